"""Host side shared by the GEMMs whose output tiles travel between the local ranks (the device pieces are
``cuda_src/gemm/mk_gemm_comm.cuh``): GEMM+ReduceScatter (:mod:`mkernel.ops.gemm_rs`) and GEMM+AllReduce
(:mod:`mkernel.ops.gemm_ar`).

* mirrors of mk_gemm_comm.cuh's structs (:class:`RsLayout`, :class:`GatherLayout`, :class:`OwnerRows`), the
  flag rows every workspace of these ops has per source (``FLAGS_PER_SOURCE``), and the owner scheduler's
  tile order (:func:`tile_order`, MkOwnerScheduler);
* the prepare / validate pieces of the two ops' calls: :func:`parse_operands`, :func:`make_out`,
  :func:`validate_operands`, :func:`exchange_ks` (every local rank's K_r, exchanged once per signature);
* bound calls: :class:`FusedBound` (one cooperative launch of a fused kernel, re-pointed at each call's
  arrays), :class:`TmaOperand` (an operand read in place through a re-pointable tensor map, or staged),
  :class:`FnBound`, :func:`resident_kernel`.

``dev`` arguments are the op's module: its ``TensorMapArg`` and ``copy_2d`` attributes are what the bound
calls use (the CPU tests replace them there).
"""
from __future__ import annotations

import ctypes
import math
import zlib
from dataclasses import dataclass

import numpy as np
from cuda.bindings import driver as cu

from ..core.arrays import DeviceArray
from ..core.compiler import kernel
from ..core.driver import check
from ..core.interop import as_device_array, require
from ..core.tensormap import tma_compatible
from ..core.util import round_up
from ..dist.signals import MAX_CHUNKS
from .base import BoundCall
from . import gemm as G  # the GEMM package's public planning API

__all__ = ["MAXP", "FLAG_ROWS_PER_SOURCE", "FLAGS_PER_SOURCE", "LAYOUTS", "RsLayout", "GatherLayout", "OwnerRows",
           "row_offsets", "owner_tiles", "raster", "Tile", "tile_order", "units_of_worker", "copy_2d", "TmaOperand", "FnBound",
           "FusedBound", "resident_kernel", "exchange_ks", "parse_operands", "make_out",
           "validate_operands", "gemm_options"]

MAXP = 16  # local ranks (the kernels keep the owner in 4 bits of the tile id)
# Ready flags per source: FLAG_ROWS_PER_SOURCE rows of MAX_CHUNKS, one flag per tile of an owner (or of the
# whole output: the one-shot all-reduce); plans never exceed it (32768: e.g. 16384 x 65536 output rows x
# columns of 128 x 256 tiles).
FLAG_ROWS_PER_SOURCE = 32
FLAGS_PER_SOURCE = FLAG_ROWS_PER_SOURCE * MAX_CHUNKS
LAYOUTS = ("kn", "nk")


class RsLayout(ctypes.Structure):
    """``struct MkRsLayout`` of mk_gemm_comm.cuh."""

    _fields_ = [("consumed_off", ctypes.c_uint64), ("flags_off", ctypes.c_uint64), ("data_off", ctypes.c_uint64),
                ("slot_bytes", ctypes.c_uint64), ("flag_stride", ctypes.c_int32), ("pad", ctypes.c_int32)]


class GatherLayout(ctypes.Structure):
    """``struct MkGatherLayout`` of mk_gemm_comm.cuh."""

    _fields_ = [("flags_off", ctypes.c_uint64), ("data_off", ctypes.c_uint64), ("slot_bytes", ctypes.c_uint64)]


class OwnerRows(ctypes.Structure):
    """``struct MkOwnerRows`` of mk_gemm_comm.cuh."""

    _fields_ = [("P", ctypes.c_int32), ("me", ctypes.c_int32), ("N", ctypes.c_int32), ("group_m", ctypes.c_int32),
                ("offs", ctypes.c_int32 * (MAXP + 1))]


