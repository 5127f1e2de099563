#!/usr/bin/env python
"""Independent re-check of flash attention (not a test: shapes and inputs no test names, drawn from a seed).
Forward and backward of random problems -- B 1-3, S_q / S_k 1-3000 (unequal, causal bottom-right aligned),
H_kv 1-4 with GQA ratios 1-8, D 64 / 128, bf16 / fp16, both layouts, every third call on torch tensors
sliced out of a packed qkv buffer (strided views) -- against a float64 torch reference on the GPU (explicit
mask, autograd for the gradients); the backward is fed our own forward's out and lse, as a training step is.
Outputs NaN-poisoned first.  Relative Frobenius error bounds: forward 1e-2 (bf16) / 3e-3 (fp16), lse 1e-4
absolute where finite, gradients 2e-2 / 4e-3.

    PYTHONPATH=. python tools/recheck_attention.py [SEED] [CASES] [--schedule default|pingpong]
                                                                       (last line: RECHECK PASSED / FAILED)

``--schedule``: the forward kernel (``AttentionOptions.schedule``) under test; the backward is the same.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOL_FWD = {"bfloat16": 1e-2, "float16": 3e-3}
TOL_BWD = {"bfloat16": 2e-2, "float16": 4e-3}


def reference(torch, q, k, v, do, causal: bool, scale: float):
    """float64 (out, lse, dq, dk, dv) for [B, H, S, D] tensors (K/V heads repeated for the reference only)."""
    q, k, v, do = (t.detach().double().requires_grad_(True) for t in (q, k, v, do))
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, kk) * scale
    Sq, Sk = q.shape[2], k.shape[2]
    if causal:
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (Sk - Sq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), torch.zeros_like(s))
    out = torch.einsum("bhqk,bhkd->bhqd", p, vv)
    out.backward(do.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def rel(a, b) -> float:
    n = float(b.norm())
    return float((a.double() - b).norm()) / n if n > 0 else float(a.double().abs().max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("seed", nargs="?", type=int, default=20261202)
    ap.add_argument("cases", nargs="?", type=int, default=40)
    ap.add_argument("--schedule", default="default", choices=("default", "pingpong"))
    a = ap.parse_args()
    import torch

    import mkernel

    seed, cases = a.seed, a.cases
    opts = mkernel.AttentionOptions(schedule=a.schedule)
    rng = np.random.default_rng(seed)
    dev = torch.device("cuda")
    fails = 0
    for case in range(cases):
        B = int(rng.integers(1, 4))
        Sq, Sk = int(rng.integers(1, 3001)), int(rng.integers(1, 3001))
        if case % 4 == 0:
            Sk = Sq
        hkv = int(rng.integers(1, 5))
        hq = hkv * int(rng.choice([1, 2, 4, 8]))
        D = int(rng.choice([64, 128]))
        dt = str(rng.choice(["bfloat16", "float16"]))
        layout = str(rng.choice(["bshd", "bhsd"]))
        causal = bool(rng.integers(0, 2))
        tdt = getattr(torch, dt)
        scale = 1.0 / math.sqrt(D) * float(rng.choice([1.0, 0.5, 2.0]))
        packed = case % 3 == 2 and layout == "bshd" and Sq == Sk

        def make(S, H):  # a [B, S, H, D] tensor of N(0, 1) values in the dtype
            return torch.randn(B, S, H, D, device=dev, dtype=torch.float32).to(tdt)

        if packed:  # one [B, S, hq + 2 hkv, D] buffer, q/k/v as strided views
            buf = torch.randn(B, Sq, hq + 2 * hkv, D, device=dev, dtype=torch.float32).to(tdt)
            qs, ks, vs = buf[:, :, :hq], buf[:, :, hq:hq + hkv], buf[:, :, hq + hkv:]
        else:
            qs, ks, vs = make(Sq, hq), make(Sk, hkv), make(Sk, hkv)
            if layout == "bhsd":
                qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (qs, ks, vs))
        to_bhsd = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
        qh, kh, vh = to_bhsd(qs), to_bhsd(ks), to_bhsd(vs)
        do_h = torch.randn(B, hq, Sq, D, device=dev, dtype=torch.float32).to(tdt)
        o_ref, lse_ref, dq_ref, dk_ref, dv_ref = reference(torch, qh, kh, vh, do_h, causal, scale)
        out = torch.full((B, Sq, hq, D) if layout == "bshd" else (B, hq, Sq, D), float("nan"), device=dev, dtype=tdt)
        lse = torch.full((B, hq, Sq), float("nan"), device=dev, dtype=torch.float32)
        what = (f"case {case}: B={B} Sq={Sq} Sk={Sk} Hq={hq} Hkv={hkv} D={D} {dt} {layout} causal={causal} "
                f"scale={scale:.4g}{' packed' if packed else ''}")
        try:
            mkernel.attention(qs, ks, vs, out, lse=lse, causal=causal, softmax_scale=scale, layout=layout,
                              options=opts)
            torch.cuda.synchronize()
            e_o = rel(to_bhsd(out), o_ref)
            fin = torch.isfinite(lse_ref)
            e_l = float((lse.double()[fin] - lse_ref[fin]).abs().max()) if bool(fin.any()) else 0.0
            same_inf = bool(torch.equal(torch.isfinite(lse), fin))
            do = do_h.transpose(1, 2).contiguous() if layout == "bshd" else do_h
            dq, dk, dv = (torch.full(t.shape, float("nan"), device=dev, dtype=tdt) for t in (qs, ks, vs))
            mkernel.attention_backward(qs, ks, vs, out, lse, do, dq, dk, dv, causal=causal, softmax_scale=scale,
                                       layout=layout)
            torch.cuda.synchronize()
            e_q, e_k, e_v = rel(to_bhsd(dq), dq_ref), rel(to_bhsd(dk), dk_ref), rel(to_bhsd(dv), dv_ref)
            ok = (e_o < TOL_FWD[dt] and e_l < 1e-4 and same_inf
                  and max(e_q, e_k, e_v) < TOL_BWD[dt])
            line = (f"{what}: out {e_o:.2e} lse {e_l:.1e}{'' if same_inf else ' (-inf rows differ)'} "
                    f"dq {e_q:.2e} dk {e_k:.2e} dv {e_v:.2e}")
        except Exception as exc:  # noqa: BLE001 -- a raised error is a failure of this case, reported
            ok, line = False, f"{what}: raised {exc!r}"
        fails += not ok
        print(("ok   " if ok else "FAIL ") + line, flush=True)
    print(f"{cases - fails}/{cases} cases passed (seed {seed}, schedule {a.schedule})")
    print("RECHECK PASSED" if fails == 0 else "RECHECK FAILED")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
