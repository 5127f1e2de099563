"""The collectives' workspace layout, chunking and path choice: pure functions of sizes and options.

The workspace (cuda_src/ops/collectives.cu has the picture): epoch state, the call header
(consumed / entered / sig of every local rank), ``ready[2][P][MAX_CHUNKS]`` flags, then ``phases`` x P
receive slots.  Everything before the slots depends on the rank count only (docs/design.md, "Control
words never move").
"""
from __future__ import annotations

import ctypes
import functools

from ...core.util import ceil_div, round_up
from ...dist.signals import MAX_CHUNKS, workspace_control
from .options import CollectiveOptions

__all__ = ["CollLayout", "plan_chunks", "grid_for", "sm_layout", "ce_layout", "plan_ce_chunks", "ce_chunk",
           "use_copy_engines", "copy_engine_path", "one_shot", "shard_elems", "CE_VALUE_OFF", "CE_MIN_CHUNK",
           "SMALL_SLOT_BLOCKS", "LARGE_SLOT_BYTES", "CE_ONE_SHOT_MAX_RANKS"]

CE_VALUE_OFF = 32  # collectives.cu MK_COLL_CE_VALUE_OFF: the call number the copy engines copy into flags
CE_MIN_CHUNK = 2 << 20  # bytes per copy-engine copy (and flag): fewer, larger copies keep the host's share small
# Blocks of the SM path: one per SM from slots of LARGE_SLOT_BYTES up; below, SMALL_SLOT_BLOCKS (the
# launch-bound sizes start sooner on a smaller grid: docs/collectives.md, "Blocks per call")
SMALL_SLOT_BLOCKS = 32
LARGE_SLOT_BYTES = 2 << 20
# All-reduce on the copy engines with at most this many local ranks runs one-shot (one copy-engine round;
# the same bytes per link direction as reduce-scatter + all-gather when P = 2)
CE_ONE_SHOT_MAX_RANKS = 2


class CollLayout(ctypes.Structure):
    """``struct CollLayout`` of collectives.cu: byte offsets into the symmetric workspace."""

    _fields_ = [("consumed_off", ctypes.c_uint64), ("flags_off", ctypes.c_uint64),
                ("data0_off", ctypes.c_uint64), ("data1_off", ctypes.c_uint64),
                ("slot_bytes", ctypes.c_uint64), ("chunk_bytes", ctypes.c_uint64),
                ("nchunks", ctypes.c_int32), ("tail_pieces", ctypes.c_int32),
                ("direct", ctypes.c_int32), ("flag_stride", ctypes.c_int32)]


def plan_chunks(slot_bytes: int, grid_max: int, min_chunk: int) -> tuple[int, int]:
    """(chunk_bytes, nchunks) of the SM path: about two chunks per block, none smaller than ``min_chunk``."""
    slot_bytes = max(slot_bytes, 16)
    chunk = max(min_chunk, ceil_div(slot_bytes, 2 * grid_max), ceil_div(slot_bytes, MAX_CHUNKS))
    chunk = round_up(min(chunk, round_up(slot_bytes, 16)), 16)
    return chunk, ceil_div(slot_bytes, chunk)


def grid_for(slot_bytes: int, grid_max: int) -> int:
    return grid_max if slot_bytes >= LARGE_SLOT_BYTES else min(grid_max, SMALL_SLOT_BLOCKS)


def _workspace_layout(P: int, slot_bytes: int, chunk: int, nchunks: int, phases: int) -> tuple[CollLayout, int]:
    if not 0 < nchunks <= MAX_CHUNKS:
        raise AssertionError(f"collectives: {nchunks} chunks per slot, the workspace has flags for {MAX_CHUNKS}")
    L = CollLayout()
    L.consumed_off, L.flags_off, end = workspace_control(P, 2 * P)
    L.data0_off = round_up(end, 4096)
    L.data1_off = L.data0_off + P * slot_bytes
    L.slot_bytes, L.chunk_bytes, L.nchunks, L.flag_stride = slot_bytes, chunk, nchunks, MAX_CHUNKS
    return L, L.data0_off + phases * P * slot_bytes


