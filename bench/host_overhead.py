#!/usr/bin/env python
"""Where an eager mkernel call's host time goes: Python in the library vs the driver's launch calls.

    mpirun --allow-run-as-root -np 2 python bench/host_overhead.py      (or 1 rank: gemm only)

Small collectives (64 KiB - 4 MiB) are bound by host submission in eager mode (bench/collectives.py
marks them †): a call takes as long to submit as the GPU takes to run it.  This splits the submit
time of each op into the driver calls (cuLaunchKernelEx, cuMemcpyAsync, event record/wait: timed by
wrapping them) and the rest (argument checks, plan lookup, argument packing: Python).  Per op: the
median over rounds of (host seconds to submit N back-to-back calls) / N, and the driver share of
it; the GPU is synchronized between rounds only.  No GPU time is measured.  Prints a table.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import _common as C  # noqa: E402

N_CALLS = 200
ROUNDS = 7


class DriverClock:
    """Wraps driver entry points of the ``cu`` namespace (cuda.bindings.driver) of the modules given to sum the
    time spent in them."""

    NAMES = ("cuLaunchKernelEx", "cuMemcpyDtoDAsync", "cuEventRecord", "cuStreamWaitEvent", "cuCtxGetCurrent")

    def __init__(self, modules):
        self.total = 0.0
        self.count = 0
        self._saved = []
        seen = set()
        for mod in modules:
            cu = mod.cu  # (the same cuda.bindings.driver module in every mkernel module: wrap it once)
            if id(cu) in seen:
                continue
            seen.add(id(cu))
            for name in self.NAMES:
                fn = getattr(cu, name, None)
                if fn is None:
                    continue
                self._saved.append((cu, name, fn))

        for cu, name, fn in self._saved:
            setattr(cu, name, self._wrap(fn))

    def _wrap(self, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.total += time.perf_counter() - t0
                self.count += 1
        return timed

    def restore(self):
        for cu, name, fn in reversed(self._saved):
            setattr(cu, name, fn)


def measure(name, fn, ctx, clock, comm):
    import torch

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ctx.check()
    per_call, driver, calls = [], [], []
    for _ in range(ROUNDS):
        comm.Barrier()
        clock.total, clock.count = 0.0, 0
        t0 = time.perf_counter()
        for _ in range(N_CALLS):
            fn()
        dt = time.perf_counter() - t0
        per_call.append(dt / N_CALLS * 1e6)
        driver.append(clock.total / N_CALLS * 1e6)
        calls.append(clock.count / N_CALLS)
        torch.cuda.synchronize()
    ctx.check()
    return dict(op=name, host_us=statistics.median(per_call), driver_us=statistics.median(driver),
                driver_calls=statistics.median(calls))


def main():
    ctx = C.bootstrap(nccl=False)
    import torch

    import mkernel
    from mkernel.ops import gemm as G

    from mkernel.core.interop import as_device_array

    comm = ctx.world
    s = torch.cuda.current_stream()
    sh = int(s.cuda_stream)
    dev = torch.device("cuda", ctx.device)
    P = ctx.local_size
    cases = []

    def t(shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=dev, dtype=dtype)

    if P > 1:
        for nbytes in (64 << 10, 1 << 20, 4 << 20):
            n = nbytes // 2
            x, o = t((n,)), t((n,))
            X, O = as_device_array(x, stream=sh), as_device_array(o, stream=sh)
            cases.append((f"all_reduce {C.fmt_bytes(nbytes)} (DeviceArray args)",
                          lambda X=X, O=O: mkernel.all_reduce(ctx, X, O, stream=sh)))
            cases.append((f"all_reduce {C.fmt_bytes(nbytes)} (torch args)",
                          lambda x=x, o=o: mkernel.all_reduce(ctx, x, o, stream=sh)))
        x, o = t((1 << 18,)), t((P << 18,))
        X, O = as_device_array(x, stream=sh), as_device_array(o, stream=sh)
        cases.append(("all_gather 1 MiB out", lambda X=X, O=O: mkernel.all_gather(ctx, X, O, stream=sh)))
        a, w, c = t((128, 8192)), t((5120, 8192)), t((128 * P, 5120))
        A, W, CO = (as_device_array(v, stream=sh) for v in (a, w, c))
        cases.append(("ag_gemm M=128/rank N=5120 K=8192",
                      lambda A=A, W=W, CO=CO: mkernel.ag_gemm(ctx, A, W, CO, b_layout="nk", stream=sh)))
    a, w, c = t((128, 8192)), t((8192, 8192)), t((128, 8192))
    A, W, CO = (as_device_array(v, stream=sh) for v in (a, w, c))
    cases.append(("gemm 128x8192x8192 nk", lambda A=A, W=W, CO=CO: G.gemm(A, W, CO, b_layout="nk", stream=sh)))

    clock = DriverClock([sys.modules[m] for m in ("mkernel.core.launch", "mkernel.ops.collectives.api",
                                                  "mkernel.ops.ag_gemm.op")])
    rows = []
    try:
        for name, fn in cases:
            r = measure(name, fn, ctx, clock, comm)
            r["host_us"], _ = C.max_over_ranks(r["host_us"], comm)
            r["driver_us"], _ = C.max_over_ranks(r["driver_us"], comm)
            rows.append(r)
    finally:
        clock.restore()
    if ctx.rank == 0:
        print(C.markdown_table(["op", "host us/call", "driver us/call", "driver calls/call", "rest (Python) us"],
                               [[r["op"], f"{r['host_us']:.1f}", f"{r['driver_us']:.1f}", f"{r['driver_calls']:.1f}",
                                 f"{r['host_us'] - r['driver_us']:.1f}"] for r in rows]))
    C.shutdown(ctx)


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        sys.exit(print(__doc__))
    main()
