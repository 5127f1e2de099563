"""Symmetric memory: the same-size buffer on every rank of a node, each mapped by every peer.

Export is by legacy CUDA IPC handles (``cuIpcGetMemHandle``), exchanged over the node's communicator,
opened with ``cuIpcOpenMemHandle`` (docs/design.md says why we chose this over VMM + file
descriptors).  A device table of peer base pointers, indexed by local rank, lets kernels reach any
peer's copy: ``peer_table[j] + offset`` is byte ``offset`` of local rank ``j``'s buffer.

Creating and freeing are collective, and every wait in them is a bounded exchange of the context's
agreement (:class:`~mkernel.dist.agreement.Agreement`: at most its ``limit``, then CommTimeout).  Each
exchange carries every rank's status, so a rank whose allocation, export or mapping failed tells the
others in the same exchange and every rank raises the same kind of error naming it (MemoryError when
a rank ran out of device memory) instead of waiting for it.  Memory that a peer may still map is never
freed on a failure path: it is leaked (:meth:`SymmetricBuffer.abandon`) and returns when the process
exits.
"""
from __future__ import annotations


import numpy as np
from cuda.bindings import driver as cu

from ..core.driver import check
from ..errors import CommError, CudaError

__all__ = ["SymmetricBuffer"]

_ALIGN = 1 << 21  # allocations rounded to 2 MiB: IPC maps whole allocations anyway
_HANDLE_WORDS = 8  # a CUipcMemHandle is 64 bytes: 8 int64 words in the exchange
# a rank's status in the exchanges
_OK, _OOM, _FAILED, _BAD_SIZE = 0, 1, 2, 3


