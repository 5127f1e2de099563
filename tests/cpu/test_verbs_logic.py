"""The verbs transport's own logic on the CPU, against a fake pyverbs (tests/cpu/_fake_pyverbs.py:
a software NIC that executes requests late and checks what a real one would).  The real RC queue
pairs are tested in the soft-RoCE VM (tests/rdma/test_verbs.py).

* staging slots (notices, flag values) are recycled only after their request completed: the NIC
  never reads a slot that was rewritten after the post, with 400 notices and a slow NIC;
* notices are credit-controlled: a receiver that stops receiving for a while never runs out of
  posted receives (no RNR), and an RNR failure is a CommError naming the receiver;
* only memory peers write is registered remote-writable; the RNR and transport retry counts are
  below 7 (7 is "forever" for RNR everywhere, and for transport retries on rdma_rxe);
* a malformed notice is a CommError naming the peer;
* a peer's QP forced into the error state, or its window deregistered, mid-stream: the proxy fails
  with a CommError naming that peer within its timeout, and both ranks close promptly (the same
  scenarios run over real RC QPs in the soft-RoCE VM).
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import _fake_pyverbs as FV
from _thread_ranks import Group, ThreadEx
from mkernel.errors import CommError
from mkernel.proxy.transport import HostWindow, PeerBatch
from mkernel.proxy.transport import verbs as V

DATA, FLAGS, NSLOT = 64 << 10, 4096, 32


def _in_threads(fns, timeout=60):
    out, errs = [None] * len(fns), [None] * len(fns)

    def run(i):
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001
            errs[i] = exc

    ts = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    assert not any(t.is_alive() for t in ts), "a rank hung"
    for e in errs:
        if e is not None:
            raise e
    return out


@pytest.fixture
def fabric(monkeypatch):
    fab = FV.install(monkeypatch)
    monkeypatch.setattr(V, "list_ports", lambda *a, **k: [
        {"name": "fake0", "port": 1, "state": "ACTIVE", "link_layer": "Ethernet", "numa": -1, "pci": ""}])
    return fab


def _pair(notify, timeout=20.0):
    g = Group(2)
    wins = [[HostWindow(DATA), HostWindow(FLAGS)] for _ in range(2)]

    def mk(r):
        t = V.VerbsTransport(ThreadEx(g, r), wins[r], device="fake0", port=1, gid_index=0, notify=notify,
                             timeout=timeout)
        t.connect()
        return t

    return _in_threads([lambda: mk(0), lambda: mk(1)]), wins


def _pattern(i):
    return ((np.arange(64) * 7 + i * 13) & 0xFF).astype(np.uint8)


def _stream(fabric, notify, n=400, receiver_starts_after=0.0):
    """Rank 0 posts n batches (a 64-byte range + a flag each) to rank 1, which checks "flag visible
    => data complete" whenever it looks, then both close."""
    (t0, t1), (w0, w1) = _pair(notify)
    for i in range(n):
        w0[0].array[64 * i:64 * i + 64] = _pattern(i)
    done = threading.Event()

    def receiver():
        time.sleep(receiver_starts_after)
        deadline = time.monotonic() + 30
        while True:
            t1.progress()
            f = w1[1].array[:8 * NSLOT].view(np.uint64)
            for v in f[f > 0].tolist():
                i = v - 1
                assert np.array_equal(w1[0].array[64 * i:64 * i + 64], _pattern(i)), f"flag {v} before its data"
            if (f == [max(i for i in range(n) if i % NSLOT == j) + 1 for j in range(NSLOT)]).all() and done.is_set():
                break
            assert time.monotonic() < deadline, f"flags stuck at {f.tolist()}"
            time.sleep(1e-4)
        t1.close(timeout=10)
        return t1.error

    def sender():
        tokens = [t0.post([PeerBatch(1, [(0, 64 * i, 64 * i, 64)], [(1, 8 * (i % NSLOT), i + 1)])])
                  for i in range(n)]
        got, deadline = set(), time.monotonic() + 30
        while len(got) < len(tokens):
            got.update(t0.progress())
            assert time.monotonic() < deadline
            time.sleep(1e-4)
        done.set()
        t0.close(timeout=10)
        return t0.error

    assert _in_threads([sender, receiver]) == [None, None]
    assert np.array_equal(w1[0].array[:64 * n].reshape(n, 64), np.stack([_pattern(i) for i in range(n)]))
    assert fabric.stale == [], fabric.stale[:3]
    return t0, t1


def test_send_notices_slow_nic_never_reads_a_recycled_slot(fabric):
    fabric.per_run = 2
    t0, _ = _stream(fabric, "send")
    assert fabric.rnr_events == 0
    assert t0._notes_sent[1] >= 400  # every batch's flag went as a notice


def test_write_flags_without_inline_slow_nic(fabric):
    fabric.per_run, fabric.no_inline = 3, True
    t0, _ = _stream(fabric, "write")
    assert not t0.inline


