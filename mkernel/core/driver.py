"""The CUDA driver as every other module uses it: result checking, graph-capture state, device facts.

``check`` unwraps cuda.bindings' ``(err, *values)`` results into values or a :class:`~mkernel.CudaError`;
device attributes are queried once per (attribute, device).
"""
from __future__ import annotations

import functools
from contextlib import contextmanager

from cuda.bindings import driver as cu
from cuda.bindings import nvrtc

from ..errors import CudaError

__all__ = ["check", "capture_relaxed", "current_device", "device_attribute", "current_arch"]


def check(result):
    """Unwrap a cuda.bindings ``(err, *values)`` result, raising :class:`CudaError` on failure."""
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if isinstance(err, cu.CUresult):
        if err != cu.CUresult.CUDA_SUCCESS:
            _, name = cu.cuGetErrorName(err)
            _, text = cu.cuGetErrorString(err)
            raise CudaError(int(err), f"{name.decode() if name else err}: {text.decode() if text else ''}")
    elif isinstance(err, nvrtc.nvrtcResult):
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CudaError(int(err), f"NVRTC error {err}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest



@contextmanager
def capture_relaxed():
    """Let this thread call what a CUDA-graph capture in global mode forbids (cuMemAlloc, cuMemFree,
    module loads) while some stream is being captured: the library allocates a plan's workspace,
    frees an evicted plan's and loads modules lazily, possibly inside the caller's capture, and
    none of that is (or needs to be) part of the captured work.  Without it such a call fails with
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the caller's capture."""
    try:
        err, prev = cu.cuThreadExchangeStreamCaptureMode(cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    except Exception:  # no driver at all (CPU machines): nothing is being captured
        err, prev = None, None
    try:
        yield
    finally:
        if err == cu.CUresult.CUDA_SUCCESS:
            cu.cuThreadExchangeStreamCaptureMode(prev)


def current_device() -> int:
    return int(check(cu.cuCtxGetDevice()))


def device_attribute(attr: cu.CUdevice_attribute, device: int | None = None) -> int:
    """A device attribute (None: the current context's device), queried once per (attribute, device):
    they never change while the process runs."""
    dev = current_device() if device is None else device
    return _device_attribute(attr, dev)


@functools.lru_cache(maxsize=None)
def _device_attribute(attr: cu.CUdevice_attribute, device: int) -> int:
    return int(check(cu.cuDeviceGetAttribute(attr, device)))


def current_arch() -> str:
    """``sm_XYa`` for the current device (the ``a`` variant where wgmma/setmaxnreg need it)."""
    A = cu.CUdevice_attribute
    major = device_attribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
    minor = device_attribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
    suffix = "a" if major >= 9 else ""
    return f"sm_{major}{minor}{suffix}"
