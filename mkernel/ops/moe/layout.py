"""The MoE ops' shapes and workspace layouts: pure functions of sizes and options (cuda_src/ops/moe.cu has
the protocol; docs/moe.md the design)."""
from __future__ import annotations

import ctypes
import math

from ...core.util import ceil_div, round_up
from ...dist.signals import MAX_CHUNKS, workspace_control
from ..gemm import CONFIGS, pair_width
from .options import FUSED_CONFIGS, MoeOptions

__all__ = ["MAX_CHUNKS", "SOURCE", "FUSED_SOURCE", "COMBINE_SOURCE", "LAYER_SOURCE", "MoeGemmArgs", "MoeCombineArgs",
           "gemm_combine_layout", "layer_layout", "arrived_slots", "fused_config",
           "fused_swiglu_config", "no_swiglu_config", "fused_grid", "TILE", "MAX_EXPERTS", "MAX_K", "THREADS", "MoeLayout", "MoeShape", "capacity_of", "recv_rows",
           "make_shape", "route_layout", "dispatch_layout", "low_latency_layout", "low_latency_grid", "combine_layout", "kernel_defines", "SPECIALIZATIONS",
           "INTERNODE_SOURCE", "INTERNODE_GRID", "MoeXLayout", "x_route_layout", "x_dispatch_layout",
           "x_combine_layout", "node_meta_words", "node_meta_offsets", "x_node_dispatch_layout",
           "x_node_combine_layout"]

SOURCE = "ops/moe.cu"
FUSED_SOURCE = "ops/moe_gemm.cu"  # dispatch + gate/up grouped GEMM (compiled with the GEMM's config defines)
COMBINE_SOURCE = "ops/moe_gemm_combine.cu"  # down grouped GEMM + combine (the same defines)
LAYER_SOURCE = "ops/moe_layer.cu"  # the layer after routing in one kernel (the same defines)
TILE = 256          # tokens per routing tile (moe.cu MOE_TILE)
MAX_EXPERTS = 1024  # moe.cu MOE_MAX_E
MAX_K = 32          # moe.cu MOE_MAX_K (one lane per choice)
THREADS = 256       # dispatch / combine blocks
EXCHANGE_THREADS = MAX_EXPERTS

# (MK_DTYPE, MK_OUT_DTYPE, MK_LOGIT_DTYPE) codes compiled: the routing kernels by logit dtype, the combine
# and SwiGLU kernels by (input, output) dtype; the dispatch kernel moves bytes (any specialization).
SPECIALIZATIONS = ((0, 0, 2), (0, 0, 0), (0, 2, 2), (1, 1, 2), (1, 2, 2), (2, 2, 2))


def kernel_defines(dtype: int = 0, out_dtype: int | None = None, logit_dtype: int = 2) -> dict:
    out = dtype if out_dtype is None else out_dtype
    if (dtype, out, logit_dtype) not in SPECIALIZATIONS:
        raise AssertionError(f"moe: no specialization {(dtype, out, logit_dtype)}")
    return {"MK_DTYPE": dtype, "MK_OUT_DTYPE": out, "MK_LOGIT_DTYPE": logit_dtype}


class MoeLayout(ctypes.Structure):
    """``struct MoeLayout`` of moe.cu: byte offsets into an op's symmetric workspace."""

    _fields_ = [("consumed_off", ctypes.c_uint64), ("flags_off", ctypes.c_uint64),
                ("counts_off", ctypes.c_uint64), ("scratch_off", ctypes.c_uint64),
                ("stage_off", ctypes.c_uint64), ("row_bytes", ctypes.c_uint64),
                ("flag_stride", ctypes.c_int32), ("pad", ctypes.c_int32)]


class MoeShape(ctypes.Structure):
    """``struct MoeShape`` of moe.cu."""

    _fields_ = [("T", ctypes.c_int32), ("H", ctypes.c_int32), ("k", ctypes.c_int32), ("E", ctypes.c_int32),
                ("El", ctypes.c_int32), ("capacity", ctypes.c_int32), ("r_cap", ctypes.c_int32),
                ("softmax_all", ctypes.c_int32)]


def capacity_of(P: int, T: int, k: int, E: int, options: MoeOptions) -> int:
    """Rows an expert keeps per receiving rank (0: no limit)."""
    if options.expert_capacity is not None:
        return options.expert_capacity
    if options.capacity_factor is not None:
        return max(1, math.ceil(options.capacity_factor * P * T * k / E))
    return 0


