"""GEMM + ReduceScatter on the op pipeline (:mod:`mkernel.ops.base`): prepare -> key -> validate / compile
(the ranks' K_r exchanged, the plan made, its kernel compiled) / agree / plan / bind -> run.

``gemm_reduce_scatter(ctx, a, b)``: local rank r (of the P = ``ctx.local_size`` ranks of one node) holds
``A_r [M, K_r]`` and ``B_r`` (``[K_r, N]`` "kn" or ``[N, K_r]`` "nk"); ``S = sum_r A_r @ B_r`` and rank r
returns rows ``[offs[r], offs[r+1])`` of S, ``[M_r, N]``.  Bound calls:

* "fused" (:class:`_FusedBound`): one cooperative launch of ``mk_gemm_rs_{kn,nk}`` (cuda_src/ops/gemm_rs.cu);
  each call re-points the operands' tensor maps (or re-stages operands TMA cannot read in place) and
  the output fields, then submits.
* "unfused" (:class:`_UnfusedBound`): :func:`mkernel.gemm` into a buffer of P equal shares (one GEMM per
  owner when the row split is uneven), :func:`mkernel.reduce_scatter`, and a copy into ``out`` where the
  reduce-scatter cannot write it directly.
* "gemm" (one local rank): :func:`mkernel.gemm`; "empty": nothing.
"""
from __future__ import annotations

import ctypes
import zlib
from dataclasses import replace

import numpy as np
from cuda.bindings import driver as cu

from ...core.archs import require_gemm_device
from ...core.arrays import DeviceArray
from ...core.compiler import kernel
from ...core.driver import check
from ...core.interop import as_device_array, require
from ...core.tensormap import TensorMapArg, tma_compatible
from ...core.util import round_up
from ..base import BoundCall, Op, as_stream, checked_once
from ..collectives import reduce_scatter
from ..gemm import gemm
from .. import gemm as G  # the GEMM package's public planning API
from .layout import SOURCE, OwnerRows, RsArgs, kernel_defines, row_offsets, split_rows
from .options import GemmRsOptions
from .planner import RsPlan, m_sizes_for, plan as make_plan

__all__ = ["gemm_reduce_scatter"]

OP = "gemm_rs"
WHAT = "mkernel.gemm_reduce_scatter"
LAYOUTS = ("kn", "nk")
_DEFAULT = GemmRsOptions()


# --------------------------------------------------------------------------------------------
# device helpers (module attributes: the CPU tests replace them)
# --------------------------------------------------------------------------------------------
def copy_2d(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int) -> None:
    """``height`` rows of ``width`` bytes from ``src`` (rows ``spitch`` bytes apart) to ``dst`` (``dpitch``),
    on ``stream`` (a copy node when captured)."""
    if width == 0 or height == 0:
        return
    p = cu.CUDA_MEMCPY2D()
    p.srcMemoryType = p.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
    p.srcDevice, p.srcPitch, p.dstDevice, p.dstPitch = src, spitch, dst, dpitch
    p.WidthInBytes, p.Height = width, height
    check(cu.cuMemcpy2DAsync(p, cu.CUstream(stream)))


def fused_kernel(ctx, p: RsPlan):
    """The fused kernel of plan ``p``, checked once per context to fit one block per SM (a cooperative
    launch needs every block resident)."""
    cfg = G.CONFIGS[p.config]
    k = kernel(SOURCE, kernel_defines(p.in_dtype, p.out_dtype, p.config, p.partial_dtype), f"mk_gemm_rs_{p.b_layout}")
    seen = ctx.op_state(OP).data.setdefault("resident", set())
    key = (p.in_dtype, p.out_dtype, p.partial_dtype, p.config, p.b_layout)
    if key not in seen:
        if k.max_active_blocks_per_sm(cfg.threads, cfg.smem) < 1:
            raise RuntimeError(f"{WHAT}: the fused kernel (config {p.config}) cannot be resident")
        seen.add(key)
    return k


# --------------------------------------------------------------------------------------------
# bound calls
# --------------------------------------------------------------------------------------------
class _FnBound(BoundCall):
    def __init__(self, plan, fn):
        self.plan, self._fn = plan, fn

    def run(self, stream, call):
        self._fn(stream, call)


