"""GEMM + ReduceScatter (row-parallel tensor parallelism) in one persistent kernel.

    mpirun -np 2 python examples/gemm_rs.py [--m 8192] [--k 28672] [--n 8192] [--path fused|unfused]

Local rank r holds A_r [M, K/P] (its share of the reduction, e.g. the MLP's intermediate activations) and
its weight shard W_r [N, K/P]; the ranks compute S = sum_r A_r @ W_r.T [M, N] and rank r keeps its M/P
rows.  The example checks a sample of those rows against a float64 numpy reference (relative Frobenius
error), then times the call and prints TFLOP/s per GPU and which path the planner chose ("fused": each
GEMM tile pushed to the rank that owns its rows as soon as it is done; "unfused": mkernel.gemm then
mkernel.reduce_scatter).
"""
import argparse
import time

import numpy as np

import mkernel
from mkernel import DeviceArray, bf16_to_f32, f32_to_bf16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=8192, help="rows (tokens)")
    ap.add_argument("--k", type=int, default=28672, help="reduction length over all ranks (split evenly)")
    ap.add_argument("--n", type=int, default=8192, help="output width (hidden size)")
    ap.add_argument("--path", default=None, choices=("fused", "unfused"), help="force a path (default: planner)")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()

    ctx = mkernel.init()
    P, me = ctx.local_size, ctx.local_rank
    M, Kr, N = args.m, args.k // P, args.n

    # Row i of rank r's A (and row j of its W) from its own seed: a rank builds its whole operands, and for
    # the check only the sampled rows of every rank's A and the sampled rows of every W (output columns).
    def rows_of(kind, r, idx, scale=1.0):
        return f32_to_bf16(np.stack([np.random.default_rng((kind, r, int(i))).standard_normal(Kr, dtype=np.float32)
                                     for i in idx]) * np.float32(scale))

    wscale = 1.0 / np.sqrt(Kr * P)
    a = DeviceArray.from_numpy(rows_of(10, me, range(M)), dtype="bfloat16")
    w = DeviceArray.from_numpy(rows_of(90, me, range(N), wscale), dtype="bfloat16")
    opts = mkernel.GemmRsOptions(path=args.path)
    out = mkernel.gemm_reduce_scatter(ctx, a, w, b_layout="nk", options=opts)  # [M_r, N]: this rank's rows
    ctx.synchronize()
    plan = ctx.last_plan("gemm_rs")
    r0 = sum(plan.m_sizes[:me])
    pick = np.random.default_rng(7)
    rows = np.sort(pick.choice(plan.m_sizes[me], size=min(plan.m_sizes[me], 64), replace=False))
    cols = np.sort(pick.choice(N, size=min(N, 256), replace=False))
    f64 = lambda bits: bf16_to_f32(bits).astype(np.float64)  # noqa: E731
    err = 0.0
    if len(rows):  # (a rank may keep no row)
        ref = sum(f64(rows_of(10, r, r0 + rows)) @ f64(rows_of(90, r, cols, wscale)).T for r in range(P))
        got = f64(out.to_numpy()[rows][:, cols])
        err = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)) if not np.isnan(got).any() else np.inf
    ok = err < 1e-2

    ctx.world.Barrier()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        mkernel.gemm_reduce_scatter(ctx, a, w, out, b_layout="nk", options=opts)
    ctx.synchronize()
    dt = (time.perf_counter() - t0) / args.iters
    tflops = 2.0 * M * N * Kr / dt / 1e12
    oks = ctx.world.gather(ok, root=0)
    if ctx.rank == 0:
        print(f"gemm_reduce_scatter over {P} GPUs: A_r [{M}, {Kr}] @ W_r [{N}, {Kr}].T summed over ranks, "
              f"{plan.m_sizes[me]} rows kept per rank: {'correct' if all(oks) else 'WRONG'} (rel. Frobenius error "
              f"{err:.2e} on {len(rows)} x {len(cols)} sampled elements vs float64 numpy); {dt * 1e3:.3f} ms per call, "
              f"{tflops:.0f} TFLOP/s per GPU; path {plan.path}"
              f"{f' (config {plan.config})' if plan.path == 'fused' else ''} ({plan.reason})")
    ctx.close()
    return 0 if all(oks if oks else [ok]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
