"""GEMM + AllReduce on the op pipeline (:mod:`mkernel.ops.base`): prepare -> key -> validate / compile (the
ranks' K_r exchanged, the plan made, its kernel compiled) / agree / plan / bind -> run.

``gemm_all_reduce(ctx, a, b)``: local rank r (of the P = ``ctx.local_size`` ranks of one node) holds
``A_r [M, K_r]`` and ``B_r`` (``[K_r, N]`` "kn" or ``[N, K_r]`` "nk"); every rank returns ``C = sum_r A_r @
B_r`` ``[M, N]``, the same bits on every rank.  Bound calls:

* "latency" / "bandwidth" (:func:`_fused_bound`, a :class:`mkernel.ops.gemm_comm.FusedBound`): one
  cooperative launch of ``mk_gemm_ar_{kn,nk}`` (cuda_src/ops/gemm_ar.cu) -- its operands' tensor maps
  re-pointed (or operands TMA cannot read in place re-staged) and the output fields set at each call.  A
  transposed latency plan maps B_r as the kernel's A and A_r as its "nk" B, and stores C^T tiles transposed.
* "unfused" (:class:`_UnfusedBound`): :func:`mkernel.gemm` into ``out`` (or a dense buffer), then
  :func:`mkernel.all_reduce` in place, and a copy into ``out`` where it is not dense.
* "gemm" (one local rank): :func:`mkernel.gemm`; "empty": nothing.
"""
from __future__ import annotations

import sys
from dataclasses import replace

from ...core.archs import require_gemm_device
from ...core.arrays import DeviceArray
from ...core.tensormap import TensorMapArg  # noqa: F401  (used through _DEV: the CPU tests replace it)
from ..base import BoundCall, Op, as_stream, check_no_overlap, checked_once
from ..collectives import all_reduce
from ..gemm import gemm
from .. import gemm as G  # the GEMM package's public planning API
from ..gemm_comm import (FnBound, FusedBound, OwnerRows, copy_2d, exchange_ks, gemm_options, make_out,
                         parse_operands, resident_kernel, row_offsets, validate_operands)
from .layout import SOURCE, ArArgs, kernel_defines
from .options import GemmArOptions
from .planner import ArPlan, plan as make_plan

__all__ = ["gemm_all_reduce"]

OP = "gemm_ar"
WHAT = "mkernel.gemm_all_reduce"
_DEFAULT = GemmArOptions()
_DEV = sys.modules[__name__]  # (the bound calls use its TensorMapArg and copy_2d)


# --------------------------------------------------------------------------------------------
# device helpers (module attributes: the CPU tests replace them; copy_2d and TensorMapArg too)
# --------------------------------------------------------------------------------------------
def fused_kernel(ctx, p: ArPlan):
    """The fused kernel of plan ``p``, checked once per context to fit one block per SM (a cooperative
    launch needs every block resident)."""
    d = kernel_defines(p.in_dtype, p.out_dtype, p.config, p.path, p.partial_dtype, p.transposed)
    return resident_kernel(ctx, OP, WHAT, SOURCE, d, f"mk_gemm_ar_{p.b_layout}", G.CONFIGS[p.config],
                           (p.in_dtype, p.out_dtype, p.partial_dtype, p.config, p.path, p.transposed, p.b_layout))


