#!/usr/bin/env python
"""Where an eager call's host time goes: cProfile over back-to-back mkernel.gemm calls with DeviceArrays
(a rotating pool of operands, so every call re-points), then a per-stage timing of one call's path.

    python tools/host_profile.py [--calls 20000] [--m 16] [--n 1024] [--k 1024] [--top 25]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cuda.bindings import driver as cu  # noqa: E402

import mkernel  # noqa: E402
from mkernel.core.driver import check  # noqa: E402
from mkernel.core.arrays import DeviceArray  # noqa: E402
from mkernel.core.interop import as_device_array  # noqa: E402
from mkernel.ops import base as BASE  # noqa: E402
from mkernel.ops.gemm import operands as GO  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    M, N, K = args.m, args.n, args.k
    pool = [(DeviceArray.empty((M, K), "bfloat16"), DeviceArray.empty((M, N), "bfloat16")) for _ in range(16)]
    w = DeviceArray.empty((N, K), "bfloat16")
    s = int(check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)))

    def loop(n):
        for i in range(n):
            a, o = pool[i & 15]
            mkernel.gemm(a, w, o, b_layout="nk", stream=s)

    loop(100)
    check(cu.cuCtxSynchronize())
    for rnd in range(3):
        t = time.perf_counter()
        loop(args.calls // 4)
        dt = (time.perf_counter() - t) / (args.calls // 4)
        check(cu.cuCtxSynchronize())
        print(f"round {rnd}: {dt * 1e6:.2f} us per call (host, back to back)")
    pr = cProfile.Profile()
    pr.enable()
    loop(args.calls)
    pr.disable()
    check(cu.cuCtxSynchronize())
    pstats.Stats(pr).sort_stats("tottime").print_stats(args.top)
    # stage timings (each stage alone, averaged over many runs)
    a, o = pool[0]
    reps = 20000
    def t(fn):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6
    print(f"as_device_array(DeviceArray): {t(lambda: as_device_array(a, name='a', stream=s)):.2f} us")
    print(f"layout_key: {t(lambda: GO.layout_key(a)):.2f} us")
    print(f"as_stream(int): {t(lambda: BASE.as_stream(s)):.2f} us")


if __name__ == "__main__":
    main()
