"""GEMM + ReduceScatter on the op pipeline (:mod:`mkernel.ops.base`): prepare -> key -> validate / compile
(the ranks' K_r exchanged, the plan made, its kernel compiled) / agree / plan / bind -> run.

``gemm_reduce_scatter(ctx, a, b)``: local rank r (of the P = ``ctx.local_size`` ranks of one node) holds
``A_r [M, K_r]`` and ``B_r`` (``[K_r, N]`` "kn" or ``[N, K_r]`` "nk"); ``S = sum_r A_r @ B_r`` and rank r
returns rows ``[offs[r], offs[r+1])`` of S, ``[M_r, N]``.  Bound calls:

* "fused" (:func:`_fused_bound`, a :class:`mkernel.ops.gemm_comm.FusedBound`): one cooperative launch of ``mk_gemm_rs_{kn,nk}`` (cuda_src/ops/gemm_rs.cu);
  each call re-points the operands' tensor maps (or re-stages operands TMA cannot read in place) and
  the output fields, then submits.
* "unfused" (:class:`_UnfusedBound`): :func:`mkernel.gemm` into a buffer of P equal shares (one GEMM per
  owner when the row split is uneven), :func:`mkernel.reduce_scatter`, and a copy into ``out`` where the
  reduce-scatter cannot write it directly.
* "gemm" (one local rank): :func:`mkernel.gemm`; "empty": nothing.
"""
from __future__ import annotations

import sys
from dataclasses import replace

from ...core.archs import require_gemm_device
from ...core.arrays import DeviceArray
from ...core.tensormap import TensorMapArg  # noqa: F401  (used through _DEV: the CPU tests replace it)
from ..base import BoundCall, Op, as_stream, check_no_overlap, checked_once
from ..collectives import reduce_scatter
from ..gemm import gemm
from .. import gemm as G  # the GEMM package's public planning API
from ..gemm_comm import (FnBound, FusedBound, copy_2d, exchange_ks, gemm_options, make_out, parse_operands,
                         resident_kernel, validate_operands)
from .layout import SOURCE, OwnerRows, RsArgs, kernel_defines, row_offsets, split_rows
from .options import GemmRsOptions
from .planner import RsPlan, m_sizes_for, plan as make_plan

__all__ = ["gemm_reduce_scatter"]

OP = "gemm_rs"
WHAT = "mkernel.gemm_reduce_scatter"
_DEFAULT = GemmRsOptions()
_DEV = sys.modules[__name__]  # (the bound calls use its TensorMapArg and copy_2d)


# --------------------------------------------------------------------------------------------
# device helpers (module attributes: the CPU tests replace them; copy_2d and TensorMapArg too)
# --------------------------------------------------------------------------------------------
def fused_kernel(ctx, p: RsPlan):
    """The fused kernel of plan ``p``, checked once per context to fit one block per SM (a cooperative
    launch needs every block resident)."""
    return resident_kernel(ctx, OP, WHAT, SOURCE, kernel_defines(p.in_dtype, p.out_dtype, p.config, p.partial_dtype),
                           f"mk_gemm_rs_{p.b_layout}", G.CONFIGS[p.config],
                           (p.in_dtype, p.out_dtype, p.partial_dtype, p.config, p.b_layout))


# --------------------------------------------------------------------------------------------
# bound calls
# --------------------------------------------------------------------------------------------
def _fused_bound(ctx, call, p: RsPlan) -> FusedBound:
    """The fused kernel, prepared once: each call re-points A, B (or stages them), out, then submits."""
    cfg = G.CONFIGS[p.config]
    M, K, N, me = call.M, call.K, call.N, p.me
    bn = cfg.tile_n(p.b_layout)
    b_op = ("b", K, N, (64, 64, 1), True) if p.b_layout == "kn" else ("b", N, K, (64, bn, 1), True)
    a = RsArgs()
    a.L = p.ws.struct()
    rows = OwnerRows()
    rows.P, rows.me, rows.N, rows.group_m = p.P, me, N, G.GROUP_M
    rows.offs[:p.P + 1] = row_offsets(p.m_sizes)
    a.rows = rows
    a.K = K
    return FusedBound(ctx, call, p, what=WHAT, dev=_DEV, args=a, kernel=fused_kernel(ctx, p),
                      cfg=cfg, grid=p.grid, comm=ctx.comm_args(OP, p.digest), ws_key=(OP,), ws_bytes=p.ws.total,
                      operands=[("a", M, K, (64, cfg.bm), False), b_op], out_rows=p.m_sizes[me], c_map=True)


