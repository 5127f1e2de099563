"""Faults on the inter-node TCP path and in the proxy (CPU only, loopback only; docs/reliability.md).

* kill -9 of a rank in the middle of the proxy's transfers (three processes joined by a SocketExchanger):
  every other rank raises a CommError naming it within the timeout + 2 s, and closes in bounded time;
* set-up: a rank whose listener or connections fail makes every rank raise naming it (no rank is left
  waiting in the set-up's exchanges); a rank that stalls in the socket rendezvous is named after its
  timeout;
* a peer that stops in the middle of a message, resets the connection in the middle of one, or stops
  reading: a CommError naming it within the timeout + 2 s, nothing half-written becomes visible;
* a stranger connecting after set-up finds nothing listening (strangers during set-up:
  tests/cpu/test_transport_security.py);
* an exception inside the proxy thread (injected into the transport's post) reaches the context:
  ``ctx.check()`` raises it as the cause, the device-side waits are told (error record), and close() is
  local.
"""
from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _threads import LO, ThreadEx, fake_rank1, run_ranks  # noqa: E402

from mkernel.errors import CommError, CommTimeout  # noqa: E402
from mkernel.proxy.transport import HostWindow, PeerBatch, SocketExchanger  # noqa: E402
from mkernel.proxy.transport import tcp as tcp_mod  # noqa: E402
from mkernel.proxy.transport.tcp import _HDR, KIND_BATCH, TcpTransport  # noqa: E402

pytestmark = pytest.mark.faults

HERE = Path(__file__).resolve().parent
T = 1.0  # the transports' timeout in the in-process tests
SLACK = 2.0
_DESC = np.dtype([("win", "<u4"), ("pad", "<u4"), ("off", "<u8"), ("n", "<u8")])


def _free_port():
    s = socket.socket()
    s.bind((LO, 0))
    p = s.getsockname()[1]
    s.close()
    return p


# ---- kill -9 mid-transfer ------------------------------------------------------------------------------

