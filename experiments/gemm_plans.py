#!/usr/bin/env python
"""Every plan mkernel.gemm has for a shape -- each tile config x each split-K factor it allows --
against cuBLAS, all timed in the same alternating rounds (bench/gemm.py's CUDA-graph runners), to
check whether the heuristic's pick is the best plan there is (docs/journal/gemm.md entry 24).

    python experiments/gemm_plans.py [NAME@M ...] [--configs 1,2,3,4,5,9] [--splits 1,2,3,4,6,8] [--reps 7]

Shapes: NAME@M of bench/gemm.py's tables (weights [N, K], b_layout "nk"); default: the few-tile
shapes that sat below ~0.92x cuBLAS.  One line per shape: cuBLAS, the automatic plan, the six best
plans (us, ratio to cuBLAS); ERR marks a plan whose result is off (relative Frobenius error >= 1e-2).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]  # bench/_common.py, bench/gemm.py; the package
from _common import setup_env  # noqa: E402

DEFAULT = ["llama70b.o@128", "dsv3.q_a@512", "dsv3.moe_gate_up@512", "dsv3.moe_down@128", "dsv3.kv_a@512",
           "llama70b.qkv@128"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="*", default=DEFAULT)
    ap.add_argument("--configs", default="1,2,3,4,5,9")
    ap.add_argument("--splits", default="1,2,3,4,6,8")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    setup_env()
    import torch

    from gemm import DEEPSEEK_V3, LLAMA3_70B, _runner, _time_alternating, batch_for, make_inputs
    from mkernel.ops import gemm as G
    from mkernel.ops.gemm import heuristic as GH
    from mkernel.core.interop import as_device_array

    torch.cuda.init()
    torch.empty(1, device="cuda")
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    cfgs = [int(c) for c in args.configs.split(",")]
    splits = [int(s) for s in args.splits.split(",")]
    table = {**LLAMA3_70B, **DEEPSEEK_V3}
    for spec in args.shapes:
        name, m = spec.split("@")
        M, (N, K) = int(m), table[name]
        A, B, C, Cr = make_inputs(M, N, K, "nk", l2)
        nsets = len(A)
        dA, dB, dC = ([as_device_array(x) for x in xs] for xs in (A, B, C))
        plans = [(None, None)] + [(c, s) for c in cfgs for s in splits
                                  if s <= GH.max_splits(G.CONFIGS[c], M, N, K, "nk")]
        flop = 2.0 * M * N * K
        batch = batch_for(flop, nsets)
        runs, labels = [], []
        for c, s in plans:
            def ours(i, c=c, s=s):
                G.gemm(dA[i], dB[i], dC[i], b_layout="nk", stream=torch.cuda.current_stream(), config=c, splits=s)
            ours(0)
            torch.matmul(A[0], B[0].t(), out=Cr[0])
            torch.cuda.synchronize()
            err = ((C[0].float() - Cr[0].float()).norm() / Cr[0].float().norm()).item()
            runs.append(_runner(ours, nsets, batch, False))
            if c is None:
                d = G.describe(M, N, K, b_layout="nk")
                label = f"auto (config {d.get('config')} x {d.get('splits')})"
            else:
                label = f"c{c}x{s}"
            labels.append(label + ("" if err < 1e-2 else " ERR"))

        def theirs(i):
            torch.matmul(A[i], B[i].t(), out=Cr[i])
        runs.append(_runner(theirs, nsets, batch, False))
        ts = _time_alternating(runs, batch, args.reps)
        tc = ts[-1]
        best = sorted(zip(ts[:-1], labels))[:6]
        print(f"{spec}: cuBLAS {tc * 1e6:.1f} us ({flop / tc / 1e12:.0f} TFLOP/s); {labels[0]} {ts[0] * 1e6:.1f} us "
              f"({tc / ts[0]:.2f}x); best: " + "  ".join(f"{lb} {t * 1e6:.1f} ({tc / t:.2f})" for t, lb in best),
              flush=True)


if __name__ == "__main__":
    main()
