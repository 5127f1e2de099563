"""How the ranks of a job find each other: the :class:`Bootstrap` protocol.

``mkernel.init(comm)`` takes an mpi4py communicator (default ``MPI.COMM_WORLD``) or any object with

* ``rank`` and ``size`` (ints: this process's index in the job and the number of processes),
* ``allgather(data: bytes) -> list[bytes]`` (collective over every rank: element ``r`` is what rank ``r``
  passed; every rank calls it in the same order),
* ``barrier()`` (collective: returns once every rank called it).

That is all mkernel asks of a launcher: ``examples/torchrun_bootstrap.py`` builds one on
torch.distributed.  With MPI the context keeps using MPI itself (private duplicates of the communicator,
``Split_type`` for the hosts, a non-blocking allgather for the bounded agreement); with another
bootstrap the context's communicators are built on it (:mod:`.group`, :mod:`.localgroup`).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["Bootstrap", "MpiBootstrap", "is_mpi_comm", "check_bootstrap"]


@runtime_checkable
class Bootstrap(Protocol):
    """What a launcher must offer mkernel (module doc)."""

    rank: int
    size: int

    def allgather(self, data: bytes) -> list[bytes]: ...

    def barrier(self) -> None: ...


class MpiBootstrap:
    """A :class:`Bootstrap` over an mpi4py communicator (``mkernel.init`` uses the communicator itself;
    this is for code that wants the protocol's view of one)."""

    def __init__(self, comm=None):
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def allgather(self, data: bytes) -> list[bytes]:
        return self.comm.allgather(bytes(data))

    def barrier(self) -> None:
        self.comm.Barrier()


def is_mpi_comm(obj) -> bool:
    """Whether ``obj`` is (duck-typed as) an mpi4py intra-communicator."""
    return all(hasattr(obj, a) for a in ("Get_rank", "Get_size", "Dup", "Split_type", "Iallgather"))


def check_bootstrap(obj) -> None:
    """Raise TypeError naming what ``obj`` lacks to be a :class:`Bootstrap` (ValueError for a bad rank/size)."""
    missing = [a for a in ("rank", "size", "allgather", "barrier") if not hasattr(obj, a)]
    if missing:
        raise TypeError(f"mkernel.init: comm must be an mpi4py communicator or a bootstrap object with rank, size, "
                        f"allgather(bytes) -> list[bytes] and barrier(); {type(obj).__name__} has no "
                        f"{', '.join(missing)}")
    rank, size = obj.rank, obj.size
    if not (isinstance(rank, int) and isinstance(size, int) and 0 <= rank < size):
        raise ValueError(f"mkernel.init: bootstrap rank {rank!r} / size {size!r}: need ints with 0 <= rank < size")