@functools.lru_cache(maxsize=1024)
def sm_layout(P: int, slot_bytes: int, grid_max: int, phases: int, min_chunk: int) -> tuple[CollLayout, int, int]:
    """(layout, workspace bytes, grid) of the SM path for ``P`` local ranks exchanging slots of ``slot_bytes``."""
    slot_bytes = round_up(max(slot_bytes, 16), 256)
    grid_max = grid_for(slot_bytes, grid_max)
    chunk, nchunks = plan_chunks(slot_bytes, grid_max, min_chunk)
    L, total = _workspace_layout(P, slot_bytes, chunk, nchunks, phases)
    return L, total, min(grid_max, nchunks)


def plan_ce_chunks(slot_bytes: int, max_chunks: int, tail_pieces: int) -> tuple[int, int, int]:
    """(chunk_bytes, nchunks, tail_pieces) of a copy-engine slot: at most ``max_chunks`` chunks of at
    least CE_MIN_CHUNK bytes (4 KiB multiples), the last one cut into ``tail_pieces`` pieces (0: not
    cut; see :func:`ce_chunk`); ``nchunks`` counts the pieces (one flag each)."""
    slot_bytes = max(slot_bytes, 16)
    chunk = round_up(max(CE_MIN_CHUNK, ceil_div(slot_bytes, max_chunks)), 4096)
    n = ceil_div(slot_bytes, chunk)
    pieces = tail_pieces if tail_pieces > 1 and chunk >= tail_pieces * 4096 else 0
    return chunk, n - 1 + max(pieces, 1), pieces


def ce_chunk(L: CollLayout, nbytes: int, c: int) -> tuple[int, int]:
    """(offset, length) of chunk ``c`` of a ``nbytes`` message in a copy-engine slot (collectives.cu
    ``ce_chunk``, the same formula): chunks of ``chunk_bytes``, except that with ``tail_pieces`` = T > 0
    the last T indices cut the last chunk into pieces of ``round_up(chunk_bytes / T, 4 KiB)``."""
    T = L.tail_pieces
    full = L.nchunks - T if T else L.nchunks
    if T and c >= full:
        piece = round_up(ceil_div(L.chunk_bytes, T), 4096)
        off = full * L.chunk_bytes + (c - full) * piece
        size = piece
    else:
        off, size = c * L.chunk_bytes, L.chunk_bytes
    return off, max(0, min(size, nbytes - off))


@functools.lru_cache(maxsize=1024)
def ce_layout(P: int, slot_bytes: int, phases: int, max_chunks: int, tail_pieces: int) -> tuple[CollLayout, int]:
    """(layout, workspace bytes) of the copy-engine path (the SM path's layout, copy-engine chunks)."""
    slot_bytes = round_up(max(slot_bytes, 16), 4096)
    chunk, nchunks, pieces = plan_ce_chunks(slot_bytes, max_chunks, tail_pieces)
    L, total = _workspace_layout(P, slot_bytes, chunk, nchunks, phases)
    L.tail_pieces = pieces
    return L, total


def use_copy_engines(op: str, message_bytes: int, local_size: int, options: CollectiveOptions) -> bool:
    """Whether ``op`` moving ``message_bytes`` per peer goes through the copy engines (never with one local
    rank).  Every rank decides alike: the choice is part of the agreed signature."""
    if local_size < 2:
        return False
    if options.copy_engines is not None:
        return options.copy_engines
    return message_bytes >= options.ce_min_bytes(op)


def shard_elems(n: int, P: int, itemsize: int) -> int:
    """Elements per rank of a two-phase all-reduce of ``n`` elements (16-byte multiples)."""
    return round_up(ceil_div(n, P), 16 // itemsize)


def one_shot(nbytes: int, local_size: int, options: CollectiveOptions) -> bool:
    """Whether an all-reduce of ``nbytes`` reduces everything on every rank (one flag hop)."""
    return local_size == 1 or nbytes <= options.one_shot_limit(local_size)


def copy_engine_path(op: str, x_nbytes: int, itemsize: int, local_size: int, options: CollectiveOptions) -> bool:
    """Whether ``op`` with an input of ``x_nbytes`` on one node of ``local_size`` ranks runs on the copy
    engines: by its per-peer message (all-gather: x, reduce-scatter: one rank's share of x, all-reduce:
    one shard); never a one-shot SM all-reduce."""
    P = local_size
    if op == "all_gather":
        return use_copy_engines(op, x_nbytes, P, options)
    if op == "reduce_scatter":
        return use_copy_engines(op, x_nbytes // max(P, 1), P, options)
    if one_shot(x_nbytes, P, options):
        return False
    return use_copy_engines(op, shard_elems(x_nbytes // itemsize, P, itemsize) * itemsize, P, options)
