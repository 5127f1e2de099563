#!/usr/bin/env python
"""Flash-attention forward on one GPU: ``mkernel.attention`` against torch's ``scaled_dot_product_attention``
with each backend that runs here (flash, cuDNN, memory-efficient; ``torch.nn.attention.sdpa_kernel``), in the
same run.

    python bench/attention.py [--quick] [--out DIR] [--only D128,causal,...] [--schedules default,pingpong]

Shapes: H_q = 32 / H_kv = 8 (GQA; torch with ``enable_gqa=True``, K/V not replicated) and H = 16 (MHA),
D in {64, 128}, S = S_q = S_k in {1K, 2K, 4K, 8K, 16K, 32K}, B = min(4, max(1, 16K / S)), causal and not;
bf16, layout [B, S, H, D] for mkernel (torch reads the same memory as [B, H, S, D] views).  ``--quick``: S in
{4K, 16K}.  ``--schedules``: the ``AttentionOptions.schedule`` values to time, each a method of its own
(``mkernel`` for the default, ``mkernel_<schedule>`` for the others), in the same rounds.

Every method's output is checked against torch's first working backend (relative Frobenius error < 2e-2)
on the first call.  Timing: CUDA events around batches of back-to-back calls, every method of a shape in
the same alternating rounds (bench/_common.py time_interleaved), each batch behind a GPU-side delay longer
than its submission (GPU time alone); the host's submission time per eager call is reported beside.
TFLOP/s = 4 B H_q S_q S_k D / t (causal counted at half).  Writes ``<out>/attention_bench.{md,png,json}``
(default docs/).
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import markdown_table, time_interleaved, write_report  # noqa: E402

SEQS = (1024, 2048, 4096, 8192, 16384, 32768)
HEADS = ((32, 8), (16, 16))
BACKENDS = ("flash", "cudnn", "efficient")


def method_name(schedule: str) -> str:
    return "mkernel" if schedule == "default" else f"mkernel_{schedule}"


def shapes(quick: bool):
    out = []
    for hq, hkv in HEADS:
        for d in (64, 128):
            for causal in (False, True):
                for s in ((4096, 16384) if quick else SEQS):
                    out.append(dict(B=min(4, max(1, 16384 // s)), S=s, Hq=hq, Hkv=hkv, D=d, causal=causal))
    return out


def flops(sh) -> float:
    f = 4.0 * sh["B"] * sh["Hq"] * sh["S"] * sh["S"] * sh["D"]
    return f / 2 if sh["causal"] else f


def torch_method(torch, backend: str, q, k, v, causal: bool, gqa: bool):
    """A zero-argument call of SDPA pinned to ``backend`` (q, k, v as [B, H, S, D] views)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
    F = torch.nn.functional

    def run():
        with sdpa_kernel([be]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return run


def bench_shape(torch, mkernel, sh, rounds: int, schedules=("default",)):
    B, S, Hq, Hkv, D, causal = sh["B"], sh["S"], sh["Hq"], sh["Hkv"], sh["D"], sh["causal"]
    dev = torch.device("cuda")
    q = torch.randn(B, S, Hq, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, S, Hkv, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, S, Hkv, D, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, S, device=dev, dtype=torch.float32)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    fns, results, ref = {}, {}, None
    for be in BACKENDS:
        fn = torch_method(torch, be, qt, kt, vt, causal, Hq != Hkv)
        try:
            o = fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 -- a backend that does not take this shape
            results[f"torch_{be}"] = dict(error=str(e).splitlines()[0][:120])
            continue
        if ref is None:
            ref = o.float()
        fns[f"torch_{be}"] = fn

    def ours(schedule):
        opts = mkernel.AttentionOptions(schedule=schedule)

        def run():
            mkernel.attention(q, k, v, out, lse=lse, causal=causal, stream=torch.cuda.current_stream(), options=opts)
        return run
    for sched in schedules:
        name = method_name(sched)
        fn = ours(sched)
        out.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        if ref is not None:
            err = float((out.transpose(1, 2).float() - ref).norm() / ref.norm())
            results[f"{name}_err"] = err
            if not err < 2e-2:
                raise AssertionError(f"{sh}: mkernel.attention (schedule={sched}) differs from torch by {err:.3e}")
        fns[name] = fn
    per_call = 2 if S >= 16384 else 5 if S >= 4096 else 20
    times = time_interleaved(fns, warmup=2, rounds=rounds, batch=per_call, host_lead=True)
    for name, t in times.items():
        ms = t["median_ms"]
        results[name] = dict(ms=ms, tflops=flops(sh) / ms / 1e9, host_ms=t["host_ms"])
    return results


def report(res, meta, schedules=("default",)) -> str:
    rows = []
    names = [method_name(s) for s in schedules]
    for sh, r in res:
        best = min((r[f"torch_{b}"]["ms"] for b in BACKENDS if "ms" in r.get(f"torch_{b}", {})), default=None)

        def cell(name):
            x = r.get(name, {})
            return f"{x['tflops']:.0f} ({x['ms']:.3f})" if "ms" in x else "n/a"

        def speedup(name):
            m = r.get(name, {})
            return f"{best / m['ms']:.2f}x" if best and "ms" in m else "n/a"
        m = r.get(names[0], {})
        rows.append([f"B={sh['B']} S={sh['S']} H={sh['Hq']}/{sh['Hkv']} D={sh['D']}{' causal' if sh['causal'] else ''}",
                     *(cell(n) for n in names), *(cell(f"torch_{b}") for b in BACKENDS), *(speedup(n) for n in names),
                     f"{m['host_ms'] * 1e3:.0f}" if "host_ms" in m else "n/a"])
    table = markdown_table(["shape", *(f"{n} TFLOP/s (ms)" for n in names), *(f"torch {b}" for b in BACKENDS),
                            *(f"{n} vs best torch" for n in names), f"{names[0]} host us/call"], rows)
    return ("# Attention forward (one GPU)\n\n"
            f"{meta.get('device', '')}, torch {meta.get('torch', '')}; bf16, TFLOP/s = 4 B H_q S^2 D / t (causal "
            "at half); GPU time per call (CUDA events, alternating rounds, median); host us/call: the submission "
            "time of one eager call.  Produced by bench/attention.py.\n\n" + table + "\n")


def plot(res, path, schedules=("default",)):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(sh["Hq"], sh["Hkv"], sh["D"], sh["causal"]) for sh, _ in res})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        pts = [(sh["S"], r) for sh, r in res if (sh["Hq"], sh["Hkv"], sh["D"], sh["causal"]) == key]
        for name, style in (*((method_name(s), "o-") for s in schedules), *((f"torch_{b}", "s--") for b in BACKENDS)):
            xy = [(s, r[name]["tflops"]) for s, r in pts if "tflops" in r.get(name, {})]
            if xy:
                ax.plot([x for x, _ in xy], [y for _, y in xy], style, label=name, ms=4)
        ax.set_xscale("log", base=2)
        ax.set_title(f"H={key[0]}/{key[1]} D={key[2]}{' causal' if key[3] else ''}", fontsize=9)
        ax.set_xlabel("S")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs"))
    ap.add_argument("--only", default="", help="comma-separated filters: D64, D128, causal, noncausal, gqa, mha")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--schedules", default="default",
                    help="comma-separated AttentionOptions.schedule values to time side by side (default,pingpong)")
    a = ap.parse_args()
    import torch

    import mkernel
    from mkernel.ops.attention.kernels import SCHEDULES

    schedules = tuple(x.strip() for x in a.schedules.split(",") if x.strip())
    if not schedules or any(x not in SCHEDULES for x in schedules):
        ap.error(f"--schedules: a comma-separated subset of {','.join(SCHEDULES)}, got {a.schedules!r}")

    keep = {x.strip() for x in a.only.split(",") if x.strip()}

    def wanted(sh):
        tags = {f"D{sh['D']}", "causal" if sh["causal"] else "noncausal", "gqa" if sh["Hq"] != sh["Hkv"] else "mha"}
        return all(t in tags for t in keep)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    res = []
    for sh in filter(wanted, shapes(a.quick)):
        try:
            r = bench_shape(torch, mkernel, sh, a.rounds, schedules)
        except Exception:  # noqa: BLE001 -- report and go on with the next shape
            traceback.print_exc()
            r = dict(error=traceback.format_exc().splitlines()[-1])
        res.append((sh, r))
        print(sh, {k: (round(v["tflops"]) if isinstance(v, dict) and "tflops" in v else v) for k, v in r.items()},
              flush=True)
    meta["schedules"] = list(schedules)
    text = report(res, meta, schedules)
    print(text)
    write_report(a.out, "attention_bench", text, meta, [dict(shape=sh, **r) for sh, r in res],
                 plot=lambda p: plot(res, p, schedules))


if __name__ == "__main__":
    main()
