"""mkernel's array type, :class:`DeviceArray`, and its zero-copy exports (CAI and DLPack).

:class:`DeviceArray` is a plain description of GPU memory: a device pointer, a shape, a
:class:`DType`, strides counted in ELEMENTS, the CUDA device ordinal and an ``owner`` that keeps the
memory alive.  Every op takes its arguments through :func:`mkernel.core.interop.as_device_array`, which accepts

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

import sys
import weakref
from typing import Sequence

import numpy as np
from cuda.bindings import driver as cu

from . import dlpack, frees
from .dlpack import KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED
from .device import on_device
from .driver import capture_relaxed, check
from .dtypes import SUPPORTED, DType, bfloat16, dtype_of, f32_to_bf16
from .streams import stream_handle

__all__ = ["DeviceArray", "contiguous_strides", "as_shape", "KDL_CPU", "KDL_CUDA", "KDL_CUDA_HOST", "KDL_CUDA_MANAGED"]


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
        with on_device(device) as (ctx, dev):
            self.device = dev
            if self.nbytes == 0:
                self.ptr = 0
                self._finalizer = None
                return
            with capture_relaxed():  # a plan's workspace may be allocated inside a graph capture
                self.ptr = int(check(cu.cuMemAlloc(self.nbytes)))
        # deferred while a kernel may wait on this process's proxy (cuMemFree would stall it: core/frees.py)
        self._finalizer = weakref.finalize(self, frees.release, _free, int(ctx), self.ptr)
        self._finalizer.atexit = False  # at exit the driver frees everything; no driver calls then

    def __repr__(self) -> str:
        return f"<mkernel allocation 0x{self.ptr:x} {self.nbytes} B on cuda:{self.device}>"



def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """C-order strides in elements."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


def _importer(obj, *, name: str, stream=None) -> "DeviceArray":
    """mkernel.core.interop.as_device_array, set by that module when it loads (it imports this one)."""
    if isinstance(obj, DeviceArray):
        return obj
    raise TypeError(f"{name}: expected a DeviceArray")


def _stream(stream):
    return cu.CUstream(stream_handle(stream))


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def as_shape(shape) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    out = tuple(int(s) for s in shape)
    if any(s < 0 for s in out):
        raise ValueError(f"negative dimension in shape {out}")
    return out




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
        self.shape = as_shape(shape)
        self.dtype = dtype_of(dtype)
        if strides is None:
            self.strides = contiguous_strides(self.shape)
        else:
            self.strides = tuple(int(s) for s in strides)
            if len(self.strides) != len(self.shape):
                raise ValueError(f"strides {self.strides} do not match shape {self.shape}")
        if device is None:
            with on_device(None) as (_, dev):
                device = dev
        self.device = int(device)
        self.owner = owner
        self.readonly = bool(readonly)
        self._dl_device_type = KDL_CUDA

    @classmethod
    def _trusted(cls, ptr: int, shape: tuple, dtype: DType, strides: tuple, device: int, owner,
                 readonly: bool = False) -> "DeviceArray":
        """A DeviceArray from already-normalized fields (the importers' fast path: no checks)."""
        a = cls.__new__(cls)
        a.ptr, a.shape, a.dtype, a.strides, a.device, a.owner = ptr, shape, dtype, strides, device, owner
        a.readonly, a._dl_device_type = readonly, KDL_CUDA
        return a

    def call_key(self) -> tuple:
        """What makes this view the same argument of an op call as another: pointer, shape, strides,
        dtype, device and the read-only flag."""
        return (self.ptr, self.shape, self.strides, self.dtype.name, self.device, self.readonly)

    def layout_key(self) -> tuple:
        """What a bound call depends on of this argument but its address: shape, strides, dtype, device, the
        address modulo 16 (TMA maps, vector accesses) and the read-only flag; another array of the same key
        re-points the bound call."""
        return (self.shape, self.strides, self.dtype, self.device, self.ptr % 16, self.readonly)

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
        shape = as_shape(shape)
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
        shape, d = as_shape(shape), dtype_of(dtype)
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
            with on_device(arr.device):
                s = _stream(stream)
                # drain the stream first: a pageable copy waits for it holding a driver lock (core/frees.py)
                check(cu.cuStreamSynchronize(s))
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
        with on_device(self.device):
            s = _stream(stream)
            check(cu.cuStreamSynchronize(s))  # (as in from_numpy)
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
        with on_device(self.device):
            s = _stream(stream)
            if bits == 16:
                check(cu.cuMemsetD16Async(self.ptr, pattern, self.nbytes // 2, s))
            else:
                check(cu.cuMemsetD32Async(self.ptr, pattern, self.nbytes // 4, s))
        return self

    def copy_from(self, other, stream=None) -> "DeviceArray":
        """Async device-to-device copy (cuMemcpyAsync, peers included) of an array of the same
        shape and dtype; both contiguous.  Returns self."""
        src = _importer(other, name="copy_from: source", stream=stream)
        if src.shape != self.shape or src.dtype is not self.dtype:
            raise ValueError(f"copy_from: source is {src.dtype.name}{list(src.shape)}, destination is "
                             f"{self.dtype.name}{list(self.shape)}")
        if not (src.is_contiguous() and self.is_contiguous()):
            raise ValueError("copy_from: both arrays must be contiguous")
        if self.nbytes:
            with on_device(self.device):
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
        return dlpack.export_capsule(self, versioned)


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
                                f"{SUPPORTED} to convert") from None
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


