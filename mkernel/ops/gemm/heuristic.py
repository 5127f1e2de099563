"""The GEMM's cost model and plan choice: which tile config, split-K plan, orientation (plain or transposed)
and launch kind a call of a given shape gets.  Pure functions of shapes, configs and the SM count -- no
arrays, no driver -- so other ops (AllGather+GEMM) plan with them too.

Model (docs/gemm.md, "Configurations", heuristic paragraph): per-SM time in multiply-accumulates /
efficiency; a cooperative config runs ``ceil(units / SMs)`` waves of ``bm * bn * (K_unit + epilogue)``; every
config is evaluated with its best split-K plan and the least predicted time wins.

Comments cite the measurements behind a constant as "entry N": docs/journal/gemm.md entry N.
"""
from __future__ import annotations

import math
from dataclasses import replace

from .configs import (AUTO_CANDIDATES, CONFIGS, DECODE_SWAP_CONFIGS, LEGACY_CANDIDATES, SWAP_CANDIDATES,
                      TALL_SWAP_CONFIGS, TileConfig)

__all__ = ["choose_config", "config_cost", "workers", "tile_count", "scheduler_units", "grid_size",
           "max_splits", "max_splits_for", "choose_splits", "split_plan", "split_cost", "auto_plan",
           "orient_and_plan", "swap_candidates", "load_bound", "misaligned_rows", "phantom_row_half",
           "pdl_auto", "use_pdl", "CLUSTER4_FIT", "TAIL_SPLIT_MIN_GAIN", "SMALL_M", "SWAP_MAX_M"]

# Epilogue cost in K-equivalents.  Register epilogue: a 128 x 256 bf16 tile's stores take about as long as
# 256 more K of main loop (measured on kv_b, K = 512); ping-pong hides it but at the end.  TMA-store
# epilogue: the consumers only write shared memory, the stores drain under the next tile (32 fitted in
# docs/journal/gemm.md entry 9).
EPILOGUE_K = 256
EPILOGUE_K_TMA = 32
# Split-K (plain GEMM): at most MAX_SPLITS splits of at least MIN_SPLIT_KBLOCKS K blocks each, at most
# MAX_PARTIAL_BYTES of fp32 running sums per plan.  SPLIT_REDUCE_COST: a unit's share of the reduction in
# fp32 tiles of traffic (its additions into the tile's sum; the last unit's read-back and re-zeroing),
# whatever the split factor (docs/journal/gemm.md entry 11).
MAX_SPLITS = 16
MIN_SPLIT_KBLOCKS = 4
MAX_PARTIAL_BYTES = 64 << 20
SPLIT_REDUCE_COST = 4.0
# A last-wave split must beat every other plan by this fraction: predicted gains of a few % came out as
# 1-3 % losses on large problems (docs/journal/gemm.md entry 10).
TAIL_SPLIT_MIN_GAIN = 0.10
# M at or below which TileConfig.efficiency_small_m applies: one band of rows streams B (entry 14).
SMALL_M = 128
# TileConfig.full_wave_max_m's "one whole wave": at least this fraction of the SMs get a tile, none a second.
FULL_WAVE_FILL = 0.9
# Clusters of four fit 120 of an H200's 132 SMs (cuOccupancyMaxActiveClusters: a GPC's SMs do not all group
# up); pairs fit every SM.  The model's share for clusters of four or more; the launch caps its grid by the
# driver's answer.
CLUSTER4_FIT = 120 / 132
# Operand rows an odd multiple of 16 bytes apart: each 128-byte TMA box row moves 5 sectors instead of 4
# (docs/journal/gemm.md entries 60, 62), so the configs loading the most rows per multiply-accumulate
# become load-bound: a K block costs at least (rows loaded per block, x MISALIGNED_ROW_COST for a misaligned
# operand) x LOAD_AREA_PER_ROW tile-area units (load_bound).  75 fitted on the table of entry 64 (the
# geometric-mean regret 1.07 -> 1.02-1.03).
MISALIGNED_ROW_COST = 1.25
LOAD_AREA_PER_ROW = 75
# Programmatic dependent launch (pdl_auto): every plain GEMM without cluster split-K (it hides most of a small
# call's launch latency: 160x120x96 3.1 -> 2.4 us, entry 62); grouped GEMMs and cluster split-K from this
# arithmetic intensity (flop per byte of A, B and C) up (entries 20, 35).  Cluster split-K also only where
# its blocks fill PDL_CK_MIN_FILL of the SMs or a block's K range is at most PDL_CK_MAX_K: elsewhere it lost
# 1.6-5.6 us per call (entry 45).
PDL_MIN_INTENSITY = 100
PDL_CK_MIN_FILL = 0.9
PDL_CK_MAX_K = 2048
# Transposed plans (swap_candidates; docs/gemm.md, "Transposed (swapped) plans"; entries 66-67).
# Decode-shaped calls, M <= SWAP_MAX_M: the 64 x 16 / 64 x 32 tiles where ceil(N / 64) tiles fill SWAP_FILL
# of the SMs (16x8192x8192 39.4 -> 32.6 us).
SWAP_MAX_M = 32
SWAP_FILL = 0.75
# Tall-skinny calls: 128-row tiles along N's few columns where a long K hides the transposed register stores
# (9008x248x5752 69.0 -> 61.3 us; at short K they lose), N filling SWAP_MIN_FILL of its tiles (64-row and
# half-empty tiles lost where the model put them ahead), and the model's gain at least 1 - SWAP_GAIN.
SWAP_MAX_N = 256
SWAP_MIN_K = 4096
SWAP_GAIN = 0.95
SWAP_MIN_FILL = 0.75


