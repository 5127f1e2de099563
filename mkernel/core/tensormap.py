"""TMA tensor-map descriptors (``CUtensorMap``) built on the host, as 128 bytes to pass by value.

A kernel takes them as ``const __grid_constant__ MkTensorMap`` parameters (cuda_src/mk_tma.cuh);
:meth:`mkernel.core.launch.Kernel.launch` passes ``bytes`` arguments by value.  Encoding needs the CUDA
driver (``cuTensorMapEncodeTiled``), i.e. a GPU machine, but no current context.

TMA's requirements, checked here with clear messages before the driver sees them:
  * the global base address is 16-byte aligned;
  * every stride (bytes, of dimensions 1..rank-1; dimension 0 is contiguous) is a multiple of 16
    and below 2**40; every dimension is in [1, 2**32];
  * box dimensions are in [1, 256]; with a 128-byte swizzle the inner box row is at most 128 bytes.
Out-of-bounds box elements are zero-filled on loads and skipped on stores.

Encoded maps are memoized (bounded LRU keyed by every argument), so a repeated call with the same
pointers and shapes encodes nothing.  A :class:`TensorMapArg` is a launch argument whose base address
changes from call to call (an op's bound call re-pointed at new arrays of the same layout): the
address word is patched in place when the driver's encoding of it has been verified on this machine
(:func:`address_codec`: the descriptor is linear in the address, checked on probe addresses), and
the map is encoded again otherwise.
"""
from __future__ import annotations

import ctypes
import struct
import threading
from collections import OrderedDict

from cuda.bindings import driver as cu

from ..errors import CudaError
from .driver import driver_version
from .log import log

__all__ = ["encode_tiled", "TensorMapError", "tma_compatible", "clear_cache", "TensorMapArg", "address_codec"]

_DTYPES = {
    "bfloat16": (cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2),
    "float16": (cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2),
    "float32": (cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4),
    "uint16": (cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16, 2),
}
_SWIZZLE = {
    0: (cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE, 0),
    32: (cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B, 32),
    64: (cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B, 64),
    128: (cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B, 128),
}


class TensorMapError(ValueError):
    """The tensor cannot be described by a TMA descriptor (alignment, stride or box limits)."""


def tma_compatible(ptr: int, strides_bytes) -> bool:
    """True if a tensor at ``ptr`` with these outer strides (bytes) satisfies TMA's alignment rules."""
    return ptr % 16 == 0 and all(s % 16 == 0 and 0 < s < (1 << 40) for s in strides_bytes)


_cache: "OrderedDict[tuple, bytes]" = OrderedDict()
_cache_lock = threading.Lock()
_CACHE_MAX = 512


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()


def encode_tiled(ptr: int, dtype: str, dims, strides_bytes, box, *, swizzle: int = 128,
                 l2_promotion: int = 128) -> bytes:
    """Encode a tiled tensor map; returns the 128 descriptor bytes.

    ptr: device address of element (0, ..., 0).  dtype: "bfloat16" | "float16" | "float32" | "uint16".
    dims: extents, innermost (contiguous) first.  strides_bytes: byte strides of dims[1:], in order.
    box: the tile copied per instruction, innermost first.  swizzle: 0, 32, 64 or 128 (bytes).
    l2_promotion: 0, 64, 128 or 256 bytes.  128 by default: with 256, a GEMM whose operand rows are an
    odd multiple of 16 bytes apart (box rows starting mid 32-byte sector) ran 1.3x slower than at 128
    (3072x1536x4096 at row stride 8208 B: 75.7 vs 62.2 us; 57.2 at 8192 B), and 128 is as fast on
    aligned rows (docs/journal/gemm.md entry 60).
    """
    dims = tuple(int(d) for d in dims)
    strides_bytes = tuple(int(s) for s in strides_bytes)
    box = tuple(int(b) for b in box)
    key = (int(ptr), dtype, dims, strides_bytes, box, swizzle, l2_promotion)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    raw = _encode(*key)
    with _cache_lock:
        _cache[key] = raw
        while len(_cache) > _CACHE_MAX:
            _cache.popitem(last=False)
    return raw


