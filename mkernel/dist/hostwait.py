"""Bounded host-side collectives over MPI: every collective the host waits for ends within a limit.

Each one posts a non-blocking MPI operation (``Idup``, ``Ibarrier``, ``Iallgather``, ``Iallgatherv``) and
tests it, sleeping between tests, until it completes or ``limit`` seconds pass.  Then:

* on the deadline, :class:`~mkernel.CommTimeout`.  The operation is still active inside MPI: a
  non-blocking collective cannot be cancelled and freeing its request is erroneous (mpi4py frees the
  request of a collected Request object, and the receive buffer would be freed under MPI), so the request
  and its buffers are kept alive until the process exits (:data:`_abandoned`); a rank that joins late
  completes it harmlessly.  The communicator is unusable from then on (its next collective would pair
  with the abandoned one): callers mark their state broken (:class:`~mkernel.dist.agreement.Agreement`).
* an error MPI reports while testing (e.g. a failed peer, with an MPI that detects failures):
  :class:`~mkernel.CommError` with MPI's exception as the cause; also abandoned.

A :class:`~mkernel.dist.group.Group` (the communicators of a job started without MPI) has no
non-blocking collectives: its allgather runs on a helper thread that the caller stops waiting for at the
deadline (:meth:`~mkernel.dist.group.Group.allgather_within`), with the same outcomes.

Needs only an mpi4py-like communicator or a group (tests pass fakes); never imports ``mpi4py.MPI`` itself.
"""
from __future__ import annotations

import threading
import time

import numpy as np

from ..errors import CommError, CommTimeout
from .group import GroupTimeout

__all__ = ["wait", "idup", "ibarrier", "iallgather", "iallgather_bytes", "group_allgather", "blocking"]

_abandoned: list = []  # (request, buffers) of operations given up on: alive until the process exits
_abandoned_lock = threading.Lock()


def _abandon(req, keep) -> None:
    with _abandoned_lock:
        # drop the ones a late rank completed since (testing them is harmless: each is still active or done)
        live = []
        for r, k in _abandoned:
            try:
                done = r.Test()
            except Exception:  # noqa: BLE001 - an erroneous request stays alive, untested
                done = False
            if not done:
                live.append((r, k))
        live.append((req, keep))
        _abandoned[:] = live


def _timeout(limit: float, what: str, rank: int) -> CommTimeout:
    return CommTimeout(f"mkernel: rank {rank} waited {limit:.1f} s for the other ranks to join {what}; a rank "
                       "is dead, stalled or made a different call", {"rank": rank, "op": what})


def _is_group(comm) -> bool:
    return not hasattr(comm, "Iallgather")


def group_allgather(comm, obj, limit: float, what: str, rank: int) -> list:
    """A group's allgather of ``obj``, waited for at most ``limit`` seconds."""
    try:
        return comm.allgather_within(obj, limit)
    except GroupTimeout:
        raise _timeout(limit, what, rank) from None
    except CommError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the group's transport raised
        raise CommError(f"mkernel: rank {rank}: {what} failed: {exc}", {"rank": rank, "op": what}) from exc


def wait(req, limit: float, what: str, rank: int, keep=()) -> None:
    """Test ``req`` until it completes; CommTimeout after ``limit`` seconds, CommError if MPI reports an
    error.  ``keep``: the buffers the operation reads or writes (kept alive with it when abandoned)."""
    deadline = time.monotonic() + limit
    sleep = 2e-6
    while True:
        try:
            if req.Test():
                return
        except Exception as exc:  # noqa: BLE001 - whatever MPI raised (mpi4py: MPI.Exception)
            _abandon(req, keep)
            raise CommError(f"mkernel: rank {rank}: {what} failed in MPI (a peer failed?): {exc}",
                            {"rank": rank, "op": what}) from exc
        if time.monotonic() > deadline:
            _abandon(req, keep)
            raise _timeout(limit, what, rank)
        time.sleep(sleep)
        sleep = min(sleep * 2, 1e-4)


