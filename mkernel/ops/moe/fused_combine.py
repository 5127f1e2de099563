"""The MoE down grouped GEMM fused with the combine (:func:`moe_gemm_combine`), on the op pipeline
(:mod:`mkernel.ops.base`).  Kernel: ``cuda_src/ops/moe_gemm_combine.cu``; design: docs/moe.md, "Down GEMM +
combine, fused".

One cooperative launch within this rank's share of the SMs (``ctx.resident_sms``): GEMM blocks multiply each
received row block by its expert's ``w_down`` and store every finished tile's rows straight into the combine
staging of the rows' token owners (NVLink stores), counting them per (token, choice); sum blocks add up each
of this rank's tokens, in choice order, as soon as its counts are complete.  The counters are zeroed on
the stream before every launch (graph-capturable): the workspace is shared by every call of the op, and a
call of another T or k finds the last call's staging rows where its counters lie.
"""
from __future__ import annotations

from ...core.archs import require_gemm_device
from ...core.arrays import DeviceArray
from ...core.compiler import kernel, register_specialization
from ...core.interop import as_device_array, require
from ...core.tensormap import TensorMapArg
from ..base import Op, check_no_overlap
from .. import gemm as G  # the GEMM package's public planning API
from .layout import COMBINE_SOURCE, MoeCombineArgs, fused_config, fused_grid, gemm_combine_layout, make_shape
from .gemm_bound import GemmKernelBound, gemm_operands
from .op import MoePlan, MoeRouting, one_node
from .options import FUSED_CONFIGS, MoeOptions

__all__ = ["moe_gemm_combine", "combine_defines", "combine_config"]

NAME = "mk_moe_gemm_combine"


def combine_defines(dtype: str, config: int) -> dict:
    """The specialization of moe_gemm_combine.cu: the GEMM's defines of (dtype in = out, config)."""
    return G.defines(dtype, dtype, config)


def combine_config(H: int, options: MoeOptions) -> int:
    """The kernel's GEMM tile config for output rows of H columns (the down GEMM's N): as the fused dispatch
    kernel chooses for its N (:func:`mkernel.ops.moe.layout.fused_config`)."""
    return fused_config(H, options)


for _dt in G.IN_DTYPES:
    for _c in FUSED_CONFIGS:
        register_specialization(COMBINE_SOURCE, combine_defines(_dt, _c))


class _Call:
    __slots__ = ("key", "stream", "act", "routing", "wd", "o", "options", "config")


class _CombineBound(GemmKernelBound):
    """B's staging (if any), then the cooperative launch; each call re-points the arguments at its arrays."""

    def __init__(self, ctx, call, p: MoePlan):
        self.plan = p
        R, A, WD = call.routing, call.act, call.wd
        H, F = WD.shape[1], WD.shape[2]
        dt, isz = A.dtype.name, A.dtype.itemsize
        cfg = G.CONFIGS[call.config]
        ws = ctx.workspace(("moe_gemm_combine",), p.ws_bytes, call.stream, "mkernel.moe_gemm_combine")
        a = self._args = MoeCombineArgs()
        a.ws, a.peers, a.K = ws.ptr, ws.peer_table, F
        a.n_comm, a.group_m = fused_grid(ctx.resident_sms, call.options)[0], G.GROUP_M
        self._tma = TensorMapArg(A.ptr, dt, (F, R.recv_rows), (F * isz,), (64, cfg.bm))
        self._b = G.b_arg(WD, F, H, "nk", cfg, dt, dt, ctx.device)
        self._point(call)
        shape = make_shape(ctx.local_size, R.T, H, R.k, R.E, R.options)
        k = kernel(COMBINE_SOURCE, combine_defines(dt, call.config), NAME)
        comm = ctx.comm_args("moe_gemm_combine", p.digest)
        # the pair counters (u64 cnt[T * k]) zeroed before each launch: a peer adds to them only after our
        # kernel announced the call
        cnt = (ws.ptr + p.layout.counts_off, 2 * R.T * R.k)
        self.prepare(k, p.grid, cfg, [self._tma.buf, self._b.map.buf, comm, p.layout, shape, a], call.stream,
                     zero=(cnt,))
        self.buffers = (ws, *self._b.keep)

    def _point(self, call) -> None:
        self._args.point(call.routing, call.o.ptr)
        self._tma.point(call.act.ptr)
        self._b.point(call.wd.ptr)

    def run(self, stream, call):
        self._point(call)
        self.submit()


