"""The DLPack ABI (ctypes): exporting a view of device memory as a capsule, and reading one."""
from __future__ import annotations

import ctypes
import sys
import weakref

from .dtypes import dtype_from_dlpack

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED = 1, 2, 3, 13  # DLDeviceType

__all__ = ["DLPACK_VERSION", "export_capsule", "read_capsule", "DLPackOwner", "KDL_CPU", "KDL_CUDA", "KDL_CUDA_HOST",
           "KDL_CUDA_MANAGED"]


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


def export_capsule(arr, versioned: bool):
    """A DLPack capsule viewing ``arr`` (anything with ptr, shape, strides in elements, dtype, readonly,
    __dlpack_device__); ``arr`` stays alive until the consumer calls the deleter."""
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


def read_capsule(capsule, name: str = "array", producer=None):
    """Consume a DLPack capsule (legacy or versioned): ``(ptr, shape, strides or None, DType,
    device_type, device_id, readonly, owner)``; ``owner`` calls the producer's deleter when it
    dies.  Non-CUDA tensors and unsupported dtypes are refused (TypeError) before the capsule is consumed, so its producer
    still frees it."""
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
    dtype = dtype_from_dlpack(int(t.dtype.code), int(t.dtype.bits), int(t.dtype.lanes), name)
    nd = int(t.ndim)
    shape = tuple(int(t.shape[i]) for i in range(nd))
    strides = tuple(int(t.strides[i]) for i in range(nd)) if t.strides else None
    ptr = int(t.data or 0) + int(t.byte_offset)
    deleter = int(mt.deleter or 0)
    if not _Capsule_SetName(capsule, used) == 0:  # pragma: no cover - SetName raises on failure
        raise RuntimeError("PyCapsule_SetName failed")
    owner = DLPackOwner(addr, deleter, versioned, producer)
    return ptr, shape, strides, dtype, dev_type, dev_id, readonly, owner