# --------------------------------------------------------------------------------------------
# bound calls
# --------------------------------------------------------------------------------------------
def _fused_bound(ctx, call, p: ArPlan) -> FusedBound:
    """The fused kernel of a latency or bandwidth plan, prepared once; each call re-points A, B (or stages
    them) and out, then submits."""
    cfg = G.CONFIGS[p.config]
    M, K, N = call.M, call.K, call.N
    bn = cfg.tile_n(p.b_layout)
    if p.transposed:  # the kernel's problem is N x M: B_r [N, K_r] is its A, A_r [M, K_r] its "nk" B
        operands = [("b", N, K, (64, cfg.bm), False), ("a", M, K, (64, bn, 1), True)]
        kM, kN = N, M
    else:
        b_op = ("b", K, N, (64, 64, 1), True) if p.b_layout == "kn" else ("b", N, K, (64, bn, 1), True)
        operands = [("a", M, K, (64, cfg.bm), False), b_op]
        kM, kN = M, N
    a = ArArgs()
    a.L = p.ws.rs_struct()
    a.G = p.ws.gather_struct()
    rows = OwnerRows()
    rows.P, rows.me, rows.N, rows.group_m = p.P, p.me, kN, G.GROUP_M
    if p.path == "bandwidth":
        rows.offs[:p.P + 1] = row_offsets(p.m_sizes)
    a.rows = rows
    a.M, a.K = kM, K
    return FusedBound(ctx, call, p, what=WHAT, dev=_DEV, args=a, kernel=fused_kernel(ctx, p), cfg=cfg, grid=p.grid,
                      comm=ctx.comm_args(OP, p.digest), ws_key=(OP,), ws_bytes=p.ws.total, operands=operands,
                      out_rows=M, c_map=not p.transposed)


class _UnfusedBound(BoundCall):
    """mkernel.gemm into ``out`` (a dense buffer when ``out`` is not C-contiguous), mkernel.all_reduce of it in
    place (every rank the same bits), then the buffer copied into ``out``."""

    def __init__(self, ctx, call, p: ArPlan):
        self.plan, self._ctx = p, ctx
        O = call.o
        self._direct = O.is_contiguous()
        self._tmp = None if self._direct else DeviceArray.empty((p.M, p.N), O.dtype, device=O.device)
        self.buffers = () if self._direct else (self._tmp,)

    def run(self, stream, call):
        p, O = self.plan, call.o
        buf = O if self._direct else self._tmp
        gemm(call.a, call.b, buf, b_layout=p.b_layout, stream=stream, options=gemm_options(call))
        all_reduce(self._ctx, buf, buf, stream=stream)
        if not self._direct:
            isz = O.dtype.itemsize
            copy_2d(O.ptr, (O.strides[0] if p.M > 1 else p.N) * isz, buf.ptr, p.N * isz, p.N * isz, p.M, stream)


# --------------------------------------------------------------------------------------------
# the op
# --------------------------------------------------------------------------------------------
class _Call:
    __slots__ = ("key", "stream", "a", "b", "o", "b_layout", "out_dtype", "deterministic", "options", "M", "K", "N",
                 "local_sig", "plan")


