"""Agreement on calls across ranks: every rank must make the same call in the same position.

Two halves (docs/design.md, "Epochs, flags and timeouts"):

* on the host, once per distinct call signature: a bounded non-blocking allgather checks that every
  rank of the communicator makes the same call (:meth:`Agreement.agree`), or exchanges per-rank
  values an op needs from its peers (:meth:`Agreement.exchange`: AllGather+GEMM's row counts);
* on the device, every call after: the signature's 32-bit digest travels in ``MkComm.sig``, every
  rank announces it in the op's workspace before any data moves, and a receiver compares it with its
  own (``MK_ERR_MISMATCH`` -> :class:`mkernel.CommMismatch`).

Every host wait is bounded by the context's timeout (MPI: a non-blocking allgather; another bootstrap's
group: its allgather on a helper thread).  A timed-out exchange leaves an MPI request (or a pending
allgather) that a late rank's next exchange would pair with, so after one the agreement is *broken*: every
later exchange raises at once (the context must be reset or discarded) instead of hanging.
"""
from __future__ import annotations

import time
import zlib

import numpy as np

from ..errors import CommTimeout
from .group import GroupTimeout

__all__ = ["Agreement", "digest"]


def digest(what: str, signature) -> int:
    """The 32-bit digest the kernels announce and compare: the same for the same call on every rank,
    in general different for two different calls."""
    return zlib.crc32(repr((what, signature)).encode()) & 0xFFFFFFFF


class Agreement:
    """Host-side agreement of one context: ``timeout()`` gives the bound in seconds, ``rank`` names this
    rank in messages; ``comms`` are the context's private communicators (exchanges never share an MPI
    communicator with the application)."""

    def __init__(self, rank: int, timeout):
        self.rank = rank
        self._timeout = timeout
        self._agreed: dict = {}  # (what, signature, comm id) -> digest
        self.broken: str | None = None

    def agree(self, what: str, signature: tuple, comm) -> int:
        """Check, once per distinct ``signature``, that every rank of ``comm`` makes the same call.

        Raises ``ValueError`` naming the ranks that differ, or :class:`~mkernel.CommTimeout` if a rank
        does not join within the bound.  Later calls with an agreed signature cost a dict lookup.
        Returns the call's digest (``MkComm.sig``)."""
        key = (what, signature, id(comm))
        d = self._agreed.get(key)
        if d is not None:
            return d
        d = digest(what, signature)
        allv = self.exchange(what, np.array([d], dtype=np.int64), comm)[:, 0]
        if not np.all(allv == d):
            sigs = comm.allgather(signature)
            bad = [i for i, s in enumerate(sigs) if s != signature]
            raise ValueError(f"mkernel: {what}: ranks disagree on the call: this rank (rank {comm.Get_rank()} of "
                             f"the communicator) has {signature}, ranks {bad} have {[sigs[i] for i in bad]}")
        self._agreed[key] = d
        return d

    def exchange(self, what: str, vec: np.ndarray, comm) -> np.ndarray:
        """Allgather one int64 vector per rank of ``comm`` -> ``[size, len]``, bounded: a rank that does not
        join within 4x the timeout (at least 4 s) raises :class:`~mkernel.CommTimeout` here, and the
        agreement is broken from then on."""
        if self.broken is not None:
            raise CommTimeout(f"mkernel: rank {self.rank}: {what}: this context's agreement is broken "
                              f"({self.broken}); reset or discard the context", {"rank": self.rank, "op": what})
        vec = np.ascontiguousarray(vec, dtype=np.int64).reshape(-1)
        limit = max(self._timeout(), 1.0) * 4
        if not hasattr(comm, "Iallgather"):  # a group over another bootstrap (mkernel.dist.group)
            return self._exchange_group(what, vec, comm, limit)
        allv = np.empty((comm.Get_size(), vec.shape[0]), dtype=np.int64)
        req = comm.Iallgather(vec, allv)
        deadline = time.monotonic() + limit
        sleep = 2e-6
        while not req.Test():
            if time.monotonic() > deadline:
                self.broken = f"{what} timed out after {limit:.1f} s"
                raise CommTimeout(f"mkernel: rank {self.rank} waited {limit:.1f} s for the other ranks to join "
                                  f"{what}; a rank is dead or made a different call", {"rank": self.rank, "op": what})
            time.sleep(sleep)
            sleep = min(sleep * 2, 1e-4)
        return allv

    def _exchange_group(self, what: str, vec: np.ndarray, comm, limit: float) -> np.ndarray:
        """:meth:`exchange` over a :class:`~mkernel.dist.group.Group`: its blocking allgather on a helper
        thread, waited for at most ``limit`` seconds."""
        try:
            rows = comm.allgather_within([int(v) for v in vec], limit)
        except GroupTimeout:
            self.broken = f"{what} timed out after {limit:.1f} s"
            raise CommTimeout(f"mkernel: rank {self.rank} waited {limit:.1f} s for the other ranks to join "
                              f"{what}; a rank is dead or made a different call",
                              {"rank": self.rank, "op": what}) from None
        if any(len(r) != vec.shape[0] for r in rows):
            raise ValueError(f"mkernel: {what}: ranks exchanged vectors of different lengths {[len(r) for r in rows]}")
        return np.array(rows, dtype=np.int64).reshape(len(rows), vec.shape[0])

    def forget(self) -> None:
        """Drop every agreed signature (after a reset: the next call of each agrees again)."""
        self._agreed.clear()
