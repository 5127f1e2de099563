"""A MoE layer with expert parallelism over the ranks of one node: route -> dispatch -> gate/up GEMM ->
SwiGLU -> down GEMM -> combine, every step on the GPU with no host synchronization (docs/moe.md).

    mpirun -np 2 python examples/moe_layer.py [--tokens 512] [--hidden 2048] [--ffn 1024] [--experts 8] [--k 2]

Every rank holds ``--experts / P`` experts and routes its own ``--tokens`` tokens from random router logits.
The example checks the first rank's output against a float64 numpy reference of the whole layer (built
from every rank's inputs, drawn from one seed), then times the layer.
"""
import argparse
import time

import numpy as np

import mkernel
from mkernel import DeviceArray, bf16_to_f32, f32_to_bf16
from mkernel.ops.moe import reference as ref


def bf16(x):
    bits = f32_to_bf16(x.astype(np.float32))
    return DeviceArray.from_numpy(bits, dtype="bfloat16"), bf16_to_f32(bits).astype(np.float64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8, help="experts over all ranks")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    ctx = mkernel.init()
    P, me = ctx.local_size, ctx.local_rank
    T, H, F, E, k = args.tokens, args.hidden, args.ffn, args.experts, args.k
    El = E // P
    rng = np.random.default_rng(0)  # the same draws on every rank: each can build the whole reference
    logits = [rng.standard_normal((T, E)).astype(np.float32) for _ in range(P)]
    xs = [bf16(rng.standard_normal((T, H))) for _ in range(P)]
    wgs = [bf16(rng.standard_normal((El, 2 * F, H)) / np.sqrt(H)) for _ in range(P)]
    wds = [bf16(rng.standard_normal((El, H, F)) / np.sqrt(F)) for _ in range(P)]
    lg = DeviceArray.from_numpy(logits[me])
    out, routing = mkernel.moe_layer(ctx, xs[me][0], wgs[me][0], wds[me][0], lg, k=k)
    ctx.synchronize()
    if me == 0:
        ids = [ref.topk_reference(l, k)[0] for l in logits]
        wts = [ref.topk_reference(l, k)[1] for l in logits]
        lay = ref.layout_reference(ids, E)
        want = ref.layer_reference([x[1] for x in xs], ids, wts, [l["slots"] for l in lay], [w[1] for w in wgs],
                                   [w[1] for w in wds])[0]
        got = bf16_to_f32(out.to_numpy()).astype(np.float64)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        print(f"rank 0: relative error vs float64 {err:.2e}; received {routing.expert_offsets.to_numpy()[-1]} rows")
    for _ in range(3):
        mkernel.moe_layer(ctx, xs[me][0], wgs[me][0], wds[me][0], lg, k=k, out=out)
    ctx.synchronize()
    ctx.barrier()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        mkernel.moe_layer(ctx, xs[me][0], wgs[me][0], wds[me][0], lg, k=k, out=out)
    ctx.synchronize()
    dt = (time.perf_counter() - t0) / args.iters
    if me == 0:
        print(f"moe_layer T={T} H={H} F={F} E={E} k={k} P={P}: {dt * 1e6:.1f} us per layer")
    ctx.close()


if __name__ == "__main__":
    main()
