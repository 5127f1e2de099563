"""Collectives against float64 numpy references, on every rank of ``mpirun -np N python -m pytest``.

Every rank draws all ranks' inputs from a generator seeded identically (fresh per test), uses its
own, and checks the result against the reference computed from all of them.
"""
from __future__ import annotations


import numpy as np
import pytest
from cuda.bindings import driver as cu

import mkernel
from mkernel.core.arrays import DeviceArray
from mkernel.core.driver import check

from _util import (capture, assert_close, assert_missing_peer_times_out, check_all_reduce, download, on_other_device,
                   poison_workspace_tail, poisoned, upload)

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

DTYPES = ["bfloat16", "float16", "float32"]


def _sizes(rng, count=20):
    fixed = [1, 7, 8, 33, 1000, 4097, 65536 + 3, 1 << 20]
    rand = rng.integers(1, 1_200_000, size=count - len(fixed)).tolist()
    return fixed + rand


def _graph_replay(ctx, rng, n: int, reps: int, what: str) -> None:
    """Capture all_reduce + all_gather of n float32 in a CUDA graph (after a first call outside the
    capture: plan + workspace), replay it ``reps`` times with new inputs, check every replay."""
    P, me = ctx.local_size, ctx.local_rank
    stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
    x = DeviceArray.empty((n,), "float32")
    ar = DeviceArray.empty((n,), "float32")
    ag = DeviceArray.empty((P * n,), "float32")
    x.copy_from(upload(np.zeros(n) + 1.0, "float32")[0])
    mkernel.all_reduce(ctx, x, ar, stream=stream)
    mkernel.all_gather(ctx, x, ag, stream=stream)
    ctx.synchronize(stream)
    graph = capture(stream, lambda: (mkernel.all_reduce(ctx, x, ar, stream=int(stream)),
                                     mkernel.all_gather(ctx, x, ag, stream=int(stream))))
    gexec = check(cu.cuGraphInstantiate(graph, 0))
    host = np.empty(n, dtype=np.float32)
    for rep in range(reps):
        xs = rng.standard_normal((P, n)).astype(np.float32)
        host[:] = xs[me]
        check(cu.cuMemcpyHtoDAsync(x.ptr, host.ctypes.data, host.nbytes, stream))
        ar.fill_nan(stream=stream)
        ag.fill_nan(stream=stream)
        check(cu.cuGraphLaunch(gexec, stream))
        ctx.synchronize(stream)
        ref = xs.astype(np.float64)
        assert_close(download(ar), ref.sum(0), "float32", np.abs(ref).sum(0) * 1e-3, f"{what} {rep}")
        np.testing.assert_array_equal(download(ag), ref.reshape(-1), err_msg=f"{what} {rep}")
    check(cu.cuGraphExecDestroy(gexec))
    check(cu.cuGraphDestroy(graph))
    check(cu.cuStreamDestroy(stream))


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather_sizes(ctx, shared_rng, dtype):
    P, me = ctx.local_size, ctx.local_rank
    for n in _sizes(shared_rng):
        xs = [shared_rng.standard_normal(n) for _ in range(P)]
        x, exact = upload(xs[me], dtype)
        refs = [upload(v, dtype)[1] for v in xs]
        out = poisoned((P * n,), dtype)
        mkernel.all_gather(ctx, x, out)
        ctx.synchronize()
        got = download(out)
        np.testing.assert_array_equal(got, np.concatenate(refs), err_msg=f"all_gather n={n} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter_sizes(ctx, shared_rng, dtype):
    P, me = ctx.local_size, ctx.local_rank
    for n in _sizes(shared_rng):
        xs = [shared_rng.standard_normal(P * n) for _ in range(P)]
        exacts = [upload(v, dtype)[1] for v in xs]
        x, _ = upload(xs[me], dtype)
        out = poisoned((n,), dtype)
        mkernel.reduce_scatter(ctx, x, out)
        ctx.synchronize()
        ref = sum(exacts)[me * n:(me + 1) * n]
        scale = sum(np.abs(e) for e in exacts)[me * n:(me + 1) * n] * 1e-3
        assert_close(download(out), ref, dtype, scale, f"reduce_scatter n={n} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_sizes(ctx, shared_rng, dtype):
    for n in _sizes(shared_rng):
        check_all_reduce(ctx, ctx.node_comm, shared_rng, n, dtype, "all_reduce")


def test_all_reduce_two_phase(ctx, mkenv, shared_rng, monkeypatch):
    """The SM path's reduce-scatter + all-gather all-reduce (2 ranks take it only above 32 MiB: forced
    here from 256 KiB), out of place and in place, bit-identical on every rank."""
    mkenv("MKERNEL_COLL_ONE_SHOT_MAX_BYTES", 256 * 1024)
    mkenv("MKERNEL_COLL_CE", "0")
    for dtype, n in [("bfloat16", 131072 + 1), ("float16", 1_000_003), ("float32", 2_500_000)]:
        check_all_reduce(ctx, ctx.node_comm, shared_rng, n, dtype, "two-phase", in_place=True)


def _sm_data_off(ctx, op: str, n: int, itemsize: int) -> int:
    """Where the SM path's receive slots begin for ``op`` on ``n`` elements (x's size; all_gather and
    all_reduce) or ``n`` output elements (reduce_scatter)."""
    from mkernel.ops.collectives import CollectiveOptions
    from mkernel.ops.collectives import layout as LY

    P = ctx.local_size
    o = CollectiveOptions.default()
    grid_max = min(ctx.resident_sms, o.max_blocks) if o.max_blocks > 0 else ctx.resident_sms
    phases = 1
    slot = n * itemsize
    if op == "all_reduce" and not LY.one_shot(n * itemsize, P, o):
        slot, phases = LY.shard_elems(n, P, itemsize) * itemsize, 2
    return LY.sm_layout(P, slot, grid_max, phases, o.min_chunk)[0].data0_off


def test_stale_slot_bytes_are_never_flags(ctx, mkenv, shared_rng, monkeypatch):
    """Every call of an op shares its workspace, so bytes a call left in its receive slots must never
    read as a later call's ready flag, whatever the sizes: the control words sit at offsets of P only
    (mkernel.collectives MAX_CHUNKS).  Before every call each rank fills the op's workspace from the
    previous call's first slot byte to the end with 0xFF (as a flag: raised for any call).  SM path,
    float32, sizes of 3 KiB to 32 MiB whose chunk counts differ (2 to 2 x #SMs: once, flag regions that
    grew past the 4 KiB boundary where a smaller call's slots had begun); the all-reduce two-phase from
    256 KiB so that both phases' flags are in use.  (Whether a misplaced flag shows depends on timing:
    the block that meets it has just waited for a real flag of the same peer, whose push of the
    chunk is then under way; the deterministic guard is tests/cpu
    test_control_words_do_not_move_with_the_size.)"""
    P, me = ctx.local_size, ctx.local_rank
    if P < 2:
        pytest.skip("needs 2 or more local ranks")
    mkenv("MKERNEL_COLL_CE", "0")
    mkenv("MKERNEL_COLL_ONE_SHOT_MAX_BYTES", 256 * 1024)
    prev = {}
    for n in [(8 << 20) + 3, 4096, (8 << 20) + 3, (3 << 20) + 5, 777, 8 << 20]:
        xs = shared_rng.standard_normal((P, n)).astype(np.float32)
        x, _ = upload(xs[me], "float32")
        ref = xs.astype(np.float64)
        scale = np.abs(ref).sum(0) * 1e-3
        m = max(1, n // P)
        for op in ("all_gather", "reduce_scatter", "all_reduce"):
            if op in prev:
                poison_workspace_tail(ctx, ctx._workspaces[("collective", op)], prev[op])
            what = f"{op} n={n}"
            if op == "all_gather":
                out = poisoned((P * n,), "float32")
                mkernel.all_gather(ctx, x, out)
                ctx.synchronize()
                np.testing.assert_array_equal(download(out), ref.reshape(-1), err_msg=what)
                prev[op] = _sm_data_off(ctx, op, n, 4)
            elif op == "reduce_scatter":
                out = poisoned((m,), "float32")
                mkernel.reduce_scatter(ctx, x[:P * m], out)
                ctx.synchronize()
                assert_close(download(out), ref[:, me * m:(me + 1) * m].sum(0), "float32",
                             scale[me * m:(me + 1) * m], what)
                prev[op] = _sm_data_off(ctx, op, m, 4)
            else:
                out = poisoned((n,), "float32")
                mkernel.all_reduce(ctx, x, out)
                ctx.synchronize()
                assert_close(download(out), ref.sum(0), "float32", scale, what)
                prev[op] = _sm_data_off(ctx, op, n, 4)


def test_all_reduce_in_place_and_2d(ctx, shared_rng):
    P, me = ctx.local_size, ctx.local_rank
    for shape in [(3, 5), (1023, 77), (4096, 1024)]:
        xs = [shared_rng.standard_normal(shape) for _ in range(P)]
        exacts = [upload(v, "float32")[1] for v in xs]
        x, _ = upload(xs[me], "float32")
        mkernel.all_reduce(ctx, x, x)
        ctx.synchronize()
        assert_close(download(x), sum(exacts), "float32", sum(np.abs(e) for e in exacts) * 1e-3, f"in place {shape}")


def test_all_gather_int_and_rows(ctx, shared_rng):
    P, me = ctx.local_size, ctx.local_rank
    for dtype, shape in [("int32", (17, 3)), ("int64", (5,)), ("bfloat16", (129, 64))]:
        xs = [shared_rng.standard_normal(shape) for _ in range(P)]
        x, _ = upload(xs[me], dtype)
        out = mkernel.all_gather(ctx, x)
        ctx.synchronize()
        assert tuple(out.shape) == (P * shape[0],) + shape[1:]
        np.testing.assert_array_equal(download(out), np.concatenate([upload(v, dtype)[1] for v in xs]))


def _mixed_back_to_back(ctx, rng, calls: int, n: int, dtype: str, rel: float, what: str) -> None:
    """``calls`` all-reduce / all-gather / reduce-scatter calls in turn with changing data and no host
    sync in between; all checked at the end (tolerance ``rel`` of the sum of magnitudes)."""
    P, me = ctx.local_size, ctx.local_rank
    xs = rng.standard_normal((P, calls, n))
    exacts = np.stack([upload(xs[r], dtype)[1] for r in range(P)])
    x, _ = upload(xs[me], dtype)
    ar = poisoned((calls, n), dtype)
    ag = poisoned((calls, P * n), dtype)
    rs_n = n // P
    rs = poisoned((calls, rs_n), dtype)
    for i in range(calls):
        op = i % 3
        if op == 0:
            mkernel.all_reduce(ctx, x[i], ar[i])
        elif op == 1:
            mkernel.all_gather(ctx, x[i], ag[i])
        else:
            mkernel.reduce_scatter(ctx, x[i][: rs_n * P], rs[i])
    ctx.synchronize()
    h_ar, h_ag, h_rs = download(ar), download(ag), download(rs)
    total = exacts.sum(axis=0)
    scale = np.abs(exacts).sum(axis=0) * rel
    sl = slice(me * rs_n, (me + 1) * rs_n)
    for i in range(calls):
        if i % 3 == 0:
            assert_close(h_ar[i], total[i], dtype, scale[i], f"{what} call {i}")
        elif i % 3 == 1:
            np.testing.assert_array_equal(h_ag[i], exacts[:, i, :].reshape(-1), err_msg=f"{what} call {i}")
        else:
            assert_close(h_rs[i], total[i][sl], dtype, scale[i][sl], f"{what} call {i}")


def test_back_to_back_1000_calls(ctx, shared_rng):
    """1000 calls with changing data and no host sync in between; all checked at the end."""
    _mixed_back_to_back(ctx, shared_rng, 1000, 3000, "float32", 1e-3, "")


def test_graph_capture_replay(ctx, shared_rng):
    """Capture all_reduce + all_gather in a CUDA graph, replay 100 times with new inputs each time."""
    _graph_replay(ctx, shared_rng, 50_000, 100, "replay")


def _ce_sizes(rng):
    """Odd and round sizes, tiny to several copy-engine chunks (2 MiB+) per peer."""
    return [1, 7, 33, 4097, 65536 + 3, 1 << 20, 3_000_001] + rng.integers(1, 2_500_000, size=3).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_engine_path(ctx, mkenv, shared_rng, monkeypatch, dtype):
    """The copy-engine path (MKERNEL_COLL_CE=1 forces it at every size): all-gather, reduce-scatter,
    all-reduce (out of place and in place) against float64 references; all-reduce bit-identical on
    every rank."""
    mkenv("MKERNEL_COLL_CE", "1")
    P, me = ctx.local_size, ctx.local_rank
    for n in _ce_sizes(shared_rng):
        xs = [shared_rng.standard_normal(n) for _ in range(P)]
        exacts = [upload(v, dtype)[1] for v in xs]
        x, _ = upload(xs[me], dtype)
        ag = poisoned((P * n,), dtype)
        mkernel.all_gather(ctx, x, ag)
        ar = poisoned((n,), dtype)
        mkernel.all_reduce(ctx, x, ar)
        m = max(1, n // P)
        rs = poisoned((m,), dtype)
        ys = [shared_rng.standard_normal(P * m) for _ in range(P)]
        yex = [upload(v, dtype)[1] for v in ys]
        y, _ = upload(ys[me], dtype)
        mkernel.reduce_scatter(ctx, y, rs)
        ctx.synchronize()
        np.testing.assert_array_equal(download(ag), np.concatenate(exacts), err_msg=f"CE all_gather n={n} {dtype}")
        got = download(ar)
        assert_close(got, sum(exacts), dtype, sum(np.abs(e) for e in exacts) * 1e-3, f"CE all_reduce n={n} {dtype}")
        for g in ctx.node_comm.allgather(got):
            np.testing.assert_array_equal(g, got)
        sl = slice(me * m, (me + 1) * m)
        assert_close(download(rs), sum(yex)[sl], dtype, sum(np.abs(e) for e in yex)[sl] * 1e-3,
                     f"CE reduce_scatter n={m} {dtype}")
        mkernel.all_reduce(ctx, x, x)  # in place
        ctx.synchronize()
        assert_close(download(x), sum(exacts), dtype, sum(np.abs(e) for e in exacts) * 1e-3, f"CE in place n={n}")


def test_copy_engine_all_reduce_two_phase(ctx, mkenv, shared_rng, monkeypatch):
    """The copy-engine all-reduce as reduce-scatter + all-gather (the choice above 2 ranks; forced
    here), out of place and in place, bit-identical on every rank."""
    from mkernel.ops.collectives import api as collectives

    mkenv("MKERNEL_COLL_CE", "1")
    monkeypatch.setattr(collectives, "CE_ONE_SHOT_MAX_RANKS", 1)
    for dtype, n in [("bfloat16", 65536 + 3), ("float32", 1 << 20), ("float16", 5_000_017)]:
        check_all_reduce(ctx, ctx.node_comm, shared_rng, n, dtype, "CE two-phase", in_place=True)


def test_copy_engine_back_to_back_and_graph(ctx, mkenv, shared_rng, monkeypatch):
    """Copy-engine path: 300 mixed calls with changing data and no host sync, then a CUDA graph of an
    all-reduce + all-gather replayed 20 times with new inputs."""
    mkenv("MKERNEL_COLL_CE", "1")
    _mixed_back_to_back(ctx, shared_rng, 300, 40_000, "bfloat16", 1e-2, "CE")
    _graph_replay(ctx, shared_rng, 300_001, 20, "CE replay")


def test_copy_engine_all_gather_into_symmetric_out(ctx, mkenv, shared_rng, monkeypatch):
    """All-gather into a symmetric ``out`` on the copy-engine path (zero-copy: the peers' copy engines
    write straight into it): odd sizes, buffer offsets, in place; then 24 calls back to back on one
    stream, each result copied away right after its call -- a peer writing call i+1 into our ``out``
    before that copy ran would corrupt it (the begin kernel waits until every peer started the call);
    and a rank whose ``out`` is not symmetric while the other's is raises on every rank."""
    P, me = ctx.local_size, ctx.local_rank
    if P < 2:
        pytest.skip("the copy-engine path needs 2+ local ranks")
    mkenv("MKERNEL_COLL_CE", "1")
    buf = ctx.alloc_symmetric(64 << 20)
    try:
        for i, n in enumerate(_ce_sizes(shared_rng)):
            dtype = DTYPES[i % len(DTYPES)]
            itemsize = 2 if dtype != "float32" else 4
            off = (i * 4096 + 2 * itemsize * i) if P * n * itemsize + i * 4200 < (64 << 20) else 0
            xs = [shared_rng.standard_normal(n) for _ in range(P)]
            exact = np.concatenate([upload(v, dtype)[1] for v in xs])
            out = buf.array((P * n,), dtype, offset=off)
            out.fill_nan()
            x, _ = upload(xs[me], dtype)
            assert mkernel.all_gather(ctx, x, out) is out
            ctx.synchronize()
            np.testing.assert_array_equal(download(out), exact, err_msg=f"symmetric out n={n} {dtype} @{off}")
            out.fill_nan()  # in place: our rows of out are the input
            own = out[me * n:(me + 1) * n]
            own.copy_from(x)
            mkernel.all_gather(ctx, own, out)
            ctx.synchronize()
            np.testing.assert_array_equal(download(out), exact, err_msg=f"in place n={n} {dtype}")
        calls, n = 24, 3 << 20  # 6 MiB per rank: a copy-out long enough to race with
        stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
        xs = shared_rng.standard_normal((P, calls, n))
        exact = np.stack([upload(xs[r], "bfloat16")[1] for r in range(P)])  # [P, calls, n]
        x, _ = upload(xs[me], "bfloat16")
        out = buf.array((P * n,), "bfloat16")
        res = poisoned((calls, P * n), "bfloat16")
        ctx.synchronize()
        for i in range(calls):
            mkernel.all_gather(ctx, x[i], out, stream=int(stream))
            res[i].copy_from(out, stream=int(stream))
        ctx.synchronize(stream)
        got = download(res)
        for i in range(calls):
            np.testing.assert_array_equal(got[i], exact[:, i, :].reshape(-1), err_msg=f"back to back call {i}")
        check(cu.cuStreamDestroy(stream))
        x1, _ = upload(shared_rng.standard_normal(1000), "float32")
        plain = DeviceArray.empty((P * 1000,), "float32")
        mixed = buf.array((P * 1000,), "float32") if me == 0 else plain
        with pytest.raises(ValueError, match="disagree"):
            mkernel.all_gather(ctx, x1, mixed)
    finally:
        ctx.synchronize()
        buf.free()


def test_bad_inputs_raise_before_launch(ctx):
    P = ctx.local_size
    x = DeviceArray.empty((64,), "int32")
    with pytest.raises(TypeError, match="all_reduce: x must be bfloat16, float16 or float32, got int32"):
        mkernel.all_reduce(ctx, x)
    with pytest.raises(TypeError, match="host array"):
        mkernel.all_reduce(ctx, np.ones(4, dtype=np.float32))
    y = DeviceArray.empty((P * 4 + 1,), "float32")
    if P > 1:
        with pytest.raises(ValueError, match="multiple"):
            mkernel.reduce_scatter(ctx, y)
    z = DeviceArray.empty((8, 8), "float32")
    nc = DeviceArray(z.ptr, (8, 4), z.dtype, (8, 2), z.device, owner=z)
    with pytest.raises(ValueError, match="contiguous"):
        mkernel.all_reduce(ctx, nc)
    out = poisoned((3,), "float32")
    with pytest.raises(ValueError, match="out must be"):
        mkernel.all_reduce(ctx, DeviceArray.empty((4,), "float32"), out)
    w, other = on_other_device(ctx.device, (16,), "float32")
    if w is not None:
        with pytest.raises(ValueError, match=f"x is on cuda:{other}, expected cuda:{ctx.device}"):
            mkernel.all_reduce(ctx, w)
    # sizes that differ across ranks: every rank gets a clear error
    bad_out = None
    if ctx.size > 1:
        bad = DeviceArray.empty((100 + ctx.local_rank,), "float32")
        bad_out = poisoned(bad.shape, "float32")
        with pytest.raises(ValueError, match="disagree"):
            mkernel.all_reduce(ctx, bad, bad_out)
    ctx.synchronize()
    for o in (out, bad_out):  # nothing was launched
        assert o is None or np.isnan(download(o)).all(), "a failing call launched something"


def test_zzz_missing_peer_times_out(ctx):
    """A rank that never makes the call: the other raises CommTimeout within the timeout."""
    if ctx.local_size < 2:
        pytest.skip("needs 2 ranks")
    x = DeviceArray.empty((1 << 16,), "float32")
    x.copy_from(upload(np.ones(1 << 16), "float32")[0])
    assert_missing_peer_times_out(lambda c2: mkernel.all_reduce(c2, x), "all_reduce")


def test_zzz_missing_peer_times_out_copy_engines(ctx, mkenv, monkeypatch):
    """Copy-engine path: a rank that never makes the call -> CommTimeout on the other."""
    if ctx.local_size < 2:
        pytest.skip("needs 2 ranks")
    mkenv("MKERNEL_COLL_CE", "1")
    x = DeviceArray.empty((1 << 20,), "float32")
    x.copy_from(upload(np.ones(1 << 20), "float32")[0])
    assert_missing_peer_times_out(lambda c2: mkernel.all_reduce(c2, x), "all_reduce")


def test_first_call_inside_a_capture_raises_clearly(ctx):
    """A collective first called inside a CUDA-graph capture (its workspace does not exist yet: a
    collective allocation that synchronizes the device) raises a RuntimeError that says what to do,
    on every rank, before anything touches the capture -- which still ends cleanly."""
    from mpi4py import MPI

    c2 = mkernel.init(MPI.COMM_WORLD.Dup())  # a fresh context: no workspace yet
    x = upload(np.ones(4096), "float32")[0]
    stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
    check(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
    try:
        with pytest.raises(RuntimeError, match="before capturing"):
            mkernel.all_reduce(c2, x, stream=int(stream))
    finally:
        graph = check(cu.cuStreamEndCapture(stream))
    check(cu.cuGraphDestroy(graph))
    check(cu.cuStreamDestroy(stream))
    out = mkernel.all_reduce(c2, x)  # outside the capture: sets up and runs
    c2.synchronize()
    assert np.allclose(download(out), c2.local_size)


@pytest.mark.parametrize("path", ["sm", "ce"])
def test_zzz_mismatched_call_after_agreement(ctx, mkenv, monkeypatch, path):
    """Two sizes agreed on earlier (so the host exchanges nothing more), then rank 0 repeats one while
    rank 1 makes the other: every rank raises CommMismatch naming the other -- from the call
    signatures announced on the device -- before it reads anything a peer sent (the peers' rows of
    the output stay NaN).  sm: all-reduce on the SM path; ce: all-gather on the copy engines."""
    if ctx.local_size < 2:
        pytest.skip("needs 2 ranks")
    from mpi4py import MPI

    mkenv("MKERNEL_COLL_CE", "1" if path == "ce" else "0")
    op = mkernel.all_gather if path == "ce" else mkernel.all_reduce
    c2 = mkernel.init(MPI.COMM_WORLD.Dup(), timeout=2.0)
    a = upload(np.ones(1000 + 7), "float32")[0]
    b = upload(np.ones(3000 + 5), "float32")[0]
    op(c2, a)
    op(c2, b)
    c2.synchronize()
    c2.world.Barrier()
    x = a if c2.rank == 0 else b
    n = x.shape[0]
    out = poisoned((c2.local_size * n,) if path == "ce" else (n,), "float32")
    op(c2, x, out)
    with pytest.raises(mkernel.CommMismatch) as ei:
        c2.synchronize()
    rec = ei.value.record
    name = "all_gather" if path == "ce" else "all_reduce"
    assert rec["op"] == name and rec["rank"] == c2.rank and rec["peer"] == 1 - c2.rank, rec
    assert rec["expected"] != rec["seen"]
    got = download(out)
    if path == "ce":  # the own rows may be copied before the check; no peer's
        got = np.delete(got, np.s_[c2.local_rank * n:(c2.local_rank + 1) * n])
    assert np.isnan(got).all(), "a mismatched call read a peer's data"
    c2.world.Barrier()
