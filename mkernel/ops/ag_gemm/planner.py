"""AllGather+GEMM's planner: which path runs, with how many communication SMs, on which tile config, in
which chunks, with which split-K -- and what each path is predicted to cost.  Pure functions of the agreed
call (every rank computes the same plan from the values the ranks exchanged); docs/ag_gemm.md, "Design".

Paths: "fused_ce" (the GEMM on every SM, the shards moved by the copy engines on a side stream), "fused"
(one cooperative kernel, ``comm_sms`` blocks of it pushing the shards), "unfused" (a gather kernel, then
:func:`mkernel.gemm` on the gathered rows).  The automatic choice is the fastest predicted fused path that
beats ``fuse_margin`` x unfused; "fused" is a candidate only with ``fused_auto`` (its model is not
calibrated: docs/journal/validation.md).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, fields, replace

import numpy as np

from ...dist.signals import MAX_CHUNKS
from ..collectives.layout import grid_for
from .. import gemm as G  # the GEMM package's public planning API
from .layout import CE_VALUES, FUSED_CONFIGS

__all__ = ["CostModel", "MODEL", "AgPlan", "PATHS", "plan", "chunk_rows_for", "ce_chunk_rows", "ce_copy_groups",
           "tile_config", "call_digest", "CE_GROUP_OPTIONS", "AG_TAIL_SPLIT_MIN_GAIN"]

PATHS = ("fused", "fused_ce", "unfused")


@dataclass(frozen=True)
class CostModel:
    """Every constant of the planner, in one place (H200, NVLink 4 through NVSwitch)."""

    per_block_bw: float = 20e9      # B/s one communication block pushes to a peer over NVLink
    link_bw: float = 300e9          # B/s a GPU sends (and receives) over NVLink, achievable by SM copies
                                    # (all-gather 1 GiB: 276-291 GB/s bus bw, copy engine 384 GB/s;
                                    # docs/journal/validation.md)
    local_block_bw: float = 60e9    # B/s one block copies HBM -> HBM
    hbm_copy_bw: float = 1.6e12     # B/s cap of local copies (read + write share HBM)
    gemm_rate: float = 700e12       # dense bf16/fp16 FLOP/s of the whole GPU (all SMs busy; measured 705-712
                                    # on random data, docs/ag_gemm.md)
    chunk_latency: float = 2e-6     # s per chunk a block moves (flag round trip, barrier)
    launch_latency: float = 6e-6    # s per kernel launch + epoch handshake
    fuse_margin: float = 0.97       # fuse only if predicted fused < margin * predicted unfused
    max_comm_sms: int = 32          # candidates for the split: 1 .. max_comm_sms
    chunk_target_bytes: int = 1 << 20  # bytes per ready flag (before the parallelism cap)
    min_chunks: int = 16            # the largest shard is cut into at least this many chunks
    comm_safety: float = 1.25       # push times are scaled by this (a late chunk stalls the GEMM)
    min_comm_sms: int = 4           # never fewer communication blocks (they also do the local copy)
    chunks_per_block: int = 2       # SM paths: the largest shard has at least this many chunks per
    min_chunk_bytes: int = 64 << 10  # pushing block, down to chunks of this many bytes
    # copy-engine path ("fused_ce")
    ce_link_bw: float = 370e9       # B/s the copy engines push to one peer (copy engine 382.7 GB/s measured)
    ce_local_bw: float = 1.2e12     # B/s a copy-engine HBM -> HBM copy
    ce_op_latency: float = 3e-6     # s per copy-engine operation (data or flag copy; 256 MiB both ways on
                                    # 2 x H200 in 1 / 8 / 16 copies: 696 / 724 / 754 us, each with a flag
                                    # copy 697 / 744 / 794: docs/ag_gemm.md)
    ce_start_latency: float = 20e-6  # s from the call to the first copy moving (fork, the GEMM's worker 0
                                     # opening the call, the side stream's wait, first op)
    ce_free_sms: int = 0            # SMs the fused_ce GEMM leaves idle (0: the GEMM itself opens the
                                    # call, no side-stream kernel takes an SM)
    ce_chunks: int = 4              # chunks (ready flags) per shard: the planner tries ce_chunks,
    ce_chunks_max: int = 64         # 2 * ce_chunks, ... up to ce_chunks_max (docs/ag_gemm.md), each with
                                    # every copy grouping of CE_GROUP_OPTIONS
    ce_gemm_slowdown: float = 1.02  # the GEMM beside incoming NVLink traffic (L2 / HBM sharing)
    ce_min_bytes: int = 8 << 20     # automatic plan: fused_ce only from this many gathered bytes (below,
                                    # the call is host-bound: fork/join and copy submissions cost more
                                    # than the transfer they hide)


    # fields that divide (or cap) something: must be > 0; every other field >= 0
    _POSITIVE = ("per_block_bw", "link_bw", "local_block_bw", "hbm_copy_bw", "gemm_rate", "chunk_target_bytes",
                 "min_chunks", "chunks_per_block", "min_chunk_bytes", "ce_link_bw", "ce_local_bw", "ce_chunks",
                 "ce_chunks_max", "max_comm_sms", "min_comm_sms", "fuse_margin", "comm_safety", "ce_gemm_slowdown")

    def checked(self) -> "CostModel":
        """Self, or a ValueError naming the first field out of range."""
        for f in fields(self):
            v = getattr(self, f.name)
            ok_type = isinstance(v, int) if f.type in ("int", int) else isinstance(v, (int, float))
            if isinstance(v, bool) or not ok_type or not (v > 0 if f.name in self._POSITIVE else v >= 0):
                raise ValueError(f"CostModel.{f.name} must be {'an int' if f.type in ('int', int) else 'a number'} "
                                 f"{'> 0' if f.name in self._POSITIVE else '>= 0'}, got {v!r}")
        return self

    @classmethod
    def from_spec(cls, spec: str, what: str = "MKERNEL_AG_GEMM_MODEL") -> "CostModel":
        """CostModel() with the overrides of ``spec``, e.g. ``"per_block_bw=15e9,link_bw=280e9"``."""
        kw = {}
        for item in filter(None, (x.strip() for x in spec.split(","))):
            name, _, val = item.partition("=")
            f = cls.__dataclass_fields__.get(name.strip())
            if f is None:
                raise ValueError(f"{what}: unknown field {name!r}; known: {list(cls.__dataclass_fields__)}")
            kw[name.strip()] = int(float(val)) if f.type in ("int", int) else float(val)
        return cls(**kw)


MODEL = CostModel()  # the built-in constants (the op's default options take MKERNEL_AG_GEMM_MODEL's overrides)


@dataclass
class AgPlan:
    """What one ag_gemm call ran (or would run).  Times are predictions, in seconds."""

    path: str                       # "fused" (SM communication) | "fused_ce" (copy engines) | "unfused"
    comm_sms: int                   # communication blocks of the fused kernel (0 when unfused)
    workers: int                    # GEMM blocks of the fused kernel
    config: int                     # tile config of the fused kernel (mkernel.gemm.CONFIGS)
    chunk_rows: int                 # rows per ready flag
    m_sizes: tuple                  # M_j of every local rank
    n_max: int
    K: int
    P: int
    predicted_fused: float
    predicted_unfused: float
    predicted_comm: float           # fused: communication time with comm_sms blocks
    predicted_gemm: float           # fused: GEMM time on the workers
    predicted_allgather: float      # unfused parts
    predicted_gemm_alone: float
    reason: str = ""
    gather_blocks: int = 0          # unfused: blocks of the gather kernel
    fused_comm_sms: int = 0         # the model's best split, also when the unfused path was chosen
    splits: int = 1                 # fused paths: K splits of the tiles from split_from on (the last,
    split_from: int = 0             # partial wave of the workers' tile order; 1 = none)
    ce_group_max: int = 1           # fused_ce: the largest copy group, in chunks (ce_copy_groups)

    @property
    def fallback(self) -> str:
        """Why the ranks' rows are gathered before the GEMM instead of during it ("" when they are not)."""
        return f"all-gather, then GEMM ({self.reason})" if self.path == "unfused" and self.P > 1 else ""

    def describe(self) -> str:
        us = lambda t: f"{t * 1e6:.1f}us" if math.isfinite(t) else "n/a"  # noqa: E731
        split = f" splits={self.splits} from tile {self.split_from}" if self.splits > 1 else ""
        if self.path == "fused_ce" and self.ce_group_max > 1:
            split += f" copy groups<={self.ce_group_max}"
        return (f"path={self.path} comm_sms={self.comm_sms} workers={self.workers} config={self.config}{split} "
                f"chunk_rows={self.chunk_rows} P={self.P} M={list(self.m_sizes)} N={self.n_max} K={self.K} "
                f"predicted fused={us(self.predicted_fused)} (comm {us(self.predicted_comm)}, gemm "
                f"{us(self.predicted_gemm)}) unfused={us(self.predicted_unfused)} (allgather "
                f"{us(self.predicted_allgather)} + gemm {us(self.predicted_gemm_alone)}) [{self.reason}]")