# --------------------------------------------------------------------------------------------
# owners' tiles (MkOwnerScheduler)
# --------------------------------------------------------------------------------------------
_DETERMINISTIC_GEMM = G.GemmOptions(deterministic=True)


def gemm_options(call):
    """The options of the plain GEMM a fused op runs (its one-rank and unfused paths): deterministic when the
    call is (docs/gemm.md, "Determinism"), else the defaults (None)."""
    return _DETERMINISTIC_GEMM if call.deterministic else None


def row_offsets(m_sizes) -> tuple:
    """``offs`` with owner j's rows at ``[offs[j], offs[j+1])``."""
    offs = [0]
    for m in m_sizes:
        offs.append(offs[-1] + int(m))
    return tuple(offs)


def owner_tiles(m: int, N: int, bm: int, bn: int) -> int:
    """Output tiles of an owner of m rows (its own tile grid: no tile straddles two owners)."""
    return math.ceil(m / bm) * math.ceil(N / bn)


def raster(i: int, num_m: int, num_n: int, group_m: int) -> tuple:
    """(tile row, tile column) of tile i in super-rows of group_m tile-rows (mk_gemm.cuh mk_raster)."""
    per_group = group_m * num_n
    gid = i // per_group
    first_m = gid * group_m
    gsz = min(num_m - first_m, group_m)
    local = i - gid * per_group
    return first_m + local % gsz, local // gsz


@dataclass(frozen=True)
class Tile:
    """One tile of the owner scheduler: owner, tile coordinates in the owner's grid, the flag index
    (``tm * num_n + tn``), absolute first row (of A and of the full output), rows, first column, columns."""

    owner: int
    tm: int
    tn: int
    index: int
    row0: int
    rows: int
    col0: int
    cols: int


def tile_order(m_sizes, N: int, bm: int, bn: int, me: int, group_m: int | None = None) -> list:
    """Rank ``me``'s tiles in the kernels' unit order (mk_gemm_comm.cuh MkOwnerScheduler): owner me+1's
    grid first, ..., this rank's own last; unit u runs on worker u % workers."""
    group_m = G.GROUP_M if group_m is None else group_m
    P, offs = len(m_sizes), row_offsets(m_sizes)
    num_n = math.ceil(N / bn)
    out = []
    for k in range(1, P + 1):
        owner = (me + k) % P
        rows = offs[owner + 1] - offs[owner]
        num_m = math.ceil(rows / bm)
        for i in range(num_m * num_n):
            tm, tn = raster(i, num_m, num_n, group_m)
            out.append(Tile(owner, tm, tn, tm * num_n + tn, offs[owner] + tm * bm, min(bm, rows - tm * bm), tn * bn,
                            min(bn, N - tn * bn)))
    return out


def units_of_worker(lo: int, hi: int, w: int, W: int) -> int:
    """Units u in [lo, hi) with u % W == w (units dealt round robin over W workers)."""
    def upto(n):  # u in [0, n) with u % W == w
        return 0 if n <= w else (n - 1 - w) // W + 1
    return upto(hi) - upto(lo)


# --------------------------------------------------------------------------------------------
# prepare / validate
# --------------------------------------------------------------------------------------------
def parse_operands(what: str, a, b, b_layout: str, stream: int):
    """``(A, B, M, K, N)`` of an ``A [M, K] @ B`` call (B ``[K, N]`` "kn" or ``[N, K]`` "nk") as DeviceArrays;
    ValueError for a bad layout, a non-2-D operand or K differing."""
    if b_layout not in LAYOUTS:
        raise ValueError(f"{what}: b_layout must be 'kn' or 'nk', got {b_layout!r}")
    A = as_device_array(a, name=f"{what}: a", stream=stream)
    B = as_device_array(b, name=f"{what}: b", stream=stream)
    if A.ndim != 2 or B.ndim != 2:
        raise ValueError(f"{what}: a and b must be 2-D, got shapes {tuple(A.shape)} and {tuple(B.shape)}")
    M, K = A.shape
    Kb, N = B.shape if b_layout == "kn" else B.shape[::-1]
    if Kb != K:
        raise ValueError(f"{what}: a is {tuple(A.shape)} but b is {tuple(B.shape)} (b_layout={b_layout!r}): "
                         f"K differs ({K} vs {Kb})")
    return A, B, M, K, N


