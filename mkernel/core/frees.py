"""Device-memory frees that never stall a kernel waiting on this process's inter-node proxy.

``cuMemFree`` waits for the device to go idle and holds a driver lock while it waits, so every other
thread's driver call (the TCP transport's copies in and out of GPU memory) waits behind it.  A free made
while a kernel waits on the proxy would therefore stall that kernel until its timeout
(docs/internode.md, "Frees while a kernel waits on the proxy").  Ops whose kernels wait on a proxy
call :func:`mark_proxy_launch` after each launch (an event on the launch stream); a free made while
any marked launch is unfinished is deferred, and done by the first free (or :func:`drain`) that finds
none unfinished.  Other processes see no change: only frees of this process wait.
"""
from __future__ import annotations

import threading
import time

from cuda.bindings import driver as cu

from .driver import check
from .streams import is_capturing

__all__ = ["mark_proxy_launch", "release", "drain", "pending", "wait_marked"]

# Re-entrant: a finalizer (release) may run inside the locked code when the interpreter collects garbage
# there; it then only defers (_inside), never touching the lists being walked.
_lock = threading.RLock()
_inside = 0
_marks: list = []      # CUevent of unfinished marked launches
_graph_marks: list = []  # CUevent recorded by graph replays (captured marks): checked always, never reused
_pool: list = []       # finished events, ready to be recorded again
_deferred: list = []   # (free function, context handle, pointer) waiting for no marked launch


def _record(stream: int) -> None:
    if is_capturing(stream):  # the record becomes a graph node: every replay records the event again
        ev = check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
        check(cu.cuEventRecordWithFlags(ev, cu.CUstream(stream), cu.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL))
        _graph_marks.append(ev)
        return
    ev = _pool.pop() if _pool else check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
    check(cu.cuEventRecord(ev, cu.CUstream(stream)))
    _marks.append(ev)


def _done(ev) -> bool:
    err, = cu.cuEventQuery(ev)
    return err != cu.CUresult.CUDA_ERROR_NOT_READY


_RELAXED = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED


def _exchange_mode(mode):
    """This thread's stream-capture mode set to ``mode``; the previous one (None: not changed)."""
    err, prev = cu.cuThreadExchangeStreamCaptureMode(mode)
    return prev if err == cu.CUresult.CUDA_SUCCESS else None


def mark_proxy_launch(stream: int) -> None:
    """Note a launch on ``stream`` (raw handle) whose kernel may wait on this process's proxy."""
    global _inside
    with _lock:
        _inside += 1
        try:
            _busy()  # drop the finished marks: the list stays as long as the launches in flight
            _record(stream)
        finally:
            _inside -= 1


def _busy() -> bool:
    # An event query is an "unsafe" call during a stream capture on this thread and would invalidate the
    # caller's capture: query in relaxed capture mode, which allows it (events outside the capture).
    prev = _exchange_mode(_RELAXED)
    try:
        keep = []
        for ev in _marks:
            (keep if not _done(ev) else _pool).append(ev)
        _marks[:] = keep
        return bool(keep) or not all(_done(ev) for ev in _graph_marks)
    finally:
        if prev is not None:
            _exchange_mode(prev)


def _take(extra) -> list:
    """(under the lock) The frees to do now, or [] after deferring ``extra``."""
    global _inside
    if _inside:
        if extra is not None:
            _deferred.append(extra)
        return []
    _inside += 1
    try:
        if _busy():
            if extra is not None:
                _deferred.append(extra)
            return []
        todo = _deferred[:] + ([extra] if extra is not None else [])
        _deferred.clear()
        return todo
    finally:
        _inside -= 1


def release(free, ctx_handle: int, ptr: int) -> None:
    """``free(ctx_handle, ptr)`` now, or once no marked launch is unfinished (with the deferred ones)."""
    with _lock:
        todo = _take((free, ctx_handle, ptr))
    for f, c, p in todo:
        f(c, p)


def drain() -> None:
    """Do the deferred frees if no marked launch is unfinished (after a device-wide synchronize)."""
    with _lock:
        todo = _take(None) if _deferred else []
    for f, c, p in todo:
        f(c, p)


def pending() -> int:
    """How many frees wait (tests, diagnostics)."""
    return len(_deferred)


def wait_marked(poll_s: float = 1e-3) -> None:
    """Return once no marked launch is unfinished: polls the marks' events, sleeping between queries (no
    driver lock held, the GIL released), so this process's proxy threads keep serving the kernels waited
    for.  Used before driver calls that may wait for the device holding the driver lock where no free is
    involved: a kernel's first load (launch.Kernel._func)."""
    global _inside
    if not _marks and not _graph_marks:  # (nothing marked: no driver call)
        return
    sleep = 20e-6
    while True:
        with _lock:
            if _inside:  # (called from frees' own locked code, e.g. by a finalizer: never wait there)
                return
            _inside += 1
            try:
                busy = _busy()
            finally:
                _inside -= 1
        if not busy:
            return
        time.sleep(sleep)
        sleep = min(poll_s, sleep * 2)
