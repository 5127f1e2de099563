"""Fork/join of a caller's stream onto a side stream, for work handed to the copy engines."""
from __future__ import annotations

from cuda.bindings import driver as cu

from ..core.driver import check
from ..core.streams import Events, copy_async

__all__ = ["ForkedCopies"]


class ForkedCopies:
    """Copies forked from a caller's stream onto a side stream and joined back to it (the copy-engine
    paths of the collectives and AllGather+GEMM).  ``fork(s, begin)``: the side stream starts after
    ``s``'s work so far, first ``begin(side)`` (work enqueued on the side stream: a launch, or a stream
    wait for a word the caller's kernel raises), then the copies of ``copies(list)`` in order
    (a flag copied after its data lands after it).  ``resume(s)``: later copies start after ``s``'s work
    so far too.  ``join(s)``: ``s`` waits for the side stream.  Inside a graph capture the events
    become dependencies."""

    def __init__(self, side):
        self.side = cu.CUstream(int(side))
        self._ev = Events("fork", "join")

    def fork(self, s, begin=None) -> None:
        self.resume(s)
        if begin is not None:
            begin(self.side)

    def resume(self, s) -> None:
        check(cu.cuEventRecord(self._ev.fork, s))
        check(cu.cuStreamWaitEvent(self.side, self._ev.fork, 0))

    def copies(self, copies) -> None:
        copy_async(copies, self.side)

    def join(self, s) -> None:
        check(cu.cuEventRecord(self._ev.join, self.side))
        check(cu.cuStreamWaitEvent(s, self._ev.join, 0))