def make_out(what: str, out, out_dtype, A: DeviceArray, shape: tuple, device: int, stream: int):
    """``(O, result)``: ``out`` as a DeviceArray and what the op returns (``out`` itself), or a fresh ``shape``
    array of ``out_dtype`` (default a's) when ``out`` is None.  TypeError for a bad out_dtype or, before
    allocating, a bad a dtype."""
    if out_dtype is not None and out_dtype not in G.OUT_DTYPES:
        raise TypeError(f"{what}: out_dtype must be one of {G.OUT_DTYPES}, got {out_dtype!r}")
    if out is None:
        if A.dtype.name not in G.IN_DTYPES:  # (before allocating an output for a call that cannot run)
            raise TypeError(f"{what}: a must be {' or '.join(G.IN_DTYPES)}, got {A.dtype.name}")
        O = DeviceArray.empty(shape, out_dtype or A.dtype.name, device=device)
        return O, O
    return as_device_array(out, name=f"{what}: out", stream=stream), out


def validate_operands(ctx, call, what: str, out_shape: tuple, out_desc: str) -> None:
    """Every check of a fused comm-GEMM call's arrays, after the op's device check (require_gemm_device):
    (``call.a``, ``call.b``, ``call.o``, ``call.M / K / N``,
    ``call.out_dtype``) on one node: dtypes, devices, unit inner strides, row strides, sizes, out writable
    and of ``out_shape`` (``out_desc`` says what it holds)."""
    if ctx.num_nodes != 1:
        raise ValueError(f"{what}: runs among the ranks of one node (NVLink); this context has "
                         f"{ctx.num_nodes} nodes")
    A = require(call.a, f"{what}: a", dtypes=G.IN_DTYPES, ndim=2, contiguous=False, device=ctx.device)
    B = require(call.b, f"{what}: b", ndim=2, contiguous=False, device=ctx.device)
    if B.dtype != A.dtype:
        raise TypeError(f"{what}: a is {A.dtype.name} but b is {B.dtype.name}; they must match")
    for X, nm, inner in ((A, "a", call.K), (B, "b", B.shape[1])):
        if inner > 1 and X.shape[0] > 0 and X.strides[1] != 1:
            raise ValueError(f"{what}: {nm} must have a unit stride along its last axis, got strides {X.strides}")
        if X.shape[0] > 1 and X.strides[0] < X.shape[1]:
            raise ValueError(f"{what}: {nm}'s row stride {X.strides[0]} is smaller than its row ({X.shape[1]})")
    if max(call.M, call.N, call.K) >= 2**31:
        raise ValueError(f"{what}: dimensions must be below 2**31")
    O = require(call.o, f"{what}: out", dtypes=G.OUT_DTYPES, ndim=2, contiguous=False, device=ctx.device,
                writable=True)
    if call.out_dtype is not None and O.dtype.name != call.out_dtype:
        raise TypeError(f"{what}: out is {O.dtype.name} but out_dtype={call.out_dtype}")
    if tuple(O.shape) != tuple(out_shape):
        raise ValueError(f"{what}: out must have shape {tuple(out_shape)} ({out_desc}), got {tuple(O.shape)}")
    if out_shape[1] > 1 and out_shape[0] > 0 and O.strides[1] != 1:
        raise ValueError(f"{what}: out must have a unit column stride, got strides {O.strides}")
    if out_shape[0] > 1 and O.strides[0] < out_shape[1]:
        raise ValueError(f"{what}: out's row stride {O.strides[0]} is smaller than N={out_shape[1]}")


