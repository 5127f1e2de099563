"""GPU-driven collectives over NVLink: all-gather, reduce-scatter, all-reduce (sum), on the op pipeline.

Each call is one persistent kernel (``cuda_src/ops/collectives.cu``) launched on the caller's stream;
no host synchronization between calls (per-call epochs live on the device), so calls can be captured
in a CUDA graph and replayed.  Every device-side wait is bounded by the context timeout; a dead peer
turns into :class:`mkernel.CommTimeout` at the next :meth:`Context.check` / ``synchronize``.

All ranks of the context's communicator take part.  On one node (``ctx.num_nodes == 1``) the
kernels move data over NVLink only: SM stores, or the copy engines for large messages
(:class:`CollectiveOptions`); across nodes (real, or emulated with ``MKERNEL_RANKS_PER_NODE``)
:mod:`.internode` runs the hierarchical versions (NVLink inside a node, the CPU proxy across nodes).
bf16 / fp16 / fp32 (reductions accumulate in fp32); all-gather also takes int32 / int64.  Inputs and
outputs are any CUDA arrays (``__cuda_array_interface__`` / DLPack / torch tensors), C-contiguous, on
the context's GPU; they need not be symmetric memory: each op owns a symmetric workspace, allocated on
first use and grown when a larger call comes.  The first call of a layout checks across ranks that
every rank makes the same call; later calls re-point its bound launch at the new arrays.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

from cuda.bindings import driver as cu

from ...core.arrays import DeviceArray
from ...core.compiler import kernel, register_specialization
from ...core.dtypes import dtype_of
from ...core.interop import as_device_array, require
from ...dist.sidestream import ForkedCopies
from ..base import BoundCall, Op, as_stream
from . import internode
from .layout import (CE_ONE_SHOT_MAX_RANKS, CE_VALUE_OFF, CollLayout, ce_chunk, ce_layout, copy_engine_path,
                     one_shot, shard_elems, sm_layout)
from .options import CollectiveOptions

__all__ = ["all_gather", "reduce_scatter", "all_reduce", "CollPlan"]

SOURCE = "ops/collectives.cu"
THREADS = 512
REDUCE_DTYPES = tuple(dtype_of(d) for d in ("bfloat16", "float16", "float32"))
GATHER_DTYPES = tuple(dtype_of(d) for d in ("bfloat16", "float16", "float32", "int32", "int64"))
_BYTES = dtype_of("bfloat16")  # the all-gather kernel moves bytes: one specialization for every dtype

for _code in (0, 1, 2):
    register_specialization(SOURCE, {"MK_DTYPE": _code})


@dataclass(frozen=True)
class CollPlan:
    """What a collective call runs: ``path`` is "sm" (SM stores over NVLink), "ce" (copy engines),
    "internode" (NVLink + proxy) or "empty" (nothing to move); ``one_shot``: an all-reduce reduced in
    full by every rank; ``grid``: blocks of the (receiving) kernel; ``chunks``: flags per peer slot;
    ``zero_copy``: an all-gather whose peers write straight into a symmetric ``out``.  The rest is the
    bound call's: the call's digest, the workspace layout and size, element counts."""

    op: str
    path: str
    one_shot: bool = False
    grid: int = 0
    chunks: int = 0
    zero_copy: bool = False
    digest: int = field(default=0, repr=False)
    layout: CollLayout | None = field(default=None, repr=False, compare=False)
    ws_bytes: int = field(default=0, repr=False)
    count: int = field(default=0, repr=False)
    shard: int = field(default=0, repr=False)
    sm_args: tuple = field(default=(), repr=False)


class _Call:
    __slots__ = ("key", "stream", "x", "o", "options", "ce", "direct")


def _overlaps(a: DeviceArray, b: DeviceArray) -> bool:
    return a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes


def _residency_checked(ctx, op: str, dtype, threads: int = THREADS):
    """The kernel of ``op`` for ``dtype``, checked once per context to fit one block per SM (cooperative
    launches need every block resident)."""
    k = kernel(SOURCE, {"MK_DTYPE": dtype.code}, "mk_" + op)
    seen = ctx.op_state("collectives").data.setdefault("resident", set())
    if (op, dtype.code) not in seen:
        if k.max_active_blocks_per_sm(threads) < 1:
            raise RuntimeError(f"mkernel: the {op} kernel cannot be resident")
        seen.add((op, dtype.code))
    return k


class _SmBound(BoundCall):
    """The SM-path kernel, prepared once; each call sets the two array pointers and submits."""

    def __init__(self, plan, launch, x_arg, o_arg, keep):
        self.plan, self._launch, self._x, self._o, self._keep = plan, launch, x_arg, o_arg, keep

    def run(self, stream, call):
        self._x.value = call.x.ptr
        self._o.value = call.o.ptr
        self._launch.submit()


class _FnBound(BoundCall):
    """A bound call that is a function of the call (internode, empty)."""

    def __init__(self, plan, fn):
        self.plan, self._fn = plan, fn

    def run(self, stream, call):
        self._fn(stream, call)


class _CeBound(BoundCall):
    """The copy-engine path: a begin kernel and the copies on the context's side stream, the receiving
    kernel(s) on the caller's stream, joined back.  The copy lists depend on the arrays' addresses:
    rebuilt when they change."""

    def __init__(self, plan: CollPlan, ctx, dtype, ws, direct):
        L = plan.layout
        self.plan = plan
        self._ctx, self._op, self._L, self._ws, self._count, self._shard = ctx, plan.op, L, ws, plan.count, plan.shard
        self._direct = direct
        P = ctx.local_size
        self._comm = ctx.comm_args(plan.op, plan.digest)
        self._begin = _residency_checked(ctx, "coll_ce_begin", dtype, threads=32)
        self._kern = _residency_checked(ctx, plan.op + "_ce", dtype)
        self._grid = plan.grid
        self._fork = ForkedCopies(ctx.side_stream())
        self._bargs = [self._comm, ctypes.c_uint64(ws.ptr), ctypes.c_uint64(ws.peer_table), L]
        self._x, self._o = ctypes.c_uint64(0), ctypes.c_uint64(0)
        self._tail = [ctypes.c_uint64(ws.ptr), ctypes.c_uint64(ws.peer_table), L]
        self._isz = dtype.itemsize
        self._ptrs = None
        self._P = P

    def _lists(self, x: DeviceArray, o: DeviceArray):
        """(pushes, kernel args, later) for these arrays: ``later`` = (copies, args) of the all-reduce's
        second phase, or None."""
        P, me, isz, L, ws = self._P, self._ctx.local_rank, self._isz, self._L, self._ws
        count, shard, op, direct = self._count, self._shard, self._op, self._direct
        head = [self._comm, self._x, self._o]
        later = None
        if op == "all_gather":
            dst_of = None if direct is None else (lambda d: direct[0].peer_ptr(d, direct[1] + me * x.nbytes))
            pushes = _ce_pushes(ws, L, P, me, 0, lambda d: x.ptr, lambda d: x.nbytes, dst_of=dst_of)
            args = head + [ctypes.c_uint64(x.nbytes)] + self._tail
        elif op == "reduce_scatter":
            pushes = _ce_pushes(ws, L, P, me, 0, lambda d: x.ptr + d * count * isz, lambda d: count * isz,
                                chunk_major=True)
            args = head + [ctypes.c_uint64(count)] + self._tail
        elif shard == count:  # one-shot all-reduce: the whole buffer to every peer, reduced everywhere
            pushes = _ce_pushes(ws, L, P, me, 0, lambda d: x.ptr, lambda d: count * isz, sent_flags=x.ptr == o.ptr,
                                chunk_major=True)
            args = head + [ctypes.c_uint64(count), ctypes.c_uint64(count), ctypes.c_int32(2)] + self._tail
        else:  # two-phase all-reduce: reduce-scatter of shards, then the owners' shards to every peer
            def shard_bytes(r):
                return max(0, min(shard, count - r * shard)) * isz
            pushes = _ce_pushes(ws, L, P, me, 0, lambda d: x.ptr + d * shard * isz, shard_bytes, chunk_major=True)
            args = head + [ctypes.c_uint64(count), ctypes.c_uint64(shard), ctypes.c_int32(0)] + self._tail
            later = (_ce_pushes(ws, L, P, me, 1, lambda d: o.ptr + me * shard * isz, lambda d: shard_bytes(me)),
                     head + [ctypes.c_uint64(count), ctypes.c_uint64(shard), ctypes.c_int32(1)] + self._tail)
        return pushes, args, later

    def run(self, stream, call):
        x, o = call.x, call.o
        if self._ptrs != (x.ptr, o.ptr):
            self._x.value, self._o.value = x.ptr, o.ptr
            self._lists_now = self._lists(x, o)
            self._ptrs = (x.ptr, o.ptr)
        pushes, args, later = self._lists_now
        s = cu.CUstream(stream)
        begin, bargs = self._begin, self._bargs
        self._fork.fork(s, lambda side: begin.launch(1, 32, bargs, stream=side))
        self._fork.copies(pushes)
        self._kern.launch(self._grid, THREADS, args, stream=stream)
        if later is not None:
            self._fork.resume(s)
            self._fork.copies(later[0])
            self._kern.launch(self._grid, THREADS, later[1], stream=stream)
        self._fork.join(s)


def _ce_pushes(ws, L: CollLayout, P: int, me: int, phase: int, src_of, bytes_of, sent_flags: bool = False,
               chunk_major: bool = False, dst_of=None) -> list:
    """The side stream's copies of one phase: for each peer (rank-rotated, me+1 first) and chunk, the
    data into the peer's slot[phase][me], then the call number into its ready[phase][me][chunk].
    Peer-major for gathers (receivers take one source after another), chunk-major for reductions
    (a receiver needs chunk c from every peer before it can reduce it).  ``sent_flags``: after every
    peer got chunk c, the call number into our own ready[phase][me][c] too (an in-place one-shot
    all-reduce waits for it before overwriting its input).  ``dst_of(dst)``: where rank ``dst``'s data
    goes, as mapped here (default: its slot for us; a zero-copy all-gather: our rows of its ``out``)."""
    value = cu.CUdeviceptr(ws.ptr + CE_VALUE_OFF)
    base = L.data1_off if phase else L.data0_off

    def flag(owner, c):
        return cu.CUdeviceptr(ws.peer_ptr(owner, L.flags_off + 8 * ((phase * P + me) * L.flag_stride + c)))
    pairs = [(j, c) for c in range(L.nchunks) for j in range(1, P)] if chunk_major else \
        [(j, c) for j in range(1, P) for c in range(L.nchunks)]
    out = []
    last_of_chunk = {c: i for i, (_, c) in enumerate(pairs)}
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


class _Collective(Op):
    """The three collectives share one pipeline; subclasses say what they move."""

    dtypes = REDUCE_DTYPES

    def __init__(self, name: str):
        self.name = name
        self.what = "mkernel." + name

    # ---- per call -------------------------------------------------------------------------------
    def __call__(self, ctx, x, out, stream, options):
        ctx.check()
        s = as_stream(stream)
        opts = CollectiveOptions.default() if options is None else options
        X = as_device_array(x, name=f"{self.what}: x", stream=s)
        if out is None:
            O = DeviceArray.empty(self.out_shape(ctx, X), X.dtype, device=ctx.device)
            result = O
        else:
            O = as_device_array(out, name=f"{self.what}: out", stream=s)
            result = out
        isz = X.dtype.itemsize
        for a, nm in ((X, "x"), (O, "out")):
            if a.ptr % isz:
                raise ValueError(f"{self.what}: {nm} must be {isz}-byte aligned, got ptr 0x{a.ptr:x}")
        inplace = self.check_overlap(ctx, X, O)
        call = _Call()
        call.stream, call.x, call.o, call.options = s, X, O, opts
        call.ce = ctx.num_nodes == 1 and copy_engine_path(self.name, X.nbytes, isz, ctx.local_size, opts)
        call.direct = self.direct(ctx, call)
        call.key = (X.shape, X.strides, X.dtype, X.device, O.shape, O.strides, O.dtype, O.device, O.readonly,
                    inplace, s, opts, call.direct and (call.direct[0].seq, call.direct[1]), ctx._ws_gen)
        self.invoke(ctx.op_state(self.name), call, ctx)
        return result

    def out_shape(self, ctx, X) -> tuple:
        return tuple(X.shape)

    def check_overlap(self, ctx, X, O) -> bool:
        """Raise for an overlap the op does not allow; True when the call is in place."""
        if _overlaps(X, O) and X.ptr != O.ptr:
            raise ValueError(f"{self.what}: out overlaps x without being x")
        return X.ptr == O.ptr and X.nbytes > 0

    def direct(self, ctx, call):
        return None

    # ---- first call of a layout ----------------------------------------------------------------
    def validate(self, ctx, call):
        if call.options is not CollectiveOptions.default():
            if not isinstance(call.options, CollectiveOptions):
                raise TypeError(f"{self.what}: options must be a CollectiveOptions, got {type(call.options).__name__}")
            call.options.checked()
        require(call.x, f"{self.what}: x", dtypes=self.dtypes, device=ctx.device)
        require(call.o, f"{self.what}: out", dtypes=self.dtypes, device=ctx.device, writable=True)
        X, O = call.x, call.o
        shape = self.out_shape(ctx, X)
        if O.dtype != X.dtype or tuple(O.shape) != shape:
            raise ValueError(f"{self.what}: out must be {X.dtype.name} {shape}, got {O.dtype.name} {tuple(O.shape)}")

    def compile(self, ctx, call):
        if call.x.size and call.o.size and ctx.num_nodes > 1:
            internode.compile_for(self.name, call.x.dtype)
        elif call.x.size and call.o.size:
            dt = self.sizes(ctx, call)[0]
            if call.ce:
                _residency_checked(ctx, "coll_ce_begin", dt, threads=32)
                _residency_checked(ctx, self.name + "_ce", dt)
            else:
                _residency_checked(ctx, self.name, dt)

    def agree(self, ctx, call):
        X = call.x
        extra = () if call.direct is None else (f"symmetric out: buffer #{call.direct[0].seq} at byte {call.direct[1]}",)
        return ctx.agree(self.what, (X.dtype.name, tuple(X.shape), call.ce) + extra, ctx.world)

    def sizes(self, ctx, call) -> tuple:
        """(kernel dtype, count, shard, one_shot, SM slot bytes, SM phases, SM tail args, CE message bytes,
        CE phases) of this op's call."""
        raise NotImplementedError

    def describe_call(self, call):
        return f"{call.x.dtype.name}{list(call.x.shape)} -> {list(call.o.shape)}"

    def plan(self, ctx, call, digest):
        X, O = call.x, call.o
        if O.size == 0 or X.size == 0:
            return CollPlan(self.name, "empty")
        if ctx.num_nodes > 1:
            return CollPlan(self.name, "internode", digest=digest)
        opts = call.options
        dt, count, shard, os_, slot, phases, tail, ce_bytes, ce_phases = self.sizes(ctx, call)
        if call.ce:
            L, total = ce_layout(ctx.local_size, ce_bytes, ce_phases, opts.ce_max_chunks, opts.ce_tail_pieces)
            if call.direct is not None:
                L = CollLayout.from_buffer_copy(L)  # (the cached layout stays as it is)
                L.direct = 1
            # receiving blocks: all SMs but one (the begin kernel always finds one)
            grid = max(1, min(ctx.resident_sms - 1, opts.ce_blocks or ctx.resident_sms))
            return CollPlan(self.name, "ce", os_, grid, L.nchunks, call.direct is not None, digest, L, total,
                            count, shard)
        grid_max = min(ctx.resident_sms, opts.max_blocks) if opts.max_blocks > 0 else ctx.resident_sms
        L, total, grid = sm_layout(ctx.local_size, slot, grid_max, phases, opts.min_chunk)
        return CollPlan(self.name, "sm", os_, grid, L.nchunks, False, digest, L, total, count, shard, tuple(tail))

    def bind(self, ctx, call, plan: CollPlan) -> BoundCall:
        if plan.path == "empty":
            return _FnBound(plan, lambda stream, c: None)
        if plan.path == "internode":
            fn = getattr(internode, self.name)
            return _FnBound(plan, lambda stream, c: fn(ctx, c.x, c.o, stream, plan.digest))
        dt = self.sizes(ctx, call)[0]
        if plan.path == "ce":
            ws = ctx.workspace(("collective_ce", self.name), plan.ws_bytes, call.stream, self.what)
            return _CeBound(plan, ctx, dt, ws, call.direct)
        ws = ctx.workspace(("collective", self.name), plan.ws_bytes, call.stream, self.what)
        k = _residency_checked(ctx, self.name, dt)
        xa, oa = ctypes.c_uint64(call.x.ptr), ctypes.c_uint64(call.o.ptr)
        # (the kernels take u64 sizes; the all-reduce's third value is its int one-shot flag)
        tail = [ctypes.c_int32(v) if i == 2 else ctypes.c_uint64(v) for i, v in enumerate(plan.sm_args)]
        args = [ctx.comm_args(self.name, plan.digest), xa, oa, *tail, ctypes.c_uint64(ws.ptr),
                ctypes.c_uint64(ws.peer_table), plan.layout]
        launch = k.prepare(plan.grid, THREADS, args, stream=call.stream, cooperative=True)
        return _SmBound(plan, launch, xa, oa, (ws,))


