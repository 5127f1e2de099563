#!/usr/bin/env python
"""Every plan mkernel.gemm has for a shape, timed against cuBLAS, as a table the heuristic can be replayed
on without a GPU (experiments/gemm_heuristic_replay.py).

    python experiments/gemm_plan_table.py SHAPE [SHAPE ...] [--configs 1,2,3] [--splits 1,2,4,8] [--swap-configs 53,54]
                                          [--json FILE] [--batch-ms 50]

SHAPE: MxNxK[:kn|:nk][+PAD] -- B "nk" ([N, K]) unless ":kn"; PAD extra elements at the end of every
operand row (in-place views of wider buffers; PAD = 8 mod 16 makes the rows misaligned, docs/journal/gemm.md
entry 62).  Plans: the automatic one (with PDL as the heuristic decides, forced off, forced on; and
"auto:plain", with MKERNEL_GEMM_SWAP=0) and every config (default: the heuristic's candidates) x forced
split factor it allows (forced splits split every tile), and with --swap-configs every such config x
split computed transposed (C^T = B A^T, "nk" only: labels s<config>x<splits>, and s<config>xa with the
split plan the heuristic gives it).  All of a shape's plans and cuBLAS are CUDA-graph replays timed in
the same rounds, in an order shuffled each round (median of 5).  Prints cuBLAS, the automatic plans and
the six best; --json writes, per shape, every plan's label (c<config>x<splits>[f<split_from>][p: PDL])
and microseconds.  (First run as
scratch/plans_probe.py in the twenty-first session: docs/journal/results/gemm_plans_20261201.json.)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]  # bench/_common.py, bench/gemm.py; the package
from _common import setup_env, time_interleaved, write_json  # noqa: E402
from gemm import GemmProblem, plan_label  # noqa: E402


def parse_shape(spec: str):
    """(M, N, K, layout, pad) of MxNxK[:kn|:nk][+PAD]."""
    body, _, pad = spec.partition("+")
    dims, _, layout = body.partition(":")
    M, N, K = (int(v) for v in dims.lower().split("x"))
    return M, N, K, layout or "nk", int(pad or 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="+")
    ap.add_argument("--configs", default=None, help="config ids (default: the heuristic's candidates)")
    ap.add_argument("--splits", default="1,2,4,8")
    ap.add_argument("--swap-configs", default="", help="config ids to also time swapped (B \"nk\" only)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--batch-ms", type=float, default=50.0, help="work per timed replay (ms, guessed)")
    args = ap.parse_args()
    setup_env()
    import torch

    from mkernel.ops import gemm as G
    from mkernel.ops.gemm import configs as GC, heuristic as GH

    torch.empty(1, device="cuda")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    cfgs = [int(c) for c in args.configs.split(",")] if args.configs else list(GC.AUTO_CANDIDATES)
    splits = [int(s) for s in args.splits.split(",")]
    rows = []
    for spec in args.shapes:
        M, N, K, layout, pad = parse_shape(spec)
        prob = GemmProblem(M, N, K, l2, layout, pad, args.batch_ms)
        fns = {"cublas": prob.cublas}
        plans = [("auto", None, None, "auto", None), ("auto:pdl0", None, None, "0", None),
                 ("auto:pdl1", None, None, "1", None), ("auto:plain", None, None, "auto", None)]
        for c in cfgs:
            cfg = G.CONFIGS[c]
            if GH.phantom_row_half(cfg, M):  # (plans the heuristic never offers)
                continue
            ms = GH.max_splits(cfg, M, N, K, layout)
            plans += [(f"c{c}x{sp}", c, sp, "auto", None) for sp in splits if sp <= ms]
        for c in ([int(x) for x in args.swap_configs.split(",") if x] if layout == "nk" else []):
            ms = GH.max_splits(G.CONFIGS[c], N, M, K, layout)  # (the transposed problem)
            plans += [(f"s{c}x{sp}", c, sp, "auto", True) for sp in splits if sp <= ms]
            plans.append((f"s{c}xa", c, None, "auto", True))  # (its own split plan, as the heuristic's)
        labels = {}
        saved = {k: os.environ.get(k) for k in ("MKERNEL_GEMM_PDL", "MKERNEL_GEMM_SWAP")}
        for name, c, sp, pdl, swap in plans:
            os.environ["MKERNEL_GEMM_PDL"] = pdl  # (part of the plan key: read when the plan is built)
            os.environ["MKERNEL_GEMM_SWAP"] = "0" if name == "auto:plain" else "auto"  # (idem)
            prob.poison()  # (each plan's result checked on its own)
            fns[name] = prob.runner(lambda i, c=c, sp=sp, sw=swap, p=prob: p.ours(
                i, torch.cuda.current_stream(), config=c, splits=sp, swap=sw))
            torch.cuda.synchronize()
            labels[name] = plan_label(G.last_plan()) + ("" if prob.error() < 1e-2 else " ERR")
        for k, v in saved.items():  # (the caller's settings back)
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        # (shuffled: rotated by one a round, dozens of plans keep their places, and on long plans the
        # place moved a plan's median by up to 15 % -- docs/journal/validation.md twenty-third session, call 1)
        st = time_interleaved(fns, warmup=1, rounds=5, order="shuffle")
        us = {k: statistics.median(v["samples"]) / prob.batch * 1e3 for k, v in st.items()}
        cb = us.pop("cublas")
        best = sorted((v, k) for k, v in us.items() if not k.startswith("auto"))[:6]
        print(f"{spec}: cuBLAS {cb:.1f} | " + " ".join(f"{k}={labels[k]} {us[k]:.1f} ({cb / us[k]:.2f})"
                                                      for k in ("auto", "auto:pdl0", "auto:pdl1", "auto:plain"))
              + " | best " + " ".join(f"{labels[k]} {v:.1f} ({cb / v:.2f})" for v, k in best), flush=True)
        rows.append(dict(M=M, N=N, K=K, layout=layout, pad=pad, cublas=cb,
                         plans={k: (labels[k], v) for k, v in us.items()}))
        if args.json:
            write_json(args.json, {"device": torch.cuda.get_device_name(0), "rows": rows})
        del fns, prob
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
