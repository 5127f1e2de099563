#!/usr/bin/env python
"""Phase timeline of one mkernel.gemm call, from timestamps the kernel records itself
(cuda_src/core/mk_trace.cuh, compiled in with MK_GEMM_TRACE): where a few-tile GEMM's time goes --
launch skew, barrier setup, pipeline fill, main loop, split-K reduction, epilogue.

    python tools/gemm_trace.py dsv3.q_a@512 square1024:1 dsv3.q_a@512:4:1

Specs: a shape as in tools/gemm_profile.py (NAME@M, squareN, MxNxK with B [N, K]), optionally
``:CONFIG`` and ``:CONFIG:SPLITS`` to force the plan.  Per spec: the plan, the call's time (CUDA
events, median of 50 eager calls, the trace compiled in), then the medians and maxima over blocks of
each phase in microseconds (SM clock ticks converted with the clock rate measured over the call).
TRACE_COLD=1 evicts L2 before every timed and traced call (inputs come from HBM, as in bench/gemm.py).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["MKERNEL_DEFINES"] = ",".join(filter(None, [os.environ.get("MKERNEL_DEFINES", ""), "MK_GEMM_TRACE=1"]))
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "bench"), str(ROOT)]  # gemm_profile; bench/gemm.py; the package

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    sys.exit(print(__doc__))  # before the imports that need a GPU machine (torch, the driver)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from cuda.bindings import driver as cu  # noqa: E402

from gemm_profile import parse  # noqa: E402
from mkernel.ops import gemm as G
from mkernel.ops import gemm as G
from mkernel.core import compiler as runtime  # noqa: E402
from mkernel.core.interop import as_device_array  # noqa: E402

EVENTS = 16  # cuda_src/core/mk_trace.cuh MK_TRACE_EVENTS
COLD = os.environ.get("TRACE_COLD", "0") == "1"  # evict L2 (write 256 MiB) before every timed call
FLUSH = None


def trace_buffers():
    out = []
    for (source, _, _), k in list(runtime._kernels.items()):
        if source != "gemm/gemm.cu":
            continue
        ptr, size = runtime.check(cu.cuModuleGetGlobal(k.module._module_handle(), b"mk_trace_buf"))
        out.append((int(ptr), size))
    return list(dict.fromkeys(out))


def run(spec: str):
    parts = spec.split(":")
    name, M, N, K = parse(parts[0])
    config = int(parts[1]) if len(parts) > 1 else None
    splits = int(parts[2]) if len(parts) > 2 else None
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    da, db, dc = as_device_array(a), as_device_array(b), as_device_array(c)
    s = torch.cuda.current_stream()
    call = lambda: G.gemm(da, db, dc, b_layout="nk", stream=s, config=config, splits=splits)  # noqa: E731
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    plan = G.last_plan()
    cfg = G.CONFIGS[plan.config]
    plan = f"config {plan.config} ({cfg.bm}x{cfg.tile_n('nk')}) splits {plan.splits} from {plan.split_from} grid {plan.grid}"
    ts = []
    for _ in range(50):
        if COLD:
            FLUSH.zero_()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(s)
        call()
        e1.record(s)
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    bufs = trace_buffers()
    for ptr, size in bufs:
        runtime.check(cu.cuMemsetD8(ptr, 0, size))
    if COLD:
        FLUSH.zero_()
    torch.cuda.synchronize()
    call()
    torch.cuda.synchronize()
    tr = None
    for ptr, size in bufs:
        h = np.zeros(size // 8, dtype=np.uint64)
        runtime.check(cu.cuMemcpyDtoH(h.ctypes.data, ptr, size))
        h = h.reshape(-1, EVENTS)
        if h[:, 0].any():
            tr = h
    ref = torch.matmul(a.float(), b.float().t())
    err = (c.float() - ref).norm() / ref.norm()
    print(f"\n{spec}: M={M} N={N} K={K} {plan} rel err {err:.1e}; "
          f"call {np.median(ts):.1f} us (min {min(ts):.1f}) eager, trace on, L2 {'flushed' if COLD else 'warm'}", flush=True)
    if tr is None:
        print("  no trace recorded")
        return
    blocks = tr[tr[:, 0] != 0].astype(np.int64)
    ns0, ns1 = blocks[:, 1], blocks[:, 11]
    span_ns = ns1 - ns0
    span_clk = blocks[:, 10] - blocks[:, 0]
    mhz = np.median(span_clk[span_ns > 2000] / span_ns[span_ns > 2000] * 1e3) if (span_ns > 2000).any() else 1755.0
    us = lambda clk: clk / mhz  # noqa: E731
    print(f"  {len(blocks)} blocks; SM clock ~{mhz:.0f} MHz; entry skew {(ns0.max() - ns0.min()) / 1e3:.2f} us; "
          f"first entry -> last exit {(ns1.max() - ns0.min()) / 1e3:.2f} us; units/block "
          f"{np.bincount(blocks[:, 12]).nonzero()[0].tolist()}; split tiles finished {int(blocks[:, 15].sum())}")

    def phase(label, a_ev, b_ev):
        m = (blocks[:, a_ev] != 0) & (blocks[:, b_ev] != 0)
        if not m.any():
            return
        d = us(blocks[m, b_ev] - blocks[m, a_ev])
        print(f"  {label:34s} median {np.median(d):7.2f}  min {d.min():7.2f}  max {d.max():7.2f} us  ({m.sum()} blocks)")

    phase("entry -> barriers set up", 0, 2)
    phase("entry -> producer's first TMA issue", 0, 3)
    phase("first issue -> first stage full", 3, 5)
    phase("first unit's main loop", 5, 6)
    phase("last unit: red.add + fence (split)", 14, 7)
    phase("last unit: count (split)", 7, 8)
    phase("last unit main loop", 13, 14)
    phase("last unit end -> last store done", 14, 9)
    phase("store done -> drained", 9, 10)
    phase("entry -> drained (block total)", 0, 10)
    phase("producer first -> last issue", 3, 4)


def main(argv):
    global FLUSH
    torch.manual_seed(1)
    if COLD:
        FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for spec in argv or ["dsv3.q_a@512", "square1024"]:
        run(spec)


if __name__ == "__main__":
    main(sys.argv[1:])
