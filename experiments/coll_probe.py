"""Probe: our collectives alone at a few sizes, timed with CUDA events (no torch).

    mpirun -np 2 python experiments/coll_probe.py
Chunking knobs come from MKERNEL_COLL_MIN_CHUNK / MKERNEL_COLL_MAX_BLOCKS.
"""
import os
import sys
from pathlib import Path

import numpy as np
from cuda.bindings import driver as cu

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mkernel  # noqa: E402
from mkernel.core.arrays import DeviceArray  # noqa: E402
from mkernel.core.driver import check  # noqa: E402


def main():
    ctx = mkernel.init()
    P = ctx.local_size
    stream = check(cu.cuStreamCreate(1))
    s = int(stream)
    e0, e1 = check(cu.cuEventCreate(0)), check(cu.cuEventCreate(0))
    rows = []
    for mib in [int(x) for x in os.environ.get("PROBE_SIZES", "4,8,16,32,64").split(",")]:
        nbytes = mib << 20
        for op in ("all_gather", "all_reduce", "reduce_scatter"):
            n = nbytes // 2
            if op == "all_gather":
                x, out = DeviceArray.empty((n // P,), "bfloat16"), DeviceArray.empty((n // P * P,), "bfloat16")
            elif op == "reduce_scatter":
                x, out = DeviceArray.empty((n // P * P,), "bfloat16"), DeviceArray.empty((n // P,), "bfloat16")
            else:
                x, out = DeviceArray.empty((n,), "bfloat16"), DeviceArray.empty((n,), "bfloat16")
            x.fill_nan()
            fn = getattr(mkernel, op)
            for _ in range(5):
                fn(ctx, x, out, stream=s)
            ctx.synchronize(s)
            times = []
            for _ in range(7):
                ctx.world.Barrier()
                check(cu.cuEventRecord(e0, stream))
                for _ in range(20):
                    fn(ctx, x, out, stream=s)
                check(cu.cuEventRecord(e1, stream))
                ctx.synchronize(s)
                times.append(check(cu.cuEventElapsedTime(e0, e1)) / 20 * 1e3)
            t = float(np.median(times))
            t = ctx.world.allreduce(t, op=__import__("mpi4py").MPI.MAX)
            rows.append((op, mib, t, min(times), max(times)))
    if ctx.rank == 0:
        tag = f"min_chunk={os.environ.get('MKERNEL_COLL_MIN_CHUNK', 'default')} max_blocks={os.environ.get('MKERNEL_COLL_MAX_BLOCKS', 'default')}"
        for op, mib, t, lo, hi in rows:
            print(f"{tag} {op:15s} {mib:4d} MiB  median {t:8.1f} us  (min {lo:8.1f} max {hi:8.1f})")
    ctx.close()


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        sys.exit(print(__doc__))
    main()
