"""The context's communicators when the job did not start with MPI.

A :class:`Group` offers the part of the mpi4py communicator API the context and the ops use --
``Get_rank()``, ``Get_size()``, ``allgather(obj)``, ``bcast(obj, root)``, ``Barrier()`` -- with objects
carried as bytes through :mod:`.wire` (plain values only).  Subclasses move the bytes:
:class:`BootstrapGroup` through a user's :class:`~mkernel.dist.bootstrap.Bootstrap` (the world),
:class:`~mkernel.dist.localgroup.LocalGroup` through sockets among the ranks of one host (nodes, hosts).

Every rank of a group calls its collectives in the same order (as with MPI).  What MPI's non-blocking
allgather gives the bounded agreement, a group gives with :meth:`Group.allgather_within`: the allgather
runs on a helper thread and the caller stops waiting at a deadline.
"""
from __future__ import annotations

import threading

from . import wire

__all__ = ["Group", "BootstrapGroup", "GroupTimeout"]


class GroupTimeout(TimeoutError):
    """An allgather did not complete within its deadline (it may still complete later, on its thread)."""


class Group:
    """A communicator over bytes (module doc).  Subclasses define ``rank``, ``size``, :meth:`allgather_bytes`
    and :meth:`barrier_bytes`."""

    rank = 0
    size = 1

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        raise NotImplementedError

    def barrier_bytes(self) -> None:
        self.allgather_bytes(b"")

    # mpi4py's names, so the context's code runs on either
    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def allgather(self, obj) -> list:
        return [wire.decode(b) for b in self.allgather_bytes(wire.encode(obj))]

    def bcast(self, obj, root: int = 0):
        return self.allgather(obj if self.rank == root else None)[root]

    def Barrier(self) -> None:
        self.barrier_bytes()

    def allgather_within(self, obj, seconds: float) -> list:
        """:meth:`allgather`, waiting at most ``seconds``: GroupTimeout after that (the allgather stays
        pending on its helper thread, so this group is out of step from then on)."""
        box: dict = {}

        def run():
            try:
                box["out"] = self.allgather(obj)
            except BaseException as exc:  # noqa: BLE001 -- re-raised in the caller's thread
                box["err"] = exc

        t = threading.Thread(target=run, name="mkernel-allgather", daemon=True)
        t.start()
        t.join(seconds)
        if t.is_alive():
            raise GroupTimeout(f"allgather not complete after {seconds:.1f} s")
        if "err" in box:
            raise box["err"]
        return box["out"]

    def close(self) -> None:
        """Release what the group holds (sockets); collective use ends here."""


class BootstrapGroup(Group):
    """The world over a user's bootstrap: its ``allgather(bytes)`` and ``barrier()``, checked."""

    def __init__(self, bootstrap):
        self.bootstrap = bootstrap
        self.rank, self.size = int(bootstrap.rank), int(bootstrap.size)

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        out = self.bootstrap.allgather(bytes(data))
        out = list(out) if out is not None else []
        if len(out) != self.size or not all(isinstance(b, (bytes, bytearray, memoryview)) for b in out):
            raise TypeError(f"mkernel: the bootstrap's allgather returned {type(out).__name__} of {len(out)} items; "
                            f"expected a list of {self.size} bytes objects (element r from rank r)")
        return [bytes(b) for b in out]

    def barrier_bytes(self) -> None:
        self.bootstrap.barrier()
