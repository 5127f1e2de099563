#!/usr/bin/env python
"""mkernel.gemm against cuBLAS (torch.matmul) on random shapes no table names: the general case.

    python bench/gemm_random.py SEED COUNT [--out DIR]
    python bench/gemm_random.py --replot JSON [--out DIR]      (no GPU: table and plot from a run's JSON)

COUNT shapes from SEED: M, N, K log-uniform in [64, 12288] (N and K multiples of 8, so a bf16 row is a
16-byte multiple as TMA needs; M anything), B "kn" or "nk" at random, about a third of them with padded
operand rows (row stride K or N plus 8 to 64 elements: in-place views of wider buffers).  Each shape:
inputs rotated over as many sets as it takes to exceed 2x L2, one CUDA-graph replay of a batch of calls
per round, ours and cuBLAS alternating for ROUNDS (5) rounds; the median per call.  Both results are
compared (relative Frobenius distance, must be < 1e-2).  Prints one row per shape and a summary: the
geometric mean and minimum of cuBLAS time / ours, and the shapes below 0.9x.  --out DIR also writes
gemm_random_SEED.json / .md / .png there (the plot: ratio against the call's flop, misaligned operand
rows -- an odd multiple of 16 bytes apart, docs/gemm.md entry 62 -- marked).
"""
from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from _common import setup_env, time_interleaved  # noqa: E402

setup_env()

ROUNDS = 5


