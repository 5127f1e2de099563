"""Out of device memory on one rank, with the real driver (docs/reliability.md; the CPU scenario with a fake
driver is tests/faults/test_mpi_faults.py::test_out_of_memory_on_one_rank_raises_memory_error_on_every_rank).

    mpirun -np 2 python -m pytest tests/gpu/test_oom.py

A symmetric allocation that only some ranks can make: every rank raises MemoryError naming the ranks
that ran out, promptly (well inside the context's timeout), no rank keeps memory, and the context stays
usable (a new allocation and an all-reduce pass).  Ranks with a GPU each: rank 1 first fills its GPU; ranks
sharing one GPU: each asks for 60 % of the free memory, so whichever allocates second runs out."""
from __future__ import annotations

import re
import time

import pytest
from cuda.bindings import driver as cu

from mkernel.core.driver import check

from _util import check_all_reduce

pytestmark = [pytest.mark.gpu, pytest.mark.mpi, pytest.mark.faults]

GiB = 1 << 30


def _free() -> int:
    free, _ = check(cu.cuMemGetInfo())
    return int(free)


def test_out_of_memory_on_one_rank_raises_memory_error_on_every_rank(ctx, shared_rng):
    if ctx.local_size < 2:
        pytest.skip("needs 2 ranks on the node")
    comm = ctx.node_comm
    ctx.synchronize()
    ballast = None
    if ctx.gpu_sharers > 1:
        nbytes = int(0.6 * min(comm.allgather(_free()))) // (2 << 20) * (2 << 20)
    else:
        nbytes = 4 * GiB
        if ctx.local_rank == 1:
            ballast = int(check(cu.cuMemAlloc(max(_free() - GiB, 1))))
    before = comm.allgather(_free())
    t0 = time.monotonic()
    with pytest.raises(MemoryError, match=r"out of device memory on (local )?ranks? [0-9].*no rank kept any of it") as ei:
        ctx.alloc_symmetric(nbytes)
    took = time.monotonic() - t0
    if ballast is not None:
        check(cu.cuMemFree(ballast))
    named = comm.allgather(re.sub(r" \(here: .*?\)", "", str(ei.value)))  # (the failing rank adds its error)
    assert len(set(named)) == 1, named  # every rank names the same ranks
    assert took < min(ctx.timeout, 10.0), took
    ctx.synchronize()
    after = comm.allgather(_free())
    for b, a in zip(before, after):
        if ballast is None:
            assert a >= b - 256 * (1 << 20), (before, after)  # nothing kept (the pool may round)
    buf = ctx.alloc_symmetric(1 << 20)
    buf.free()
    check_all_reduce(ctx, ctx.world, shared_rng, 4099, "float32", "after the out-of-memory")
