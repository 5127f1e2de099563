"""GEMM+AllReduce's planner: which path runs, on which tile config (plain or transposed), and what each path
is predicted to cost -- a pure function of the agreed call (every rank computes the same plan).

Paths: "latency" (cuda_src/ops/gemm_ar.cu, one-shot: every tile's partial pushed to every peer, every rank
sums every tile; decode-sized M), "bandwidth" (gemm_ar.cu, two-phase: tiles reduce-scattered to their
owners, reduced tiles pushed back to every rank; large M), "unfused" (mkernel.gemm, then mkernel.all_reduce),
"gemm" (one local rank: the GEMM is the whole op), "empty" (no output element: nothing runs).

Cost model (``CostModel``; times per rank, the call is the slowest rank's).  A tile costs ``t = 2 bm bn (K_r +
epilogue) / (rate / SMs) / efficiency`` (the GEMM's ``config_cost``; a decode call's tiles at the GEMM's
small-M efficiency); a call streams its weights at no more than ``min(hbm_bw, W sm_load_bw)`` with W blocks
working (``T_mem``).

* latency: every rank computes all T tiles on ``W = min(SMs, T)`` blocks; a tile's epilogue holds its SM
  ``(P-1) vb / sm_push_bw + (P-1) vb / sm_read_bw + flag_latency`` longer (vb: the bytes of the tile's valid
  part in the partial dtype: only the threads holding valid elements send and sum); ``T = max(ceil(T / W)
  (t + epi), T_mem + epi) + launch``, and no less than the link's ``(P-1) M N psize / link_bw``.
* bandwidth: gemm_rs's fused model (peers' tiles first, each holding its SM ``tile_bytes / sm_push_bw``
  longer, own tiles ``(P-1) tile_bytes / sm_read_bw``), own tiles also pushing the reduced tile to P - 1
  peers, then the receive units (``tile_bytes_out / sm_read_bw`` each, round robin, the first on the
  blocks with a tile fewer); the link carries both halves.
* unfused: the GEMM's own plan (``auto_plan``'s cost, no less than T_mem over every SM) + launch, then the
  all-reduce: ``ar_latency + 2 (P-1) / P M N osize / ar_bw``.

The automatic choice is the fused path of least predicted time where it is below ``fuse_margin x T_unfused``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .. import gemm as G  # the GEMM package's public planning API
from ..gemm_comm import FLAGS_PER_SOURCE, MAXP, units_of_worker
from .layout import (BANDWIDTH_CONFIGS, LATENCY_CONFIGS, TRANSPOSED_CONFIGS, WsLayout, bandwidth_workspace,
                     latency_workspace, owner_rows, tile_bytes)
from .options import CostModel, GemmArOptions

__all__ = ["ArPlan", "plan", "with_digest", "latency_choice", "bandwidth_config", "latency_time", "bandwidth_time",
           "unfused_time", "SMALL_M", "TRANSPOSE_MAX_M"]

_ISZ = {"bfloat16": 2, "float16": 2, "float32": 4}
# M at or below which a config's small-M efficiency applies, and the decode-shaped B "nk" calls the latency
# path may compute transposed: the GEMM heuristic's own bounds (docs/gemm.md, "Configurations" and
# "Transposed (swapped) plans").
SMALL_M = G.SMALL_M
TRANSPOSE_MAX_M = G.SWAP_MAX_M


@dataclass(frozen=True)
class ArPlan:
    """What one gemm_all_reduce call runs (``ctx.last_plan("gemm_ar")``).  Times are predictions in seconds
    (None where a path was not considered)."""

    path: str                     # "latency" | "bandwidth" | "unfused" | "gemm" | "empty"
    reason: str                   # why this path
    P: int
    me: int
    M: int
    N: int
    Ks: tuple                     # K_r of every local rank
    b_layout: str
    in_dtype: str
    out_dtype: str
    partial_dtype: str            # fused: the dtype partial tiles travel in
    deterministic: bool
    config: int | None = None     # fused: the tile config
    transposed: bool = False      # latency: computed as C^T = B A^T (the kernel's problem is N x M)
    grid: int = 0                 # fused: blocks (the same on every rank)
    units: int = 0                # fused: tiles this rank computes
    m_sizes: tuple = ()           # bandwidth: rows each owner reduces (split on tile rows)
    ws: WsLayout | None = field(default=None, repr=False)
    predicted_latency: float | None = None
    predicted_bandwidth: float | None = None
    predicted_unfused: float | None = None
    digest: int = field(default=0, repr=False)

    @property
    def predicted(self) -> float | None:
        """The prediction for the path that runs."""
        return {"latency": self.predicted_latency, "bandwidth": self.predicted_bandwidth,
                "unfused": self.predicted_unfused}.get(self.path)


def _eff_cfg(cfg, M: int):
    """``cfg`` at the efficiency the GEMM's heuristic gives it for M rows (small-M efficiency up to SMALL_M)."""
    if cfg.efficiency_small_m is not None and M <= SMALL_M:
        return replace(cfg, efficiency=cfg.efficiency_small_m)
    return cfg


