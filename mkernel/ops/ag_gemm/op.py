"""AllGather + GEMM (column-parallel tensor parallelism), fused into one persistent kernel.

``ag_gemm(ctx, a_shard, b)``: local rank r holds the row shard ``A_r [M_r, K]`` and its weight shard
``B_r`` (``[K, N]`` for ``b_layout="kn"``, ``[N, K]`` for "nk"); every rank computes
``C_r = AllGather(A) @ B_r`` of shape ``[sum_j M_j, N]``, rows of rank j at row offset
``sum_{i<j} M_i``.  The ranks taking part are the ``ctx.local_size`` ranks of this node (NVLink).

Three paths, one kernel source (``cuda_src/ag_gemm.cu``), one workspace protocol:

* ``"fused_ce"`` (copy engines): the GEMM kernel runs on every SM, on the caller's stream;
  a side stream (``ctx.side_stream()``, forked and joined with events, so it is captured with the
  call in a CUDA graph) copies this rank's shard with the copy engines into the op's symmetric
  workspace (the gathered A) on every rank, chunk by chunk, each chunk followed by a copy-engine
  write of its ready flag.  GEMM workers (``cuda_src/mk_gemm.cuh``) take the local rows first, then
  rows of ranks me-1, me-2, ... (the order they arrive) and wait only for the chunks a tile needs.
  No SM is spent on communication.
* ``"fused"`` (SM communication): one cooperative kernel whose first ``comm_sms`` blocks do the
  copies instead (same flags, same workers).
* ``"unfused"``: a gather kernel (every SM copies, same protocol), then :func:`mkernel.gemm` on the
  gathered buffer, then a one-block release kernel.

A small cost model (:data:`MODEL`, :func:`plan`) picks the path (and the SM split of "fused");
``path=`` or env ``MKERNEL_AG_GEMM_PATH`` force one, ``comm_sms=N`` forces "fused" with N
communication blocks, ``comm_sms=0`` forces "unfused".  The fused kernel may split the tiles of its
partial last wave along K (split-K, as :func:`mkernel.gemm` does; env ``MKERNEL_AG_GEMM_TAIL_SPLIT``
= ``0``/``1`` overrides the model).  The plan that ran is in ``ag_gemm.last_plan`` (also the module attribute
``mkernel.ag_gemm.last_plan``; ``.path``, ``.comm_sms``, predicted times); ``MKERNEL_LOG=1`` prints
one line per new plan.

Shapes and rules:

* ``a_shard``: bf16 or fp16, 2-D ``[M_r, K]``, C-contiguous, on ``ctx``'s GPU (any memory: it need
  not be symmetric).  ``M_r`` may be any value >= 0 and may differ across ranks.  ``K * itemsize``
  must be a multiple of 16 (TMA row stride of the gathered A), i.e. K % 8 == 0.
* ``b``: same dtype, ``[K, N]`` or ``[N, K]``, any strides (staged like :func:`mkernel.gemm` when TMA
  cannot read it in place).  N may differ across ranks.
* ``out``: ``[M_total, N]``, dtype = a's or float32, unit column stride (any row stride); allocated
  when None.  Returned.
* ``gathered_a``: optional ``[M_total, K]`` C-contiguous array of a's dtype that receives the whole
  gathered A, exactly (written by the communication blocks; on "fused_ce" copied from the workspace
  after the GEMM, then the call is closed by the release kernel).
* ``m_sizes``: optional host sequence of every local rank's ``M_j`` (``m_sizes[local_rank]`` must be
  ``M_r``).  Without it, the first call with a new *local* signature (dtype, M_r, K, N, comm_sms,
  gathered_a given or not) exchanges every rank's signature over the node communicator (bounded by
  the context timeout) and caches the result; so when ranks change their M_r independently of each
  other, pass ``m_sizes`` (then any change is a new signature on every rank).
* Every rank must make the same sequence of calls.  Ranks that disagree on dtype, K, comm_sms or
  m_sizes get a ``ValueError`` (all of them) before anything is launched.

No host synchronization between calls (per-call epochs live on the device; the consumed handshake of
``docs/design.md`` protects the workspace), so calls can be captured in a CUDA graph and replayed
(make the first call with a signature outside the capture: it may exchange signatures and allocate
the workspace).  Every device wait is bounded by the context timeout (:class:`mkernel.CommTimeout`
on the next ``ctx.check()``/``ctx.synchronize()``).
"""
from __future__ import annotations

import ctypes
import math
import os
import sys
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np
from cuda.bindings import driver as cu

from ...core.arrays import DeviceArray
from ...core.compiler import kernel, precompile_source, register_specialization
from ...core.driver import check
from ...core.interop import as_device_array
from ...core.streams import copy_async, is_capturing, stream_handle
from ...core.tensormap import encode_tiled
from ...core.util import round_up
from ...dist.sidestream import ForkedCopies
from ...dist.signals import MAX_CHUNKS, workspace_control
from ..base import fast_get, fast_put
from ..collectives.layout import grid_for
from .. import gemm as G  # the GEMM's public planning API


