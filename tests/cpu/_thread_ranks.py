"""Ranks as threads of this process, for transport tests: an allgather through two barriers, delivering what a
SocketExchanger delivers (plain values through encode / decode)."""
from __future__ import annotations

import threading

from _fake_mpi import run_ranks as fake_mpi_run_ranks
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

    def abort(r):
        group.b1.abort()
        group.b2.abort()
    return fake_mpi_run_ranks(size, lambda r: body(ThreadEx(group, r), r), timeout,
                              on_error=abort if abort_on_error else None)
