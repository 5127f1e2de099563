"""mkernel's array type and zero-copy interop: ``__cuda_array_interface__`` (CAI) and DLPack.

:class:`DeviceArray` is a plain description of GPU memory: a device pointer, a shape, a
:class:`DType`, strides counted in ELEMENTS, the CUDA device ordinal and an ``owner`` that keeps the
memory alive.  Every op takes its arguments through :func:`as_device_array`, which accepts

* a :class:`DeviceArray` (returned as is),
* anything with ``__cuda_array_interface__`` (CuPy, Numba, PyTorch for non-bf16 dtypes, ...),
* anything with ``__dlpack__``/``__dlpack_device__`` (PyTorch, CuPy, JAX, ...) on kDLCUDA or
  kDLCUDAManaged memory,
* a raw ``(ptr, shape, dtype)`` or ``(ptr, shape, dtype, device)`` tuple,

and never copies.  Host arrays are rejected.  The library needs only numpy, ctypes and
``cuda.bindings`` (no torch/cupy); DLPack capsules are built and read with ctypes.

Streams.  mkernel runs on the caller's stream, so data an op wrote is ready *on that stream*.
Exports therefore record nothing: the CAI ``"stream"`` entry is ``None`` ("no synchronization
needed by the consumer") and ``__dlpack__(stream=...)`` ignores the consumer's stream; a consumer
using another stream than the one the producing op ran on must order the two itself.  On import,
:func:`as_device_array` passes ``stream`` (the stream the op will run on) to ``__dlpack__`` so the
producer orders its pending work before it, and, for a CAI v3 ``"stream"`` that differs from
``stream``, makes ``stream`` wait for it with an event.

bfloat16 has no numpy typestr: the CAI export uses ``"<V2"`` (as ml_dtypes does), which CAI
consumers (CuPy, Numba) don't understand as bf16; use DLPack to hand bf16 arrays to other
libraries.  On the host, bf16 data is a uint16 numpy array of bit patterns (see
:func:`bf16_to_f32`, :func:`f32_to_bf16`); ml_dtypes.bfloat16 arrays are accepted when ml_dtypes
happens to be installed (it is never imported here).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import threading
import weakref
from typing import Iterable, Sequence

import numpy as np
from cuda.bindings import driver as cu

from .runtime import capture_relaxed, check, stream_handle

__all__ = [
    "DType", "bfloat16", "float16", "float32", "int32", "int64", "DTYPES", "dtype_of",
    "DeviceArray", "as_device_array", "from_dlpack_capsule", "require",
    "bf16_to_f32", "f32_to_bf16", "contiguous_strides",
    "KDL_CPU", "KDL_CUDA", "KDL_CUDA_HOST", "KDL_CUDA_MANAGED",
]


# --------------------------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------------------------
KDL_INT, KDL_UINT, KDL_FLOAT, KDL_BFLOAT = 0, 1, 2, 4  # DLDataTypeCode


class DType:
    """An element type mkernel kernels handle.  Instances are singletons (compare with ``is``/``==``).

    ``code`` is the ``MK_DTYPE_*`` value of ``cuda_src/mk_common.cuh``; ``typestr`` the CAI /
    numpy typestr (``"<V2"`` for bfloat16, which numpy has no type for); ``dlpack`` the DLPack
    ``(type code, bits)``; ``numpy_dtype`` the host storage type (uint16 bit patterns for bf16).
    """

    __slots__ = ("name", "code", "itemsize", "typestr", "dl_code", "dl_bits", "numpy_dtype")

    def __init__(self, name: str, code: int, itemsize: int, typestr: str, dl_code: int, numpy_dtype):
        self.name, self.code, self.itemsize, self.typestr = name, code, itemsize, typestr
        self.dl_code, self.dl_bits = dl_code, 8 * itemsize
        self.numpy_dtype = np.dtype(numpy_dtype)

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
        return hash(self.name)

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
_SUPPORTED = "bfloat16, float16, float32, int32 or int64"


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
            raise TypeError(f"unsupported dtype {x!r}; mkernel supports {_SUPPORTED}")
        return d
    if isinstance(x, np.dtype) or (isinstance(x, type) and issubclass(x, np.generic)):
        nd = np.dtype(x)
        d = _BY_NAME.get(nd.name)
        if d is not None and (d is bfloat16 or nd == d.numpy_dtype):
            return d
        hint = " (bf16 bit patterns: pass dtype='bfloat16')" if nd == np.uint16 else ""
        raise TypeError(f"unsupported dtype {nd.name}{hint}; mkernel supports {_SUPPORTED}")
    for cand in (getattr(x, "name", None), str(x)):
        if isinstance(cand, str):
            d = _dtype_from_str(cand)
            if d is not None:
                return d
    raise TypeError(f"unsupported dtype {x!r}; mkernel supports {_SUPPORTED}")


def _dtype_from_dlpack(code: int, bits: int, lanes: int, name: str) -> DType:
    d = _BY_DLPACK.get((int(code), int(bits)))
    if d is None or lanes != 1:
        raise TypeError(f"{name}: unsupported DLPack dtype (code={code}, bits={bits}, lanes={lanes}); "
                        f"mkernel supports {_SUPPORTED}")
    return d


def _dtype_from_typestr(typestr: str, name: str) -> DType:
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


# --------------------------------------------------------------------------------------------
# contexts and allocations
# --------------------------------------------------------------------------------------------
_init_lock = threading.Lock()
_initialized = False
_primary: dict[int, object] = {}  # device ordinal -> retained primary CUcontext (kept for the process)


def _cu_init() -> None:
    global _initialized
    if not _initialized:
        with _init_lock:
            if not _initialized:
                check(cu.cuInit(0))
                _initialized = True


def _primary_context(dev: int):
    ctx = _primary.get(dev)
    if ctx is None:
        ctx = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(dev))))
        _primary[dev] = ctx
    return ctx


@contextlib.contextmanager
def _on_device(device: int | None = None):
    """Run with a context of ``device`` current; yields ``(ctx, device)``.

    ``None`` means the current context's device.  With no current context at all, the device's
    primary context is made current (as the CUDA runtime does implicitly); a context of another
    device is pushed for the duration and popped after.
    """
    _cu_init()
    ctx = check(cu.cuCtxGetCurrent())
    if int(ctx) != 0:
        cur = int(check(cu.cuCtxGetDevice()))
        if device is None or int(device) == cur:
            yield ctx, cur
            return
    dev = 0 if device is None else int(device)
    pctx = _primary_context(dev)
    if int(ctx) == 0:
        check(cu.cuCtxSetCurrent(pctx))
        yield pctx, dev
        return
    check(cu.cuCtxPushCurrent(pctx))
    try:
        yield pctx, dev
    finally:
        check(cu.cuCtxPopCurrent())


_GONE = {int(cu.CUresult.CUDA_ERROR_DEINITIALIZED), int(cu.CUresult.CUDA_ERROR_INVALID_CONTEXT),
         int(cu.CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED)}


def _free(ctx_handle: int, ptr: int) -> None:
    """weakref.finalize callback: cuMemFree in the allocating context.

    A context already destroyed (its memory went with it) and any error while the interpreter
    shuts down are ignored; other errors are reported by weakref as "Exception ignored".
    """
    try:
        check(cu.cuCtxPushCurrent(cu.CUcontext(ctx_handle)))
        try:
            with capture_relaxed():  # an LRU eviction may drop a plan's workspace inside a graph capture
                check(cu.cuMemFree(ptr))
        finally:
            check(cu.cuCtxPopCurrent())
    except Exception as exc:
        if getattr(exc, "code", None) in _GONE or sys.is_finalizing():
            return
        raise


class _Allocation:
    """Owns one cuMemAlloc block; freed (in its context) when the last reference dies."""

    __slots__ = ("ptr", "nbytes", "device", "_finalizer", "__weakref__")

    def __init__(self, nbytes: int, device: int | None):
        self.nbytes = int(nbytes)
        with _on_device(device) as (ctx, dev):
            self.device = dev
            if self.nbytes == 0:
                self.ptr = 0
                self._finalizer = None
                return
            with capture_relaxed():  # a plan's workspace may be allocated inside a graph capture
                self.ptr = int(check(cu.cuMemAlloc(self.nbytes)))
        self._finalizer = weakref.finalize(self, _free, int(ctx), self.ptr)
        self._finalizer.atexit = False  # at exit the driver frees everything; no driver calls then

    def __repr__(self) -> str:
        return f"<mkernel allocation 0x{self.ptr:x} {self.nbytes} B on cuda:{self.device}>"


def _stream(stream):
    return cu.CUstream(stream_handle(stream))


_wait_events = threading.local()  # per thread: current context handle -> a reusable event


def _stream_wait(producer: int, consumer) -> None:
    """Make stream ``consumer`` wait for the work queued so far on CAI stream ``producer``.

    One event per thread and context, re-recorded every time (``cuStreamWaitEvent`` takes the event's
    state at the call), instead of creating and destroying one per imported array."""
    c = stream_handle(consumer) or cu.CU_STREAM_LEGACY
    p = int(producer) or cu.CU_STREAM_LEGACY
    if p == c:
        return
    events = getattr(_wait_events, "by_ctx", None)
    if events is None:
        events = _wait_events.by_ctx = {}
    key = int(check(cu.cuCtxGetCurrent()))
    ev = events.get(key)
    if ev is None:
        ev = events[key] = check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
    check(cu.cuEventRecord(ev, cu.CUstream(p)))
    check(cu.cuStreamWaitEvent(cu.CUstream(c), ev, 0))


def _pointer_device(ptr: int) -> int | None:
    """The device ordinal of a device pointer; None when the driver can't say (no driver/GPU)."""
    try:
        _cu_init()
    except Exception:
        return None
    try:
        return int(check(cu.cuPointerGetAttribute(
            cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)))
    except Exception:
        return None