__all__ = ["ag_gemm", "plan", "precompile", "AgPlan", "CostModel", "MODEL", "AgArgs", "last_plan", "chunk_rows_for"]

SOURCE = "ops/ag_gemm.cu"
IN_DTYPES = ("bfloat16", "float16")
MAXP = 16  # local ranks (the kernel keeps the source rank in 4 bits of the tile id)
GATHER_THREADS = 512
RELEASE_THREADS = 128
_FUSED_CONFIGS = (1, 2, 3, 4, 5)  # 0 is the debug config (config=0 forces it); 5: 128x224 with B "nk" only

for _i in IN_DTYPES:
    for _o in (_i, "float32"):
        for _c in (0,) + _FUSED_CONFIGS:
            register_specialization(SOURCE, G.defines(_i, _o, _c))


class AgArgs(ctypes.Structure):
    """Mirror of ``struct AgArgs`` in cuda_src/ag_gemm.cu (232 bytes)."""

    _fields_ = [
        ("a_shard", ctypes.c_void_p), ("ws", ctypes.c_void_p), ("peers", ctypes.c_void_p),
        ("c", ctypes.c_void_p), ("gathered_out", ctypes.c_void_p),
        ("row_bytes", ctypes.c_uint64), ("data_off", ctypes.c_uint64), ("flags_off", ctypes.c_uint64),
        ("consumed_off", ctypes.c_uint64), ("ldc", ctypes.c_int64),
        ("M_total", ctypes.c_int32), ("N", ctypes.c_int32), ("K", ctypes.c_int32),
        ("chunk_rows", ctypes.c_int32), ("nch_stride", ctypes.c_int32), ("n_comm", ctypes.c_int32),
        ("group_m", ctypes.c_int32), ("c_vec_ok", ctypes.c_int32), ("gather_only", ctypes.c_int32),
        ("P", ctypes.c_int32), ("me", ctypes.c_int32), ("ce_value_off", ctypes.c_int32),
        ("local_map", ctypes.c_int32),
        ("offs", ctypes.c_int32 * (MAXP + 1)),
        ("c_tma", ctypes.c_int32),
        ("partials", ctypes.c_void_p), ("counters", ctypes.c_void_p),
        ("splits", ctypes.c_int32), ("split_from", ctypes.c_int32),
        ("ce_go_off", ctypes.c_int32),
    ]


assert ctypes.sizeof(AgArgs) == 240


# --------------------------------------------------------------------------------------------
# cost model and planner
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CostModel:
    """Every constant of the planner, in one place (H200, NVLink 4 through NVSwitch)."""

    per_block_bw: float = 20e9      # B/s one communication block pushes to a peer over NVLink
    link_bw: float = 300e9          # B/s a GPU sends (and receives) over NVLink, achievable by SM copies
                                    # (all-gather 1 GiB: 276-291 GB/s bus bw, copy engine 384 GB/s;
                                    # docs/validation.md)
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


def _model_from_env() -> CostModel:
    """CostModel() with overrides from ``MKERNEL_AG_GEMM_MODEL="per_block_bw=15e9,link_bw=280e9"``."""
    spec = os.environ.get("MKERNEL_AG_GEMM_MODEL", "").strip()
    kw = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, val = item.partition("=")
        f = CostModel.__dataclass_fields__.get(name.strip())
        if f is None:
            raise ValueError(f"MKERNEL_AG_GEMM_MODEL: unknown field {name!r}; known: {list(CostModel.__dataclass_fields__)}")
        kw[name.strip()] = int(float(val)) if f.type in ("int", int) else float(val)
    return CostModel(**kw)


MODEL = _model_from_env()


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


# Copy-engine path: flag-value slots in the workspace (cuda_src/ag_gemm.cu AG_CE_VALUES): one flag copy
# raises up to this many consecutive ready flags, so a copy of that many chunks costs two operations.
CE_VALUES = 64
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
    if tiles < workers or K <= 0 or tail_split is False or cfg.id not in _FUSED_CONFIGS:
        return 1, tiles, 1.0
    margin = 0.0 if tail_split else AG_TAIL_SPLIT_MIN_GAIN
    sp, sf = G.split_plan(cfg, tiles, K, "nk", workers, tail_margin=margin)
    if sp <= 1:
        return 1, tiles, 1.0
    return sp, sf, G.split_cost(cfg, tiles, K, "nk", workers, sp, sf) / G.config_cost(cfg, tiles, workers, K, "nk")