def _status(exc: BaseException) -> int:
    oom = int(cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    return _OOM if isinstance(exc, MemoryError) or (isinstance(exc, CudaError) and exc.code == oom) else _FAILED


class SymmetricBuffer:
    """``nbytes`` of device memory on every rank of ``comm`` (a node), zeroed, with peers mapped.

    Attributes: ``ptr`` (this rank's copy), ``peer_ptrs[j]`` (local rank j's copy as mapped here;
    ``peer_ptrs[local_rank] == ptr``), ``peer_table`` (device pointer to ``uint64[local_size]`` of
    those), ``nbytes``.  Collective to create and to :meth:`free`, each bounded by the context's host
    wait limit.  Creation raises on every rank when it fails on any: ``MemoryError`` when a rank ran out
    of device memory, ``ValueError`` for sizes that differ or are not positive, ``CommError`` for any other
    failure, each naming the ranks; ``CommTimeout`` when a rank does not arrive.
    """

    def __init__(self, ctx, nbytes: int, comm):
        self.ctx = ctx
        self.comm = comm
        self.nbytes = int(nbytes)
        self.local_rank = comm.Get_rank()
        self.local_size = comm.Get_size()
        self.freed = self.leaked = False
        self.ptr = self.peer_table = 0
        self.peer_ptrs: list[int] = []
        self._opened: list[int] = []
        self._alloc = (max(self.nbytes, 1) + _ALIGN - 1) // _ALIGN * _ALIGN
        host = ctx.agreement
        what = f"a symmetric allocation of {self.nbytes} bytes"
        host.require(what)
        # 1: allocate, zero and export this rank's copy; every rank's status, size and handle in one exchange
        status, err = _OK, None
        handle = np.zeros(_HANDLE_WORDS, np.int64)
        if self.nbytes <= 0:
            status = _BAD_SIZE
        else:
            try:
                self.ptr = int(check(cu.cuMemAlloc(self._alloc)))
                check(cu.cuMemsetD8(self.ptr, 0, self._alloc))
                check(cu.cuCtxSynchronize())  # zeroed before any peer may write into it
                h = check(cu.cuIpcGetMemHandle(self.ptr))
                handle = np.frombuffer(bytes(h.reserved), dtype=np.int64)[:_HANDLE_WORDS].copy()
            except (CudaError, MemoryError) as exc:
                status, err = _status(exc), exc
        try:
            allv = host.exchange(what, np.concatenate([[status, self.nbytes], handle]), comm)
        except CommError:
            self.abandon()  # a peer may hold our handle
            raise
        statuses, sizes = allv[:, 0], allv[:, 1]
        if (statuses != _OK).any() or len(set(sizes.tolist())) != 1:
            self._free_local()  # every rank learned of the failure in this exchange: nobody maps our copy
            raise self._failure("allocating", statuses, sizes, status, err)
        # 2: map every peer's copy and publish the table; every rank's status in one exchange, which also
        # tells every rank that every peer has mapped every buffer
        status, err = _OK, None
        try:
            for j in range(self.local_size):
                if j == self.local_rank:
                    self.peer_ptrs.append(self.ptr)
                    continue
                h = cu.CUipcMemHandle()
                h.reserved = allv[j, 2:2 + _HANDLE_WORDS].tobytes()
                p = int(check(cu.cuIpcOpenMemHandle(h, cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)))
                self.peer_ptrs.append(p)
                self._opened.append(p)
            table = np.array(self.peer_ptrs, dtype=np.uint64)
            self.peer_table = int(check(cu.cuMemAlloc(max(8, table.nbytes))))
            check(cu.cuMemcpyHtoD(self.peer_table, table.ctypes.data, table.nbytes))
        except (CudaError, MemoryError) as exc:
            status, err = _status(exc), exc
        try:
            statuses = host.exchange(f"mapping {what}", np.array([status], np.int64), comm)[:, 0]
        except CommError:
            self.abandon()
            raise
        if (statuses != _OK).any():
            self._unmap()
            try:
                host.barrier(f"unmapping {what}", comm)  # every peer unmapped our copy
            except CommError:
                self.abandon()
                raise
            self._free_local()
            raise self._failure("mapping", statuses, sizes, status, err)

    def _names(self, ranks) -> str:
        """``ranks`` of the buffer's communicator, as world ranks where the context maps them."""
        ranks = [int(r) for r in ranks]
        lw = getattr(self.ctx, "local_world_ranks", None)
        if lw is not None and self.comm is getattr(self.ctx, "node_comm", None):
            return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(lw[r]) for r in ranks)}"
        return f"local rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of the buffer's communicator"

    def _failure(self, stage: str, statuses, sizes, mine: int, err) -> Exception:
        """The error every rank raises after a failed exchange (the same kind on every rank)."""
        what = f"{stage} a {self.nbytes}-byte symmetric buffer"
        if len(set(sizes.tolist())) != 1:
            return ValueError(f"mkernel: symmetric allocation sizes differ across ranks: {sizes.tolist()}")
        if mine == _BAD_SIZE or (statuses == _BAD_SIZE).any():
            return ValueError(f"symmetric allocation of {self.nbytes} bytes")
        oom = np.flatnonzero(statuses == _OOM)
        failed = np.flatnonzero(statuses == _FAILED)
        parts = []
        if len(oom):
            parts.append(f"out of device memory on {self._names(oom)}")
        if len(failed):
            parts.append(f"failed on {self._names(failed)}")
        here = f" (here: {err})" if err is not None else ""
        msg = f"mkernel: {what}: {' and '.join(parts)}{here}; no rank kept any of it"
        exc = MemoryError(msg) if len(oom) else CommError(msg, {"ranks": [int(r) for r in failed]})
        exc.__cause__ = err
        return exc

    def _unmap(self) -> None:
        for p in self._opened:
            cu.cuIpcCloseMemHandle(p)
        self._opened = []
        if self.peer_table:
            cu.cuMemFree(self.peer_table)
            self.peer_table = 0

    def _free_local(self) -> None:
        self._unmap()
        if self.ptr:
            cu.cuMemFree(self.ptr)
            self.ptr = 0
        self.freed = True

    def abandon(self) -> None:
        """Give this buffer up without freeing it (local, never waits; after a failure): its device memory
        and mappings stay allocated until the process exits, because a peer that is alive may still map
        or write it.  The context no longer lists it."""
        self.freed = self.leaked = True
        try:
            self.ctx._symmetric.remove(self)
        except (AttributeError, ValueError):
            pass

    def peer_ptr(self, local_rank: int, offset: int = 0) -> int:
        return self.peer_ptrs[local_rank] + offset

    def array(self, shape, dtype, offset: int = 0):
        """A :class:`~mkernel.DeviceArray` view of this rank's copy: C-contiguous ``shape`` of ``dtype``
        from byte ``offset`` (keeps the buffer alive).  An all-gather whose ``out`` is such a view on
        every rank (same buffer, same offset) runs zero-copy on the copy-engine path: the peers write
        straight into it."""
        from ..core.arrays import DeviceArray
        from ..core.dtypes import dtype_of

        dt = dtype_of(dtype)
        n = 1
        for d in shape:
            n *= int(d)
        if offset < 0 or offset % dt.itemsize or offset + n * dt.itemsize > self.nbytes:
            raise ValueError(f"mkernel: a {tuple(shape)} {dt.name} view at byte {offset} does not fit a "
                             f"{self.nbytes}-byte symmetric buffer (or is misaligned)")
        return DeviceArray(self.ptr + offset, tuple(int(d) for d in shape), dt, None, self.ctx.device, self)

    def free(self) -> None:
        """Collective: wait for this device, unmap peers, then free once nobody maps ours.  Bounded: when a
        rank does not arrive (CommTimeout) or a rank's device failed, the buffer is abandoned (leaked,
        :meth:`abandon`) and the error raised."""
        if self.freed:
            return
        host = self.ctx.agreement
        what = f"freeing a {self.nbytes}-byte symmetric buffer"
        err = None
        try:
            check(cu.cuCtxSynchronize())
        except CudaError as exc:
            err = exc
        try:  # no kernel of any rank still touches any copy
            statuses = host.exchange(what, np.array([_OK if err is None else _FAILED], np.int64), self.comm)[:, 0]
        except CommError:
            self.abandon()
            raise
        if (statuses != _OK).any():
            self.abandon()  # a failed device may still run kernels that touch the copies
            bad = self._names(np.flatnonzero(statuses != _OK))
            exc = CommError(f"mkernel: {what}: the device failed on {bad}; the buffer is leaked, not freed")
            raise exc from err
        for p in self._opened:
            cu.cuIpcCloseMemHandle(p)
        self._opened = []
        try:
            host.barrier(what, self.comm)  # every peer unmapped ours
        except CommError:
            self.abandon()
            raise
        check(cu.cuMemFree(self.peer_table))
        check(cu.cuMemFree(self.ptr))
        self.freed = True
        try:
            self.ctx._symmetric.remove(self)
        except (AttributeError, ValueError):
            pass

    def __repr__(self):
        return f"SymmetricBuffer({self.nbytes} bytes, local_rank={self.local_rank}/{self.local_size})"