def _tile_time(cfg, K: int, b_layout: str, sms: int, model: CostModel) -> float:
    """Seconds one SM spends on one tile of K_r = K (config_cost of one tile on one SM, in multiply-adds)."""
    return 2 * G.config_cost(cfg, 1, 1, K, b_layout) / (model.gemm_rate / sms)


def _stream_time(N: int, K: int, workers: int, model: CostModel) -> float:
    """Seconds to stream the [K, N] 16-bit weights with ``workers`` SMs loading them."""
    return N * K * 2 / min(model.hbm_bw, workers * model.sm_load_bw)


def _tiles(M: int, N: int, cfg, layout: str, transposed: bool) -> int:
    """Tiles of the kernel's problem (transposed: N x M)."""
    rows, cols = (N, M) if transposed else (M, N)
    return math.ceil(rows / cfg.bm) * math.ceil(cols / cfg.tile_n(layout))


def latency_time(cfg, transposed: bool, M: int, N: int, Ks, b_layout: str, partial_itemsize: int, sms: int,
                 model: CostModel) -> float:
    """Predicted seconds of the latency path (see the module doc)."""
    P = len(Ks)
    bn = cfg.tile_n(b_layout)
    rows, cols = (N, M) if transposed else (M, N)
    T = _tiles(M, N, cfg, b_layout, transposed)
    W = min(sms, T)
    vb = min(rows, cfg.bm) * min(cols, bn) * partial_itemsize  # a tile's valid part (the fullest tile)
    epi = (P - 1) * vb / model.sm_push_bw + (P - 1) * vb / model.sm_read_bw + model.flag_latency
    eff = _eff_cfg(cfg, cols if transposed else M)
    link = (P - 1) * M * N * partial_itemsize / model.link_bw
    worst = 0.0
    for K in Ks:
        t = _tile_time(eff, K, b_layout, sms, model)
        worst = max(worst, math.ceil(T / W) * (t + epi), _stream_time(N, K, W, model) + epi, link + epi)
    return worst + model.launch_latency


def bandwidth_time(cfg, m_sizes, N: int, Ks, b_layout: str, partial_itemsize: int, out_itemsize: int, sms: int,
                   model: CostModel) -> float:
    """Predicted seconds of the bandwidth path (see the module doc)."""
    P = len(m_sizes)
    bn = cfg.tile_n(b_layout)
    tb, tbo = tile_bytes(cfg.bm, bn, partial_itemsize), tile_bytes(cfg.bm, bn, out_itemsize)
    tiles = [math.ceil(m / cfg.bm) * math.ceil(N / bn) for m in m_sizes]
    total = sum(tiles)
    W = min(sms, total)
    push, reduce, recv = tb / model.sm_push_bw, (P - 1) * tb / model.sm_read_bw, tbo / model.sm_read_bw
    gpush = (P - 1) * tbo / model.sm_push_bw
    worst = 0.0
    for r in range(P):
        t = _tile_time(cfg, Ks[r], b_layout, sms, model)
        n_peer = total - tiles[r]
        shift = total % W  # receive units go first to the blocks with a tile fewer
        t_sm = max(units_of_worker(0, n_peer, w, W) * (t + push)
                   + units_of_worker(n_peer, total, w, W) * (t + reduce + gpush)
                   + units_of_worker(0, n_peer, (w - shift) % W, W) * recv for w in range(W))
        sent = n_peer * tb + (P - 1) * tiles[r] * tbo
        received = (P - 1) * tiles[r] * tb + n_peer * tbo
        t_link = max(sent, received) / model.link_bw
        worst = max(worst, t_sm, t_link + t + reduce + recv + model.flag_latency)
    return worst + model.launch_latency


