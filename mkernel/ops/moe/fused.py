"""MoE dispatch fused with the gate/up grouped GEMM (:func:`moe_dispatch_gemm`), on the op pipeline
(:mod:`mkernel.ops.base`).  Kernel: ``cuda_src/ops/moe_gemm.cu``; design: docs/moe.md, "Dispatch + grouped
GEMM, fused".

One cooperative launch within this rank's share of the SMs (``ctx.resident_sms``): communication blocks
move the rows (the protocol of :func:`mkernel.moe_dispatch`, own rows first) and count them per (expert,
row block); GEMM blocks multiply each row block as soon as its count is complete, the row blocks of this
rank's own rows first (from the routing's ``src_offsets``).  The arrival counters belong to the bound call
and are zeroed on the stream before every launch (graph-capturable).  With ``swiglu=True`` the kernel's
SwiGLU variant writes ``act`` instead of h (docs/moe.md, "SwiGLU epilogue").
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
from .layout import (FUSED_SOURCE, MoeGemmArgs, arrived_slots, dispatch_layout, fused_config, fused_grid,
                     fused_swiglu_config, make_shape, no_swiglu_config)
from .gemm_bound import GemmKernelBound, gemm_operands
from .op import MoePlan, MoeRouting, one_node
from .options import FUSED_CONFIGS, MoeOptions

__all__ = ["moe_dispatch_gemm", "fused_defines"]

NAME = "mk_moe_dispatch_gemm"


def fused_defines(dtype: str, config: int, swiglu: bool = False) -> dict:
    """The specialization of moe_gemm.cu: the GEMM's defines of (dtype in = out, config); ``swiglu``: its
    SwiGLU variant (``MK_MOE_SWIGLU``; absent otherwise, so the h kernel's defines stay as they were)."""
    d = G.defines(dtype, dtype, config)
    return {**d, "MK_MOE_SWIGLU": 1} if swiglu else d


for _dt in G.IN_DTYPES:
    for _c in FUSED_CONFIGS:
        register_specialization(FUSED_SOURCE, fused_defines(_dt, _c))
        register_specialization(FUSED_SOURCE, fused_defines(_dt, _c, swiglu=True))


class _Call:
    __slots__ = ("key", "stream", "x", "routing", "wg", "o", "xr", "options", "swiglu", "config")


class _FusedBound(GemmKernelBound):
    """The arrival counters' memset, B's staging (if any), then the cooperative launch; each call re-points
    the arguments at its arrays."""

    def __init__(self, ctx, call, p: MoePlan):
        self.plan = p
        R, X, WG = call.routing, call.x, call.wg
        T, H = X.shape
        dt, isz = X.dtype.name, X.dtype.itemsize
        El, N = WG.shape[0], WG.shape[1]
        cfg = G.CONFIGS[call.config]
        rr = R.recv_rows
        self._stream = call.stream
        ws = ctx.workspace(("moe_dispatch_gemm",), p.ws_bytes, call.stream, "mkernel.moe_dispatch_gemm")
        self._own_xr = None
        if call.xr is None:
            self._own_xr = DeviceArray.empty((rr, H), dt, device=ctx.device)
        xr = call.xr if call.xr is not None else self._own_xr
        n_slots = arrived_slots(El, rr, cfg.bm)
        self._arrived = DeviceArray.empty((n_slots,), "int64", device=ctx.device)
        a = self._args = MoeGemmArgs()
        a.ws, a.peers, a.arrived = ws.ptr, ws.peer_table, self._arrived.ptr
        a.ldc, a.N, a.K = (N // 2 if call.swiglu else N), N, H
        comm_blocks, workers = fused_grid(ctx.resident_sms, call.options)
        a.n_comm, a.group_m = comm_blocks, G.GROUP_M
        self._tma = TensorMapArg(xr.ptr, dt, (H, rr), (H * isz,), (64, cfg.bm))
        self._b = (G.gate_up_arg(WG, H, N // 2, cfg, dt, dt, ctx.device) if call.swiglu else
                   G.b_arg(WG, H, N, "nk", cfg, dt, dt, ctx.device))
        self._src_offs = ctypes.c_uint64()  # the routing's src_offsets: the tile order (this rank's rows first)
        self._point(call, xr)
        shape = make_shape(ctx.local_size, T, H, R.k, R.E, R.options)
        k = kernel(FUSED_SOURCE, fused_defines(dt, call.config, call.swiglu), NAME)
        comm = ctx.comm_args("moe_dispatch_gemm", p.digest)
        self.prepare(k, p.grid, cfg, [self._tma.buf, self._b.map.buf, comm, p.layout, shape, a, self._src_offs],
                     call.stream, zero=((self._arrived.ptr, 2 * n_slots),))
        self.buffers = (ws, self._arrived, self._own_xr, *self._b.keep)

    def _point(self, call, xr) -> None:
        a, R = self._args, call.routing
        a.point(call.x.ptr, R)
        self._src_offs.value = R.src_offsets.ptr
        a.x_recv, a.c, a.c_vec_ok = xr.ptr, call.o.ptr, vec_ok(call.o, a.ldc, R.recv_rows)
        self._tma.point(xr.ptr)
        self._b.point(call.wg.ptr)

    def x_recv(self, call):
        return call.xr if call.xr is not None else self._own_xr

    def run(self, stream, call):
        self._point(call, self.x_recv(call))
        self.submit()


class _DispatchGemm(Op):
    generation_keyed = True
    name = "moe_dispatch_gemm"
    what = "mkernel.moe_dispatch_gemm"

    def __call__(self, ctx, x, routing, w_gate_up, out, x_recv, stream, options, swiglu):
        s, opts, R, X, WG = gemm_operands(self, ctx, stream, options, routing, x, w_gate_up, ("x", "w_gate_up"),
                                          ("[T, H]", "[E_local, 2F, H]"))
        if not isinstance(swiglu, bool):
            raise TypeError(f"{self.what}: swiglu must be a bool, got {swiglu!r}")
        N = WG.shape[1] // 2 if swiglu else WG.shape[1]  # out's columns: act's F or h's 2F
        O = DeviceArray.empty((R.recv_rows, N), X.dtype.name, device=ctx.device) if out is None else \
            as_device_array(out, name="moe_dispatch_gemm: out", stream=s)
        XR = None if x_recv is None else as_device_array(x_recv, name="moe_dispatch_gemm: x_recv", stream=s)
        check_no_overlap(self.what, ((O, "out", X, "x"), (O, "out", WG, "w_gate_up"), (O, "out", XR, "x_recv"),
                                     (XR, "x_recv", X, "x"), (XR, "x_recv", WG, "w_gate_up")))
        call = _Call()
        call.stream, call.x, call.routing, call.wg, call.o, call.xr, call.options = s, X, R, WG, O, XR, opts
        call.swiglu = swiglu
        call.config = fused_swiglu_config(WG.shape[1] // 2, opts) if swiglu else fused_config(WG.shape[1], opts)
        lk = G.layout_key
        call.key = (lk(X), lk(WG), lk(O), O.readonly, None if XR is None else (lk(XR), XR.readonly, XR.ptr % 16 == 0),
                    X.ptr % 16 == 0, R._key, s, opts, swiglu, ctx.workspace_generation)
        bound = self.invoke(ctx.op_state(self.name), call, ctx)
        return call.o, bound.x_recv(call)

    def validate(self, ctx, call):
        one_node(ctx, self.what)
        require_gemm_device(self.what, ctx.device)
        R, X, WG, O, XR = call.routing, call.x, call.wg, call.o, call.xr
        if R.options.mode != "throughput":
            raise ValueError(f"{self.what}: the routing was made in {R.options.mode!r} mode; the fused path is "
                             f"a throughput-mode path")
        require(X, f"{self.what}: x", dtypes=G.IN_DTYPES, device=ctx.device, shape=(R.T, None), align=16)
        H, dt = X.shape[1], X.dtype.name
        if (H * X.dtype.itemsize) % 16 or H == 0:
            raise ValueError(f"{self.what}: rows of x must be a positive multiple of 16 bytes (H={H} {dt})")
        El = R.E_local
        require(WG, f"{self.what}: w_gate_up", dtypes=(dt,), device=ctx.device, shape=(El, None, H))
        N = WG.shape[1]
        if N == 0 or N % 8:
            raise ValueError(f"{self.what}: w_gate_up's second dim (2F = {N}) must be a positive multiple of 8")
        if call.swiglu:
            self._validate_swiglu(call)
        require(O, f"{self.what}: out", dtypes=(dt,), device=ctx.device,
                shape=(R.recv_rows, N // 2 if call.swiglu else N), writable=True)
        if not O.is_contiguous():
            raise ValueError(f"{self.what}: out must be C-contiguous")
        if XR is not None:
            require(XR, f"{self.what}: x_recv", dtypes=(dt,), device=ctx.device, shape=(R.recv_rows, H), align=16,
                    writable=True)
            if not XR.is_contiguous():
                raise ValueError(f"{self.what}: x_recv must be C-contiguous")
        if ctx.resident_sms < 2:
            raise RuntimeError(f"{self.what}: needs at least 2 SMs of this rank's share (has {ctx.resident_sms})")

    def _validate_swiglu(self, call) -> None:
        """SwiGLU needs F a multiple of the fused config's pair width (docs/moe.md, "SwiGLU epilogue")."""
        if call.config is None:
            raise no_swiglu_config(self.what, call.wg.shape[1] // 2, call.options, "swiglu=True")

    def compile(self, ctx, call):
        cfg = G.CONFIGS[call.config]
        k = kernel(FUSED_SOURCE, fused_defines(call.x.dtype.name, call.config, call.swiglu), NAME)
        if k.max_active_blocks_per_sm(cfg.threads, cfg.smem) < 1:
            raise RuntimeError(f"{self.what}: config {call.config} cannot be resident on this GPU")

    def agree(self, ctx, call):
        R, X = call.routing, call.x
        return ctx.agree(self.what, (X.dtype.name, X.shape[1], call.wg.shape[1], R.T, R.k, R.E, R.recv_rows,
                                     R.capacity, call.config, call.swiglu, repr(call.options), ctx.resident_sms),
                         ctx.world)

    def describe_call(self, call):
        sw = " swiglu" if call.swiglu else ""
        return f"x {call.x.dtype.name}{list(call.x.shape)} w_gate_up {list(call.wg.shape)}{sw} {call.routing!r}"

    def plan(self, ctx, call, digest):
        R, X = call.routing, call.x
        L, total = dispatch_layout(ctx.local_size, R.T, X.shape[1] * X.dtype.itemsize, R.recv_rows)
        comm, workers = fused_grid(ctx.resident_sms, call.options)
        return MoePlan(self.name, comm + workers, R.recv_rows, digest, L, total,
                       swiglu="epilogue" if call.swiglu else "")

    def bind(self, ctx, call, p: MoePlan) -> GemmKernelBound:
        return _FusedBound(ctx, call, p)


_DISPATCH_GEMM = _DispatchGemm()


def moe_dispatch_gemm(ctx, x, routing: MoeRouting, w_gate_up, out=None, *, x_recv=None, stream=None,
                      options: MoeOptions | None = None, swiglu: bool = False):
    """Dispatch fused with the gate/up grouped GEMM: ``h[r] = x_recv[r] @ w_gate_up[l].T`` for the rows r
    of every local expert l, each 128-row block multiplied as soon as its rows have landed (this rank's
    own rows first); one persistent kernel (docs/moe.md, "Dispatch + grouped GEMM, fused").

    ``x``: ``[T, H]`` bf16 / fp16, rows a multiple of 16 bytes; ``routing``: this call's
    :func:`moe_route` result (throughput mode); ``w_gate_up``: this rank's experts ``[E_local, 2F, H]`` of
    x's dtype.  ``out``: ``[routing.recv_rows, 2F]`` of x's dtype (allocated when None); ``x_recv``:
    ``[routing.recv_rows, H]`` (C-contiguous, 16-byte aligned), where the received rows land (None: a
    buffer owned by the op, rewritten by the next call of the same shapes).  Rows ``[o[l], o[l+1])`` (``o =
    routing.expert_offsets``) are local expert l's, as after :func:`moe_dispatch`; rows past
    ``o[E_local]`` are not written.  Fills ``routing.recv_map``.  Returns ``(out, x_recv)``.

    ``swiglu=True``: ``out`` is ``act [routing.recv_rows, F]`` = ``silu(h[:, :F]) * h[:, F:]`` (fp32 from the
    accumulators, x's dtype), computed in the GEMM's epilogue; h is never written (docs/moe.md, "SwiGLU
    epilogue").  F must be a multiple of a fused config's pair width (``MoeOptions.gemm_config``'s if set;
    :func:`mkernel.ops.moe.layout.fused_swiglu_config`), else ValueError before any launch."""
    return _DISPATCH_GEMM(ctx, x, routing, w_gate_up, out, x_recv, stream, options, swiglu)
