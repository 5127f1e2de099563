"""The whole MoE layer (:func:`moe_layer`): route -> dispatch -> gate/up grouped GEMM -> SwiGLU -> down
grouped GEMM -> combine, composed from the MoE ops on one stream (docs/moe.md, "Layer"); SwiGLU in the
gate/up GEMM's epilogue with ``MoeOptions.swiglu_epilogue`` (:func:`swiglu_path`); the down GEMM and the
combine as one kernel with ``MoeOptions.fused_combine`` (:func:`combine_path`); everything after the routing
as one kernel with ``MoeOptions.one_kernel`` (:func:`one_kernel_path`)."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ...core.arrays import DeviceArray
from ...core.compiler import kernel
from ...core.interop import as_device_array, require
from ...core.util import ceil_div
from ..base import BoundCall, Op, as_stream, check_no_overlap
from ..gemm import grouped_gemm, grouped_gemm_swiglu, swiglu_candidates
from .fused import moe_dispatch_gemm
from .fused_combine import moe_gemm_combine
from .fused_layer import check_layer_arrays, layer_config, moe_ffn_fused
from .layout import SOURCE, fused_swiglu_config, kernel_defines
from .op import (DTYPE_CODES, MoePlan, MoeRouting, check_sizes, moe_combine, moe_dispatch, moe_options, moe_route,
                 _ptr, one_node, routing_source)
from .options import MoeOptions

__all__ = ["moe_layer", "swiglu_path", "combine_path", "one_kernel_path"]


def swiglu_path(F: int, options: MoeOptions) -> str:
    """Where the layer computes SwiGLU: "epilogue" (the gate/up GEMM -- ``grouped_gemm_swiglu``, or with
    ``options.fused`` the fused dispatch kernel's SwiGLU variant -- writes act, never h) when
    ``options.swiglu_epilogue`` and F is a multiple of the pair width of a config that GEMM runs on; else
    "kernel" (h, then mk_moe_swiglu).  docs/moe.md, "SwiGLU epilogue"."""
    if not options.swiglu_epilogue:
        return "kernel"
    suits = fused_swiglu_config(F, options) is not None if options.fused else bool(swiglu_candidates(F))
    return "epilogue" if suits else "kernel"


def combine_path(options: MoeOptions, x_dtype: str, out_dtype: str) -> str:
    """How the layer runs the down GEMM and the combine: "fused" (one kernel, :func:`moe_gemm_combine`) when
    ``options.fused_combine`` and out has x's dtype (the fused kernel's sums are stored in it), else "kernel"
    (the down grouped GEMM, then :func:`moe_combine`).  docs/moe.md, "Down GEMM + combine, fused"."""
    return "fused" if options.fused_combine and out_dtype == x_dtype else "kernel"


def one_kernel_path(F: int, options: MoeOptions, x_dtype: str, out_dtype: str) -> bool:
    """Whether the layer runs everything after the routing as one kernel (:func:`moe_ffn_fused`): with
    ``options.one_kernel``, where a fused config's pair width divides F (:func:`layer_config`) and out has x's
    dtype (the kernel's sums are stored in it); the plan's ``combine`` is then "layer".  docs/moe.md, "The layer
    in one kernel"."""
    return options.one_kernel and out_dtype == x_dtype and layer_config(F, options) is not None


class _LayerBound(BoundCall):
    """route -> dispatch -> grouped GEMM (gate/up) -> SwiGLU -> grouped GEMM (down) -> combine on one stream
    (``options.fused``: dispatch and the gate/up GEMM in one kernel; low-latency mode: routing and dispatch
    in one kernel; ``plan.swiglu == "epilogue"``: SwiGLU in the gate/up GEMM's epilogue, no h, whichever
    kernel runs that GEMM); the intermediate buffers belong to this bound call.  ``plan.combine == "layer"``:
    route, then everything else in one kernel (:func:`moe_ffn_fused`, whose bound call owns x_recv and act)."""

    def __init__(self, ctx, call, plan):
        self.plan, self._ctx = plan, ctx
        X = call.x
        T, H = X.shape
        wg, wd = call.sig
        El, F2 = wg.shape[0], wg.shape[1]
        F = F2 // 2
        dev, dt = ctx.device, X.dtype.name
        self.routing = MoeRouting(ctx, T, call.routing.k, call.routing.E, call.options)
        if plan.combine == "layer":  # (the one kernel's op owns x_recv and act)
            return
        rr = self.routing.recv_rows
        self._x_recv = DeviceArray.empty((rr, H), dt, device=dev)
        self._act = DeviceArray.empty((rr, F), dt, device=dev)
        # y [rr, H] only where the down GEMM writes it (plan.combine "kernel"); the fused kernel never does
        self._y = DeviceArray.empty((rr, H), dt, device=dev) if plan.combine == "kernel" else None
        if plan.swiglu == "epilogue":
            self._h = self._swiglu = None
            self.buffers = (self._x_recv, self._act, self._y)
            return
        self._h = DeviceArray.empty((rr, F2), dt, device=dev)
        self.buffers = (self._x_recv, self._h, self._act, self._y)
        c = DTYPE_CODES[dt]
        sw = kernel(SOURCE, kernel_defines(c, c, 2), "mk_moe_swiglu")
        self._h_arg, self._a_arg = _ptr(self._h.ptr), _ptr(self._act.ptr)
        rows = self.routing.expert_offsets.ptr + 4 * El
        g = max(1, min(ceil_div(rr * F // 8, 256), 8 * ctx.sm_count))
        self._swiglu = sw.prepare(g, 256, [self._h_arg, self._a_arg, _ptr(rows), ctypes.c_int32(rr),
                                           ctypes.c_int32(F)], stream=call.stream)

    def run(self, stream, call):
        ctx, R, opts = self._ctx, self.routing, call.options
        wg, wd = call.sig
        if opts.mode == "low_latency":
            moe_dispatch(ctx, call.x, R, self._x_recv, logits=call.logits, topk_ids=call.ids,
                         topk_weights=call.weights, stream=stream, options=opts)
        else:
            if call.logits is not None:
                moe_route(ctx, call.logits, k=R.k, out=R, stream=stream, options=opts)
            else:
                moe_route(ctx, topk_ids=call.ids, topk_weights=call.weights, num_experts=R.E, out=R, stream=stream,
                          options=opts)
            if self.plan.combine == "layer":
                moe_ffn_fused(ctx, call.x, R, wg, wd, call.o, stream=stream, options=opts)
                return
            if not opts.fused:
                moe_dispatch(ctx, call.x, R, self._x_recv, stream=stream, options=opts)
        self._gate_up(stream, call)
        if self._y is None:
            moe_gemm_combine(ctx, self._act, R, wd, call.o, stream=stream, options=opts)
        else:
            grouped_gemm(self._act, wd, R.expert_offsets, out=self._y, b_layout="nk", stream=stream)
            moe_combine(ctx, self._y, R, call.o, stream=stream, options=opts)

    def _gate_up(self, stream, call) -> None:
        """act from x_recv: the gate/up GEMM (fused with the dispatch under ``options.fused``), SwiGLU in its
        epilogue (``self._h`` None) or the separate kernel after it."""
        R, opts, wg = self.routing, call.options, call.sig[0]
        out = self._act if self._h is None else self._h
        if opts.fused:
            moe_dispatch_gemm(self._ctx, call.x, R, wg, out, x_recv=self._x_recv, stream=stream, options=opts,
                              swiglu=self._h is None)
        elif self._h is None:
            grouped_gemm_swiglu(self._x_recv, wg, R.expert_offsets, out=out, stream=stream)
        else:
            grouped_gemm(self._x_recv, wg, R.expert_offsets, out=out, b_layout="nk", stream=stream)
        if self._swiglu is not None:
            self._swiglu.submit()


@dataclass(frozen=True)
class _RoutingSpec:
    k: int
    E: int


class _Call:
    __slots__ = ("key", "stream", "x", "options", "sig", "logits", "ids", "weights", "routing", "o")


class _Layer(Op):
    generation_keyed = True
    name = "moe_layer"
    what = "mkernel.moe_layer"

    def __call__(self, ctx, x, w_gate_up, w_down, logits, topk_ids, topk_weights, k, out, stream, options):
        ctx.check()
        s = as_stream(stream)
        opts = moe_options(options, self.what)
        X = as_device_array(x, name="moe_layer: x", stream=s)
        WG = as_device_array(w_gate_up, name="moe_layer: w_gate_up", stream=s)
        WD = as_device_array(w_down, name="moe_layer: w_down", stream=s)
        call = _Call()
        call.stream, call.x, call.options, call.sig = s, X, opts, (WG, WD)
        if WG.ndim != 3:
            raise ValueError(f"{self.what}: w_gate_up must be [E_local, 2F, H], got shape {tuple(WG.shape)}")
        E = WG.shape[0] * ctx.local_size
        src = routing_source(self.what, call, logits, topk_ids, topk_weights, s)
        if logits is not None:
            if k is None:
                raise ValueError(f"{self.what}: k is required with logits")
        else:
            if call.ids.ndim != 2:
                raise ValueError(f"{self.what}: topk_ids must be [T, k], got shape {tuple(call.ids.shape)}")
            k = call.ids.shape[1]
        call.routing = _RoutingSpec(int(k), E)
        T = X.shape[0] if X.ndim == 2 else 0
        if out is None:
            O = result = DeviceArray.empty((T, X.shape[-1]), X.dtype, device=ctx.device)
        else:
            O = as_device_array(out, name="moe_layer: out", stream=s)
            result = out
        call.o = O
        if opts.one_kernel:  # (the one kernel reads x and the weights while its sum blocks write out)
            check_no_overlap(self.what, ((O, "out", X, "x"), (O, "out", WG, "w_gate_up"), (O, "out", WD, "w_down")))
        call.key = (X.shape, X.strides, X.dtype, WG.shape, WG.strides, WG.dtype, WD.shape, WD.strides, WD.dtype,
                    O.shape, O.dtype, src, int(k), s, opts, ctx.workspace_generation)
        bound = self.invoke(ctx.op_state(self.name), call, ctx)
        return result, bound.routing

    def validate(self, ctx, call):
        one_node(ctx, self.what)
        X, (WG, WD) = call.x, call.sig
        require(X, f"{self.what}: x", dtypes=("bfloat16", "float16"), ndim=2, device=ctx.device)
        T, H = X.shape
        El, F2 = WG.shape[0], WG.shape[1]
        require(WG, f"{self.what}: w_gate_up", dtypes=(X.dtype.name,), shape=(El, F2, H), device=ctx.device)
        if F2 % 16 or F2 == 0:
            raise ValueError(f"{self.what}: w_gate_up's second dim (2F = {F2}) must be a positive multiple of 16")
        require(WD, f"{self.what}: w_down", dtypes=(X.dtype.name,), shape=(El, H, F2 // 2), device=ctx.device)
        check_sizes(self.what, ctx.local_size, T, call.routing.k, call.routing.E)
        F, opts = F2 // 2, call.options
        if one_kernel_path(F, opts, X.dtype.name, call.o.dtype.name):  # (before the routing launches)
            check_layer_arrays(self.what, ctx, T, El, X, WG, WD, call.o, layer_config(F, opts), opts)

    def plan(self, ctx, call, digest):
        F, xd, od = call.sig[0].shape[1] // 2, call.x.dtype.name, call.o.dtype.name
        if one_kernel_path(F, call.options, xd, od):
            return MoePlan(self.name, swiglu="epilogue", combine="layer")
        return MoePlan(self.name, swiglu=swiglu_path(F, call.options), combine=combine_path(call.options, xd, od))

    def describe_call(self, call):
        return f"x {call.x.dtype.name}{list(call.x.shape)} w_gate_up {list(call.sig[0].shape)} k={call.routing.k}"

    def bind(self, ctx, call, plan):
        return _LayerBound(ctx, call, plan)



_LAYER = _Layer()


def moe_layer(ctx, x, w_gate_up, w_down, logits=None, *, topk_ids=None, topk_weights=None, k: int | None = None,
              out=None, stream=None, options: MoeOptions | None = None):
    """A whole MoE layer: route -> dispatch -> grouped GEMM (gate / up) -> SwiGLU -> grouped GEMM (down) ->
    combine, on ``stream``, no host synchronization (docs/moe.md, "Layer").  ``options.fused``: the dispatch
    and the gate/up GEMM run as one kernel (:func:`moe_dispatch_gemm`); ``options.mode="low_latency"``
    (T <= 256): routing and dispatch run as one kernel; ``options.swiglu_epilogue``: SwiGLU in the gate/up
    GEMM's epilogue where F allows (:func:`swiglu_path`; the plan's ``swiglu`` says which ran);
    ``options.fused_combine``: the down GEMM and the combine run as one kernel (:func:`moe_gemm_combine`)
    where out has x's dtype (:func:`combine_path`; the plan's ``combine`` says which ran).
    ``options.one_kernel``: everything after the routing runs as one kernel (docs/moe.md, "The layer in one
    kernel") where F and out's dtype allow (:func:`one_kernel_path`; the plan's ``combine`` is then "layer").

    ``x``: ``[T, H]`` bf16 / fp16; ``w_gate_up``: this rank's experts ``[E_local, 2F, H]`` (gate rows
    ``[0, F)``, up rows ``[F, 2F)``); ``w_down``: ``[E_local, H, F]``; routing from ``logits [T, E]`` with
    ``k`` or from ``topk_ids`` / ``topk_weights`` (E = E_local * P).  Returns ``(out [T, H], routing)``:
    the routing is the dispatch map (:class:`MoeRouting`), owned by the op and rewritten by the next call
    of the same shapes."""
    return _LAYER(ctx, x, w_gate_up, w_down, logits, topk_ids, topk_weights, k, out, stream, options)
