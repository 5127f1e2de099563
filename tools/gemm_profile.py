#!/usr/bin/env python
"""A profiler target: a few GEMM shapes, each run by mkernel.gemm and by torch.matmul (cuBLAS) a few
times on random bf16 data, nothing else on the GPU.  For Nsight Compute, e.g.

    ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --launch-skip 0 \
        python tools/gemm_profile.py dsv3.q_a@512 square1024

Shapes: NAME@M of bench/gemm.py's tables, squareN, or MxNxK (B given [N, K]).  PROFILE_REPS (default 3) calls
per library per shape; mkernel's plan is printed (config, split-K), so a kernel in the profile can be
matched to its plan.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]  # bench/gemm.py's tables; the package

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    sys.exit(print(__doc__))  # before the imports that need a GPU machine (torch, the driver)

import torch  # noqa: E402

from gemm import WEIGHTS  # noqa: E402
from mkernel.ops import gemm as G  # noqa: E402
from mkernel.core.interop import as_device_array  # noqa: E402


def parse(spec: str):
    if spec.startswith("square"):
        m = int(spec[len("square"):])
        return spec, m, m, m
    if "@" in spec:
        name, m = spec.split("@")
        n, k = WEIGHTS[name]
        return spec, int(m), n, k
    m, n, k = (int(v) for v in spec.lower().split("x"))
    return spec, m, n, k


def main(argv):
    reps = int(os.environ.get("PROFILE_REPS", 3))
    gen = torch.Generator(device="cuda").manual_seed(7)
    for spec in argv or ["dsv3.q_a@512", "square1024"]:
        name, M, N, K = parse(spec)
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        cfg, splits, split_from = G.auto_plan(M, N, K, "nk", torch.cuda.get_device_properties(0).multi_processor_count,
                                               None, G.misaligned_rows(M, N, K, "nk"))
        print(f"{name}: M={M} N={N} K={K}: mkernel config {cfg.id} ({cfg.bm}x{cfg.bn}) splits {splits} "
              f"from tile {split_from}", flush=True)
        da, db, dc = as_device_array(a), as_device_array(b), as_device_array(c)
        s = torch.cuda.current_stream()
        for _ in range(reps):
            G.gemm(da, db, dc, b_layout="nk", stream=s)
        for _ in range(reps):
            torch.matmul(a, b.t(), out=c)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
