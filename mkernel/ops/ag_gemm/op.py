"""AllGather + GEMM on the op pipeline (:mod:`mkernel.ops.base`): prepare -> key -> validate / compile /
agree (the local ranks' signatures exchanged) / plan / bind -> run.  docs/ag_gemm.md.

``ag_gemm(ctx, a_shard, b)``: local rank r holds the row shard ``A_r [M_r, K]`` and its weight shard
``B_r`` (``[K, N]`` for ``b_layout="kn"``, ``[N, K]`` for "nk"); every rank computes
``C_r = AllGather(A) @ B_r`` of shape ``[sum_j M_j, N]``, rows of rank j at row offset ``sum_{i<j} M_i``.
The ranks taking part are the ``ctx.local_size`` ranks of this node (NVLink).  Bound calls:

* "fused_ce" (:class:`_CeBound`): the GEMM kernel ``mk_ag_gemm_{kn,nk}`` (cuda_src/ops/ag_gemm.cu) on every SM,
  on the caller's stream; a side stream (``ctx.side_stream()``, forked and joined with events, so it is
  captured with the call in a CUDA graph) copies this rank's shard with the copy engines into the op's
  symmetric workspace (the gathered A) on every peer, in groups of chunks, each group followed by a
  copy-engine write of its ready flags.  The workers take the local rows first (read in place), then the
  rows of ranks me-1, me-2, ... (the order they arrive), and wait only for the chunks a tile needs.
* "fused" (:class:`_FusedBound`): one cooperative kernel whose first ``comm_sms`` blocks do the copies
  instead (same flags, same workers).
* "unfused" (:class:`_UnfusedBound`): a gather kernel (every SM copies, same protocol), then
  :func:`mkernel.gemm` on the gathered rows, then a one-block release kernel.
* "plain" (:class:`_PlainBound`: one local rank, or K = 0): :func:`mkernel.gemm` (+ a copy for
  ``gathered_a``); nothing at all when the gathered A has no row (:class:`_EmptyBound`).

Each call re-points the bound call at its arrays: the tensor maps of this rank's rows, of B (or B's
staging source) and of the output, the ``AgArgs`` pointer fields, and, on the copy-engine path, the copy
list's sources (rebuilt when ``a_shard`` moves).

The agreed signature: the first call with a new *local* signature (dtype, M_r, K, N, whether gathered_a
is given, m_sizes, b_layout, options) exchanges every local rank's values over the node communicator
(bounded by the context timeout) and keeps the result in ``ctx.op_state("ag_gemm").data``; the plan is a
pure function of the exchanged values, its digest travels in ``MkComm.sig`` and every kernel compares it
with its peers' on the device.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from cuda.bindings import driver as cu

from ...core.archs import require_gemm_device
from ...core.arrays import DeviceArray
from ...core.compiler import kernel, precompile_source
from ...core.driver import check
from ...core.interop import as_device_array
from ...core.streams import copy_async
from ...core.tensormap import TensorMapArg
from ...dist.sidestream import ForkedCopies
from ..base import BoundCall, Op, as_stream, check_no_overlap, checked_once
from ..gemm import gemm
from ..gemm.operands import vec_ok
from .. import gemm as G  # the GEMM package's public planning API
from .layout import (GATHER_THREADS, MAXP, RELEASE_THREADS, SOURCE, AgArgs, Layout, kernel_defines,
                     workspace_layout)
from .options import AgGemmOptions
from .planner import AgPlan, _fused_tiles, call_digest, ce_copy_groups, plan as make_plan, tile_config

__all__ = ["ag_gemm", "precompile", "Agreed", "ce_copies", "gathered_copies"]

OP = "ag_gemm"
WHAT = "mkernel.ag_gemm"
SIGS_MAX = 256  # agreed signatures kept per context (oldest dropped first)
_FORCE = {None: 0, "fused": 1, "unfused": 2, "fused_ce": 3}  # the path override in the exchanged signature


@dataclass(frozen=True)
class Agreed:
    """What the local ranks agreed on for one local signature: the plan, the workspace layout (None: no
    workspace -- one local rank, no row or K = 0), the row offsets of every local rank's shard, the digest
    the kernels compare (MkComm.sig), and the values the plan was made from: (m_sizes, N = the largest of
    the ranks' N, whether any rank wants the gathered A, "nk" if every rank's B is [N, K] else "kn")."""

    plan: AgPlan
    layout: Layout | None
    offs: tuple
    P: int
    digest: int
    inputs: tuple


# --------------------------------------------------------------------------------------------
# kernels (module attributes: the CPU tests replace them)
# --------------------------------------------------------------------------------------------
def _kernel(in_dtype: str, out_dtype: str, config: int, name: str):
    return kernel(SOURCE, kernel_defines(in_dtype, out_dtype, config), name)


def fused_kernel(ctx, in_dtype: str, out_dtype: str, config: int, b_layout: str):
    """The fused kernel, checked once per context to fit one block per SM (both fused paths need every
    block resident: "fused" launches cooperatively, "fused_ce" waits across blocks for arriving rows)."""
    k = _kernel(in_dtype, out_dtype, config, f"mk_ag_gemm_{b_layout}")
    seen = ctx.op_state(OP).data.setdefault("resident", set())
    key = (in_dtype, out_dtype, config, b_layout)
    if key not in seen:
        cfg = G.CONFIGS[config]
        if k.max_active_blocks_per_sm(cfg.threads, cfg.smem) < 1:
            raise RuntimeError(f"{WHAT}: config {config} cannot be resident on this GPU")
        seen.add(key)
    return k


def warm_gemm(M: int, N: int, K: int, in_dtype: str, out_dtype: str, b_layout: str, device: int) -> None:
    """Compile (or load) the GEMM kernel :func:`mkernel.gemm` will run on the unfused path's gathered rows
    (``describe`` compiles what it would launch for dense operands)."""
    G.describe(M, N, K, in_dtype=in_dtype, out_dtype=out_dtype, b_layout=b_layout, device=device)


def _open_side(side, go) -> None:
    """The copy-engine path's side stream: wait until the GEMM opened the call (raised the go word), re-zero
    it, then copy."""
    check(cu.cuStreamWaitValue32(side, go, 1, cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ.value))
    check(cu.cuStreamWriteValue32(side, go, 0, 0))


# --------------------------------------------------------------------------------------------
# the copy-engine path's copies (pure)
# --------------------------------------------------------------------------------------------
def ce_copies(chunk_rows: int, group_max: int, L: Layout, offs, ws, a_ptr: int, me: int, row_bytes: int,
              local_map: bool) -> list:
    """The side stream's copies for rank ``me``, in order: (dst, src, bytes).  Local chunks first (our GEMM
    starts on them; none when the GEMM reads them in place: ``local_map``), then the shard at ``a_ptr`` to
    each peer in rank-rotated order (me+1 first), in copy groups of consecutive chunks
    (:func:`~mkernel.ops.ag_gemm.planner.ce_copy_groups` of ``group_max``); each data copy is followed by
    one copy of the flag values into its chunks' ready flags at the destination (consecutive u64: up to
    CE_VALUES of them per copy).  ``offs``: the agreed row offsets; ``ws``: the workspace (``ptr``,
    ``peer_ptr(j)``)."""
    P = len(offs) - 1
    cr, m = chunk_rows, offs[me + 1] - offs[me]
    base = offs[me] * row_bytes
    value = ws.ptr + L.value_off
    groups = ce_copy_groups(-(-m // cr), group_max)
    out = []
    for j in range(1 if local_map else 0, P):
        dst = (me + j) % P
        ws_dst = ws.ptr if j == 0 else ws.peer_ptr(dst)
        c = 0
        for g in groups:
            off, n = c * cr * row_bytes, (min(m, (c + g) * cr) - c * cr) * row_bytes
            out.append((ws_dst + L.data_off + base + off, a_ptr + off, n))
            out.append((ws_dst + L.flags_off + 8 * (me * L.nch_stride + c), value, 8 * g))
            c += g
    return out


def gathered_copies(ga: int, data: int, a_ptr: int, lo: int, hi: int, total: int, local_map: bool) -> list:
    """(dst, src, bytes) copies of the gathered A into ``ga`` after the copy-engine path's GEMM: the
    workspace's data region at ``data`` (``total`` bytes), except -- when the GEMM read this rank's rows in
    place (``local_map``) -- bytes ``[lo, hi)``, which are not in the workspace: those from ``a_ptr``."""
    if not local_map:
        return [(ga, data, total)]
    parts = [(ga, data, lo), (ga + lo, a_ptr, hi - lo), (ga + hi, data + hi, total - hi)]
    return [g for g in parts if g[2] > 0]


# --------------------------------------------------------------------------------------------
# bound calls
# --------------------------------------------------------------------------------------------
class _Bound(BoundCall):
    """A bound call that allocates the output of calls made with ``out=None`` (``out_spec``: shape, dtype,
    device)."""

    def _out(self, call) -> DeviceArray:
        O = call.o
        if O is None:
            shape, dtype, device = self._out_spec
            O = call.o = DeviceArray.empty(shape, dtype, device=device)
        return O


class _EmptyBound(_Bound):
    """No row in the gathered A: nothing runs."""

    def __init__(self, plan, out_spec):
        self.plan, self._out_spec = plan, out_spec

    def run(self, stream, call):
        self._out(call)


class _PlainBound(_Bound):
    """Nothing to gather (one local rank, or K = 0): :func:`mkernel.gemm`, and a copy of a_shard into
    gathered_a."""

    def __init__(self, ctx, call, ag: Agreed, out_spec):
        self.plan, self._out_spec = ag.plan, out_spec
        self._P, self._M, self._N, self._b_layout = ag.P, ag.offs[-1], call.N, call.b_layout

    def run(self, stream, call):
        O = self._out(call)
        A, GA = call.a, call.ga
        if GA is not None and GA.nbytes and GA.ptr != A.ptr:
            copy_async([(GA.ptr, A.ptr, A.nbytes)], stream)
        if self._N > 0:
            # (P > 1 here means K = 0: a [M_total, 0] view, the GEMM writes zeros)
            a_full = A if self._P == 1 else DeviceArray(A.ptr, (self._M, 0), A.dtype, (1, 1), A.device, owner=A)
            gemm(a_full, call.b, O, b_layout=self._b_layout, stream=stream)


def _ag_args(ctx, ag: Agreed, ws, call, O: DeviceArray) -> AgArgs:
    """The kernels' AgArgs of this call (every path's fields; the path sets its own)."""
    p, L = ag.plan, ag.layout
    A, GA, N, K = call.a, call.ga, call.N, call.K
    M_total = ag.offs[-1]
    args = AgArgs()
    args.a_shard, args.ws, args.peers = A.ptr, ws.ptr, ws.peer_table
    args.gathered_out = GA.ptr if GA is not None else None
    args.row_bytes, args.data_off, args.flags_off = K * A.dtype.itemsize, L.data_off, L.flags_off
    args.consumed_off = L.consumed_off
    args.ldc = O.strides[0] if M_total > 1 else N
    args.M_total, args.N, args.K = M_total, N, K
    args.chunk_rows, args.nch_stride = p.chunk_rows, L.nch_stride
    args.group_m = G.GROUP_M
    args.P, args.me, args.ce_value_off = ag.P, ctx.local_rank, L.value_off
    for j, o in enumerate(ag.offs):
        args.offs[j] = o
    return args


class _UnfusedBound(_Bound):
    """The gather kernel (cooperative, every SM copying), :func:`mkernel.gemm` on the gathered rows in the
    workspace, the release kernel; each call sets a_shard and gathered_a in the shared AgArgs."""

    def __init__(self, ctx, call, ag: Agreed, ws, out_spec):
        p, L = ag.plan, ag.layout
        self.plan, self._out_spec = p, out_spec
        dt, out_dt = call.a.dtype.name, call.o.dtype.name
        args = self._args = _ag_args(ctx, ag, ws, call, call.o)
        args.n_comm, args.gather_only = 0, 1
        comm = ctx.comm_args(OP, ag.digest)
        s = call.stream
        self._gather = _kernel(dt, out_dt, p.config, "mk_ag_gather").prepare(
            p.gather_blocks, GATHER_THREADS, [comm, args], stream=s, cooperative=True)
        self._release = _kernel(dt, out_dt, p.config, "mk_ag_release").prepare(1, RELEASE_THREADS, [comm, args],
                                                                               stream=s)
        self._gathered = DeviceArray(ws.ptr + L.data_off, (ag.offs[-1], call.K), dt, None, ctx.device, owner=ws)
        self._N, self._b_layout = call.N, call.b_layout

    def run(self, stream, call):
        O = self._out(call)
        a = self._args
        a.a_shard = call.a.ptr
        a.gathered_out = call.ga.ptr if call.ga is not None else None
        self._gather.submit()
        if self._N > 0:
            gemm(self._gathered, call.b, O, b_layout=self._b_layout, stream=stream)
        self._release.submit()


class _FusedArgs:
    """The fused kernel's arguments ``[tmA (gathered A in the workspace), tmB, tmA_local, tmC, comm, AgArgs]``
    and B's staging launch, bound once; :meth:`point` re-points them at a call's arrays: this rank's rows
    (``a_shard`` and, where the GEMM reads them in place, their map), B (its map, or its staging source),
    the output (its map, ``c``, ``c_vec_ok``) and ``gathered_out``."""

    def __init__(self, ctx, call, ag: Agreed, ws):
        p, L = ag.plan, ag.layout
        A, B, O = call.a, call.b, call.o
        dt, out_dt = A.dtype.name, O.dtype.name
        M_total, N, K, isz, me = ag.offs[-1], call.N, call.K, A.dtype.itemsize, ctx.local_rank
        cfg = G.CONFIGS[p.config]
        a = self.args = _ag_args(ctx, ag, ws, call, O)
        a.n_comm, a.gather_only = p.comm_sms, 0  # fused_ce: comm_sms = 0, every block a GEMM worker
        self.tma = TensorMapArg(ws.ptr + L.data_off, dt, (K, M_total), (K * isz,), (64, cfg.bm))
        # this rank's rows are read in place (no local copy, no wait) when TMA can address a_shard
        m_me = ag.offs[me + 1] - ag.offs[me]
        a.local_map = int(m_me > 0 and A.ptr % 16 == 0)
        self.tmal = TensorMapArg(A.ptr, dt, (K, m_me), (K * isz,), (64, cfg.bm)) if a.local_map else None
        self.b = G.b_arg(B, K, N, call.b_layout, cfg, dt, out_dt, ctx.device)
        self.ldc, self.M_total = a.ldc, M_total
        self.tmc, a.c_tma = G.c_arg(O, M_total, N, a.ldc, cfg)  # (None: the kernel stores from registers)
        a.c, a.c_vec_ok = O.ptr, vec_ok(O, a.ldc, M_total)
        tcfg = tile_config(p.config, call.b_layout)  # the tile the kernel runs (config 5: 224 or 256 wide)
        tiles = _fused_tiles([ag.offs[j + 1] - ag.offs[j] for j in range(ag.P)], N, tcfg)
        a.splits, a.split_from = 1, tiles  # (no split-K: every unit a whole tile, mk_split_unit)
        self.keep, self.clears = list(self.b.keep), ()
        # split-K: fp32 running sums and counters, zero before first use (the kernel keeps them so).  (A rank
        # whose N is below the agreed maximum has fewer tiles than the plan counted: it splits from the same
        # unit on, if any.)
        if p.splits > 1 and p.split_from < tiles:
            sk, a.partials, a.counters = G.split_workspace(tiles - p.split_from, tcfg.bm * tcfg.bn, ctx.device)
            a.splits, a.split_from = p.splits, p.split_from
            self.keep.append(sk)
            self.clears = (G.ClearBeforeFirstUse(sk.ptr, sk.size),)
        comm = ctx.comm_args(OP, ag.digest)
        self.kargs = [self.tma.buf, self.b.map.buf, (self.tmal or self.tma).buf, (self.tmc or self.tma).buf, comm, a]
        self.comm = comm
        self.pre = [] if self.b.stage is None else [self.b.stage[0].prepare(*self.b.stage[1:], stream=call.stream)]

    def point(self, call, O: DeviceArray) -> None:
        a, A = self.args, call.a
        a.a_shard = A.ptr
        if self.tmal is not None:
            self.tmal.point(A.ptr)
        self.b.point(call.b.ptr)
        if self.tmc is not None:
            self.tmc.point(O.ptr)
        a.c, a.c_vec_ok = O.ptr, vec_ok(O, self.ldc, self.M_total)
        a.gathered_out = call.ga.ptr if call.ga is not None else None


class _FusedBound(_Bound):
    """The SM-communication path: B's staging (if any), then one cooperative launch of the fused kernel."""

    def __init__(self, ctx, call, ag: Agreed, ws, out_spec):
        p = ag.plan
        self.plan, self._out_spec = p, out_spec
        f = self._f = _FusedArgs(ctx, call, ag, ws)
        cfg = G.CONFIGS[p.config]
        k = fused_kernel(ctx, call.a.dtype.name, call.o.dtype.name, p.config, call.b_layout)
        self._launch = k.prepare(p.comm_sms + p.workers, cfg.threads, f.kargs, stream=call.stream, smem=cfg.smem,
                                 cooperative=True)
        self.buffers, self.clears = tuple(f.keep), f.clears

    def run(self, stream, call):
        self._f.point(call, self._out(call))
        for pre in self._f.pre:
            pre.submit()
        self._launch.submit()