def recv_rows(P: int, T: int, k: int, E: int, options: MoeOptions) -> int:
    """Rows of a rank's receive buffer (x_recv): ``options.recv_rows``, else the most it can receive."""
    if options.recv_rows is not None:
        return options.recv_rows
    El = E // P
    worst = P * T * min(k, El)
    cap = capacity_of(P, T, k, E, options)
    return max(1, min(worst, El * cap) if cap else worst)


def make_shape(P: int, T: int, H: int, k: int, E: int, options: MoeOptions) -> MoeShape:
    s = MoeShape()
    s.T, s.H, s.k, s.E, s.El = T, H, k, E, E // P
    s.capacity = capacity_of(P, T, k, E, options)
    s.r_cap = recv_rows(P, T, k, E, options)
    s.softmax_all = int(options.softmax == "all")
    return s


def _control(P: int) -> tuple[MoeLayout, int]:
    L = MoeLayout()
    L.consumed_off, L.flags_off, end = workspace_control(P, P)
    L.flag_stride = MAX_CHUNKS
    return L, round_up(end, 256)


def route_layout(P: int, T: int, E: int) -> tuple[MoeLayout, int]:
    """(layout, bytes) of the routing workspace: control, int32 counts[2][P][E] (written by the peers),
    then this rank's scratch: int32 tile_cnt[ceil(T / TILE)][E], base[2 E]."""
    L, off = _control(P)
    L.counts_off = off
    L.scratch_off = round_up(off + 2 * P * E * 4, 256)
    total = L.scratch_off + (ceil_div(max(T, 1), TILE) * E + 2 * E) * 4
    L.stage_off = total
    return L, round_up(total, 256)


def dispatch_layout(P: int, T: int, row_bytes: int, r_cap: int) -> tuple[MoeLayout, int]:
    """(layout, bytes) of the dispatch workspace: control, int32 recv_src[r_cap] (written by the senders),
    staging rows [P][T] of ``row_bytes`` (row [src][t]: source rank src's token t)."""
    L, off = _control(P)
    return L, _dispatch_regions(L, off, P, T, row_bytes, r_cap)


def _dispatch_regions(L: MoeLayout, off: int, P: int, T: int, row_bytes: int, r_cap: int) -> int:
    """Place the dispatch's regions of ``L`` from ``off`` (256-aligned) on; returns their end."""
    L.counts_off = off
    L.scratch_off = L.stage_off = round_up(off + 4 * r_cap, 256)
    L.row_bytes = row_bytes
    return L.stage_off + P * T * row_bytes


def low_latency_layout(P: int, T: int, k: int, E: int, row_bytes: int) -> tuple[MoeLayout, int]:
    """(layout, bytes) of the low-latency dispatch workspace: control, int32 ids_all[P][T][k] (row s written
    by rank s), this rank's scratch int32 pos[P][T][k] and cnt[P][E], staging rows [P][T] of ``row_bytes``."""
    L, off = _control(P)
    L.counts_off = off
    L.scratch_off = round_up(off + 4 * P * T * k, 256)
    L.stage_off = round_up(L.scratch_off + 4 * (P * T * k + P * E), 256)
    L.row_bytes = row_bytes
    return L, L.stage_off + P * T * row_bytes


