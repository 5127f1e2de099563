"""Probe: does a blocking cuda.bindings call (cuStreamSynchronize, cuCtxSynchronize, cuMemcpyDtoH, cuMemFree)
hold the GIL, and does it block another thread's driver calls?  A 1 s spin kernel runs on the legacy
stream; a second Python thread counts loop turns and times small driver calls meanwhile.
Run: python experiments/gil_probe.py"""
from __future__ import annotations

import ctypes
import threading
import time

import cupy as cp
import numpy as np
from cuda.bindings import driver as cu

SPIN = cp.RawKernel(r'''
extern "C" __global__ void spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}''', "spin")


def main():
    cp.cuda.Device(0).use()
    cp.zeros(1).sum()
    ctx = cu.cuCtxGetCurrent()[1]
    libcuda = ctypes.CDLL("libcuda.so.1")
    dbuf = cu.cuMemAlloc(1 << 20)[1]
    host = np.zeros(1 << 18, np.float32)

    def variants():
        yield "bindings cuStreamSynchronize(0)", lambda: cu.cuStreamSynchronize(cu.CUstream(0))
        yield "bindings cuCtxSynchronize", lambda: cu.cuCtxSynchronize()
        yield "bindings cuMemcpyDtoH", lambda: cu.cuMemcpyDtoH(host.ctypes.data, dbuf, host.nbytes)
        yield "bindings cuMemFree", lambda: cu.cuMemFree(cu.cuMemAlloc(4096)[1])
        yield "ctypes cuStreamSynchronize(0)", lambda: libcuda.cuStreamSynchronize(ctypes.c_void_p(0))
        yield "ctypes cuCtxSynchronize", lambda: libcuda.cuCtxSynchronize()

    for name, fn in variants():
        stop = threading.Event()
        stats = {"turns": 0, "calls": 0, "max_call": 0.0}

        def other():
            cu.cuCtxSetCurrent(ctx)
            s = cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)[1]
            last = time.perf_counter()
            while not stop.is_set():
                stats["turns"] += 1
                now = time.perf_counter()
                if now - last > 0.01:
                    last = now
                    t0 = time.perf_counter()
                    cu.cuMemcpyHtoDAsync(dbuf, host.ctypes.data, 64, s)
                    while cu.cuStreamQuery(s)[0] == cu.CUresult.CUDA_ERROR_NOT_READY:
                        pass
                    stats["max_call"] = max(stats["max_call"], time.perf_counter() - t0)
                    stats["calls"] += 1
            cu.cuStreamDestroy(s)

        th = threading.Thread(target=other)
        th.start()
        time.sleep(0.1)
        SPIN((1,), (1,), (np.uint64(1_000_000_000),))
        b_turns, b_calls = stats["turns"], stats["calls"]
        stats["max_call"] = 0.0
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        turns, calls, mc = stats["turns"] - b_turns, stats["calls"] - b_calls, stats["max_call"]
        stop.set()
        th.join()
        cu.cuCtxSynchronize()
        print(f"{name:34s}: blocked {dt:.3f} s; other thread: {turns} loop turns, {calls} HtoD calls "
              f"(longest {mc * 1e3:.1f} ms) while it was blocked", flush=True)


if __name__ == "__main__":
    main()
