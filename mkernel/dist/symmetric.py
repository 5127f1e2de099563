"""Symmetric memory: the same-size buffer on every rank of a node, each mapped by every peer.

Export is by legacy CUDA IPC handles (``cuIpcGetMemHandle``), exchanged with mpi4py over the node's
communicator, opened with ``cuIpcOpenMemHandle`` (docs/design.md says why we chose this over VMM +
file descriptors).  A device table of peer base pointers, indexed by local rank, lets kernels reach
any peer's copy: ``peer_table[j] + offset`` is byte ``offset`` of local rank ``j``'s buffer.
"""
from __future__ import annotations


import numpy as np
from cuda.bindings import driver as cu

from ..core.driver import check

__all__ = ["SymmetricBuffer"]

_ALIGN = 1 << 21  # allocations rounded to 2 MiB: IPC maps whole allocations anyway


class SymmetricBuffer:
    """``nbytes`` of device memory on every rank of ``comm`` (a node), zeroed, with peers mapped.

    Attributes: ``ptr`` (this rank's copy), ``peer_ptrs[j]`` (local rank j's copy as mapped here;
    ``peer_ptrs[local_rank] == ptr``), ``peer_table`` (device pointer to ``uint64[local_size]`` of
    those), ``nbytes``.  Collective to create and to :meth:`free`.
    """

    def __init__(self, ctx, nbytes: int, comm):
        if nbytes <= 0:
            raise ValueError(f"symmetric allocation of {nbytes} bytes")
        self.ctx = ctx
        self.comm = comm
        self.nbytes = int(nbytes)
        self.local_rank = comm.Get_rank()
        self.local_size = comm.Get_size()
        sizes = comm.allgather(self.nbytes)
        if len(set(sizes)) != 1:
            raise ValueError(f"mkernel: symmetric allocation sizes differ across ranks: {sizes}")
        alloc = (self.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self._alloc = alloc
        self.ptr = int(check(cu.cuMemAlloc(alloc)))
        check(cu.cuMemsetD8(self.ptr, 0, alloc))
        check(cu.cuCtxSynchronize())  # zeroed before any peer may write into it
        handle = check(cu.cuIpcGetMemHandle(self.ptr))
        handles = comm.allgather(bytes(handle.reserved))
        self.peer_ptrs: list[int] = []
        self._opened: list[int] = []
        try:
            for j, hb in enumerate(handles):
                if j == self.local_rank:
                    self.peer_ptrs.append(self.ptr)
                    continue
                h = cu.CUipcMemHandle()
                h.reserved = hb
                p = int(check(cu.cuIpcOpenMemHandle(h, cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)))
                self.peer_ptrs.append(p)
                self._opened.append(p)
        except Exception:
            for p in self._opened:
                cu.cuIpcCloseMemHandle(p)
            cu.cuMemFree(self.ptr)
            raise
        table = np.array(self.peer_ptrs, dtype=np.uint64)
        self.peer_table = int(check(cu.cuMemAlloc(max(8, table.nbytes))))
        check(cu.cuMemcpyHtoD(self.peer_table, table.ctypes.data, table.nbytes))
        comm.Barrier()  # every peer has mapped every buffer
        self.freed = False

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
        """Collective: wait for this device, unmap peers, then free once nobody maps ours."""
        if self.freed:
            return
        self.freed = True
        check(cu.cuCtxSynchronize())
        self.comm.Barrier()  # no peer kernel still touches any copy
        for p in self._opened:
            check(cu.cuIpcCloseMemHandle(p))
        self.comm.Barrier()  # every peer unmapped ours
        check(cu.cuMemFree(self.peer_table))
        check(cu.cuMemFree(self.ptr))
        try:
            self.ctx._symmetric.remove(self)
        except (AttributeError, ValueError):
            pass

    def __repr__(self):
        return f"SymmetricBuffer({self.nbytes} bytes, local_rank={self.local_rank}/{self.local_size})"
