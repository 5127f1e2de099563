"""Multi-node collectives (NVLink inside a node, the CPU proxy across), checked against float64 numpy.

Run with emulated nodes, e.g. one GPU per node:
    MKERNEL_RANKS_PER_NODE=1 mpirun -np 2 python -m pytest -m "gpu and mpi and internode" tests/gpu
(tests/run_gpu.sh does).  Skipped when the context has a single node.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from cuda.bindings import driver as cu

import mkernel
from mkernel.core.arrays import DeviceArray
from mkernel.core.driver import check

from _util import capture, assert_close, check_all_reduce, download, poisoned, upload

pytestmark = [pytest.mark.gpu, pytest.mark.mpi, pytest.mark.internode]


@pytest.fixture
def mctx(ctx):
    if ctx.num_nodes < 2:
        pytest.skip("single node: run with MKERNEL_RANKS_PER_NODE to emulate nodes")
    return ctx


SIZES = [1, 7, 256, 1000, 4097, 65536 + 5, 333_333]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_internode_all_gather(mctx, shared_rng, dtype):
    P, me = mctx.size, mctx.rank
    for n in SIZES:
        xs = [shared_rng.standard_normal(n) for _ in range(P)]
        x, _ = upload(xs[me], dtype)
        out = poisoned((P * n,), dtype)
        mkernel.all_gather(mctx, x, out)
        mctx.synchronize()
        np.testing.assert_array_equal(download(out), np.concatenate([upload(v, dtype)[1] for v in xs]),
                                      err_msg=f"n={n}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_internode_reduce_scatter(mctx, shared_rng, dtype):
    P, me = mctx.size, mctx.rank
    for n in SIZES:
        xs = [shared_rng.standard_normal(P * n) for _ in range(P)]
        ex = [upload(v, dtype)[1] for v in xs]
        x, _ = upload(xs[me], dtype)
        out = poisoned((n,), dtype)
        mkernel.reduce_scatter(mctx, x, out)
        mctx.synchronize()
        sl = slice(me * n, (me + 1) * n)
        assert_close(download(out), sum(ex)[sl], dtype, sum(np.abs(e) for e in ex)[sl] * 1e-3, f"n={n}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_internode_all_reduce(mctx, shared_rng, dtype):
    for n in SIZES:
        check_all_reduce(mctx, mctx.world, shared_rng, n, dtype, "internode all_reduce")


def test_internode_back_to_back(mctx, shared_rng):
    """200 calls with changing data, no host sync in between, all checked at the end."""
    P, me = mctx.size, mctx.rank
    calls, n = 200, 1001
    xs = shared_rng.standard_normal((P, calls, P * n))
    ex = np.stack([upload(xs[r], "float32")[1] for r in range(P)])
    x, _ = upload(xs[me], "float32")
    ag = poisoned((calls, P * n), "float32")
    rs = poisoned((calls, n), "float32")
    for i in range(calls):
        if i % 2 == 0:
            mkernel.all_gather(mctx, x[i][:n], ag[i])
        else:
            mkernel.reduce_scatter(mctx, x[i], rs[i])
    mctx.synchronize()
    h_ag, h_rs = download(ag), download(rs)
    tot, sc = ex.sum(0), np.abs(ex).sum(0) * 1e-3
    sl = slice(me * n, (me + 1) * n)
    for i in range(calls):
        if i % 2 == 0:
            np.testing.assert_array_equal(h_ag[i], ex[:, i, :n].reshape(-1), err_msg=f"call {i}")
        else:
            assert_close(h_rs[i], tot[i][sl], "float32", sc[i][sl], f"call {i}")


def test_internode_graph_replay(mctx, shared_rng):
    P, me = mctx.size, mctx.rank
    n = 4099
    stream = check(cu.cuStreamCreate(1))
    x = DeviceArray.empty((n,), "float32")
    out = DeviceArray.empty((n,), "float32")
    host = np.empty(n, dtype=np.float32)
    host[:] = 1.0
    check(cu.cuMemcpyHtoD(x.ptr, host.ctypes.data, host.nbytes))
    mkernel.all_reduce(mctx, x, out, stream=int(stream))
    mctx.synchronize(int(stream))
    graph = capture(stream, lambda: mkernel.all_reduce(mctx, x, out, stream=int(stream)))
    gexec = check(cu.cuGraphInstantiate(graph, 0))
    for rep in range(20):
        xs = shared_rng.standard_normal((P, n)).astype(np.float32)
        host[:] = xs[me]
        check(cu.cuMemcpyHtoDAsync(x.ptr, host.ctypes.data, host.nbytes, stream))
        out.fill_nan(stream=int(stream))
        check(cu.cuGraphLaunch(gexec, stream))
        mctx.synchronize(int(stream))
        ref = xs.astype(np.float64)
        assert_close(download(out), ref.sum(0), "float32", np.abs(ref).sum(0) * 1e-3, f"replay {rep}")
    check(cu.cuGraphExecDestroy(gexec))
    check(cu.cuGraphDestroy(graph))


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_zzz_internode_mismatched_sizes_raise_comm_mismatch(mctx, op):
    """Two sizes agreed on earlier (the host exchanges nothing more), then rank 0 repeats one while the
    other ranks make the other: every rank raises CommMismatch -- from the call words announced through
    the proxy and over NVLink -- before it reads a slot a mismatched peer filled (no peer's data reaches
    the NaN-poisoned output).  Run with MKERNEL_RANKS_PER_NODE=1 (every peer across the proxy)."""
    from mpi4py import MPI

    c2 = mkernel.init(MPI.COMM_WORLD.Dup(), timeout=2.0)
    P, me = c2.size, c2.rank
    fn = getattr(mkernel, op)
    sizes = (1000 + 7, 3000 + 5)
    for n in sizes:
        x = upload(np.ones(n * (P if op == "reduce_scatter" else 1)), "float32")[0]
        fn(c2, x, poisoned((n * P,) if op == "all_gather" else (n,), "float32"))
    c2.synchronize()
    c2.world.Barrier()
    n = sizes[0] if me == 0 else sizes[1]
    x = upload(np.ones(n * (P if op == "reduce_scatter" else 1)), "float32")[0]
    out = poisoned((n * P,) if op == "all_gather" else (n,), "float32")
    fn(c2, x, out)
    with pytest.raises(mkernel.CommError) as ei:
        c2.synchronize()
    rec = ei.value.record
    assert rec["op"] == "internode_" + op and rec["rank"] == me, rec
    if P == 2 or me == 0:  # rank 0 differs from every peer; with 2 ranks each sees the other first
        assert isinstance(ei.value, mkernel.CommMismatch), ei.value
        assert rec["expected"] != rec["seen"] and rec["peer"] != me, rec
    got = download(out)
    if op == "all_gather":  # a rank's own shard may be copied before any check; no peer's
        got = np.delete(got, np.s_[me * n:(me + 1) * n])
    assert np.isnan(got).all(), "a mismatched call read a peer's data"
    c2.world.Barrier()


def test_zzz_internode_dead_rank_times_out(mctx):
    from mpi4py import MPI

    c2 = mkernel.init(MPI.COMM_WORLD.Dup(), timeout=1.0)
    x = DeviceArray.empty((4096,), "float32")
    x.fill_nan()
    y = DeviceArray.empty((4096 * c2.size,), "float32")
    mkernel.all_gather(c2, x, y)
    c2.synchronize()
    c2.world.Barrier()
    if c2.rank == 0:
        t0 = time.monotonic()
        mkernel.all_gather(c2, x, y)
        with pytest.raises(mkernel.CommTimeout) as ei:
            c2.synchronize()
        rec = ei.value.record
        assert rec["rank"] == 0 and rec["peer"] == 1 and rec["op"] == "internode_all_gather", rec
        assert time.monotonic() - t0 < 5.0
    c2.world.Barrier()
