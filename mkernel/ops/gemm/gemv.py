"""Decode-shaped GEMMs: ``C[M, N] = A[M, K] @ B[N, K]^T`` for M <= 16 rows (cuda_src/gemm/gemv.cu).

Such a call is a stream of B (the weights, read once from memory) with almost no arithmetic per byte;
a GEMM tile of 64+ rows wastes most of its tensor-core work and, worse, streams B through one tile per
SM.  ``gemv.cu`` gives every 16 rows of B a block of 8 warps that split K, each lane loading 16
contiguous bytes of two B rows and of one or two A rows per 32-element chunk, a run of chunks in
flight (VARIANTS), and multiplying them on the tensor cores (``mma.sync`` m16n8k16 with B as the
16-row operand); registers are budgeted for two blocks per SM, so one block's loads run while the
other starts up or reduces.

:func:`mkernel.gemm` routes a call here (:func:`plan`) when :func:`supported` (B "nk", M <= 16, K a
multiple of 8, 16-byte aligned operands and row strides) and :func:`worthwhile` (enough 16-row blocks
to occupy half of the SMs, too few GEMM tiles to stream B on most of them: see MIN_BLOCK_FILL);
``MKERNEL_GEMM_GEMV=0`` turns the route off (benchmarks), as does forcing a tile config, a split
factor or ``swap``; calls whose 64-row tiles fill 3/4 of the SMs go to the transposed GEMM plans
first (``heuristic.swap_candidates``: 64 x 16 tiles, 16 stages, faster there -- docs/journal/gemm.md
entries 66, 67).  The launch is a programmatic dependent one (``MKERNEL_GEMM_PDL=0``: plain), as the GEMM
plans' are: it starts while the previous kernel in the stream finishes and waits for it before its
first load.  docs/gemm.md, section "Decode-shaped calls".
"""
from __future__ import annotations

import ctypes
import math

from ...core.arrays import DeviceArray
from ...core.compiler import compile_module, kernel, register_specialization
from .configs import DTYPE_CODES, IN_DTYPES, OUT_DTYPES
from .bound import GemmBound, GemmPlan
from .kernels import usage

SOURCE = "gemm/gemv.cu"
MAX_M = 16
THREADS = 256  # MK_GEMV_THREADS
ROWS = 16  # rows of B (columns of C) per block
# (MK_GEMV_UNROLL, MK_GEMV_MINB) per MK_GEMV_NT: the 32-element K chunks a warp has in flight and the
# blocks per SM the registers are budgeted for: one A tile, 8 chunks; two A tiles (9-16 rows), 4 chunks --
# both two blocks per SM, <= 128 registers (docs/journal/gemm.md entries 48-49).
VARIANTS = {1: (8, 2), 2: (4, 2)}
# Routing: every supported call beats the GEMM tiles (1x8192x8192 35.4 vs 44.0 us; docs/journal/gemm.md
# entries 47-49), but only where its ceil(N / ROWS) blocks give at least MIN_BLOCK_FILL of the SMs one
# (below, a few SMs would stream all of B, where the GEMM path splits K over every SM), and only while
# the GEMM path's unsplit 64 x 256 tiles cover less than ROUTE_MAX_TILE_FILL of the SMs (beyond, they
# stream B as fast, within ~5 %).  With transposed plans on (the default) swap_candidates takes every
# call from ceil(N / 64) >= 0.75 SMs on, so ROUTE_MAX_TILE_FILL decides only under MKERNEL_GEMM_SWAP=0.
MIN_BLOCK_FILL = 0.5
ROUTE_MAX_TILE_FILL = 0.75


def _defines(in_dtype: str, out_dtype: str, nt: int) -> dict:
    unroll, minb = VARIANTS[nt]
    return dict(MK_GEMM_IN=DTYPE_CODES[in_dtype], MK_GEMM_OUT=DTYPE_CODES[out_dtype], MK_GEMV_NT=nt,
                MK_GEMV_UNROLL=unroll, MK_GEMV_MINB=minb)


for _i in IN_DTYPES:
    for _o in OUT_DTYPES:
        for _nt in (1, 2):
            register_specialization(SOURCE, _defines(_i, _o, _nt))


def column_tiles(M: int) -> int:
    """MK_GEMV_NT for ``M`` rows: one 8-column MMA tile of A's rows up to 8, two up to 16."""
    return 1 if M <= 8 else 2


def blocks(N: int) -> int:
    """The launch's grid: one block per ROWS rows of B."""
    return math.ceil(N / ROWS)


