"""The MoE layer after routing in one persistent kernel (:func:`moe_ffn_fused`), on the op pipeline
(:mod:`mkernel.ops.base`).  Kernel: ``cuda_src/ops/moe_layer.cu``; design: docs/moe.md, "The layer in one
kernel".

One cooperative launch within this rank's share of the SMs (``ctx.resident_sms``): communication blocks run
the dispatch of :func:`mkernel.moe_dispatch_gemm` and then, once every rank's down tiles are stored, the owner
sums of :func:`mkernel.moe_gemm_combine`; GEMM blocks run the gate/up grouped GEMM with SwiGLU in its epilogue
(each row block as soon as its rows have landed), then the down grouped GEMM (each row block as soon as all its
act columns are stored) whose tiles go straight into the token owners' combine staging.  ``x_recv`` and
``act`` belong to the bound call; h and y are never written.  Per launch the host zeroes the bound call's
counters (rows landed and act tiles stored per (expert, row block), loop (2) tiles finished) and this rank's
combine counters in the workspace (graph-capturable memsets).
"""
from __future__ import annotations

import ctypes

from ...core.archs import require_gemm_device
from ...core.arrays import DeviceArray
from ...core.compiler import kernel, register_specialization
from ...core.interop import as_device_array, require
from ...core.tensormap import TensorMapArg
from ..base import Op, check_no_overlap
from .. import gemm as G  # the GEMM package's public planning API
from ..gemm.operands import vec_ok
from .layout import (LAYER_SOURCE, MoeCombineArgs, MoeGemmArgs, arrived_slots, fused_grid, fused_swiglu_config,
                     layer_layout, make_shape, no_swiglu_config)
from .gemm_bound import GemmKernelBound, gemm_operands
from .op import MoePlan, MoeRouting, one_node
from .options import FUSED_CONFIGS, MoeOptions

__all__ = ["moe_ffn_fused", "layer_defines", "layer_config", "check_layer_arrays"]

NAME = "mk_moe_layer"


def layer_defines(dtype: str, config: int) -> dict:
    """The specialization of moe_layer.cu: the GEMM's defines of (dtype in = out, config)."""
    return G.defines(dtype, dtype, config)


def layer_config(F: int, options: MoeOptions) -> int | None:
    """The kernel's one tile config (both GEMMs): the fused SwiGLU kernel's choice for F
    (:func:`mkernel.ops.moe.layout.fused_swiglu_config`: its pair width divides F), None where none does."""
    return fused_swiglu_config(F, options)


for _dt in G.IN_DTYPES:
    for _c in FUSED_CONFIGS:
        register_specialization(LAYER_SOURCE, layer_defines(_dt, _c))


def check_layer_arrays(what: str, ctx, T: int, El: int, X, WG, WD, O, config: int | None,
                       options: MoeOptions) -> None:
    """The kernel's checks of its arrays for T tokens and El local experts (``config``: :func:`layer_config`'s
    choice): TypeError / ValueError / RuntimeError before any launch.  :func:`mkernel.moe_layer` makes them
    before it routes."""
    require_gemm_device(what, ctx.device)
    require(X, f"{what}: x", dtypes=G.IN_DTYPES, device=ctx.device, shape=(T, None), align=16)
    H, dt, isz = X.shape[1], X.dtype.name, X.dtype.itemsize
    if H == 0 or (H * isz) % 16:
        raise ValueError(f"{what}: rows of x must be a positive multiple of 16 bytes (H={H} {dt})")
    require(WG, f"{what}: w_gate_up", dtypes=(dt,), device=ctx.device, shape=(El, None, H))
    F2 = WG.shape[1]
    if F2 == 0 or F2 % 16:
        raise ValueError(f"{what}: w_gate_up's second dim (2F = {F2}) must be a positive multiple of 16")
    F = F2 // 2
    require(WD, f"{what}: w_down", dtypes=(dt,), device=ctx.device, shape=(El, H, F))
    require(O, f"{what}: out", dtypes=(dt,), device=ctx.device, shape=(T, H), align=16, writable=True)
    if config is None:
        raise no_swiglu_config(what, F, options, "the layer in one kernel")
    if ctx.resident_sms < 2:
        raise RuntimeError(f"{what}: needs at least 2 SMs of this rank's share (has {ctx.resident_sms})")


