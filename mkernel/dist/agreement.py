"""Agreement on calls across ranks, and every other host-side collective of a context, bounded.

Two halves (docs/design.md, "Epochs, flags and timeouts"):

* on the host, once per distinct call signature: a bounded non-blocking allgather checks that every
  rank of the communicator makes the same call (:meth:`Agreement.agree`), or exchanges per-rank
  values an op needs from its peers (:meth:`Agreement.exchange`: AllGather+GEMM's row counts);
* on the device, every call after: the signature's 32-bit digest travels in ``MkComm.sig``, every
  rank announces it in the op's workspace before any data moves, and a receiver compares it with its
  own (``MK_ERR_MISMATCH`` -> :class:`mkernel.CommMismatch`).

The same object runs the context's other host collectives (:meth:`Agreement.barrier`,
:meth:`Agreement.exchange_bytes`: symmetric memory, the inter-node transports' set-up), all through
:mod:`mkernel.dist.hostwait` (MPI: non-blocking collectives tested against a deadline; another
bootstrap's group: its allgather on a helper thread): each wait is bounded by
:func:`~mkernel.dist.timeouts.host_wait_limit` of the context's timeout.  A timed-out or failed collective
leaves an MPI request (or a pending allgather) that a late rank's next collective would pair with, so
after one the agreement is *broken*: every later collective raises at once (the context must be
discarded: ``close()`` it, which is then local, and make a new one with ``mkernel.init()``) instead of
hanging or pairing with the wrong operation.
"""
from __future__ import annotations

import zlib

import numpy as np

from ..errors import CommError, CommTimeout
from . import hostwait
from .timeouts import host_wait_limit

__all__ = ["Agreement", "digest"]


def digest(what: str, signature) -> int:
    """The 32-bit digest the kernels announce and compare: the same for the same call on every rank,
    in general different for two different calls."""
    return zlib.crc32(repr((what, signature)).encode()) & 0xFFFFFFFF


class Agreement:
    """Host-side agreement and collectives of one context: ``timeout()`` gives the context's timeout in
    seconds (every wait is bounded by :attr:`limit`, derived from it), ``rank`` names this rank in
    messages; the communicators passed in are the context's private ones (exchanges never share an MPI
    communicator with the application).  ``broken``: None, or why the agreement is broken."""

    def __init__(self, rank: int, timeout):
        self.rank = rank
        self._timeout = timeout
        self._agreed: dict = {}  # (what, signature, comm id) -> digest
        self.broken: str | None = None

    def agree(self, what: str, signature: tuple, comm) -> int:
        """Check, once per distinct ``signature``, that every rank of ``comm`` makes the same call.

        Raises ``ValueError`` on every rank, naming the ranks that differ and their calls, or
        :class:`~mkernel.CommTimeout` if a rank does not join within the bound.  Later calls with an agreed
        signature cost a dict lookup.  Returns the call's digest (``MkComm.sig``)."""
        key = (what, signature, id(comm))
        d = self._agreed.get(key)
        if d is not None:
            return d
        d = digest(what, signature)
        allv = self.exchange(what, np.array([d], dtype=np.int64), comm)[:, 0]
        if not np.all(allv == d):
            # every rank saw the same digests, so every rank takes this path: a second bounded exchange
            mine = (what, repr(signature))
            calls = [tuple(b.decode("utf-8", "replace").split("\0", 1)) for b in
                     self.exchange_bytes(what, "\0".join(mine).encode(), comm)]
            bad = [i for i, c in enumerate(calls) if c != mine]
            shown = [c[1] if c[0] == what else f"{c[0]}{c[1]}" for c in (calls[i] for i in bad)]
            raise ValueError(f"mkernel: {what}: ranks disagree on the call: this rank (rank {comm.Get_rank()} of "
                             f"the communicator) has {mine[1]}, ranks {bad} have [{', '.join(shown)}]")
        self._agreed[key] = d
        return d

    @property
    def limit(self) -> float:
        """Seconds every host collective of this agreement may wait for the other ranks."""
        return host_wait_limit(self._timeout())

    def require(self, what: str) -> None:
        """Raise :class:`~mkernel.CommTimeout` naming ``what`` if the agreement is broken."""
        if self.broken is not None:
            raise CommTimeout(f"mkernel: rank {self.rank}: {what}: this context's agreement is broken "
                              f"({self.broken}); discard the context (close() it) and make a new one with "
                              "mkernel.init()", {"rank": self.rank, "op": what})

    def _run(self, what: str, fn, *args):
        self.require(what)
        try:
            return fn(*args)
        except CommError as exc:
            self.broken = f"{what}: {exc}"
            raise

    def exchange(self, what: str, vec: np.ndarray, comm) -> np.ndarray:
        """Allgather one int64 vector per rank of ``comm`` -> ``[size, len]``, bounded: a rank that does not
        join within :attr:`limit` (4x the timeout, at least 4 s) raises :class:`~mkernel.CommTimeout` here,
        and the agreement is broken from then on."""
        return self._run(what, hostwait.iallgather, comm, vec, self.limit, what, self.rank)

    def exchange_bytes(self, what: str, data: bytes, comm) -> list:
        """Allgather ``data`` (any length up to 1 MiB) per rank of ``comm`` -> list of bytes, bounded
        like :meth:`exchange`."""
        return self._run(what, hostwait.iallgather_bytes, comm, data, self.limit, what, self.rank)

    def barrier(self, what: str, comm) -> None:
        """Every rank of ``comm`` reached this point, bounded like :meth:`exchange`."""
        self._run(what, hostwait.ibarrier, comm, self.limit, what, self.rank)

    def forget(self) -> None:
        """Drop every agreed signature (after a reset: the next call of each agrees again)."""
        self._agreed.clear()