def plan(m_sizes, N: int, K: int, itemsize: int, sms: int, *, comm_sms: int | None = None,
         gathered: bool = False, force_path: str | None = None, config: int | None = None,
         tail_split: bool | None = None, b_layout: str = "kn", model: CostModel = MODEL) -> AgPlan:
    """The plan for gathering shards of ``m_sizes`` rows (one per local rank) of K columns and
    multiplying by an [K, N] operand on a GPU of ``sms`` SMs.  ``b_layout``: "nk" when every rank's B
    is [N, K] (then config 5's 224-wide tile is a candidate), else "kn".  Pure function of its
    arguments (every rank computes the same plan from the values they exchanged)."""
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
            candidates=_FUSED_CONFIGS).id
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
            [("fused", t)] if FUSED_AUTO else [])
        cands = cands or [("unfused", t_unfused)]
        path, t_best = min(cands, key=lambda c: c[1])
        if t_best < model.fuse_margin * t_unfused:
            reason = f"model: {path} faster"
        else:
            path, reason = "unfused", "model: fusion does not pay (small M, tiny K or N)"
    if path == "unfused":  # the predictions of the fusion the model would have taken
        tf, tcf, tgf = (t, tc, tg) if FUSED_AUTO and t < t_ce else (t_ce, tc_ce, tg_ce)
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


# --------------------------------------------------------------------------------------------
# signature exchange (first call of a signature)
# --------------------------------------------------------------------------------------------
_FORCE = {None: 0, "fused": 1, "unfused": 2, "fused_ce": 3}
PATHS = ("fused", "fused_ce", "unfused")

# The automatic plan considers the SM-communication path ("fused") only when this is set: on 2x H200
# (bench/ag_probe.py, docs/validation.md) it lost to "fused_ce" on three of five probe shapes, tied on
# one, and won only on the communication-bound M=K=8192 sweep point (251 vs 292 us); its cost model is
# not calibrated.  Forcing still works (comm_sms=N, path="fused").
FUSED_AUTO = os.environ.get("MKERNEL_AG_GEMM_FUSED_AUTO", "0") == "1"


def _agree(ctx, dtype: str, M: int, K: int, N: int, comm_sms, gathered: bool, force, config, m_sizes,
           b_layout: str = "kn"):
    """Exchange every rank's call signature.  Returns (M of every local rank, max N, any rank wants the
    gathered A, P, "nk" if every rank's B is [N, K] else "kn"); raises ValueError on every rank when
    they disagree."""
    msz_hash = 0 if m_sizes is None else (hash(tuple(m_sizes)) & ((1 << 62) - 1)) + 1
    mine = np.array([G.DTYPE_CODES[dtype], M, K, N, -1 if comm_sms is None else comm_sms, int(gathered),
                     _FORCE.get(force, 3), -1 if config is None else config, msz_hash, int(b_layout == "nk")],
                    dtype=np.int64)
    allv = ctx.bounded_allgather(mine, "mkernel.ag_gemm's signature exchange", ctx.node_comm)
    P = allv.shape[0]
    problems = []
    for col, name in ((0, "dtype"), (2, "K"), (4, "comm_sms"), (6, "path override"), (7, "config"),
                      (8, "m_sizes")):
        vals = allv[:, col]
        if np.any(vals != vals[0]):
            problems.append(f"{name} differs across local ranks: {vals.tolist()}")
    ms = tuple(int(v) for v in allv[:, 1])
    if m_sizes is not None and tuple(m_sizes) != ms:
        problems.append(f"m_sizes={list(m_sizes)} but the ranks hold shards of {list(ms)} rows")
    all_nk = bool(allv[:, 9].all())
    if config is not None and G.CONFIGS[config].bn_kn is not None and allv[:, 9].any() and not all_nk:
        problems.append(f"config {config} runs a tile whose width depends on b_layout, and the ranks' layouts "
                        f"differ ({['nk' if v else 'kn' for v in allv[:, 9]]})")
    if problems:
        raise ValueError("mkernel.ag_gemm: ranks disagree on the call: " + "; ".join(problems))
    return ms, int(allv[:, 3].max()), bool(allv[:, 5].any()), P, "nk" if all_nk else "kn"


# --------------------------------------------------------------------------------------------
# kernels, workspace layout
# --------------------------------------------------------------------------------------------
def _kernel(in_dtype: str, out_dtype: str, config: int, name: str):
    return kernel(SOURCE, G.defines(in_dtype, out_dtype, config), name)


@dataclass(frozen=True)
class _Layout:
    consumed_off: int
    flags_off: int
    value_off: int  # copy-engine path: CE_VALUES u64, the call number the copy engines copy into ready flags
    go_off: int  # copy-engine path: the u32 the side stream waits on before its copies
    data_off: int
    nch_stride: int
    total: int