def exchange_ks(ctx, op: str, what: str, sig: tuple, K: int) -> tuple:
    """Every local rank's K_r for a call of local signature ``sig``: one bounded exchange per distinct
    (signature, K_r), which also checks that every rank makes the same call (ValueError naming the ranks
    that differ)."""
    cache = ctx.op_state(op).data.setdefault("ks", {})
    ks = cache.get((sig, K))
    if ks is not None:
        return ks
    crc = zlib.crc32(repr(sig).encode()) & 0x7FFFFFFF
    allv = np.asarray(ctx.bounded_allgather(np.array([crc, K], dtype=np.int64), what, ctx.node_comm))
    if not np.all(allv[:, 0] == crc):  # (every rank saw the same digests: every rank raises, no more waiting)
        bad = [i for i, x in enumerate(allv[:, 0].tolist()) if x != crc]
        raise ValueError(f"{what}: local ranks disagree on the call: this rank (local rank {ctx.local_rank}) has "
                         f"{sig}, local ranks {bad} have other calls (signature digests "
                         f"{[int(allv[i, 0]) for i in bad]}, this rank's {crc})")
    ks = cache[(sig, K)] = tuple(int(k) for k in allv[:, 1])
    return ks


# --------------------------------------------------------------------------------------------
# bound calls
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


def resident_kernel(ctx, op: str, what: str, source: str, defines: dict, name: str, cfg, key: tuple):
    """Kernel ``name`` of ``source`` compiled with ``defines``, checked once per context and ``key`` to fit one
    block per SM (a cooperative launch needs every block resident)."""
    k = kernel(source, defines, name)
    seen = ctx.op_state(op).data.setdefault("resident", set())
    if key not in seen:
        if k.max_active_blocks_per_sm(cfg.threads, cfg.smem) < 1:
            raise RuntimeError(f"{what}: the fused kernel (config {cfg.id}) cannot be resident")
        seen.add(key)
    return k


class FnBound(BoundCall):
    """A bound call that runs ``fn(stream, call)``."""

    def __init__(self, plan, fn):
        self.plan, self._fn = plan, fn

    def run(self, stream, call):
        self._fn(stream, call)


