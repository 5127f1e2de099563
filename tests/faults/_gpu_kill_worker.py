"""One rank of the GPU kill scenario under mpirun (not collected: no test_ functions).

    python tests/faults/_gpu_kill_worker.py OP OUTDIR

Started by tests/faults/test_gpu_kill.py.  Every rank makes one warm-up call of OP (compile, agreement,
workspaces) and synchronizes; then the last rank (the victim) launches the next call -- its kernel is
now waiting for its peers on the device -- writes ``OUTDIR/victim.pid`` and sleeps until the harness
kills it (SIGKILL).  The others wait for that file, then make up to three calls of OP, each followed by
``ctx.synchronize()``: the first may still complete on what the victim pushed before it died; a later
one must raise.  Each rank logs what it saw to ``OUTDIR/rank<r>.json`` (the shared Log of
_mpi_worker.py) and leaves with ``os._exit`` (MPI_Finalize could wait for the dead rank).
"""
from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mpi4py import MPI  # noqa: E402

from _mpi_worker import Log, become_victim, leave, wait_for_victim  # noqa: E402

import numpy as np  # noqa: E402

import mkernel  # noqa: E402
from mkernel.core.arrays import DeviceArray  # noqa: E402

TIMEOUT = float(os.environ.get("MK_KILL_TIMEOUT", "2.0"))  # the context timeout of the scenario


def _arr(shape, dtype, rng):
    x = rng.standard_normal(shape).astype(np.float32)
    return DeviceArray.from_numpy(x, dtype=dtype) if dtype == "bfloat16" else DeviceArray.from_numpy(x)


def make_call(op: str, ctx, rng):
    """A callable making one call of ``op`` (a name of test_gpu_kill.OPS) on fixed arrays."""
    P = ctx.size
    if op in ("all_reduce_sm", "internode_all_reduce"):
        x = _arr((1 << 16) + 3, "float32", rng)
        return lambda: mkernel.all_reduce(ctx, x)
    if op == "all_gather_ce":
        x = _arr((1 << 20) + 5, "float32", rng)
        opts = mkernel.CollectiveOptions(copy_engines=True)
        return lambda: mkernel.all_gather(ctx, x, options=opts)
    if op == "ag_gemm":
        a, b = _arr((1000 + 3 * ctx.rank, 1024), "bfloat16", rng), _arr((1024, 2000), "bfloat16", rng)
        return lambda: mkernel.ag_gemm(ctx, a, b)
    if op == "gemm_rs":
        a, b = _arr((512 * P, 512), "bfloat16", rng), _arr((512, 1024), "bfloat16", rng)
        return lambda: mkernel.gemm_reduce_scatter(ctx, a, b)
    raise ValueError(op)


def main():
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # (MPICH's hydra: a rank died; we find out ourselves)
    op, out = sys.argv[1], Path(sys.argv[2])
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    log = Log(out, rank)
    rc = 0
    try:
        ctx = mkernel.init(MPI.COMM_WORLD, timeout=TIMEOUT)
        call = make_call(op, ctx, np.random.default_rng(rank))
        call()
        ctx.synchronize()
        MPI.COMM_WORLD.Barrier()
        if rank == size - 1:
            # its kernel now waits for the peers.  The result stays referenced until the kill: dropping it
            # frees the output, and cuMemFree waits for the device -- for this very kernel, which would
            # then time out before the victim got ready, and the victim would die after its kernel.
            pending = call()  # noqa: F841
            time.sleep(0.2)
            become_victim(out)
        wait_for_victim(out)
        for i in range(3):
            # Log.attempt returns the exception when fn raised, fn's value (here a tuple) when it returned:
            # only an exception ends the calls (a call completing on the victim's last pushes goes on)
            e = log.attempt(f"call{i}", lambda: (call(), ctx.synchronize()))
            if isinstance(e, Exception):
                break
        log.attempt("close", ctx.close)
        log.add("done")
    except Exception as exc:  # noqa: BLE001
        log.add("crashed", exc, tb=traceback.format_exc())
        rc = 1
    leave(out, rank, list(range(size - 1)), rc)


if __name__ == "__main__":
    main()
