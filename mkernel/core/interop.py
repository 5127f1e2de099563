"""Importing foreign GPU arrays without copying: ``__cuda_array_interface__``, DLPack, raw tuples.

Every op takes its arguments through :func:`as_device_array` (see :mod:`mkernel.core.arrays` for
the stream rules) and checks them with :func:`require`.
"""
from __future__ import annotations

import sys
from typing import Iterable

import numpy as np
from cuda.bindings import driver as cu

from . import arrays, dlpack
from .arrays import KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED, DeviceArray, as_shape
from .device import cu_init, current_device_or, pointer_device, stream_wait
from .dtypes import SUPPORTED, DType, dtype_from_dlpack, dtype_from_typestr, dtype_of, dtype_names
from .streams import stream_handle

__all__ = ["as_device_array", "from_dlpack_capsule", "require"]


def from_dlpack_capsule(capsule, *, name: str = "array", producer=None) -> DeviceArray:
    """A DeviceArray viewing the tensor of a DLPack capsule (legacy or versioned), consuming it.

    The capsule is renamed ``used_dltensor[_versioned]`` and its deleter is called when the
    returned array (and every view of it) is gone.  Non-CUDA tensors are refused before the capsule
    is consumed, so its producer still frees it.  ``producer`` is kept alive with the array.
    """
    ptr, shape, strides, dtype, dev_type, dev_id, readonly, owner = dlpack.read_capsule(capsule, name, producer)
    arr = DeviceArray(ptr, shape, dtype, strides, dev_id, owner, readonly=readonly)
    arr._dl_device_type = dev_type
    return arr


def _host_error(name: str, what: str) -> TypeError:
    return TypeError(f"{name} is a host array ({what}); mkernel takes GPU memory: copy it to the GPU first "
                     f"(DeviceArray.from_numpy, torch .cuda(), cupy.asarray)")


def _from_cai(obj, cai: dict, name: str, stream) -> DeviceArray:
    version = int(cai.get("version", 0))
    if version > 3:
        raise ValueError(f"{name}: __cuda_array_interface__ version {version} is not supported (<= 3)")
    if cai.get("mask") is not None:
        raise ValueError(f"{name}: masked __cuda_array_interface__ arrays are not supported")
    shape = as_shape(cai["shape"])
    dtype = dtype_from_typestr(cai["typestr"], name)
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
        device = pointer_device(ptr)
    if device is None:
        device = current_device_or(0)
    prod_stream = cai.get("stream") if version >= 3 else None
    if prod_stream is not None:
        stream_wait(int(prod_stream), stream)
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
        cap = obj.__dlpack__(stream=s, max_version=dlpack.DLPACK_VERSION)
    except TypeError:  # producers older than DLPack 1.0 (no max_version)
        cap = obj.__dlpack__(stream=s)
    return from_dlpack_capsule(cap, name=name)


def as_device_array(obj, *, name: str = "array", stream=None) -> DeviceArray:
    """View ``obj`` as a :class:`DeviceArray` without copying.

    ``obj``: a DeviceArray (returned as is); a PyTorch CUDA tensor (read through its own accessors: the
    cheapest route); an object with ``__cuda_array_interface__`` (v0-v3; owner = obj); an object with
    ``__dlpack__`` on CUDA / CUDA-managed memory (its capsule is consumed; used when CAI is absent or
    fails); or ``(ptr, shape, dtype[, device])`` (the pointer is checked with the driver: a host or null
    pointer raises).  ``stream`` is the stream the caller will use the data on: work the producer queued
    on its own stream (CAI v3 ``stream``, DLPack's stream argument, torch's current stream) is ordered
    before it.  Host arrays raise TypeError; ``name`` appears in every message.

    The route is chosen once per Python type and remembered (a call costs a dict lookup and the
    importer itself: about a microsecond for a torch tensor).
    """
    imp = _importers.get(type(obj))
    if imp is None:
        imp = _importer_for(obj)
    return imp(obj, name, stream)