def idup(comm, limit: float, what: str, rank: int):
    """A duplicate of ``comm`` (``Idup``), bounded."""
    new, req = comm.Idup()
    wait(req, limit, what, rank, keep=(new,))
    return new


def ibarrier(comm, limit: float, what: str, rank: int) -> None:
    if _is_group(comm):
        group_allgather(comm, None, limit, what, rank)
        return
    wait(comm.Ibarrier(), limit, what, rank)


def iallgather(comm, vec, limit: float, what: str, rank: int) -> np.ndarray:
    """Every rank's int64 vector (the same length on every rank) -> ``[size, len]``, bounded."""
    vec = np.ascontiguousarray(vec, dtype=np.int64).reshape(-1)
    if _is_group(comm):
        rows = group_allgather(comm, [int(v) for v in vec], limit, what, rank)
        if any(len(r) != vec.shape[0] for r in rows):
            raise ValueError(f"mkernel: {what}: ranks exchanged vectors of different lengths {[len(r) for r in rows]}")
        return np.array(rows, dtype=np.int64).reshape(len(rows), vec.shape[0])
    out = np.empty((comm.Get_size(), vec.shape[0]), dtype=np.int64)
    wait(comm.Iallgather(vec, out), limit, what, rank, keep=(vec, out))
    return out


def iallgather_bytes(comm, data: bytes, limit: float, what: str, rank: int, max_bytes: int = 1 << 20) -> list:
    """Every rank's ``data`` (any length up to ``max_bytes``) -> list of bytes in rank order: the lengths,
    then the bytes, each bounded by ``limit``."""
    if len(data) > max_bytes:
        raise ValueError(f"mkernel: {what}: {len(data)} bytes to exchange (at most {max_bytes})")
    if _is_group(comm):
        return [bytes(b) for b in group_allgather(comm, bytes(data), limit, what, rank)]
    lens = iallgather(comm, [len(data)], limit, what, rank)[:, 0]
    if (lens < 0).any() or (lens > max_bytes).any():
        raise CommError(f"mkernel: rank {rank}: {what}: a peer announced {lens.tolist()} bytes (at most {max_bytes})",
                        {"rank": rank, "op": what})
    send = np.frombuffer(bytes(data), dtype=np.uint8)
    buf = np.empty(int(lens.sum()), dtype=np.uint8)
    displs = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    counts, displs = [int(x) for x in lens], [int(x) for x in displs]
    wait(comm.Iallgatherv(send, [buf, (counts, displs)]), limit, what, rank, keep=(send, buf))
    return [bytes(buf[d:d + c]) for c, d in zip(counts, displs)]


def blocking(fn, limit: float, what: str, rank: int, threads_ok: bool):
    """``fn()`` -- a blocking MPI collective that has no non-blocking form (``Split_type``, ``Split``) --
    waited for at most ``limit`` seconds.  With ``threads_ok`` (MPI initialised with
    ``MPI_THREAD_MULTIPLE``) it runs on a helper thread: past the limit :class:`~mkernel.CommTimeout`
    is raised and the thread is left blocked in MPI (a daemon: it never holds up the exit), as an
    abandoned request is (docs/reliability.md, "Limits").  Without it, MPI forbids a second thread in
    the library and ``fn`` runs here, unbounded."""
    if not threads_ok:
        return fn()
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = exc

    t = threading.Thread(target=run, name="mkernel-mpi-blocking", daemon=True)
    t.start()
    t.join(limit)
    if t.is_alive():
        with _abandoned_lock:
            _abandoned.append((_Stuck(t), ()))
        raise _timeout(limit, what, rank)
    if "error" in box:
        exc = box["error"]
        if isinstance(exc, CommError):
            raise exc
        raise CommError(f"mkernel: rank {rank}: {what} failed in MPI (a peer failed?): {exc}",
                        {"rank": rank, "op": what}) from exc
    return box["value"]


class _Stuck:
    """An abandoned blocking call, kept in the abandoned list like a request (done once its thread ends)."""

    def __init__(self, thread):
        self.thread = thread

    def Test(self) -> bool:  # noqa: N802 - the request protocol
        return not self.thread.is_alive()
