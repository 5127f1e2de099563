"""GPU-driven collectives over NVLink: all-gather, reduce-scatter, all-reduce (sum).

Each call is one persistent kernel (``cuda_src/collectives.cu``) launched on the caller's stream; no
host synchronization between calls (per-call epochs live on the device), so calls can be captured
in a CUDA graph and replayed.  Every device-side wait is bounded by the context timeout; a dead peer
turns into :class:`mkernel.CommTimeout` at the next :meth:`Context.check`/``synchronize``.

All ranks of the context's communicator take part.  On one node (``ctx.num_nodes == 1``) the
kernels below move data over NVLink only; across nodes (real, or emulated with
``MKERNEL_RANKS_PER_NODE``) :mod:`mkernel.internode` runs the hierarchical versions (NVLink inside a
node, the CPU proxy across nodes).
bf16 / fp16 / fp32 (reductions accumulate in fp32); all-gather also takes int32/int64.  Inputs and
outputs are any CUDA arrays (``__cuda_array_interface__`` / DLPack), C-contiguous, on the context's
GPU; they need not be symmetric memory: each op owns a symmetric workspace, allocated on first use
and grown when a larger call comes.  The first call with a new size checks across ranks that every
rank makes the same call.
"""
from __future__ import annotations

import ctypes
import functools
import os

from . import internode, runtime
from .arrays import DeviceArray, as_device_array, dtype_of, require
from .runtime import round_up

__all__ = ["all_gather", "reduce_scatter", "all_reduce", "CollLayout", "plan_chunks"]

_SOURCE = "collectives.cu"
_REDUCE_DTYPES = tuple(dtype_of(d) for d in ("bfloat16", "float16", "float32"))
_GATHER_DTYPES = tuple(dtype_of(d) for d in ("bfloat16", "float16", "float32", "int32", "int64"))
_BYTES = dtype_of("bfloat16")  # the all-gather kernel moves bytes: one specialization for every dtype
_THREADS = 512
ONE_SHOT_MAX_BYTES = 256 * 1024  # all-reduce below this: one flag hop instead of two
_HEADER = 4096

for _code in (0, 1, 2):
    runtime.register_specialization(_SOURCE, {"MK_DTYPE": _code})


class CollLayout(ctypes.Structure):
    """``struct CollLayout`` of collectives.cu: byte offsets into the symmetric workspace."""

    _fields_ = [("consumed_off", ctypes.c_uint64), ("flags_off", ctypes.c_uint64),
                ("data0_off", ctypes.c_uint64), ("data1_off", ctypes.c_uint64),
                ("slot_bytes", ctypes.c_uint64), ("chunk_bytes", ctypes.c_uint64),
                ("nchunks", ctypes.c_int32), ("pad", ctypes.c_int32)]


MIN_CHUNK = int(os.environ.get("MKERNEL_COLL_MIN_CHUNK", 32 * 1024))
MAX_BLOCKS = int(os.environ.get("MKERNEL_COLL_MAX_BLOCKS", 0))  # 0: one block per SM


