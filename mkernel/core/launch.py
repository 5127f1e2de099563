"""Kernel launch through the driver API (``cuLaunchKernelEx``) on the caller's stream.

A :class:`Kernel` is one ``__global__`` function of a compiled module; :meth:`Kernel.prepare` packs a
launch (configuration and parameter pointers) once into a :class:`PreparedLaunch` that can be
submitted again and again -- the ops' bound calls keep these.
"""
from __future__ import annotations

import ctypes
from typing import Iterable

from cuda.bindings import driver as cu

from . import frees
from .driver import check
from .streams import stream_handle

__all__ = ["Kernel", "PreparedLaunch"]


def _launch_config(grid, block, smem: int, hstream: int, cooperative: bool, cluster,
                   dependent: bool = False) -> "cu.CUlaunchConfig":
    grid = tuple(grid) + (1,) * (3 - len(grid)) if isinstance(grid, tuple) else (int(grid), 1, 1)
    block = tuple(block) + (1,) * (3 - len(block)) if isinstance(block, tuple) else (int(block), 1, 1)
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
    cfg.sharedMemBytes = smem
    cfg.hStream = cu.CUstream(hstream)
    attrs = []
    if cooperative:
        at = cu.CUlaunchAttribute()
        at.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        at.value.cooperative = 1
        attrs.append(at)
    if cluster is not None:
        at = cu.CUlaunchAttribute()
        at.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        cx, cy, cz = tuple(cluster) + (1,) * (3 - len(cluster))
        at.value.clusterDim.x, at.value.clusterDim.y, at.value.clusterDim.z = cx, cy, cz
        attrs.append(at)
    if dependent:  # programmatic dependent launch (the kernel waits: griddepcontrol.wait)
        at = cu.CUlaunchAttribute()
        at.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        at.value.programmaticStreamSerializationAllowed = 1
        attrs.append(at)
    cfg.attrs = attrs
    cfg.numAttrs = len(attrs)
    return cfg