def test_credits_keep_a_paused_receiver_from_running_dry(fabric):
    """The receiver does not look at its completions for a while: the sender stops at the receives
    it has credit for instead of overrunning them (each would be an RNR)."""
    fabric.per_run = 64
    _stream(fabric, "send", n=300, receiver_starts_after=0.5)
    assert fabric.rnr_events == 0


def test_only_memory_peers_write_is_remote_writable(fabric):
    (t0, t1), (w0, _) = _pair("send")
    remote = {mr.address for mr in fabric.mrs if mr.access & FV.IBV_ACCESS_REMOTE_WRITE and mr.fabric is fabric
              and mr.address in (w0[0].ptr, w0[1].ptr, t0.credit_buf.ctypes.data, t0.flag_buf.ctypes.data,
                                 t0.note_buf.ctypes.data, t0.recv_buf.ctypes.data)}
    assert remote == {w0[0].ptr, w0[1].ptr, t0.credit_buf.ctypes.data}
    for qp in t0.qps.values():
        assert qp.rts_attr.rnr_retry == V._RNR_RETRY < 7 and qp.rts_attr.retry_cnt == V._RETRY_CNT < 7
    _in_threads([lambda: t0.close(timeout=5), lambda: t1.close(timeout=5)])


def test_rnr_is_a_comm_error_naming_the_receiver(fabric):
    (t0, t1), _ = _pair("send", timeout=5.0)
    peer_qp = fabric.qps[t0.remote[1]["qpn"][0]]
    peer_qp.rq.clear()  # rank 1 has no receive posted for rank 0 (its proxy stopped re-posting)
    t0.post([PeerBatch(1, [], [(1, 0, 1)])])
    with pytest.raises(CommError, match="receiver not ready") as ei:
        for _ in range(100):
            t0.progress()
    assert ei.value.record["peer"] == 1 and "rank 1" in str(ei.value)


@pytest.mark.parametrize("payload", [
    V._NOTE_HDR.pack(9, 0, 0, 0),                                   # unknown kind
    V._NOTE_HDR.pack(1, 0, V._MAX_REC + 1, 0),                      # more records than a notice holds
    V._NOTE_HDR.pack(1, 0, 1, 0) + np.array([(7, 0, 0, 1)], V._NOTE_REC).tobytes(),         # window 7
    V._NOTE_HDR.pack(1, 0, 1, 0) + np.array([(1, 0, FLAGS, 1)], V._NOTE_REC).tobytes(),     # beyond
    V._NOTE_HDR.pack(1, 1, 0, 0) + np.array([(0, 0, 0, 64)], V._NOTE_REC).tobytes(),        # no bounce
    V._NOTE_HDR.pack(1, 0, 2, 0) + np.array([(1, 0, 0, 1)], V._NOTE_REC).tobytes(),         # truncated
], ids=["kind", "count", "window", "range", "bounce", "short"])
def test_malformed_notice_is_a_comm_error(fabric, payload):
    (t0, t1), (_, w1) = _pair("send", timeout=5.0)
    t0._post_chain(1, [("note", payload)], None)
    with pytest.raises(CommError, match="rank 0") as ei:
        for _ in range(100):
            t0.progress()
            t1.progress()
    assert ei.value.record["peer"] == 0
    assert not w1[0].array.any() and not w1[1].array.any()


@pytest.mark.parametrize("notify", ["write", "send"])
def test_proxy_scenarios_over_the_fake_nic(fabric, notify, monkeypatch):
    """The multi-process proxy scenarios (tests/cpu/test_proxy_scenarios.py), two ranks as threads,
    over the verbs transport and the fake NIC: ordering, batching, backpressure, barrier, close."""
    import test_proxy_scenarios as S

    monkeypatch.setattr(S, "DATA_BYTES", 4 << 20)
    monkeypatch.setattr(S, "SMALL", True)
    fabric.per_run = 16
    g = Group(2)
    opts = {"device": "fake0", "port": 1, "gid_index": 0, "notify": notify}
    names = ["shutdown", "many", "large", "backpressure", "flag_batching", "ordering", "barrier"]

    def rank(r):
        env = S.Env(ThreadEx(g, r), V.VerbsTransport, opts)
        for name in names:
            S.SCENARIOS[name](env)
            env.ex.barrier()
        return True

    assert _in_threads([lambda: rank(0), lambda: rank(1)], timeout=240) == [True, True]
    assert fabric.stale == [] and fabric.rnr_events == 0


@pytest.mark.parametrize("scenario", ["verbs_peer_qp_error", "verbs_peer_mr_gone"])
@pytest.mark.parametrize("notify", ["write", "send"])
def test_peer_fault_mid_stream_is_a_comm_error_naming_the_peer(fabric, notify, scenario, monkeypatch):
    import test_proxy_scenarios as S

    monkeypatch.setattr(S, "DATA_BYTES", 1 << 20)
    g = Group(2)
    opts = {"device": "fake0", "port": 1, "gid_index": 0, "notify": notify}

    def rank(r):
        S.SCENARIOS[scenario](S.Env(ThreadEx(g, r), V.VerbsTransport, opts))
        return True

    assert _in_threads([lambda: rank(0), lambda: rank(1)], timeout=60) == [True, True]
