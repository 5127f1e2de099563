"""Memory windows: the byte ranges a transport reads from and writes into.

A window is one contiguous region of this rank's memory, ``nbytes`` long, that peers address by
byte offset (every rank registers windows in the same order, so window ``i`` means the same
buffer on every rank: symmetric).  Two kinds:

* :class:`HostWindow`: a numpy ``uint8`` buffer (tests, bounce buffers, host-side flags).
* :class:`GpuWindow`: a CUDA device pointer + size; the proxy copies in and out with
  ``cuMemcpyDtoHAsync``/``cuMemcpyHtoDAsync`` on a stream it owns, through pinned staging memory,
  and synchronizes before it reports anything done.

Flags are u64 values at 8-byte aligned offsets inside a window; ``write_u64`` raises one (for a
GPU window: after every earlier copy into that window has completed, so a kernel that sees the
flag sees the data).
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

__all__ = ["Window", "HostWindow", "GpuWindow", "as_window"]


class Window:
    """Base class.  ``kind`` is ``"host"`` or ``"gpu"``; ``ptr`` the address (host VA or device ptr)."""

    kind = "?"
    nbytes = 0
    ptr = 0

    def check_range(self, offset: int, n: int) -> None:
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise ValueError(f"range [{offset}, {offset + n}) outside the {self.nbytes}-byte {self.kind} window")

    # host-side view of the bytes, or None (GPU windows)
    def host_view(self) -> np.ndarray | None:
        return None

    def read(self, offset: int, n: int, out: np.ndarray | None = None) -> np.ndarray:
        """Bytes [offset, offset+n) as a uint8 array (a view for host windows unless ``out`` given)."""
        raise NotImplementedError

    def write(self, offset: int, data) -> None:
        raise NotImplementedError

    def write_u64(self, offset: int, value: int) -> None:
        self.write(offset, np.array([value], dtype=np.uint64).view(np.uint8))

    def read_u64(self, offset: int) -> int:
        return int(self.read(offset, 8, np.empty(8, np.uint8)).view(np.uint64)[0])

    def prepare(self) -> None:
        """Make what the transport's copies need (GPU windows: streams, pinned staging); host: nothing."""

    def close(self) -> None:
        pass


class HostWindow(Window):
    """A window over host memory: ``HostWindow(nbytes)`` allocates, ``HostWindow(array)`` wraps
    (any C-contiguous numpy array; viewed as bytes).  ``.array`` is the uint8 view."""

    kind = "host"

    def __init__(self, buf):
        if isinstance(buf, (int, np.integer)):
            # 4 KiB aligned so the buffer can be registered with a NIC page-cleanly
            raw = np.zeros(int(buf) + 4096, dtype=np.uint8)
            start = (-raw.ctypes.data) % 4096
            self._raw = raw
            arr = raw[start:start + int(buf)]
        else:
            arr = np.asarray(buf)
            if not arr.flags.c_contiguous:
                raise ValueError("HostWindow needs a C-contiguous array")
            arr = arr.reshape(-1).view(np.uint8)
        self.array = arr
        self.nbytes = int(arr.nbytes)
        self.ptr = int(arr.ctypes.data)

    def host_view(self):
        return self.array

    def read(self, offset, n, out=None):
        self.check_range(offset, n)
        v = self.array[offset:offset + n]
        if out is None:
            return v
        out[:n] = v
        return out[:n]

    def write(self, offset, data):
        data = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8).reshape(-1)
        self.check_range(offset, data.nbytes)
        self.array[offset:offset + data.nbytes] = data

    def write_u64(self, offset, value):
        self.check_range(offset, 8)
        if offset % 8:
            raise ValueError(f"flag offset {offset} is not 8-byte aligned")
        # one aligned 8-byte store: a reader never sees a torn flag
        self.array[offset:offset + 8].view(np.uint64)[0] = value

    def read_u64(self, offset):
        return int(self.array[offset:offset + 8].view(np.uint64)[0])