def plan_chunks(slot_bytes: int, grid_max: int, min_chunk: int | None = None) -> tuple[int, int]:
    """(chunk_bytes, nchunks): about two chunks per block, none smaller than ``min_chunk``."""
    min_chunk = MIN_CHUNK if min_chunk is None else min_chunk
    slot_bytes = max(slot_bytes, 16)
    chunk = max(min_chunk, -(-slot_bytes // (2 * grid_max)))
    chunk = round_up(min(chunk, round_up(slot_bytes, 16)), 16)
    return chunk, -(-slot_bytes // chunk)


# Blocks per call.  Measured on 2x H200 (docs/collectives.md): with one block per SM, slots of
# 2-32 MiB first ran 3-7x slower than with 32 blocks -- the waiters' polling (a .sys load every spin,
# the host-mapped error record read over PCIe every 64 spins) starved the copies.  With quiet polling
# (mk_signal.cuh: back-off, error record read about once a millisecond) one block per SM is as fast
# at 4-16 MiB and faster from 32 MiB up (all-reduce 64 MiB 249 us vs 321 us, reduce-scatter 150 us
# vs 235 us), and from 2 MiB slots too (all-reduce 8 MiB: 43.4 us with 132 blocks, 57.5 with 32;
# reduce-scatter 8 MiB 28.8 vs 38.4; all-gather equal); below 2 MiB slots 32 blocks stay (launch-
# bound, a smaller grid starts sooner).
SMALL_SLOT_BLOCKS = 32
LARGE_SLOT_BYTES = 2 << 20


def grid_for(slot_bytes: int, grid_max: int) -> int:
    return grid_max if slot_bytes >= LARGE_SLOT_BYTES else min(grid_max, SMALL_SLOT_BLOCKS)


@functools.lru_cache(maxsize=1024)
def _layout(P: int, slot_bytes: int, grid_max: int, phases: int) -> tuple[CollLayout, int, int]:
    """(layout, workspace bytes, grid) for ``P`` local ranks exchanging slots of ``slot_bytes``."""
    slot_bytes = round_up(max(slot_bytes, 16), 256)
    grid_max = grid_for(slot_bytes, grid_max)
    chunk, nchunks = plan_chunks(slot_bytes, grid_max)
    L = CollLayout()
    L.consumed_off = 64
    L.flags_off = round_up(L.consumed_off + 8 * P, 256)
    L.data0_off = round_up(L.flags_off + 8 * 2 * P * nchunks, 4096)
    L.data1_off = L.data0_off + P * slot_bytes
    L.slot_bytes, L.chunk_bytes, L.nchunks = slot_bytes, chunk, nchunks
    total = L.data0_off + phases * P * slot_bytes
    return L, total, min(grid_max, nchunks)


def _kernel(ctx, op: str, dtype):
    """The compiled kernel of ``op`` for ``dtype`` on this context (checked once for residency)."""
    kernels = ctx.__dict__.setdefault("_collective_kernels", {})
    k = kernels.get((op, dtype.code))
    if k is None:
        k = runtime.kernel(_SOURCE, {"MK_DTYPE": dtype.code}, "mk_" + op)
        if k.max_active_blocks_per_sm(_THREADS) < 1:  # the launch is cooperative: one block per SM
            raise RuntimeError(f"mkernel: the {op} kernel cannot be resident")
        kernels[(op, dtype.code)] = k
    return k


def _launch(ctx, op: str, dtype, slot_bytes: int, phases: int, head_args: list, stream) -> None:
    """Plan the chunks, take the op's symmetric workspace (grown collectively when needed), launch."""
    k = _kernel(ctx, op, dtype)
    grid_max = min(ctx.sm_count, MAX_BLOCKS) if MAX_BLOCKS > 0 else ctx.sm_count
    L, total, grid = _layout(ctx.local_size, slot_bytes, grid_max, phases)
    ws = ctx.workspace(("collective", op), total)
    args = [ctx.comm_args(op), *head_args, ctypes.c_uint64(ws.ptr), ctypes.c_uint64(ws.peer_table), L]
    k.launch(grid, _THREADS, args, stream=stream, cooperative=True)


def _arg(ctx, arr, what: str, name: str, dtypes, stream) -> DeviceArray:
    """``arr`` imported for use on ``stream`` (the producer's pending work is ordered before it), checked."""
    a = as_device_array(arr, name=f"{what}: {name}", stream=stream)
    return require(a, f"{what}: {name}", dtypes=dtypes, device=ctx.device, align=a.dtype.itemsize)


def _out(ctx, out, what: str, shape: tuple, x: DeviceArray, dtypes, stream):
    """(the object to return, its DeviceArray view): ``out`` checked, or a new array when None."""
    if out is None:
        out = DeviceArray.empty(shape, x.dtype, device=ctx.device)
    o = _arg(ctx, out, what, "out", dtypes, stream)
    if o.dtype != x.dtype or tuple(o.shape) != tuple(shape):
        raise ValueError(f"{what}: out must be {x.dtype.name} {tuple(shape)}, got {o.dtype.name} {tuple(o.shape)}")
    return out, o


def _overlaps(a: DeviceArray, b: DeviceArray) -> bool:
    return a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes


def all_gather(ctx, x, out=None, *, stream=None):
    """Gather ``x`` from every local rank: ``out`` = concat over local ranks (axis 0).

    ``x``: ``[n, ...]`` on every local rank (same shape and dtype everywhere);
    ``out``: ``[size * n, ...]``, allocated when None; rank j's ``x`` lands in rows
    ``[j*n, (j+1)*n)`` on every rank.  ``x`` may be this rank's own rows of ``out`` (in place).
    Returns ``out``.
    """
    what = "mkernel.all_gather"
    ctx.check()
    x = _arg(ctx, x, what, "x", _GATHER_DTYPES, stream)
    out, o = _out(ctx, out, what, (ctx.size * (x.shape[0] if x.ndim else 1),) + tuple(x.shape[1:]), x,
                  _GATHER_DTYPES, stream)
    if _overlaps(x, o) and x.ptr != o.ptr + ctx.rank * x.nbytes:
        raise ValueError(f"{what}: x overlaps out but is not this rank's own rows of out")
    ctx.agree(what, (x.dtype.name, tuple(x.shape)), ctx.world)
    if x.nbytes == 0:
        return out
    if ctx.num_nodes > 1:
        internode.all_gather(ctx, x, o, stream)
        return out
    # byte-oriented: one kernel for every dtype
    _launch(ctx, "all_gather", _BYTES, x.nbytes, 1,
            [ctypes.c_uint64(x.ptr), ctypes.c_uint64(o.ptr), ctypes.c_uint64(x.nbytes)], stream)
    return out


def reduce_scatter(ctx, x, out=None, *, stream=None):
    """Sum ``x`` over local ranks and scatter: ``out`` on local rank j = sum_r x_r[j*n:(j+1)*n].

    ``x``: ``[size * n, ...]``; ``out``: ``[n, ...]`` (allocated when None), must not overlap
    ``x``.  bf16/fp16/fp32, fp32 accumulation.  Returns ``out``.
    """
    what = "mkernel.reduce_scatter"
    ctx.check()
    x = _arg(ctx, x, what, "x", _REDUCE_DTYPES, stream)
    P = ctx.size
    if x.ndim == 0 or x.shape[0] % P:
        raise ValueError(f"{what}: x's first dimension ({x.shape[0] if x.ndim else 'scalar'}) must be a multiple "
                         f"of the number of ranks ({P})")
    out, o = _out(ctx, out, what, (x.shape[0] // P,) + tuple(x.shape[1:]), x, _REDUCE_DTYPES, stream)
    if _overlaps(x, o):
        raise ValueError(f"{what}: out must not overlap x")
    ctx.agree(what, (x.dtype.name, tuple(x.shape)), ctx.world)
    if o.size == 0:
        return out
    if ctx.num_nodes > 1:
        internode.reduce_scatter(ctx, x, o, stream)
        return out
    _launch(ctx, "reduce_scatter", x.dtype, o.nbytes, 1,
            [ctypes.c_uint64(x.ptr), ctypes.c_uint64(o.ptr), ctypes.c_uint64(o.size)], stream)
    return out


def all_reduce(ctx, x, out=None, *, stream=None):
    """Sum ``x`` over local ranks into ``out`` (same shape; allocated when None; may be ``x`` itself).

    bf16/fp16/fp32, fp32 accumulation.  Below ``ONE_SHOT_MAX_BYTES`` every rank reduces the whole
    array itself (one hop); above, reduce-scatter + all-gather inside one kernel.  Every rank gets
    bit-identical results.  Returns ``out``.
    """
    what = "mkernel.all_reduce"
    ctx.check()
    x = _arg(ctx, x, what, "x", _REDUCE_DTYPES, stream)
    out, o = _out(ctx, out, what, tuple(x.shape), x, _REDUCE_DTYPES, stream)
    if _overlaps(x, o) and x.ptr != o.ptr:
        raise ValueError(f"{what}: out overlaps x without being x")
    ctx.agree(what, (x.dtype.name, tuple(x.shape)), ctx.world)
    n = x.size
    if n == 0:
        return out
    if ctx.num_nodes > 1:
        internode.all_reduce(ctx, x, o, stream)
        return out
    P = ctx.local_size
    one_shot = x.nbytes <= ONE_SHOT_MAX_BYTES or P == 1
    shard = n if one_shot else round_up(-(-n // P), 16 // x.dtype.itemsize)
    _launch(ctx, "all_reduce", x.dtype, shard * x.dtype.itemsize, 1 if one_shot else 2,
            [ctypes.c_uint64(x.ptr), ctypes.c_uint64(o.ptr), ctypes.c_uint64(n), ctypes.c_uint64(shard),
             ctypes.c_int32(1 if one_shot else 0)], stream)
    return out