class _GemmCombine(Op):
    generation_keyed = True
    name = "moe_gemm_combine"
    what = "mkernel.moe_gemm_combine"

    def __call__(self, ctx, act, routing, w_down, out, stream, options):
        s, opts, R, A, WD = gemm_operands(self, ctx, stream, options, routing, act, w_down, ("act", "w_down"),
                                          ("[recv_rows, F]", "[E_local, H, F]"))
        O = DeviceArray.empty((R.T, WD.shape[1]), A.dtype.name, device=ctx.device) if out is None else \
            as_device_array(out, name="moe_gemm_combine: out", stream=s)
        check_no_overlap(self.what, ((O, "out", A, "act"), (O, "out", WD, "w_down")))
        call = _Call()
        call.stream, call.act, call.routing, call.wd, call.o, call.options = s, A, R, WD, O, opts
        call.config = combine_config(WD.shape[1], opts)
        lk = G.layout_key
        call.key = (lk(A), lk(WD), lk(O), O.readonly, R._key, s, opts, ctx.workspace_generation)
        self.invoke(ctx.op_state(self.name), call, ctx)
        return out if out is not None else O

    def validate(self, ctx, call):
        one_node(ctx, self.what)
        require_gemm_device(self.what, ctx.device)
        R, A, WD, O = call.routing, call.act, call.wd, call.o
        if R.options.mode != "throughput":
            raise ValueError(f"{self.what}: the routing was made in {R.options.mode!r} mode; the fused combine is "
                             f"a throughput-mode path")
        require(A, f"{self.what}: act", dtypes=G.IN_DTYPES, device=ctx.device, shape=(R.recv_rows, None), align=16)
        F, dt, isz = A.shape[1], A.dtype.name, A.dtype.itemsize
        if F == 0 or (F * isz) % 16 or not A.is_contiguous():
            raise ValueError(f"{self.what}: act must be C-contiguous with rows a positive multiple of 16 bytes "
                             f"(F={F} {dt})")
        require(WD, f"{self.what}: w_down", dtypes=(dt,), device=ctx.device, shape=(R.E_local, None, F))
        H = WD.shape[1]
        if H == 0 or (H * isz) % 16:
            raise ValueError(f"{self.what}: w_down's second dim (H = {H}) must make rows a positive multiple of "
                             f"16 bytes")
        require(O, f"{self.what}: out", dtypes=(dt,), device=ctx.device, shape=(R.T, H), align=16, writable=True)
        if not O.is_contiguous():
            raise ValueError(f"{self.what}: out must be C-contiguous")
        if ctx.resident_sms < 2:
            raise RuntimeError(f"{self.what}: needs at least 2 SMs of this rank's share (has {ctx.resident_sms})")

    def compile(self, ctx, call):
        cfg = G.CONFIGS[call.config]
        k = kernel(COMBINE_SOURCE, combine_defines(call.act.dtype.name, call.config), NAME)
        if k.max_active_blocks_per_sm(cfg.threads, cfg.smem) < 1:
            raise RuntimeError(f"{self.what}: config {call.config} cannot be resident on this GPU")

    def agree(self, ctx, call):
        R, A = call.routing, call.act
        return ctx.agree(self.what, (A.dtype.name, A.shape[1], call.wd.shape[1], R.T, R.k, R.E, R.recv_rows,
                                     R.capacity, call.config, repr(call.options), ctx.resident_sms), ctx.world)

    def describe_call(self, call):
        return f"act {call.act.dtype.name}{list(call.act.shape)} w_down {list(call.wd.shape)} {call.routing!r}"

    def plan(self, ctx, call, digest):
        R, A = call.routing, call.act
        L, total = gemm_combine_layout(ctx.local_size, R.T, R.k, call.wd.shape[1] * A.dtype.itemsize)
        comm, workers = fused_grid(ctx.resident_sms, call.options)
        return MoePlan(self.name, comm + workers, R.recv_rows, digest, L, total, combine="fused")

    def bind(self, ctx, call, p: MoePlan) -> GemmKernelBound:
        return _CombineBound(ctx, call, p)


_GEMM_COMBINE = _GemmCombine()


def moe_gemm_combine(ctx, act, routing: MoeRouting, w_down, out=None, *, stream=None,
                     options: MoeOptions | None = None):
    """The down grouped GEMM fused with the combine: ``out[t] = sum_j weights[t, j] * y(t, j)`` with ``y[r] =
    act[r] @ w_down[l].T`` for the received rows r of every local expert l; each finished output tile is
    stored straight into the combine staging of its rows' token owners, and an owner sums a token (fp32, j
    order, no atomics on data: bit-reproducible) as soon as all its rows have landed, while other tiles are
    still computing; one persistent kernel (docs/moe.md, "Down GEMM + combine, fused").

    ``act``: ``[routing.recv_rows, F]`` bf16 / fp16, C-contiguous, rows a multiple of 16 bytes, rows
    ``[o[l], o[l+1])`` local expert l's (``o = routing.expert_offsets``: the receive order of the
    :func:`moe_dispatch` / :func:`moe_dispatch_gemm` that filled ``routing.recv_map``); ``w_down``: this rank's
    experts ``[E_local, H, F]`` of act's dtype; ``routing``: throughput mode.  ``out``: ``[T, H]`` of act's
    dtype (allocated when None).  Returns ``out``."""
    return _GEMM_COMBINE(ctx, act, routing, w_down, out, stream, options)
