"""Strangers on the set-up sockets (CPU only, loopback only).

* the authenticated handshake (mkernel/proxy/transport/auth.py): wrong MAC, no secret, duplicate,
  out-of-range and own ranks are refused, a silent connection does not block the others, and a
  listener that does not know the secret is refused by the connector;
* the TCP transport: strangers that reach a rank's listener before the real peer do not get in,
  and the two ranks (threads) still move their data; a malformed message after a valid handshake
  (oversized record counts, bad window, range beyond the window, unaligned flag, bad kind) is a
  CommError naming the peer;
* the SocketExchanger: no pickle (a crafted payload never runs), oversized length refused, wrong
  token refused, plain values round-trip exactly, no default port.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import secrets
import socket
import struct
import threading
import time

import numpy as np
import pytest

from _thread_ranks import run_ranks

from mkernel.errors import CommError
from mkernel.proxy.transport import HostWindow, PeerBatch, SocketExchanger
from mkernel.proxy.transport import auth
from mkernel.proxy.transport.exchange import MAX_MESSAGE, decode, encode
from mkernel.proxy.transport.tcp import _HDR, KIND_BATCH, MAX_RECORDS, TcpTransport

LO = "127.0.0.1"
TCP_LABEL = b"mkernel-tcp-1"


def _free_port():
    s = socket.socket()
    s.bind((LO, 0))
    p = s.getsockname()[1]
    s.close()
    return p


def _mac(secret, label, side, nonce_l, nonce_c, rc, rl):
    msg = label + side + nonce_l + nonce_c + struct.pack("<i", rc) + struct.pack("<i", rl)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def _answer(sock, claim_rank, secret, label, listener_rank, garbage=False):
    """The connector's half of the handshake on a connected socket; True if the listener let us in
    (sent back its MAC), False if it closed the connection."""
    try:
        nonce_l = b""
        while len(nonce_l) < 32:
            chunk = sock.recv(32 - len(nonce_l))
            if not chunk:
                return False
            nonce_l += chunk
        nonce_c = secrets.token_bytes(32)
        if garbage:
            sock.sendall(secrets.token_bytes(4 + 32 + 32))
        else:
            sock.sendall(struct.pack("<i", claim_rank) + nonce_c
                         + _mac(secret, label, b"C", nonce_l, nonce_c, claim_rank, listener_rank))
        return len(sock.recv(32)) == 32
    except OSError:
        return False
    finally:
        sock.close()


# ---- the handshake ----------------------------------------------------------------------------------

def _listener():
    srv = socket.create_server((LO, 0))
    return srv, srv.getsockname()


def _accept_in_thread(srv, secret, expected, timeout=10.0):
    box = {}

    def run():
        try:
            box["peers"] = auth.accept_peers(srv, secret, TCP_LABEL, 0, expected, time.monotonic() + timeout, "test")
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_handshake_refuses_strangers_duplicates_and_out_of_range():
    secret = auth.new_secret()
    srv, addr = _listener()
    t, box = _accept_in_thread(srv, secret, [1, 2])
    try:
        silent = socket.create_connection(addr)  # stalls: must not block the others
        assert not _answer(socket.create_connection(addr), 1, secret, TCP_LABEL, 0, garbage=True)   # no secret
        assert not _answer(socket.create_connection(addr), 1, b"x" * 32, TCP_LABEL, 0)              # wrong MAC
        assert not _answer(socket.create_connection(addr), 1, secret, b"mkernel-exchange-1", 0)     # other protocol
        assert not _answer(socket.create_connection(addr), 7, secret, TCP_LABEL, 0)                 # out of range
        assert not _answer(socket.create_connection(addr), -1, secret, TCP_LABEL, 0)                # out of range
        assert not _answer(socket.create_connection(addr), 0, secret, TCP_LABEL, 0)                 # the listener itself
        one = auth.connect_peer(addr, secret, TCP_LABEL, 1, 0, 10.0)
        assert not _answer(socket.create_connection(addr), 1, secret, TCP_LABEL, 0)                 # duplicate
        two = auth.connect_peer(addr, secret, TCP_LABEL, 2, 0, 10.0)
        t.join(15)
        assert "error" not in box, box.get("error")
        assert sorted(box["peers"]) == [1, 2]
        silent.settimeout(5)
        got = b""
        while chunk := silent.recv(64):  # the listener sent its nonce, then closed the connection
            got += chunk
        assert len(got) == 32
        # the accepted sockets are connected to the right peers
        box["peers"][1].sendall(b"to-one")
        assert one.recv(6) == b"to-one"
        box["peers"][2].sendall(b"to-two")
        assert two.recv(6) == b"to-two"
        for s in (one, two, silent, *box["peers"].values()):
            s.close()
    finally:
        srv.close()


def test_handshake_times_out_naming_the_missing_rank():
    secret = auth.new_secret()
    srv, addr = _listener()
    t, box = _accept_in_thread(srv, secret, [1], timeout=1.0)
    assert not _answer(socket.create_connection(addr), 1, b"y" * 32, TCP_LABEL, 0)
    t.join(10)
    srv.close()
    err = box.get("error")
    assert isinstance(err, CommError) and "[1]" in str(err) and "wrong MAC" in str(err), err


def test_connector_refuses_a_listener_without_the_secret():
    srv, addr = _listener()

    def fake():
        c, _ = srv.accept()
        c.sendall(secrets.token_bytes(32))
        c.recv(68)
        c.sendall(secrets.token_bytes(32))  # a MAC it cannot compute
        time.sleep(0.5)
        c.close()

    t = threading.Thread(target=fake, daemon=True)
    t.start()
    with pytest.raises(CommError, match="failed to authenticate"):
        auth.connect_peer(addr, auth.new_secret(), TCP_LABEL, 1, 0, 10.0)
    t.join(5)
    srv.close()


# ---- TCP transport ------------------------------------------------------------------------------------

DATA, FLAGS = 1 << 16, 4096


def _run_ranks(size, hook, body, timeout=60):
    results, errors = run_ranks(size, body, hook=hook, timeout=timeout, abort_on_error=True)
    for e in errors:
        if e is not None:
            raise e
    return results


def _exchange_data(ex, r):
    """Both ranks write a pattern into each other's data window, raise a flag, check what arrived."""
    data, flags = HostWindow(DATA), HostWindow(FLAGS)
    tr = TcpTransport(ex, [data, flags], timeout=20.0)
    tr.connect()
    try:
        peer = 1 - r
        src = ((np.arange(DATA // 2) * 7 + r * 31) & 0xFF).astype(np.uint8)
        data.array[:DATA // 2] = src
        tr.post([PeerBatch(peer, [(0, 0, DATA // 2, DATA // 2)], [(1, 8 * r, 5)])])
        t0 = time.monotonic()
        while flags.read_u64(8 * peer) < 5:
            tr.progress()
            assert time.monotonic() - t0 < 20, "flag never arrived"
            time.sleep(1e-3)
        want = ((np.arange(DATA // 2) * 7 + peer * 31) & 0xFF).astype(np.uint8)
        assert np.array_equal(data.array[DATA // 2:], want)
        ex.barrier()
    finally:
        tr.close(timeout=10)
    assert tr.error is None, tr.error
    return True


def test_tcp_strangers_first_are_refused_and_the_job_completes():
    outcomes = {}
    stranger_threads = []

    def hook(rnd, table):
        if rnd != 1:  # round 0: host names + secret; round 1: the listeners' addresses
            return
        for victim in (0, 1):
            addr = tuple(table[victim])
            other = 1 - victim
            cases = {
                "no secret": dict(claim_rank=other, secret=b"\0" * 32, garbage=True),
                "wrong MAC": dict(claim_rank=other, secret=secrets.token_bytes(32)),
                "the real peer's rank, another secret": dict(claim_rank=other, secret=b"k" * 32),
                "out of range": dict(claim_rank=5, secret=b"k" * 32),
                "claims the listener's rank": dict(claim_rank=victim, secret=b"k" * 32),
            }
            # connect now, synchronously: these connections queue ahead of the real peer's
            for name, kw in cases.items():
                s = socket.create_connection(addr, timeout=10)

                def go(s=s, name=name, kw=kw, victim=victim):
                    outcomes[(victim, name)] = _answer(s, kw["claim_rank"], kw["secret"], TCP_LABEL, victim,
                                                       garbage=kw.get("garbage", False))

                t = threading.Thread(target=go, daemon=True)
                t.start()
                stranger_threads.append(t)
            silent = socket.create_connection(addr, timeout=10)
            stranger_threads.append(silent)

    assert _run_ranks(2, hook, _exchange_data) == [True, True]
    for t in stranger_threads:
        if isinstance(t, threading.Thread):
            t.join(10)
        else:
            t.close()
    assert len(outcomes) == 10
    assert not any(outcomes.values()), f"a stranger got in: {outcomes}"


def test_tcp_stranger_with_a_valid_secret_for_an_out_of_range_rank_is_refused():
    """Even knowing the job secret, a connection for a rank outside the job is refused."""
    outcomes = {}
    box = {}

    def hook(rnd, table):
        if rnd == 0:
            box["secret"] = table[0][1]
        elif rnd == 1:
            for claim in (2, 9, -3):
                s = socket.create_connection(tuple(table[0]), timeout=10)
                t = threading.Thread(target=lambda s=s, c=claim: outcomes.__setitem__(
                    c, _answer(s, c, box["secret"], TCP_LABEL, 0)), daemon=True)
                t.start()
                box.setdefault("threads", []).append(t)

    assert _run_ranks(2, hook, _exchange_data) == [True, True]
    for t in box["threads"]:
        t.join(10)
    assert outcomes == {2: False, 9: False, -3: False}


def _fake_rank1(ex, send_after_setup):
    """Rank 1 of a 2-rank TCP job, by hand: valid handshakes, then ``send_after_setup(sock)``."""
    hello = ex.allgather((socket.gethostname(), None))
    secret = hello[0][1]
    srv = socket.create_server((LO, 0))
    table = ex.allgather((LO, srv.getsockname()[1]))
    t, box = None, {}

    def acc():
        box["peers"] = auth.accept_peers(srv, secret, TCP_LABEL, 1, [0], time.monotonic() + 20, "fake")

    t = threading.Thread(target=acc, daemon=True)
    t.start()
    out = auth.connect_peer(tuple(table[0]), secret, TCP_LABEL, 1, 0, 20.0)
    t.join(20)
    srv.close()
    ex.barrier()
    send_after_setup(out)
    return out, box["peers"][0]


_DESC = np.dtype([("win", "<u4"), ("pad", "<u4"), ("off", "<u8"), ("n", "<u8")])


def _records(*recs):
    return np.array(list(recs), _DESC).tobytes()


MALFORMED = {
    "oversized counts": _HDR.pack(KIND_BATCH, 0xFFFFFFFF, 0xFFFFFFFF, 0),
    "just over the record limit": _HDR.pack(KIND_BATCH, MAX_RECORDS, 1, 0),
    "bad kind": _HDR.pack(7, 0, 0, 0),
    "reserved field": _HDR.pack(KIND_BATCH, 0, 0, 1),
    "window index": _HDR.pack(KIND_BATCH, 1, 0, 0) + _records((9, 0, 0, 8)),
    "range beyond the window": _HDR.pack(KIND_BATCH, 1, 0, 0) + _records((0, 0, DATA - 8, 16)),
    "huge range (u64 wrap)": _HDR.pack(KIND_BATCH, 1, 0, 0) + _records((0, 0, 2**64 - 8, 16)),
    "flag beyond the window": _HDR.pack(KIND_BATCH, 0, 1, 0) + _records((1, 0, FLAGS, 1)),
    "unaligned flag": _HDR.pack(KIND_BATCH, 0, 1, 0) + _records((1, 0, 4, 1)),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_tcp_malformed_message_after_a_valid_handshake_is_a_comm_error(case):
    windows = [HostWindow(DATA), HostWindow(FLAGS)]
    socks = []

    def body(ex, r):
        if r == 1:
            socks.extend(_fake_rank1(ex, lambda s: s.sendall(MALFORMED[case])))
            return None
        tr = TcpTransport(ex, windows, timeout=20.0)
        tr.connect()
        return tr

    tr, _ = _run_ranks(2, None, body)
    try:
        t0 = time.monotonic()
        with pytest.raises(CommError) as ei:
            while time.monotonic() - t0 < 20:
                tr.progress()
                time.sleep(1e-3)
        assert ei.value.record.get("peer") == 1 and "rank 1" in str(ei.value), ei.value
        assert "malformed" in str(ei.value), ei.value
        assert not windows[0].array.any() and not windows[1].array.any()  # nothing was written
    finally:
        tr.close(timeout=1)
        for s in socks:
            s.close()


def test_tcp_large_batches_are_split_and_still_ordered():
    """A batch with more records than one message may hold arrives whole, flags after the data."""
    n = MAX_RECORDS + 100

    def body(ex, r):
        data, flags = HostWindow(4 * n * 2), HostWindow(FLAGS)
        tr = TcpTransport(ex, [data, flags], timeout=20.0)
        tr.connect()
        try:
            if r == 0:
                data.array[:4 * n] = (np.arange(4 * n) & 0xFF).astype(np.uint8)
                # every range separate (stride 8), so nothing merges; many flags too
                tr.post([PeerBatch(1, [(0, 4 * i, 8 * i, 4) for i in range(n)],
                                   [(1, 8 * j, 3) for j in range(MAX_RECORDS // 8)])])
            else:
                t0 = time.monotonic()
                while flags.read_u64(8 * (MAX_RECORDS // 8 - 1)) < 3:
                    tr.progress()
                    assert time.monotonic() - t0 < 20
                    time.sleep(1e-3)
                got = data.array.reshape(n, 8)[:, :4].reshape(-1)
                assert np.array_equal(got, (np.arange(4 * n) & 0xFF).astype(np.uint8))
            ex.barrier()
        finally:
            tr.close(timeout=10)
        assert tr.error is None, tr.error
        return True

    assert _run_ranks(2, None, body) == [True, True]


def test_tcp_refuses_a_wildcard_address():
    def body(ex, r):
        tr = TcpTransport(ex, [HostWindow(64)], addr="0.0.0.0", timeout=5.0)
        with pytest.raises(CommError, match="wildcard"):
            tr.connect()
        return True

    assert _run_ranks(1, None, body) == [True]


# ---- SocketExchanger ----------------------------------------------------------------------------

def test_exchange_encoding_round_trips_what_the_transports_send():
    verbs_info = {"qpn": {1: 17, 2: 18}, "psn": {1: 5, 2: 6}, "lid": 0, "gid": "fe80:0000:0000:0000:0000:0000:0000:0001",
                  "mtu": 5, "notify": "write", "win": [(4096, 0x1234, 1 << 20), (0, 77, 64)]}
    values = [None, "host-a", ("10.0.0.1", 40000), ("host", secrets.token_bytes(32)), ("error", "boom"),
              verbs_info, [1, 2.5, True, False, [], {}, ()], {"nested": {("a", 1): [b"", b"\xff"]}},
              np.int64(3)]
    for v in values:
        got = decode(encode(v))
        assert got == (int(v) if isinstance(v, np.integer) else v)
        assert type(got) is (int if isinstance(v, np.integer) else type(v))
    got = decode(encode(verbs_info))
    assert type(got["win"][0]) is tuple and list(got["qpn"]) == [1, 2]
    with pytest.raises(TypeError):
        encode(object())
    with pytest.raises(ValueError):
        encode(float("nan"))
    for bad in (b"\x80\x04K\x01.", b'{"x": 1}', b'{"b": "***"}', b'NaN', b"[" * 100000, b'{"d": [[[1], 2]]}'):
        with pytest.raises(ValueError):
            decode(bad)


def test_exchange_needs_an_explicit_port_and_a_token(monkeypatch):
    monkeypatch.delenv("MKERNEL_EXCHANGE_PORT", raising=False)
    monkeypatch.delenv("MKERNEL_EXCHANGE_TOKEN", raising=False)
    with pytest.raises(ValueError, match="port"):
        SocketExchanger(0, 2, LO, token="t")
    with pytest.raises(ValueError, match="token"):
        SocketExchanger(0, 2, LO, 12345)


def _exchanger_in_thread(rank, size, port, token, timeout=10.0):
    box = {}

    def run():
        try:
            box["ex"] = SocketExchanger(rank, size, LO, port, timeout=timeout, token=token)
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_exchange_round_trip_with_env_port_and_token(monkeypatch):
    port = _free_port()
    monkeypatch.setenv("MKERNEL_EXCHANGE_PORT", str(port))
    monkeypatch.setenv("MKERNEL_EXCHANGE_TOKEN", "s3cret")
    t, box = _exchanger_in_thread(0, 2, None, None)
    ex1 = SocketExchanger(1, 2, LO, timeout=10)
    t.join(10)
    ex0 = box["ex"]
    res = {}
    th = threading.Thread(target=lambda: res.__setitem__(0, ex0.allgather(("127.0.0.1", 5, b"\x01"))))
    th.start()
    res[1] = ex1.allgather({"qpn": {0: 3}})
    th.join(10)
    assert res[0] == res[1] == [("127.0.0.1", 5, b"\x01"), {"qpn": {0: 3}}]
    ex0.close(), ex1.close()


def _framed(payload: bytes) -> bytes:
    return struct.pack("<Q", len(payload)) + payload


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_exchange_never_unpickles(tmp_path):
    marker = str(tmp_path / "pwned")
    evil = pickle.dumps(_Evil(marker))
    assert not os.path.exists(marker)
    # (a) a stranger without the token sends the pickle as its "hello"
    port = _free_port()
    t, box = _exchanger_in_thread(0, 2, port, "tok", timeout=1.5)
    time.sleep(0.2)
    s = socket.create_connection((LO, port), timeout=5)
    s.recv(32)
    s.sendall(_framed(evil))
    t.join(10)
    s.close()
    assert isinstance(box.get("error"), CommError), box
    assert not os.path.exists(marker)
    # (b) a rank with the token sends the pickle as its allgather contribution
    port = _free_port()
    t, box = _exchanger_in_thread(0, 2, port, "tok")
    ex1 = SocketExchanger(1, 2, LO, port, timeout=10, token="tok")
    t.join(10)
    ex1._peers[0].sendall(_framed(evil))
    with pytest.raises(CommError, match="malformed"):
        box["ex"].allgather(None)
    assert not os.path.exists(marker)
    ex1.close(), box["ex"].close()


def test_exchange_refuses_an_oversized_message():
    port = _free_port()
    t, box = _exchanger_in_thread(0, 2, port, b"tok")
    ex1 = SocketExchanger(1, 2, LO, port, timeout=10, token=b"tok")
    t.join(10)
    ex1._peers[0].sendall(struct.pack("<Q", 1 << 40))
    with pytest.raises(CommError, match="limit"):
        box["ex"].allgather(None)
    with pytest.raises(ValueError, match="limit"):
        ex1.allgather(b"\0" * MAX_MESSAGE)
    ex1.close(), box["ex"].close()


def test_exchange_refuses_a_wrong_token():
    port = _free_port()
    t, box = _exchanger_in_thread(0, 2, port, "right", timeout=1.5)
    with pytest.raises((ConnectionError, CommError)):
        SocketExchanger(1, 2, LO, port, timeout=1.5, token="wrong")
    t.join(10)
    err = box.get("error")
    assert isinstance(err, CommError) and "wrong MAC" in str(err), err