def _identity(obj, name, stream):
    return obj


def _from_tuple(obj, name, stream) -> DeviceArray:
    if len(obj) not in (3, 4):
        raise TypeError(f"{name}: a raw array is (ptr, shape, dtype) or (ptr, shape, dtype, device), "
                        f"got a tuple of {len(obj)}")
    ptr, shape, dtype = obj[:3]
    device = obj[3] if len(obj) == 4 else None
    try:
        ptr = int(ptr)
        arr = DeviceArray(ptr, shape, dtype, None, device, None)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {exc}") from None
    if arr.nbytes:
        _check_raw_pointer(ptr, name)
    return arr


def _check_raw_pointer(ptr: int, name: str) -> None:
    """A raw pointer must be device (or managed) memory the driver knows: a null, host or stray
    pointer would fault the CUDA context at launch."""
    if ptr == 0:
        raise ValueError(f"{name}: null device pointer")
    try:
        cu_init()
    except Exception:  # noqa: BLE001 -- no driver at all: nothing can be launched with it either
        return
    err, mem_type = cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise ValueError(f"{name}: 0x{ptr:x} is not a pointer the CUDA driver knows (host memory or freed?)")
    if int(mem_type) not in (int(cu.CUmemorytype.CU_MEMORYTYPE_DEVICE), int(cu.CUmemorytype.CU_MEMORYTYPE_UNIFIED)):
        raise ValueError(f"{name}: 0x{ptr:x} is host memory; mkernel takes device memory")


def _host_array(obj, name, stream):
    raise _host_error(name, f"numpy.ndarray {obj.dtype}{list(np.shape(obj))}")


# torch.dtype object -> DType (filled on first sight of each dtype)
_TORCH_DTYPES: dict = {}


def _from_torch(t, name, stream) -> DeviceArray:
    """A torch tensor through its accessors (no DLPack capsule, no CAI dict).  Ordering as torch's own
    exports: our stream waits for torch's current stream on the tensor's device when they differ."""
    if not t.is_cuda:
        raise _host_error(name, f"torch.Tensor on {t.device}")
    dt = _TORCH_DTYPES.get(t.dtype)
    if dt is None:
        try:
            dt = _TORCH_DTYPES[t.dtype] = dtype_of(t.dtype)
        except TypeError:
            raise TypeError(f"{name}: unsupported dtype {t.dtype}; mkernel supports {SUPPORTED}") from None
    if t.is_neg() or t.is_conj():
        raise ValueError(f"{name}: a lazily negated / conjugated torch view; call .resolve_neg() first")
    dev = t.get_device()
    producer = _torch_current_stream(dev)
    consumer = stream_handle(stream)
    if producer != consumer:
        stream_wait(producer, consumer)
    return DeviceArray._trusted(t.data_ptr(), tuple(t.shape), dt, t.stride(), dev, t)


def _torch_current_stream(device: int) -> int:
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device))
    return int(torch.cuda.current_stream(device).cuda_stream)


def _is_torch_tensor_type(tp) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(getattr(torch, "Tensor", None), type) and issubclass(tp, torch.Tensor)


def _importer_for(obj):
    """The import route for ``type(obj)``, remembered in ``_importers``."""
    tp = type(obj)
    if issubclass(tp, DeviceArray):
        imp = _identity
    elif issubclass(tp, (np.ndarray, np.generic)):
        imp = _host_array
    elif issubclass(tp, tuple):
        imp = _from_tuple
    elif _is_torch_tensor_type(tp):
        imp = _from_torch
    else:
        imp = _from_protocols
    if len(_importers) < 256:
        _importers[tp] = imp
    return imp


_importers: dict = {}


def _from_protocols(obj, name: str, stream) -> DeviceArray:
    """CAI first (one dict, no capsule), DLPack when CAI is absent or refuses."""
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
            raise TypeError(f"{name} must be {dtype_names(allowed)}, got {a.dtype.name}")
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


arrays._importer = as_device_array  # (DeviceArray.copy_from takes any GPU array through it)