def _validate(ptr, dtype, dims, strides, box, swizzle):
    if dtype not in _DTYPES:
        raise TensorMapError(f"tensor map: unsupported dtype {dtype!r}")
    _, itemsize = _DTYPES[dtype]
    rank = len(dims)
    if not 1 <= rank <= 5:
        raise TensorMapError(f"tensor map: rank {rank} not in [1, 5]")
    if len(strides) != rank - 1 or len(box) != rank:
        raise TensorMapError("tensor map: need rank-1 strides and rank box dimensions")
    if ptr % 16:
        raise TensorMapError(f"tensor map: base address 0x{ptr:x} is not 16-byte aligned")
    for i, d in enumerate(dims):
        if not 1 <= d <= (1 << 32):
            raise TensorMapError(f"tensor map: dimension {i} = {d} not in [1, 2**32]")
    for i, s in enumerate(strides):
        if s % 16 or not 0 < s < (1 << 40):
            raise TensorMapError(f"tensor map: stride of dimension {i + 1} = {s} bytes is not a positive "
                                 "multiple of 16 below 2**40")
    for i, b in enumerate(box):
        if not 1 <= b <= 256:
            raise TensorMapError(f"tensor map: box dimension {i} = {b} not in [1, 256]")
    if swizzle not in _SWIZZLE:
        raise TensorMapError(f"tensor map: swizzle {swizzle} not in (0, 32, 64, 128)")
    if swizzle and box[0] * itemsize > swizzle:
        raise TensorMapError(f"tensor map: inner box row {box[0] * itemsize} B exceeds the {swizzle} B swizzle")
    if box[0] * itemsize % 16:
        raise TensorMapError("tensor map: inner box row must be a multiple of 16 bytes")


_L2 = {
    0: cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_NONE,
    64: cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_64B,
    128: cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
    256: cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
}


def _encode(ptr, dtype, dims, strides, box, swizzle, l2_promotion) -> bytes:
    _validate(ptr, dtype, dims, strides, box, swizzle)
    dt, _ = _DTYPES[dtype]
    rank = len(dims)
    sw, _ = _SWIZZLE[swizzle]
    l2 = _L2[l2_promotion]
    try:
        res = cu.cuTensorMapEncodeTiled(
            dt, rank, ptr,
            [cu.cuuint64_t(d) for d in dims],
            [cu.cuuint64_t(s) for s in strides],
            [cu.cuuint32_t(b) for b in box],
            [cu.cuuint32_t(1)] * rank,
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, sw, l2,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    except TypeError:  # argument conversion differs across cuda-python versions: call libcuda directly
        return _encode_ctypes(int(dt), rank, ptr, dims, strides, box, int(sw), int(l2))
    err, tm = res[0], res[1]
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise CudaError(int(err), f"cuTensorMapEncodeTiled({dtype}, dims={dims}, strides={strides}, box={box}, "
                                  f"swizzle={swizzle}) failed: {name.decode() if name else err}")
    return ctypes.string_at(int(tm.getPtr()), 128)


def _encode_ctypes(dt, rank, ptr, dims, strides, box, sw, l2) -> bytes:
    lib = ctypes.CDLL("libcuda.so.1")
    buf = ctypes.create_string_buffer(128 + 64)  # the descriptor must be 64-byte aligned
    addr = (ctypes.addressof(buf) + 63) & ~63
    res = lib.cuTensorMapEncodeTiled(
        ctypes.c_void_p(addr), ctypes.c_int(dt), ctypes.c_uint32(rank), ctypes.c_void_p(ptr),
        (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * max(1, rank - 1))(*strides),
        (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)),
        ctypes.c_int(0), ctypes.c_int(sw), ctypes.c_int(l2), ctypes.c_int(0))
    if res != 0:
        raise CudaError(int(res), f"cuTensorMapEncodeTiled failed (CUresult {res}) for dims={dims} "
                                  f"strides={strides} box={box}")
    return ctypes.string_at(addr, 128)