def _layout(P: int, m_sizes, chunk_rows: int, row_bytes: int) -> _Layout:
    """The workspace (cuda_src/ag_gemm.cu has the picture).  Every control word's offset depends on P
    only: the workspace is shared by every call of the op, and a word that moved with the call's
    shape could land on bytes an earlier call left in its data region -- rows read as a raised flag
    (a GEMM reading rows that have not arrived), or a stale 1 as the copy engines' go word."""
    nch = max([-(-m // chunk_rows) for m in m_sizes] + [1])
    if nch > MAX_CHUNKS:  # (chunk_rows_for and ce_chunk_rows never cut a shard into more)
        raise AssertionError(f"ag_gemm: {nch} chunks per shard, the workspace has flags for {MAX_CHUNKS}")
    consumed_off, flags_off, value_off = workspace_control(P, P)
    go_off = value_off + 8 * CE_VALUES
    data_off = round_up(go_off + 8, 4096)
    return _Layout(consumed_off, flags_off, value_off, go_off, data_off, MAX_CHUNKS,
                   data_off + max(1, sum(m_sizes)) * row_bytes)


# --------------------------------------------------------------------------------------------
# the op
# --------------------------------------------------------------------------------------------
@dataclass
class _Sig:
    """Per (context, local signature): the agreed plan and the workspace layout."""

    plan: AgPlan
    layout: _Layout | None
    offs: tuple
    P: int
    digest: int = 0  # 32-bit digest of the agreed call (MkComm.sig): the kernels compare it with the peers'


def call_digest(dt: str, ms: tuple, K: int, n_max: int, any_gathered: bool, p: AgPlan) -> int:
    """The signature the kernels announce and compare (mkernel/signals MkComm.sig): a digest of what
    every rank agreed on -- the same on every rank for the same call, and in general different for
    two different agreed calls (a rank repeating one while a peer makes the other is caught on the
    device)."""
    return zlib.crc32(repr((dt, tuple(ms), K, n_max, any_gathered, p.path, p.config, p.comm_sms, p.chunk_rows,
                            p.splits, p.split_from)).encode()) & 0xFFFFFFFF


_sigs: "OrderedDict[tuple, _Sig]" = OrderedDict()
_bindings: "OrderedDict[tuple, tuple]" = OrderedDict()
_lock = threading.Lock()
_SIGS_MAX = 256
_BINDINGS_MAX = 64
_pinned_bindings: list = []  # bindings that ran inside a CUDA-graph capture: kept for the process's life


def _lru_put(d: OrderedDict, key, value, cap: int) -> None:
    with _lock:
        d[key] = value
        d.move_to_end(key)
        while len(d) > cap:
            d.popitem(last=False)


def _lru_get(d: OrderedDict, key):
    with _lock:
        v = d.get(key)
        if v is not None:
            d.move_to_end(key)
        return v


def _log(ctx, plan_: AgPlan) -> None:
    if os.environ.get("MKERNEL_LOG", "") not in ("", "0"):
        print(f"mkernel.ag_gemm[rank {ctx.rank}]: {plan_.describe()}", file=sys.stderr, flush=True)


def _set_last(p: AgPlan) -> None:
    global last_plan
    last_plan = p
    ag_gemm.last_plan = p


def _check_same_device(ctx, arr: DeviceArray, name: str) -> None:
    if arr.device != ctx.device:
        raise ValueError(f"mkernel.ag_gemm: {name} is on cuda:{arr.device}, but this rank's context uses "
                         f"cuda:{ctx.device}")


def _tail_split_env() -> bool | None:
    """MKERNEL_AG_GEMM_TAIL_SPLIT: unset/"auto" lets the model decide, "0" never splits the fused kernel's
    last wave along K, "1" splits it wherever the model predicts any gain (a rank-local choice: peers
    need not agree)."""
    v = os.environ.get("MKERNEL_AG_GEMM_TAIL_SPLIT", "auto").strip().lower()
    if v in ("", "auto"):
        return None
    if v in ("0", "1"):
        return v == "1"
    raise ValueError(f"mkernel.ag_gemm: MKERNEL_AG_GEMM_TAIL_SPLIT must be auto, 0 or 1, got {v!r}")


def ag_gemm(ctx, a_shard, b, out=None, *, gathered_a=None, b_layout: str = "kn", stream=None,
            comm_sms: int | None = None, m_sizes=None, config: int | None = None, path: str | None = None):
    """``out = AllGather(a_shard over local ranks) @ b`` (see the module doc for shapes and rules).

    a_shard: ``[M_r, K]`` bf16/fp16, C-contiguous.  b: ``[K, N]`` ("kn") or ``[N, K]`` ("nk").
    out: ``[sum M_j, N]`` (a's dtype or float32) or None.  gathered_a: optional ``[sum M_j, K]``
    receiving the gathered A.  stream: any stream-like (None: the legacy default stream).
    comm_sms: communication SMs of the fused kernel (forces fusion), 0 forces the unfused path, None
    lets the cost model decide.  m_sizes: every local rank's M_j (optional, see module doc).
    config: force the fused kernel's tile config (mkernel.gemm.CONFIGS; 0 = debug).  path: force
    "fused_ce" (copy-engine communication), "fused" (SM communication) or "unfused" (env
    ``MKERNEL_AG_GEMM_PATH`` does the same; None lets the cost model decide).  Returns out;
    ``ag_gemm.last_plan`` describes what ran.
    """
    what = "mkernel.ag_gemm"
    fkey = _fast_key(ctx, a_shard, b, out, gathered_a, b_layout, stream, comm_sms, m_sizes, config, path)
    hit = fast_get(ctx, fkey)
    if hit is not None:  # an identical earlier call: replay its bound launch (see _fast_key)
        ctx.check()
        _set_last(hit[1])
        hit[0]()
        return out
    ctx.check()
    A, B, M_r, K, N, _ = G.check_operands(a_shard, b, b_layout, what=what, a_name="a_shard", stream=stream)
    dt = A.dtype.name
    _check_same_device(ctx, A, "a_shard")
    _check_same_device(ctx, B, "b")
    if not A.is_contiguous():
        raise ValueError(f"{what}: a_shard must be C-contiguous (strides {A.strides} for shape {tuple(A.shape)})")
    isz = A.dtype.itemsize
    if (K * isz) % 16:
        raise ValueError(f"{what}: K={K} gives {K * isz}-byte rows; the gathered A needs rows of a multiple of "
                         f"16 bytes (K % {16 // isz} == 0)")
    if max(M_r, N, K) >= 2 ** 31:
        raise ValueError(f"{what}: dimensions must be below 2**31")
    P, me = ctx.local_size, ctx.local_rank
    if P > MAXP:
        raise ValueError(f"{what}: {P} local ranks; at most {MAXP} are supported")
    if comm_sms is not None and (not isinstance(comm_sms, (int, np.integer)) or comm_sms < 0):
        raise ValueError(f"{what}: comm_sms must be None or an int >= 0, got {comm_sms!r}")
    if config is not None and config not in (0,) + _FUSED_CONFIGS:
        raise ValueError(f"{what}: config {config} is not one of the fused kernel's tile configs "
                         f"{[0, *_FUSED_CONFIGS]} (mkernel.ops.gemm.CONFIGS)")
    if m_sizes is not None:
        m_sizes = tuple(int(m) for m in m_sizes)
        if len(m_sizes) != P or m_sizes[me] != M_r or min(m_sizes) < 0:
            raise ValueError(f"{what}: m_sizes={list(m_sizes)} must list {P} sizes >= 0 with m_sizes[{me}] == "
                             f"{M_r} (this rank's rows)")
    if path is not None and path not in PATHS:
        raise ValueError(f"{what}: path must be None or one of {PATHS}, got {path!r}")
    force = path or os.environ.get("MKERNEL_AG_GEMM_PATH") or None
    if force not in (None, *PATHS):
        raise ValueError(f"{what}: MKERNEL_AG_GEMM_PATH must be one of {PATHS}, got {force!r}")
    tail_split = _tail_split_env()
    O_in = None if out is None else as_device_array(out, name="ag_gemm: out", stream=stream)
    GA = None if gathered_a is None else as_device_array(gathered_a, name="ag_gemm: gathered_a", stream=stream)
    out_dtype = O_in.dtype.name if O_in is not None else dt
    if out_dtype not in (dt, "float32"):
        raise TypeError(f"{what}: out has dtype {out_dtype}; expected {dt} or float32")

    # ---- the agreed signature (exchanged on first use) -----------------------------------------
    dev = ctx.device
    sms = ctx.sm_count
    skey = (ctx, dt, M_r, K, N, comm_sms, GA is not None, force, config, m_sizes, tail_split, b_layout)
    sig = _lru_get(_sigs, skey)
    if sig is None:
        ms, n_max, any_gathered, _, layout_all = _agree(
            ctx, dt, M_r, K, N, comm_sms, GA is not None, force, config, m_sizes, b_layout
        ) if P > 1 else ((M_r,), N, GA is not None, 1, b_layout)
        p = plan(ms, n_max, K, isz, sms, comm_sms=comm_sms, gathered=any_gathered, force_path=force,
                 config=config, tail_split=tail_split, b_layout=layout_all)
        layout = _layout(P, ms, p.chunk_rows, K * isz) if P > 1 and sum(ms) > 0 and K > 0 else None
        offs = tuple(int(x) for x in np.concatenate([[0], np.cumsum(ms)]))
        sig = _Sig(p, layout, offs, P, call_digest(dt, ms, K, n_max, any_gathered, p))
        _lru_put(_sigs, skey, sig, _SIGS_MAX)
        _log(ctx, p)
    p = sig.plan
    M_total = sig.offs[-1]
    if M_total >= 2 ** 31:
        raise ValueError(f"{what}: the gathered A has {M_total} rows; at most 2**31 - 1 are supported")

    # ---- out / gathered_a ----------------------------------------------------------------------
    if O_in is None:
        O = DeviceArray.empty((M_total, N), dt, device=dev)
    else:
        O = O_in
        _check_same_device(ctx, O, "out")
        if tuple(O.shape) != (M_total, N):
            raise ValueError(f"{what}: out has shape {tuple(O.shape)}, expected {(M_total, N)} (sum of the local "
                             f"ranks' rows {list(p.m_sizes)} x N)")
        if N > 1 and M_total > 0 and O.strides[1] != 1:
            raise ValueError(f"{what}: out must have a unit column stride (row-major rows)")
        if M_total > 1 and O.strides[0] < N:
            raise ValueError(f"{what}: out row stride {O.strides[0]} is smaller than N={N}")
    if GA is not None:
        _check_same_device(ctx, GA, "gathered_a")
        if GA.dtype.name != dt or tuple(GA.shape) != (M_total, K):
            raise ValueError(f"{what}: gathered_a must be {dt} {(M_total, K)}, got {GA.dtype.name} "
                             f"{tuple(GA.shape)}")
        if not GA.is_contiguous():
            raise ValueError(f"{what}: gathered_a must be C-contiguous")
    result = out if out is not None else O
    _set_last(p)
    if M_total == 0:
        return result

    # ---- P == 1 or nothing to communicate: plain GEMM (+ copy) ---------------------------------
    if sig.layout is None:
        if GA is not None and GA.nbytes and GA.ptr != A.ptr:
            check(cu.cuMemcpyDtoDAsync(GA.ptr, A.ptr, A.nbytes, cu.CUstream(stream_handle(stream))))
        if N > 0:
            a_full = A if P == 1 else DeviceArray(A.ptr, (M_total, 0), dt, (1, 1), dev, owner=A)
            G.gemm(a_full, B, O, b_layout=b_layout, stream=stream)
        return result

    # ---- workspace, bound launch arguments -----------------------------------------------------
    L = sig.layout
    ws = ctx.workspace(("ag_gemm",), L.total, stream, what)
    # keyed by the output's layout, not its address: a fresh output per call (out=None) re-points the
    # bound launch instead of binding anew (tensor maps, B staging, split-K workspace, events)
    # (gathered_a likewise: its layout is fixed -- dense [M_total, K] -- so only whether there is one)
    bkey = (skey, b_layout, out_dtype, ws, A.ptr, G.array_key(B), G.out_layout_key(O), GA is not None)
    bound = _lru_get(_bindings, bkey)
    if bound is None:
        bound = _bind(ctx, sig, ws, A, B, O, GA, b_layout, dt, out_dtype, M_total, N, K)
        _lru_put(_bindings, bkey, bound, _BINDINGS_MAX)
    ga_ptr = GA.ptr if GA is not None else 0

    def run():
        bound(stream, O, ga_ptr)
        if bound.buffers and not getattr(bound, "pinned", False) and is_capturing(stream):
            # a graph replays the binding's buffers (B staging, split-K sums) after the LRU may have
            # evicted it
            bound.pinned = True
            with _lock:
                _pinned_bindings.append(bound)
    run()
    fast_put(ctx, fkey, (run, p))
    return result


# ---- eager fast path -------------------------------------------------------------------------------
# A call repeated with the same mkernel DeviceArrays (a_shard, b, out, gathered_a), stream and options
# replays the first call's bound launch (fast_get): no argument checks, no signature or plan
# lookup, no binding lookup -- at small M the call is bound by host time in eager mode (sweep M=K=4096
# on 2 x H200: ~100 us of host time per call against ~90 us of GPU time).  The key also holds the
# environment the full path reads per call.  out=None always takes the full path (it allocates), and so
# does a read-only out.  ctx.check() still runs first (a failed peer raises).


def _fast_key(ctx, a_shard, b, out, gathered_a, b_layout, stream, comm_sms, m_sizes, config, path):
    arrays = (a_shard, b, out) + (() if gathered_a is None else (gathered_a,))
    if any(type(x) is not DeviceArray for x in arrays) or out.readonly:
        return None
    try:
        hs = stream_handle(stream)
        extra = (b_layout, hs, comm_sms, None if m_sizes is None else tuple(int(m) for m in m_sizes), config,
                 path, os.environ.get("MKERNEL_AG_GEMM_PATH"), os.environ.get("MKERNEL_AG_GEMM_TAIL_SPLIT"),
                 ctx._ws_gen)
        hash(extra)
    except (TypeError, ValueError):
        return None  # (the full path reports bad arguments)
    return ("ag_gemm", *(x.call_key() for x in arrays)) + extra


def _bind(ctx, sig: _Sig, ws, A, B, O, GA, b_layout, dt, out_dtype, M_total, N, K):
    """Build the launch closure for these pointers (tensor maps, packed args, B staging)."""
    p, L = sig.plan, sig.layout
    P, me = sig.P, ctx.local_rank
    isz = A.dtype.itemsize
    ldc = O.strides[0] if M_total > 1 else N
    args = AgArgs()
    args.a_shard, args.ws, args.peers = A.ptr, ws.ptr, ws.peer_table
    args.gathered_out = GA.ptr if GA is not None else None
    args.row_bytes, args.data_off, args.flags_off, args.consumed_off = K * isz, L.data_off, L.flags_off, L.consumed_off
    args.ldc = ldc
    args.M_total, args.N, args.K = M_total, N, K
    args.chunk_rows, args.nch_stride = p.chunk_rows, L.nch_stride
    args.group_m = G.GROUP_M
    args.P, args.me, args.ce_value_off = P, me, L.value_off
    for j, o in enumerate(sig.offs):
        args.offs[j] = o
    comm = ctx.comm_args("ag_gemm", sig.digest)
    dev = ctx.device
    ga_ptr = GA.ptr if GA is not None else 0

    def with_gathered(a, ga: int):
        """``a``, or a copy of it writing the gathered A to ``ga`` (a call's own gathered_a)."""
        if ga == ga_ptr:
            return a
        a2 = AgArgs.from_buffer_copy(a)
        a2.gathered_out = ga or None
        return a2

    if p.path == "unfused":
        args.n_comm, args.gather_only = 0, 1
        gather = _kernel(dt, out_dtype, p.config, "mk_ag_gather")
        release = _kernel(dt, out_dtype, p.config, "mk_ag_release")
        gathered = DeviceArray(ws.ptr + L.data_off, (M_total, K), dt, None, dev, owner=ws)
        # a bare view: a cached binding must not keep the caller's memory alive
        B = DeviceArray(B.ptr, B.shape, B.dtype, B.strides, B.device)
        grid = p.gather_blocks
        cargs = [comm, args]

        def run_unfused(stream, out, ga):
            gather.launch(grid, GATHER_THREADS, [comm, with_gathered(args, ga)], stream=stream, cooperative=True)
            if N > 0:
                G.gemm(gathered, B, out, b_layout=b_layout, stream=stream)
            release.launch(1, RELEASE_THREADS, cargs, stream=stream)
        run_unfused.buffers = False  # (mkernel.gemm keeps its own plan's buffers)
        return run_unfused

    cfg = G.CONFIGS[p.config]
    args.n_comm, args.gather_only = p.comm_sms, 0  # fused_ce: comm_sms = 0, every block a GEMM worker
    kern = _kernel(dt, out_dtype, cfg.id, f"mk_ag_gemm_{b_layout}")
    if kern.max_active_blocks_per_sm(cfg.threads, cfg.smem) < 1:
        raise RuntimeError(f"mkernel.ag_gemm: config {cfg.id} cannot be resident on this GPU")
    tma = encode_tiled(ws.ptr + L.data_off, dt, (K, M_total), (K * isz,), (64, cfg.bm))
    # this rank's rows are read in place (no local copy, no wait) when TMA can address a_shard
    M_me = sig.offs[me + 1] - sig.offs[me]
    args.local_map = int(M_me > 0 and A.ptr % 16 == 0)
    tmal = encode_tiled(A.ptr, dt, (K, M_me), (K * isz,), (64, cfg.bm)) if args.local_map else tma
    tmb, pre, keep = G.b_operand(B, K, N, b_layout, cfg, dt, out_dtype, dev)
    tmc = G.point_out(args, O, M_total, N, ldc, cfg, tma)  # (only the fused kernel writes C itself)
    grid = p.comm_sms + p.workers
    kargs = [tma, tmb, tmal, tmc, comm, args]
    keep = tuple(keep)
    o_ptr = O.ptr

    def kargs_for(O2, ga: int) -> list:
        """The fused kernel's arguments for output O2 (O's layout, any address) and gathered A at ga."""
        a2 = with_gathered(args, ga)
        if O2.ptr == o_ptr:
            return kargs if a2 is args else [tma, tmb, tmal, tmc, comm, a2]
        if a2 is args:
            a2 = AgArgs.from_buffer_copy(args)
        return [tma, tmb, tmal, G.point_out(a2, O2, M_total, N, ldc, cfg, tma), comm, a2]
    tcfg = tile_config(p.config, b_layout)  # the tile the kernel runs (config 5: 224 or 256 wide)
    tiles = _fused_tiles([sig.offs[j + 1] - sig.offs[j] for j in range(P)], N, tcfg)
    args.splits, args.split_from = 1, tiles  # (no split-K: every unit a whole tile, mk_split_unit)
    # split-K (fp32 running sums and counters, zero; the kernel keeps them so).  (A rank whose N is below
    # the agreed maximum has fewer tiles than the plan counted: it splits from the same unit on, if any.)
    if p.splits > 1 and p.split_from < tiles:
        sk_ws, args.partials, args.counters = G.split_workspace(tiles - p.split_from, tcfg.bm * tcfg.bn, dev)
        args.splits, args.split_from = p.splits, p.split_from
        keep += (sk_ws,)

    if p.path == "fused_ce":
        if not args.local_map:
            # this rank's rows are copied into the workspace first: a same-device copy the driver may
            # run as a kernel, which must find an SM while the GEMM waits for those rows
            grid = min(grid, ctx.sm_count - 1)
        run = _bind_ce(ctx, sig, ws, A, GA, kern, grid, cfg, kargs_for, pre, keep, args, comm, dt, out_dtype,
                       K * isz)
    else:
        def run(stream, out, ga, _keep=keep):
            for k, g, blk, a in pre:
                k.launch(g, blk, a, stream=stream)
            kern.launch(grid, cfg.threads, kargs_for(out, ga), stream=stream, smem=cfg.smem, cooperative=True)
    # buffers: device memory a captured graph replays (pinned once captured: ag_gemm)
    if p.splits == 1:
        run.buffers = bool(keep)
        return run
    clear = G.ClearBeforeFirstUse(sk_ws.ptr, sk_ws.size)

    def run_split(stream, out, ga):
        clear(stream)
        run(stream, out, ga)
    run_split.buffers = True
    return run_split


def _ce_copies(sig: _Sig, ws, A, me: int, row_bytes: int, local_map: bool) -> list:
    """The side stream's copies for this rank, in order: (dst, src, bytes).  Local chunks first (our
    GEMM starts on them; none when the GEMM reads them in place: local_map), then the shard to each
    peer in rank-rotated order (me+1 first), in the plan's copy groups of consecutive chunks
    (ce_copy_groups); each data copy is followed by one copy of the flag values into its chunks' ready
    flags at the destination (consecutive u64: up to CE_VALUES of them per copy)."""
    p, L, P = sig.plan, sig.layout, sig.P
    cr, m = p.chunk_rows, sig.offs[me + 1] - sig.offs[me]
    base = sig.offs[me] * row_bytes
    value = ws.ptr + L.value_off
    groups = ce_copy_groups(-(-m // cr), p.ce_group_max)
    out = []
    for j in range(1 if local_map else 0, P):
        dst = (me + j) % P
        ws_dst = ws.ptr if j == 0 else ws.peer_ptr(dst)
        c = 0
        for g in groups:
            off, n = c * cr * row_bytes, (min(m, (c + g) * cr) - c * cr) * row_bytes
            out.append((ws_dst + L.data_off + base + off, A.ptr + off, n))
            out.append((ws_dst + L.flags_off + 8 * (me * L.nch_stride + c), value, 8 * g))
            c += g
    return out


def _bind_ce(ctx, sig, ws, A, GA, kern, grid, cfg, kargs_for, pre, keep, args, comm, dt, out_dtype, row_bytes):
    """The copy-engine path: GEMM on the caller's stream, copies on ctx.side_stream() (fork/join)."""
    me = ctx.local_rank
    copies = [(cu.CUdeviceptr(d), cu.CUdeviceptr(s_), n)
              for d, s_, n in _ce_copies(sig, ws, A, me, row_bytes, bool(args.local_map))]
    fork = ForkedCopies(ctx.side_stream())
    bargs = [comm, args]
    L = sig.layout
    # The GEMM kernel opens the call (worker 0's idle producer warp: ag_ce_open) and raises the word
    # at go; the side stream waits for it, re-zeroes it, then copies.
    args.ce_go_off = L.go_off
    go = cu.CUdeviceptr(ws.ptr + L.go_off)
    if GA is not None:
        # The caller's copy of the gathered A is taken from the workspace after the GEMM, so the call
        # stays open until then (peers may refill the workspace once we signal consumed): the GEMM
        # leaves the epoch open and the release kernel closes it after the copy.
        args.gather_only = 1
        release = _kernel(dt, out_dtype, sig.plan.config, "mk_ag_release")
    lo, hi, total = sig.offs[me] * row_bytes, sig.offs[me + 1] * row_bytes, sig.offs[-1] * row_bytes

    def gathered_copies(ga: int) -> list:
        """(dst, src, bytes) copies of the gathered A into ga after the GEMM."""
        if not args.local_map:
            return [(ga, ws.ptr + L.data_off, total)]
        # our rows are not in the workspace: peers' rows around them, ours from a_shard
        parts = [(ga, ws.ptr + L.data_off, lo), (ga + lo, A.ptr, hi - lo),
                 (ga + hi, ws.ptr + L.data_off + hi, total - hi)]
        return [g for g in parts if g[2] > 0]
    # (the kernel opens the call whenever there are peers, even with no rows of ours to send: it
    # announces the call, which the peers check before they push to us; P > 1 on this path)

    def start(side):
        check(cu.cuStreamWaitValue32(side, go, 1, cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ.value))
        check(cu.cuStreamWriteValue32(side, go, 0, 0))

    def run_fused_ce(stream, out, ga, _keep=(keep, fork)):
        s = cu.CUstream(stream_handle(stream))
        fork.fork(s, start)
        fork.copies(copies)
        try:
            for k, g, blk, a in pre:
                k.launch(g, blk, a, stream=stream)
            kern.launch(grid, cfg.threads, kargs_for(out, ga), stream=stream, smem=cfg.smem)
        except BaseException:
            # the kernel that raises the word never ran: release the side stream, or it waits forever
            cu.cuStreamWriteValue32(s, go, 1, 0)
            fork.join(s)
            raise
        fork.join(s)
        if ga:
            copy_async(gathered_copies(ga), s)
            release.launch(1, RELEASE_THREADS, bargs, stream=stream)
    return run_fused_ce


ag_gemm.last_plan = None


def precompile(specs=None, *, arch: str | None = None, workers: int | None = None) -> float:
    """Compile ag_gemm.cu specializations (default: every registered one) into the disk cache in
    parallel worker processes; returns the summed NVRTC seconds (0 for cubins already cached)."""
    return precompile_source(SOURCE, specs, arch=arch, workers=workers)