class _CeBound(_Bound):
    """The copy-engine path: the fused kernel on the caller's stream, every block a GEMM worker; the copies on
    ``ctx.side_stream()`` (fork/join).  The GEMM opens the call (worker 0's idle producer warp: ag_ce_open)
    and raises the go word; the side stream waits for it, re-zeroes it, then copies.  With gathered_a, the
    gathered A is copied out of the workspace after the GEMM and the release kernel closes the call.  The
    copy list depends on a_shard's address: rebuilt when it changes."""

    def __init__(self, ctx, call, ag: Agreed, ws, out_spec):
        p, L = ag.plan, ag.layout
        self.plan, self._out_spec = p, out_spec
        f = self._f = _FusedArgs(ctx, call, ag, ws)
        a = f.args
        a.ce_go_off = L.go_off
        cfg = G.CONFIGS[p.config]
        dt, out_dt = call.a.dtype.name, call.o.dtype.name
        s = call.stream
        self._release = None
        if call.ga is not None:
            # The caller's copy of the gathered A is taken from the workspace after the GEMM, so the call
            # stays open until then (peers may refill the workspace once we signal consumed): the GEMM
            # leaves the epoch open and the release kernel closes it after the copy.
            a.gather_only = 1
            self._release = _kernel(dt, out_dt, p.config, "mk_ag_release").prepare(1, RELEASE_THREADS, [f.comm, a],
                                                                                   stream=s)
        grid = p.comm_sms + p.workers
        if not a.local_map:
            # this rank's rows are copied into the workspace first: a same-device copy the driver may run as
            # a kernel, which must find an SM while the GEMM waits for those rows
            grid = min(grid, ctx.resident_sms - 1)
        k = fused_kernel(ctx, dt, out_dt, p.config, call.b_layout)
        self._launch = k.prepare(grid, cfg.threads, f.kargs, stream=s, smem=cfg.smem)
        self.buffers, self.clears = tuple(f.keep), f.clears
        self._fork = ForkedCopies(ctx.side_stream())
        self._go = cu.CUdeviceptr(ws.ptr + L.go_off)
        me, row_bytes = ctx.local_rank, call.K * call.a.dtype.itemsize
        self._copy_spec = (p.chunk_rows, p.ce_group_max, L, ag.offs, ws, me, row_bytes, bool(a.local_map))
        self._a_ptr, self._copies = None, []
        self._ga_spec = (ws.ptr + L.data_off, ag.offs[me] * row_bytes, ag.offs[me + 1] * row_bytes,
                         ag.offs[-1] * row_bytes, bool(a.local_map))

    def _start(self, side) -> None:
        _open_side(side, self._go)

    def run(self, stream, call):
        self._f.point(call, self._out(call))
        A = call.a
        if A.ptr != self._a_ptr:
            cr, gm, L, offs, ws, me, rb, lm = self._copy_spec
            self._copies = [(cu.CUdeviceptr(d), cu.CUdeviceptr(src), n)
                            for d, src, n in ce_copies(cr, gm, L, offs, ws, A.ptr, me, rb, lm)]
            self._a_ptr = A.ptr
        s = cu.CUstream(stream)
        fork = self._fork
        fork.fork(s, self._start)
        fork.copies(self._copies)
        try:
            for pre in self._f.pre:
                pre.submit()
            self._launch.submit()
        except BaseException:
            # the kernel that raises the go word never ran: release the side stream, or it waits forever
            cu.cuStreamWriteValue32(s, self._go, 1, 0)
            fork.join(s)
            raise
        fork.join(s)
        if self._release is not None:
            data, lo, hi, total, lm = self._ga_spec
            copy_async(gathered_copies(call.ga.ptr, data, A.ptr, lo, hi, total, lm), s)
            self._release.submit()


