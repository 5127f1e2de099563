"""Probe: a GEMM beside copy-engine traffic.  On each of two GPUs of one process, the GEMM of the
AllGather+GEMM sweep point M = K = 16384 (A [16384, 16384] @ W[1024, 16384]^T, bf16) alone, then
with both GPUs pushing 256 MiB to each other on the copy engines (8 copies, another stream) at the
same time; for cuBLAS (torch.matmul) and mkernel.gemm.  Prints the median GEMM and copy times (max over
the GPUs) of 9 trials, each started behind a GPU-side delay.  Needs torch and 2 GPUs.

    PYTHONPATH=. python bench/ce_gemm_probe.py
"""
import torch
from cuda.bindings import driver as cu
import mkernel
from mkernel.arrays import as_device_array

NB = 256 << 20
devs = [0, 1]
src = [torch.empty(NB, dtype=torch.uint8, device=f"cuda:{d}").random_() for d in devs]
dst = [torch.empty(NB, dtype=torch.uint8, device=f"cuda:{d}") for d in devs]
_ = src[0][:16].to("cuda:1"); _ = src[1][:16].to("cuda:0")
cs = {d: torch.cuda.Stream(device=d) for d in devs}
gs = {d: torch.cuda.Stream(device=d) for d in devs}
A = {d: torch.randn(16384, 16384, dtype=torch.bfloat16, device=f"cuda:{d}") for d in devs}
W = {d: torch.randn(1024, 16384, dtype=torch.bfloat16, device=f"cuda:{d}") / 128 for d in devs}
C = {d: torch.empty(16384, 1024, dtype=torch.bfloat16, device=f"cuda:{d}") for d in devs}
DA = {}
for d in devs:
    with torch.cuda.device(d):
        DA[d] = tuple(as_device_array(t, stream=gs[d].cuda_stream) for t in (A[d], W[d], C[d]))

def gemm(d, which):
    with torch.cuda.device(d), torch.cuda.stream(gs[d]):
        if which == "cublas":
            torch.matmul(A[d], W[d].t(), out=C[d])
        else:
            a, w, c = DA[d]
            mkernel.gemm(a, w, c, b_layout="nk", stream=gs[d].cuda_stream)

def run(which, copies, reps=9):
    g, c = [], []
    for _ in range(reps):
        for d in devs: torch.cuda.synchronize(d)
        evs = {}
        for d in devs:
            with torch.cuda.device(d), torch.cuda.stream(gs[d]):
                torch.cuda._sleep(2_000_000)
                e0 = torch.cuda.Event(enable_timing=True); e0.record(gs[d])
            if copies:
                cs[d].wait_event(e0)
            evs[d] = [e0]
        for d in devs:
            gemm(d, which)
            if copies:
                per = NB // 8
                for k in range(8):
                    cu.cuMemcpyAsync(dst[1 - d].data_ptr() + k * per, src[d].data_ptr() + k * per, per, cs[d].cuda_stream)
        for d in devs:
            with torch.cuda.device(d):
                e1 = torch.cuda.Event(enable_timing=True); e1.record(gs[d]); evs[d].append(e1)
                if copies:
                    e2 = torch.cuda.Event(enable_timing=True); e2.record(cs[d]); evs[d].append(e2)
        for d in devs: torch.cuda.synchronize(d)
        g.append(max(evs[d][0].elapsed_time(evs[d][1]) for d in devs))
        if copies:
            c.append(max(evs[d][0].elapsed_time(evs[d][2]) for d in devs))
    med = lambda x: sorted(x)[len(x) // 2] * 1e3 if x else float("nan")
    return med(g), med(c)

for d in devs:
    for w in ("cublas", "mkernel"):
        gemm(d, w)
for d in devs: torch.cuda.synchronize(d)
for rnd in range(3):
    for w in ("cublas", "mkernel"):
        ga, _ = run(w, False)
        gb, cb = run(w, True)
        print(f"round {rnd} {w:8s}: gemm alone {ga:.0f} us; with copies: gemm {gb:.0f} us, copies {cb:.0f} us", flush=True)