# --------------------------------------------------------------------------------------------
# re-pointing a map at another base address
# --------------------------------------------------------------------------------------------
_PROBE = ("bfloat16", (64, 64), (128,), (64, 64), 128, 128)
_PROBE_PTRS = (1 << 21, (1 << 40) + 16 * 12345, (1 << 47) - (1 << 12), 0x7F12_3456_7890)
_codec = None  # (byte offset, shift) of the address word; False: not linear (encode instead)
_codec_lock = threading.Lock()


def address_codec():
    """``(offset, shift)`` such that a descriptor's u64 at ``offset`` is ``c + (address >> shift)`` with
    every other byte independent of the address -- verified by encoding probe descriptors at several
    addresses -- or None when no such word exists (then maps are encoded per address)."""
    global _codec
    if _codec is None:
        with _codec_lock:
            if _codec is None:
                _codec = _discover_codec()
                if _codec is False and driver_version() is not None:
                    log.info("tensor maps are encoded again for every new address (no address word linear in "
                             "the address found in this driver's descriptors): GEMM calls with new arrays cost "
                             "more host time")
    return _codec or None


def _discover_codec():
    try:
        maps = [_encode(p, *_PROBE) for p in _PROBE_PTRS]
    except Exception:  # noqa: BLE001 -- no driver, or the driver refuses the probe addresses
        return False
    for off in range(0, 128, 8):
        for shift in (0, 4):
            base = int.from_bytes(maps[0][off:off + 8], "little") - (_PROBE_PTRS[0] >> shift)
            if all(m == maps[0][:off] + ((base + (p >> shift)) & (2**64 - 1)).to_bytes(8, "little")
                   + maps[0][off + 8:] for p, m in zip(_PROBE_PTRS, maps)):
                return off, shift
    return False


class TensorMapArg:
    """A 128-byte tensor map as a launch argument (``buf``, passed by value) that can be re-pointed at
    another array of the same layout: ``point(ptr)`` (``ptr`` 16-byte aligned, like the first)."""

    __slots__ = ("buf", "ptr", "_spec", "_base")

    def __init__(self, ptr: int, dtype: str, dims, strides_bytes, box, *, swizzle: int = 128,
                 l2_promotion: int = 128):
        raw = encode_tiled(ptr, dtype, dims, strides_bytes, box, swizzle=swizzle, l2_promotion=l2_promotion)
        self.buf = ctypes.create_string_buffer(raw, 128)
        self.ptr = int(ptr)
        self._spec = (dtype, tuple(int(d) for d in dims), tuple(int(s) for s in strides_bytes),
                      tuple(int(b) for b in box), swizzle, l2_promotion)
        codec = address_codec()
        self._base = None
        if codec is not None:
            off, shift = codec
            self._base = int.from_bytes(raw[off:off + 8], "little") - (self.ptr >> shift)

    def point(self, ptr: int) -> None:
        ptr = int(ptr)
        if ptr == self.ptr:
            return
        if ptr % 16:
            raise TensorMapError(f"tensor map: base address 0x{ptr:x} is not 16-byte aligned")
        if self._base is not None:
            off, shift = _codec
            struct.pack_into("<Q", self.buf, off, (self._base + (ptr >> shift)) & (2**64 - 1))
        else:
            dtype, dims, strides, box, swizzle, l2 = self._spec
            ctypes.memmove(self.buf, encode_tiled(ptr, dtype, dims, strides, box, swizzle=swizzle, l2_promotion=l2), 128)
        self.ptr = ptr

    @property
    def raw(self) -> bytes:
        return self.buf.raw
