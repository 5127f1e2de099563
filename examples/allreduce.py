"""All-reduce across the GPUs of a node, driven by one persistent kernel.

    mpirun -np 2 python examples/allreduce.py [--elements N] [--dtype bfloat16|float16|float32]

Every rank fills its buffer with random numbers, all-reduces, checks the sum against numpy (float64)
and prints the bus bandwidth (nccl-tests convention: 2(P-1)/P * bytes / time).
"""
import argparse
import time

import numpy as np

import mkernel
from mkernel import DeviceArray, bf16_to_f32, f32_to_bf16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=64 * 1024 * 1024)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()

    ctx = mkernel.init()
    P, n = ctx.local_size, args.elements
    rng = np.random.default_rng(1234 + ctx.rank)
    host = rng.standard_normal(n).astype(np.float32)
    if args.dtype == "bfloat16":
        bits = f32_to_bf16(host)
        exact, x = bf16_to_f32(bits).astype(np.float64), DeviceArray.from_numpy(bits, dtype="bfloat16")
    else:
        h = host.astype(args.dtype)
        exact, x = h.astype(np.float64), DeviceArray.from_numpy(h)
    out = DeviceArray.empty(x.shape, x.dtype)
    out.fill_nan()

    mkernel.all_reduce(ctx, x, out)
    ctx.synchronize()
    got = out.to_numpy()
    got = bf16_to_f32(got).astype(np.float64) if args.dtype == "bfloat16" else got.astype(np.float64)
    ref = ctx.node_comm.allreduce(exact)  # MPI sum in float64
    scale = ctx.node_comm.allreduce(np.abs(exact))
    tol = {"bfloat16": 2 ** -8, "float16": 2 ** -11, "float32": 2 ** -22}[args.dtype]
    err = np.abs(got - ref) / (np.abs(ref) + 1e-3 * scale)
    ok = bool(np.all(err <= tol)) and not np.isnan(got).any()

    ctx.node_comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        mkernel.all_reduce(ctx, x, out)
    ctx.synchronize()
    dt = (time.perf_counter() - t0) / args.iters
    busbw = 2 * (P - 1) / P * x.nbytes / dt / 1e9 if P > 1 else float("nan")
    oks = ctx.world.gather(ok, root=0)
    if ctx.rank == 0:
        print(f"all_reduce of {n} {args.dtype} over {P} GPUs ({x.nbytes / 2**20:.1f} MiB per rank): "
              f"{'correct' if all(oks) else 'WRONG'} vs numpy float64 (max rel err {err.max():.2e}); "
              f"{dt * 1e6:.1f} us per call, bus bandwidth {busbw:.1f} GB/s")
    ctx.close()
    if not all(oks if oks else [ok]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
