"""Probes of the copy engines between two GPUs of one process, each pushing 256 MiB to the other at
once (like a 2-rank all-gather).  Every trial starts behind a GPU-side delay, so the host's
submission is not timed; printed: the median over trials of the slower GPU's microseconds.  Needs
torch and 2 GPUs.

    python experiments/ce_probe.py ops    what one copy-engine operation costs: the push as 1 / 4 / 8 / 16
                                          copies on one stream per GPU, each followed by nothing, an 8-byte
                                          flag copy (mkernel.ag_gemm's fused_ce path), a cuStreamWriteValue32
                                          or ...64 of the flag, or flag copies after a cuStreamWaitValue32 on
                                          an already-raised word
    PYTHONPATH=. python experiments/ce_probe.py gemm
                                          a GEMM beside copy-engine traffic: the AllGather+GEMM sweep point
                                          M = K = 16384 (A [16384, 16384] @ W [1024, 16384]^T, bf16) alone, then
                                          with the push in 8 copies on another stream, for cuBLAS and
                                          mkernel.gemm
"""
import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    sys.exit(print(__doc__))  # before the imports that need a GPU machine (torch, the driver)

import torch
from cuda.bindings import driver as cu

NB = 256 << 20
DEVS = (0, 1)


def median_us(xs_ms):
    return sorted(xs_ms)[len(xs_ms) // 2] * 1e3


class Pair:
    """The two GPUs' buffers and a copy stream each (peer access enabled by a small torch copy)."""

    def __init__(self):
        self.src = [torch.empty(NB, dtype=torch.uint8, device=f"cuda:{d}").random_() for d in DEVS]
        self.dst = [torch.empty(NB, dtype=torch.uint8, device=f"cuda:{d}") for d in DEVS]
        self.src[0][:16].to("cuda:1")
        self.src[1][:16].to("cuda:0")
        self.copy = {d: torch.cuda.Stream(device=d) for d in DEVS}

    def push(self, d, copies, after=None):
        """GPU d's buffer into the other's as ``copies`` copies on its copy stream; ``after(c, stream)``
        after copy c."""
        s, per = self.copy[d].cuda_stream, NB // copies
        for c in range(copies):
            cu.cuMemcpyAsync(self.dst[1 - d].data_ptr() + c * per, self.src[d].data_ptr() + c * per, per, s)
            if after is not None:
                after(c, s)

    def trials(self, lead, ends, enqueue, reps, lead_cycles):
        """Per stream of ``ends[d]``: the median over ``reps`` trials of the slower GPU's time from an event
        recorded on ``lead[d]`` behind a ``lead_cycles`` delay (the other streams of ``ends[d]`` wait for
        it) to the end of what ``enqueue()`` put on that stream."""
        samples = [[] for _ in ends[DEVS[0]]]
        for _ in range(reps):
            for d in DEVS:
                torch.cuda.synchronize(d)
            e0, e1 = {}, {}
            for d in DEVS:
                with torch.cuda.device(d), torch.cuda.stream(lead[d]):
                    torch.cuda._sleep(lead_cycles)
                    e0[d] = torch.cuda.Event(enable_timing=True)
                    e0[d].record(lead[d])
                for s in ends[d]:
                    if s is not lead[d]:
                        s.wait_event(e0[d])
            enqueue()
            for d in DEVS:
                with torch.cuda.device(d):
                    e1[d] = [torch.cuda.Event(enable_timing=True) for _ in ends[d]]
                    for e, s in zip(e1[d], ends[d]):
                        e.record(s)
            for d in DEVS:
                torch.cuda.synchronize(d)
            for i, xs in enumerate(samples):
                xs.append(max(e0[d].elapsed_time(e1[d][i]) for d in DEVS))
        return [median_us(xs) for xs in samples]


def ops(pair):
    flags = [torch.zeros(64, dtype=torch.int64, device=f"cuda:{d}") for d in DEVS]
    val = [torch.ones(1, dtype=torch.int64, device=f"cuda:{d}") for d in DEVS]
    go = [torch.ones(1, dtype=torch.int32, device=f"cuda:{d}") for d in DEVS]
    ends = {d: [pair.copy[d]] for d in DEVS}

    def run(copies, mode, waitgo):
        def enqueue():
            for d in DEVS:
                fl = flags[1 - d].data_ptr()
                if waitgo:
                    cu.cuStreamWaitValue32(pair.copy[d].cuda_stream, go[d].data_ptr(), 1,
                                           cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ.value)
                flag = {"memcpy8": lambda c, s, d=d, fl=fl: cu.cuMemcpyAsync(fl + 8 * c, val[d].data_ptr(), 8, s),
                        "write32": lambda c, s, fl=fl: cu.cuStreamWriteValue32(s, fl + 8 * c, 1, 0),
                        "write64": lambda c, s, fl=fl: cu.cuStreamWriteValue64(s, fl + 8 * c, 1, 0)}.get(mode)
                pair.push(d, copies, flag)
        return pair.trials(pair.copy, ends, enqueue, 7, 1_000_000)[0]

    for rnd in range(2):
        for copies in (1, 4, 8, 16):
            line = [f"{mode} {run(copies, mode, False):.0f}" for mode in ("none", "memcpy8", "write32", "write64")]
            line.append(f"memcpy8+waitgo {run(copies, 'memcpy8', True):.0f}")
            print(f"round {rnd} copies={copies:2d}: " + "  ".join(line) + " us", flush=True)


def gemm(pair):
    import mkernel
    from mkernel.core.interop import as_device_array

    gs = {d: torch.cuda.Stream(device=d) for d in DEVS}
    A = {d: torch.randn(16384, 16384, dtype=torch.bfloat16, device=f"cuda:{d}") for d in DEVS}
    W = {d: torch.randn(1024, 16384, dtype=torch.bfloat16, device=f"cuda:{d}") / 128 for d in DEVS}
    C = {d: torch.empty(16384, 1024, dtype=torch.bfloat16, device=f"cuda:{d}") for d in DEVS}
    DA = {}
    for d in DEVS:
        with torch.cuda.device(d):
            DA[d] = tuple(as_device_array(t, stream=gs[d].cuda_stream) for t in (A[d], W[d], C[d]))

    def one(d, which):
        with torch.cuda.device(d), torch.cuda.stream(gs[d]):
            if which == "cublas":
                torch.matmul(A[d], W[d].t(), out=C[d])
            else:
                mkernel.gemm(*DA[d], b_layout="nk", stream=gs[d].cuda_stream)

    def run(which, copies):
        def enqueue():
            for d in DEVS:
                one(d, which)
                if copies:
                    pair.push(d, 8)
        ends = {d: [gs[d]] + ([pair.copy[d]] if copies else []) for d in DEVS}
        return pair.trials(gs, ends, enqueue, 9, 2_000_000)

    for d in DEVS:
        for w in ("cublas", "mkernel"):
            one(d, w)
        torch.cuda.synchronize(d)
    for rnd in range(3):
        for w in ("cublas", "mkernel"):
            ga, = run(w, False)
            gb, cb = run(w, True)
            print(f"round {rnd} {w:8s}: gemm alone {ga:.0f} us; with copies: gemm {gb:.0f} us, copies {cb:.0f} us",
                  flush=True)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what not in ("ops", "gemm"):
        raise SystemExit(__doc__)
    (ops if what == "ops" else gemm)(Pair())