def unfused_time(M: int, N: int, Ks, b_layout: str, out_itemsize: int, sms: int, model: CostModel) -> float:
    """Predicted seconds of mkernel.gemm + mkernel.all_reduce."""
    P = len(Ks)
    t_gemm = 0.0
    for K in Ks:
        if K == 0:  # (a zero fill)
            t = M * N * out_itemsize / 2e12
        else:
            res = G.auto_plan(M, N, K, b_layout, sms, with_cost=True)
            cost = res[3] if len(res) > 3 else G.config_cost(res[0], G.tile_count(res[0], M, N, b_layout), sms, K,
                                                              b_layout)
            t = max(2 * cost / (model.gemm_rate / sms), _stream_time(N, K, sms, model))
        t_gemm = max(t_gemm, t + model.launch_latency)
    t_ar = model.ar_latency + 2 * (P - 1) / P * M * N * out_itemsize / model.ar_bw
    return t_gemm + t_ar


def _cost_pick(cands, M: int, N: int, Ks, b_layout: str, partial_itemsize: int, sms: int, model: CostModel,
               transposed: bool):
    """(time, cfg) of least latency_time among config ids ``cands`` whose tiles fit the flags."""
    best = None
    for cid in cands:
        cfg = G.CONFIGS[cid]
        if _tiles(M, N, cfg, b_layout, transposed) > FLAGS_PER_SOURCE:
            continue
        t = latency_time(cfg, transposed, M, N, Ks, b_layout, partial_itemsize, sms, model)
        if best is None or t < best[0]:
            best = (t, cfg)
    return best


def latency_choice(M: int, N: int, Ks, b_layout: str, partial_itemsize: int, sms: int, model: CostModel,
                   config: int | None = None, transposed_ok: bool = True):
    """``(time, cfg, transposed)`` of the latency path's best config, or None when none fits the flags.

    B "nk" and M <= TRANSPOSE_MAX_M (and ``transposed_ok``): the decode tiles computed transposed (config 53
    up to 16 rows, else 54), as mkernel.gemm's swap_candidates; otherwise the plain LATENCY_CONFIGS (config
    53 with B "kn" only: its "nk" tile is 16 columns wide).  ``config`` forces one: a TRANSPOSED_CONFIGS id
    with B "nk" runs transposed where M allows it, plain otherwise."""
    can_t = transposed_ok and b_layout == "nk"
    if config is not None:
        if config in TRANSPOSED_CONFIGS and can_t and M <= TRANSPOSE_MAX_M:
            r = _cost_pick((config,), M, N, Ks, b_layout, partial_itemsize, sms, model, True)
            return None if r is None else (r[0], r[1], True)
        if config not in LATENCY_CONFIGS:
            return None
        r = _cost_pick((config,), M, N, Ks, b_layout, partial_itemsize, sms, model, False)
        return None if r is None else (r[0], r[1], False)
    if can_t and M <= TRANSPOSE_MAX_M:
        r = _cost_pick((53,) if M <= 16 else (54,), M, N, Ks, b_layout, partial_itemsize, sms, model, True)
        if r is not None:
            return r[0], r[1], True
    cands = tuple(c for c in LATENCY_CONFIGS if b_layout == "kn" or c != 53)
    r = _cost_pick(cands, M, N, Ks, b_layout, partial_itemsize, sms, model, False)
    return None if r is None else (r[0], r[1], False)


def bandwidth_config(M: int, N: int, K: int, P: int, b_layout: str, sms: int, config: int | None = None):
    """The bandwidth path's TileConfig: ``config`` if given, else the GEMM's heuristic (``choose_config``) over
    BANDWIDTH_CONFIGS on the plain tile grid (owners split on tile rows); None when an owner would have more
    tiles than flags."""
    def fits(cfg):
        bn = cfg.tile_n(b_layout)
        return max(math.ceil(m / cfg.bm) for m in owner_rows(M, P, cfg.bm)) * math.ceil(N / bn) <= FLAGS_PER_SOURCE
    if config is not None:
        if config not in BANDWIDTH_CONFIGS:
            return None
        cfg = G.CONFIGS[config]
        return cfg if fits(cfg) else None
    cands = tuple(c for c in BANDWIDTH_CONFIGS if fits(G.CONFIGS[c]))
    if not cands:
        return None
    return G.choose_config(lambda cfg: G.tile_count(cfg, M, N, b_layout), sms, k=K, layout=b_layout,
                           candidates=cands)


