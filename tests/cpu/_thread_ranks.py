"""Ranks as threads of this process, for transport tests: an allgather through two barriers, delivering what a
SocketExchanger delivers (plain values through encode / decode)."""
from __future__ import annotations

import threading

from mkernel.proxy.transport import Exchanger
from mkernel.proxy.transport.exchange import decode, encode


class Group:
    """``size`` thread ranks; ``hook(round, table)`` runs once per allgather after every rank contributed and
    before any returns."""

    def __init__(self, size, hook=None, timeout=60):
        self.size, self.hook, self.round = size, hook, 0
        self.slots = [None] * size
        self.result = None
        self.b1 = threading.Barrier(size, action=self._gathered, timeout=timeout)
        self.b2 = threading.Barrier(size, timeout=timeout)

    def _gathered(self):
        self.result = [decode(encode(v)) for v in self.slots]
        if self.hook is not None:
            self.hook(self.round, self.result)
        self.round += 1


class ThreadEx(Exchanger):
    def __init__(self, group, rank):
        self.g, self.rank, self.size = group, rank, group.size

    def allgather(self, obj):
        self.g.slots[self.rank] = obj
        self.g.b1.wait()
        out = list(self.g.result)
        self.g.b2.wait()
        return out


def run_ranks(size, body, *, hook=None, timeout=60, abort_on_error=False):
    """``body(exchanger, rank)`` per rank on ``size`` threads; returns (results, errors); asserts no rank hung.
    ``abort_on_error``: a rank that raises breaks the others' barriers (they raise too, instead of waiting)."""
    group = Group(size, hook, timeout)
    results, errors = [None] * size, [None] * size

    def run(r):
        try:
            results[r] = body(ThreadEx(group, r), r)
        except BaseException as exc:  # noqa: BLE001
            errors[r] = exc
            if abort_on_error:
                group.b1.abort()
                group.b2.abort()

    ts = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    assert not any(t.is_alive() for t in ts), "a rank hung"
    return results, errors