def test_kill_9_mid_transfer_every_other_rank_raises_naming_it(tmp_path):
    from _tcp_worker import TIMEOUT

    env = dict(os.environ)
    env["MKERNEL_EXCHANGE_TOKEN"] = secrets.token_hex(16)
    env.pop("MKERNEL_TCP_ADDR", None)
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "_tcp_worker.py"), str(r), "3", str(port), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for r in range(3)]
    try:
        t0 = time.monotonic()
        pid_file = tmp_path / "victim.pid"
        while not pid_file.exists():
            assert time.monotonic() - t0 < 60 and all(p.poll() is None for p in procs), "the victim never got ready"
            time.sleep(0.005)
        t_kill = time.time()
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        outs = {r: procs[r].communicate(timeout=60)[0] for r in (0, 2)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for r in (0, 2):
        f = tmp_path / f"rank{r}.json"
        assert f.exists(), outs[r][-3000:]
        res = json.loads(f.read_text())
        assert res.get("type") in ("CommError", "CommTimeout") and res["peer"] == 1 and "rank 1" in res["msg"], res
        assert res["t"] - t_kill <= TIMEOUT + SLACK, (r, res["t"] - t_kill, res)
        assert res["close_s"] <= TIMEOUT + SLACK, res  # closing after the failure is bounded too


# ---- set-up --------------------------------------------------------------------------------------------

def test_a_rank_that_cannot_listen_fails_every_rank_naming_it():
    """Rank 1's address is not this host's: it cannot listen, and says so in the address exchange."""
    def body(ex, r):
        tr = TcpTransport(ex, [HostWindow(4096)], addr="192.0.2.1" if r == 1 else LO, timeout=T)
        t0 = time.monotonic()
        try:
            tr.connect()
        except CommError as exc:
            return exc, time.monotonic() - t0
        return None, time.monotonic() - t0

    res, errs = run_ranks(2, body)
    assert errs == [None, None], errs
    (e0, dt0), (e1, dt1) = res
    assert isinstance(e1, CommError) and "cannot listen on 192.0.2.1" in str(e1)
    assert isinstance(e0, CommError) and "set-up failed on ranks [1]" in str(e0) and e0.record["peer"] == 1
    assert dt0 < T and dt1 < T  # told, not timed out


def test_a_rank_whose_connections_fail_fails_every_rank_naming_it(monkeypatch):
    real = tcp_mod.connect_peer

    def connect(addr, secret, label, my_rank, peer, timeout):
        if my_rank == 1:
            raise ConnectionRefusedError("injected: rank 1 cannot connect")
        return real(addr, secret, label, my_rank, peer, timeout)

    monkeypatch.setattr(tcp_mod, "connect_peer", connect)

    def body(ex, r):
        tr = TcpTransport(ex, [HostWindow(4096)], timeout=T)
        t0 = time.monotonic()
        try:
            tr.connect()
        except CommError as exc:
            return exc, time.monotonic() - t0
        tr.close(timeout=1)
        return None, time.monotonic() - t0

    res, errs = run_ranks(2, body)
    assert errs == [None, None], errs
    for r, (e, dt) in enumerate(res):  # rank 0 waited for rank 1 and is told why it never came
        assert isinstance(e, CommError) and "injected: rank 1 cannot connect" in str(e) and dt <= T + SLACK, (r, e, dt)
    assert "set-up failed on ranks [1]" in str(res[0][0]) and res[0][0].record["peer"] == 1


def test_a_rank_stalling_in_the_socket_rendezvous_is_named_after_the_timeout():
    port, token = _free_port(), secrets.token_hex(8)
    box = {}

    def rank1():
        ex = SocketExchanger(1, 2, LO, port, timeout=T, token=token)
        box["ex1"] = ex  # connected, then silent: never joins the allgather
        time.sleep(T + SLACK + 1)

    t = threading.Thread(target=rank1, daemon=True)
    t.start()
    ex0 = SocketExchanger(0, 2, LO, port, timeout=T, token=token)
    t0 = time.monotonic()
    with pytest.raises(CommError, match="rank 1 did not answer") as ei:
        ex0.allgather(("host", None))
    assert T - 0.1 <= time.monotonic() - t0 <= T + SLACK and ei.value.record["peer"] == 1
    ex0.close()


# ---- a peer misbehaving after set-up ------------------------------------------------------------------

def _rank0_against(fake_body, data_bytes=1 << 16):
    """Rank 0 (a TcpTransport with timeout T) and a hand-played rank 1 running ``fake_body(send_sock)``."""
    windows = [HostWindow(data_bytes), HostWindow(4096)]
    socks = []

    def body(ex, r):
        if r == 1:
            out, inc = fake_rank1(ex)
            socks.extend([out, inc])
            return None
        tr = TcpTransport(ex, windows, timeout=T)
        tr.connect()
        return tr

    res, errs = run_ranks(2, body)
    assert errs == [None, None], errs
    threading.Thread(target=fake_body, args=(socks[0],), daemon=True).start()
    return res[0], windows, socks


def _first_error(tr, within):
    t0 = time.monotonic()
    with pytest.raises(CommError) as ei:
        while time.monotonic() - t0 < within:
            tr.progress()
            time.sleep(1e-3)
    return ei.value, time.monotonic() - t0


def _half_a_message():
    hdr = _HDR.pack(KIND_BATCH, 1, 1, 0)
    recs = np.array([(0, 0, 0, 4096), (1, 0, 8, 1)], _DESC).tobytes()
    return hdr + recs + b"\xab" * 100  # 100 of the 4096 payload bytes


def test_a_peer_stalling_mid_message_is_named_within_the_timeout():
    stop = threading.Event()

    def stall(s):
        s.sendall(_half_a_message())
        stop.wait(30)  # connected and silent

    tr, windows, socks = _rank0_against(stall)
    try:
        err, dt = _first_error(tr, T + SLACK + 5)
        assert err.record["peer"] == 1 and "stopped in the middle of a message" in str(err), err
        assert dt <= T + SLACK, dt
        assert windows[1].read_u64(8) == 0  # the flag of the half-received batch never became visible
    finally:
        stop.set()
        tr.close(timeout=1)
        for s in socks:
            s.close()


def test_a_connection_reset_mid_message_is_named_at_once():
    def reset(s):
        s.sendall(_half_a_message())
        time.sleep(0.05)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # RST

    tr, windows, socks = _rank0_against(reset)
    try:
        err, dt = _first_error(tr, T + SLACK + 5)
        assert err.record["peer"] == 1 and "without saying bye" in str(err), err
        assert dt <= SLACK, dt
        assert windows[1].read_u64(8) == 0
    finally:
        tr.close(timeout=1)
        for s in socks:
            s.close()


def test_a_peer_that_stops_reading_fails_the_sender_within_the_timeout():
    stop = threading.Event()
    n = 48 << 20

    def never_read(s):
        stop.wait(30)

    tr, windows, socks = _rank0_against(never_read, data_bytes=n)
    try:
        t0 = time.monotonic()
        with pytest.raises(CommError, match="sending to rank 1 failed") as ei:
            tr.post([PeerBatch(1, [(0, 0, 0, n)], [(1, 0, 1)])])
        assert ei.value.record["peer"] == 1 and time.monotonic() - t0 <= T + SLACK
        with pytest.raises(CommError):  # and the transport stays failed
            tr.progress()
    finally:
        stop.set()
        tr.close(timeout=1)
        for s in socks:
            s.close()


def test_a_stranger_after_set_up_finds_nothing_listening():
    tables = []

    class Recording(ThreadEx):
        def allgather(self, obj):
            out = super().allgather(obj)
            if self.rank == 0:
                tables.append(out)
            return out

    def body(ex, r):
        tr = TcpTransport(Recording(ex.g, r), [HostWindow(4096)], timeout=T)
        tr.connect()
        return tr

    res, errs = run_ranks(2, body)
    assert errs == [None, None], errs
    try:
        for host, port in tables[1]:  # round 1: the listeners' addresses
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((host, port), timeout=2).close()
    finally:
        run_ranks(2, lambda ex, r: res[r].close(timeout=2))


# ---- the proxy thread ------------------------------------------------------------------------------------

def test_an_exception_in_the_proxy_thread_reaches_ctx_check(monkeypatch):
    """Inject a failure into the transport's post: the proxy thread stops, the context's error record is
    written (every device-side wait of the rank stops), ctx.check() raises a CommError whose cause is the
    injected exception, ctx.failure() says why, and close() is local."""
    from mkernel.dist import context as X
    from mkernel.dist.agreement import Agreement
    from mkernel.dist.signals import MK_ERR_PROXY, ErrorRecordView
    from mkernel.ops.collectives import internode
    from mkernel.proxy import engine
    from mkernel.proxy.transport import Exchanger, Transport
    from mkernel.proxy.transport import window as W

    class Injected(RuntimeError):
        pass

    class FaultyTransport(Transport):
        name = "faulty"

        def __init__(self, ex, windows, **kw):
            super().__init__(ex, windows)

        def connect(self):
            pass

        def post(self, batches):
            raise Injected("injected into post")

        def progress(self):
            return []

        def close(self, timeout=10.0):
            pass

    class TwoRanks(Exchanger):
        rank, size = 0, 2

        def allgather(self, obj):
            return [obj, obj]

    monkeypatch.setattr(engine, "select_transport", lambda name=None: FaultyTransport)
    monkeypatch.setattr(W, "GpuWindow", lambda ptr, nbytes: HostWindow(nbytes))
    monkeypatch.setattr(X, "cu", types.SimpleNamespace(cuCtxSynchronize=lambda: None, cuStreamDestroy=lambda s: None,
                                                        cuMemFreeHost=lambda p: None))
    monkeypatch.setattr(X, "check", lambda r: None)
    rec = ctypes.create_string_buffer(4096)
    ctx = object.__new__(X.Context)
    ctx.rank, ctx._timeout, ctx._closed, ctx._closers, ctx._checks, ctx._op_states = 0, 1.0, False, [], [], {}
    ctx._symmetric, ctx._workspaces, ctx._ws_gen, ctx._side, ctx._err_host = [], {}, 0, None, 0
    ctx._record_lock = threading.Lock()
    ctx.agreement = Agreement(0, lambda: 1.0)
    ctx.error_record = ErrorRecordView(ctypes.addressof(rec), [0, 1])
    ctx.world = TwoRanks()
    ctx.topology = types.SimpleNamespace(close=lambda: None)
    ctx.workspace = lambda key, nbytes: types.SimpleNamespace(ptr=0, nbytes=nbytes, freed=False)
    st = internode.ProxyState(ctx, "all_gather", 1 << 16)  # the real wiring: on_error, add_check, add_closer
    ctx.check()
    st.proxy.producer().push(1, 1, 0, 0, 0, 64, 0, 0, 1)  # a WRITE to rank 1: the post raises
    t0 = time.monotonic()
    while st.proxy.error is None and time.monotonic() - t0 < 5:
        time.sleep(1e-3)
    with pytest.raises(CommError) as ei:
        ctx.check()
    assert isinstance(ei.value.__cause__, Injected), ei.value
    assert ctx.error_record.code == MK_ERR_PROXY  # the device-side waits of this rank stop
    assert "injected into post" in ctx.failure()
    t0 = time.monotonic()
    ctx.close()
    assert time.monotonic() - t0 < 0.5 + 2.0 and st.closed  # (the proxy thread had stopped already)


def test_a_failed_proxy_set_up_fails_the_context(monkeypatch):
    """A proxy whose set-up fails (here: a bounded exchange timing out) leaves MPI requests behind: the
    context is failed from then on (check raises the cause, close is local)."""
    import mkernel.proxy as P
    from mkernel.dist import context as X
    from mkernel.dist.agreement import Agreement
    from mkernel.dist.signals import ErrorRecordView
    from mkernel.ops.collectives import internode
    from mkernel.proxy.transport import window as W

    def failing_proxy(*a, **k):
        raise CommTimeout("rank 0 waited 4.0 s for the other ranks to join inter-node transport set-up")

    monkeypatch.setattr(W, "GpuWindow", lambda ptr, nbytes: HostWindow(nbytes))
    monkeypatch.setattr(P, "Proxy", failing_proxy)
    rec = ctypes.create_string_buffer(4096)
    ctx = object.__new__(X.Context)
    ctx.rank, ctx._timeout, ctx._closed, ctx._closers, ctx._checks = 0, 1.0, False, [], []
    ctx._record_lock = threading.Lock()
    ctx.agreement = Agreement(0, lambda: 1.0)
    ctx.error_record = ErrorRecordView(ctypes.addressof(rec), [0])
    ctx.world = object()
    ctx.workspace = lambda key, nbytes: types.SimpleNamespace(ptr=0, nbytes=nbytes)
    with pytest.raises(CommTimeout):
        internode.ProxyState(ctx, "all_gather", 4096)
    with pytest.raises(CommTimeout, match="inter-node transport set-up"):
        ctx.check()
    assert ctx.failure() is not None