def plan(M: int, N: int, Ks, me: int, *, b_layout: str, in_dtype: str, out_dtype: str, sms: int,
         options: GemmArOptions | None = None, deterministic: bool = False) -> ArPlan:
    """The plan of a call of ``[M, N]`` output where local rank j has K_r = ``Ks[j]``, for rank ``me`` (every
    rank's plan is the same but for ``me``)."""
    opts = options if options is not None else GemmArOptions()
    model = opts.model
    Ks = tuple(int(k) for k in Ks)
    P = len(Ks)
    partial = opts.partial_dtype or out_dtype
    psz, osz = _ISZ[partial], _ISZ[out_dtype]
    base = dict(P=P, me=me, M=M, N=N, Ks=Ks, b_layout=b_layout, in_dtype=in_dtype, out_dtype=out_dtype,
                partial_dtype=partial, deterministic=deterministic)
    if M == 0 or N == 0:
        return ArPlan("empty", "no output element", **base)
    if P == 1:
        return ArPlan("gemm", "one local rank: the GEMM is the whole op", **base)
    unfused_base = dict(base, partial_dtype=out_dtype)  # (the unfused path reduces in out's dtype)
    t_unfused = unfused_time(M, N, Ks, b_layout, osz, sms, model)
    why_not = None
    if P > MAXP:
        why_not = f"{P} local ranks (the fused kernel takes up to {MAXP})"
    elif min(Ks) == 0:
        why_not = "a rank has K_r = 0"
    lat = bw = None
    if why_not is None:
        if opts.path in (None, "latency"):
            lat = latency_choice(M, N, Ks, b_layout, psz, sms, model, opts.config, opts.transposed)
        if opts.path in (None, "bandwidth"):
            cfg = bandwidth_config(M, N, max(Ks), P, b_layout, sms, opts.config)
            if cfg is not None:
                bw = (bandwidth_time(cfg, owner_rows(M, P, cfg.bm), N, Ks, b_layout, psz, osz, sms, model), cfg)
        if lat is None and bw is None and opts.path != "unfused":
            why_not = (f"config {opts.config} does not fit the fused kernel here" if opts.config is not None else
                       f"more tiles than the {FLAGS_PER_SOURCE} ready flags of the workspace")
    preds = dict(predicted_latency=None if lat is None else lat[0], predicted_bandwidth=None if bw is None else bw[0],
                 predicted_unfused=t_unfused)
    if why_not is not None:
        if opts.path in ("latency", "bandwidth"):
            raise ValueError(f"gemm_all_reduce: path={opts.path!r} is not possible here: {why_not}")
        return ArPlan("unfused", why_not, **unfused_base, **preds)
    fused = [(t, name) for name, t in (("latency", preds["predicted_latency"]),
                                       ("bandwidth", preds["predicted_bandwidth"])) if t is not None]
    if opts.path is not None:
        path, reason = opts.path, "forced (options.path)"
    else:
        t_best, best = min(fused)
        if t_best < model.fuse_margin * t_unfused:
            path, reason = best, (f"predicted {t_best * 1e6:.1f} us < {model.fuse_margin} x {t_unfused * 1e6:.1f} us "
                                  "unfused" + "".join(f"; {n} {t * 1e6:.1f} us" for t, n in fused if n != best))
        else:
            path, reason = "unfused", (f"predicted fused {t_best * 1e6:.1f} us ({best}) >= {model.fuse_margin} x "
                                       f"{t_unfused * 1e6:.1f} us unfused")
    if path == "unfused":
        return ArPlan("unfused", reason, **unfused_base, **preds)
    if path == "latency":
        _, cfg, transposed = lat
        bn = cfg.tile_n(b_layout)
        T = _tiles(M, N, cfg, b_layout, transposed)
        ws = latency_workspace(P, T, cfg.bm, bn, psz)
        return ArPlan("latency", reason, **base, config=cfg.id, transposed=transposed, grid=min(sms, T), units=T,
                      ws=ws, **preds)
    _, cfg = bw
    bn = cfg.tile_n(b_layout)
    m_sizes = owner_rows(M, P, cfg.bm)
    units = sum(math.ceil(m / cfg.bm) for m in m_sizes) * math.ceil(N / bn)
    ws = bandwidth_workspace(m_sizes, N, cfg.bm, bn, psz, osz)
    return ArPlan("bandwidth", reason, **base, config=cfg.id, grid=min(sms, units), units=units, m_sizes=m_sizes,
                  ws=ws, **preds)


def with_digest(p: ArPlan, digest: int) -> ArPlan:
    return replace(p, digest=digest)