class Kernel:
    """One ``__global__`` function of a :class:`Module`, launched through the driver API."""

    def __init__(self, module: Module, name: str):
        self.module = module
        self.name = name
        self._funcs: dict[int, object] = {}
        self._smem_set: dict[int, int] = {}
        self._configs: dict[tuple, object] = {}

    def _func(self):
        ctx = int(check(cu.cuCtxGetCurrent()))
        f = self._funcs.get(ctx)
        if f is None:
            # First use in this context: the module's load, then (CUDA's lazy loading, the default) the
            # kernel's code may synchronize the context holding the driver lock, which the inter-node
            # proxy's copies wait behind -- a kernel waiting on this process's proxy would never finish
            # (docs/internode.md, "Frees while a kernel waits on the proxy").  So: after the marked
            # launches, and the code loaded now (cuFuncLoad), not by the first launch behind such a kernel.
            frees.wait_marked()
            f = check(cu.cuModuleGetFunction(self.module._module_handle(), self.name.encode()))
            load = getattr(cu, "cuFuncLoad", None)  # (CUDA >= 12.4)
            if load is not None:
                check(load(f))
            self._funcs[ctx] = f
        return ctx, f

    def attribute(self, attr: cu.CUfunction_attribute) -> int:
        return int(check(cu.cuFuncGetAttribute(attr, self._func()[1])))

    def max_active_blocks_per_sm(self, block: int, smem: int = 0) -> int:
        ctx, f = self._func()
        self._ensure_smem(ctx, f, smem)
        return int(check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, block, smem)))

    def max_active_clusters(self, grid: int, block: int, smem: int, cluster: int) -> int:
        """How many clusters of ``cluster`` blocks (1-D) can be resident at once (cuOccupancyMaxActiveClusters):
        a persistent kernel launched in clusters must not ask for more, or the rest wait for the first
        ones to finish."""
        ctx, f = self._func()
        self._ensure_smem(ctx, f, smem)
        cfg = _launch_config(grid, block, smem, 0, False, (cluster, 1, 1))
        return int(check(cu.cuOccupancyMaxActiveClusters(f, cfg)))

    def _ensure_smem(self, ctx, f, smem):
        if smem > 48 * 1024 and self._smem_set.get(ctx, 0) < smem:
            check(cu.cuFuncSetAttribute(
                f, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
            self._smem_set[ctx] = smem

    def launch(self, grid, block, args: Iterable, *, stream=None, smem: int = 0,
               cooperative: bool = False, cluster: tuple | None = None, dependent: bool = False) -> None:
        """Launch on ``stream``.  ``args`` are ctypes scalars/structures or bytes (structs by value).
        ``dependent``: a programmatic dependent launch -- the kernel may start before the previous
        kernel in the stream completes, and must itself wait (``griddepcontrol.wait``) before it
        touches memory that kernel writes."""
        self.prepare(grid, block, args, stream=stream, smem=smem, cooperative=cooperative, cluster=cluster,
                     dependent=dependent).submit()

    def prepare(self, grid, block, args: Iterable, *, stream=None, smem: int = 0,
                cooperative: bool = False, cluster: tuple | None = None, dependent: bool = False) -> "PreparedLaunch":
        """The launch of :meth:`launch`, its configuration and parameter pointers packed once: calling
        the result launches (again and again, with the argument objects' current values)."""
        ctx, f = self._func()
        self._ensure_smem(ctx, f, smem)
        hstream = stream_handle(stream)
        key = (ctx, grid if isinstance(grid, int) else tuple(grid), block if isinstance(block, int) else tuple(block),
               smem, hstream, cooperative, None if cluster is None else tuple(cluster), bool(dependent))
        cfg = self._configs.get(key)
        if cfg is None:  # launch configurations are reused: ops launch the same shapes over and over
            cfg = _launch_config(grid, block, smem, hstream, cooperative, cluster, dependent)
            if len(self._configs) >= 64:
                self._configs.clear()
            self._configs[key] = cfg
        holders = []
        for a in args:
            if isinstance(a, (bytes, bytearray)):
                a = ctypes.create_string_buffer(bytes(a), len(a))
            elif not isinstance(a, (ctypes._SimpleCData, ctypes.Structure, ctypes.Array)):
                raise TypeError(f"kernel {self.name}: argument {a!r} must be a ctypes value or bytes")
            holders.append(a)
        ptrs = (ctypes.c_void_p * max(1, len(holders)))(*[ctypes.addressof(h) for h in holders])
        return PreparedLaunch(self.name, ctx, f, cfg, holders, ptrs)


class PreparedLaunch:
    """One kernel launch, packed (Kernel.prepare): calling it submits it.  It keeps its argument objects
    alive and reads their values at each call (a ctypes struct changed in place, e.g. a new timeout in
    an MkComm, is seen).  Raises if another CUDA context is current than the one it was prepared in."""

    __slots__ = ("name", "ctx", "f", "cfg", "holders", "ptrs", "_addr")

    def __init__(self, name, ctx, f, cfg, holders, ptrs):
        self.name, self.ctx, self.f, self.cfg, self.holders, self.ptrs = name, ctx, f, cfg, holders, ptrs
        self._addr = ctypes.addressof(ptrs)

    def __call__(self) -> None:
        err, cur = cu.cuCtxGetCurrent()
        if err != cu.CUresult.CUDA_SUCCESS or int(cur) != self.ctx:
            raise RuntimeError(f"kernel {self.name}: prepared in another CUDA context than the current one")
        self.submit()

    def submit(self) -> None:
        """Launch (the context it was prepared in must be current: Kernel.launch just made sure)."""
        r, = cu.cuLaunchKernelEx(self.cfg, self.f, self._addr, 0)
        if r != cu.CUresult.CUDA_SUCCESS:
            check((r,))