class GemmAllReduce(Op):
    name = OP

    # ---- per call ---------------------------------------------------------------------------
    def __call__(self, ctx, a, b, out, b_layout, out_dtype, deterministic, stream, options):
        ctx.check()
        s = as_stream(stream)
        opts = _DEFAULT if options is None else options
        if opts is not _DEFAULT:
            if not isinstance(opts, GemmArOptions):
                raise TypeError(f"{WHAT}: options must be a GemmArOptions, got {type(opts).__name__}")
            checked_once(opts)
        A, B, M, K, N = parse_operands(WHAT, a, b, b_layout, s)
        O, result = make_out(WHAT, out, out_dtype, A, (M, N), ctx.device, s)
        check_no_overlap(WHAT, ((O, "out", A, "a"), (O, "out", B, "b")))
        call = _Call()
        call.stream, call.a, call.b, call.o = s, A, B, O
        call.b_layout, call.out_dtype, call.deterministic, call.options = b_layout, out_dtype, bool(deterministic), opts
        call.M, call.K, call.N = M, K, N
        call.key = (A.shape, A.strides, A.dtype, A.device, A.ptr % 16 == 0, B.shape, B.strides, B.dtype, B.device,
                    B.ptr % 16 == 0, O.shape, O.strides, O.dtype, O.device, O.readonly, O.ptr % 16 == 0, b_layout,
                    out_dtype, call.deterministic, s, opts)
        self.invoke(ctx.op_state(OP), call, ctx)
        return result

    # ---- first call of a key ----------------------------------------------------------------
    def validate(self, ctx, call):
        require_gemm_device(WHAT, ctx.device)
        validate_operands(ctx, call, WHAT, (call.M, call.N), f"the whole {call.M} x {call.N} sum, on every rank")

    def _local_signature(self, ctx, call) -> tuple:
        """What every rank's call must share (K_r may differ: it is exchanged)."""
        return (call.a.dtype.name, call.o.dtype.name, call.M, call.N, call.b_layout, call.deterministic,
                repr(call.options), ctx.local_size, ctx.resident_sms)

    def compile(self, ctx, call):
        """Exchange K_r, plan, and compile the fused kernel before the ranks agree: a rank compiling for
        seconds then delays the host agreement (bounded, waited for by every rank), never a peer's kernel."""
        sig = self._local_signature(ctx, call)
        ks = exchange_ks(ctx, OP, WHAT, sig, call.K) if ctx.local_size > 1 else (call.K,)
        call.local_sig = sig
        call.plan = make_plan(call.M, call.N, ks, ctx.local_rank, b_layout=call.b_layout, in_dtype=call.a.dtype.name,
                              out_dtype=call.o.dtype.name, sms=ctx.resident_sms, options=call.options,
                              deterministic=call.deterministic)
        if call.plan.path in ("latency", "bandwidth"):
            fused_kernel(ctx, call.plan)

    def agree(self, ctx, call):
        p = call.plan
        return ctx.agree(WHAT, (call.local_sig, p.Ks, p.path, p.config, p.transposed, p.partial_dtype), ctx.node_comm)

    def plan(self, ctx, call, digest):
        return replace(call.plan, digest=digest)

    def bind(self, ctx, call, p: ArPlan) -> BoundCall:
        if p.path == "empty":
            return FnBound(p, lambda stream, c: None)
        if p.path == "gemm":
            return FnBound(p, lambda stream, c: gemm(c.a, c.b, c.o, b_layout=c.b_layout, stream=stream,
                                                         options=gemm_options(c)))
        if p.path == "unfused":
            return _UnfusedBound(ctx, call, p)
        return _fused_bound(ctx, call, p)


_OP = GemmAllReduce()


def gemm_all_reduce(ctx, a, b, out=None, *, b_layout: str = "kn", out_dtype: str | None = None,
                    deterministic: bool = False, stream=None, options: GemmArOptions | None = None):
    """Row-parallel GEMM + AllReduce over the local ranks: every rank returns ``C = sum_r A_r @ B_r``, the same
    bits on every rank.

    Local rank r (of ``P = ctx.local_size``, one node; ``ctx.num_nodes`` must be 1) holds ``a`` = ``A_r``
    ``[M, K_r]`` (M the same on every rank, K_r its own share of the reduction) and ``b`` = ``B_r``,
    ``[K_r, N]`` for ``b_layout="kn"`` or ``[N, K_r]`` for "nk" (N the same on every rank); both bf16 or
    both fp16, any row strides, unit stride along the last axis, on ``ctx``'s GPU.  ``out``: ``[M, N]`` of
    ``out_dtype`` (default a's; bf16, fp16 or fp32), unit column stride, any row stride, not overlapping
    ``a`` or ``b``; allocated when None.  Partials are rounded to the partial dtype (out's, or
    ``options.partial_dtype``) and summed in fp32 in a fixed order.  ``deterministic``: bit-identical
    results run after run (every path sums in a fixed order already, so this costs nothing).  ``stream``:
    any stream-like object or raw handle (None: the legacy default stream).  ``options``:
    :class:`GemmArOptions` (path, tile config, partial dtype, transposed decode tiles, cost model), equal on
    every rank.  The path that ran: ``ctx.last_plan("gemm_ar")`` ("latency", "bandwidth", "unfused", "gemm"
    or "empty").  Every rank must make the same calls in the same order.  No host synchronization;
    CUDA-graph capturable once a call of the same shape ran outside the capture.  Returns ``out``."""
    return _OP(ctx, a, b, out, b_layout, out_dtype, deterministic, stream, options)