class _AllGather(_Collective):
    dtypes = GATHER_DTYPES

    def out_shape(self, ctx, X):
        return (ctx.size * (X.shape[0] if X.ndim else 1),) + tuple(X.shape[1:])

    def check_overlap(self, ctx, X, O):
        own = O.ptr + ctx.rank * X.nbytes
        if _overlaps(X, O) and X.ptr != own:
            raise ValueError(f"{self.what}: x overlaps out but is not this rank's own rows of out")
        return X.ptr == own and X.nbytes > 0

    def direct(self, ctx, call):
        return ctx.symmetric_region(call.o.ptr, call.o.nbytes) if call.ce else None

    def sizes(self, ctx, call):
        nb = call.x.nbytes  # (bytes: one kernel for every dtype)
        return _BYTES, nb, 0, False, nb, 1, (nb,), nb, 1


class _ReduceScatter(_Collective):
    def out_shape(self, ctx, X):
        P = ctx.size
        if X.ndim == 0 or X.shape[0] % P:
            raise ValueError(f"{self.what}: x's first dimension ({X.shape[0] if X.ndim else 'scalar'}) must be a "
                             f"multiple of the number of ranks ({P})")
        return (X.shape[0] // P,) + tuple(X.shape[1:])

    def check_overlap(self, ctx, X, O):
        if _overlaps(X, O):
            raise ValueError(f"{self.what}: out must not overlap x")
        return False

    def sizes(self, ctx, call):
        O = call.o
        return call.x.dtype, O.size, 0, False, O.nbytes, 1, (O.size,), O.nbytes, 1


class _AllReduce(_Collective):
    def sizes(self, ctx, call):
        X = call.x
        n, P, isz = X.size, ctx.local_size, X.dtype.itemsize
        if call.ce:
            if P <= CE_ONE_SHOT_MAX_RANKS:
                return X.dtype, n, n, True, 0, 0, (), X.nbytes, 1
            shard = shard_elems(n, P, isz)
            return X.dtype, n, shard, False, 0, 0, (), shard * isz, 2
        os_ = one_shot(X.nbytes, P, call.options)
        shard = n if os_ else shard_elems(n, P, isz)
        return X.dtype, n, shard, os_, shard * isz, 1 if os_ else 2, (n, shard, 1 if os_ else 0), 0, 0


_ALL_GATHER = _AllGather("all_gather")
_REDUCE_SCATTER = _ReduceScatter("reduce_scatter")
_ALL_REDUCE = _AllReduce("all_reduce")


def all_gather(ctx, x, out=None, *, stream=None, options: CollectiveOptions | None = None):
    """Gather ``x`` from every rank: ``out`` = concatenation over ranks along axis 0.

    ``x``: ``[n, ...]`` on every rank (same shape and dtype everywhere; bf16, fp16, fp32, int32, int64);
    ``out``: ``[size * n, ...]``, allocated (a :class:`~mkernel.DeviceArray`) when None; rank j's ``x``
    lands in rows ``[j*n, (j+1)*n)`` on every rank.  ``x`` may be this rank's own rows of ``out`` (in
    place).  Zero-copy: when ``out`` is the same view of a symmetric buffer on every rank
    (``ctx.alloc_symmetric(nbytes).array(shape, dtype, offset)``) and the call takes the copy-engine
    path, the peers' copy engines write straight into it.  ``stream``: any stream-like object or raw
    handle (None: the legacy default stream).  Returns ``out``."""
    return _ALL_GATHER(ctx, x, out, stream, options)


def reduce_scatter(ctx, x, out=None, *, stream=None, options: CollectiveOptions | None = None):
    """Sum ``x`` over ranks and scatter: ``out`` on rank j = sum over ranks r of ``x_r[j*n:(j+1)*n]``.

    ``x``: ``[size * n, ...]``; ``out``: ``[n, ...]`` (allocated when None), must not overlap ``x``.
    bf16 / fp16 / fp32, fp32 accumulation.  Returns ``out``."""
    return _REDUCE_SCATTER(ctx, x, out, stream, options)


def all_reduce(ctx, x, out=None, *, stream=None, options: CollectiveOptions | None = None):
    """Sum ``x`` over ranks into ``out`` (same shape; allocated when None; may be ``x`` itself).

    bf16 / fp16 / fp32, fp32 accumulation.  Small buffers are reduced in full by every rank (one flag
    hop), larger ones reduce-scattered then all-gathered inside one kernel, large ones carried by the
    copy engines (:class:`CollectiveOptions`).  Every rank gets bit-identical results.  Returns ``out``."""
    return _ALL_REDUCE(ctx, x, out, stream, options)