class _Call:
    __slots__ = ("key", "stream", "x", "routing", "wg", "wd", "o", "options", "config")


class _LayerBound(GemmKernelBound):
    """The counters' memsets, the weights' staging (if any), then the cooperative launch; each call re-points
    the arguments at its arrays.  ``x_recv [recv_rows, H]`` and ``act [recv_rows, F]`` are the bound call's."""

    def __init__(self, ctx, call, p: MoePlan):
        self.plan = p
        R, X, WG, WD = call.routing, call.x, call.wg, call.wd
        T, H = X.shape
        dt, isz = X.dtype.name, X.dtype.itemsize
        El, F = WG.shape[0], WG.shape[1] // 2
        cfg = G.CONFIGS[call.config]
        rr, dev = R.recv_rows, ctx.device
        Ld, Lc = p.layout
        self._ws = ctx.workspace(("moe_ffn_fused",), p.ws_bytes, call.stream, "mkernel.moe_layer")
        self.x_recv = DeviceArray.empty((rr, H), dt, device=dev)
        self.act = DeviceArray.empty((rr, F), dt, device=dev)
        n_slots = arrived_slots(El, rr, cfg.bm)
        # arrived [n_slots], act_done [n_slots], down_done (this rank's loop (2) tiles finished)
        self._counters = DeviceArray.empty((2 * n_slots + 1,), "int64", device=dev)
        zero = ((self._counters.ptr, 2 * (2 * n_slots + 1)), (self._ws.ptr + Lc.counts_off, 2 * R.T * R.k))
        n_comm = fused_grid(ctx.resident_sms, call.options)[0]
        a = self._a = MoeGemmArgs()
        a.x_recv, a.c, a.ws, a.peers, a.arrived = self.x_recv.ptr, self.act.ptr, self._ws.ptr, self._ws.peer_table, \
            self._counters.ptr
        a.ldc, a.N, a.K, a.n_comm, a.group_m = F, 2 * F, H, n_comm, G.GROUP_M
        a.c_vec_ok = vec_ok(self.act, F, rr)
        b = self._bargs = MoeCombineArgs()
        b.ws, b.peers, b.K, b.n_comm, b.group_m = self._ws.ptr, self._ws.peer_table, F, n_comm, G.GROUP_M
        self._tm_x = TensorMapArg(self.x_recv.ptr, dt, (H, rr), (H * isz,), (64, cfg.bm))
        self._tm_act = TensorMapArg(self.act.ptr, dt, (F, rr), (F * isz,), (64, cfg.bm))
        self._gu = G.gate_up_arg(WG, H, F, cfg, dt, dt, dev)
        self._wd = G.b_arg(WD, F, H, "nk", cfg, dt, dt, dev)
        self._point(call)
        shape = make_shape(ctx.local_size, T, H, R.k, R.E, R.options)
        k = kernel(LAYER_SOURCE, layer_defines(dt, call.config), NAME)
        comm = ctx.comm_args("moe_ffn_fused", p.digest)
        args = [self._tm_x.buf, self._gu.map.buf, self._tm_act.buf, self._wd.map.buf, comm, Ld, Lc, shape, a, b,
                ctypes.c_int32(n_slots)]
        self.prepare(k, p.grid, cfg, args, call.stream, operands=(self._gu, self._wd), zero=zero)
        self.buffers = (self._ws, self.x_recv, self.act, self._counters, *self._gu.keep, *self._wd.keep)

    def _point(self, call) -> None:
        self._a.point(call.x.ptr, call.routing)
        self._bargs.point(call.routing, call.o.ptr)
        self._gu.point(call.wg.ptr)
        self._wd.point(call.wd.ptr)

    def run(self, stream, call):
        self._point(call)
        self.submit()