class _UnfusedBound(BoundCall):
    """mkernel.gemm into P equal shares of ``max(m_j)`` rows (owner j's rows at share j), then
    mkernel.reduce_scatter into ``out`` -- or into a buffer copied into ``out`` when the shares are padded
    or ``out`` is not a dense ``[max(m_j), N]`` array."""

    def __init__(self, ctx, call, p: RsPlan):
        self.plan, self._ctx = p, ctx
        O = call.o
        P, N, me = p.P, p.N, p.me
        self._m_max = m_max = max(p.m_sizes)
        self._equal = all(m == m_max for m in p.m_sizes)
        self._tmp = DeviceArray.empty((P * m_max, N), O.dtype, device=O.device)
        self._direct = self._equal and O.is_contiguous()
        self._red = None if self._direct else DeviceArray.empty((m_max, N), O.dtype, device=O.device)
        self._offs = row_offsets(p.m_sizes)
        self.buffers = tuple(x for x in (self._tmp, self._red) if x is not None)

    def run(self, stream, call):
        p, tmp, m_max = self.plan, self._tmp, self._m_max
        if self._equal:
            gemm(call.a, call.b, tmp, b_layout=p.b_layout, stream=stream, options=gemm_options(call))
        else:
            for j, m in enumerate(p.m_sizes):
                if m:
                    gemm(call.a[self._offs[j]:self._offs[j + 1]], call.b, tmp[j * m_max:j * m_max + m],
                         b_layout=p.b_layout, stream=stream, options=gemm_options(call))
        O = call.o
        red = O if self._direct else self._red
        reduce_scatter(self._ctx, tmp, red, stream=stream)
        if not self._direct:
            isz = O.dtype.itemsize
            m_me = p.m_sizes[p.me]
            copy_2d(O.ptr, (O.strides[0] if m_me > 1 else p.N) * isz, red.ptr, p.N * isz, p.N * isz, m_me, stream)


# --------------------------------------------------------------------------------------------
# the op
# --------------------------------------------------------------------------------------------
class _Call:
    __slots__ = ("key", "stream", "a", "b", "o", "b_layout", "out_dtype", "deterministic", "options", "M", "K", "N",
                 "m_sizes", "local_sig", "plan")


