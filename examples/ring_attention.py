"""Ring attention forward across the GPUs of one node (mkernel.ring_attention), under mpirun:

    mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 python examples/ring_attention.py [--s 16384] [--causal] [--persistent]

First a small causal GQA case (zigzag sharded, S_local = 2 * 150) is checked against a float64 numpy
reference of full attention over the whole sequence; then the requested shape is timed (CUDA events around
back-to-back calls) and TFLOP/s per GPU printed (4 B H_q S S_local D / t, causal at half).  No torch.
"""
import argparse

import numpy as np
from cuda.bindings import driver as cu

import mkernel
from mkernel import DeviceArray, bf16_to_f32, f32_to_bf16
from mkernel.core.driver import check
from mkernel.ops.ring_attention import zigzag_indices


def bf16_values(x):
    return bf16_to_f32(f32_to_bf16(x.astype(np.float32))).astype(np.float64)


def reference(q, k, v, causal):
    """float64 attention, q [B, S, Hq, D], k/v [B, S, Hkv, D] -> out, lse [B, Hq, S]."""
    g = q.shape[2] // k.shape[2]
    s = np.einsum("bihd,bjhd->bhij", q, np.repeat(k, g, 2)) / np.sqrt(q.shape[3])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    return np.einsum("bhij,bjhd->bihd", p / p.sum(-1, keepdims=True), np.repeat(v, g, 2)), (m + np.log(p.sum(-1, keepdims=True)))[..., 0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--s", type=int, default=16384, help="total sequence length of the timed case")
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--persistent", action="store_true", help="one persistent kernel per call (one node)")
    a = ap.parse_args()
    opts = mkernel.RingAttentionOptions(persistent=a.persistent)
    ctx = mkernel.init()
    P, r = ctx.local_size, ctx.local_rank
    rng = np.random.default_rng(1234)  # the same on every rank: each takes its shard
    # --- check
    B, S, Hq, Hkv, D = 1, 2 * 150 * P, 8, 2, 128
    q, k, v = (bf16_values(rng.standard_normal((B, S, h, D))) for h in (Hq, Hkv, Hkv))
    rows = zigzag_indices(S, P, r)
    up = [DeviceArray.from_numpy(f32_to_bf16(x[:, rows].astype(np.float32)), dtype="bfloat16") for x in (q, k, v)]
    out, lse = mkernel.ring_attention(ctx, *up, causal=True, options=opts)
    ctx.synchronize()
    ref_o, ref_l = reference(q, k, v, True)
    got = bf16_to_f32(out.to_numpy()).astype(np.float64)
    err = np.linalg.norm(got - ref_o[:, rows]) / np.linalg.norm(ref_o[:, rows])
    lerr = np.abs(lse.to_numpy() - ref_l[:, :, rows]).max()
    print(f"rank {ctx.rank}: causal zigzag check vs float64: rel err {err:.2e}, lse max err {lerr:.2e}")
    assert err < 1e-2 and lerr < 1e-3
    # --- timing
    Sl = a.s // P
    arrs = [DeviceArray.from_numpy(f32_to_bf16(rng.standard_normal((a.b, Sl, h, a.d), dtype=np.float32)),
                                   dtype="bfloat16") for h in (a.hq, a.hkv, a.hkv)]
    out = DeviceArray.empty(arrs[0].shape, "bfloat16")
    lse = DeviceArray.empty((a.b, a.hq, Sl), "float32")
    s = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    e0, e1 = (check(cu.cuEventCreate(0)) for _ in range(2))
    for _ in range(3):
        mkernel.ring_attention(ctx, *arrs, out, lse=lse, causal=a.causal, stream=int(s), options=opts)
    ctx.synchronize()
    ctx.barrier()
    n = 20
    check(cu.cuEventRecord(e0, s))
    for _ in range(n):
        mkernel.ring_attention(ctx, *arrs, out, lse=lse, causal=a.causal, stream=int(s), options=opts)
    check(cu.cuEventRecord(e1, s))
    ctx.synchronize()
    ms = check(cu.cuEventElapsedTime(e0, e1)) / n
    tf = 4 * a.b * a.hq * a.s * Sl * a.d * (0.5 if a.causal else 1.0) / (ms * 1e-3) / 1e12
    note = " (ranks share a GPU: not a measurement)" if ctx.gpu_sharers > 1 else ""
    print(f"rank {ctx.rank}: S={a.s} S_local={Sl} causal={a.causal}: {ms:.3f} ms, {tf:.0f} TFLOP/s per GPU{note}")
    ctx.close()


if __name__ == "__main__":
    main()
