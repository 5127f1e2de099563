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

from cuda.bindings import driver as cu

from ...core.arrays import DeviceArray
from ...core.compiler import kernel, register_specialization
from ...core.dtypes import dtype_of
from ...core.interop import as_device_array, require
from ...core.streams import stream_handle
from ...core.util import round_up
from ...dist.sidestream import ForkedCopies
from ...dist.signals import MAX_CHUNKS, workspace_control
from ..base import fast_get, fast_put
from . import internode

__all__ = ["all_gather", "reduce_scatter", "all_reduce", "CollLayout", "plan_chunks", "use_copy_engines",
           "copy_engine_path"]

_SOURCE = "ops/collectives.cu"
_REDUCE_DTYPES = tuple(dtype_of(d) for d in ("bfloat16", "float16", "float32"))
_GATHER_DTYPES = tuple(dtype_of(d) for d in ("bfloat16", "float16", "float32", "int32", "int64"))
_BYTES = dtype_of("bfloat16")  # the all-gather kernel moves bytes: one specialization for every dtype
_THREADS = 512
# All-reduce up to this many bytes: one-shot (every rank pushes its whole buffer to every peer and
# reduces everything itself: one flag hop instead of two).  With 2 ranks it moves the same bytes per
# link direction as reduce-scatter + all-gather, and measured faster up to 32 MiB (2x H200, us: 1 MiB
# 18.7 vs 30.9, 16 MiB 72.7 vs 77.8, 32 MiB 131.5 vs 134.8; 64 MiB 268.8 vs 250.6); with more ranks it
# moves (P-1)/2 times more, so only small buffers.  MKERNEL_COLL_ONE_SHOT_MAX_BYTES overrides both.
_ONE_SHOT_ENV = os.environ.get("MKERNEL_COLL_ONE_SHOT_MAX_BYTES")
ONE_SHOT_MAX_BYTES = int(_ONE_SHOT_ENV or 256 * 1024)
ONE_SHOT_MAX_BYTES_2RANKS = int(_ONE_SHOT_ENV or 32 << 20)


def one_shot_max_bytes(local_size: int) -> int:
    return ONE_SHOT_MAX_BYTES_2RANKS if local_size == 2 else ONE_SHOT_MAX_BYTES

for _code in (0, 1, 2):
    register_specialization(_SOURCE, {"MK_DTYPE": _code})


class CollLayout(ctypes.Structure):
    """``struct CollLayout`` of collectives.cu: byte offsets into the symmetric workspace."""

    _fields_ = [("consumed_off", ctypes.c_uint64), ("flags_off", ctypes.c_uint64),
                ("data0_off", ctypes.c_uint64), ("data1_off", ctypes.c_uint64),
                ("slot_bytes", ctypes.c_uint64), ("chunk_bytes", ctypes.c_uint64),
                ("nchunks", ctypes.c_int32), ("tail_pieces", ctypes.c_int32),
                ("direct", ctypes.c_int32), ("flag_stride", ctypes.c_int32)]


MIN_CHUNK = int(os.environ.get("MKERNEL_COLL_MIN_CHUNK", 32 * 1024))
MAX_BLOCKS = int(os.environ.get("MKERNEL_COLL_MAX_BLOCKS", 0))  # 0: one block per SM


