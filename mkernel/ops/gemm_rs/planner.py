"""GEMM+ReduceScatter's planner: which path runs, on which tile config, and what each path is predicted
to cost -- a pure function of the agreed call (every rank computes the same plan).

Paths: "fused" (cuda_src/ops/gemm_rs.cu: one persistent kernel, tiles pushed to their owners as they
finish), "unfused" (mkernel.gemm, then mkernel.reduce_scatter), "gemm" (one local rank: the GEMM is the
whole op), "empty" (no output element: nothing runs).

Cost model (``CostModel``; times per rank, the call is the slowest rank's):

* fused: a tile costs ``t = 2 bm bn (K_r + epilogue) / (rate / SMs) / efficiency`` (the GEMM's
  ``config_cost``); a peer tile holds its SM ``tile_bytes / sm_push_bw`` longer (its epilogue's stores),
  an own tile ``(P-1) tile_bytes / sm_read_bw`` longer (reading the peers' partials).  Units go round
  robin over ``W = min(SMs, units)`` workers, peers' tiles first: ``T_sm`` = the busiest worker's sum.
  The link carries every peer tile once (``T_link`` = the larger of bytes sent and received over
  ``link_bw``), and the last own tile cannot finish before the last partial it needs has arrived:
  ``T_fused = max(T_sm, T_link + t + reduce) + launch``.
* unfused: the GEMM's own plan (``auto_plan``'s cost: config and split-K) for ``M x N x K_r`` (one GEMM
  per owner when the row split is uneven: the reduce-scatter needs equal shares), then a reduce-scatter
  of ``P`` shares of ``max(m_j) x N`` (``(P-1) share_bytes / rs_bw + rs_latency``).

The automatic choice is fused where ``T_fused < fuse_margin x T_unfused``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .. import gemm as G  # the GEMM package's public planning API
from ..gemm_comm import units_of_worker
from .layout import (FLAGS_PER_SOURCE, FUSED_CONFIGS, MAXP, WsLayout, owner_tiles, row_offsets, split_rows,
                     tile_bytes, workspace_layout)
from .options import CostModel, GemmRsOptions

__all__ = ["RsPlan", "plan", "choose_fused_config", "fused_time", "unfused_time", "m_sizes_for"]

_ISZ = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class RsPlan:
    """What one gemm_reduce_scatter call runs (``ctx.last_plan("gemm_rs")``).  Times are predictions in
    seconds (None where a path was not considered)."""

    path: str                     # "fused" | "unfused" | "gemm" | "empty"
    reason: str                   # why this path
    P: int
    me: int
    m_sizes: tuple                # rows of the result every local rank keeps
    N: int
    Ks: tuple                     # K_r of every local rank
    b_layout: str
    in_dtype: str
    out_dtype: str
    partial_dtype: str            # fused: the dtype of the partial tiles sent
    deterministic: bool
    config: int | None = None     # fused: the tile config
    grid: int = 0                 # fused: blocks (this rank)
    units: int = 0                # fused: tiles this rank computes (every owner's)
    ws: WsLayout | None = field(default=None, repr=False)
    predicted_fused: float | None = None
    predicted_unfused: float | None = None
    digest: int = field(default=0, repr=False)

    @property
    def fallback(self) -> str:
        """Why the GEMM runs before the reduce-scatter instead of fused with it ("" when it does not)."""
        return f"GEMM, then reduce-scatter ({self.reason})" if self.path == "unfused" and self.P > 1 else ""

    @property
    def offs(self) -> tuple:
        return row_offsets(self.m_sizes)


def m_sizes_for(M: int, P: int, m_sizes=None) -> tuple:
    """The row split: ``m_sizes`` checked against M and P, or the default even split.  Raises ValueError."""
    if m_sizes is None:
        return split_rows(M, P)
    m_sizes = tuple(m_sizes)
    if len(m_sizes) != P:
        raise ValueError(f"m_sizes has {len(m_sizes)} entries, expected one per local rank ({P})")
    if any(m < 0 for m in m_sizes) or sum(m_sizes) != M:
        raise ValueError(f"m_sizes {m_sizes} must be >= 0 and sum to a's rows ({M})")
    return m_sizes


def _tile_time(cfg, K: int, b_layout: str, sms: int, model: CostModel) -> float:
    """Seconds one SM spends on one tile of K_r = K (config_cost of one tile on one SM, in multiply-adds)."""
    return 2 * G.config_cost(cfg, 1, 1, K, b_layout) / (model.gemm_rate / sms)


def _fits(cfg, m_sizes, N: int, b_layout: str) -> bool:
    return max(owner_tiles(m, N, cfg.bm, cfg.tile_n(b_layout)) for m in m_sizes) <= FLAGS_PER_SOURCE


def choose_fused_config(m_sizes, N: int, K: int, b_layout: str, sms: int, config: int | None = None):
    """The fused kernel's TileConfig: ``config`` if given, else the GEMM's heuristic (``choose_config``) over
    FUSED_CONFIGS on the per-owner tile grids; None when no config keeps every owner within its flags."""
    if config is not None:
        cfg = G.CONFIGS[config]
        return cfg if _fits(cfg, m_sizes, N, b_layout) else None
    cands = tuple(c for c in FUSED_CONFIGS if _fits(G.CONFIGS[c], m_sizes, N, b_layout))
    if not cands:
        return None
    return G.choose_config(lambda cfg: sum(owner_tiles(m, N, cfg.bm, cfg.tile_n(b_layout)) for m in m_sizes), sms,
                           k=K, layout=b_layout, candidates=cands)


def fused_time(cfg, m_sizes, N: int, Ks, b_layout: str, partial_itemsize: int, sms: int, model: CostModel) -> float:
    """Predicted seconds of the fused call (the slowest rank's; see the module doc)."""
    P = len(m_sizes)
    bn = cfg.tile_n(b_layout)
    tb = tile_bytes(cfg.bm, bn, partial_itemsize)
    tiles = [owner_tiles(m, N, cfg.bm, bn) for m in m_sizes]
    push, reduce = tb / model.sm_push_bw, (P - 1) * tb / model.sm_read_bw
    worst = 0.0
    for r in range(P):
        t = _tile_time(cfg, Ks[r], b_layout, sms, model)
        n_peer = sum(tiles) - tiles[r]
        total = n_peer + tiles[r]
        if total == 0:
            continue
        W = min(sms, total)
        t_sm = max(units_of_worker(0, n_peer, w, W) * (t + push) + units_of_worker(n_peer, total, w, W) * (t + reduce)
                   for w in range(W))
        sent, received = n_peer * tb, (P - 1) * tiles[r] * tb
        t_link = max(sent, received) / model.link_bw
        worst = max(worst, max(t_sm, t_link + t + reduce))
    return worst + model.launch_latency


def unfused_time(m_sizes, N: int, Ks, b_layout: str, out_itemsize: int, sms: int, model: CostModel) -> float:
    """Predicted seconds of mkernel.gemm (one per owner when the split is uneven) + mkernel.reduce_scatter."""
    P = len(m_sizes)
    m_max = max(m_sizes)
    equal = all(m == m_max for m in m_sizes)
    problems = [sum(m_sizes)] if equal else [m for m in m_sizes if m > 0]
    t_gemm = 0.0
    for K in Ks:
        t = 0.0
        for M in problems:
            if K == 0:  # (a zero fill)
                t += M * N * out_itemsize / 2e12 + model.launch_latency
                continue
            res = G.auto_plan(M, N, K, b_layout, sms, with_cost=True)
            cost = res[3] if len(res) > 3 else G.config_cost(res[0], G.tile_count(res[0], M, N, b_layout), sms, K,
                                                              b_layout)
            t += 2 * cost / (model.gemm_rate / sms) + model.launch_latency
        t_gemm = max(t_gemm, t)
    share = m_max * N * out_itemsize
    t_rs = (P - 1) * share / model.rs_bw + model.rs_latency
    return t_gemm + t_rs


def plan(m_sizes, N: int, Ks, me: int, *, b_layout: str, in_dtype: str, out_dtype: str, sms: int,
         options: GemmRsOptions | None = None, deterministic: bool = False) -> RsPlan:
    """The plan of a call where local rank j keeps ``m_sizes[j]`` rows and has K_r = ``Ks[j]``, N output
    columns, for rank ``me`` (every rank's plan is the same but for ``me``, ``grid`` and ``units``)."""
    opts = options if options is not None else GemmRsOptions()
    model = opts.model
    m_sizes, Ks = tuple(int(m) for m in m_sizes), tuple(int(k) for k in Ks)
    P = len(m_sizes)
    partial = opts.partial_dtype or out_dtype
    base = dict(P=P, me=me, m_sizes=m_sizes, N=N, Ks=Ks, b_layout=b_layout, in_dtype=in_dtype, out_dtype=out_dtype,
                partial_dtype=partial, deterministic=deterministic)
    if sum(m_sizes) == 0 or N == 0:
        return RsPlan("empty", "no output element", **base)
    if P == 1:
        return RsPlan("gemm", "one local rank: the GEMM is the whole op", **base)
    t_unfused = unfused_time(m_sizes, N, Ks, b_layout, _ISZ[out_dtype], sms, model)
    why_not = None
    if P > MAXP:
        why_not = f"{P} local ranks (the fused kernel takes up to {MAXP})"
    elif min(Ks) == 0:
        why_not = "a rank has K_r = 0"
    cfg = None
    if why_not is None:
        cfg = choose_fused_config(m_sizes, N, max(Ks), b_layout, sms, opts.config)
        if cfg is None:
            why_not = f"more tiles per owner than the {FLAGS_PER_SOURCE} ready flags of the workspace"
    unfused_base = dict(base, partial_dtype=out_dtype)  # (the unfused path reduces in out's dtype)
    if why_not is not None:
        if opts.path == "fused":
            raise ValueError(f"gemm_reduce_scatter: path='fused' is not possible here: {why_not}")
        return RsPlan("unfused", why_not, **unfused_base, predicted_unfused=t_unfused)
    t_fused = fused_time(cfg, m_sizes, N, Ks, b_layout, _ISZ[partial], sms, model)
    if opts.path is not None:
        path, reason = opts.path, "forced (options.path)"
    elif t_fused < model.fuse_margin * t_unfused:
        path, reason = "fused", (f"predicted {t_fused * 1e6:.1f} us < {model.fuse_margin} x {t_unfused * 1e6:.1f} us "
                                 "unfused")
    else:
        path, reason = "unfused", (f"predicted fused {t_fused * 1e6:.1f} us >= {model.fuse_margin} x "
                                   f"{t_unfused * 1e6:.1f} us unfused")
    if path == "unfused":
        return RsPlan("unfused", reason, **unfused_base, config=cfg.id, predicted_fused=t_fused,
                      predicted_unfused=t_unfused)
    bn = cfg.tile_n(b_layout)
    units = sum(owner_tiles(m, N, cfg.bm, bn) for m in m_sizes)
    ws = workspace_layout(m_sizes, N, cfg.bm, bn, _ISZ[partial])
    return RsPlan("fused", reason, **base, config=cfg.id, grid=max(1, min(sms, units)), units=units, ws=ws,
                  predicted_fused=t_fused, predicted_unfused=t_unfused)


def with_digest(p: RsPlan, digest: int) -> RsPlan:
    return replace(p, digest=digest)