class TmaOperand:
    """A row-major ``[rows, cols]`` operand (unit column stride) as a fused kernel's TMA map of ``dims``
    (innermost first; a third dimension of 1 when ``three_d``) and ``box``: in place, re-pointed each call;
    or, when TMA cannot address it (base or row stride not 16-byte multiples), staged by a 2-D copy into a
    buffer of 16-byte rows that the map covers.  ``dev``: the op's module (``TensorMapArg``, ``copy_2d``)."""

    def __init__(self, X: DeviceArray, rows: int, cols: int, box: tuple, three_d: bool, dev):
        isz = X.dtype.itemsize
        self.dev = dev
        self.rows, self.width = rows, cols * isz
        self.pitch_of = (lambda Y: Y.strides[0] * isz if rows > 1 else self.width)
        self.staged = not tma_compatible(X.ptr, (self.pitch_of(X),))
        pitch = round_up(self.width, 16) if self.staged else self.pitch_of(X)
        self.buffer = DeviceArray.empty((rows * pitch // isz,), X.dtype, device=X.device) if self.staged else None
        base = self.buffer.ptr if self.staged else X.ptr
        dims, strides = (cols, rows), (pitch,)
        if three_d:
            dims, strides = dims + (1,), strides + (pitch * rows,)
        self.map = dev.TensorMapArg(base, X.dtype.name, dims, strides, box)
        self.pitch = pitch

    def point(self, X: DeviceArray, stream: int) -> None:
        if self.staged:
            self.dev.copy_2d(self.buffer.ptr, self.pitch, X.ptr, self.pitch_of(X), self.width, self.rows, stream)
        else:
            self.map.point(X.ptr)


class FusedBound(BoundCall):
    """One cooperative launch of a fused comm-GEMM kernel taking ``(tmA, tmB, tmC, MkComm, args)``, prepared
    once per layout of the arguments; each call re-points the operands (or re-stages them), out's map and
    the ``args`` fields ``c`` / ``c_vec_ok``, takes the op's workspace anew when the context's workspace
    generation moved (another call grew it), then submits.

    ``operands``: ``[(attribute of the call, rows, cols, box, three_d)]`` for tmA and tmB, in that order;
    ``out_rows``: rows of ``call.o`` (its map's and ldc's); ``c_map``: whether the kernel may store out
    through TMA (the config's TMA-store epilogue).  ``args``: the kernel's argument struct, with fields ws,
    peers, c, ldc, c_tma, c_vec_ok (set here) and the rest set by the caller.  ``ws_key`` / ``ws_bytes``: the
    op's workspace (ctx.workspace)."""

    def __init__(self, ctx, call, plan, *, what: str, dev, args, kernel, cfg, grid: int, comm, ws_key,
                 ws_bytes: int, operands, out_rows: int, c_map: bool):
        self.plan, self._ctx, self._what = plan, ctx, what
        self._ws_key, self._ws_bytes = ws_key, ws_bytes
        self._ops = [(attr, TmaOperand(getattr(call, attr), rows, cols, box, three_d, dev))
                     for attr, rows, cols, box, three_d in operands]
        O = call.o
        N = O.shape[1]
        isz = O.dtype.itemsize
        self._out_rows = out_rows
        self._ldc = O.strides[0] if out_rows > 1 else N
        n16 = N - N % (16 // isz)  # a TMA store writes whole 16-byte pieces: the map ends there (gemm's c_map)
        c_tma = (c_map and cfg.tma_store and out_rows > 0 and n16 > 0 and O.ptr % 16 == 0
                 and (self._ldc * isz) % 16 == 0)
        self._c = None
        if c_tma:
            self._c = dev.TensorMapArg(O.ptr, O.dtype.name, (n16, out_rows), (self._ldc * isz,), (128 // isz, 64))
        first = self._ops[0][1].map
        c_arg = self._c.buf if c_tma else ctypes.create_string_buffer(first.raw, 128)  # (any valid map)
        self._args = args
        args.c, args.ldc, args.c_tma, args.c_vec_ok = O.ptr, self._ldc, int(c_tma), self._vec_ok(O)
        self._gen = None
        self._point_workspace(call.stream)
        maps = [op.map.buf for _, op in self._ops]
        self._launch = kernel.prepare(grid, cfg.threads, maps + [c_arg, comm, args], stream=call.stream,
                                      smem=cfg.smem, cooperative=True)
        self.buffers = tuple(op.buffer for _, op in self._ops if op.staged)

    def _point_workspace(self, stream) -> None:
        """The op's workspace as of now (ctx.workspace re-allocates collectively when it must grow, raising
        inside a capture)."""
        ws = self._ctx.workspace(self._ws_key, self._ws_bytes, stream, self._what)
        self._args.ws, self._args.peers = ws.ptr, ws.peer_table
        self._gen = self._ctx.workspace_generation

    def _vec_ok(self, O: DeviceArray) -> int:
        return int(O.ptr % (2 * O.dtype.itemsize) == 0 and (self._ldc % 2 == 0 or self._out_rows == 1))

    def run(self, stream, call):
        if self._ctx.workspace_generation != self._gen:
            self._point_workspace(stream)
        for attr, op in self._ops:
            op.point(getattr(call, attr), stream)
        O = call.o
        if self._c is not None:
            self._c.point(O.ptr)
        a = self._args
        a.c, a.c_vec_ok = O.ptr, self._vec_ok(O)
        self._launch.submit()
