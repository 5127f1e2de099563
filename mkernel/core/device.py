"""CUDA contexts for the array layer: driver initialization, the device's primary context, pointers'
devices, and stream ordering between a producer's stream and ours."""
from __future__ import annotations

import contextlib
import threading

from cuda.bindings import driver as cu

from .driver import check, init_driver
from .streams import stream_handle

__all__ = ["cu_init", "on_device", "pointer_device", "current_device_or", "stream_wait", "current_context",
           "context_handle"]


_init_lock = threading.Lock()
_initialized = False
_primary: dict[int, object] = {}  # device ordinal -> retained primary CUcontext (kept for the process)


def cu_init() -> None:
    """Initialize the driver once per process (:func:`~mkernel.core.driver.init_driver`: a
    :class:`~mkernel.DeviceError` when there is none)."""
    global _initialized
    if not _initialized:
        with _init_lock:
            if not _initialized:
                init_driver()
                _initialized = True


def _primary_context(dev: int):
    ctx = _primary.get(dev)
    if ctx is None:
        ctx = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(dev))))
        _primary[dev] = ctx
    return ctx


@contextlib.contextmanager
def on_device(device: int | None = None):
    """Run with a context of ``device`` current; yields ``(ctx, device)``.

    ``None`` means the current context's device.  With no current context at all, the device's
    primary context is made current (as the CUDA runtime does implicitly); a context of another
    device is pushed for the duration and popped after.
    """
    cu_init()
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


_wait_events = threading.local()  # per thread: current context handle -> a reusable event


def stream_wait(producer: int, consumer) -> None:
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


def pointer_device(ptr: int) -> int | None:
    """The device ordinal of a device pointer; None when the driver can't say (no driver/GPU)."""
    try:
        cu_init()
    except Exception:
        return None
    try:
        return int(check(cu.cuPointerGetAttribute(
            cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)))
    except Exception:
        return None


def current_device_or(default: int) -> int:
    try:
        cu_init()
        ctx = check(cu.cuCtxGetCurrent())
        if int(ctx) != 0:
            return int(check(cu.cuCtxGetDevice()))
    except Exception:
        pass
    return default


def current_context() -> tuple[int, int]:
    """(handle, device) of the current CUDA context: a bound call's prepared launches belong to it."""
    return int(check(cu.cuCtxGetCurrent())), int(check(cu.cuCtxGetDevice()))


def context_handle() -> int:
    """The current CUDA context's handle (0: none): checked on every call of a bound call, which launches in
    its own context."""
    return int(cu.cuCtxGetCurrent()[1])