class GpuWindow(Window):
    """A window over device memory ``[ptr, ptr+nbytes)`` of the CUDA context current at creation.

    Copies run on a stream this window owns, staged through pinned host memory of ``staging_bytes``
    (allocated on first use); every method returns only after its copies completed.
    """

    kind = "gpu"

    def __init__(self, ptr: int, nbytes: int, staging_bytes: int = 8 << 20):
        from cuda.bindings import driver as cu

        from ...core.driver import check

        self._cu, self._check = cu, check
        self.ptr, self.nbytes = int(ptr), int(nbytes)
        self.ctx = check(cu.cuCtxGetCurrent())
        self._stream = None
        self._staging_bytes = staging_bytes
        self._staging = None
        self._rx = None  # (stream, pinned ptr, array) of the receiver thread
        self._lock = threading.Lock()

    def _ensure(self):
        cu, check = self._cu, self._check
        check(cu.cuCtxSetCurrent(self.ctx))
        if self._stream is None:
            self._stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
            p = check(cu.cuMemHostAlloc(self._staging_bytes, 0))
            self._staging_ptr = int(p)
            self._staging = np.ctypeslib.as_array((ctypes.c_uint8 * self._staging_bytes).from_address(int(p)))

    def prepare(self) -> None:
        """Make the copy streams and pinned staging buffers now (else on first use, in the proxy's
        threads, where the driver calls could wait behind a free of the application's thread)."""
        self._ensure()
        self.rx_staging()

    def staging(self) -> np.ndarray:
        """The pinned staging buffer (uint8), for transports that receive straight into it."""
        self._ensure()
        return self._staging

    def read(self, offset, n, out=None):
        self.check_range(offset, n)
        cu, check = self._cu, self._check
        with self._lock:
            self._ensure()
            if out is None:
                out = np.empty(n, np.uint8)
            pos = 0
            while pos < n:  # through pinned staging, chunk by chunk
                m = min(self._staging_bytes, n - pos)
                check(cu.cuMemcpyDtoHAsync(self._staging_ptr, self.ptr + offset + pos, m, self._stream))
                check(cu.cuStreamSynchronize(self._stream))
                out[pos:pos + m] = self._staging[:m]
                pos += m
            return out[:n]

    def write(self, offset, data):
        data = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8).reshape(-1)
        n = data.nbytes
        self.check_range(offset, n)
        cu, check = self._cu, self._check
        with self._lock:
            self._ensure()
            pos = 0
            while pos < n:
                m = min(self._staging_bytes, n - pos)
                self._staging[:m] = data[pos:pos + m]
                check(cu.cuMemcpyHtoDAsync(self.ptr + offset + pos, self._staging_ptr, m, self._stream))
                check(cu.cuStreamSynchronize(self._stream))
                pos += m

    def rx_staging(self) -> np.ndarray:
        """A pinned buffer of its own for a receiver thread (``read``/``write`` use the other one
        under the lock, from the proxy thread, at the same time)."""
        if self._rx is None:
            cu, check = self._cu, self._check
            check(cu.cuCtxSetCurrent(self.ctx))
            stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
            p = int(check(cu.cuMemHostAlloc(self._staging_bytes, 0)))
            buf = np.ctypeslib.as_array((ctypes.c_uint8 * self._staging_bytes).from_address(p))
            self._rx = (stream, p, buf)
        return self._rx[2]

    def write_from_rx_staging(self, offset, n):
        """Copy rx_staging()[:n] (filled by the receiver thread) to [offset, offset+n) and wait."""
        self.check_range(offset, n)
        cu, check = self._cu, self._check
        stream, p, _ = self._rx
        check(cu.cuMemcpyHtoDAsync(self.ptr + offset, p, n, stream))
        check(cu.cuStreamSynchronize(stream))

    def write_u64(self, offset, value):
        if offset % 8:
            raise ValueError(f"flag offset {offset} is not 8-byte aligned")
        self.write(offset, np.array([value], dtype=np.uint64).view(np.uint8))

    def close(self):
        cu = self._cu
        if self._stream is not None:
            cu.cuCtxSetCurrent(self.ctx)
            cu.cuStreamDestroy(self._stream)
            cu.cuMemFreeHost(self._staging_ptr)
            self._stream = None
        if self._rx is not None:
            cu.cuCtxSetCurrent(self.ctx)
            cu.cuStreamDestroy(self._rx[0])
            cu.cuMemFreeHost(self._rx[1])
            self._rx = None


def as_window(x) -> Window:
    """A Window from a Window, a numpy array (host), an int size (new host buffer), or an object
    with ``__cuda_array_interface__`` (GPU: pointer + nbytes)."""
    if isinstance(x, Window):
        return x
    if isinstance(x, (int, np.integer, np.ndarray)):
        return HostWindow(x)
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        shape, typestr = cai["shape"], cai["typestr"]
        n = int(np.prod(shape)) * np.dtype(typestr).itemsize
        return GpuWindow(cai["data"][0], n)
    if hasattr(x, "ptr") and hasattr(x, "nbytes"):
        return GpuWindow(int(x.ptr), int(x.nbytes))
    raise TypeError(f"cannot make a memory window from {type(x).__name__}")