def _current_device_or(default: int) -> int:
    try:
        _cu_init()
        ctx = check(cu.cuCtxGetCurrent())
        if int(ctx) != 0:
            return int(check(cu.cuCtxGetDevice()))
    except Exception:
        pass
    return default


# --------------------------------------------------------------------------------------------
# DeviceArray
# --------------------------------------------------------------------------------------------
def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """C-order strides in elements."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _as_shape(shape) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    out = tuple(int(s) for s in shape)
    if any(s < 0 for s in out):
        raise ValueError(f"negative dimension in shape {out}")
    return out


KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED = 1, 2, 3, 13  # DLDeviceType


class DeviceArray:
    """A strided view of GPU memory.

    ``ptr``: device address of element ``[0, ..., 0]`` (int); ``shape``: tuple; ``dtype``:
    :class:`DType`; ``strides``: tuple in ELEMENTS (default C-contiguous); ``device``: CUDA ordinal
    (``None``: the current context's); ``owner``: any object keeping the memory alive (an
    allocation, the parent array of a view, a foreign tensor, a DLPack manager);
    ``readonly``: the producer marked the memory read-only (DLPack 1.x flag / CAI data[1]).
    """

    __slots__ = ("ptr", "shape", "dtype", "strides", "device", "owner", "readonly", "_dl_device_type",
                 "__weakref__")

    def __init__(self, ptr, shape, dtype, strides=None, device=None, owner=None, *, readonly=False):
        self.ptr = int(ptr)
        self.shape = _as_shape(shape)
        self.dtype = dtype_of(dtype)
        if strides is None:
            self.strides = contiguous_strides(self.shape)
        else:
            self.strides = tuple(int(s) for s in strides)
            if len(self.strides) != len(self.shape):
                raise ValueError(f"strides {self.strides} do not match shape {self.shape}")
        if device is None:
            with _on_device(None) as (_, dev):
                device = dev
        self.device = int(device)
        self.owner = owner
        self.readonly = bool(readonly)
        self._dl_device_type = KDL_CUDA

    def call_key(self) -> tuple:
        """What makes this view the same argument of an op call as another: pointer, shape, strides,
        dtype, device and the read-only flag (the ops' eager fast paths key on it: runtime.fast_get)."""
        return (self.ptr, self.shape, self.strides, self.dtype.name, self.device, self.readonly)

    # ---- basic properties ------------------------------------------------------------------
    @property
    def size(self) -> int:
        return _prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def is_contiguous(self) -> bool:
        """C-contiguous (dimensions of extent 1 may have any stride; empty arrays are contiguous)."""
        if self.size == 0:
            return True
        expect = 1
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            if n != 1 and s != expect:
                return False
            expect *= n
        return True

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d DeviceArray")
        return self.shape[0]

    def __repr__(self) -> str:
        extra = "" if self.is_contiguous() else f", strides={self.strides}"
        return (f"DeviceArray(ptr=0x{self.ptr:x}, shape={self.shape}, dtype={self.dtype.name}"
                f"{extra}, device={self.device})")

    # ---- views -----------------------------------------------------------------------------
    def _view(self, ptr, shape, strides, dtype=None) -> "DeviceArray":
        v = DeviceArray.__new__(DeviceArray)
        v.ptr, v.shape, v.strides = int(ptr), tuple(shape), tuple(strides)
        v.dtype = self.dtype if dtype is None else dtype
        v.device, v.owner, v.readonly, v._dl_device_type = self.device, self, self.readonly, self._dl_device_type
        return v

    def reshape(self, *shape) -> "DeviceArray":
        """A view with another shape (contiguous arrays only; one ``-1`` allowed)."""
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = tuple(shape[0])
        shape = [int(s) for s in shape]
        if shape.count(-1) > 1:
            raise ValueError("reshape: only one dimension may be -1")
        if -1 in shape:
            rest = _prod(s for s in shape if s != -1)
            if rest == 0 or self.size % rest:
                raise ValueError(f"reshape: cannot reshape {self.shape} into {tuple(shape)}")
            shape[shape.index(-1)] = self.size // rest
        shape = _as_shape(shape)
        if _prod(shape) != self.size:
            raise ValueError(f"reshape: cannot reshape {self.shape} ({self.size} elements) into {shape}")
        if not self.is_contiguous():
            raise ValueError(f"reshape: needs a contiguous array, got strides {self.strides} for shape "
                             f"{self.shape}")
        return self._view(self.ptr, shape, contiguous_strides(shape))

    def view(self, dtype) -> "DeviceArray":
        """The same memory as another dtype of the same itemsize (e.g. bfloat16 <-> float16)."""
        d = dtype_of(dtype)
        if d.itemsize != self.dtype.itemsize:
            raise ValueError(f"view: {d.name} has itemsize {d.itemsize}, {self.dtype.name} has "
                             f"{self.dtype.itemsize}; only same-itemsize views are supported")
        return self._view(self.ptr, self.shape, self.strides, d)

    def __getitem__(self, key) -> "DeviceArray":
        """Basic indexing of the first axis only: ``a[i]`` and ``a[i:j:k]`` give views."""
        if not self.shape:
            raise IndexError("cannot index a 0-d DeviceArray")
        n, s0, isz = self.shape[0], self.strides[0], self.dtype.itemsize
        if isinstance(key, (int, np.integer)):
            i = int(key)
            if i < 0:
                i += n
            if not 0 <= i < n:
                raise IndexError(f"index {int(key)} out of range for axis 0 of extent {n}")
            return self._view(self.ptr + i * s0 * isz, self.shape[1:], self.strides[1:])
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            length = len(range(start, stop, step))
            ptr = self.ptr + start * s0 * isz if length else self.ptr
            return self._view(ptr, (length,) + self.shape[1:], (s0 * step,) + self.strides[1:])
        raise TypeError(f"DeviceArray supports a[i] and a[i:j:k] on the first axis only, got {key!r}")

    # ---- allocation and copies ---------------------------------------------------------------
    @classmethod
    def empty(cls, shape, dtype, device: int | None = None) -> "DeviceArray":
        """Uninitialized C-contiguous memory from cuMemAlloc on ``device`` (None: the current
        context's).  Freed, in the allocating context, when the last reference dies; memory still
        alive at interpreter exit is left to the driver (no driver calls during shutdown)."""
        shape, d = _as_shape(shape), dtype_of(dtype)
        alloc = _Allocation(_prod(shape) * d.itemsize, device)
        return cls(alloc.ptr, shape, d, None, alloc.device, alloc)

    @classmethod
    def from_numpy(cls, x, dtype=None, device: int | None = None, stream=None) -> "DeviceArray":
        """A new device array holding a copy of host array ``x`` (returns once the copy is done).

        ``dtype=None`` keeps x's dtype (float16/float32/int32/int64, or ml_dtypes bfloat16);
        ``dtype="bfloat16"`` takes a uint16 array as bf16 bit patterns and converts a float array
        with round-to-nearest-even (:func:`f32_to_bf16`); other dtypes cast like ``astype``.
        """
        host, d = _host_payload(x, dtype)
        arr = cls.empty(host.shape, d, device)
        if arr.nbytes:
            with _on_device(arr.device):
                s = _stream(stream)
                check(cu.cuMemcpyHtoDAsync(arr.ptr, host.ctypes.data, arr.nbytes, s))
                check(cu.cuStreamSynchronize(s))
        return arr

    def to_numpy(self, stream=None) -> np.ndarray:
        """Copy to a new host array (synchronous, after the work queued on ``stream``).

        bf16 comes back as uint16 bit patterns (see :func:`bf16_to_f32`).  Strided views are
        supported: the span they cover is copied and gathered on the host.
        """
        nd = self.dtype.numpy_dtype
        if self.size == 0:
            return np.empty(self.shape, dtype=nd)
        isz = self.dtype.itemsize
        lo = sum(min(0, (n - 1) * s) for n, s in zip(self.shape, self.strides))
        hi = sum(max(0, (n - 1) * s) for n, s in zip(self.shape, self.strides))
        span = hi - lo + 1
        buf = np.empty(span, dtype=nd)
        with _on_device(self.device):
            s = _stream(stream)
            check(cu.cuMemcpyDtoHAsync(buf.ctypes.data, self.ptr + lo * isz, span * isz, s))
            check(cu.cuStreamSynchronize(s))
        if self.is_contiguous():
            return buf.reshape(self.shape)
        view = np.lib.stride_tricks.as_strided(buf[-lo:], shape=self.shape,
                                               strides=tuple(s * isz for s in self.strides))
        return np.ascontiguousarray(view)

    # (memset width, pattern): quiet NaNs; ints get 0x7fff... (int64: 0x7fffffff7fffffff, one D32 memset)
    _POISON = {"bfloat16": (16, 0x7FC0), "float16": (16, 0x7E00), "float32": (32, 0x7FC00000),
               "int32": (32, 0x7FFFFFFF), "int64": (32, 0x7FFFFFFF)}

    def fill_nan(self, stream=None) -> "DeviceArray":
        """Poison the array (async on ``stream``): quiet NaN for float dtypes, 0x7fffffff (int32) /
        0x7fffffff7fffffff (int64) for int dtypes.  Contiguous arrays only.  Returns self."""
        if not self.is_contiguous():
            raise ValueError(f"fill_nan needs a contiguous array, got strides {self.strides}")
        if self.size == 0:
            return self
        bits, pattern = self._POISON[self.dtype.name]
        with _on_device(self.device):
            s = _stream(stream)
            if bits == 16:
                check(cu.cuMemsetD16Async(self.ptr, pattern, self.nbytes // 2, s))
            else:
                check(cu.cuMemsetD32Async(self.ptr, pattern, self.nbytes // 4, s))
        return self

    def copy_from(self, other, stream=None) -> "DeviceArray":
        """Async device-to-device copy (cuMemcpyAsync, peers included) of an array of the same
        shape and dtype; both contiguous.  Returns self."""
        src = as_device_array(other, name="copy_from: source", stream=stream)
        if src.shape != self.shape or src.dtype is not self.dtype:
            raise ValueError(f"copy_from: source is {src.dtype.name}{list(src.shape)}, destination is "
                             f"{self.dtype.name}{list(self.shape)}")
        if not (src.is_contiguous() and self.is_contiguous()):
            raise ValueError("copy_from: both arrays must be contiguous")
        if self.nbytes:
            with _on_device(self.device):
                check(cu.cuMemcpyAsync(self.ptr, src.ptr, self.nbytes, _stream(stream)))
        return self

    # ---- exports ---------------------------------------------------------------------------
    @property
    def __cuda_array_interface__(self) -> dict:
        """CAI v3.  ``"stream": None``: nothing is recorded; the data is ready on the stream of the
        op that wrote it, and a consumer on another stream must order itself (see module doc).
        bfloat16 is exported as ``"<V2"``, which CAI consumers do not read as bf16: use DLPack."""
        isz = self.dtype.itemsize
        return {
            "shape": self.shape,
            "typestr": self.dtype.typestr,
            "descr": [("", self.dtype.typestr)],
            "data": (self.ptr, self.readonly),
            "strides": None if self.is_contiguous() else tuple(s * isz for s in self.strides),
            "version": 3,
            "stream": None,
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._dl_device_type, self.device

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule viewing this array (zero copy).

        ``max_version >= (1, 0)`` gives a ``"dltensor_versioned"`` capsule (DLPack 1.0 ABI), else a
        legacy ``"dltensor"`` one.  ``stream`` is accepted and ignored: mkernel records nothing, the
        data is ready on the stream of the op that wrote it (see module doc).  ``dl_device`` must be
        this array's device; ``copy=True`` is refused (BufferError).  The array stays alive until
        the consumer calls the deleter (or the capsule dies unconsumed).
        """
        if copy:
            raise BufferError("mkernel DeviceArray: __dlpack__(copy=True) is not supported (zero copy only)")
        if dl_device is not None and tuple(int(v) for v in dl_device) != self.__dlpack_device__():
            raise BufferError(f"mkernel DeviceArray lives on {self.__dlpack_device__()}, cannot export "
                              f"to dl_device={tuple(dl_device)} without a copy")
        versioned = max_version is not None and int(tuple(max_version)[0]) >= 1
        return _dlpack_export(self, versioned)


def _host_payload(x, dtype) -> tuple[np.ndarray, DType]:
    """The contiguous host bits ``from_numpy`` copies, and their DType."""
    if isinstance(x, DeviceArray) or (not isinstance(x, np.ndarray) and hasattr(x, "__cuda_array_interface__")):
        raise TypeError("from_numpy takes a host array; use as_device_array for GPU arrays")
    a = np.asarray(x)
    src_bf16 = a.dtype.name == "bfloat16"
    if dtype is None:
        if src_bf16:
            d = bfloat16
        elif a.dtype == np.uint16:
            raise TypeError("from_numpy: a uint16 array is ambiguous; pass dtype='bfloat16' for bf16 bit "
                            "patterns")
        else:
            try:
                d = dtype_of(a.dtype)
            except TypeError:
                raise TypeError(f"from_numpy: mkernel has no {a.dtype} dtype; pass dtype= one of "
                                f"{_SUPPORTED} to convert") from None
    else:
        d = dtype_of(dtype)
    if d is bfloat16:
        if src_bf16 or a.dtype in (np.uint16, np.int16):
            host = np.ascontiguousarray(a).view(np.uint16)
        elif a.dtype.kind in "fiub":
            host = f32_to_bf16(a if a.dtype.kind == "f" else a.astype(np.float64))
        else:
            raise TypeError(f"from_numpy: cannot convert {a.dtype} to bfloat16")
    else:
        host = np.ascontiguousarray(a.astype(np.float32) if src_bf16 else a).astype(d.numpy_dtype, copy=False)
    return np.ascontiguousarray(host), d


# --------------------------------------------------------------------------------------------
# DLPack ABI (ctypes)
# --------------------------------------------------------------------------------------------
class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


DLPACK_FLAG_BITMASK_READ_ONLY = 1 << 0
DLPACK_VERSION = (1, 0)  # the ABI of the structs above (stable across 1.x)

# capsule names must outlive every capsule: module-level buffers, never freed
_NAME = ctypes.create_string_buffer(b"dltensor")
_NAME_V = ctypes.create_string_buffer(b"dltensor_versioned")
_USED = ctypes.create_string_buffer(b"used_dltensor")
_USED_V = ctypes.create_string_buffer(b"used_dltensor_versioned")

_api = ctypes.pythonapi
_Capsule_New = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", _api))
_Capsule_IsValid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_IsValid", _api))
_Capsule_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))
_Capsule_SetName = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_SetName", _api))
# raw-pointer variants for the capsule destructor (the capsule is being deallocated: no new refs)
_Capsule_IsValid_raw = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api))
_Capsule_GetPointer_raw = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))

_DeleterFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

# exported managed tensors alive in a consumer's hands: struct address -> (array, struct, shape, strides)
_exports: dict[int, tuple] = {}


def _release_export(addr) -> None:
    _exports.pop(int(addr or 0), None)


@_DeleterFn
def _dl_deleter(addr):  # called by the consumer (any thread; ctypes takes the GIL)
    try:
        _release_export(addr)
    except BaseException:  # never let an exception cross into C
        pass


@_DeleterFn
def _capsule_destructor(cap):  # the capsule died; free the manager unless a consumer took it
    try:
        for name in (_NAME, _NAME_V):
            if _Capsule_IsValid_raw(cap, name):
                _release_export(_Capsule_GetPointer_raw(cap, name))
                return
    except BaseException:
        pass


_DL_DELETER_ADDR = ctypes.cast(_dl_deleter, ctypes.c_void_p).value
_CAPSULE_DESTRUCTOR_ADDR = ctypes.cast(_capsule_destructor, ctypes.c_void_p).value


def _dlpack_export(arr: DeviceArray, versioned: bool):
    nd = arr.ndim
    shape = (ctypes.c_int64 * max(nd, 1))(*arr.shape)
    strides = (ctypes.c_int64 * max(nd, 1))(*arr.strides)
    if versioned:
        mt = DLManagedTensorVersioned()
        mt.version.major, mt.version.minor = DLPACK_VERSION
        mt.flags = DLPACK_FLAG_BITMASK_READ_ONLY if arr.readonly else 0
    else:
        mt = DLManagedTensor()
    t = mt.dl_tensor
    t.data = arr.ptr or None
    t.device.device_type, t.device.device_id = arr.__dlpack_device__()
    t.ndim = nd
    t.dtype.code, t.dtype.bits, t.dtype.lanes = arr.dtype.dl_code, arr.dtype.dl_bits, 1
    t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    t.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = 0
    addr = ctypes.addressof(mt)
    mt.manager_ctx = addr
    mt.deleter = _DL_DELETER_ADDR
    _exports[addr] = (arr, mt, shape, strides)
    try:
        return _Capsule_New(addr, _NAME_V if versioned else _NAME, _CAPSULE_DESTRUCTOR_ADDR)
    except BaseException:
        _exports.pop(addr, None)
        raise


def _call_deleter(deleter: int, addr: int) -> None:
    try:
        _DeleterFn(deleter)(addr)
    except Exception:
        if not sys.is_finalizing():
            raise


class DLPackOwner:
    """Keeps a consumed DLPack managed tensor alive; calls its deleter when garbage collected."""

    __slots__ = ("address", "versioned", "producer", "_finalizer", "__weakref__")

    def __init__(self, address: int, deleter: int | None, versioned: bool, producer=None):
        self.address, self.versioned, self.producer = address, versioned, producer
        self._finalizer = None
        if deleter:
            self._finalizer = weakref.finalize(self, _call_deleter, deleter, address)
            self._finalizer.atexit = False  # foreign deleters are not called at interpreter exit

    def __repr__(self) -> str:
        kind = "versioned " if self.versioned else ""
        return f"<DLPack {kind}managed tensor 0x{self.address:x}>"


def from_dlpack_capsule(capsule, *, name: str = "array", producer=None) -> DeviceArray:
    """A DeviceArray viewing the tensor of a DLPack capsule (legacy or versioned), consuming it.

    The capsule is renamed ``used_dltensor[_versioned]`` and its deleter is called when the
    returned array (and every view of it) is gone.  Non-CUDA tensors are refused before the capsule
    is consumed, so its producer still frees it.  ``producer`` is kept alive with the array.
    """
    if _Capsule_IsValid(capsule, _NAME_V):
        addr = _Capsule_GetPointer(capsule, _NAME_V)
        mt = DLManagedTensorVersioned.from_address(addr)
        if mt.version.major != 1:
            raise BufferError(f"{name}: DLPack version {mt.version.major}.{mt.version.minor} is not "
                              f"supported (mkernel reads 1.x)")
        versioned, used = True, _USED_V
        readonly = bool(mt.flags & DLPACK_FLAG_BITMASK_READ_ONLY)
    elif _Capsule_IsValid(capsule, _NAME):
        addr = _Capsule_GetPointer(capsule, _NAME)
        mt = DLManagedTensor.from_address(addr)
        versioned, used, readonly = False, _USED, False
    elif _Capsule_IsValid(capsule, _USED) or _Capsule_IsValid(capsule, _USED_V):
        raise ValueError(f"{name}: this DLPack capsule was already consumed")
    else:
        raise TypeError(f"{name}: expected a DLPack capsule, got {type(capsule).__name__}")
    t = mt.dl_tensor
    dev_type, dev_id = int(t.device.device_type), int(t.device.device_id)
    if dev_type in (KDL_CPU, KDL_CUDA_HOST):
        raise TypeError(f"{name} is a host array (DLPack device type {dev_type}); mkernel takes GPU memory "
                        f"(copy it to the GPU first, e.g. DeviceArray.from_numpy)")
    if dev_type not in (KDL_CUDA, KDL_CUDA_MANAGED):
        raise TypeError(f"{name}: DLPack device type {dev_type} is not CUDA; mkernel takes CUDA memory")
    dtype = _dtype_from_dlpack(t.dtype.code, t.dtype.bits, t.dtype.lanes, name)
    nd = int(t.ndim)
    shape = tuple(int(t.shape[i]) for i in range(nd))
    strides = tuple(int(t.strides[i]) for i in range(nd)) if t.strides else None
    ptr = int(t.data or 0) + int(t.byte_offset)
    deleter = int(mt.deleter or 0)
    if not _Capsule_SetName(capsule, used) == 0:  # pragma: no cover - SetName raises on failure
        raise RuntimeError("PyCapsule_SetName failed")
    owner = DLPackOwner(addr, deleter, versioned, producer)
    arr = DeviceArray(ptr, shape, dtype, strides, dev_id, owner, readonly=readonly)
    arr._dl_device_type = dev_type
    return arr


# --------------------------------------------------------------------------------------------
# import: as_device_array
# --------------------------------------------------------------------------------------------
def _host_error(name: str, what: str) -> TypeError:
    return TypeError(f"{name} is a host array ({what}); mkernel takes GPU memory: copy it to the GPU first "
                     f"(DeviceArray.from_numpy, torch .cuda(), cupy.asarray)")


def _from_cai(obj, cai: dict, name: str, stream) -> DeviceArray:
    version = int(cai.get("version", 0))
    if version > 3:
        raise ValueError(f"{name}: __cuda_array_interface__ version {version} is not supported (<= 3)")
    if cai.get("mask") is not None:
        raise ValueError(f"{name}: masked __cuda_array_interface__ arrays are not supported")
    shape = _as_shape(cai["shape"])
    dtype = _dtype_from_typestr(cai["typestr"], name)
    ptr, readonly = cai["data"]
    ptr = int(ptr or 0)
    bstrides = cai.get("strides")
    if bstrides is None:
        strides = None
    else:
        if len(bstrides) != len(shape):
            raise ValueError(f"{name}: __cuda_array_interface__ strides {tuple(bstrides)} do not match "
                             f"shape {shape}")
        if any(int(s) % dtype.itemsize for s in bstrides):
            raise ValueError(f"{name}: byte strides {tuple(bstrides)} are not multiples of the "
                             f"{dtype.name} itemsize {dtype.itemsize}")
        strides = tuple(int(s) // dtype.itemsize for s in bstrides)
    # the producer's own word first (torch/cupy/jax export __dlpack_device__), then the driver's
    device = None
    dl = getattr(obj, "__dlpack_device__", None)
    if dl is not None:
        try:
            device = int(dl()[1])
        except Exception:
            device = None
    if device is None and ptr:
        device = _pointer_device(ptr)
    if device is None:
        device = _current_device_or(0)
    prod_stream = cai.get("stream") if version >= 3 else None
    if prod_stream is not None:
        _stream_wait(int(prod_stream), stream)
    return DeviceArray(ptr, shape, dtype, strides, device, obj, readonly=bool(readonly))


def _from_dlpack_obj(obj, name: str, stream) -> DeviceArray:
    dev_type, _ = obj.__dlpack_device__()
    dev_type = int(dev_type)
    if dev_type in (KDL_CPU, KDL_CUDA_HOST):
        raise _host_error(name, f"DLPack device type {dev_type}")
    if dev_type not in (KDL_CUDA, KDL_CUDA_MANAGED):
        raise TypeError(f"{name}: DLPack device type {dev_type} is not CUDA; mkernel takes CUDA memory")
    s = stream_handle(stream) or cu.CU_STREAM_LEGACY  # DLPack: 1 = legacy default stream, 0 is illegal
    try:
        cap = obj.__dlpack__(stream=s, max_version=DLPACK_VERSION)
    except TypeError:  # producers older than DLPack 1.0 (no max_version)
        cap = obj.__dlpack__(stream=s)
    return from_dlpack_capsule(cap, name=name)


def as_device_array(obj, *, name: str = "array", stream=None) -> DeviceArray:
    """View ``obj`` as a :class:`DeviceArray` without copying.

    ``obj``: a DeviceArray (returned as is); an object with ``__cuda_array_interface__`` (v0-v3;
    owner = obj); an object with ``__dlpack__`` on CUDA / CUDA-managed memory (its capsule is
    consumed; used when CAI is absent or fails, e.g. torch bf16); or ``(ptr, shape, dtype[,
    device])``.  ``stream`` is the stream the caller will use the data on (for the producers'
    stream synchronization).  Host arrays raise TypeError; ``name`` appears in every message.
    """
    if isinstance(obj, DeviceArray):
        return obj
    if isinstance(obj, (np.ndarray, np.generic)):
        raise _host_error(name, f"numpy.ndarray {obj.dtype}{list(np.shape(obj))}")
    if isinstance(obj, tuple):
        if len(obj) not in (3, 4):
            raise TypeError(f"{name}: a raw array is (ptr, shape, dtype) or (ptr, shape, dtype, device), "
                            f"got a tuple of {len(obj)}")
        ptr, shape, dtype = obj[:3]
        device = obj[3] if len(obj) == 4 else None
        try:
            return DeviceArray(int(ptr), shape, dtype, None, device, None)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}: {exc}") from None
    cai_error = None
    try:
        cai = obj.__cuda_array_interface__
    except AttributeError as exc:  # absent, or torch's CPU tensors / bf16 raising
        cai, cai_error = None, exc
    except Exception as exc:  # pragma: no cover - producers raising something else
        cai, cai_error = None, exc
    if cai is not None:
        return _from_cai(obj, cai, name, stream)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _from_dlpack_obj(obj, name, stream)
    if hasattr(obj, "__array_interface__") or hasattr(obj, "__array__"):
        raise _host_error(name, type(obj).__name__)
    detail = f" (__cuda_array_interface__ raised {cai_error})" if cai_error and hasattr(
        type(obj), "__cuda_array_interface__") else ""
    raise TypeError(f"{name}: expected a GPU array (DeviceArray, __cuda_array_interface__, DLPack or "
                    f"(ptr, shape, dtype)), got {type(obj).__name__}{detail}")


# --------------------------------------------------------------------------------------------
# validation used by every op
# --------------------------------------------------------------------------------------------
def _names(dtypes) -> str:
    names = [d.name for d in dtypes]
    if len(names) == 1:
        return names[0]
    return ", ".join(names[:-1]) + " or " + names[-1]


def _shape_str(shape) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def require(arr, name: str, *, dtypes=None, ndim=None, shape=None, contiguous: bool = True,
            align: int | None = None, device: int | None = None, writable: bool = False,
            stream=None) -> DeviceArray:
    """Check an op argument and return it as a DeviceArray (converted with :func:`as_device_array`).

    ``name`` is the message prefix, e.g. ``"gemm: b"`` -> "gemm: b must be bfloat16 or float16,
    got float32".  ``dtypes``: a dtype-like or several; ``ndim``: an int or several; ``shape``:
    expected extents, ``None`` entries match anything; ``contiguous``: C-contiguous required;
    ``align``: byte alignment of ``ptr``; ``device``: CUDA ordinal; ``writable``: refuse read-only
    memory.  TypeError for a wrong dtype/kind, ValueError for everything else.
    """
    a = arr if isinstance(arr, DeviceArray) else as_device_array(arr, name=name, stream=stream)
    if dtypes is not None:
        # tuples/lists first: the typing.Iterable check is slow on the per-call hot path
        many = isinstance(dtypes, (tuple, list)) or (not isinstance(dtypes, (str, DType)) and isinstance(dtypes, Iterable))
        allowed = [dtype_of(d) for d in dtypes] if many else [dtype_of(dtypes)]
        if a.dtype not in allowed:
            raise TypeError(f"{name} must be {_names(allowed)}, got {a.dtype.name}")
    if ndim is not None:
        allowed_nd = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if a.ndim not in allowed_nd:
            want = " or ".join(f"{n}-D" for n in allowed_nd)
            raise ValueError(f"{name} must be {want}, got {a.ndim}-D with shape {a.shape}")
    if shape is not None:
        shape = tuple(shape)
        if len(shape) != a.ndim or any(w is not None and int(w) != s for w, s in zip(shape, a.shape)):
            raise ValueError(f"{name} must have shape {_shape_str(shape)}, got {a.shape}")
    if contiguous and not a.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major), got strides {a.strides} (elements) for "
                         f"shape {a.shape}")
    if align is not None and a.ptr % int(align):
        raise ValueError(f"{name} must be {int(align)}-byte aligned, got ptr 0x{a.ptr:x}")
    if device is not None and a.device != int(device):
        raise ValueError(f"{name} is on cuda:{a.device}, expected cuda:{int(device)}")
    if writable and a.readonly:
        raise ValueError(f"{name} is read-only memory but the op writes it")
    return a
