#!/usr/bin/env python
"""mkernel.attention_backward against torch SDPA's backward (flash, cuDNN, efficient backends) on one GPU,
in the same run.

    python bench/attention_bwd.py [--quick] [--only NAME,...] [--kernels mma,wgmma] [--deterministic] [--out DIR]

Shapes: [B, H, S, D] bf16 (torch's layout; mkernel reads it as layout="bhsd", zero-copy), S_q = S_k,
head dims 64 and 128, plain and causal, and a GQA shape (H_q 32, H_kv 8; torch's backends get K/V repeated
over the group, mkernel reads them once).  The forward's out and lse come from ``mkernel.attention`` when
it exists, else from torch's flash forward (``aten._scaled_dot_product_flash_attention``: natural-log lse
[B, H, S] fp32, the same contract).

Timing: each method's backward alone -- mkernel.attention_backward(q, k, v, out, lse, dout) and, per torch
backend, ``torch.autograd.grad`` of that backend's forward output (graph retained) -- timed in alternating
rounds with CUDA events (bench/_common.time_interleaved), median per call.  ``--kernels``: the main kernels
timed (AttentionBwdOptions.kernel; default mma), each as its own method "mkernel-<kernel>".  Before timing,
each mkernel kernel's dq, dk, dv are checked against torch's (relative Frobenius error < 2e-2).

FLOPs: the forward is 4 B H S_q S_k D (two GEMMs); the backward counts 2.5x that (five GEMMs: S = Q K^T
recomputed, dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q), the usual convention of FlashAttention's
benchmarks; causal counts half.  Writes ``<out>/attention_bwd_bench.md`` and ``.json`` (default docs/).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import markdown_table, setup_env, time_interleaved, write_json  # noqa: E402

SHAPES = {  # name -> (B, H_q, H_kv, S, D)
    "b8-h16-s1k-d128": (8, 16, 16, 1024, 128),
    "b4-h16-s2k-d128": (4, 16, 16, 2048, 128),
    "b2-h16-s4k-d128": (2, 16, 16, 4096, 128),
    "b1-h16-s8k-d128": (1, 16, 16, 8192, 128),
    "b4-h16-s2k-d64": (4, 16, 16, 2048, 64),
    "b1-h16-s8k-d64": (1, 16, 16, 8192, 64),
    "gqa-b2-h32x8-s4k-d128": (2, 32, 8, 4096, 128),
}
QUICK = ("b4-h16-s2k-d128", "b4-h16-s2k-d64", "gqa-b2-h32x8-s4k-d128")


def flops(B, H, S, D, causal: bool) -> float:
    f = 2.5 * 4.0 * B * H * S * S * D
    return f / 2 if causal else f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--kernels", default="mma", help="comma-separated main kernels to time: mma, wgmma")
    ap.add_argument("--deterministic", action="store_true", help="time mkernel's deterministic mode too")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs"))
    args = ap.parse_args()
    setup_env()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import mkernel
    from mkernel.ops.attention_bwd import AttentionBwdOptions, last_plan
    from mkernel.ops.attention_bwd.kernels import KERNELS

    torch.cuda.set_device(0)
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    keep = [n.strip() for n in args.only.split(",") if n.strip()] or (QUICK if args.quick else list(SHAPES))
    unknown = [n for n in keep if n not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {list(SHAPES)}")
    shapes = {n: SHAPES[n] for n in keep}
    kernels = [x.strip() for x in args.kernels.split(",") if x.strip()]
    if not kernels or any(x not in KERNELS for x in kernels):
        raise SystemExit(f"--kernels: a comma-separated subset of {KERNELS}, got {args.kernels!r}")
    mk_names = [f"mkernel-{x}" for x in kernels]
    rows, results = [], []
    for name, (B, Hq, Hkv, S, D) in shapes.items():
        for causal in (False, True):
            torch.manual_seed(0)
            mk = lambda h: torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16)  # noqa: E731
            q, k, v, do = mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)
            grp = Hq // Hkv
            kr, vr = (k.repeat_interleave(grp, 1), v.repeat_interleave(grp, 1)) if grp > 1 else (k, v)
            scale = D ** -0.5
            if hasattr(mkernel, "attention"):
                out, lse = mkernel.attention(q, k, v, causal=causal, layout="bhsd")
            else:
                out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, kr, vr, 0.0, causal, False,
                                                                              scale=scale)[:2]
            dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
            stream = torch.cuda.current_stream()
            fns = {}

            def run_mk(kernel, det=False):
                mkernel.attention_backward(q, k, v, out, lse, do, dq, dk, dv, causal=causal, layout="bhsd",
                                           stream=stream, options=AttentionBwdOptions(deterministic=det,
                                                                                      kernel=kernel))
            for x in kernels:
                fns[f"mkernel-{x}"] = lambda x=x: run_mk(x)
                if args.deterministic:
                    fns[f"mkernel-{x}-det"] = lambda x=x: run_mk(x, True)
            ref = None
            for bname, be in backends.items():
                qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, kr, vr))
                try:
                    with sdpa_kernel(be):
                        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, scale=scale)
                    g = torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True)
                except RuntimeError as exc:
                    print(f"{name} causal={causal}: torch {bname} unavailable ({str(exc).splitlines()[0][:80]})")
                    continue
                if ref is None:
                    ref = g
                fns[f"torch-{bname}"] = (lambda o=o, t=(qq, kk, vv): torch.autograd.grad(o, t, do, retain_graph=True))
            errs, plans = {}, {}
            for x in kernels:
                for g_ in (dq, dk, dv):
                    g_.fill_(float("nan"))
                run_mk(x)
                torch.cuda.synchronize()
                plans[x] = repr(last_plan())
                if ref is not None:
                    rdk = ref[1].view(B, Hkv, grp, S, D).float().sum(2) if grp > 1 else ref[1].float()
                    rdv = ref[2].view(B, Hkv, grp, S, D).float().sum(2) if grp > 1 else ref[2].float()
                    for n, got, r in (("dq", dq, ref[0].float()), ("dk", dk, rdk), ("dv", dv, rdv)):
                        errs[f"{x}-{n}"] = float((got.float() - r).norm() / r.norm().clamp_min(1e-30))
                    bad = {n: e for n, e in errs.items() if n.startswith(x) and not e < 2e-2}
                    if bad:
                        print(f"{name} causal={causal}: mkernel {x} differs from torch: {bad}")
            t = time_interleaved(fns, warmup=3, rounds=7, batch=5)
            fl = flops(B, Hq, S, D, causal)
            res = {"name": name, "B": B, "H_q": Hq, "H_kv": Hkv, "S": S, "D": D, "causal": causal, "errors": errs,
                   "plans": plans, "ms": {n: t[n]["median_ms"] for n in t},
                   "tflops": {n: fl / (t[n]["median_ms"] * 1e-3) / 1e12 for n in t}}
            torch_best = min((t[n]["median_ms"] for n in t if n.startswith("torch-")), default=float("nan"))
            res["vs_best_torch"] = {n: torch_best / t[n]["median_ms"] for n in mk_names}
            results.append(res)
            cols = [f"{res['tflops'].get(n, float('nan')):.0f}" for n in
                    (*mk_names, "torch-flash", "torch-cudnn", "torch-efficient")]
            rows.append([name, "yes" if causal else "no", *cols,
                         *(f"{res['vs_best_torch'][n]:.2f}x" for n in mk_names)])
            print(" | ".join(map(str, rows[-1])), flush=True)
            del fns, ref
            torch.cuda.empty_cache()
    head = ["shape", "causal", *(f"{n} TFLOP/s" for n in mk_names), "flash", "cudnn", "efficient",
            *(f"{n} vs fastest torch" for n in mk_names)]
    text = ("# attention backward on one H200 (bf16)\n\nTFLOP/s = 2.5 x forward FLOPs (4 B H S^2 D) / time; "
            "causal counted at half.\n\n" + markdown_table(head, rows) + "\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_bwd_bench.md").write_text(text)
    write_json(out / "attention_bwd_bench.json", {"results": results})
    print(text)


if __name__ == "__main__":
    main()
