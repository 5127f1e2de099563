"""What the MoE ops built on the GEMM component share (:mod:`.fused`: dispatch + gate/up GEMM;
:mod:`.fused_combine`: down GEMM + combine): the import of a call's activation and weight arrays, and the
bound call's B staging copy, if any, then one cooperative launch with the tile config's block and shared
memory."""
from __future__ import annotations

from cuda.bindings import driver as cu

from ...core.driver import check
from ...core.interop import as_device_array
from ..base import BoundCall, as_stream
from .op import moe_options, routing_arg

__all__ = ["GemmKernelBound", "gemm_operands"]


def gemm_operands(op, ctx, stream, options, routing, a, w, names: tuple, shapes: tuple):
    """``(stream, options, routing, A, W)`` of a call of ``op`` (its ``name`` / ``what``): ``a`` imported as
    a 2-D array, ``w`` as a 3-D one (``names``: their parameter names, ``shapes``: how the error message
    writes them), else ValueError."""
    ctx.check()
    s = as_stream(stream)
    opts = moe_options(options, op.what)
    R = routing_arg(op.what, routing, ctx)
    A = as_device_array(a, name=f"{op.name}: {names[0]}", stream=s)
    W = as_device_array(w, name=f"{op.name}: {names[1]}", stream=s)
    if A.ndim != 2 or W.ndim != 3:
        raise ValueError(f"{op.what}: {names[0]} must be {shapes[0]} and {names[1]} {shapes[1]}, got shapes "
                         f"{tuple(A.shape)} and {tuple(W.shape)}")
    return s, opts, R, A, W


class GemmKernelBound(BoundCall):
    """Subclasses set ``self._b`` (a GEMM ``OperandArg`` for B) and call :meth:`prepare` once; ``submit`` zeroes
    the kernel's counters (``zero``: ``(device pointer, 32-bit words)`` regions, memsets on the call's stream:
    graph-capturable), runs B's staging (when B is not TMA-readable in place) and the launch.  A kernel with
    several weight operands passes them all as ``operands`` (each staged, in order, where it needs it)."""

    def prepare(self, k, grid: int, cfg, args: list, stream, operands: tuple | None = None,
                zero: tuple = ()) -> None:
        self._launch = k.prepare(grid, cfg.threads, args, stream=stream, smem=cfg.smem, cooperative=True)
        ops = (self._b,) if operands is None else operands
        self._pre = [op.stage[0].prepare(*op.stage[1:], stream=stream) for op in ops if op.stage is not None]
        self._zero = [(cu.CUdeviceptr(p), n) for p, n in zero if n]
        self._cu_stream = cu.CUstream(stream)

    def submit(self) -> None:
        for ptr, words in self._zero:
            check(cu.cuMemsetD32Async(ptr, 0, words, self._cu_stream))
        for pre in self._pre:
            pre.submit()
        self._launch.submit()