class _FfnFused(Op):
    generation_keyed = True
    name = "moe_ffn_fused"
    what = "mkernel.moe_layer"

    def __call__(self, ctx, x, routing, w_gate_up, w_down, out, stream, options):
        s, opts, R, X, WG = gemm_operands(self, ctx, stream, options, routing, x, w_gate_up, ("x", "w_gate_up"),
                                          ("[T, H]", "[E_local, 2F, H]"))
        WD = as_device_array(w_down, name=f"{self.name}: w_down", stream=s)
        if WD.ndim != 3:
            raise ValueError(f"{self.what}: w_down must be [E_local, H, F], got shape {tuple(WD.shape)}")
        O = DeviceArray.empty((R.T, X.shape[1]), X.dtype.name, device=ctx.device) if out is None else \
            as_device_array(out, name="moe_layer: out", stream=s)
        check_no_overlap(self.what, ((O, "out", X, "x"), (O, "out", WG, "w_gate_up"), (O, "out", WD, "w_down")))
        call = _Call()
        call.stream, call.x, call.routing, call.wg, call.wd, call.o, call.options = s, X, R, WG, WD, O, opts
        call.config = layer_config(WG.shape[1] // 2, opts)
        lk = G.layout_key
        call.key = (lk(X), lk(WG), lk(WD), lk(O), O.readonly, X.ptr % 16 == 0, O.ptr % 16 == 0, R._key, s, opts,
                    ctx.workspace_generation)
        self.invoke(ctx.op_state(self.name), call, ctx)
        return out if out is not None else O

    def validate(self, ctx, call):
        one_node(ctx, self.what)
        R = call.routing
        if R.options.mode != "throughput":
            raise ValueError(f"{self.what}: the routing was made in {R.options.mode!r} mode; the layer in one kernel "
                             f"is a throughput-mode path")
        check_layer_arrays(self.what, ctx, R.T, R.E_local, call.x, call.wg, call.wd, call.o, call.config,
                           call.options)

    def compile(self, ctx, call):
        cfg = G.CONFIGS[call.config]
        k = kernel(LAYER_SOURCE, layer_defines(call.x.dtype.name, call.config), NAME)
        if k.max_active_blocks_per_sm(cfg.threads, cfg.smem) < 1:
            raise RuntimeError(f"{self.what}: config {call.config} cannot be resident on this GPU")

    def agree(self, ctx, call):
        R, X = call.routing, call.x
        return ctx.agree(self.what, ("one_kernel", X.dtype.name, X.shape[1], call.wg.shape[1], R.T, R.k, R.E,
                                     R.recv_rows, R.capacity, call.config, repr(call.options), ctx.resident_sms),
                         ctx.world)

    def describe_call(self, call):
        return (f"one kernel x {call.x.dtype.name}{list(call.x.shape)} w_gate_up {list(call.wg.shape)} "
                f"w_down {list(call.wd.shape)} {call.routing!r}")

    def plan(self, ctx, call, digest):
        R, X = call.routing, call.x
        rb = X.shape[1] * X.dtype.itemsize
        Ld, Lc, total = layer_layout(ctx.local_size, R.T, R.k, rb, rb, R.recv_rows)
        comm, workers = fused_grid(ctx.resident_sms, call.options)
        return MoePlan(self.name, comm + workers, R.recv_rows, digest, (Ld, Lc), total, swiglu="epilogue",
                       combine="layer")

    def bind(self, ctx, call, p: MoePlan) -> GemmKernelBound:
        return _LayerBound(ctx, call, p)


_FFN_FUSED = _FfnFused()


def moe_ffn_fused(ctx, x, routing: MoeRouting, w_gate_up, w_down, out=None, *, stream=None,
                  options: MoeOptions | None = None):
    """The MoE layer after routing in one persistent kernel: ``out[t] = sum_j weights[t, j] * y(t, j)`` with
    ``y = (silu(x_recv @ gate^T) * (x_recv @ up^T)) @ w_down[l]^T`` for the rows every local expert l receives
    (docs/moe.md, "The layer in one kernel"); used by :func:`mkernel.moe_layer` with
    ``MoeOptions(one_kernel=True)``.

    ``x``: ``[T, H]`` bf16 / fp16, C-contiguous, 16-byte aligned rows of a multiple of 16 bytes; ``routing``:
    this call's :func:`mkernel.moe_route` result (throughput mode; its ``recv_map`` is filled, as by
    :func:`mkernel.moe_dispatch`); ``w_gate_up``: this rank's experts ``[E_local, 2F, H]`` (gate rows ``[0,
    F)``, up rows ``[F, 2F)``), ``w_down``: ``[E_local, H, F]``, both of x's dtype; F a multiple of a fused
    config's pair width (:func:`layer_config`), else ValueError before any launch.  ``out``: ``[T, H]`` of x's
    dtype, C-contiguous, 16-byte aligned (allocated when None).  Returns ``out``."""
    return _FFN_FUSED(ctx, x, routing, w_gate_up, w_down, out, stream, options)