class _Operand:
    """A row-major ``[rows, cols]`` operand (unit column stride) as the fused kernel's TMA map of ``dims``
    (innermost first; a third dimension of 1 for B) and ``box``: in place, re-pointed each call; or, when
    TMA cannot address it (base or row stride not 16-byte multiples), staged by a 2-D copy into a buffer
    of 16-byte rows that the map covers."""

    def __init__(self, X: DeviceArray, rows: int, cols: int, box: tuple, three_d: bool):
        isz = X.dtype.itemsize
        self.rows, self.width = rows, cols * isz
        self.pitch_of = (lambda Y: Y.strides[0] * isz if rows > 1 else self.width)
        self.staged = not tma_compatible(X.ptr, (self.pitch_of(X),))
        pitch = round_up(self.width, 16) if self.staged else self.pitch_of(X)
        self.buffer = DeviceArray.empty((rows * pitch // isz,), X.dtype, device=X.device) if self.staged else None
        base = self.buffer.ptr if self.staged else X.ptr
        dims, strides = (cols, rows), (pitch,)
        if three_d:
            dims, strides = dims + (1,), strides + (pitch * rows,)
        self.map = TensorMapArg(base, X.dtype.name, dims, strides, box)
        self.pitch = pitch

    def point(self, X: DeviceArray, stream: int) -> None:
        if self.staged:
            copy_2d(self.buffer.ptr, self.pitch, X.ptr, self.pitch_of(X), self.width, self.rows, stream)
        else:
            self.map.point(X.ptr)


class _FusedBound(BoundCall):
    """The fused kernel, prepared once: each call re-points A, B (or stages them), out, then submits."""

    def __init__(self, ctx, call, p: RsPlan):
        self.plan = p
        cfg = G.CONFIGS[p.config]
        A, B, O = call.a, call.b, call.o
        M, K, N, me = call.M, call.K, call.N, p.me
        bn = cfg.tile_n(p.b_layout)
        self._ctx = ctx
        self._a = _Operand(A, M, K, (64, cfg.bm), False)
        if p.b_layout == "kn":
            self._b = _Operand(B, K, N, (64, 64, 1), True)
        else:
            self._b = _Operand(B, N, K, (64, bn, 1), True)
        m_me = p.m_sizes[me]
        isz = O.dtype.itemsize
        self._ldc = O.strides[0] if m_me > 1 else N
        n16 = N - N % (16 // isz)  # a TMA store writes whole 16-byte pieces: the map ends there (gemm's c_map)
        c_tma = (cfg.tma_store and m_me > 0 and n16 > 0 and O.ptr % 16 == 0 and (self._ldc * isz) % 16 == 0)
        self._c = None
        if c_tma:
            self._c = TensorMapArg(O.ptr, O.dtype.name, (n16, m_me), (self._ldc * isz,), (128 // isz, 64))
        c_arg = self._c.buf if c_tma else ctypes.create_string_buffer(self._a.map.raw, 128)  # (any valid map)
        a = self._args = RsArgs()
        a.c, a.ldc = O.ptr, self._ldc
        self._gen = None
        self._point_workspace(call.stream)
        a.L = p.ws.struct()
        rows = OwnerRows()
        rows.P, rows.me, rows.N, rows.group_m = p.P, me, N, G.GROUP_M
        rows.offs[:p.P + 1] = row_offsets(p.m_sizes)
        a.rows = rows
        a.K, a.c_tma = K, int(c_tma)
        a.c_vec_ok = self._vec_ok(O)
        self._comm = ctx.comm_args(OP, p.digest)
        k = fused_kernel(ctx, p)
        self._launch = k.prepare(p.grid, cfg.threads, [self._a.map.buf, self._b.map.buf, c_arg, self._comm, a],
                                 stream=call.stream, smem=cfg.smem, cooperative=True)
        self.buffers = tuple(x.buffer for x in (self._a, self._b) if x.staged)

    def _point_workspace(self, stream) -> None:
        """The op's workspace as of now (another call may have grown it since this call was bound:
        ctx.workspace re-allocates collectively, raising inside a capture)."""
        ws = self._ctx.workspace((OP,), self.plan.ws.total, stream, WHAT)
        self._args.ws, self._args.peers = ws.ptr, ws.peer_table
        self._gen = self._ctx.workspace_generation

    def _vec_ok(self, O: DeviceArray) -> int:
        return int(O.ptr % (2 * O.dtype.itemsize) == 0 and (self._ldc % 2 == 0 or self.plan.m_sizes[self.plan.me] == 1))

    def run(self, stream, call):
        if self._ctx.workspace_generation != self._gen:
            self._point_workspace(stream)
        self._a.point(call.a, stream)
        self._b.point(call.b, stream)
        O = call.o
        if self._c is not None:
            self._c.point(O.ptr)
        a = self._args
        a.c, a.c_vec_ok = O.ptr, self._vec_ok(O)
        self._launch.submit()


class _UnfusedBound(BoundCall):
    """mkernel.gemm into P equal shares of ``max(m_j)`` rows (owner j's rows at share j), then
    mkernel.reduce_scatter into ``out`` -- or into a buffer copied into ``out`` when the shares are padded
    or ``out`` is not a dense ``[max(m_j), N]`` array."""

    def __init__(self, ctx, call, p: RsPlan):
        self.plan, self._ctx = p, ctx
        O = call.o
        P, N, me = p.P, p.N, p.me
        self._m_max = m_max = max(p.m_sizes)
        self._equal = all(m == m_max for m in p.m_sizes)
        self._tmp = DeviceArray.empty((P * m_max, N), O.dtype, device=O.device)
        self._direct = self._equal and O.is_contiguous()
        self._red = None if self._direct else DeviceArray.empty((m_max, N), O.dtype, device=O.device)
        self._offs = row_offsets(p.m_sizes)
        self.buffers = tuple(x for x in (self._tmp, self._red) if x is not None)

    def run(self, stream, call):
        p, tmp, m_max = self.plan, self._tmp, self._m_max
        if self._equal:
            gemm(call.a, call.b, tmp, b_layout=p.b_layout, stream=stream)
        else:
            for j, m in enumerate(p.m_sizes):
                if m:
                    gemm(call.a[self._offs[j]:self._offs[j + 1]], call.b, tmp[j * m_max:j * m_max + m],
                         b_layout=p.b_layout, stream=stream)
        O = call.o
        red = O if self._direct else self._red
        reduce_scatter(self._ctx, tmp, red, stream=stream)
        if not self._direct:
            isz = O.dtype.itemsize
            m_me = p.m_sizes[p.me]
            copy_2d(O.ptr, (O.strides[0] if m_me > 1 else p.N) * isz, red.ptr, p.N * isz, p.N * isz, m_me, stream)


# --------------------------------------------------------------------------------------------
# the op
# --------------------------------------------------------------------------------------------
class _Call:
    __slots__ = ("key", "stream", "a", "b", "o", "b_layout", "out_dtype", "deterministic", "options", "M", "K", "N",
                 "m_sizes", "local_sig", "plan")


def _span(x: DeviceArray) -> tuple:
    """[first byte, last byte + 1) that ``x`` touches."""
    if x.size == 0:
        return x.ptr, x.ptr
    isz = x.dtype.itemsize
    lo = sum(min(0, (n - 1) * s) for n, s in zip(x.shape, x.strides))
    hi = sum(max(0, (n - 1) * s) for n, s in zip(x.shape, x.strides))
    return x.ptr + lo * isz, x.ptr + (hi + 1) * isz


def _overlap(x: DeviceArray, y: DeviceArray) -> bool:
    (a0, a1), (b0, b1) = _span(x), _span(y)
    return a0 < b1 and b0 < a1


class GemmReduceScatter(Op):
    name = OP

    # ---- per call ---------------------------------------------------------------------------
    def __call__(self, ctx, a, b, out, b_layout, out_dtype, deterministic, stream, options):
        ctx.check()
        s = as_stream(stream)
        opts = _DEFAULT if options is None else options
        if opts is not _DEFAULT:
            if not isinstance(opts, GemmRsOptions):
                raise TypeError(f"{WHAT}: options must be a GemmRsOptions, got {type(opts).__name__}")
            checked_once(opts)
        if b_layout not in LAYOUTS:
            raise ValueError(f"{WHAT}: b_layout must be 'kn' or 'nk', got {b_layout!r}")
        A = as_device_array(a, name=f"{WHAT}: a", stream=s)
        B = as_device_array(b, name=f"{WHAT}: b", stream=s)
        if A.ndim != 2 or B.ndim != 2:
            raise ValueError(f"{WHAT}: a and b must be 2-D, got shapes {tuple(A.shape)} and {tuple(B.shape)}")
        M, K = A.shape
        Kb, N = B.shape if b_layout == "kn" else B.shape[::-1]
        if Kb != K:
            raise ValueError(f"{WHAT}: a is {tuple(A.shape)} but b is {tuple(B.shape)} (b_layout={b_layout!r}): "
                             f"K differs ({K} vs {Kb})")
        P, me = ctx.local_size, ctx.local_rank
        if opts.m_sizes is None:
            m_sizes = split_rows(M, P)
        else:
            try:
                m_sizes = m_sizes_for(M, P, opts.m_sizes)
            except ValueError as exc:
                raise ValueError(f"{WHAT}: options.{exc}") from None
        if out_dtype is not None and out_dtype not in G.OUT_DTYPES:
            raise TypeError(f"{WHAT}: out_dtype must be one of {G.OUT_DTYPES}, got {out_dtype!r}")
        if out is None:
            if A.dtype.name not in G.IN_DTYPES:  # (before allocating an output for a call that cannot run)
                raise TypeError(f"{WHAT}: a must be {' or '.join(G.IN_DTYPES)}, got {A.dtype.name}")
            O = DeviceArray.empty((m_sizes[me], N), out_dtype or A.dtype.name, device=ctx.device)
            result = O
        else:
            O = as_device_array(out, name=f"{WHAT}: out", stream=s)
            result = out
        for X, nm in ((A, "a"), (B, "b")):
            if _overlap(O, X):
                raise ValueError(f"{WHAT}: out overlaps {nm}")
        call = _Call()
        call.stream, call.a, call.b, call.o = s, A, B, O
        call.b_layout, call.out_dtype, call.deterministic, call.options = b_layout, out_dtype, bool(deterministic), opts
        call.M, call.K, call.N, call.m_sizes = M, K, N, m_sizes
        call.key = (A.shape, A.strides, A.dtype, A.device, A.ptr % 16 == 0, B.shape, B.strides, B.dtype, B.device,
                    B.ptr % 16 == 0, O.shape, O.strides, O.dtype, O.device, O.readonly, O.ptr % 16 == 0, b_layout,
                    out_dtype, call.deterministic, s, opts)
        self.invoke(ctx.op_state(OP), call, ctx)
        return result

    # ---- first call of a key ----------------------------------------------------------------
    def validate(self, ctx, call):
        require_gemm_device(WHAT, ctx.device)
        if ctx.num_nodes != 1:
            raise ValueError(f"{WHAT}: runs among the ranks of one node (NVLink); this context has "
                             f"{ctx.num_nodes} nodes")
        A = require(call.a, f"{WHAT}: a", dtypes=G.IN_DTYPES, ndim=2, contiguous=False, device=ctx.device)
        B = require(call.b, f"{WHAT}: b", ndim=2, contiguous=False, device=ctx.device)
        if B.dtype != A.dtype:
            raise TypeError(f"{WHAT}: a is {A.dtype.name} but b is {B.dtype.name}; they must match")
        for X, nm, inner in ((A, "a", call.K), (B, "b", B.shape[1])):
            if inner > 1 and X.shape[0] > 0 and X.strides[1] != 1:
                raise ValueError(f"{WHAT}: {nm} must have a unit stride along its last axis, got strides {X.strides}")
            if X.shape[0] > 1 and X.strides[0] < X.shape[1]:
                raise ValueError(f"{WHAT}: {nm}'s row stride {X.strides[0]} is smaller than its row ({X.shape[1]})")
        if max(call.M, call.N, call.K) >= 2**31:
            raise ValueError(f"{WHAT}: dimensions must be below 2**31")
        O = require(call.o, f"{WHAT}: out", dtypes=G.OUT_DTYPES, ndim=2, contiguous=False, device=ctx.device,
                    writable=True)
        if call.out_dtype is not None and O.dtype.name != call.out_dtype:
            raise TypeError(f"{WHAT}: out is {O.dtype.name} but out_dtype={call.out_dtype}")
        shape = (call.m_sizes[ctx.local_rank], call.N)
        if tuple(O.shape) != shape:
            raise ValueError(f"{WHAT}: out must have shape {shape} (this rank's rows of the {call.M} x {call.N} "
                             f"sum), got {tuple(O.shape)}")
        if shape[1] > 1 and shape[0] > 0 and O.strides[1] != 1:
            raise ValueError(f"{WHAT}: out must have a unit column stride, got strides {O.strides}")
        if shape[0] > 1 and O.strides[0] < shape[1]:
            raise ValueError(f"{WHAT}: out's row stride {O.strides[0]} is smaller than N={shape[1]}")

    def _local_signature(self, ctx, call) -> tuple:
        """What every rank's call must share (K_r may differ: it is exchanged)."""
        return (call.a.dtype.name, call.o.dtype.name, call.M, call.N, call.b_layout, call.m_sizes,
                call.deterministic, repr(call.options), ctx.local_size, ctx.sm_count)

    def _exchange_ks(self, ctx, sig: tuple, K: int) -> tuple:
        """Every local rank's K_r for this call: one bounded exchange per distinct (signature, K_r), which
        also checks that every rank makes the same call (ValueError naming the ranks that differ)."""
        cache = ctx.op_state(OP).data.setdefault("ks", {})
        ks = cache.get((sig, K))
        if ks is not None:
            return ks
        crc = zlib.crc32(repr(sig).encode()) & 0x7FFFFFFF
        allv = np.asarray(ctx.bounded_allgather(np.array([crc, K], dtype=np.int64), WHAT, ctx.node_comm))
        if not np.all(allv[:, 0] == crc):  # (every rank saw the same digests: every rank raises)
            bad = [i for i, x in enumerate(allv[:, 0].tolist()) if x != crc]
            raise ValueError(f"{WHAT}: local ranks disagree on the call: this rank (local rank {ctx.local_rank}) has "
                             f"{sig}, local ranks {bad} have other calls (signature digests "
                             f"{[int(allv[i, 0]) for i in bad]}, this rank's {crc})")
        ks = cache[(sig, K)] = tuple(int(k) for k in allv[:, 1])
        return ks

    def compile(self, ctx, call):
        """Exchange K_r, plan, and compile the fused kernel before the ranks agree: a rank compiling for
        seconds then delays the host agreement (bounded, waited for by every rank), never a peer's kernel."""
        sig = self._local_signature(ctx, call)
        ks = self._exchange_ks(ctx, sig, call.K) if ctx.local_size > 1 else (call.K,)
        opts = call.options
        call.local_sig = sig
        call.plan = make_plan(call.m_sizes, call.N, ks, ctx.local_rank, b_layout=call.b_layout,
                              in_dtype=call.a.dtype.name, out_dtype=call.o.dtype.name, sms=ctx.sm_count,
                              options=opts, deterministic=call.deterministic)
        if call.plan.path == "fused":
            fused_kernel(ctx, call.plan)

    def agree(self, ctx, call):
        p = call.plan
        return ctx.agree(WHAT, (call.local_sig, p.Ks, p.path, p.config, p.partial_dtype), ctx.node_comm)

    def plan(self, ctx, call, digest):
        return replace(call.plan, digest=digest)

    def bind(self, ctx, call, p: RsPlan) -> BoundCall:
        if p.path == "empty":
            return _FnBound(p, lambda stream, c: None)
        if p.path == "gemm":
            return _FnBound(p, lambda stream, c: gemm(c.a, c.b, c.o, b_layout=c.b_layout, stream=stream))
        if p.path == "unfused":
            return _UnfusedBound(ctx, call, p)
        return _FusedBound(ctx, call, p)


_OP = GemmReduceScatter()


def gemm_reduce_scatter(ctx, a, b, out=None, *, b_layout: str = "kn", out_dtype: str | None = None,
                        deterministic: bool = False, stream=None, options: GemmRsOptions | None = None):
    """Row-parallel GEMM + ReduceScatter over the local ranks: returns this rank's rows of ``sum_r A_r @ B_r``.

    Local rank r (of ``P = ctx.local_size``, one node; ``ctx.num_nodes`` must be 1) holds ``a`` = ``A_r``
    ``[M, K_r]`` (M the same on every rank, K_r its own share of the reduction) and ``b`` = ``B_r``,
    ``[K_r, N]`` for ``b_layout="kn"`` or ``[N, K_r]`` for "nk" (N the same on every rank); both bf16 or
    both fp16, any row strides, unit stride along the last axis, on ``ctx``'s GPU.  Rank r keeps rows
    ``[offs[r], offs[r+1])`` of the ``[M, N]`` sum: M split as evenly as possible (the first M % P ranks
    one row more) or ``options.m_sizes``.  ``out``: ``[M_r, N]`` of ``out_dtype`` (default a's; bf16,
    fp16 or fp32), unit column stride, any row stride, not overlapping ``a`` or ``b``; allocated when
    None.  Sums accumulate in fp32.  ``deterministic``: bit-identical results run after run (every path
    sums in a fixed order already, so this costs nothing).  ``stream``: any stream-like object or raw
    handle (None: the legacy default stream).  ``options``: :class:`GemmRsOptions` (path, tile config,
    partial dtype, row split, cost model), equal on every rank.  The path that ran:
    ``ctx.last_plan("gemm_rs")``.  Every rank must make the same calls in the same order.  No host
    synchronization; CUDA-graph capturable once a call of the same shape ran outside the capture.
    Returns ``out``."""
    return _OP(ctx, a, b, out, b_layout, out_dtype, deterministic, stream, options)
