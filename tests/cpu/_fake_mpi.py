"""A fake mpi4py communicator for ranks run as threads of one process (CPU tests of the bounded host waits).

``FakeWorld(size)`` is the shared state; ``world.comm(rank)`` the communicator one thread uses.  The
non-blocking collectives the library posts (``Ibarrier``, ``Iallgather``, ``Iallgatherv``, ``Idup``) are
matched by their position in each rank's sequence of collectives on that communicator, as MPI matches
them; a request completes once every rank posted the same position.  Faults:

* a rank that never calls (dead or stalled) leaves the others' requests incomplete forever;
* ``world.fail_tests = True``: every ``Test`` raises (an MPI that reports a failed peer);
* ``world.never = True``: no request ever completes.
"""
from __future__ import annotations

import itertools
import threading

import numpy as np

_ids = itertools.count(1)


class FakeMpiError(Exception):
    """What an MPI that detects a failed peer raises from Test."""


class FakeWorld:
    def __init__(self, size: int):
        self.size = size
        self.lock = threading.Lock()
        self.posts: dict = {}  # (comm id, seq) -> {rank: payload}
        self.fail_tests = False
        self.never = False
        self.id = next(_ids)

    def comm(self, rank: int) -> "FakeComm":
        return FakeComm(self, rank, self.id)


class FakeRequest:
    def __init__(self, world, key, rank, finish):
        self.world, self.key, self.rank, self.finish = world, key, rank, finish
        self.done = False

    def Test(self):
        w = self.world
        if w.fail_tests:
            raise FakeMpiError("MPIX_ERR_PROC_FAILED: a peer failed")
        if self.done:
            return True
        if w.never:
            return False
        with w.lock:
            got = w.posts.get(self.key, {})
            if len(got) < w.size:
                return False
            payloads = [got[r] for r in range(w.size)]
        self.finish(payloads)
        self.done = True
        return True


class FakeComm:
    def __init__(self, world: FakeWorld, rank: int, cid: int):
        self.world, self.rank, self.cid = world, rank, cid
        self.seq = 0
        self.calls: list = []

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.world.size

    def _post(self, kind, payload, finish):
        key = (self.cid, self.seq, kind)
        self.seq += 1
        self.calls.append(kind)
        with self.world.lock:
            self.world.posts.setdefault(key, {})[self.rank] = payload
        return FakeRequest(self.world, key, self.rank, finish)

    def Ibarrier(self):
        return self._post("barrier", None, lambda p: None)

    def Iallgather(self, send, recv):
        send = np.array(send, copy=True)

        def finish(payloads):
            recv[...] = np.stack(payloads).reshape(recv.shape)
        return self._post("allgather", send, finish)

    def Iallgatherv(self, send, spec):
        buf, (counts, displs) = spec
        data = bytes(np.asarray(send, dtype=np.uint8))

        def finish(payloads):
            for p, c, d in zip(payloads, counts, displs):
                assert len(p) == c
                buf[d:d + c] = np.frombuffer(p, dtype=np.uint8)
        return self._post("allgatherv", data, finish)

    def Idup(self):
        new = FakeComm(self.world, self.rank, (self.cid, self.seq))
        return new, self._post("dup", None, lambda p: None)

    def allgather(self, obj):  # a blocking collective: the library must never call one
        raise AssertionError("blocking allgather called")

    def Barrier(self):
        raise AssertionError("blocking Barrier called")


def run_ranks(size: int, body, timeout: float = 60.0, on_error=None):
    """``body(rank)`` on ``size`` threads; returns (results, errors) per rank; asserts none hung.
    ``on_error(rank)``: called in a rank's thread after its body raised."""
    results, errors = [None] * size, [None] * size

    def run(r):
        try:
            results[r] = body(r)
        except BaseException as exc:  # noqa: BLE001
            errors[r] = exc
            if on_error is not None:
                on_error(r)

    ts = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    assert not any(t.is_alive() for t in ts), "a rank hung"
    return results, errors
