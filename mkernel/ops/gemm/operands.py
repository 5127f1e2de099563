"""The GEMM's operands: the checks every GEMM-based op makes, A and B as TMA reads them (staged into dense
zero-padded copies where TMA cannot read them in place), the output (checks, allocation, its tensor map and
launch fields), and the split-K workspace.  docs/gemm.md, section "Operand staging (host side)".
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from cuda.bindings import driver as cu

from ...core.arrays import DeviceArray
from ...core.driver import check
from ...core.interop import as_device_array
from ...core.streams import is_capturing, stream_handle
from ...core.tensormap import TensorMapArg, encode_tiled
from ...core.util import round_up
from . import kernels
from .configs import IN_DTYPES, LAYOUTS, OUT_DTYPES, TileConfig
from .swiglu import pair_width

__all__ = ["check_operands", "check_arrays", "check_device", "prepare_out", "a_operand", "b_operand", "c_map",
           "point_out", "OperandArg", "a_arg", "b_arg", "gate_up_arg", "c_arg", "vec_ok", "row_misaligned", "array_key",
           "out_layout_key", "layout_key", "zero_fill_launch", "split_workspace", "ClearBeforeFirstUse"]


def check_operands(a, b, b_layout: str, *, what: str, a_name: str = "a", grouped: bool = False, stream=None):
    """The checks every GEMM-based op makes of its operands, before any launch.

    ``a``: 2-D ``[M, K]``; ``b``: ``[K, N]`` / ``[N, K]`` ("kn" / "nk"), or ``[G, K, N]`` / ``[G, N, K]``
    when ``grouped``; both bf16 or both fp16; dimensions below 2**31.  ``what`` prefixes every message
    (e.g. ``"mkernel.gemm"``).  Returns ``(A, B, M, K, N, G)`` (``G`` = 1 when not grouped)."""
    if b_layout not in LAYOUTS:
        raise ValueError(f"{what}: b_layout must be 'kn' or 'nk', got {b_layout!r}")
    short = what.rsplit(".", 1)[-1]
    A = as_device_array(a, name=f"{short}: {a_name}", stream=stream)
    B = as_device_array(b, name=f"{short}: b", stream=stream)
    return check_arrays(A, B, b_layout, what=what, a_name=a_name, grouped=grouped)


def check_arrays(A: DeviceArray, B: DeviceArray, b_layout: str, *, what: str, a_name: str = "a",
                 grouped: bool = False):
    """:func:`check_operands` of already imported arrays.  Returns ``(A, B, M, K, N, G)``."""
    if b_layout not in LAYOUTS:
        raise ValueError(f"{what}: b_layout must be 'kn' or 'nk', got {b_layout!r}")
    b_nd = 3 if grouped else 2
    if A.ndim != 2 or B.ndim != b_nd:
        raise ValueError(f"{what}: {a_name} must be 2-D and b {b_nd}-D, got shapes {tuple(A.shape)} and "
                         f"{tuple(B.shape)}")
    for x, name in ((A, a_name), (B, "b")):
        if x.dtype.name not in IN_DTYPES:
            raise TypeError(f"{what}: {name} has dtype {x.dtype.name}; expected one of {', '.join(IN_DTYPES)}")
    if B.dtype != A.dtype:
        raise TypeError(f"{what}: {a_name} is {A.dtype.name} but b is {B.dtype.name}; they must match")
    M, K = A.shape
    G = B.shape[0] if grouped else 1
    Kb, N = B.shape[-2:] if b_layout == "kn" else B.shape[-2:][::-1]
    if Kb != K:
        raise ValueError(f"{what}: inner dimensions differ: {a_name} is {tuple(A.shape)}, b is {tuple(B.shape)} "
                         f"(b_layout={b_layout!r})")
    if max(M, N, K, G) >= 2**31:
        raise ValueError(f"{what}: dimensions must be below 2**31")
    return A, B, M, K, N, G


def check_device(arrays, names) -> int:
    """The device of ``arrays`` (all on one, else ValueError naming them by ``names``)."""
    dev = arrays[0].device
    for x, n in zip(arrays, names):
        if x.device != dev:
            raise ValueError(f"mkernel.gemm: {n} is on cuda:{x.device}, {names[0]} on cuda:{dev}")
    return dev


def prepare_out(out, out_dtype, in_dtype: str, shape, device: int):
    """``out`` checked against ``shape`` / ``out_dtype`` (unit column stride, any row stride), or a new array
    of ``out_dtype`` (default ``in_dtype``) when it is None."""
    if out is None:
        od = out_dtype or in_dtype
        if od not in OUT_DTYPES:
            raise TypeError(f"mkernel.gemm: out_dtype {od} not in {OUT_DTYPES}")
        return DeviceArray.empty(shape, od, device=device)
    o = out
    if o.dtype.name not in OUT_DTYPES:
        raise TypeError(f"mkernel.gemm: out has dtype {o.dtype.name}; expected one of {', '.join(OUT_DTYPES)}")
    if out_dtype is not None and o.dtype.name != out_dtype:
        raise TypeError(f"mkernel.gemm: out has dtype {o.dtype.name} but out_dtype={out_dtype}")
    if tuple(o.shape) != tuple(shape):
        raise ValueError(f"mkernel.gemm: out has shape {tuple(o.shape)}, expected {tuple(shape)}")
    if shape[1] > 1 and o.strides[1] != 1:
        raise ValueError("mkernel.gemm: out must have a unit column stride (row-major rows)")
    if shape[0] > 1 and o.strides[0] < shape[1]:
        raise ValueError(f"mkernel.gemm: out row stride {o.strides[0]} is smaller than N={shape[1]}")
    return o


def array_key(x: DeviceArray) -> tuple:
    """What a plan depends on of an operand: pointer, shape, strides, dtype."""
    return (x.ptr, tuple(x.shape), tuple(x.strides), x.dtype.name)


def layout_key(x: DeviceArray) -> tuple:
    """What a bound GEMM call depends on of an array but its address: shape, strides, dtype, device, and the
    address modulo 16 (TMA reads in place or stages; vector stores): a call with another array of the same
    key re-points the bound call."""
    return (x.shape, x.strides, x.dtype, x.device, x.ptr % 16)


def out_layout_key(O: DeviceArray) -> tuple:
    """What a GEMM plan depends on of its output besides the address: shape, strides, dtype, and
    whether the address allows 16-byte vectors / a TMA map (a plan re-pointed at another output of
    the same key launches the same code)."""
    return (tuple(O.shape), tuple(O.strides), O.dtype.name, O.ptr % 16 == 0)


# --------------------------------------------------------------------------------------------
# A and B as TMA reads them
# --------------------------------------------------------------------------------------------
@dataclass
class _Operand:
    """A TMA-ready view: ptr, dims (innermost first) and byte strides of dims[1:]."""

    ptr: int
    dims: tuple
    strides: tuple
    staging: object = None  # DeviceArray holding the padded copy, or None
    copy: tuple | None = None  # (batch, rows, cols, cols_p, dst_ld, sb, sr, sc, src_ptr)


def _tma_operand(x: DeviceArray, batch: int, rows: int, cols: int, sb: int, sr: int, sc: int) -> _Operand:
    """View of x as [batch, rows, cols] (element strides sb, sr, sc) with `cols` contiguous.

    Read in place when TMA allows (16-byte aligned base and strides, unit inner stride), else staged
    into a dense [batch, rows, roundup(cols, 16)] zero-padded copy.
    """
    isz = x.dtype.itemsize
    row_b, bat_b = _row_bytes(x, batch, rows, cols, sb, sr)
    if _in_place(x, batch, rows, cols, sb, sr, sc):
        return _Operand(x.ptr, (cols, rows, batch), (row_b, bat_b))
    cols_p = round_up(cols, 16)  # (rows a multiple of 32 bytes: see row_misaligned)
    buf = DeviceArray.empty((batch, rows, cols_p), x.dtype.name, device=x.device)
    row_b = cols_p * isz
    return _Operand(buf.ptr, (cols, rows, batch), (row_b, row_b * rows), buf,
                    (batch, rows, cols, cols_p, cols_p, sb, sr, sc, x.ptr))


def _row_bytes(x: DeviceArray, batch: int, rows: int, cols: int, sb: int, sr: int) -> tuple[int, int]:
    isz = x.dtype.itemsize
    row_b = sr * isz if rows > 1 else round_up(cols * isz, 16)
    return row_b, (sb * isz if batch > 1 else row_b * rows)


def _in_place(x: DeviceArray, batch: int, rows: int, cols: int, sb: int, sr: int, sc: int) -> bool:
    """Whether TMA can read x as [batch, rows, cols] (element strides sb, sr, sc) in place."""
    row_b, bat_b = _row_bytes(x, batch, rows, cols, sb, sr)
    return ((sc == 1 or cols == 1) and x.ptr % 16 == 0 and row_b > 0 and bat_b > 0 and row_b % 16 == 0
            and bat_b % 16 == 0 and (rows == 1 or sr >= cols) and (batch == 1 or sb >= rows * sr))


def row_misaligned(x: DeviceArray, rows: int, cols: int) -> bool:
    """Whether TMA reads 2-D operand x ([rows, cols], cols contiguous) in place from rows an odd multiple
    of 16 bytes apart (heuristic.load_bound; a staged copy's rows are 32-byte multiples)."""
    sr, sc = x.strides
    return rows > 1 and _in_place(x, 1, rows, cols, 0, sr, sc) and (sr * x.dtype.itemsize) % 32 == 16


def _pad_launch(op: _Operand, in_dtype: str, out_dtype: str, device: int):
    batch, rows, cols, cols_p, dst_ld, sb, sr, sc, src = op.copy
    k = kernels.get(in_dtype, out_dtype, 1, "mk_pad_copy_u16")
    total = batch * rows * cols_p
    grid = max(1, min((total + 255) // 256, 8 * kernels.num_sms(device)))
    args = [ctypes.c_void_p(op.ptr), ctypes.c_void_p(src)] + [ctypes.c_int64(v) for v in
                                                             (batch, rows, cols, cols_p, dst_ld, sb, sr, sc)]
    return (k, grid, 256, args)


def zero_fill_launch(out, M: int, N: int, ldc: int, in_dtype: str, device: int):
    """The launch (kernel, grid, block, args) writing zeros to ``out`` (``.ptr``, ``.dtype``) [M, N], row
    stride ldc: the K = 0 GEMM."""
    name = "mk_pad_copy_u32" if out.dtype.itemsize == 4 else "mk_pad_copy_u16"
    k = kernels.get(in_dtype, out.dtype.name, 1, name)
    grid = max(1, min((M * N + 255) // 256, 8 * kernels.num_sms(device)))
    args = [ctypes.c_void_p(out.ptr), ctypes.c_void_p(0)] + [ctypes.c_int64(v) for v in (1, M, N, N, ldc, 0, 0, 0)]
    return (k, grid, 256, args)


def _staging(op: _Operand, in_dtype: str, out_dtype: str, device: int):
    if op.copy is None:
        return [], []
    return [_pad_launch(op, in_dtype, out_dtype, device)], [op.staging]


def a_operand(A: DeviceArray, rows: int, K: int, cfg: TileConfig, in_dtype: str, out_dtype: str, device: int):
    """A ``[rows, K]``: ``(tensor map, staging launches, buffers to keep)``."""
    sa = A.strides
    op = _tma_operand(A, 1, rows, K, 0, sa[0], sa[1])
    # with clusters along N each block loads (and multicasts) one 64-row slab of the A tile
    tma = encode_tiled(op.ptr, in_dtype, op.dims[:2], op.strides[:1], (64, cfg.bm // cfg.cluster_n))
    return tma, *_staging(op, in_dtype, out_dtype, device)


def b_operand(B: DeviceArray, K: int, N: int, b_layout: str, cfg: TileConfig, in_dtype: str, out_dtype: str,
              device: int):
    """B (``[K, N]`` / ``[N, K]``, or ``[G, ...]`` for grouped problems) as every GEMM kernel reads it:
    ``(tensor map, staging launches, buffers to keep)`` (staged when TMA cannot read it in place)."""
    sb = tuple(B.strides) if B.ndim == 3 else (0,) + tuple(B.strides)
    G = B.shape[0] if B.ndim == 3 else 1
    if b_layout == "kn":  # [G, K, N]: N contiguous, 64 x 64 boxes
        op = _tma_operand(B, G, K, N, *sb)
        box = (64, 64, 1)
    else:  # [G, N, K]: K contiguous, 64 x BN boxes
        op = _tma_operand(B, G, N, K, *sb)
        box = (64, cfg.b_box_rows, 1)
    tmb = encode_tiled(op.ptr, in_dtype, op.dims, op.strides, box)
    return tmb, *_staging(op, in_dtype, out_dtype, device)


class OperandArg:
    """An operand as a bound launch reads it: ``map`` (a :class:`TensorMapArg`, the launch argument) over
    the operand itself, or over a padded staging copy that ``stage`` -- a launch ``(kernel, grid, block,
    args)`` whose source pointer is ``args[1]`` -- fills first; ``keep``: buffers the launches use.
    :meth:`point` re-points it at another array of the same layout."""

    __slots__ = ("map", "stage", "keep")

    def __init__(self, map_: TensorMapArg, stage, keep: list):
        self.map, self.stage, self.keep = map_, stage, keep

    def point(self, ptr: int) -> None:
        if self.stage is not None:
            self.stage[3][1].value = ptr
        else:
            self.map.point(ptr)


def _operand_arg(op: _Operand, in_dtype: str, box, out_dtype: str, device: int) -> OperandArg:
    m = TensorMapArg(op.ptr, in_dtype, op.dims[:len(box)], op.strides[:len(box) - 1], box)
    stage, keep = _staging(op, in_dtype, out_dtype, device)
    return OperandArg(m, stage[0] if stage else None, keep)


def a_arg(A: DeviceArray, rows: int, K: int, cfg: TileConfig, in_dtype: str, out_dtype: str, device: int) -> OperandArg:
    """:func:`a_operand` as a re-pointable :class:`OperandArg`."""
    sa = A.strides
    op = _tma_operand(A, 1, rows, K, 0, sa[0], sa[1])
    return _operand_arg(op, in_dtype, (64, cfg.bm // cfg.cluster_n), out_dtype, device)


def b_arg(B: DeviceArray, K: int, N: int, b_layout: str, cfg: TileConfig, in_dtype: str, out_dtype: str,
          device: int) -> OperandArg:
    """:func:`b_operand` as a re-pointable :class:`OperandArg`."""
    sb = tuple(B.strides) if B.ndim == 3 else (0,) + tuple(B.strides)
    G = B.shape[0] if B.ndim == 3 else 1
    if b_layout == "kn":
        op, box = _tma_operand(B, G, K, N, *sb), (64, 64, 1)
    else:
        op, box = _tma_operand(B, G, N, K, *sb), (64, cfg.b_box_rows, 1)
    return _operand_arg(op, in_dtype, box, out_dtype, device)


def gate_up_arg(W: DeviceArray, K: int, F: int, cfg: TileConfig, in_dtype: str, out_dtype: str,
                device: int) -> OperandArg:
    """A gate/up weight ``W [G, 2F, K]`` (gate rows ``[0, F)``, up rows ``[F, 2F)``) as the SwiGLU kernel reads
    it (MkGateUpB, cuda_src/gemm/mk_gemm_swiglu.cuh): the 5-D view ``{K, P, F / P, 2, G}`` (P = the config's
    pair width; byte strides increasing) whose box ``{64, P, 1, 2, 1}`` is chunk n's P gate rows then its P up
    rows.  Staged like any B operand when TMA cannot read W in place."""
    sb = tuple(W.strides) if W.ndim == 3 else (0,) + tuple(W.strides)
    G = W.shape[0] if W.ndim == 3 else 1
    op = _tma_operand(W, G, 2 * F, K, *sb)
    P = pair_width(cfg)
    row_b, bat_b = op.strides
    m = TensorMapArg(op.ptr, in_dtype, (K, P, F // P, 2, G), (row_b, P * row_b, F * row_b, bat_b), (64, P, 1, 2, 1))
    stage, keep = _staging(op, in_dtype, out_dtype, device)
    return OperandArg(m, stage[0] if stage else None, keep)


# --------------------------------------------------------------------------------------------
# the output
# --------------------------------------------------------------------------------------------
def vec_ok(O: DeviceArray, ldc: int, M: int) -> int:
    """MkGemmArgs::c_vec_ok: 1 where C's base is aligned to two elements and its row stride even."""
    return int(O.ptr % (2 * O.dtype.itemsize) == 0 and (ldc % 2 == 0 or M == 1))


def _c_tma_ok(O: DeviceArray, N: int, ldc: int, cfg: TileConfig, epilogue: str) -> int:
    isz = O.dtype.itemsize
    n16 = N - N % (16 // isz)
    return int(cfg.tma_store and O.ptr % 16 == 0 and (ldc * isz) % 16 == 0 and n16 > 0 and epilogue != "registers")


def c_arg(O: DeviceArray, M: int, N: int, ldc: int, cfg: TileConfig, epilogue: str = "tma"):
    """``(TensorMapArg or None, c_tma)``: :func:`c_map` for a bound launch (None: the kernel stores from
    registers; any valid map goes in its place)."""
    if not _c_tma_ok(O, N, ldc, cfg, epilogue):
        return None, 0
    isz = O.dtype.itemsize
    n16 = N - N % (16 // isz)
    return TensorMapArg(O.ptr, O.dtype.name, (n16, M), (ldc * isz,), (128 // isz, 64)), 1


def c_map(O: DeviceArray, M: int, N: int, ldc: int, cfg: TileConfig, fallback: bytes, epilogue: str = "tma"):
    """The C tensor map every GEMM kernel takes, and c_tma (1: the epilogue stores through it).

    A config with TMA-store staging uses it when C's base and row stride are 16-byte multiples
    (``epilogue="registers"`` turns it off: benchmarks compare both epilogues); otherwise the kernel gets
    ``fallback`` (any valid map) and stores from registers."""
    isz = O.dtype.itemsize
    # A TMA store writes whole 16-byte pieces of a row: the map ends at N rounded down to 16 bytes
    # (n16) and the epilogue stores the columns past it from registers (MkEpilogueTmaStore), so a
    # padded output row is never written past N.
    n16 = N - N % (16 // isz)
    if not _c_tma_ok(O, N, ldc, cfg, epilogue):
        return fallback, 0
    return encode_tiled(O.ptr, O.dtype.name, (n16, M), (ldc * isz,), (128 // isz, 64)), 1


def point_out(args, O: DeviceArray, M: int, N: int, ldc: int, cfg: TileConfig, tma_a) -> object:
    """Point a launch-argument struct's output fields (``c``, ``c_vec_ok``, ``c_tma``: the plain GEMM's
    and the fused kernels' alike) at ``O`` (in place); returns O's C tensor map."""
    args.c, args.c_vec_ok = O.ptr, vec_ok(O, ldc, M)
    tmc, args.c_tma = c_map(O, M, N, ldc, cfg, tma_a)
    return tmc


# --------------------------------------------------------------------------------------------
# split-K workspace
# --------------------------------------------------------------------------------------------
def split_workspace(n_split: int, tile_elems: int, device: int):
    """(buffer, sums ptr, counters ptr) of split-K over ``n_split`` tiles of ``tile_elems`` outputs: fp32
    running sums then int32 counters, in one buffer so one memset of ``buffer.size`` 32-bit words
    clears both (before the first call; the kernels leave them zero)."""
    ws = DeviceArray.empty((n_split * tile_elems + n_split,), "int32", device=device)
    return ws, ws.ptr, ws.ptr + 4 * n_split * tile_elems


def _clear_i32(ptr: int, n: int, stream) -> None:
    check(cu.cuMemsetD32Async(ptr, 0, n, cu.CUstream(stream_handle(stream))))


class ClearBeforeFirstUse:
    """A buffer of ``n`` 32-bit words at ``ptr`` that must be zero before a kernel first uses it (split-K
    sums and counters: the kernels leave them zero after every call).  Calling it clears it on the
    stream (ordered, no host sync) until a call outside a CUDA-graph capture has done so -- a captured
    clear only happens when the graph is launched."""

    def __init__(self, ptr: int, n: int):
        self.ptr, self.n, self.pending = ptr, n, True

    def __call__(self, stream, capturing: bool | None = None) -> None:
        if self.pending:
            _clear_i32(self.ptr, self.n, stream)
            self.pending = is_capturing(stream) if capturing is None else capturing
