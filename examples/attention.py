"""Flash-attention forward on one Hopper GPU (mkernel.attention): no torch, numpy for the check.

    python examples/attention.py [--s 8192] [--b 2] [--hq 32] [--hkv 8] [--d 128] [--causal]

First a small GQA case (B=2, S=300, H_q=8, H_kv=2, D=64, causal) is checked against a float64 numpy
reference (relative Frobenius error of out, max error of the log-sum-exp); then the requested shape is timed
(CUDA events around back-to-back calls) and its TFLOP/s printed (4 B H_q S^2 D / t, causal at half).
"""
import argparse
import math

import numpy as np
from cuda.bindings import driver as cu

import mkernel
from mkernel import DeviceArray, bf16_to_f32, f32_to_bf16
from mkernel.core.driver import check


def bf16(rng, shape):
    """(device bf16 array, its exact values as float64)."""
    bits = f32_to_bf16(rng.standard_normal(shape, dtype=np.float32))
    return DeviceArray.from_numpy(bits, dtype="bfloat16"), bf16_to_f32(bits).astype(np.float64)


def reference(q, k, v, causal):
    """q [B, S, Hq, D], k/v [B, S, Hkv, D] (float64) -> out [B, S, Hq, D], lse [B, Hq, S]."""
    B, S, Hq, D = q.shape
    g = Hq // k.shape[2]
    out, lse = np.zeros_like(q), np.zeros((B, Hq, S))
    mask = np.tril(np.ones((S, S), bool)) if causal else np.ones((S, S), bool)
    for b in range(B):
        for h in range(Hq):
            s = np.where(mask, q[b, :, h] @ k[b, :, h // g].T / math.sqrt(D), -np.inf)
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            out[b, :, h] = p @ v[b, :, h // g] / p.sum(axis=1, keepdims=True)
            lse[b, h] = m[:, 0] + np.log(p.sum(axis=1))
    return out, lse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--s", type=int, default=8192)
    ap.add_argument("--b", type=int, default=2)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128, choices=(64, 128))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    rng = np.random.default_rng(0)

    # ---- check a small case
    (q, qv), (k, kv), (v, vv) = (bf16(rng, (2, 300, h, 64)) for h in (8, 2, 2))
    out, lse = mkernel.attention(q, k, v, causal=True)
    got = bf16_to_f32(out.to_numpy()).astype(np.float64)
    ref, ref_lse = reference(qv, kv, vv, True)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    lse_err = np.abs(lse.to_numpy() - ref_lse).max()
    print(f"check: out relative Frobenius error {err:.2e}, lse max error {lse_err:.2e}")
    assert err < 1e-2 and lse_err < 1e-2

    # ---- time the requested shape
    (q, _), (k, _), (v, _) = (bf16(rng, (a.b, a.s, h, a.d)) for h in (a.hq, a.hkv, a.hkv))
    out = DeviceArray.empty(q.shape, "bfloat16")
    lse = DeviceArray.empty((a.b, a.hq, a.s), "float32")
    for _ in range(3):
        mkernel.attention(q, k, v, out, lse=lse, causal=a.causal)
    start, end = (check(cu.cuEventCreate(0)) for _ in range(2))
    check(cu.cuEventRecord(start, 0))
    for _ in range(a.iters):
        mkernel.attention(q, k, v, out, lse=lse, causal=a.causal)
    check(cu.cuEventRecord(end, 0))
    check(cu.cuEventSynchronize(end))
    ms = check(cu.cuEventElapsedTime(start, end)) / a.iters
    flops = 4.0 * a.b * a.hq * a.s * a.s * a.d / (2 if a.causal else 1)
    print(f"B={a.b} S={a.s} H_q={a.hq} H_kv={a.hkv} D={a.d} causal={a.causal}: {ms:.3f} ms, "
          f"{flops / ms / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
