"""Helpers for GPU tests: random inputs as device arrays with their exact float64 values."""
from __future__ import annotations

import numpy as np

from mkernel.core.arrays import DeviceArray
from mkernel.core.dtypes import bf16_to_f32, f32_to_bf16

TOL = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -22}


def host_values(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64 data to ``dtype`` and return (storage array, exact float64 values)."""
    if dtype == "bfloat16":
        bits = f32_to_bf16(x.astype(np.float32))
        return bits, bf16_to_f32(bits).astype(np.float64)
    if dtype in ("float16", "float32"):
        s = x.astype(dtype)
        return s, s.astype(np.float64)
    s = np.rint(x * 1000).astype(dtype)
    return s, s.astype(np.float64)


def seeded_rng(request, seed: int) -> np.random.Generator:
    """A generator seeded from the session's ``seed`` and the test's name (printed: rerun with it)."""
    s = (seed + sum(map(ord, request.node.name))) % (1 << 32)
    print(f"seed={s}")
    return np.random.default_rng(s)


def upload(x: np.ndarray, dtype: str):
    """(DeviceArray, float64 values) of ``x`` rounded to ``dtype``."""
    storage, exact = host_values(x, dtype)
    return DeviceArray.from_numpy(storage, dtype=dtype), exact


def download(a: DeviceArray) -> np.ndarray:
    """float64 values of a device array (bf16 decoded)."""
    h = a.to_numpy()
    if a.dtype.name == "bfloat16":
        return bf16_to_f32(h).astype(np.float64)
    return h.astype(np.float64)


def corner(buf: DeviceArray, rows: int, cols: int) -> DeviceArray:
    """The ``[rows, cols]`` top-left view of a 2-D buffer (its row stride: padded rows)."""
    return DeviceArray(buf.ptr, (rows, cols), buf.dtype.name, (buf.shape[1], 1), buf.device, buf)


def written_outside(h: np.ndarray, rows: int, cols: int) -> bool:
    """Whether a NaN-poisoned buffer's host copy ``h`` holds anything but NaN outside its ``[:rows, :cols]``
    corner (the row padding and the rows below)."""
    return not (np.isnan(h[:, cols:]).all() and np.isnan(h[rows:]).all())


def rel_fro(got: np.ndarray, ref: np.ndarray) -> float:
    """Relative Frobenius error ||got - ref|| / ||ref||; NaN (an unwritten element) fails at once."""
    assert not np.isnan(got).any(), f"NaN in output at {np.argwhere(np.isnan(got))[:5].tolist()}"
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def on_other_device(device: int, shape, dtype: str):
    """``(array, its device)`` allocated on the GPU after ``device`` (round robin), or ``(None, None)``
    with a single GPU (bad-input tests: an operand on the wrong device)."""
    from cuda.bindings import driver as cu

    from mkernel.core.driver import check

    ndev = check(cu.cuDeviceGetCount())
    if ndev < 2:
        return None, None
    other = (device + 1) % ndev
    check(cu.cuCtxPushCurrent(check(cu.cuDevicePrimaryCtxRetain(other))))
    try:
        return DeviceArray.empty(tuple(shape), dtype), other
    finally:
        check(cu.cuCtxPopCurrent())


def poisoned(shape, dtype: str) -> DeviceArray:
    a = DeviceArray.empty(tuple(shape), dtype)
    a.fill_nan()
    return a


def poison_workspace_tail(ctx, ws, offset: int) -> None:
    """Every rank fills its symmetric workspace ``ws`` from byte ``offset`` to the end with 0xFF --
    what a call of another size might leave in its data region; as a ready flag (u64 2**64 - 1) it
    reads as raised for any call.  Between calls: every rank's work is done before and after."""
    from cuda.bindings import driver as cu

    from mkernel.core.driver import check
    ctx.synchronize()
    ctx.world.Barrier()
    if offset < ws.nbytes:
        check(cu.cuMemsetD8(ws.ptr + offset, 0xFF, ws.nbytes - offset))
    ctx.synchronize()
    ctx.world.Barrier()


def assert_close(got: np.ndarray, ref: np.ndarray, dtype: str, scale: np.ndarray | None = None, what: str = ""):
    """|got - ref| <= tol(dtype) * (|ref| + scale) elementwise; NaN never passes."""
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert not np.isnan(got).any(), f"{what}: output has NaN (unwritten elements?) at {np.argwhere(np.isnan(got))[:5]}"
    s = np.abs(ref) + (scale if scale is not None else 0.0)
    bad = np.abs(got - ref) > TOL[dtype] * s + 1e-30
    if bad.any():
        i = np.argwhere(bad)[:5]
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} elements off; first at {i.tolist()}: "
                             f"got {got[tuple(i[0])]}, want {ref[tuple(i[0])]}")