def epilogue_k(cfg: TileConfig) -> int:
    """The config's exposed epilogue cost in K-equivalents (EPILOGUE_K, EPILOGUE_K_TMA)."""
    return EPILOGUE_K_TMA if cfg.tma_store else EPILOGUE_K


def tile_count(cfg: TileConfig, M: int, N: int, b_layout: str) -> int:
    """Output tiles (with clusters along N or M: that dimension's tiles rounded up to whole clusters,
    the scheduler's units and split-K slots)."""
    num_n = math.ceil(N / cfg.tile_n(b_layout))
    num_m = math.ceil(M / cfg.bm)
    return (-(-num_m // cfg.cluster_m) * cfg.cluster_m) * (-(-num_n // cfg.cluster_n) * cfg.cluster_n)


def scheduler_units(tiles: int, splits: int, split_from: int) -> int:
    """Scheduler units of a split plan: the whole tiles before split_from, then ``splits`` per tile."""
    return split_from + (tiles - split_from) * splits if splits > 1 else tiles


def grid_size(cfg: TileConfig, units: int, sms: int) -> int:
    """Persistent blocks for ``units`` scheduler units on ``sms`` SMs (whole clusters)."""
    if cfg.pairs > 1:  # (units come in pairs: see tile_count)
        return max(cfg.pairs, min(units, sms) // cfg.pairs * cfg.pairs)
    if cfg.cluster_k > 1:  # CK blocks per tile
        return max(cfg.cluster_k, min(units * cfg.cluster_k, sms) // cfg.cluster_k * cfg.cluster_k)
    return max(1, min(math.ceil(units / cfg.tiles_per_block), sms))


def workers(cfg: TileConfig, sms: int) -> int:
    """Blocks of ``cfg`` resident at once on ``sms`` SMs (the planning model's wave width)."""
    c = cfg.cluster
    if c < 4:
        return sms
    return max(c, int(sms * CLUSTER4_FIT) // c * c)


def _candidates(candidates, allowed=None) -> tuple:
    """``candidates`` restricted to ``allowed`` (GemmOptions.candidates; ignored where it leaves none)."""
    if not allowed:
        return tuple(candidates)
    return tuple(c for c in candidates if c in allowed) or tuple(candidates)


def choose_config(num_tiles, num_sms: int, *, k: int | None = None, layout: str | None = None,
                  candidates=LEGACY_CANDIDATES, allowed=None) -> TileConfig:
    """Pick the tile config of least predicted time (config_cost).

    ``num_tiles(cfg)`` gives the tile count of the problem under ``cfg``.  Without ``k`` (callers that only
    compare tile shapes) the cost is ``waves * bm * bn / efficiency``.  ``layout`` ("kn" / "nk") drops
    configs whose tile differs by layout when the layout does not suit them (config 5 with "kn").

    ``candidates``: config ids to consider, restricted to ``allowed`` (GemmOptions.candidates).
    """
    candidates = _candidates(candidates, allowed)
    best, best_cost = None, None
    for cid in candidates:
        cfg = CONFIGS[cid]
        if cfg.debug or (layout == "kn" and cfg.bn_kn is not None):
            continue
        cost = config_cost(cfg, max(1, num_tiles(cfg)), num_sms, k, layout or "nk")
        if best_cost is None or cost < best_cost:
            best, best_cost = cfg, cost
    return best


def config_cost(cfg: TileConfig, tiles: int, num_sms: int, k: int | None, layout: str = "nk",
                splits: int = 1) -> float:
    """Predicted per-SM time of ``tiles`` tiles under ``cfg`` (arbitrary units).

    A cooperative config runs ``ceil(tiles / SMs)`` waves of ``bm * bn * (K + epilogue_k)``; a ping-pong config
    ``2 * ceil(tiles / (2 SMs))`` tiles of ``bm * bn * K`` per block plus the exposed last epilogue(s) (both
    warpgroups' if each has a single tile); a cluster split-K config ``cluster_k`` blocks per tile, each on
    ``1 / cluster_k`` of K.  ``splits`` > 1 (split-K): ``tiles * splits`` units of ``ceil(K / 64 / splits)`` K
    blocks, each plus SPLIT_REDUCE_COST fp32 tiles of ``bm * bn * 4`` bytes counted in K-equivalents of
    operand loads (``bm * bn * 4 / ((bm + bn) * 2)``)."""
    area = cfg.bm * cfg.tile_n(layout)
    if k is None:
        return math.ceil(tiles / (num_sms * cfg.tiles_per_block)) * cfg.tiles_per_block * area / cfg.efficiency
    if cfg.cluster_k > 1:
        unit_k = math.ceil(math.ceil(k / 64) / cfg.cluster_k) * 64
        return math.ceil(tiles * cfg.cluster_k / num_sms) * area * (unit_k + epilogue_k(cfg)) / cfg.efficiency
    if not cfg.pingpong:
        if splits > 1:
            bn = cfg.tile_n(layout)
            unit_k = math.ceil(math.ceil(k / 64) / splits) * 64
            partial_k = cfg.bm * bn * 4 / ((cfg.bm + bn) * 2)
            unit_k += SPLIT_REDUCE_COST * partial_k
            return math.ceil(tiles * splits / num_sms) * area * (unit_k + epilogue_k(cfg)) / cfg.efficiency
        return math.ceil(tiles / num_sms) * area * (k + epilogue_k(cfg)) / cfg.efficiency
    w = math.ceil(tiles / (2 * num_sms))
    exposed = (2 if w == 1 else 1) * area * EPILOGUE_K
    return 2 * w * area * k / cfg.efficiency + exposed


def max_splits(cfg: TileConfig, M: int, N: int, K: int, b_layout: str, split_tiles: int | None = None) -> int:
    """The most K splits a plain GEMM may use with ``cfg`` for ``split_tiles`` split tiles (default:
    every tile); 1: none (ping-pong and debug configs never split)."""
    tiles = tile_count(cfg, M, N, b_layout) if split_tiles is None else split_tiles
    return max_splits_for(cfg, tiles, K, b_layout)


def max_splits_for(cfg: TileConfig, split_tiles: int, K: int, b_layout: str) -> int:
    """max_splits for ``split_tiles`` split tiles of K = ``K``: MAX_SPLITS, MIN_SPLIT_KBLOCKS,
    MAX_PARTIAL_BYTES; 1 for ping-pong, debug and cluster split-K configs."""
    if (cfg.pingpong or cfg.debug or cfg.cluster_k > 1
            or split_tiles * cfg.bm * cfg.tile_n(b_layout) * 4 > MAX_PARTIAL_BYTES):
        return 1
    return max(1, min(MAX_SPLITS, math.ceil(K / 64) // MIN_SPLIT_KBLOCKS))


def choose_splits(cfg: TileConfig, M: int, N: int, K: int, b_layout: str, sms: int) -> tuple[int, int]:
    """``(splits, split_from)`` of least predicted time for ``cfg`` (config_cost): fewer tiles than SMs
    -> every tile split (``split_from = 0``); otherwise whole waves of whole tiles and, when the last
    wave is partial, its ``r`` tiles split up to ``sms // r`` ways (``split_from = tiles - r``), so it
    takes a fraction of a tile's time instead of a whole one.  ``(1, tiles)``: no split."""
    return split_plan(cfg, tile_count(cfg, M, N, b_layout), K, b_layout, sms)


def split_plan(cfg: TileConfig, tiles: int, K: int, b_layout: str, workers: int,
               tail_margin: float = 0.0) -> tuple[int, int]:
    """choose_splits for ``tiles`` tiles on ``workers`` blocks (fused kernels pass their own tile
    count and worker count).  A last-wave split must save ``tail_margin`` of the unsplit cost."""
    best, best_cost = (1, tiles), config_cost(cfg, tiles, workers, K, b_layout)
    if tiles < workers:
        for sp in range(2, max_splits_for(cfg, tiles, K, b_layout) + 1):
            c = config_cost(cfg, tiles, workers, K, b_layout, sp)
            if c < best_cost:
                best, best_cost = (sp, 0), c
        return best
    q, r = divmod(tiles, workers)
    if r == 0 or cfg.pairs > 1:  # (clusters: the pair scheduler's split_from would count pairs)
        return best
    whole = q * config_cost(cfg, workers, workers, K, b_layout)
    unsplit = best_cost
    for sp in range(2, min(max_splits_for(cfg, r, K, b_layout), workers // r) + 1):
        c = whole + config_cost(cfg, r, workers, K, b_layout, sp)
        if c < best_cost and c < (1 - tail_margin) * unsplit:
            best, best_cost = (sp, tiles - r), c
    return best


def split_cost(cfg: TileConfig, tiles: int, K: int, b_layout: str, workers: int, splits: int, split_from: int) -> float:
    """config_cost of a split plan (``splits`` = 1: the unsplit cost)."""
    if splits <= 1:
        return config_cost(cfg, tiles, workers, K, b_layout)
    if split_from == 0:
        return config_cost(cfg, tiles, workers, K, b_layout, splits)
    return (split_from // workers) * config_cost(cfg, workers, workers, K, b_layout) + config_cost(
        cfg, tiles - split_from, workers, K, b_layout, splits)


def _pick_plan(plans: list) -> tuple:
    """The least-cost (cost, config, splits, split_from); a last-wave split must beat every other plan by
    TAIL_SPLIT_MIN_GAIN."""
    best = min(plans, key=lambda p: p[0])
    if best[2] > 1 and best[3] > 0:
        rest = [p for p in plans if not (p[2] > 1 and p[3] > 0)]
        if rest and best[0] > (1 - TAIL_SPLIT_MIN_GAIN) * min(p[0] for p in rest):
            best = min(rest, key=lambda p: p[0])
    return best


def phantom_row_half(cfg: TileConfig, M: int) -> bool:
    """Whether M's row tiles leave a pair along M with a half below M (one SM idle): the heuristic never
    offers such a plan (a forced config still runs it)."""
    return math.ceil(M / cfg.bm) % cfg.cluster_m != 0


def misaligned_rows(M: int, N: int, K: int, b_layout: str, itemsize: int = 2, pad: int = 0) -> tuple[bool, bool]:
    """(A, B): whether dense operands of an M x N x K GEMM, each row padded by ``pad`` elements, have rows
    an odd multiple of 16 bytes apart (load_bound; operands.row_misaligned for the shape alone: A is M rows
    of K elements, B K rows of N ("kn") or N rows of K ("nk"); an operand of one row has no row stride)."""
    b_rows, b_cols = (K, N) if b_layout == "kn" else (N, K)
    return tuple(rows > 1 and ((cols + pad) * itemsize) % 32 == 16 for rows, cols in ((M, K), (b_rows, b_cols)))


def load_bound(cfg: TileConfig, misaligned: tuple[bool, bool], b_layout: str = "nk") -> TileConfig:
    """``cfg`` with its efficiencies capped by what its load stream allows when A's and / or B's rows
    (``misaligned``) are an odd multiple of 16 bytes apart (MISALIGNED_ROW_COST, LOAD_AREA_PER_ROW);
    ``cfg`` itself when neither is.  Rows a cluster multicasts count once per block that loads them, so
    on misaligned rows the pairs beat the single-block configs of their tile."""
    if not any(misaligned):
        return cfg
    bn = cfg.tile_n(b_layout)
    rows_a = cfg.bm // cfg.cluster_n  # rows each block loads per K block (clusters multicast the rest)
    rows_b = bn // cfg.cluster_m
    rows = sum(r * (MISALIGNED_ROW_COST if m else 1.0) for r, m in zip((rows_a, rows_b), misaligned))
    cap = cfg.bm * bn / (rows * LOAD_AREA_PER_ROW)
    small = None if cfg.efficiency_small_m is None else min(cfg.efficiency_small_m, cap)
    return replace(cfg, efficiency=min(cfg.efficiency, cap), efficiency_small_m=small)


def auto_plan(M: int, N: int, K: int, b_layout: str, sms: int, config: int | None = None,
              misaligned: tuple[bool, bool] = (False, False), candidates=AUTO_CANDIDATES, with_cost: bool = False,
              allowed=None):
    """(config, splits, split_from) for a plain GEMM: the heuristic's config and split-K plan (a
    forced config still gets its best split plan).  ``misaligned``: whether A's / B's rows are an odd
    multiple of 16 bytes apart (load_bound).  ``with_cost``: the pick's predicted cost as a fourth value
    (not with a forced config)."""
    if config is not None:
        cfg = CONFIGS[config]
        return (cfg, *choose_splits(cfg, M, N, K, b_layout, workers(cfg, sms)))
    cands = _candidates(candidates, allowed)
    plans = []  # (cost, config, splits, split_from)
    for cid in cands:
        cfg = load_bound(CONFIGS[cid], misaligned, b_layout)
        if cfg.debug or (b_layout == "kn" and cfg.bn_kn is not None):
            continue
        if phantom_row_half(cfg, M):
            continue
        tiles = max(1, tile_count(cfg, M, N, b_layout))
        # one band of rows streaming B, or (up to full_wave_max_m) one whole wave of tiles: the small-M
        # efficiency (a uniform factor: splits unchanged)
        if cfg.efficiency_small_m is not None and (
                M <= SMALL_M or (M <= cfg.full_wave_max_m and FULL_WAVE_FILL * sms <= tiles <= sms)):
            cfg = replace(cfg, efficiency=cfg.efficiency_small_m)
        w = workers(cfg, sms)
        if cfg.cluster_k > 1 and tiles * cfg.cluster_k > w:  # beyond one wave it lost everywhere (entry 15)
            continue
        sp, sf = choose_splits(cfg, M, N, K, b_layout, w)
        plans.append((split_cost(cfg, tiles, K, b_layout, w, sp, sf), cid, sp, sf))
        if sp > 1 and sf > 0:  # last-wave split: also keep this config's unsplit plan as a candidate
            plans.append((config_cost(cfg, tiles, w, K, b_layout), cid, 1, tiles))
    best = _pick_plan(plans)
    # Cluster split-K replaces a split plan, never an unsplit one: where whole tiles already fill the SMs,
    # halving K per block only adds the exchange and the register epilogue (entry 40).
    if CONFIGS[best[1]].cluster_k > 1:
        rest = [p for p in plans if CONFIGS[p[1]].cluster_k == 1]
        alt = _pick_plan(rest) if rest else None
        if alt is not None and alt[2] == 1:
            best = alt
    if with_cost:
        return CONFIGS[best[1]], best[2], best[3], best[0]
    return CONFIGS[best[1]], best[2], best[3]


def orient_and_plan(M: int, N: int, K: int, b_layout: str, sms: int, options, misaligned, gemv_ok: bool):
    """``(swap, config, splits, split_from)`` of a plain GEMM's plan, or None where the decode kernel
    (gemv.py) takes the call (``gemv_ok``).  ``options``: a GemmOptions.  Unless a config, a split factor or
    ``swap`` is forced, swap_candidates decides the orientation; a transposed plan is the N x M x K
    problem's (``misaligned`` exchanged too).  ``splits``: forced on every tile.  ``deterministic``: no
    split-K (its partials are added in arrival order)."""
    config, splits, swap, allowed = options.config, options.splits, options.swap, options.candidates
    cands = SWAP_CANDIDATES  # (swap forced)
    if config is None and splits is None and swap is None:
        cands = swap_candidates(M, N, K, b_layout, sms, misaligned, gemv_ok, options.transposed, allowed)
        if cands is None and gemv_ok:
            return None
        swap = cands is not None
    swap = bool(swap)
    if swap:
        M, N, misaligned = N, M, misaligned[::-1]
    cfg, sp, sf = auto_plan(M, N, K, b_layout, sms, config, misaligned, cands if swap else AUTO_CANDIDATES,
                            allowed=allowed)
    if swap:
        sp, sf = _decode_swap_splits(cfg, M, N, b_layout, sms, sp, sf)
    if splits is not None:  # forced: every tile split
        sp, sf = max(1, min(int(splits), max_splits(cfg, M, N, K, b_layout))), 0
    if options.deterministic and sp > 1:
        sp, sf = 1, 0
    return swap, cfg, sp, sf


def _decode_swap_splits(cfg: TileConfig, M: int, N: int, b_layout: str, sms: int, sp: int, sf: int):
    """A transposed decode plan's split: none where its tiles make one whole wave -- B's rows stream once
    either way, splits only cut the stream (16x7168x16384: 59.5 us unsplit, 67.1 in 7 splits; entry 67);
    other plans keep (sp, sf)."""
    if cfg.id in DECODE_SWAP_CONFIGS and SWAP_FILL * sms <= tile_count(cfg, M, N, b_layout) <= sms:
        return 1, 0
    return sp, sf


def swap_candidates(M: int, N: int, K: int, b_layout: str, sms: int, misaligned=(False, False),
                    gemv_ok: bool = False, transposed: bool = True, allowed=None):
    """The configs a transposed plan (C^T = B A^T, computed as the N x M x K problem) of an M x N x K call
    chooses among, or None for a plain plan (never with ``transposed`` False: GemmOptions.transposed).
    ``misaligned``: A's / B's rows (load_bound); ``gemv_ok``: the decode kernel (gemv.py) would take the
    call; ``allowed``: GemmOptions.candidates.

    Decode-shaped calls (B "nk", M <= SWAP_MAX_M): config 53 (M <= 16) / 54, but for the calls the decode
    kernel takes (``gemv_ok``) whose ceil(N / 64) tiles would not fill SWAP_FILL of the SMs.  Tall-skinny
    calls (B "nk", N <= SWAP_MAX_N, K >= SWAP_MIN_K, M >= 8 N, N filling SWAP_MIN_FILL of its 128-row
    tiles): TALL_SWAP_CONFIGS where the cost model puts the transposed plan at most SWAP_GAIN of the plain
    one."""
    if b_layout != "nk" or not transposed:
        return None
    if M <= SWAP_MAX_M:
        if gemv_ok and -(-N // 64) < SWAP_FILL * sms:
            return None
        return (53,) if M <= 16 else (54,)
    if N <= SWAP_MAX_N and K >= SWAP_MIN_K and M >= 8 * N and N >= SWAP_MIN_FILL * 128 * -(-N // 128):
        plain = auto_plan(M, N, K, b_layout, sms, None, misaligned, with_cost=True, allowed=allowed)[3]
        cands = TALL_SWAP_CONFIGS
        swapped = auto_plan(N, M, K, b_layout, sms, None, misaligned[::-1], cands, with_cost=True, allowed=allowed)[3]
        if swapped <= SWAP_GAIN * plain:
            return cands
    return None


def pdl_auto(M: int, N: int, K: int, groups: int = 1, cfg: TileConfig | None = None,
             blocks: int | None = None, sms: int | None = None) -> bool:
    """The automatic choice of a programmatic dependent launch for an M x N x K GEMM (grouped: M rows
    in all over ``groups`` weights of N x K) on tile config ``cfg`` launched as ``blocks`` blocks on
    ``sms`` SMs: on for every plain GEMM on a config without cluster split-K; for grouped GEMMs and
    cluster split-K configs where its arithmetic intensity ``2MNK / (2(MK + groups NK + MN))`` is at
    least PDL_MIN_INTENSITY flop per byte, and for the latter only where, besides, the blocks fill
    PDL_CK_MIN_FILL of the SMs or a block's K range is at most PDL_CK_MAX_K (off if ``blocks`` or
    ``sms`` is not given)."""
    ck = cfg is not None and cfg.cluster_k > 1
    if (groups > 1 or ck) and 2.0 * M * N * K < PDL_MIN_INTENSITY * 2.0 * (M * K + groups * N * K + M * N):
        return False
    if ck:
        if not blocks or not sms:
            return False
        k_range = -(-K // (64 * cfg.cluster_k)) * 64
        return blocks >= PDL_CK_MIN_FILL * sms or k_range <= PDL_CK_MAX_K
    return True


def use_pdl(auto: bool, pdl: bool | None = None) -> bool:
    """Whether a plan launches its kernel as a programmatic dependent: ``pdl`` (GemmOptions.pdl) True
    always, False never, None: ``auto`` (its pdl_auto).  Such a kernel may start while the previous kernel
    in its stream finishes; its blocks initialise their barriers, then wait for that kernel to complete
    (griddepcontrol.wait)."""
    return auto if pdl is None else bool(pdl)