last_plan: AgPlan | None = None



def _pow2_floor(x: float) -> int:
    x = max(1, int(x))
    return 1 << (x.bit_length() - 1)


def _pow2_ceil(x: int) -> int:
    """The least power of two >= x (1 for x <= 1)."""
    return 1 << (max(1, int(x)) - 1).bit_length()


def chunk_rows_for(m_sizes, row_bytes: int, model: CostModel = MODEL, blocks: int | None = None) -> int:
    """Rows per ready flag: a power of two in [8, 8192], about ``chunk_target_bytes`` per chunk but
    small enough that the largest shard has ``min_chunks`` chunks (so many blocks can push at once)
    and, given the ``blocks`` that push it, ``chunks_per_block`` chunks per block (so every block is
    busy and rows land progressively) down to ``min_chunk_bytes`` per chunk; more than 8192 only where
    a shard would otherwise have more than ``MAX_CHUNKS`` chunks (the workspace has flags for that
    many).  Depends only on values every rank agrees on."""
    m_max = max(m_sizes) if len(m_sizes) else 0
    target = _pow2_floor(model.chunk_target_bytes / max(row_bytes, 1))
    cap = _pow2_floor(max(1, m_max // model.min_chunks))
    if blocks:
        floor = _pow2_ceil(-(-model.min_chunk_bytes // max(row_bytes, 1)))  # rows of >= min_chunk_bytes
        cap = min(cap, max(floor, _pow2_floor(max(1, m_max // (model.chunks_per_block * blocks)))))
    return int(max(min(8192, max(8, min(target, cap))), _min_chunk_rows(m_max)))


def _min_chunk_rows(m_max: int) -> int:
    """The fewest rows per chunk (a power of two) that cut a shard of ``m_max`` rows into at most
    ``MAX_CHUNKS`` chunks."""
    return _pow2_ceil(-(-m_max // MAX_CHUNKS))


def _tile_time(cfg, K: int, sms: int, model: CostModel) -> float:
    return 2.0 * cfg.bm * cfg.bn * max(K, 1) / (model.gemm_rate / sms) / cfg.efficiency


def _gemm_time(tiles: int, workers: int, cfg, K: int, sms: int, model: CostModel) -> float:
    return math.ceil(tiles / max(workers, 1)) * _tile_time(cfg, K, sms, model) if tiles else 0.0


def _push_rate(blocks: int, nch: int, model: CostModel) -> tuple[float, int]:
    """(bytes/s one rank pushes with `blocks` blocks over `nch` chunks, blocks actually busy)."""
    eff = max(1, min(blocks, nch)) if nch else 1
    return min(eff * model.per_block_bw, model.link_bw), eff


def _comm_time(m_sizes, row_bytes: int, blocks: int, chunk_rows: int, gathered: bool, model: CostModel) -> float:
    """Slowest rank: local copy, then pushes to P-1 peers (send and receive both bounded by the link)."""
    P = len(m_sizes)
    total = sum(m_sizes)
    worst = 0.0
    for m in m_sizes:
        nch = -(-m // chunk_rows) if m else 0
        rate, eff = _push_rate(blocks, nch, model)
        local = m * row_bytes + (total * row_bytes if gathered else 0)
        t_local = local / min(eff * model.local_block_bw, model.hbm_copy_bw)
        send = m * row_bytes * (P - 1)
        recv = (total - m) * row_bytes
        t_net = max(send / rate, recv / model.link_bw) * model.comm_safety
        t_lat = math.ceil(nch * P / eff) * model.chunk_latency if nch else 0.0
        worst = max(worst, t_local + t_net + t_lat)
    return worst


def _stream_finish(m_sizes, arrive, tiles_of, workers: int, tile_time: float) -> float:
    """Streaming timeline of a fused kernel on the slowest rank.

    Rank r consumes shards r, r-1, ... (k = 0 .. P-1); rank s sends to s+1, s+2, ... in turn, so
    shard r-k reaches r at ``t_local + k * t_push`` of its sender (``arrive[s] = (t_local, t_push)``).
    Shard k's GEMM can finish neither before the previous shard's (compute bound) nor before its last
    chunk landed plus one tile.
    """
    P = len(m_sizes)
    worst = 0.0
    for r in range(P):
        f = 0.0
        for k in range(P):
            s = (r - k) % P
            t_local, t_push = arrive[s]
            arr = t_local + k * t_push
            g = tiles_of(m_sizes[s]) / workers * tile_time
            f = max(f + g, arr + (tile_time if m_sizes[s] else 0.0))
        worst = max(worst, f)
    return worst


def _raster_rows(num_m: int, num_n: int) -> np.ndarray:
    """Tile-row index of every tile of one shard in the order the scheduler hands them out
    (``mk_raster``: super-rows of GROUP_M tile-rows, column by column inside a super-row)."""
    i = np.arange(num_m * num_n)
    per_group = G.GROUP_M * num_n
    gid = i // per_group
    first = gid * G.GROUP_M
    gsz = np.minimum(num_m - first, G.GROUP_M)
    return first + (i - gid * per_group) % gsz



# Copy groupings the planner tries (the largest group, in chunks; 1: every chunk its own copy).
CE_GROUP_OPTIONS = (1, CE_VALUES)


def ce_copy_groups(nch: int, gmax: int) -> list:
    """Chunks per copy-engine copy of a shard cut into ``nch`` chunks, in order: from the end 1, 1, 2,
    4, ... (doubling up to ``gmax``), then ``gmax`` each (the first group takes what is left).  Few,
    large copies early (each copy and its flag copy cost an operation's latency) and single chunks
    at the end, so the GEMM's work on the rows that land last -- all that is left after the
    transfer -- is small.  ``gmax`` <= 1: every chunk its own copy."""
    if nch <= 0:
        return []
    if gmax <= 1:
        return [1] * nch
    gmax = min(gmax, CE_VALUES)
    out, total, g = [], 0, 1
    while total < nch:
        take = min(g, nch - total)
        out.append(take)
        total += take
        if len(out) >= 2:
            g = min(gmax, 2 * g)
    return out[::-1]


def _ce_landed(m: int, chunk_rows: int, gmax: int, row_bytes: int, model: CostModel) -> np.ndarray:
    """Seconds after its first copy starts at which each chunk of an ``m``-row shard has landed (its
    group's copy and flag copy done), on one copy-engine queue."""
    nch = -(-m // chunk_rows)
    sizes = np.minimum(chunk_rows, m - np.arange(nch) * chunk_rows) * row_bytes
    out, t, c = np.zeros(nch), 0.0, 0
    for g in ce_copy_groups(nch, gmax):
        t += float(sizes[c:c + g].sum()) / model.ce_link_bw + 2 * model.ce_op_latency
        out[c:c + g] = t
        c += g
    return out


def _ce_ready_times(m_sizes, r: int, N: int, cfg, chunk_rows: int, row_bytes: int, model: CostModel,
                    gmax: int = 1) -> np.ndarray:
    """When each tile of rank r's tile order (AgScheduler: its own shard, then ranks r-1, r-2, ...)
    can start on the copy-engine path: its own rows at once (read in place); a peer's rows when the
    last chunk they overlap has landed.  Sender s pushes its whole shard to s+1, then s+2, ... on one
    copy-engine queue in the copy groups of ``gmax`` (ce_copy_groups), each followed by its flag copy,
    from ``ce_start_latency`` on."""
    P, out = len(m_sizes), []
    num_n = -(-N // cfg.bn)
    for k in range(P):
        s = (r - k) % P
        m = m_sizes[s]
        if not m:
            continue
        rows = _raster_rows(-(-m // cfg.bm), num_n)
        if k == 0:
            out.append(np.zeros(rows.size))
            continue
        landed = _ce_landed(m, chunk_rows, gmax, row_bytes, model)  # chunk c has landed
        t0 = model.ce_start_latency + (k - 1) * landed[-1]  # after the shard went to k-1 other peers
        last_chunk = (np.minimum((rows + 1) * cfg.bm, m) - 1) // chunk_rows
        out.append(t0 + landed[last_chunk])
    return np.concatenate(out) if out else np.zeros(0)


def _ce_finish(ready: np.ndarray, workers: int, tile_time: float, unit_time: float, splits: int,
               split_from: int) -> float:
    """Finish time of the fused kernel's workers on one rank: tile i (in scheduler order) may start at
    ``ready[i]``; tiles from ``split_from`` on are ``splits`` units of ``unit_time`` each (consecutive
    unit ids), the others one unit of ``tile_time``; unit u runs on worker ``u % workers`` after that
    worker's previous unit (the static round robin of mk_gemm.cuh's schedulers)."""
    if splits > 1:
        r = np.concatenate([ready[:split_from], np.repeat(ready[split_from:], splits)])
        d = np.concatenate([np.full(split_from, tile_time), np.full((ready.size - split_from) * splits, unit_time)])
    else:
        r, d = ready, np.full(ready.size, tile_time)
    pad = -r.size % workers
    r = np.concatenate([r, np.zeros(pad)]).reshape(-1, workers)
    d = np.concatenate([d, np.zeros(pad)]).reshape(-1, workers)
    fin = np.zeros(workers)
    for rr, dd in zip(r, d):
        fin = np.maximum(fin, rr) + dd
    return float(fin.max()) if fin.size else 0.0


_SPLIT_OPTIONS = (2, 3, 4, 6, 8, 12, 16)  # split factors the copy-engine plan tries for the tiles it splits


def _suffix_starts(m_last: int, tiles: int, N: int, cfg) -> list:
    """split_from candidates for splitting the end of a rank's tile order: the start of each raster
    group (GROUP_M tile-rows) of the last shard, latest first (the tiles its later chunks feed); the
    caller adds 0 (every tile split: problems with fewer tiles than workers)."""
    num_m, num_n = -(-m_last // cfg.bm), -(-N // cfg.bn)
    groups = -(-num_m // G.GROUP_M)
    return [tiles - (num_m - g * G.GROUP_M) * num_n for g in range(groups - 1, -1, -1)]


def _ce_plan(m_sizes, N: int, K: int, cfg, workers: int, row_bytes: int, sms: int, model: CostModel,
             tail_split: bool | None, base_split: tuple) -> tuple:
    """(finish time, chunk_rows, splits, split_from, group_max) of the copy-engine path for tile config
    ``cfg``: the fused kernel's timeline simulated tile by tile (_ce_ready_times, _ce_finish) on the
    slowest rank, over the chunk counts ``ce_chunks * 2^i <= ce_chunks_max`` (each with the copy
    grouping of CE_GROUP_OPTIONS that finishes first under the GEMM's own split) and split plans: none, the
    GEMM's last-wave split ``base_split``, and -- where the simulated timeline is transfer-bound --
    splitting along K every tile from a raster-group start of the last shard on (the tiles its later
    chunks feed, which otherwise take a whole tile's K on few SMs while the others idle), or every
    tile.  A split plan other than ``base_split`` must beat it by AG_TAIL_SPLIT_MIN_GAIN
    (``tail_split`` True: any gain; False: no split at all)."""
    P = len(m_sizes)
    tt = _tile_time(cfg, K, sms, model) * model.ce_gemm_slowdown
    whole = G.config_cost(cfg, 1, 1, K, "nk")
    tiles = _fused_tiles(m_sizes, N, cfg)
    # the shard each rank takes last (rank r: r+1's); the suffix candidates are per rank, the plan one
    # for all: take the candidates of the rank with the longest last shard's tile run
    m_last = max((m_sizes[(r + 1) % P] for r in range(P)), default=0)
    counts = [max(1, model.ce_chunks)]
    while counts[-1] * 2 <= model.ce_chunks_max:
        counts.append(counts[-1] * 2)
    chunk_opts = sorted({ce_chunk_rows(m_sizes, n) for n in counts}, reverse=True)  # fewest chunks first
    ready = {}  # (chunk_rows, group_max) -> every rank's tile start times (they depend on the copies only)

    def finish(cr, sp, sf, gm):
        if (cr, gm) not in ready:
            ready[cr, gm] = [_ce_ready_times(m_sizes, r, N, cfg, cr, row_bytes, model, gm) for r in range(P)]
        unit = tt * G.config_cost(cfg, 1, sp, K, "nk", sp) / whole if sp > 1 else tt  # one unit of sp
        return max(_ce_finish(rt, workers, tt, unit, sp, sf) for rt in ready[cr, gm])
    b_sp, b_sf = base_split if tail_split is not False else (1, tiles)
    # each chunking's copy grouping: the one that finishes first with the GEMM's own split (ties: fewer
    # copies -- the larger group)
    group = {cr: min(CE_GROUP_OPTIONS, key=lambda gm: (finish(cr, b_sp, b_sf, gm), -gm)) for cr in chunk_opts}
    base = (finish(chunk_opts[0], b_sp, b_sf, group[chunk_opts[0]]), chunk_opts[0], b_sp, b_sf, group[chunk_opts[0]])
    if tail_split is False or tiles == 0:
        return base
    margin = 0.0 if tail_split else AG_TAIL_SPLIT_MIN_GAIN
    # nothing to win where the GEMM bounds the call: the work per worker is (nearly) all of it
    if base[0] <= math.ceil(tiles / workers) * tt * (1 + margin / 2):
        return base
    best = base
    max_sp = G.max_splits_for(cfg, tiles, K, "nk")
    for cr in chunk_opts:
        cands = [(1, tiles)] + [(sp, sf) for sf in _suffix_starts(m_last, tiles, N, cfg) + [0]
                                for sp in _SPLIT_OPTIONS if sp <= min(max_sp, G.max_splits_for(cfg, tiles - sf, K, "nk"))]
        for sp, sf in cands:
            t = finish(cr, sp, sf, group[cr])
            if t < best[0] and t < (1 - margin) * base[0]:
                best = (t, cr, sp, sf, group[cr])
    return best


def _fused_finish(m_sizes, row_bytes: int, blocks: int, chunk_rows: int, tiles_of, workers: int, tile_time: float,
                  model: CostModel) -> float:
    """_stream_finish with SM communication blocks (local copy, then one push per destination)."""
    arrive = []
    for m in m_sizes:  # per sender: local copy time, one-destination push time
        nch = -(-m // chunk_rows) if m else 0
        rate, eff = _push_rate(blocks, nch, model)
        t_local = m * row_bytes / min(eff * model.local_block_bw, model.hbm_copy_bw)
        t_push = (m * row_bytes / rate) * model.comm_safety + (math.ceil(nch / eff) * model.chunk_latency if nch else 0)
        arrive.append((t_local, t_push))
    return _stream_finish(m_sizes, arrive, tiles_of, workers, tile_time)


def ce_chunk_rows(m_sizes, chunks: int = MODEL.ce_chunks) -> int:
    """Rows per ready flag on the copy-engine path: a power of two >= 128 (whole tiles), about
    ``chunks`` chunks (at most ``MAX_CHUNKS``) for the largest shard."""
    m_max = max(m_sizes) if len(m_sizes) else 0
    return max(128, _pow2_ceil(-(-m_max // max(1, min(chunks, MAX_CHUNKS)))))


def tile_config(config: int, b_layout: str):
    """The fused kernel's tile config ``config`` as it runs with ``b_layout``: config 5 is 128x224 with B
    "nk" and config 3's 128x256 with "kn" (MN-major tiles are whole 64-column chunks), so the planner
    and the launch see the tile width the kernel uses."""
    cfg = G.CONFIGS[config]
    if b_layout == "kn" and cfg.bn_kn is not None:
        cfg = replace(cfg, bn=cfg.bn_kn, bn_kn=None)
    return cfg


def _fused_tiles(m_sizes, N: int, cfg) -> int:
    return sum(-(-m // cfg.bm) for m in m_sizes) * -(-N // cfg.bn)


# A last-wave split of the fused kernel must be predicted to save this much of its GEMM time (the plain
# GEMM asks for G.TAIL_SPLIT_MIN_GAIN = 10 %; here the tiles are long -- large N and K -- so the split-K
# reduction is a small part of a unit and the model's prediction holds better).
AG_TAIL_SPLIT_MIN_GAIN = 0.04


def _split_gain(cfg, tiles: int, K: int, workers: int, tail_split: bool | None = None) -> tuple[int, int, float]:
    """(splits, split_from, predicted GEMM time factor) of the fused kernel: the tiles of a partial last
    wave split along K where mkernel.gemm's model predicts it saves AG_TAIL_SPLIT_MIN_GAIN (whole waves
    only: with fewer tiles than workers the fusion's own timeline dominates).  tail_split: None lets the
    model decide, False never splits, True splits wherever the model predicts any gain."""
    if tiles < workers or K <= 0 or tail_split is False or cfg.id not in FUSED_CONFIGS:
        return 1, tiles, 1.0
    margin = 0.0 if tail_split else AG_TAIL_SPLIT_MIN_GAIN
    sp, sf = G.split_plan(cfg, tiles, K, "nk", workers, tail_margin=margin)
    if sp <= 1:
        return 1, tiles, 1.0
    return sp, sf, G.split_cost(cfg, tiles, K, "nk", workers, sp, sf) / G.config_cost(cfg, tiles, workers, K, "nk")


def plan(m_sizes, N: int, K: int, itemsize: int, sms: int, *, comm_sms: int | None = None,
         gathered: bool = False, force_path: str | None = None, config: int | None = None,
         tail_split: bool | None = None, b_layout: str = "kn", fused_auto: bool = False,
         model: CostModel = MODEL) -> AgPlan:
    """The plan for gathering shards of ``m_sizes`` rows (one per local rank) of K columns and
    multiplying by an [K, N] operand on a GPU of ``sms`` SMs.  ``b_layout``: "nk" when every rank's B
    is [N, K] (then config 5's 224-wide tile is a candidate), else "kn".  ``comm_sms``, ``force_path``,
    ``config``, ``tail_split``, ``fused_auto``: the AgGemmOptions fields of those names (``force_path``:
    ``path``).  Pure function of its arguments (every rank computes the same plan from the values they
    exchanged)."""
    m_sizes = tuple(int(m) for m in m_sizes)
    P = len(m_sizes)
    M = sum(m_sizes)
    row_bytes = K * itemsize
    # unfused: gather with the collectives' grid (every SM from 2 MiB shards; below, a smaller grid
    # starts sooner: docs/collectives.md), then mkernel.gemm over the gathered rows
    m_max = max(m_sizes) if m_sizes else 0
    g_want = grid_for(m_max * row_bytes, sms)
    cr = chunk_rows_for(m_sizes, row_bytes, model, blocks=g_want)
    g_blocks = max(1, min(g_want, -(-m_max // cr)))
    t_ag = (_comm_time(m_sizes, row_bytes, g_blocks, cr, gathered, model) + 2 * model.launch_latency
            if P > 1 else (M * row_bytes / model.hbm_copy_bw if gathered else 0.0))
    # mkernel.gemm's own plan for the gathered problem (any config, split-K; dense operands)
    cfg_u, sp_u, sf_u = G.auto_plan(max(M, 1), max(N, 1), max(K, 1), b_layout, sms, None,
                                    G.misaligned_rows(M, N, K, b_layout))
    n_split = G.tile_count(cfg_u, M, N, b_layout) - sf_u if sp_u > 1 else 0
    cfg_u_tile = tile_config(cfg_u.id, b_layout)
    t_gu = (_gemm_time(G.tile_count(cfg_u, M, N, b_layout) - n_split, sms, cfg_u_tile, K, sms, model)
            + _gemm_time(n_split * sp_u, sms, cfg_u_tile, -(-K // sp_u), sms, model) + model.launch_latency)
    t_unfused = t_ag + t_gu

    def fused_config(workers: int):
        """The fused kernel's tile config (forced, or the heuristic's for ``workers`` GEMM blocks), with
        the tile width it runs under the agreed layout."""
        cid = config if config is not None else G.choose_config(
            lambda c: _fused_tiles(m_sizes, N, tile_config(c.id, b_layout)), workers, layout=b_layout,
            candidates=FUSED_CONFIGS).id
        return tile_config(cid, b_layout)

    def fused_at(n: int):
        w = sms - n
        cfg = fused_config(w)
        tiles = _fused_tiles(m_sizes, N, cfg)
        tt = _tile_time(cfg, K, sms, model)
        cr_n = chunk_rows_for(m_sizes, row_bytes, model, blocks=n)  # chunks for n pushing blocks
        t_comm = _comm_time(m_sizes, row_bytes, n, cr_n, gathered, model)
        split = _split_gain(cfg, tiles, K, w, tail_split)
        t_gemm = _gemm_time(tiles, w, cfg, K, sms, model) * split[2]
        per_shard = lambda m: -(-m // cfg.bm) * -(-N // cfg.bn)  # noqa: E731
        t_stream = _fused_finish(m_sizes, row_bytes, n, cr_n, per_shard, w, tt, model)
        t = max(t_stream, t_gemm, t_comm + tt) + model.launch_latency
        return t, t_comm, t_gemm, cfg, min(w, max(tiles, 1)), split[:2], cr_n

    def fused_ce():
        w = sms - model.ce_free_sms  # every SM a GEMM worker (worker 0's idle warp opens the call)
        cfg = fused_config(w)
        tiles = _fused_tiles(m_sizes, N, cfg)
        sp, sf, gain = _split_gain(cfg, tiles, K, w, tail_split)
        t_gemm = _gemm_time(tiles, w, cfg, K, sms, model) * model.ce_gemm_slowdown * gain
        t_sim, cr_ce, sp, sf, gm = _ce_plan(m_sizes, N, K, cfg, w, row_bytes, sms, model, tail_split, (sp, sf))
        # A rank reads its own rows in place (an A shard 16 bytes aligned, the usual case: no local
        # copy first), so the copy engines start on the peers' shards at once.
        t_comm = model.ce_start_latency + max(
            (P - 1) * float(_ce_landed(m, cr_ce, gm, row_bytes, model)[-1]) for m in m_sizes if m)
        t = t_sim + model.launch_latency
        if gathered:  # the gathered A is copied out of the workspace after the GEMM
            t += M * row_bytes / model.hbm_copy_bw + model.launch_latency
        # (the grid: one worker per scheduler unit at most)
        return t, t_comm, t_gemm, cfg, min(w, max(G.scheduler_units(tiles, sp, sf), 1)), cr_ce, (sp, sf, gm)

    base = dict(m_sizes=m_sizes, n_max=N, K=K, P=P, predicted_unfused=t_unfused,
                predicted_allgather=t_ag, predicted_gemm_alone=t_gu, gather_blocks=g_blocks)
    degenerate = None
    if P == 1:
        degenerate = "P == 1: nothing to gather"
    elif M == 0 or N == 0 or K == 0:
        degenerate = "empty problem"
    if degenerate is not None:  # nothing to fuse: overrides are moot
        return AgPlan(path="unfused", comm_sms=0, workers=0, config=cfg_u.id, predicted_fused=float("inf"),
                      predicted_comm=0.0, predicted_gemm=0.0, reason=degenerate, chunk_rows=cr, **base)
    if comm_sms is not None and comm_sms > 0:
        if not 1 <= comm_sms < sms:
            raise ValueError(f"mkernel.ag_gemm: comm_sms={comm_sms} must be in [1, {sms - 1}] on this "
                             f"{sms}-SM GPU (0 forces the unfused path)")
        t, tc, tg, cfg, w, (sp, sf), cr_n = fused_at(comm_sms)
        return AgPlan(path="fused", comm_sms=comm_sms, workers=w, config=cfg.id, predicted_fused=t,
                      predicted_comm=tc, predicted_gemm=tg, reason="comm_sms given", fused_comm_sms=comm_sms,
                      chunk_rows=cr_n, splits=sp, split_from=sf, **base)
    best = None
    for n in range(min(model.min_comm_sms, sms // 2), min(model.max_comm_sms, sms // 2) + 1):
        cand = fused_at(n)
        if best is None or cand[0] < best[1][0] * 0.999:
            best = (n, cand)
    n, (t, tc, tg, cfg, w, split_sm, cr_sm) = best
    t_ce, tc_ce, tg_ce, cfg_ce, w_ce, cr_ce, split_ce = fused_ce()
    if comm_sms == 0 or force_path == "unfused":
        path, reason = "unfused", ("comm_sms=0" if comm_sms == 0 else "path forced: unfused")
    elif force_path in ("fused", "fused_ce"):
        path, reason = force_path, f"path forced: {force_path}"
    else:
        cands = ([("fused_ce", t_ce)] if M * row_bytes >= model.ce_min_bytes else []) + (
            [("fused", t)] if fused_auto else [])
        cands = cands or [("unfused", t_unfused)]
        path, t_best = min(cands, key=lambda c: c[1])
        if t_best < model.fuse_margin * t_unfused:
            reason = f"model: {path} faster"
        else:
            path, reason = "unfused", "model: fusion does not pay (small M, tiny K or N)"
    if path == "unfused":  # the predictions of the fusion the model would have taken
        tf, tcf, tgf = (t, tc, tg) if fused_auto and t < t_ce else (t_ce, tc_ce, tg_ce)
        return AgPlan(path="unfused", comm_sms=0, workers=0, config=cfg_u.id, predicted_fused=tf,
                      predicted_comm=tcf, predicted_gemm=tgf, reason=reason, fused_comm_sms=n, chunk_rows=cr, **base)
    if path == "fused_ce":
        return AgPlan(path="fused_ce", comm_sms=0, workers=w_ce, config=cfg_ce.id, predicted_fused=t_ce,
                      predicted_comm=tc_ce, predicted_gemm=tg_ce, reason=reason, fused_comm_sms=n,
                      chunk_rows=cr_ce, splits=split_ce[0], split_from=split_ce[1], ce_group_max=split_ce[2],
                      **base)
    return AgPlan(path="fused", comm_sms=n, workers=w, config=cfg.id, predicted_fused=t, predicted_comm=tc,
                  predicted_gemm=tg, reason=reason, fused_comm_sms=n, chunk_rows=cr_sm, splits=split_sm[0],
                  split_from=split_sm[1], **base)



def call_digest(dt: str, ms: tuple, K: int, n_max: int, any_gathered: bool, p: AgPlan) -> int:
    """The signature the kernels announce and compare (mkernel/signals MkComm.sig): a digest of what
    every rank agreed on -- the same on every rank for the same call, and in general different for
    two different agreed calls (a rank repeating one while a peer makes the other is caught on the
    device)."""
    return zlib.crc32(repr((dt, tuple(ms), K, n_max, any_gathered, p.path, p.config, p.comm_sms, p.chunk_rows,
                            p.splits, p.split_from)).encode()) & 0xFFFFFFFF