def _kernel(in_dtype: str, out_dtype: str, nt: int):
    return kernel(SOURCE, _defines(in_dtype, out_dtype, nt), "mk_gemv_nk")


def _row_ok(x: DeviceArray, rows: int, cols: int) -> bool:
    """x ``[rows, cols]`` readable 16 bytes at a time along its rows: unit column stride, 16-byte aligned
    base and row stride (a single row needs no row stride)."""
    isz = x.dtype.itemsize
    if x.ptr % 16 or (cols > 1 and x.strides[1] != 1):
        return False
    return rows == 1 or (x.strides[0] >= cols and (x.strides[0] * isz) % 16 == 0)


def shape_ok(M: int, N: int, K: int, b_layout: str) -> bool:
    """Whether the kernel takes an ``M x N x K`` call with B ``b_layout``: B "nk" (``[N, K]``),
    1 <= M <= MAX_M, N > 0, K > 0 a multiple of 8."""
    return b_layout == "nk" and 1 <= M <= MAX_M and N > 0 and K > 0 and K % 8 == 0


def supported(A: DeviceArray, B: DeviceArray, M: int, N: int, K: int, b_layout: str) -> bool:
    """Whether ``gemv.cu`` can compute ``A [M, K] @ B`` in place: :func:`shape_ok`, both operands bf16 /
    fp16 with 16-byte aligned bases and row strides."""
    return (shape_ok(M, N, K, b_layout) and A.dtype.name in IN_DTYPES and _row_ok(A, M, K)
            and _row_ok(B, N, K))


def worthwhile(N: int, sms: int) -> bool:
    """Whether to route a supported call here (see MIN_BLOCK_FILL, ROUTE_MAX_TILE_FILL; its row count
    is bounded by :func:`shape_ok`; GemmOptions.gemv turns the route off): the call's ceil(N / ROWS) blocks
    occupy at least MIN_BLOCK_FILL of the ``sms`` SMs and ceil(N / 256) GEMM tiles less than
    ROUTE_MAX_TILE_FILL."""
    return blocks(N) >= MIN_BLOCK_FILL * sms and math.ceil(N / 256) < ROUTE_MAX_TILE_FILL * sms


def bind(A: DeviceArray, B: DeviceArray, O: DeviceArray, M: int, N: int, K: int, stream: int, dependent: bool):
    """The bound call of ``O[M, N] = A @ B^T`` (``supported`` operands; O with unit column stride): one block
    per 16 rows of B, the two-tile variant (MK_GEMV_NT = 2) above 8 rows; ``dependent``: a programmatic
    dependent launch.  Re-pointed at each call's A, B and O."""
    nt = column_tiles(M)
    lda = A.strides[0] if M > 1 else K
    ldb = B.strides[0] if N > 1 else K
    ldc = O.strides[0] if M > 1 else N
    a, b, o = ctypes.c_void_p(A.ptr), ctypes.c_void_p(B.ptr), ctypes.c_void_p(O.ptr)
    args = [a, ctypes.c_int64(lda), b, ctypes.c_int64(ldb), o, ctypes.c_int64(ldc), ctypes.c_int32(M),
            ctypes.c_int32(N), ctypes.c_int32(K)]
    launch = _kernel(A.dtype.name, O.dtype.name, nt).prepare(blocks(N), THREADS, args, stream=stream,
                                                              dependent=dependent)

    def set_ptrs(call):
        a.value, b.value, o.value = call.A.ptr, call.B.ptr, call.O.ptr
    return GemmBound(GemmPlan("gemv", grid=blocks(N), dependent=dependent), [], launch, None, None, set_ptrs, [])


def describe(M: int, N: int, K: int, in_dtype: str, out_dtype: str) -> dict:
    """plan.describe() of a call routed here: config "gemv", bm the MMA column tiles' rows
    (8 or 16), bn the rows of B per block, registers from ptxas, one block per ROWS rows of B."""
    nt = column_tiles(M)
    mod = compile_module(SOURCE, _defines(in_dtype, out_dtype, nt))
    u = usage(mod, "mk_gemv_nk")
    grid = blocks(N)
    return dict(config="gemv", bm=8 * nt, bn=ROWS, stages=0, threads=THREADS, smem=0, pingpong=False,
                tma_store=False, splits=1, split_tiles=0, registers=u.get("registers"),
                spills=u["spill_stores"] + u["spill_loads"] if "spill_stores" in u else None,
                compile_seconds=mod.compile_seconds, cached=mod.cached, tiles=grid, grid=grid)