# --------------------------------------------------------------------------------------------
# the op
# --------------------------------------------------------------------------------------------
class _Call:
    __slots__ = ("key", "stream", "a", "b", "o", "ga", "b_layout", "options", "m_sizes", "M", "K", "N",
                 "local_sig", "guess", "agreed")


def _check_overlaps(A: DeviceArray, B: DeviceArray, O, GA) -> None:
    """The arrays the kernels write (out, gathered_a) must not share memory with what they read (a_shard, b)
    or with each other.  (gathered_a may hold a_shard: one local rank's gathered A is its shard.)"""
    if O is None and GA is None:
        return
    check_no_overlap(WHAT, ((O, "out", A, "a_shard"), (O, "out", B, "b"), (O, "out", GA, "gathered_a"),
                            (GA, "gathered_a", B, "b")))


def _has_workspace(ms, K: int) -> bool:
    """Whether a call of these agreed row counts moves anything between ranks (else: the plain GEMM)."""
    return len(ms) > 1 and sum(ms) > 0 and K > 0


class AgGemm(Op):
    generation_keyed = True
    name = OP

    # ---- per call ---------------------------------------------------------------------------
    def __call__(self, ctx, a_shard, b, out, gathered_a, b_layout, stream, options, m_sizes, path, comm_sms,
                 config):
        ctx.check()
        s = as_stream(stream)
        default = AgGemmOptions.default()
        base = default if options is None else options
        if base is not default and not isinstance(base, AgGemmOptions):
            raise TypeError(f"{WHAT}: options must be an AgGemmOptions, got {type(base).__name__}")
        opts = base.with_forced(path, comm_sms, config)
        if opts is not default:
            self._check_options(opts)
        A = as_device_array(a_shard, name="ag_gemm: a_shard", stream=s)
        B = as_device_array(b, name="ag_gemm: b", stream=s)
        O = None if out is None else as_device_array(out, name="ag_gemm: out", stream=s)
        GA = None if gathered_a is None else as_device_array(gathered_a, name="ag_gemm: gathered_a", stream=s)
        ms = None if m_sizes is None else tuple(int(m) for m in m_sizes)
        _check_overlaps(A, B, O, GA)
        call = _Call()
        call.stream, call.a, call.b, call.o, call.ga = s, A, B, O, GA
        call.b_layout, call.options, call.m_sizes = b_layout, opts, ms
        lk = G.layout_key
        call.key = (lk(A), lk(B), None if O is None else (lk(O), O.readonly),
                    None if GA is None else (lk(GA), GA.readonly), b_layout, opts, ms, s, ctx.workspace_generation)
        self.invoke(ctx.op_state(OP), call, ctx)
        return out if out is not None else call.o

    def _check_options(self, opts: AgGemmOptions) -> None:
        checked_once(opts)

    # ---- first call of a key ----------------------------------------------------------------
    def validate(self, ctx, call):
        """Every check that needs no other rank's values (out's and gathered_a's row counts, which need the
        agreed sum of every rank's rows, are checked in :meth:`plan` when m_sizes is not given)."""
        require_gemm_device(WHAT, ctx.device)
        A, B, M_r, K, N, _ = G.check_arrays(call.a, call.b, call.b_layout, what=WHAT, a_name="a_shard")
        O, GA = call.o, call.ga
        for X, nm in ((A, "a_shard"), (B, "b"), (O, "out"), (GA, "gathered_a")):
            if X is not None and X.device != ctx.device:
                raise ValueError(f"{WHAT}: {nm} is on cuda:{X.device}, but this rank's context uses cuda:{ctx.device}")
        if not A.is_contiguous():
            raise ValueError(f"{WHAT}: a_shard must be C-contiguous (strides {A.strides} for shape {tuple(A.shape)})")
        isz = A.dtype.itemsize
        if (K * isz) % 16:
            raise ValueError(f"{WHAT}: K={K} gives {K * isz}-byte rows; the gathered A needs rows of a multiple of "
                             f"16 bytes (K % {16 // isz} == 0)")
        P, me = ctx.local_size, ctx.local_rank
        if P > MAXP:
            raise ValueError(f"{WHAT}: {P} local ranks; at most {MAXP} are supported")
        ms = call.m_sizes
        if ms is not None and (len(ms) != P or ms[me] != M_r or min(ms) < 0):
            raise ValueError(f"{WHAT}: m_sizes={list(ms)} must list {P} sizes >= 0 with m_sizes[{me}] == "
                             f"{M_r} (this rank's rows)")
        dt = A.dtype.name
        rows = "sum of the local ranks' rows" if ms is None else sum(ms)
        if O is not None:
            if O.dtype.name not in (dt, "float32"):
                raise TypeError(f"{WHAT}: out has dtype {O.dtype.name}; expected {dt} or float32")
            if O.ndim != 2 or O.shape[1] != N or (ms is not None and O.shape[0] != rows):
                raise ValueError(f"{WHAT}: out has shape {tuple(O.shape)}, expected ({rows}, {N})")
            if N > 1 and O.shape[0] > 0 and O.strides[1] != 1:
                raise ValueError(f"{WHAT}: out must have a unit column stride (row-major rows)")
            if O.shape[0] > 1 and O.strides[0] < N:
                raise ValueError(f"{WHAT}: out row stride {O.strides[0]} is smaller than N={N}")
            if O.readonly:
                raise ValueError(f"{WHAT}: out is read-only memory but the op writes it")
        if GA is not None:
            if GA.dtype.name != dt or GA.ndim != 2 or GA.shape[1] != K or (ms is not None and GA.shape[0] != rows):
                raise ValueError(f"{WHAT}: gathered_a must be {dt} ({rows}, {K}), got {GA.dtype.name} "
                                 f"{tuple(GA.shape)}")
            if not GA.is_contiguous():
                raise ValueError(f"{WHAT}: gathered_a must be C-contiguous")
            if GA.readonly:
                raise ValueError(f"{WHAT}: gathered_a is read-only memory but the op writes it")
        call.M, call.K, call.N = M_r, K, N

    def _sigs(self, ctx) -> OrderedDict:
        return ctx.op_state(OP).data.setdefault("sigs", OrderedDict())

    def _plan_of(self, ctx, call, inputs) -> AgPlan:
        ms, n_max, gathered, layout = inputs
        o = call.options
        return make_plan(ms, n_max, call.K, call.a.dtype.itemsize, ctx.resident_sms, comm_sms=o.comm_sms,
                         gathered=gathered, force_path=o.path, config=o.config, tail_split=o.tail_split,
                         b_layout=layout, fused_auto=o.fused_auto, model=o.model)

    def _compile_plan(self, ctx, call, p: AgPlan, inputs) -> None:
        """Load (compiling where the disk cache has nothing) every kernel the bound call of ``p`` launches."""
        ms = inputs[0]
        if not _has_workspace(ms, call.K):
            return  # (mkernel.gemm compiles its own kernel on its first call)
        dt = call.a.dtype.name
        out_dt = call.o.dtype.name if call.o is not None else dt
        if p.path == "unfused":
            _kernel(dt, out_dt, p.config, "mk_ag_gather")
            _kernel(dt, out_dt, p.config, "mk_ag_release")
            if call.N > 0:
                warm_gemm(sum(ms), call.N, call.K, dt, out_dt, call.b_layout, ctx.device)
            return
        fused_kernel(ctx, dt, out_dt, p.config, call.b_layout)
        if p.path == "fused_ce" and call.ga is not None:
            _kernel(dt, out_dt, p.config, "mk_ag_release")

    def compile(self, ctx, call):
        """The kernels of the plan, before the ranks exchange their signatures.  The plan needs the exchanged
        values (every rank's M_j, the largest N, ...), so before a new local signature's exchange it is
        planned from this rank's own values -- M_j = M_r on every rank (or m_sizes, when given), N, gathered_a
        and b_layout as here -- and that plan's kernels compiled: where the exchanged values turn out to be
        these (equal shards or m_sizes given, the same N, gathered_a and B layout everywhere: the usual
        call), the plan is the same and nothing is compiled after the exchange.  Otherwise :meth:`agree`
        compiles the agreed plan's kernels and the ranks meet once more on the host before any launch: a
        rank compiling for seconds then delays that bounded host exchange, never a peer's device wait (which
        would time out)."""
        call.local_sig = (call.a.dtype.name, call.M, call.K, call.N, call.ga is not None, call.m_sizes,
                          call.b_layout, call.options)
        call.agreed = self._sigs(ctx).get(call.local_sig)
        call.guess = None
        if call.agreed is not None:
            self._compile_plan(ctx, call, call.agreed.plan, call.agreed.inputs)
            return
        P = ctx.local_size
        ms = call.m_sizes if call.m_sizes is not None else (call.M,) * P
        inputs = (ms, call.N, call.ga is not None, call.b_layout)
        try:
            p = self._plan_of(ctx, call, inputs)
        except ValueError:
            if P == 1:
                raise
            return  # (the plan of the exchanged values raises on every rank alike, after the exchange)
        call.guess = (inputs, p)
        self._compile_plan(ctx, call, p, inputs)

    def agree(self, ctx, call):
        if call.agreed is None:
            call.agreed = self._agree(ctx, call)
        return call.agreed.digest

    def _exchange(self, ctx, call) -> tuple:
        """Exchange every local rank's call signature: (the agreed plan inputs, whether every rank's
        pre-exchange plan inputs were these).  Raises ValueError on every rank when they disagree."""
        o, dt, ms_arg = call.options, call.a.dtype.name, call.m_sizes
        msz_hash = 0 if ms_arg is None else (hash(ms_arg) & ((1 << 62) - 1)) + 1
        mine = np.array([G.DTYPE_CODES[dt], call.M, call.K, call.N, -1 if o.comm_sms is None else o.comm_sms,
                         int(call.ga is not None), _FORCE.get(o.path, 3), -1 if o.config is None else o.config,
                         msz_hash, int(call.b_layout == "nk")], dtype=np.int64)
        allv = ctx.agreement.exchange(f"{WHAT}'s signature exchange", mine, ctx.node_comm)
        problems = []
        for col, name in ((0, "dtype"), (2, "K"), (4, "comm_sms"), (6, "path override"), (7, "config"),
                          (8, "m_sizes")):
            vals = allv[:, col]
            if np.any(vals != vals[0]):
                problems.append(f"{name} differs across local ranks: {vals.tolist()}")
        ms = tuple(int(v) for v in allv[:, 1])
        if ms_arg is not None and ms_arg != ms:
            problems.append(f"m_sizes={list(ms_arg)} but the ranks hold shards of {list(ms)} rows")
        all_nk = bool(allv[:, 9].all())
        if o.config is not None and G.CONFIGS[o.config].bn_kn is not None and allv[:, 9].any() and not all_nk:
            problems.append(f"config {o.config} runs a tile whose width depends on b_layout, and the ranks' layouts "
                            f"differ ({['nk' if v else 'kn' for v in allv[:, 9]]})")
        if problems:
            raise ValueError(f"{WHAT}: ranks disagree on the call: " + "; ".join(problems))
        inputs = (ms, int(allv[:, 3].max()), bool(allv[:, 5].any()), "nk" if all_nk else "kn")
        # every rank planned before the exchange from (m_sizes or its own M_r everywhere, its N, gathered_a, layout)
        every_guess = ((ms_arg is not None or len(set(ms)) == 1) and len(set(allv[:, 3].tolist())) == 1
                       and len(set(allv[:, 5].tolist())) == 1 and len(set(allv[:, 9].tolist())) == 1)
        return inputs, every_guess

    def _agree(self, ctx, call) -> Agreed:
        """The first call of a local signature: the exchange (none with one local rank), the plan, its
        digest; kept in the op state (the oldest of SIGS_MAX dropped first: insertion order, which is the
        same on every rank -- an exchange is collective -- so every rank drops the same one)."""
        P, K = ctx.local_size, call.K
        if P > 1:
            inputs, every_guess = self._exchange(ctx, call)
        else:
            inputs, every_guess = ((call.M,), call.N, call.ga is not None, call.b_layout), True
        guess = call.guess
        mine = guess is not None and guess[0] == inputs
        p = guess[1] if mine else self._plan_of(ctx, call, inputs)
        ms, n_max, any_gathered, _ = inputs
        layout = workspace_layout(P, ms, p.chunk_rows, K * call.a.dtype.itemsize) if _has_workspace(ms, K) else None
        offs = (0,) + tuple(int(x) for x in np.cumsum(ms))
        ag = Agreed(p, layout, offs, P, call_digest(call.a.dtype.name, ms, K, n_max, any_gathered, p), inputs)
        if not mine:
            self._compile_plan(ctx, call, p, inputs)
        if not every_guess:
            # some rank planned other values before the exchange and may have compiled just now: meet again
            # (bounded) before anyone launches -- and check that every rank made the same plan
            d = ctx.agreement.exchange(f"{WHAT}: kernels compiled", np.array([ag.digest], dtype=np.int64),
                                       ctx.node_comm)[:, 0]
            if np.any(d != ag.digest):
                raise ValueError(f"{WHAT}: local ranks planned different calls (digests {d.tolist()})")
        sigs = self._sigs(ctx)
        sigs[call.local_sig] = ag
        while len(sigs) > SIGS_MAX:
            sigs.popitem(last=False)
        return ag

    def plan(self, ctx, call, digest):
        ag = call.agreed
        M_total, N, K = ag.offs[-1], call.N, call.K
        if M_total >= 2 ** 31:
            raise ValueError(f"{WHAT}: the gathered A has {M_total} rows; at most 2**31 - 1 are supported")
        O, GA = call.o, call.ga
        if O is not None and tuple(O.shape) != (M_total, N):
            raise ValueError(f"{WHAT}: out has shape {tuple(O.shape)}, expected {(M_total, N)} (sum of the local "
                             f"ranks' rows {list(ag.plan.m_sizes)} x N)")
        if GA is not None and tuple(GA.shape) != (M_total, K):
            raise ValueError(f"{WHAT}: gathered_a must be {call.a.dtype.name} {(M_total, K)}, got {GA.dtype.name} "
                             f"{tuple(GA.shape)}")
        return ag.plan

    def bind(self, ctx, call, p: AgPlan) -> BoundCall:
        ag = call.agreed
        M_total = ag.offs[-1]
        out_spec = ((M_total, call.N), call.a.dtype.name, ctx.device)
        if call.o is None:
            call.o = DeviceArray.empty(*out_spec[:2], device=ctx.device)
        if M_total == 0:
            return _EmptyBound(p, out_spec)
        if ag.layout is None:
            return _PlainBound(ctx, call, ag, out_spec)
        ws = ctx.workspace((OP,), ag.layout.total, call.stream, WHAT)
        cls = {"unfused": _UnfusedBound, "fused_ce": _CeBound, "fused": _FusedBound}[p.path]
        return cls(ctx, call, ag, ws, out_spec)