def low_latency_grid(P: int, T: int, resident_sms: int, blocks: int) -> int:
    """Blocks of the low-latency dispatch: ``blocks`` or one per 8 (source, token) warps of the expansion,
    at least P (block s < P lays out source s), at most this rank's SM share."""
    g = blocks or ceil_div(max(1, P * T), THREADS // 32)
    return max(P, min(g, resident_sms, MAX_CHUNKS - P))


def combine_layout(P: int, T: int, k: int, row_bytes: int) -> tuple[MoeLayout, int]:
    """(layout, bytes) of the combine workspace: control, staging rows [T * k] of ``row_bytes`` (row
    t * k + j: the expert output of this rank's pair (t, j), written by the rank holding the expert)."""
    L, off = _control(P)
    L.counts_off = L.scratch_off = L.stage_off = off
    L.row_bytes = row_bytes
    return L, L.stage_off + T * k * row_bytes


class MoeGemmArgs(ctypes.Structure):
    """``struct MoeGemmArgs`` of moe_gemm.cu (112 bytes)."""

    _fields_ = [("x", ctypes.c_void_p), ("ids", ctypes.c_void_p), ("slots", ctypes.c_void_p),
                ("offs", ctypes.c_void_p), ("x_recv", ctypes.c_void_p), ("recv_map", ctypes.c_void_p),
                ("c", ctypes.c_void_p), ("ws", ctypes.c_void_p), ("peers", ctypes.c_void_p),
                ("arrived", ctypes.c_void_p), ("ldc", ctypes.c_int64), ("N", ctypes.c_int32), ("K", ctypes.c_int32),
                ("n_comm", ctypes.c_int32), ("group_m", ctypes.c_int32), ("c_vec_ok", ctypes.c_int32),
                ("pad", ctypes.c_int32)]

    def point(self, x: int, routing) -> None:
        """Re-point at a call's rows ``x`` and its routing (:class:`mkernel.MoeRouting`)."""
        R = routing
        self.x, self.ids, self.slots = x, R.ids.ptr, R.slots.ptr
        self.offs, self.recv_map = R.expert_offsets.ptr, R.recv_map.ptr


assert ctypes.sizeof(MoeGemmArgs) == 112


def arrived_slots(El: int, r_cap: int, bm: int) -> int:
    """Arrival counters of the fused kernel: one per (local expert l, row block b) at index
    ``l + o[l] // bm + b`` (moe_gemm.cu), all below ``El + r_cap // bm + 1``."""
    return El + r_cap // bm + 1


def fused_config(N: int, options: MoeOptions) -> int:
    """The fused kernel's GEMM tile config: ``options.gemm_config``, else 128 x 256 tiles (config 3) for
    N = 2F > 256, 128 x 128 (config 2) below."""
    if options.gemm_config is not None:
        return options.gemm_config
    return 3 if N > 256 else 2


def fused_swiglu_config(F: int, options: MoeOptions) -> int | None:
    """The fused kernel's tile config with SwiGLU in its epilogue (moe_gemm.cu ``MK_MOE_SWIGLU``), or None
    when no fused config suits F.  Its pair width must divide F (docs/moe.md, "SwiGLU epilogue"):
    ``options.gemm_config`` if it does, else :func:`fused_config`'s choice if it does, else the fused
    config of the largest tile that does."""
    def suits(c: int) -> bool:
        return F > 0 and F % pair_width(c) == 0

    if options.gemm_config is not None:
        return options.gemm_config if suits(options.gemm_config) else None
    by_area = sorted(FUSED_CONFIGS, key=lambda c: (-CONFIGS[c].bm * CONFIGS[c].bn, c))
    return next((c for c in (fused_config(2 * F, options), *by_area) if suits(c)), None)


def no_swiglu_config(what: str, F: int, options: MoeOptions, needs: str) -> ValueError:
    """The error when :func:`fused_swiglu_config` finds no config for F (``needs``: what asked, e.g.
    "swiglu=True"): it names the forced config's pair width, or every fused config's."""
    cfg = options.gemm_config
    if cfg is not None:
        return ValueError(f"{what}: MoeOptions.gemm_config={cfg} cannot pair gate and up columns at F = {F}: its "
                          f"pair width {pair_width(cfg)} must divide F")
    widths = sorted({pair_width(c) for c in FUSED_CONFIGS})
    return ValueError(f"{what}: {needs} needs F = {F} (w_gate_up's second dim / 2) to be a multiple of a fused "
                      f"config's pair width ({widths}; docs/moe.md, \"SwiGLU epilogue\")")


class MoeCombineArgs(ctypes.Structure):
    """``struct MoeCombineArgs`` of moe_gemm_combine.cu (80 bytes)."""

    _fields_ = [("ids", ctypes.c_void_p), ("slots", ctypes.c_void_p), ("weights", ctypes.c_void_p),
                ("offs", ctypes.c_void_p), ("recv_map", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("ws", ctypes.c_void_p), ("peers", ctypes.c_void_p), ("K", ctypes.c_int32),
                ("n_comm", ctypes.c_int32), ("group_m", ctypes.c_int32), ("pad", ctypes.c_int32)]

    def point(self, routing, out: int) -> None:
        """Re-point at a call's routing (:class:`mkernel.MoeRouting`) and its output ``out``."""
        R = routing
        self.ids, self.slots, self.weights, self.offs = R.ids.ptr, R.slots.ptr, R.weights.ptr, R.expert_offsets.ptr
        self.recv_map, self.out = R.recv_map.ptr, out


assert ctypes.sizeof(MoeCombineArgs) == 80


def gemm_combine_layout(P: int, T: int, k: int, row_bytes: int) -> tuple[MoeLayout, int]:
    """(layout, bytes) of the fused down GEMM + combine workspace: control, uint64 cnt[T * k] (pair t * k + j's
    column tiles landed, added to by the rank holding its expert, zeroed by this rank once summed), staging
    rows [T * k] of ``row_bytes`` (row t * k + j: the expert output of this rank's pair (t, j))."""
    L, off = _control(P)
    L.counts_off = L.scratch_off = off
    L.stage_off = round_up(off + 8 * T * k, 256)
    L.row_bytes = row_bytes
    return L, L.stage_off + T * k * row_bytes


def layer_layout(P: int, T: int, k: int, row_bytes_x: int, row_bytes_out: int,
                 r_cap: int) -> tuple[MoeLayout, MoeLayout, int]:
    """(dispatch layout Ld, combine layout Lc, bytes) of the one-kernel layer's workspace (moe_layer.cu): one
    control region (one epoch, one call header, one set of ready flags: both layouts' ``consumed_off`` /
    ``flags_off``; then uint64 down_stored[P] at Lc.scratch_off, entry s raised by local rank s to the call's
    epoch once its loop (2) tiles are stored: at an offset of P only, as every control word), then the
    dispatch's regions as :func:`dispatch_layout` places them after a control region, from the next 256-byte
    boundary on (int32 recv_src[r_cap], staging rows [P][T] of ``row_bytes_x``), then the combine's,
    256-aligned: uint64 cnt[T * k] (Lc.counts_off, zeroed by the host before each launch: a workspace shared
    with calls of other shapes may hold stale bytes there) and staging rows [T * k] of ``row_bytes_out``
    (Lc.stage_off)."""
    Ld, down_stored = _control(P)
    end = _dispatch_regions(Ld, round_up(down_stored + 8 * P, 256), P, T, row_bytes_x, r_cap)
    Lc = MoeLayout()
    Lc.consumed_off, Lc.flags_off, Lc.flag_stride = Ld.consumed_off, Ld.flags_off, Ld.flag_stride
    Lc.scratch_off = down_stored
    Lc.counts_off = round_up(end, 256)
    Lc.stage_off = round_up(Lc.counts_off + 8 * T * k, 256)
    Lc.row_bytes = row_bytes_out
    return Ld, Lc, Lc.stage_off + T * k * row_bytes_out


def fused_grid(resident_sms: int, options: MoeOptions) -> tuple[int, int]:
    """(communication blocks, GEMM workers) of the fused kernel within this rank's share of the SMs: one
    block per SM; ``options.comm_blocks`` or an eighth of the share (at least 1) communicate, and at least
    one block is a GEMM worker (``resident_sms`` >= 2)."""
    n = resident_sms
    comm = min(options.comm_blocks or max(1, n // 8), n - 1)
    return comm, n - comm


# --------------------------------------------------------------------------------------------
# across nodes (cuda_src/ops/moe_internode.cu; docs/moe.md "Across nodes")
# --------------------------------------------------------------------------------------------
INTERNODE_SOURCE = "ops/moe_internode.cu"
INTERNODE_GRID = 32  # blocks of the dispatch / combine kernels: fixed per context (one grid barrier per call)


class MoeXLayout(ctypes.Structure):
    """``struct MoeXLayout`` of moe_internode.cu: byte offsets into an op's workspace (window 0 of its
    proxy): control words, then the op's regions a..e."""

    _fields_ = [("consumed_off", ctypes.c_uint64), ("calls_off", ctypes.c_uint64), ("ready_off", ctypes.c_uint64),
                ("bar_off", ctypes.c_uint64), ("a_off", ctypes.c_uint64), ("b_off", ctypes.c_uint64),
                ("c_off", ctypes.c_uint64), ("d_off", ctypes.c_uint64), ("e_off", ctypes.c_uint64),
                ("row_bytes", ctypes.c_uint64), ("L", ctypes.c_int32), ("N", ctypes.c_int32)]


def _x_regions(L: int, N: int, sizes: list[int], row_bytes: int = 0) -> tuple[MoeXLayout, int]:
    """Control words at offsets that depend on L and N only (docs/design.md, "Control words never move"),
    then the regions of ``sizes`` bytes, each 256-aligned."""
    P = L * N
    X = MoeXLayout()
    X.bar_off = 64
    X.consumed_off = 128
    X.calls_off = X.consumed_off + 8 * P
    X.ready_off = X.calls_off + 16 * P
    off = round_up(X.ready_off + 8 * P, 256)
    names = ("a_off", "b_off", "c_off", "d_off", "e_off")
    for i, name in enumerate(names):
        setattr(X, name, off)
        off = round_up(off + (sizes[i] if i < len(sizes) else 0), 256)
    X.row_bytes = row_bytes
    X.L, X.N = L, N
    return X, off


def x_route_layout(L: int, N: int, T: int, E: int) -> tuple[MoeXLayout, int]:
    """(layout, bytes) of the routing workspace across nodes: a = int32 counts[2][P][E] (row s written by
    rank s), b = int32 this rank's counts [E] (the proxy's source), c = scratch: int32
    tile_cnt[ceil(T / TILE)][E], base[2 E] (this rank's, as route_layout)."""
    P = L * N
    return _x_regions(L, N, [2 * P * E * 4, E * 4, (ceil_div(max(T, 1), TILE) * E + 2 * E) * 4])


def x_dispatch_layout(L: int, N: int, T: int, row_bytes: int, r_cap: int) -> tuple[MoeXLayout, int]:
    """(layout, bytes) of the dispatch workspace across nodes: a = int32 in_src[r_cap], b = rows [P][T]
    (from this node's ranks), c = rows [r_cap] (from remote ranks, at the slot), d = rows [P][r_cap] and
    e = int32 [P][r_cap] (ours for each remote rank, at its slot: the proxy's sources)."""
    P = L * N
    return _x_regions(L, N, [4 * r_cap, P * T * row_bytes, r_cap * row_bytes, P * r_cap * row_bytes, 4 * P * r_cap],
                      row_bytes)


def x_combine_layout(L: int, N: int, T: int, k: int, row_bytes: int, r_cap: int) -> tuple[MoeXLayout, int]:
    """(layout, bytes) of the combine workspace across nodes: a unused, b = rows [T * k] (from this node's
    ranks, at t * k + j), c = rows [P][r_cap] (rank d's rows for this rank, at d's slot), d = rows [r_cap]
    (this rank's rows for remote owners, at the row: the proxy's source)."""
    P = L * N
    return _x_regions(L, N, [0, T * k * row_bytes, P * r_cap * row_bytes, r_cap * row_bytes], row_bytes)


# node-level de-duplication (moe_internode.cu includes moe_node.cuh; docs/moe.md "Node-level de-duplication")
def node_meta_words(T: int, k: int) -> int:
    """int32 words of one node's batch meta: the count, then per batched token (t, ids[k], slots[k], weight
    bits[k]) -- moe_node.cuh XNodeMeta, and the routing's ``node_meta`` rows."""
    return 1 + T * (1 + 3 * k)


def node_meta_offsets(X: MoeXLayout, T: int, k: int) -> tuple[int, int, int]:
    """(cnt_off, meta_in_off, meta_out_off) inside region e of the node dispatch workspace (moe_node.cuh
    x_node_meta): u32 cnt[N], int32 meta_in[N][M], meta_out[N][M]."""
    cnt = X.e_off
    meta_in = cnt + round_up(4 * X.N, 16)
    return cnt, meta_in, meta_in + 4 * X.N * node_meta_words(T, k)


def x_node_dispatch_layout(L: int, N: int, T: int, k: int, row_bytes: int, r_cap: int) -> tuple[MoeXLayout, int]:
    """(layout, bytes) of the node dispatch workspace: a = int32 in_src[r_cap], b = rows [P][T] (world rank
    s's token t: from this node's ranks, or forwarded), c = rows [N][T] (the batch from the rail peer on node
    m), d = rows [N][T] (this rank's batch for node m: the proxy's source), e = cnt[N] and the batch metas
    (:func:`node_meta_offsets`)."""
    P = L * N
    meta = round_up(4 * N, 16) + 2 * 4 * N * node_meta_words(T, k)
    return _x_regions(L, N, [4 * r_cap, P * T * row_bytes, N * T * row_bytes, N * T * row_bytes, meta], row_bytes)


def x_node_combine_layout(L: int, N: int, T: int, k: int, H: int, row_bytes: int) -> tuple[MoeXLayout, int]:
    """(layout, bytes) of the node combine workspace: a unused, b = rows [T * k] (y of this rank's pairs from
    this node's ranks), c = rows [N][T * k] (y of the rail peer on node m's pairs, from this node's ranks),
    d = fp32 rows [N][T] (this rank's partials for node m: the proxy's source), e = fp32 rows [N][T] (node
    m's partials of this rank's tokens)."""
    part = N * T * H * 4
    return _x_regions(L, N, [0, T * k * row_bytes, N * T * k * row_bytes, part, part], row_bytes)
