"""AllGather + GEMM (column-parallel tensor parallelism) in one persistent kernel.

    mpirun -np 2 python examples/ag_gemm.py [--m 4096] [--k 8192] [--n 14336] [--path fused_ce|fused|unfused]

Local rank r holds A_r [M/P, K] (its share of the tokens) and its weight shard W_r [N/P, K]; every
rank computes C_r = AllGather(A) @ W_r.T [M, N/P].  The example checks C_r (relative Frobenius error
against a float64 numpy reference of a row sample) and the gathered A (exactly), then times the call
and prints TFLOP/s per GPU and which path the planner chose ("fused_ce": the GEMM on all SMs but one
while the copy engines move the shards; "fused": SM communication blocks; "unfused").
"""
import argparse
import time

import numpy as np

import mkernel
from mkernel import DeviceArray, bf16_to_f32, f32_to_bf16
from mkernel.ops.ag_gemm import PATHS


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=4096, help="total rows (tokens) over all ranks")
    ap.add_argument("--k", type=int, default=8192, help="hidden size")
    ap.add_argument("--n", type=int, default=14336, help="output width over all ranks")
    ap.add_argument("--path", default=None, choices=PATHS, help="force a path (default: the planner's choice)")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()

    ctx = mkernel.init()
    P, me = ctx.local_size, ctx.local_rank
    Mr, K, Nr = args.m // P, args.k, args.n // P
    M = Mr * P
    # every rank builds every rank's shard from the same seed (only for the check), uses its own
    rng = np.random.default_rng(1234)
    shards = [f32_to_bf16(rng.standard_normal((Mr, K), dtype=np.float32)) for _ in range(P)]
    rng_w = np.random.default_rng(99 + ctx.rank)
    w_bits = f32_to_bf16(rng_w.standard_normal((Nr, K), dtype=np.float32) / np.sqrt(K))
    a = DeviceArray.from_numpy(shards[me], dtype="bfloat16")
    w = DeviceArray.from_numpy(w_bits, dtype="bfloat16")
    out = DeviceArray.empty((M, Nr), "bfloat16").fill_nan()
    gathered = DeviceArray.empty((M, K), "bfloat16").fill_nan()

    mkernel.ag_gemm(ctx, a, w, out, gathered_a=gathered, b_layout="nk", path=args.path)
    ctx.synchronize()
    plan = ctx.last_plan("ag_gemm")
    A = np.concatenate(shards)
    gathered_ok = bool(np.array_equal(gathered.to_numpy(), A))
    rows = np.random.default_rng(7).choice(M, size=min(M, 256), replace=False)  # a row sample: cheap check
    ref = bf16_to_f32(A[rows]).astype(np.float64) @ bf16_to_f32(w_bits).astype(np.float64).T
    got = bf16_to_f32(out.to_numpy()[rows]).astype(np.float64)
    err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) if not np.isnan(got).any() else float("inf")
    ok = gathered_ok and err < 1e-2

    ctx.world.Barrier()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        mkernel.ag_gemm(ctx, a, w, out, b_layout="nk", path=args.path)
    ctx.synchronize()
    dt = (time.perf_counter() - t0) / args.iters
    tflops = 2.0 * M * Nr * K / dt / 1e12
    oks = ctx.world.gather(ok, root=0)
    if ctx.rank == 0:
        print(f"ag_gemm over {P} GPUs: A [{M}, {K}] gathered from {P} shards of {Mr} rows, W_r [{Nr}, {K}] "
              f"(nk): C_r [{M}, {Nr}] {'correct' if all(oks) else 'WRONG'} (rel. Frobenius error {err:.2e} on "
              f"{len(rows)} sampled rows vs float64 numpy; gathered A {'exact' if gathered_ok else 'WRONG'}); "
              f"{dt * 1e3:.3f} ms per call, {tflops:.0f} TFLOP/s per GPU; path {plan.path}"
              f"{f' with {plan.comm_sms} comm SMs' if plan.path == 'fused' else ''} ({plan.reason})")
    ctx.close()
    return 0 if all(oks if oks else [ok]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