def shapes(seed: int, count: int):
    import numpy as np

    rng = np.random.default_rng(seed)

    def logu(lo, hi):
        return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))

    out = []
    for _ in range(count):
        M = logu(64, 12288)
        N = max(8, logu(64, 12288) // 8 * 8)
        K = max(8, logu(64, 12288) // 8 * 8)
        layout = "kn" if rng.random() < 0.5 else "nk"
        pad = int(rng.integers(1, 9)) * 8 if rng.random() < 1 / 3 else 0
        out.append((M, N, K, layout, pad))
    return out


def run_shape(M, N, K, layout, pad, l2):
    import torch

    from gemm import _runner, batch_for
    from mkernel import gemm_engine as G
    from mkernel.arrays import as_device_array

    b_rows, b_cols = (K, N) if layout == "kn" else (N, K)
    per_set = 2 * (M * (K + pad) + b_rows * (b_cols + pad) + 2 * M * N)
    nsets = max(1, min(8, math.ceil(2 * l2 / per_set)))
    A = [torch.randn(M, K + pad, device="cuda", dtype=torch.bfloat16)[:, :K] for _ in range(nsets)]
    B = [torch.randn(b_rows, b_cols + pad, device="cuda", dtype=torch.bfloat16)[:, :b_cols]
         for _ in range(nsets)]
    C = [torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(nsets)]
    Cr = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(nsets)]
    dA, dB, dC = ([as_device_array(x) for x in xs] for xs in (A, B, C))
    batch = batch_for(2.0 * M * N * K, nsets)
    Bt = [b if layout == "kn" else b.t() for b in B]
    stream = torch.cuda.current_stream
    fns = {"cublas": _runner(lambda i: torch.matmul(A[i], Bt[i], out=Cr[i]), nsets, batch, False),
           "ours": _runner(lambda i: G.gemm(dA[i], dB[i], dC[i], b_layout=layout, stream=stream()),
                           nsets, batch, False)}
    plan = next(reversed(G._plans.values()))
    torch.cuda.synchronize()
    ref = Cr[0].double()
    err = ((C[0].double() - ref).norm() / ref.norm()).item()
    st = time_interleaved(fns, warmup=1, rounds=ROUNDS)
    us = {k: statistics.median(v["samples"]) / batch * 1e3 for k, v in st.items()}
    name = plan.name if plan.cfg is None else f"c{plan.cfg.id}x{plan.splits}"
    return {"M": M, "N": N, "K": K, "layout": layout, "pad": pad, "plan": name, "err": err,
            "ours_us": us["ours"], "cublas_us": us["cublas"], "ratio": us["cublas"] / us["ours"]}


def misaligned(r) -> bool:
    """Whether A's or B's rows are an odd multiple of 16 bytes apart (bf16)."""
    b_cols = r["N"] if r["layout"] == "kn" else r["K"]
    return any(((c + r["pad"]) * 2) % 32 == 16 for c in (r["K"], b_cols))


def summarize(seed, rows) -> str:
    ratios = [r["ratio"] for r in rows]
    gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    low = [r for r in rows if r["ratio"] < 0.9]
    wrong = [r for r in rows if not r["err"] < 1e-2]
    al = [r["ratio"] for r in rows if not misaligned(r)]
    gm_al = math.exp(sum(math.log(x) for x in al) / len(al)) if al else float("nan")
    return (f"seed {seed}: {len(rows)} shapes, geometric mean {gm:.2f}x cuBLAS, min {min(ratios):.2f}, "
            f"{len(low)} below 0.9, {len(wrong)} wrong; {len(al)} with aligned operand rows: geometric mean "
            f"{gm_al:.2f}")


def write(out_dir: Path, seed, rows, device: str = "") -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"gemm_random_{seed}"
    stem.with_suffix(".json").write_text(json.dumps({"seed": seed, "device": device, "rows": rows}, indent=1))
    summary = summarize(seed, rows)
    lines = [f"# mkernel.gemm vs cuBLAS on random shapes (seed {seed}{', ' + device if device else ''})", "",
             "Generated by `python bench/gemm_random.py`: bf16, CUDA graphs, inputs rotated over >= 2x L2, "
             f"median of {ROUNDS} alternating rounds; pad = extra elements per operand row (in-place views); "
             "mis = A's or B's rows an odd multiple of 16 bytes apart.", "", summary, "",
             "| M | N | K | B | pad | mis | plan | ours us | cuBLAS us | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['M']} | {r['N']} | {r['K']} | {r['layout']} | {r['pad']} | {'x' if misaligned(r) else ''} | "
              f"{r['plan']} | {r['ours_us']:.1f} | {r['cublas_us']:.1f} | {r['ratio']:.2f} |" for r in rows]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for mis, color, label in ((False, "tab:blue", "aligned rows"), (True, "tab:red", "misaligned rows")):
        sel = [r for r in rows if misaligned(r) == mis]
        ax.scatter([2.0 * r["M"] * r["N"] * r["K"] for r in sel], [r["ratio"] for r in sel], c=color,
                   label=f"{label} ({len(sel)})", s=22)
    ax.set_xscale("log")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(0.9, color="k", lw=0.8, ls=":")
    ax.set_xlabel("flop per call")
    ax.set_ylabel("cuBLAS time / mkernel time")
    ax.set_title(summary.split(";")[0], fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)


def main(argv):
    out_dir = None
    if "--out" in argv:
        i = argv.index("--out")
        out_dir = Path(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    if argv[0] == "--replot":
        data = json.loads(Path(argv[1]).read_text())
        write(out_dir or Path(argv[1]).parent, data["seed"], data["rows"], data.get("device", ""))
        return 0
    import torch

    seed, count = int(argv[0]), int(argv[1])
    torch.empty(1, device="cuda")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    print(f"{'M':>6} {'N':>6} {'K':>6} lay pad  plan     ours_us  cublas_us  ratio  err", flush=True)
    for M, N, K, layout, pad in shapes(seed, count):
        r = run_shape(M, N, K, layout, pad, l2)
        rows.append(r)
        flag = "" if r["err"] < 1e-2 else "  WRONG"
        print(f"{M:>6} {N:>6} {K:>6} {layout} {pad:>3}  {r['plan']:<8} {r['ours_us']:>8.1f} "
              f"{r['cublas_us']:>9.1f}  {r['ratio']:.2f}  {r['err']:.1e}{flag}", flush=True)
        torch.cuda.empty_cache()
    print(summarize(seed, rows), flush=True)
    for r in rows:
        if r["ratio"] < 0.9:
            print(f"  below 0.9: {r['M']}x{r['N']}x{r['K']} {r['layout']} pad {r['pad']} {r['plan']} "
                  f"{r['ratio']:.2f}", flush=True)
    if out_dir is not None:
        write(out_dir, seed, rows, torch.cuda.get_device_name(0))
    return 1 if any(not r["err"] < 1e-2 for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