def assert_missing_peer_times_out(call, op: str, peer: int = 1) -> None:
    """``call(c2)`` on a fresh context with a 1 s timeout: once on every rank (agreement, workspace),
    then on rank 0 alone.  Rank 0 must raise ``CommTimeout`` for ``op`` naming rank 0 and ``peer`` (the
    rank it waits for first), after waiting about the timeout (not less, and within 5 s)."""
    import time

    import pytest
    from mpi4py import MPI

    import mkernel

    c2 = mkernel.init(MPI.COMM_WORLD.Dup(), timeout=1.0)
    call(c2)
    c2.synchronize()
    c2.world.Barrier()
    try:
        if c2.rank == 0:
            t0 = time.monotonic()
            call(c2)
            with pytest.raises(mkernel.CommTimeout) as ei:
                c2.synchronize()
            dt = time.monotonic() - t0
            rec = ei.value.record
            assert rec["op"] == op and rec["rank"] == 0 and rec["peer"] == peer, rec
            assert 0.9 < dt < 5.0, (dt, rec)
            assert rec["waited_ns"] >= 1e9, rec
    finally:
        c2.world.Barrier()  # (also after a failure on rank 0: the other ranks wait here, the next test pairs up)



def check_all_reduce(ctx, comm, rng, n: int, dtype: str, what: str, in_place: bool = False):
    """mkernel.all_reduce over the ranks of ``comm`` (the communicator the call spans) of fresh random
    n-vectors into a NaN-poisoned out, against the float64 sum; every rank bit-identical; in_place:
    then once more with out = x, which must give the same bits."""
    import mkernel

    P, me = comm.Get_size(), comm.Get_rank()
    xs = [rng.standard_normal(n) for _ in range(P)]
    exacts = [upload(v, dtype)[1] for v in xs]
    x, _ = upload(xs[me], dtype)
    out = poisoned((n,), dtype)
    mkernel.all_reduce(ctx, x, out)
    ctx.synchronize()
    got = download(out)
    assert_close(got, sum(exacts), dtype, sum(np.abs(e) for e in exacts) * 1e-3, f"{what} n={n} {dtype}")
    for g in comm.allgather(got):  # every rank holds bit-identical results
        np.testing.assert_array_equal(g, got)
    if in_place:
        mkernel.all_reduce(ctx, x, x)
        ctx.synchronize()
        np.testing.assert_array_equal(download(x), got, err_msg=f"{what} in place n={n} {dtype}")


def precompiled_with_long_timeout(contexts, source: str, timeout: float = 60.0):
    """Generator for a module fixture taking ``_contexts`` (conftest.py): ``source``'s registered
    specializations compiled on local rank 0 (the other ranks load the cubins), and the context's timeout
    raised to ``timeout`` (ranks sharing a GPU wait for each other's time slices) until the fixture ends (a
    context replacing a failed one keeps the raised timeout)."""
    import os

    from mkernel.core.compiler import precompile_source

    timeout = float(os.environ.get("MK_TEST_LONG_TIMEOUT", timeout))  # (a shorter one for triage runs)
    ctx = contexts["ctx"]
    if ctx.local_rank == 0:
        try:
            precompile_source(source)
        except Exception as exc:  # noqa: BLE001  (kernels then compile lazily)
            print(f"precompile failed, compiling lazily: {exc!r}")
    ctx.world.Barrier()
    old = ctx.timeout
    ctx.timeout = max(old, timeout)
    yield
    contexts["ctx"].timeout = old


def capture(stream, body, mode: str = "thread_local"):
    """``body()`` captured on ``stream`` into a new CUDA graph (returned); the capture is ended even when
    ``body`` raises, so one failing test leaves no stream capturing behind it for the next."""
    from cuda.bindings import driver as cu
    from mkernel.core.driver import check

    m = {"thread_local": cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
         "global": cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL}[mode]
    s = cu.CUstream(int(stream))
    check(cu.cuStreamBeginCapture(s, m))
    try:
        body()
    except BaseException:
        err, g = cu.cuStreamEndCapture(s)
        if err == cu.CUresult.CUDA_SUCCESS and int(g):
            cu.cuGraphDestroy(g)
        raise
    return check(cu.cuStreamEndCapture(s))
