"""Element types mkernel kernels handle, and bf16 <-> f32 on the host (uint16 bit patterns).

bfloat16 has no numpy type: on the host, bf16 data is a uint16 array of bit patterns
(:func:`bf16_to_f32`, :func:`f32_to_bf16`); ml_dtypes.bfloat16 arrays are accepted when ml_dtypes happens
to be installed (it is never imported here).
"""
from __future__ import annotations

import functools
from typing import Iterable

import numpy as np

__all__ = ["DType", "bfloat16", "float16", "float32", "int32", "int64", "DTYPES", "dtype_of", "dtype_names",
           "dtype_from_dlpack", "dtype_from_typestr", "bf16_to_f32", "f32_to_bf16", "SUPPORTED"]


KDL_INT, KDL_UINT, KDL_FLOAT, KDL_BFLOAT = 0, 1, 2, 4  # DLDataTypeCode


class DType:
    """An element type mkernel kernels handle.  Instances are singletons (compare with ``is``/``==``).

    ``code`` is the ``MK_DTYPE_*`` value of ``cuda_src/mk_common.cuh``; ``typestr`` the CAI /
    numpy typestr (``"<V2"`` for bfloat16, which numpy has no type for); ``dlpack`` the DLPack
    ``(type code, bits)``; ``numpy_dtype`` the host storage type (uint16 bit patterns for bf16).
    """

    __slots__ = ("name", "code", "itemsize", "typestr", "dl_code", "dl_bits", "numpy_dtype", "_hash")

    def __init__(self, name: str, code: int, itemsize: int, typestr: str, dl_code: int, numpy_dtype):
        self.name, self.code, self.itemsize, self.typestr = name, code, itemsize, typestr
        self.dl_code, self.dl_bits = dl_code, 8 * itemsize
        self.numpy_dtype = np.dtype(numpy_dtype)
        self._hash = hash(name)  # (bound-call keys hash dtypes on every call)

    @property
    def dlpack(self) -> tuple[int, int]:
        return self.dl_code, self.dl_bits

    @property
    def is_float(self) -> bool:
        return self.dl_code in (KDL_FLOAT, KDL_BFLOAT)

    def __repr__(self) -> str:
        return f"mkernel.{self.name}"

    __str__ = lambda self: self.name  # noqa: E731

    def __eq__(self, other) -> bool:
        if isinstance(other, DType):
            return other is self
        try:
            return dtype_of(other) is self
        except (TypeError, ValueError):
            return False

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (dtype_of, (self.name,))


bfloat16 = DType("bfloat16", 0, 2, "<V2", KDL_BFLOAT, np.uint16)
float16 = DType("float16", 1, 2, "<f2", KDL_FLOAT, np.float16)
float32 = DType("float32", 2, 4, "<f4", KDL_FLOAT, np.float32)
int32 = DType("int32", 3, 4, "<i4", KDL_INT, np.int32)
int64 = DType("int64", 4, 8, "<i8", KDL_INT, np.int64)
DTYPES = (bfloat16, float16, float32, int32, int64)

_BY_NAME = {d.name: d for d in DTYPES}
_ALIASES = {
    "bf16": bfloat16, "bfloat": bfloat16,
    "fp16": float16, "f16": float16, "half": float16, "f2": float16, "<f2": float16, "=f2": float16,
    "fp32": float32, "f32": float32, "single": float32, "f4": float32, "<f4": float32, "=f4": float32,
    "i32": int32, "i4": int32, "<i4": int32, "=i4": int32,
    "i64": int64, "i8": int64, "<i8": int64, "=i8": int64, "long": int64,
    "<v2": bfloat16,  # our own bf16 typestr (and ml_dtypes'): the only 2-byte opaque type mkernel knows
}
_BY_DLPACK = {d.dlpack: d for d in DTYPES}
SUPPORTED = "bfloat16, float16, float32, int32 or int64"


@functools.lru_cache(maxsize=256)
def _dtype_from_str(s: str) -> DType | None:
    key = s.strip().lower()
    if key.startswith("dtype(") and key.endswith(")"):  # repr of a numpy dtype
        key = key[6:-1].strip("'\"")
    if key.startswith("<class ") and key.endswith(">"):  # str() of a numpy scalar type
        key = key[7:-1].strip("'\"")
    key = key.rsplit(".", 1)[-1]  # torch.bfloat16, numpy.float32, jnp.float16, ml_dtypes.bfloat16
    return _BY_NAME.get(key) or _ALIASES.get(key)


