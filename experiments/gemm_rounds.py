"""Probe: mkernel.gemm against cuBLAS replay by replay.  For each shape (tools/gemm_profile.py's specs:
NAME@M of bench/gemm.py's tables, squareS or MxNxK; weights [N, K]) and each plan ("auto", a config id,
or CONFIGxSPLITS), after a pause of SLEEP seconds: ROUNDS rounds of one CUDA-graph replay each
(bench/gemm.py's runners, 200 calls a replay), ours and cuBLAS alternating; prints every round's
per-call microseconds, so a drift over a run (clocks under the power cap) shows instead of hiding in a
median (docs/journal/gemm.md entry 25), then a summary line: the plan that ran (c<config>x<splits>), the relative error, and the median of
rounds 0-3 ("cool") and of rounds 8 on ("steady", given more than 8 rounds), ours / cuBLAS.

    python experiments/gemm_rounds.py llama70b.o@128,dsv3.moe_down@128,square4096 20 1.5 auto,1,19x2 [--summary]

--summary: the summary lines only.
"""
import statistics
import sys
import time
from pathlib import Path
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tools"), str(ROOT)]  # _common, gemm; gemm_profile; the package
if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    sys.exit(print(__doc__))  # before the imports that need a GPU machine (torch, the driver)
from _common import setup_env, time_interleaved
setup_env()
import torch
from gemm import GemmProblem
from gemm_profile import parse
from mkernel.ops import gemm as G


def main(argv):
    summary_only = "--summary" in argv
    specs, rounds, sleep, plans = [a for a in argv if a != "--summary"]
    rounds, sleep = int(rounds), float(sleep)
    torch.empty(1, device="cuda")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for spec in specs.split(","):
        _, M, N, K = parse(spec)
        prob = GemmProblem(M, N, K, l2)
        nsets, batch, rt = prob.nsets, prob.batch, prob.cublas
        for phase in plans.split(","):
            cfg = None if phase == "auto" else int(phase.split("x")[0])
            sp = int(phase.split("x")[1]) if "x" in phase else None

            ro = prob.runner(lambda i: prob.ours(i, torch.cuda.current_stream(), config=cfg, splits=sp))
            plan = G.last_plan()  # (the plan ours just built or used)
            torch.cuda.synchronize()
            err = prob.error()
            time.sleep(sleep)
            st = time_interleaved({"ours": ro, "cublas": rt}, warmup=0, rounds=rounds)
            so = [x / batch * 1e3 for x in st["ours"]["samples"]]
            sc = [x / batch * 1e3 for x in st["cublas"]["samples"]]
            pname = plan.kind if plan.kind != "tiles" else f"c{plan.config}x{plan.splits}"  # (gemv: no tile config)
            tag = f"{spec} {phase} {pname} err={err:.1e}"
            if not summary_only:
                print(f"{tag} nsets={nsets} batch={batch}: ours " + " ".join(f"{x:.1f}" for x in so), flush=True)
                print(f"{tag}            cublas " + " ".join(f"{x:.1f}" for x in sc), flush=True)
            line = f"{tag} cool {statistics.median(so[:4]):.1f} / {statistics.median(sc[:4]):.1f}"
            if rounds > 8:
                o, c = statistics.median(so[8:]), statistics.median(sc[8:])
                line += f"  steady {o:.1f} / {c:.1f} = {c / o:.2f}x"
            print(line, flush=True)
            time.sleep(sleep)


if __name__ == "__main__":
    main(sys.argv[1:])
