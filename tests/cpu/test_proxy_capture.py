"""The inter-node proxy's threads and an application's CUDA-graph capture in global mode (CPU only: the driver's
capture rule emulated).

CUDA's rule (cuThreadExchangeStreamCaptureMode): while any thread of the process captures a stream in *global*
mode, a thread whose own mode is global (every thread's default) may not make a "potentially unsafe" driver call
-- a stream / event query or synchronize, an allocation: the call fails (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
and the capture is invalidated.  The proxy's threads copy in and out of GPU windows (``cuMemcpy*Async`` then
``cuStreamSynchronize``) whenever a message goes out or comes in -- e.g. a peer's last flags of the calls a rank
just made, landing while it captures them (tests/gpu/test_moe.py::test_internode_node_dedup_graph_replay
captures in global mode, as ``torch.cuda.graph`` does by default): without a thread-local mode of their own,
that copy failed, the proxy died and the capture was invalidated.  Here two thread ranks run real proxies over
the TCP transport on windows whose copies make such a call; one rank "captures" in global mode while both send
each other data and a flag.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from _thread_ranks import run_ranks

from mkernel.core import driver
from mkernel.proxy import OP_WRITE, Proxy
from mkernel.proxy.transport import HostWindow

GLOBAL, THREAD_LOCAL, RELAXED = 0, 1, 2


class FakeCaptureDriver:
    """What the driver does with capture modes: a mode per thread (global by default), global-mode captures by
    thread; ``unsafe(what)`` is a potentially unsafe call of the calling thread."""

    class CUstreamCaptureMode:
        CU_STREAM_CAPTURE_MODE_GLOBAL, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, CU_STREAM_CAPTURE_MODE_RELAXED = \
            GLOBAL, THREAD_LOCAL, RELAXED

    class CUresult:
        CUDA_SUCCESS = 0

    def __init__(self):
        self._tls = threading.local()
        self._lock = threading.Lock()
        self.capturing: set[int] = set()  # threads capturing in global mode
        self.refused: list = []  # (thread name, call) refused while another thread captured
        self.unsafe_calls = 0

    def cuThreadExchangeStreamCaptureMode(self, mode):
        prev = getattr(self._tls, "mode", GLOBAL)
        self._tls.mode = int(mode)
        return (0, prev)

    def begin_capture(self):
        with self._lock:
            self.capturing.add(threading.get_ident())

    def end_capture(self):
        with self._lock:
            self.capturing.discard(threading.get_ident())

    def unsafe(self, what: str):
        me, mode = threading.get_ident(), getattr(self._tls, "mode", GLOBAL)
        with self._lock:
            self.unsafe_calls += 1
            others = self.capturing - {me}
            if (others and mode == GLOBAL) or (me in self.capturing and mode != RELAXED):
                self.refused.append((threading.current_thread().name, what))
                raise RuntimeError(f"{what}: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (a capture in global mode is "
                                   "in progress; the capture is invalidated)")


class CopyingWindow(HostWindow):
    """A host window whose reads and writes end as a GPU window's do: with a stream synchronize."""

    def __init__(self, nbytes, fake):
        super().__init__(nbytes)
        self.fake = fake

    def read(self, offset, n, out=None):
        v = super().read(offset, n, out)
        self.fake.unsafe("cuStreamSynchronize (DtoH)")
        return v

    def write(self, offset, data):
        super().write(offset, data)
        self.fake.unsafe("cuStreamSynchronize (HtoD)")

    def write_u64(self, offset, value):
        super().write_u64(offset, value)
        self.fake.unsafe("cuStreamSynchronize (HtoD flag)")


NBYTES, DATA, FLAG = 1 << 14, 4096, 64


@pytest.fixture
def fake(monkeypatch):
    f = FakeCaptureDriver()
    monkeypatch.setattr(driver, "cu", f)  # what ignore_other_threads_captures() talks to
    return f


def test_proxy_threads_ignore_another_threads_global_capture(fake):
    """Rank 0's thread captures in global mode while both ranks' proxies send data + a flag to each other: every
    copy of the proxies' threads (the sender's read, the receiver's writes) goes through, nothing is refused (the
    capture stays valid), and the data and flags arrive."""
    captured = threading.Event()

    def body(ex, r):
        win = CopyingWindow(NBYTES, fake)
        win.array[:DATA] = (np.arange(DATA) * 3 + 11 * r) & 0xFF
        proxy = Proxy(ex, [win], transport="tcp", ring_capacity=16, timeout=10.0)
        proxy.start()
        try:
            ex.allgather(None)  # both proxies up
            if r == 0:
                fake.begin_capture()  # the application's capture (global mode) ...
                captured.set()
            captured.wait(10)
            peer = 1 - r
            proxy.producer(5).push(OP_WRITE, peer, 0, 0, DATA, DATA, 0, NBYTES - FLAG + 8 * r, 7)
            t0 = time.monotonic()
            while win.read_u64(NBYTES - FLAG + 8 * peer) < 7:  # (HostWindow.read_u64: no driver call)
                proxy.check()
                assert time.monotonic() - t0 < 10, f"rank {r}: the peer's flag never arrived ({fake.refused})"
                time.sleep(1e-3)
            want = ((np.arange(DATA) * 3 + 11 * peer) & 0xFF).astype(np.uint8)
            assert np.array_equal(win.array[DATA:2 * DATA], want)
            ex.allgather(None)  # ... spans both ranks' traffic
            if r == 0:
                fake.end_capture()
        finally:
            if r == 0:
                fake.end_capture()
            proxy.close()
        return True

    results, errors = run_ranks(2, body, timeout=60, abort_on_error=True)
    assert errors == [None, None], errors
    assert results == [True, True]
    assert fake.refused == [] and fake.unsafe_calls >= 4  # (2 reads, >= 2 data and 2 flag writes)


def test_the_helper_sets_thread_local_mode_and_tolerates_no_driver(fake, monkeypatch):
    """ignore_other_threads_captures(): this thread thread-local; without a driver (CPU machines) a no-op."""
    def in_thread():
        driver.ignore_other_threads_captures()
        return fake.cuThreadExchangeStreamCaptureMode(GLOBAL)[1]
    out = []
    t = threading.Thread(target=lambda: out.append(in_thread()))
    t.start()
    t.join(5)
    assert out == [THREAD_LOCAL]

    class NoDriver:
        class CUstreamCaptureMode:
            CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = THREAD_LOCAL

        @staticmethod
        def cuThreadExchangeStreamCaptureMode(mode):
            raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via system search')
    monkeypatch.setattr(driver, "cu", NoDriver)
    driver.ignore_other_threads_captures()  # no exception
