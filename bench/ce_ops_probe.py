"""Probe: what one copy-engine operation costs.  Two GPUs of one process push 256 MiB to each other at
once (like a 2-rank all-gather), on one stream each, as 1 / 4 / 8 / 16 copies, each copy followed by
nothing, an 8-byte flag copy (what mkernel.ag_gemm's fused_ce path does), a cuStreamWriteValue32 or
a cuStreamWriteValue64 of the flag, or with a cuStreamWaitValue32 on an already-raised word first.
Prints the median microseconds (max over the two GPUs) of 7 trials, each started behind a GPU-side
delay so the host's submission is not timed.  Needs torch and 2 GPUs.

    python bench/ce_ops_probe.py
"""
import torch
from cuda.bindings import driver as cu

NB = 256 << 20
devs = [0, 1]
src = [torch.empty(NB, dtype=torch.uint8, device=f"cuda:{d}").random_() for d in devs]
dst = [torch.empty(NB, dtype=torch.uint8, device=f"cuda:{d}") for d in devs]
flags = [torch.zeros(64, dtype=torch.int64, device=f"cuda:{d}") for d in devs]
val = [torch.ones(1, dtype=torch.int64, device=f"cuda:{d}") for d in devs]
go = [torch.ones(1, dtype=torch.int32, device=f"cuda:{d}") for d in devs]
_ = src[0][:16].to("cuda:1"); _ = src[1][:16].to("cuda:0")
streams = {d: torch.cuda.Stream(device=d) for d in devs}

def enqueue(d, chunks, mode, waitgo):
    o = 1 - d
    s = streams[d].cuda_stream
    if waitgo:
        cu.cuStreamWaitValue32(s, go[d].data_ptr(), 1, cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ.value)
    per = NB // chunks
    for c in range(chunks):
        cu.cuMemcpyAsync(dst[o].data_ptr() + c * per, src[d].data_ptr() + c * per, per, s)
        fp = flags[o].data_ptr() + 8 * c
        if mode == "memcpy8":
            cu.cuMemcpyAsync(fp, val[d].data_ptr(), 8, s)
        elif mode == "write32":
            cu.cuStreamWriteValue32(s, fp, 1, 0)
        elif mode == "write64":
            cu.cuStreamWriteValue64(s, fp, 1, 0)

def run(chunks, mode, waitgo, reps=7):
    out = []
    for _ in range(reps):
        for d in devs: torch.cuda.synchronize(d)
        ev = {}
        for d in devs:
            with torch.cuda.device(d), torch.cuda.stream(streams[d]):
                torch.cuda._sleep(1_000_000)
                e0 = torch.cuda.Event(enable_timing=True); e0.record(streams[d])
                ev[d] = e0
        for d in devs:
            enqueue(d, chunks, mode, waitgo)
        for d in devs:
            with torch.cuda.device(d):
                e1 = torch.cuda.Event(enable_timing=True); e1.record(streams[d])
                ev[d] = (ev[d], e1)
        for d in devs: torch.cuda.synchronize(d)
        out.append(max(a.elapsed_time(b) for a, b in ev.values()))
    out.sort()
    return out[len(out) // 2] * 1e3

for rnd in range(2):
    for chunks in (1, 4, 8, 16):
        line = []
        for mode in ("none", "memcpy8", "write32", "write64"):
            line.append(f"{mode} {run(chunks, mode, False):.0f}")
        line.append(f"memcpy8+waitgo {run(chunks, 'memcpy8', True):.0f}")
        print(f"round {rnd} chunks={chunks:2d}: " + "  ".join(line) + " us", flush=True)
