"""The CUDA driver as every other module uses it: result checking, graph-capture state, device facts.

``check`` unwraps cuda.bindings' ``(err, *values)`` results into values or a :class:`~mkernel.CudaError`;
device attributes are queried once per (attribute, device).
"""
from __future__ import annotations

import functools
import logging
import os
from contextlib import contextmanager

from cuda.bindings import driver as cu
from cuda.bindings import nvrtc

from ..errors import CudaError, DeviceError

__all__ = ["check", "init_driver", "driver_version", "capture_relaxed", "ignore_other_threads_captures",
           "current_device", "device_attribute", "current_arch", "device_name"]

NO_DRIVER = "no NVIDIA driver found (libcuda.so): mkernel needs a CUDA GPU"
CUDA_MAJOR = 13  # of the cuda-bindings, NVRTC and headers mkernel is installed with (pyproject.toml)
MIN_DRIVER = "580"  # the first driver branch of CUDA 13


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


_OLD_DRIVER = {"CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
               "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER"}


def init_driver() -> None:
    """``cuInit``, with one :class:`~mkernel.DeviceError` for each way there is no usable driver: no
    ``libcuda.so`` at all, a driver older than CUDA 13, no visible GPU.  A driver that loads but reports
    a CUDA version below 13 is logged as a warning (kernels may still load)."""
    try:
        err, = cu.cuInit(0)
    except Exception:  # libcuda.so cannot be loaded (cuda.pathfinder raises): one line, not its traceback
        raise DeviceError(NO_DRIVER) from None
    R = cu.CUresult
    if err == R.CUDA_ERROR_NO_DEVICE:
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise DeviceError("the NVIDIA driver sees no CUDA GPU" + (f" (CUDA_VISIBLE_DEVICES={vis!r})" if vis is not None
                                                                   else ""))
    if err.name in _OLD_DRIVER:
        raise DeviceError(f"the NVIDIA driver is too old for CUDA {CUDA_MAJOR} (mkernel's cuda-bindings and NVRTC): "
                          f"install driver {MIN_DRIVER} or newer ({err.name})")
    check(err)
    ver = driver_version()
    if ver is not None and ver[0] < CUDA_MAJOR:
        logging.getLogger("mkernel").warning(
            "mkernel: the NVIDIA driver supports CUDA %d.%d; mkernel is built on CUDA %d (driver %s or newer)",
            ver[0], ver[1], CUDA_MAJOR, MIN_DRIVER)


def driver_version() -> tuple[int, int] | None:
    """The CUDA version the driver supports, ``(major, minor)``; None without a driver."""
    try:
        err, v = cu.cuDriverGetVersion()
    except Exception:
        return None
    if err != cu.CUresult.CUDA_SUCCESS:
        return None
    return int(v) // 1000, int(v) % 1000 // 10


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


def ignore_other_threads_captures() -> None:
    """Make this thread's driver calls ignore CUDA-graph captures made by other threads (its capture mode
    becomes thread-local, for good: call it first in a thread of the library's own that never captures).

    In CUDA's default (global) mode a thread may not make a "potentially unsafe" call -- a stream or event
    query or synchronize, an allocation -- while *any other* thread of the process captures in global mode
    (what ``cuStreamBeginCapture(..., GLOBAL)`` and PyTorch's ``torch.cuda.graph`` do): the call fails with
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and the other thread's capture is invalidated.  The inter-node
    proxy's threads copy in and out of GPU windows (``cuMemcpy*Async`` + ``cuStreamSynchronize``) whenever a
    peer's message arrives -- e.g. a peer's last flags of the calls just made, landing while this rank
    captures them -- so they run thread-local (docs/internode.md, "Frees while a kernel waits on the
    proxy").  No driver (CPU machines): nothing to do."""
    try:
        cu.cuThreadExchangeStreamCaptureMode(cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    except Exception:  # no driver at all: nothing is being captured
        pass


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


def device_name(device: int) -> str:
    """The device's marketing name ("NVIDIA H200"), or "" when the driver cannot say."""
    try:
        return check(cu.cuDeviceGetName(64, check(cu.cuDeviceGet(device)))).split(b"\0", 1)[0].decode()
    except Exception:
        return ""