def dtype_of(x) -> DType:
    """Normalize a dtype-like to a :class:`DType`.

    Accepts a DType, names and aliases (``"bfloat16"``, ``"bf16"``, ``"fp16"``, ``"fp32"``,
    ``"int32"``, ``"i8"`` ...), numpy typestrs (``"<f4"``), dotted names (``"torch.bfloat16"``,
    ``str(torch.float16)``), numpy dtypes and scalar types (incl. ml_dtypes' ``bfloat16``), and any
    object whose ``.name`` or ``str()`` is one of those (torch/jax dtypes).  uint16 and float64
    are rejected (uint16 is ambiguous: pass ``"bfloat16"`` for bf16 bit patterns).
    """
    if isinstance(x, DType):
        return x
    if isinstance(x, str):
        d = _dtype_from_str(x)
        if d is None:
            raise TypeError(f"unsupported dtype {x!r}; mkernel supports {SUPPORTED}")
        return d
    if isinstance(x, np.dtype) or (isinstance(x, type) and issubclass(x, np.generic)):
        nd = np.dtype(x)
        d = _BY_NAME.get(nd.name)
        if d is not None and (d is bfloat16 or nd == d.numpy_dtype):
            return d
        hint = " (bf16 bit patterns: pass dtype='bfloat16')" if nd == np.uint16 else ""
        raise TypeError(f"unsupported dtype {nd.name}{hint}; mkernel supports {SUPPORTED}")
    for cand in (getattr(x, "name", None), str(x)):
        if isinstance(cand, str):
            d = _dtype_from_str(cand)
            if d is not None:
                return d
    raise TypeError(f"unsupported dtype {x!r}; mkernel supports {SUPPORTED}")


def dtype_from_dlpack(code: int, bits: int, lanes: int, name: str) -> DType:
    d = _BY_DLPACK.get((int(code), int(bits)))
    if d is None or lanes != 1:
        raise TypeError(f"{name}: unsupported DLPack dtype (code={code}, bits={bits}, lanes={lanes}); "
                        f"mkernel supports {SUPPORTED}")
    return d


def dtype_from_typestr(typestr: str, name: str) -> DType:
    d = _ALIASES.get(str(typestr).lower())
    if d is None:
        raise TypeError(f"{name}: unsupported __cuda_array_interface__ typestr {typestr!r}; mkernel "
                        f"supports <V2 (bfloat16), <f2, <f4, <i4, <i8")
    return d


# --------------------------------------------------------------------------------------------
# bf16 <-> f32 on the host
# --------------------------------------------------------------------------------------------
def _as_bits16(x) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype.name == "bfloat16" or a.dtype == np.int16:
        return a.view(np.uint16)
    if a.dtype != np.uint16:
        raise TypeError(f"bf16 bit patterns must be a uint16 array, got {a.dtype}")
    return a


def bf16_to_f32(u16) -> np.ndarray:
    """bf16 bit patterns (uint16/int16 array, or an ml_dtypes bfloat16 array) -> float32, exactly."""
    a = _as_bits16(u16)
    return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _f64_to_f32_round_to_odd(a: np.ndarray) -> np.ndarray:
    """float64 -> float32 rounding to odd, so that a second rounding (to bf16) is correctly rounded."""
    with np.errstate(over="ignore", invalid="ignore"):
        f = a.astype(np.float32)
        back = f.astype(np.float64)
        inexact = (back != a) & np.isfinite(a)
        over = inexact & (np.abs(back) > np.abs(a))
    f = np.where(over, np.nextafter(f, np.float32(0)), f)  # truncate toward zero ...
    return (f.view(np.uint32) | inexact.astype(np.uint32)).view(np.float32)  # ... and set a sticky bit


def f32_to_bf16(x) -> np.ndarray:
    """float32 (or float64, any float) array -> bf16 bit patterns (uint16), round to nearest even.

    NaNs stay NaNs (quiet, sign kept), infinities stay infinities, values past the bf16 range
    round to +-inf as RNE says.  float64 input is rounded once (via round-to-odd float32).
    """
    a = np.asarray(x)
    if a.dtype.name == "bfloat16":
        return a.view(np.uint16).copy()
    shape = a.shape
    if a.dtype == np.float64 or a.dtype == np.longdouble:
        a = _f64_to_f32_round_to_odd(np.asarray(a, dtype=np.float64).reshape(-1))
    u = np.ascontiguousarray(a, dtype=np.float32).reshape(-1).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    is_nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    out = np.where(is_nan, (u >> np.uint32(16)) | np.uint32(0x0040), rounded).astype(np.uint16)
    return out.reshape(shape)


def dtype_names(dtypes) -> str:
    """"a, b or c" of dtype-likes (error messages)."""
    names = [dtype_of(d).name for d in dtypes]
    if len(names) == 1:
        return names[0]
    return ", ".join(names[:-1]) + " or " + names[-1]