class GemmReduceScatter(Op):
    name = OP

    # ---- per call ---------------------------------------------------------------------------
    def __call__(self, ctx, a, b, out, b_layout, out_dtype, deterministic, stream, options):
        ctx.check()
        s = as_stream(stream)
        opts = _DEFAULT if options is None else options
        if opts is not _DEFAULT:
            if not isinstance(opts, GemmRsOptions):
                raise TypeError(f"{WHAT}: options must be a GemmRsOptions, got {type(opts).__name__}")
            checked_once(opts)
        A, B, M, K, N = parse_operands(WHAT, a, b, b_layout, s)
        P, me = ctx.local_size, ctx.local_rank
        if opts.m_sizes is None:
            m_sizes = split_rows(M, P)
        else:
            try:
                m_sizes = m_sizes_for(M, P, opts.m_sizes)
            except ValueError as exc:
                raise ValueError(f"{WHAT}: options.{exc}") from None
        O, result = make_out(WHAT, out, out_dtype, A, (m_sizes[me], N), ctx.device, s)
        check_no_overlap(WHAT, ((O, "out", A, "a"), (O, "out", B, "b")))
        call = _Call()
        call.stream, call.a, call.b, call.o = s, A, B, O
        call.b_layout, call.out_dtype, call.deterministic, call.options = b_layout, out_dtype, bool(deterministic), opts
        call.M, call.K, call.N, call.m_sizes = M, K, N, m_sizes
        call.key = (A.shape, A.strides, A.dtype, A.device, A.ptr % 16 == 0, B.shape, B.strides, B.dtype, B.device,
                    B.ptr % 16 == 0, O.shape, O.strides, O.dtype, O.device, O.readonly, O.ptr % 16 == 0, b_layout,
                    out_dtype, call.deterministic, s, opts)
        self.invoke(ctx.op_state(OP), call, ctx)
        return result

    # ---- first call of a key ----------------------------------------------------------------
    def validate(self, ctx, call):
        require_gemm_device(WHAT, ctx.device)
        validate_operands(ctx, call, WHAT, (call.m_sizes[ctx.local_rank], call.N),
                          f"this rank's rows of the {call.M} x {call.N} sum")

    def _local_signature(self, ctx, call) -> tuple:
        """What every rank's call must share (K_r may differ: it is exchanged)."""
        return (call.a.dtype.name, call.o.dtype.name, call.M, call.N, call.b_layout, call.m_sizes,
                call.deterministic, repr(call.options), ctx.local_size, ctx.resident_sms)

    def compile(self, ctx, call):
        """Exchange K_r, plan, and compile the fused kernel before the ranks agree: a rank compiling for
        seconds then delays the host agreement (bounded, waited for by every rank), never a peer's kernel."""
        sig = self._local_signature(ctx, call)
        ks = exchange_ks(ctx, OP, WHAT, sig, call.K) if ctx.local_size > 1 else (call.K,)
        opts = call.options
        call.local_sig = sig
        call.plan = make_plan(call.m_sizes, call.N, ks, ctx.local_rank, b_layout=call.b_layout,
                              in_dtype=call.a.dtype.name, out_dtype=call.o.dtype.name, sms=ctx.resident_sms,
                              options=opts, deterministic=call.deterministic)
        if call.plan.path == "fused":
            fused_kernel(ctx, call.plan)

    def agree(self, ctx, call):
        p = call.plan
        return ctx.agree(WHAT, (call.local_sig, p.Ks, p.path, p.config, p.partial_dtype), ctx.node_comm)

    def plan(self, ctx, call, digest):
        return replace(call.plan, digest=digest)

    def bind(self, ctx, call, p: RsPlan) -> BoundCall:
        if p.path == "empty":
            return FnBound(p, lambda stream, c: None)
        if p.path == "gemm":
            return FnBound(p, lambda stream, c: gemm(c.a, c.b, c.o, b_layout=c.b_layout, stream=stream,
                                                         options=gemm_options(c)))
        if p.path == "unfused":
            return _UnfusedBound(ctx, call, p)
        return _fused_bound(ctx, call, p)


_OP = GemmReduceScatter()


def gemm_reduce_scatter(ctx, a, b, out=None, *, b_layout: str = "kn", out_dtype: str | None = None,
                        deterministic: bool = False, stream=None, options: GemmRsOptions | None = None):
    """Row-parallel GEMM + ReduceScatter over the local ranks: returns this rank's rows of ``sum_r A_r @ B_r``.

    Local rank r (of ``P = ctx.local_size``, one node; ``ctx.num_nodes`` must be 1) holds ``a`` = ``A_r``
    ``[M, K_r]`` (M the same on every rank, K_r its own share of the reduction) and ``b`` = ``B_r``,
    ``[K_r, N]`` for ``b_layout="kn"`` or ``[N, K_r]`` for "nk" (N the same on every rank); both bf16 or
    both fp16, any row strides, unit stride along the last axis, on ``ctx``'s GPU.  Rank r keeps rows
    ``[offs[r], offs[r+1])`` of the ``[M, N]`` sum: M split as evenly as possible (the first M % P ranks
    one row more) or ``options.m_sizes``.  ``out``: ``[M_r, N]`` of ``out_dtype`` (default a's; bf16,
    fp16 or fp32), unit column stride, any row stride, not overlapping ``a`` or ``b``; allocated when
    None.  Sums accumulate in fp32.  ``deterministic``: bit-identical results run after run (every path
    sums in a fixed order already, so this costs nothing).  ``stream``: any stream-like object or raw
    handle (None: the legacy default stream).  ``options``: :class:`GemmRsOptions` (path, tile config,
    partial dtype, row split, cost model), equal on every rank.  The path that ran:
    ``ctx.last_plan("gemm_rs")``.  Every rank must make the same calls in the same order.  No host
    synchronization; CUDA-graph capturable once a call of the same shape ran outside the capture.
    Returns ``out``."""
    return _OP(ctx, a, b, out, b_layout, out_dtype, deterministic, stream, options)
