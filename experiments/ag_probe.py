"""Probe: mkernel.ag_gemm's fused and unfused paths against our GEMM alone and our all-gather alone,
on the quick shapes of bench/ag_gemm.py, timed with CUDA events (no torch).  For experiments (e.g.
kernel defines through MKERNEL_DEFINES, docs/journal/ag_gemm.md); bench/ag_gemm.py is the benchmark.

    mpirun -np 2 python experiments/ag_probe.py
PROBE_SM=1 adds the SM-communication path at the model's split; PROBE_COMM_SMS="0,4,16" adds forced fused splits (0 = unfused); PROBE_SHAPES="qkv70,mlp405" picks shapes
(or "M:N_all:K" for any); PROBE_CE="3:0,3:1,4:auto" adds copy-engine variants, each CONFIG:TAIL_SPLIT
(TAIL_SPLIT: AgGemmOptions.tail_split as 0, 1 or auto); "auto:0" is the automatic copy-engine plan
without any split-K.  PROBE_NO_COPIES=1 drops the copy-engine path's copies (timing only: with MKERNEL_DEFINES=
MK_AG_TIMING_NO_WAIT=1 the fused kernel is then the bare GEMM inside the fused kernel).
Everything of a shape (our GEMM alone, forced to config 3 too, our all-gather alone, each ag_gemm variant)
is timed in alternating rounds (PROBE_ROUNDS, default 9; one batch of calls each per round), so clocks
drifting under the power cap hit all alike.  One line per shape: median us per call (max over ranks) and
overlap efficiency max(gemm alone, all-gather alone) / time.
"""
import dataclasses
import os
import sys
from pathlib import Path

import numpy as np
from cuda.bindings import driver as cu
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mkernel  # noqa: E402
from mkernel.core.arrays import DeviceArray  # noqa: E402
from mkernel.core.dtypes import f32_to_bf16  # noqa: E402
from mkernel.core.driver import check  # noqa: E402
from mkernel.ops.ag_gemm import AgGemmOptions  # noqa: E402
from mkernel.ops.ag_gemm import op as ag_op  # noqa: E402

SHAPES = {  # name: (M_total, N over all ranks, K)
    "qkv70": (4096, 10240, 8192),
    "mlp70": (8192, 28672, 8192),
    "qkv405": (16384, 18432, 16384),
    "mlp405": (1024, 53248, 16384),
    "sweep8k": (8192, 1024, 8192),  # N/P = M/16 with P = 2
    "qkv70_1k": (1024, 10240, 8192),
    "mlp70_1k": (1024, 28672, 8192),
    "qkv70_16k": (16384, 10240, 8192),
    "qkv405_16k": (16384, 18432, 16384),
    "sweep16k": (16384, 2048, 16384),
    "sweep32k": (32768, 4096, 32768),
}


def main():
    if os.environ.get("PROBE_NO_COPIES") == "1":
        ag_op.ce_copies = lambda *a, **k: []
    ctx = mkernel.init()
    P = ctx.local_size
    stream = check(cu.cuStreamCreate(1))
    s = int(stream)
    e0, e1 = check(cu.cuEventCreate(0)), check(cu.cuEventCreate(0))
    rng = np.random.default_rng(1234 + ctx.rank)
    names = [x for x in os.environ.get("PROBE_SHAPES", ",".join(SHAPES)).split(",") if x]
    extra = [int(x) for x in os.environ.get("PROBE_COMM_SMS", "").split(",") if x.strip()]
    tag = os.environ.get("MKERNEL_DEFINES", "") or "default"

    ce_variants = [v.split(":") for v in os.environ.get("PROBE_CE", "").split(",") if v.strip()]
    for name in names:
        M, N_all, K = SHAPES[name] if name in SHAPES else (int(x) for x in name.split(":"))
        Mr, N = M // P, N_all // P
        a = DeviceArray.from_numpy(f32_to_bf16(rng.standard_normal((Mr, K), dtype=np.float32)), dtype="bfloat16")
        w = DeviceArray.from_numpy(f32_to_bf16(rng.standard_normal((N, K), dtype=np.float32) / np.sqrt(K)),
                                   dtype="bfloat16")
        out = DeviceArray.empty((M, N), "bfloat16")
        full = DeviceArray.empty((M, K), "bfloat16")
        est = 2.0 * M * N * K / 600e12 * 1e6
        mkernel.all_gather(ctx, a, full, stream=s)  # the GEMM's A holds data (zeros run faster)
        # the GEMM alone, the all-gather alone, then the ag_gemm variants (automatic plan; -1: SM path at
        # the model's split; forced splits; copy-engine variants), timed in alternating rounds
        variants = [None, *([-1] if os.environ.get("PROBE_SM") == "1" else []), *extra, *ce_variants]
        calls = [("gemm", lambda: mkernel.gemm(full, w, out, b_layout="nk", stream=s)),
                 ("gemm_c3", lambda: mkernel.gemm(full, w, out, b_layout="nk", stream=s, config=3)),
                 ("all_gather", lambda: mkernel.all_gather(ctx, a, full, stream=s))]
        for cs in variants:
            kw, env = dict(comm_sms=cs), "auto"
            if isinstance(cs, list):
                kw = dict(path="fused_ce", config=int(cs[0])) if cs[0] not in ("", "auto") else dict(path="fused_ce")
                env = cs[1]
            elif cs == -1:
                kw = dict(comm_sms=ctx.last_plan("ag_gemm").fused_comm_sms)
            tail = {"": None, "auto": None, "0": False, "1": True}[env]
            opts = dataclasses.replace(AgGemmOptions.default(), tail_split=tail)

            def call(kw=kw, opts=opts):
                mkernel.ag_gemm(ctx, a, w, out, b_layout="nk", stream=s, options=opts, **kw)
            call()  # first call of the plan (signature exchange, workspace) outside the timing
            p = ctx.last_plan("ag_gemm")
            split = f"/c{p.config}/cr{p.chunk_rows}" + (f"/split{p.splits}@{p.split_from}" if p.splits > 1 else "")
            calls.append((f"{p.path}/{p.comm_sms}{split}", call))
        batch = int(min(20, max(2, 4000 // max(est, 1))))
        per = [[] for _ in calls]
        for _ in range(int(os.environ.get("PROBE_ROUNDS", 9))):
            for j, (_, fn) in enumerate(calls):
                ctx.synchronize(s)
                ctx.world.Barrier()
                check(cu.cuEventRecord(e0, stream))
                for _ in range(batch):
                    fn()
                check(cu.cuEventRecord(e1, stream))
                ctx.synchronize(s)
                per[j].append(check(cu.cuEventElapsedTime(e0, e1)) / batch * 1e3)
        rows = [(label, ctx.world.allreduce(float(np.median(t)), op=MPI.MAX)) for (label, _), t in zip(calls, per)]
        (_, t_gemm), (_, t_g3), (_, t_ag), rows = rows[0], rows[1], rows[2], rows[3:]
        floor = max(t_gemm, t_ag)
        if ctx.rank == 0:
            print(f"[{tag}] {name:8s} M={M} N/P={N} K={K}: gemm {t_gemm:8.1f} us (config 3: {t_g3:8.1f})  "
                  f"all_gather {t_ag:7.1f} us  "
                  + "  ".join(f"{v} {t:8.1f} us (eff {floor / t:.2f})" for v, t in rows), flush=True)
    ctx.close()


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        sys.exit(print(__doc__))
    main()
