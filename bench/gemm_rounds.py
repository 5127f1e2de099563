"""Probe: mkernel.gemm against cuBLAS replay by replay.  For each shape NAME@M of bench/gemm.py's
tables (weights [N, K]) and each plan ("auto", a config id, or CONFIGxSPLITS), after a pause of
SLEEP seconds: ROUNDS rounds of one CUDA-graph replay each (bench/gemm.py's runners, 200 calls a
replay), ours and cuBLAS alternating; prints every round's per-call microseconds, so a drift over
a run (clocks under the power cap) shows instead of hiding in a median (docs/gemm.md entry 25).

    python bench/gemm_rounds.py llama70b.o@128,dsv3.moe_down@128 30 2 auto,1,13
"""
import sys
import time
from pathlib import Path
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
from _common import setup_env, time_interleaved
setup_env()
import torch
from gemm import DEEPSEEK_V3, LLAMA3_70B, _runner, batch_for, make_inputs
from mkernel import gemm_engine as G
from mkernel.arrays import as_device_array
torch.empty(1, device="cuda")
l2 = torch.cuda.get_device_properties(0).L2_cache_size
table = {**LLAMA3_70B, **DEEPSEEK_V3}
for spec in sys.argv[1].split(","):
    name, m = spec.split("@"); M, (N, K) = int(m), table[name]
    A, B, C, Cr = make_inputs(M, N, K, "nk", l2)
    nsets = len(A)
    dA, dB, dC = ([as_device_array(x) for x in xs] for xs in (A, B, C))
    batch = batch_for(2.0 * M * N * K, nsets)
    def theirs(i):
        torch.matmul(A[i], B[i].t(), out=Cr[i])
    rt = _runner(theirs, nsets, batch, False)
    for phase in sys.argv[4].split(","):
        cfg = None if phase == "auto" else int(phase.split("x")[0])
        sp = int(phase.split("x")[1]) if "x" in phase else None
        def ours(i):
            G.gemm(dA[i], dB[i], dC[i], b_layout="nk", stream=torch.cuda.current_stream(), config=cfg, splits=sp)
        ro = _runner(ours, nsets, batch, False)
        torch.cuda.synchronize()
        err = ((C[0].float() - Cr[0].float()).norm() / Cr[0].float().norm()).item()
        phase = f"{phase} err={err:.1e}"
        time.sleep(float(sys.argv[3]))
        st = time_interleaved({"ours": ro, "cublas": rt}, warmup=0, rounds=int(sys.argv[2]))
        so = [x / batch * 1e3 for x in st["ours"]["samples"]]
        sc = [x / batch * 1e3 for x in st["cublas"]["samples"]]
        print(f"{spec} {phase} nsets={nsets} batch={batch}: ours " + " ".join(f"{x:.1f}" for x in so), flush=True)
        print(f"{spec} {phase}            cublas " + " ".join(f"{x:.1f}" for x in sc), flush=True)
        time.sleep(float(sys.argv[3]))