_OP = AgGemm()


def ag_gemm(ctx, a_shard, b, out=None, *, gathered_a=None, b_layout: str = "kn", stream=None,
            comm_sms: int | None = None, m_sizes=None, config: int | None = None, path: str | None = None,
            options: AgGemmOptions | None = None):
    """``out = AllGather(a_shard over the local ranks) @ b``: column-parallel tensor parallelism.

    ``a_shard``: this rank's rows ``[M_r, K]``, bf16 or fp16, C-contiguous, on ``ctx``'s GPU (any memory: it
    need not be symmetric); ``M_r >= 0`` may differ across ranks; ``K * itemsize`` a multiple of 16.  ``b``:
    same dtype, ``[K, N]`` ("kn") or ``[N, K]`` ("nk"), any strides (staged like :func:`mkernel.gemm` when TMA
    cannot read it in place); N may differ across ranks.  ``out``: ``[sum_j M_j, N]`` of a's dtype or float32,
    unit column stride (any row stride), rows of local rank j at ``sum_{i<j} M_i``; allocated when None.
    ``gathered_a``: optional ``[sum_j M_j, K]`` C-contiguous array of a's dtype receiving the gathered A,
    exactly.  ``stream``: any stream-like object or raw handle (None: the legacy default stream).
    ``m_sizes``: every local rank's M_j (optional; ``m_sizes[local_rank]`` must be M_r): without it the first
    call of a new local signature exchanges every rank's M_j (bounded by the context timeout), so ranks that
    change M_r independently of each other must pass it.  ``options``: :class:`AgGemmOptions` (None: the
    defaults, with the ``MKERNEL_AG_GEMM_*`` overrides); ``path`` ("fused_ce", "fused", "unfused"),
    ``comm_sms`` (communication blocks of "fused"; 0: "unfused") and ``config`` (the fused kernel's tile
    config) override its fields.

    Every rank makes the same calls in the same order; ranks that disagree on dtype, K, comm_sms, the path,
    the config or m_sizes get a ValueError (all of them) before anything is launched.  No host
    synchronization: calls can be captured in a CUDA graph (make the first call of a shape outside the
    capture: it may exchange signatures and allocate the workspace).  Every device wait is bounded by the
    context timeout (:class:`mkernel.CommTimeout` at the next ``ctx.check()`` / ``ctx.synchronize()``).  The
    plan that ran: ``ctx.last_plan("ag_gemm")`` (:class:`AgPlan`).  Returns ``out``."""
    return _OP(ctx, a_shard, b, out, gathered_a, b_layout, stream, options, m_sizes, path, comm_sms, config)


def precompile(specs=None, *, arch: str | None = None, workers: int | None = None) -> float:
    """Compile ag_gemm.cu specializations (default: every registered one) into the disk cache in parallel
    worker processes; returns the summed NVRTC seconds (0 for cubins already cached)."""
    return precompile_source(SOURCE, specs, arch=arch, workers=workers)

