"""Streams: any stream-like object to a raw handle, events for fork/join, ordered async copies."""
from __future__ import annotations

from cuda.bindings import driver as cu

from .driver import check

__all__ = ["stream_handle", "is_capturing", "Events", "copy_async"]


def stream_handle(stream) -> int:
    """A raw ``CUstream`` handle (int) from any stream-like object; ``None`` is the legacy default stream.

    Accepted: an int, an object with ``__cuda_stream__`` (a ``(version, handle)`` tuple or a handle), with a
    ``cuda_stream`` / ``ptr`` / ``handle`` attribute or method (torch, CuPy, Numba streams), a ``CUstream``.
    The way to read a type is found once and remembered (a call costs a dict lookup and one read)."""
    if stream is None:
        return 0
    tp = type(stream)
    if tp is int:
        return stream
    read = _readers.get(tp)
    if read is None:
        read = _reader_for(stream)
        if len(_readers) < 64:
            _readers[tp] = read
    return read(stream)


_readers: dict = {}


def _from_protocol(s) -> int:
    val = s.__cuda_stream__
    val = val() if callable(val) else val
    return int(val[1]) if isinstance(val, tuple) else int(val)


def _reader_for(stream):
    if isinstance(stream, int):
        return int
    if getattr(stream, "__cuda_stream__", None) is not None:
        return _from_protocol
    for attr in ("cuda_stream", "ptr", "handle"):
        if hasattr(stream, attr):
            if callable(getattr(stream, attr)):
                return lambda s, a=attr: int(getattr(s, a)())
            return lambda s, a=attr: int(getattr(s, a))
    if isinstance(stream, cu.CUstream):
        return int
    raise TypeError(f"mkernel: cannot get a CUDA stream handle from {type(stream).__name__}; pass an "
                    "object with __cuda_stream__ or a raw CUstream handle (int)")


def is_capturing(stream) -> bool:
    """True while ``stream`` is being captured into a CUDA graph (an error, e.g. no context: False)."""
    err, status = cu.cuStreamIsCapturing(cu.CUstream(stream_handle(stream)))
    return (err == cu.CUresult.CUDA_SUCCESS
            and status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE)


class Events:
    """Named CUDA events without timing (``Events("fork", "join").fork``), for fork/join between a
    caller's stream and a side stream; destroyed with the object (captured graphs keep no reference
    to them: inside a capture a record/wait pair becomes a graph dependency)."""

    def __init__(self, *names: str):
        flags = cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._names = names
        for n in names:
            setattr(self, n, check(cu.cuEventCreate(flags)))

    def __del__(self):
        try:
            for n in self._names:
                cu.cuEventDestroy(getattr(self, n))
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


def copy_async(copies, stream) -> None:
    """``cuMemcpyAsync`` of every ``(dst, src, bytes)`` of ``copies``, in order, on ``stream`` (a
    ``CUstream`` or anything stream_handle takes); a stream's copies run in that order, which the
    copy-engine paths rely on (data, then its flag)."""
    s = stream if isinstance(stream, cu.CUstream) else cu.CUstream(stream_handle(stream))
    memcpy = cu.cuMemcpyDtoDAsync
    for d, src, n in copies:
        r, = memcpy(d, src, n, s)
        if r != cu.CUresult.CUDA_SUCCESS:
            check((r,))