def plan_chunks(slot_bytes: int, grid_max: int, min_chunk: int | None = None) -> tuple[int, int]:
    """(chunk_bytes, nchunks): about two chunks per block, none smaller than ``min_chunk``."""
    min_chunk = MIN_CHUNK if min_chunk is None else min_chunk
    slot_bytes = max(slot_bytes, 16)
    chunk = max(min_chunk, -(-slot_bytes // (2 * grid_max)), -(-slot_bytes // MAX_CHUNKS))
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
    L, total = _workspace_layout(P, slot_bytes, chunk, nchunks, phases)
    return L, total, min(grid_max, nchunks)


def _workspace_layout(P: int, slot_bytes: int, chunk: int, nchunks: int, phases: int) -> tuple[CollLayout, int]:
    """(layout, workspace bytes): epoch state (and the copy-engine path's call number) in the first 64
    bytes, consumed[P], entered[P], sig[P][2] (collectives.cu: the call signatures peers announce),
    ready[2][P][MAX_CHUNKS] (the first ``nchunks`` of each row used; plan_chunks and plan_ce_chunks
    never cut a slot into more), then ``phases`` x P receive slots of ``slot_bytes``.  Everything
    before the slots depends on P only (signals.workspace_control)."""
    if not 0 < nchunks <= MAX_CHUNKS:
        raise AssertionError(f"collectives: {nchunks} chunks per slot, the workspace has flags for {MAX_CHUNKS}")
    L = CollLayout()
    L.consumed_off, L.flags_off, end = workspace_control(P, 2 * P)
    L.data0_off = round_up(end, 4096)
    L.data1_off = L.data0_off + P * slot_bytes
    L.slot_bytes, L.chunk_bytes, L.nchunks, L.flag_stride = slot_bytes, chunk, nchunks, MAX_CHUNKS
    return L, L.data0_off + phases * P * slot_bytes


def _kernel(ctx, op: str, dtype, threads: int = _THREADS):
    """The compiled kernel of ``op`` for ``dtype`` on this context (checked once for residency)."""
    kernels = ctx.__dict__.setdefault("_collective_kernels", {})
    k = kernels.get((op, dtype.code))
    if k is None:
        k = kernel(_SOURCE, {"MK_DTYPE": dtype.code}, "mk_" + op)
        if k.max_active_blocks_per_sm(threads) < 1:  # cooperative launches: one block per SM
            raise RuntimeError(f"mkernel: the {op} kernel cannot be resident")
        kernels[(op, dtype.code)] = k
    return k


def _launch(ctx, op: str, dtype, slot_bytes: int, phases: int, head_args: list, stream, sig: int):
    """Plan the chunks, take the op's symmetric workspace (grown collectively when needed), launch
    (``sig``: the call's signature, ``ctx.agree``'s digest, checked against the peers' on the device).
    Returns the prepared launch (PreparedLaunch: calling it launches the same again)."""
    grid_max = min(ctx.sm_count, MAX_BLOCKS) if MAX_BLOCKS > 0 else ctx.sm_count
    L, total, grid = _layout(ctx.local_size, slot_bytes, grid_max, phases)
    ws = ctx.workspace(("collective", op), total, stream, f"mkernel.{op}")
    k = _kernel(ctx, op, dtype)
    args = [ctx.comm_args(op, sig), *head_args, ctypes.c_uint64(ws.ptr), ctypes.c_uint64(ws.peer_table), L]
    run = k.prepare(grid, _THREADS, args, stream=stream, cooperative=True)
    run.submit()
    return run


# ---- eager fast path -------------------------------------------------------------------------------
# A call repeated with the same mkernel DeviceArrays (x and out), stream and path settings, after a
# first call that ran the SM kernel, replays that call's prepared launch: no argument checks, no plan,
# no argument packing (fast_get; the key holds MKERNEL_COLL_CE, read per call).


def _fast_key(ctx, op: str, x, out, stream):
    if type(x) is not DeviceArray or type(out) is not DeviceArray:
        return None
    return (op, x.call_key(), out.call_key(), stream_handle(stream), os.environ.get("MKERNEL_COLL_CE"), ctx._ws_gen)


def _fast_run(ctx, key) -> bool:
    """Replay the prepared launch of an identical earlier call; False when there is none."""
    run = fast_get(ctx, key)
    if run is None:
        return False
    ctx.check()
    run()
    return True


# --------------------------------------------------------------------------------------------
# copy-engine path (large messages): cuda_src/collectives.cu, "Copy-engine path"
# --------------------------------------------------------------------------------------------
CE_VALUE_OFF = 32  # collectives.cu MK_COLL_CE_VALUE_OFF: the call number the copy engines copy into flags
CE_MIN_CHUNK = 2 << 20  # bytes per copy (and flag): fewer, larger copies keep the host's share small
# per peer slot: the receivers' work is pipelined over this many chunks, each one a copy and a flag copy.
# Fewer, larger chunks cost less per call; the last one's local copy is exposed.  Measured (2x H200,
# 2026-11-30, busbw GB/s at 512 MiB / 1 GiB; 16 chunks twice; docs/collectives.md): all-gather 4: 329/339,
# 8: 326/336, 16: 305-310/327-332, 32: 281/314; all-reduce 4: 334/338, 8: 347/354, 16: 339-342/353-358,
# 32: 330/351.  MKERNEL_COLL_CE_MAX_CHUNKS overrides (every rank alike).
CE_MAX_CHUNKS = min(int(os.environ.get("MKERNEL_COLL_CE_MAX_CHUNKS", 8)), MAX_CHUNKS // 2)
# Per-peer message bytes (AG: x, RS: out, AR: one shard) from which the copy engines carry the data.
# Measured on 2x H200 (docs/collectives.md, same run, per-call us, copy engines vs SM pushes): the
# copy-engine path costs ~50 us more per call (begin kernel, copy-engine and flag-copy latency, one
# more cross-GPU round trip; two of them for the all-reduce) and moves data at ~86-90 % of the copy
# engine's peer bandwidth instead of 66-77 %.  It wins from a 256 MiB all-gather message (AG 512 MiB:
# 894 vs 932), a 64 MiB reduce-scatter one (RS 128 MiB: 281 vs 286; 1 GiB: 1607 vs 2102) and a
# 64 MiB all-reduce shard, i.e. a 128 MiB buffer on 2 ranks, where the all-reduce is one-shot on the
# copy engines (one round: AR 128 MiB 469 vs 471, 256 MiB 852 vs 945, 1 GiB 3024 vs 3629).
_CE_ENV = os.environ.get("MKERNEL_COLL_CE_MIN_BYTES")
CE_MIN_BYTES = ({op: int(_CE_ENV) for op in ("all_gather", "reduce_scatter", "all_reduce")} if _CE_ENV else
                {"all_gather": 256 << 20, "reduce_scatter": 64 << 20, "all_reduce": 64 << 20})
CE_BLOCKS = int(os.environ.get("MKERNEL_COLL_CE_BLOCKS", 0))  # receiving blocks; 0: all SMs but one
# All-reduce on the copy engines with at most this many local ranks: one-shot (every rank pushes its
# whole buffer, every rank reduces it all: one copy-engine round; the same bytes per link direction
# as reduce-scatter + all-gather when P = 2, more above).
CE_ONE_SHOT_MAX_RANKS = 2


def use_copy_engines(op: str, message_bytes: int, local_size: int) -> bool:
    """Whether collective ``op`` moving ``message_bytes`` per peer goes through the copy engines.
    ``MKERNEL_COLL_CE``: ``1`` always (two or more local ranks), ``0`` never, unset/``auto``: from
    CE_MIN_BYTES[op] up.  Every rank must decide alike (the choice is part of the agreed signature)."""
    if local_size < 2:
        return False
    v = os.environ.get("MKERNEL_COLL_CE", "auto").strip().lower()
    if v in ("", "auto"):
        return message_bytes >= CE_MIN_BYTES[op]
    if v in ("0", "1"):
        return v == "1"
    raise ValueError(f"mkernel: MKERNEL_COLL_CE must be auto, 0 or 1, got {v!r}")


def copy_engine_path(op: str, x_nbytes: int, itemsize: int, local_size: int) -> bool:
    """Whether ``op`` with an input ``x`` of ``x_nbytes`` (elements of ``itemsize`` bytes) on one node of
    ``local_size`` ranks runs on the copy engines: the per-peer message (AG: x, RS: one rank's share
    of x, AR: one shard) from CE_MIN_BYTES[op] up; never a one-shot SM all-reduce."""
    P = local_size
    if op == "all_gather":
        return use_copy_engines(op, x_nbytes, P)
    if op == "reduce_scatter":
        return use_copy_engines(op, x_nbytes // max(P, 1), P)
    if x_nbytes <= one_shot_max_bytes(P) or P == 1:
        return False
    return use_copy_engines(op, _shard(x_nbytes // itemsize, P, itemsize) * itemsize, P)


def _shard(n: int, P: int, itemsize: int) -> int:
    """Elements per rank of a two-phase all-reduce of n elements (16-byte multiples)."""
    return round_up(-(-n // P), 16 // itemsize)


# The last chunk of a copy-engine slot goes in this many pieces (each its own copy and flag): the
# receivers' local work on the last piece is all that is left exposed after the copy engines finish.
CE_TAIL_PIECES = min(int(os.environ.get("MKERNEL_COLL_CE_TAIL_PIECES", 4)), MAX_CHUNKS // 2)


def plan_ce_chunks(slot_bytes: int) -> tuple[int, int, int]:
    """(chunk_bytes, nchunks, tail_pieces) of a copy-engine slot: at most CE_MAX_CHUNKS chunks of at
    least CE_MIN_CHUNK bytes (4 KiB multiples), the last one cut into ``tail_pieces`` pieces (see
    ``ce_chunk``; 0: not cut); ``nchunks`` counts the pieces (one flag each)."""
    slot_bytes = max(slot_bytes, 16)
    chunk = round_up(max(CE_MIN_CHUNK, -(-slot_bytes // CE_MAX_CHUNKS)), 4096)
    n = -(-slot_bytes // chunk)
    pieces = CE_TAIL_PIECES if CE_TAIL_PIECES > 1 and chunk >= CE_TAIL_PIECES * 4096 else 0
    return chunk, n - 1 + max(pieces, 1), pieces


def ce_chunk(L: "CollLayout", nbytes: int, c: int) -> tuple[int, int]:
    """(offset, length) of chunk ``c`` of a ``nbytes`` message in a copy-engine slot (collectives.cu
    ``ce_chunk``, the same formula): chunks of ``chunk_bytes``, except that with ``tail_pieces`` = T > 0
    the last T indices cut the last chunk into pieces of ``round_up(chunk_bytes / T, 4 KiB)``."""
    T = L.tail_pieces
    full = L.nchunks - T if T else L.nchunks
    if T and c >= full:
        piece = round_up(-(-L.chunk_bytes // T), 4096)
        off = full * L.chunk_bytes + (c - full) * piece
        size = piece
    else:
        off, size = c * L.chunk_bytes, L.chunk_bytes
    return off, max(0, min(size, nbytes - off))


@functools.lru_cache(maxsize=1024)
def _ce_layout(P: int, slot_bytes: int, phases: int) -> tuple[CollLayout, int]:
    """(layout, workspace bytes) of the copy-engine path (the kernel path's layout, CE chunks)."""
    slot_bytes = round_up(max(slot_bytes, 16), 4096)
    chunk, nchunks, pieces = plan_ce_chunks(slot_bytes)
    L, total = _workspace_layout(P, slot_bytes, chunk, nchunks, phases)
    L.tail_pieces = pieces
    return L, total


def _direct_key(direct) -> tuple:
    """The signature part of a zero-copy all-gather: every rank's ``out`` must be the same rows of the
    same symmetric buffer (or none a symmetric one)."""
    if direct is None:
        return ()
    buf, off = direct
    return (f"symmetric out: buffer #{buf.seq} at byte {off}",)


def _ce_pushes(ws, L: CollLayout, P: int, me: int, phase: int, src_of, bytes_of, sent_flags: bool = False,
               chunk_major: bool = False, dst_of=None) -> list:
    """The side stream's copies of one phase: for each peer (rank-rotated, me+1 first) and chunk, the
    data into the peer's slot[phase][me], then the call number into its ready[phase][me][chunk].
    Peer-major (every chunk to me+1, then to me+2, ...) for gathers, whose receivers take one source
    after another; chunk_major (chunk 0 to every peer, then chunk 1, ...) for reductions, whose
    receivers need chunk c from every peer before they can reduce it (with 2 ranks both orders are
    the same).  sent_flags: after every peer got chunk c, the call number into our own
    ready[phase][me][c] too (an in-place one-shot all-reduce waits for it before overwriting its input).
    ``dst_of(dst)``: where the data for rank ``dst`` goes, as mapped here (default: its slot for us;
    a zero-copy all-gather: our rows of its symmetric ``out``)."""
    value = cu.CUdeviceptr(ws.ptr + CE_VALUE_OFF)
    base = L.data1_off if phase else L.data0_off

    def flag(owner, c):
        return cu.CUdeviceptr(ws.peer_ptr(owner, L.flags_off + 8 * ((phase * P + me) * L.flag_stride + c)))
    pairs = [(j, c) for c in range(L.nchunks) for j in range(1, P)] if chunk_major else \
        [(j, c) for j in range(1, P) for c in range(L.nchunks)]
    out = []
    last_of_chunk = {c: i for i, (_, c) in enumerate(pairs)}  # the chunk's last push in this order
    for i, (j, c) in enumerate(pairs):
        dst = (me + j) % P
        off, n = ce_chunk(L, bytes_of(dst), c)
        if n:
            to = dst_of(dst) if dst_of is not None else ws.peer_ptr(dst, base + me * L.slot_bytes)
            out.append((cu.CUdeviceptr(to + off), cu.CUdeviceptr(src_of(dst) + off), n))
        out.append((flag(dst, c), value, 8))
        if sent_flags and i == last_of_chunk[c]:
            out.append((flag(me, c), value, 8))
    return out


def _ce_run(ctx, op: str, dtype, message_bytes: int, phases: int, x: DeviceArray, o: DeviceArray,
            count: int, shard: int, stream, sig: int, direct=None) -> None:
    """One copy-engine collective call (bound once per buffers and sizes, then replayed).  ``direct``:
    ``(symmetric buffer, offset)`` of an all-gather's ``out`` (every rank's, agreed): zero-copy."""
    P = ctx.local_size
    L, total = _ce_layout(P, message_bytes, phases)
    ws = ctx.workspace(("collective_ce", op), total, stream, f"mkernel.{op}")
    bindings = ctx.__dict__.setdefault("_ce_bindings", {})
    key = (op, dtype.code, x.ptr, o.ptr, count, shard, ws.ptr, ws.nbytes, sig,
           None if direct is None else (direct[0].seq, direct[1]))
    run = bindings.get(key)
    if run is None:
        if len(bindings) >= 256:
            bindings.clear()
        if direct is not None:
            L = CollLayout.from_buffer_copy(L)  # (the cached layout stays as it is)
            L.direct = 1
        run = bindings[key] = _ce_bind(ctx, op, dtype, L, ws, x, o, count, shard, sig, direct)
    run(stream)


def _ce_bind(ctx, op: str, dtype, L: CollLayout, ws, x: DeviceArray, o: DeviceArray, count: int, shard: int,
             sig: int, direct=None):
    P, me = ctx.local_size, ctx.local_rank
    isz = dtype.itemsize
    comm = ctx.comm_args(op, sig)
    begin = _kernel(ctx, "coll_ce_begin", dtype, threads=32)
    kern = _kernel(ctx, op + "_ce", dtype)
    grid = max(1, min(ctx.sm_count - 1, CE_BLOCKS or ctx.sm_count))
    head = [comm, ctypes.c_uint64(x.ptr), ctypes.c_uint64(o.ptr)]
    tail = [ctypes.c_uint64(ws.ptr), ctypes.c_uint64(ws.peer_table), L]
    later = None  # all-reduce: (copies, args) of phase 1
    if op == "all_gather":
        dst_of = None if direct is None else (lambda d: direct[0].peer_ptr(d, direct[1] + me * x.nbytes))
        pushes = _ce_pushes(ws, L, P, me, 0, lambda d: x.ptr, lambda d: x.nbytes, dst_of=dst_of)
        args = head + [ctypes.c_uint64(x.nbytes)] + tail
    elif op == "reduce_scatter":
        pushes = _ce_pushes(ws, L, P, me, 0, lambda d: x.ptr + d * count * isz, lambda d: count * isz,
                            chunk_major=True)
        args = head + [ctypes.c_uint64(count)] + tail
    elif shard == count:  # one-shot all-reduce: the whole buffer to every peer, reduced everywhere
        pushes = _ce_pushes(ws, L, P, me, 0, lambda d: x.ptr, lambda d: count * isz, sent_flags=x.ptr == o.ptr,
                            chunk_major=True)
        args = head + [ctypes.c_uint64(count), ctypes.c_uint64(count), ctypes.c_int32(2)] + tail
    else:  # all_reduce: reduce-scatter of shards, then the owners' shards to every peer
        def shard_bytes(r):
            return max(0, min(shard, count - r * shard)) * isz
        pushes = _ce_pushes(ws, L, P, me, 0, lambda d: x.ptr + d * shard * isz, shard_bytes, chunk_major=True)
        args = head + [ctypes.c_uint64(count), ctypes.c_uint64(shard), ctypes.c_int32(0)] + tail
        later = (_ce_pushes(ws, L, P, me, 1, lambda d: o.ptr + me * shard * isz, lambda d: shard_bytes(me)),
                 head + [ctypes.c_uint64(count), ctypes.c_uint64(shard), ctypes.c_int32(1)] + tail)
    bargs = [comm, ctypes.c_uint64(ws.ptr), ctypes.c_uint64(ws.peer_table), L]
    fork = ForkedCopies(ctx.side_stream())

    def start(side):
        begin.launch(1, 32, bargs, stream=side)

    def run(stream, _keep=(fork, ws, direct)):
        s = cu.CUstream(stream_handle(stream))
        fork.fork(s, start)
        fork.copies(pushes)
        kern.launch(grid, _THREADS, args, stream=stream)
        if later is not None:
            fork.resume(s)
            fork.copies(later[0])
            kern.launch(grid, _THREADS, later[1], stream=stream)
        fork.join(s)
    return run


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
    Zero-copy: when ``out`` is the same view of a symmetric buffer on every rank
    (``ctx.alloc_symmetric(nbytes).array(shape, dtype, offset)``) and the call takes the copy-engine
    path (large messages), the peers' copy engines write straight into it (no staging, no local copy).
    Returns ``out``.
    """
    what = "mkernel.all_gather"
    key = _fast_key(ctx, "all_gather", x, out, stream)
    if _fast_run(ctx, key):
        return out
    ctx.check()
    x = _arg(ctx, x, what, "x", _GATHER_DTYPES, stream)
    out, o = _out(ctx, out, what, (ctx.size * (x.shape[0] if x.ndim else 1),) + tuple(x.shape[1:]), x,
                  _GATHER_DTYPES, stream)
    if _overlaps(x, o) and x.ptr != o.ptr + ctx.rank * x.nbytes:
        raise ValueError(f"{what}: x overlaps out but is not this rank's own rows of out")
    ce = ctx.num_nodes == 1 and copy_engine_path("all_gather", x.nbytes, x.dtype.itemsize, ctx.local_size)
    direct = ctx.symmetric_region(o.ptr, o.nbytes) if ce else None
    sig = ctx.agree(what, (x.dtype.name, tuple(x.shape), ce) + _direct_key(direct), ctx.world)
    if x.nbytes == 0:
        return out
    if ctx.num_nodes > 1:
        internode.all_gather(ctx, x, o, stream)
        return out
    if ce:
        _ce_run(ctx, "all_gather", _BYTES, x.nbytes, 1, x, o, x.nbytes, 0, stream, sig, direct)
        return out
    # byte-oriented: one kernel for every dtype
    fast_put(ctx, key, _launch(ctx, "all_gather", _BYTES, x.nbytes, 1,
                                [ctypes.c_uint64(x.ptr), ctypes.c_uint64(o.ptr), ctypes.c_uint64(x.nbytes)],
                                stream, sig))
    return out


def reduce_scatter(ctx, x, out=None, *, stream=None):
    """Sum ``x`` over local ranks and scatter: ``out`` on local rank j = sum_r x_r[j*n:(j+1)*n].

    ``x``: ``[size * n, ...]``; ``out``: ``[n, ...]`` (allocated when None), must not overlap
    ``x``.  bf16/fp16/fp32, fp32 accumulation.  Returns ``out``.
    """
    what = "mkernel.reduce_scatter"
    key = _fast_key(ctx, "reduce_scatter", x, out, stream)
    if _fast_run(ctx, key):
        return out
    ctx.check()
    x = _arg(ctx, x, what, "x", _REDUCE_DTYPES, stream)
    P = ctx.size
    if x.ndim == 0 or x.shape[0] % P:
        raise ValueError(f"{what}: x's first dimension ({x.shape[0] if x.ndim else 'scalar'}) must be a multiple "
                         f"of the number of ranks ({P})")
    out, o = _out(ctx, out, what, (x.shape[0] // P,) + tuple(x.shape[1:]), x, _REDUCE_DTYPES, stream)
    if _overlaps(x, o):
        raise ValueError(f"{what}: out must not overlap x")
    ce = ctx.num_nodes == 1 and copy_engine_path("reduce_scatter", x.nbytes, x.dtype.itemsize, ctx.local_size)
    sig = ctx.agree(what, (x.dtype.name, tuple(x.shape), ce), ctx.world)
    if o.size == 0:
        return out
    if ctx.num_nodes > 1:
        internode.reduce_scatter(ctx, x, o, stream)
        return out
    if ce:
        _ce_run(ctx, "reduce_scatter", x.dtype, o.nbytes, 1, x, o, o.size, 0, stream, sig)
        return out
    fast_put(ctx, key, _launch(ctx, "reduce_scatter", x.dtype, o.nbytes, 1,
                                [ctypes.c_uint64(x.ptr), ctypes.c_uint64(o.ptr), ctypes.c_uint64(o.size)], stream, sig))
    return out


def all_reduce(ctx, x, out=None, *, stream=None):
    """Sum ``x`` over local ranks into ``out`` (same shape; allocated when None; may be ``x`` itself).

    bf16/fp16/fp32, fp32 accumulation.  Up to ``one_shot_max_bytes(P)`` every rank reduces the whole
    array itself (one hop); above, reduce-scatter + all-gather inside one kernel; large buffers go
    through the copy engines (``CE_MIN_BYTES``; one-shot there too with 2 ranks).  Every rank gets
    bit-identical results.  Returns ``out``.
    """
    what = "mkernel.all_reduce"
    key = _fast_key(ctx, "all_reduce", x, out, stream)
    if _fast_run(ctx, key):
        return out
    ctx.check()
    x = _arg(ctx, x, what, "x", _REDUCE_DTYPES, stream)
    out, o = _out(ctx, out, what, tuple(x.shape), x, _REDUCE_DTYPES, stream)
    if _overlaps(x, o) and x.ptr != o.ptr:
        raise ValueError(f"{what}: out overlaps x without being x")
    n = x.size
    P = ctx.local_size
    one_shot = x.nbytes <= one_shot_max_bytes(P) or P == 1
    shard = n if one_shot else _shard(n, P, x.dtype.itemsize)
    ce = ctx.num_nodes == 1 and copy_engine_path("all_reduce", x.nbytes, x.dtype.itemsize, P)
    sig = ctx.agree(what, (x.dtype.name, tuple(x.shape), ce), ctx.world)
    if n == 0:
        return out
    if ctx.num_nodes > 1:
        internode.all_reduce(ctx, x, o, stream)
        return out
    if ce:
        if P <= CE_ONE_SHOT_MAX_RANKS:
            _ce_run(ctx, "all_reduce", x.dtype, x.nbytes, 1, x, o, n, n, stream, sig)
        else:
            _ce_run(ctx, "all_reduce", x.dtype, shard * x.dtype.itemsize, 2, x, o, n, shard, stream, sig)
        return out
    fast_put(ctx, key, _launch(ctx, "all_reduce", x.dtype, shard * x.dtype.itemsize, 1 if one_shot else 2,
                                [ctypes.c_uint64(x.ptr), ctypes.c_uint64(o.ptr), ctypes.c_uint64(n),
                                 ctypes.c_uint64(shard), ctypes.c_int32(1 if one_shot else 0)], stream, sig))
    return out
