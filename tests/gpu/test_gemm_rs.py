"""GEMM + ReduceScatter against float64 numpy, on every rank of ``mpirun -np N python -m pytest``.

Every rank draws all ranks' A_r [M, K_r] and B_r from a generator seeded identically (fresh per test),
passes its own, and checks its rows of ``S = sum_r A_r @ B_r`` elementwise:

    |got - S| <= tol(out) * |S| + (tol(partial) + K_max * 2**-23) * (sum_r |A_r| @ |B_r|)

(tol = 2**-8 bf16, 2**-11 fp16, 2**-22 fp32: the final rounding to out's dtype, the rounding of each
partial sent in the partial dtype, fp32 accumulation over K).  Outputs are NaN-poisoned first, so an
unwritten element fails, and padded rows must stay NaN past N.

The tests also run with two ranks sharing one GPU (the kernels then take turns in time slices instead
of running side by side): the context's timeout is raised to 60 s for this module, and nothing here
depends on both ranks' kernels being resident at once.
"""
from __future__ import annotations

import numpy as np
import pytest
from cuda.bindings import driver as cu

import mkernel
from mkernel import GemmRsOptions
from mkernel.core.arrays import DeviceArray
from mkernel.core.driver import check

from _util import (capture, TOL, assert_missing_peer_times_out, download, poisoned, precompiled_with_long_timeout, upload,
                   written_outside)

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

SOURCE = "ops/gemm_rs.cu"


@pytest.fixture(scope="module", autouse=True)
def _setup(_contexts):
    yield from precompiled_with_long_timeout(_contexts, SOURCE)


def _split(M, P, m_sizes=None):
    if m_sizes is not None:
        return list(m_sizes)
    q, r = divmod(M, P)
    return [q + (1 if j < r else 0) for j in range(P)]


def _operands(rng, M, N, Ks, dtype, b_layout):
    """Every rank's A_r and B_r as float64 (same on every rank)."""
    As = [rng.standard_normal((M, K)) for K in Ks]
    Bs = [rng.standard_normal((K, N) if b_layout == "kn" else (N, K)) for K in Ks]
    return As, Bs


def _reference(As_exact, Bs_exact, b_layout):
    S = sum(a @ (b if b_layout == "kn" else b.T) for a, b in zip(As_exact, Bs_exact))
    scale = sum(np.abs(a) @ np.abs(b if b_layout == "kn" else b.T) for a, b in zip(As_exact, Bs_exact))
    return S, scale


def _check(got, ref, scale, out_dtype, partial_dtype, kmax, what):
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert not np.isnan(got).any(), f"{what}: NaN (unwritten?) at {np.argwhere(np.isnan(got))[:5].tolist()}"
    bound = TOL[out_dtype] * np.abs(ref) + (TOL[partial_dtype] + kmax * 2.0 ** -23) * scale + 1e-30
    bad = np.abs(got - ref) > bound
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} elements off; first at {list(i)}: got {got[i]}, "
                             f"want {ref[i]} (bound {bound[i]:.3e})")


def _run(ctx, rng, M, N, Ks=None, K=None, *, dtype="bfloat16", out_dtype=None, b_layout="kn", path=None,
         config=None, partial_dtype=None, m_sizes=None, pad_out=0, what=""):
    """One call against numpy; returns the plan.  Ks: every rank's K_r (default K on every rank);
    pad_out: out's rows that many elements longer than N (a strided view of a NaN buffer)."""
    P, me = ctx.local_size, ctx.local_rank
    Ks = list(Ks) if Ks is not None else [K] * P
    rows = _split(M, P, m_sizes)
    As, Bs = _operands(rng, M, N, Ks, dtype, b_layout)
    a, _ = upload(As[me], dtype)
    b, _ = upload(Bs[me], dtype)
    As_x = [upload(x, dtype)[1] for x in As]
    Bs_x = [upload(x, dtype)[1] for x in Bs]
    od = out_dtype or dtype
    buf = poisoned((rows[me], N + pad_out), od)
    out = DeviceArray(buf.ptr, (rows[me], N), od, (N + pad_out, 1), buf.device, buf) if pad_out else buf
    opts = GemmRsOptions(path=path, config=config, partial_dtype=partial_dtype,
                         m_sizes=tuple(m_sizes) if m_sizes is not None else None)
    res = mkernel.gemm_reduce_scatter(ctx, a, b, out, b_layout=b_layout, out_dtype=out_dtype, options=opts)
    ctx.synchronize()
    assert res is out
    plan = ctx.last_plan("gemm_rs")
    S, scale = _reference(As_x, Bs_x, b_layout)
    r0 = sum(rows[:me])
    h = download(buf)
    partial = plan.partial_dtype if plan.path == "fused" else od
    _check(h[:, :N], S[r0:r0 + rows[me]], scale[r0:r0 + rows[me]], od, partial, max(Ks), f"{what} ({plan})")
    if pad_out:
        assert not written_outside(h, rows[me], N), f"{what}: wrote past N into the row padding"
    return plan


# (name, M, N, K_r(r), b_layout, dtype, out dtype, path, extra)
CASES = [
    ("square-kn", 1024, 1024, lambda r: 512, "kn", "bfloat16", None, "fused", {}),
    ("square-nk", 1024, 1024, lambda r: 512, "nk", "bfloat16", None, "fused", {}),
    ("M-odd", 1001, 512, lambda r: 256, "kn", "bfloat16", None, "fused", {}),
    ("M-not-div-P-or-tile", 777, 264, lambda r: 200, "nk", "bfloat16", None, "fused", {}),
    ("K-not-64", 640, 384, lambda r: 136 + 8 * r, "kn", "bfloat16", None, "fused", {}),
    ("N-odd-multiple-of-8", 512, 1000, lambda r: 320, "nk", "bfloat16", None, "fused", {}),
    ("N-8", 384, 8, lambda r: 128, "kn", "bfloat16", None, "fused", {}),
    ("fp32-out", 768, 520, lambda r: 384, "kn", "bfloat16", "float32", "fused", {}),
    ("fp16", 600, 648, lambda r: 264, "nk", "float16", None, "fused", {}),
    ("fp16-fp32-out", 512, 392, lambda r: 512, "kn", "float16", "float32", "fused", {}),
    ("fp32-partials", 896, 768, lambda r: 1024, "nk", "bfloat16", None, "fused", {"partial_dtype": "float32"}),
    ("bf16-partials-fp32-out", 512, 512, lambda r: 640, "nk", "bfloat16", "float32", "fused",
     {"partial_dtype": "bfloat16"}),
    ("padded-out", 700, 328, lambda r: 192, "kn", "bfloat16", None, "fused", {"pad_out": 24}),
    ("one-row-each", None, 256, lambda r: 64, "kn", "bfloat16", None, "fused", {}),
    ("K-unaligned-staged", 512, 256, lambda r: 100, "nk", "bfloat16", None, "fused", {}),
    ("long-K", 256, 512, lambda r: 4096 + 64 * r, "nk", "bfloat16", None, "fused", {}),
    ("unfused-kn", 1000, 520, lambda r: 256, "kn", "bfloat16", None, "unfused", {}),
    ("unfused-fp32-out-nk", 512, 264, lambda r: 384, "nk", "float16", "float32", "unfused", {"pad_out": 8}),
    ("auto-large", 4096, 4096, lambda r: 2048, "nk", "bfloat16", None, None, {}),
    ("auto-few-tiles-long-K", 256, 256, lambda r: 16384, "kn", "bfloat16", None, None, {}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_shapes(ctx, shared_rng, case):
    name, M, N, kf, layout, dtype, out_dtype, path, extra = case
    P = ctx.local_size
    M = P if M is None else M
    plan = _run(ctx, shared_rng, M, N, Ks=[kf(r) for r in range(P)], dtype=dtype, out_dtype=out_dtype,
                b_layout=layout, path=path, what=name, **extra)
    if P == 1:
        assert plan.path == "gemm", plan
    elif path is not None:
        assert plan.path == path, plan


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("config", [1, 2, 3, 4, 5])
def test_every_fused_config(ctx, shared_rng, layout, config):
    """Every tile config of the fused kernel, rows and columns ending inside tiles."""
    plan = _run(ctx, shared_rng, 900 + 3 * ctx.local_size, 7 * 64 + 24, K=328, b_layout=layout, path="fused",
                config=config, what=f"config {config} {layout}")
    if ctx.local_size > 1:
        assert plan.path == "fused" and plan.config == config, plan


@pytest.mark.parametrize("path", ["fused", "unfused"])
def test_uneven_rows(ctx, shared_rng, path):
    """options.m_sizes: an uneven split with a rank that keeps no row at all."""
    P = ctx.local_size
    m_sizes = [0 if r == P - 1 and P > 1 else 130 + 70 * r for r in range(P)]
    plan = _run(ctx, shared_rng, sum(m_sizes), 392, K=256, b_layout="nk", path=path, m_sizes=m_sizes,
                what=f"m_sizes {m_sizes} {path}")
    if P > 1:
        assert plan.path == path and plan.m_sizes == tuple(m_sizes), plan


def test_deterministic_bits_over_50_runs(ctx, shared_rng):
    """deterministic=True: the same inputs give the same bits 50 times (the owner adds the peers' partials
    in a fixed order, whatever order they arrive in); deterministic=False runs the same fused kernel: same bits
    (one rank: the plain GEMM, whose default plan may split K and so is left out)."""
    P, me = ctx.local_size, ctx.local_rank
    M, N, K = 2048, 1536, 1024
    As, Bs = _operands(shared_rng, M, N, [K] * P, "bfloat16", "nk")
    a, _ = upload(As[me], "bfloat16")
    b, _ = upload(Bs[me], "bfloat16")
    outs = [DeviceArray.empty((_split(M, P)[me], N), "bfloat16") for _ in range(50)]
    for o in outs:
        mkernel.gemm_reduce_scatter(ctx, a, b, o, b_layout="nk", deterministic=True)
    other = DeviceArray.empty((_split(M, P)[me], N), "bfloat16")
    mkernel.gemm_reduce_scatter(ctx, a, b, other, b_layout="nk")
    ctx.synchronize()
    first = outs[0].to_numpy()
    for i, o in enumerate(outs[1:] + ([other] if P > 1 else [])):
        np.testing.assert_array_equal(o.to_numpy(), first, err_msg=f"run {i + 1} differs")
    plan = ctx.last_plan("gemm_rs")
    assert P == 1 or plan.path == "fused", plan


def test_back_to_back_1000_calls(ctx, shared_rng):
    """1000 calls with changing data and no host sync in between, alternating the fused kernel on two
    shapes (the workspace's control words stay put), fp32 partials, and the unfused path."""
    P, me = ctx.local_size, ctx.local_rank
    calls = 1000
    shapes = [(128, 64, 64), (96 + 8 * P, 136, 72), (128, 64, 64), (64, 128, 64)]  # (M, N, K) per mode
    modes = [dict(), dict(), dict(options=GemmRsOptions(partial_dtype="float32")),
             dict(options=GemmRsOptions(path="unfused"))]
    data = []
    for m, (M, N, K) in enumerate(shapes):
        n = len(range(m, calls, len(shapes)))
        A = shared_rng.standard_normal((P, n, M, K))
        B = shared_rng.standard_normal((P, n, K, N))
        a, _ = upload(A[me], "bfloat16")
        b, _ = upload(B[me], "bfloat16")
        Ax = np.stack([upload(A[r], "bfloat16")[1] for r in range(P)])
        Bx = np.stack([upload(B[r], "bfloat16")[1] for r in range(P)])
        out = poisoned((n, _split(M, P)[me], N), "bfloat16")
        data.append((a, b, Ax, Bx, out))
    for i in range(calls):
        m, j = i % len(shapes), i // len(shapes)
        a, b, _, _, out = data[m]
        mkernel.gemm_reduce_scatter(ctx, a[j], b[j], out[j], **modes[m])
    ctx.synchronize()
    for m, (M, N, K) in enumerate(shapes):
        _, _, Ax, Bx, out = data[m]
        h = download(out)
        r0, rows = sum(_split(M, P)[:me]), _split(M, P)[me]
        partial = "float32" if m == 2 else "bfloat16"
        for j in range(h.shape[0]):
            S, scale = _reference(list(Ax[:, j]), list(Bx[:, j]), "kn")
            _check(h[j], S[r0:r0 + rows], scale[r0:r0 + rows], "bfloat16", partial, K, f"call {j * 4 + m}")


def test_graph_capture_replay(ctx, shared_rng):
    """A fused and an unfused call captured in one CUDA graph, replayed 50 times with new inputs."""
    P, me = ctx.local_size, ctx.local_rank
    M, N, K = 512, 384, 256
    rows = _split(M, P)
    stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
    a = DeviceArray.empty((M, K), "bfloat16")
    b = DeviceArray.empty((N, K), "bfloat16")
    o1 = DeviceArray.empty((rows[me], N), "bfloat16")
    o2 = DeviceArray.empty((rows[me], N), "float32")

    def calls(s):
        mkernel.gemm_reduce_scatter(ctx, a, b, o1, b_layout="nk", stream=s, options=GemmRsOptions(path="fused"))
        mkernel.gemm_reduce_scatter(ctx, a, b, o2, b_layout="nk", stream=s, out_dtype="float32",
                                    options=GemmRsOptions(path="unfused"))

    calls(stream)  # outside the capture: agreement, workspaces, plans
    ctx.synchronize(stream)
    graph = capture(stream, lambda: calls(int(stream)))
    gexec = check(cu.cuGraphInstantiate(graph, 0))
    for rep in range(50):
        As, Bs = _operands(shared_rng, M, N, [K] * P, "bfloat16", "nk")
        src_a, _ = upload(As[me], "bfloat16")
        src_b, _ = upload(Bs[me], "bfloat16")
        a.copy_from(src_a, stream=stream)
        b.copy_from(src_b, stream=stream)
        o1.fill_nan(stream=stream)
        o2.fill_nan(stream=stream)
        check(cu.cuGraphLaunch(gexec, stream))
        ctx.synchronize(stream)
        S, scale = _reference([upload(x, "bfloat16")[1] for x in As], [upload(x, "bfloat16")[1] for x in Bs], "nk")
        r0 = sum(rows[:me])
        _check(download(o1), S[r0:r0 + rows[me]], scale[r0:r0 + rows[me]], "bfloat16", "bfloat16", K,
               f"replay {rep} fused")
        _check(download(o2), S[r0:r0 + rows[me]], scale[r0:r0 + rows[me]], "float32", "float32", K,
               f"replay {rep} unfused")
    check(cu.cuGraphExecDestroy(gexec))
    check(cu.cuGraphDestroy(graph))
    check(cu.cuStreamDestroy(stream))


def test_repeated_calls_repoint(ctx, shared_rng):
    """The same layout with new arrays every call (out=None: a fresh output each time) re-points the bound
    launch: right results every call."""
    P, me = ctx.local_size, ctx.local_rank
    M, N, K = 640, 320, 192
    for it in range(4):
        As, Bs = _operands(shared_rng, M, N, [K] * P, "bfloat16", "kn")
        a, _ = upload(As[me], "bfloat16")
        b, _ = upload(Bs[me], "bfloat16")
        out = mkernel.gemm_reduce_scatter(ctx, a, b)
        ctx.synchronize()
        S, scale = _reference([upload(x, "bfloat16")[1] for x in As], [upload(x, "bfloat16")[1] for x in Bs], "kn")
        r0, rows = sum(_split(M, P)[:me]), _split(M, P)[me]
        _check(download(out), S[r0:r0 + rows], scale[r0:r0 + rows], "bfloat16", "bfloat16", K, f"call {it}")


def test_bad_inputs_raise_before_launch(ctx):
    P = ctx.local_size
    a = DeviceArray.empty((64 * P, 64), "bfloat16")
    b = DeviceArray.empty((64, 48), "bfloat16")
    out = poisoned((64, 48), "bfloat16")
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        mkernel.gemm_reduce_scatter(ctx, DeviceArray.empty((64, 64), "float32"), b)
    with pytest.raises(TypeError, match="must match"):
        mkernel.gemm_reduce_scatter(ctx, a, DeviceArray.empty((64, 48), "float16"), out)
    with pytest.raises(ValueError, match="K differs"):
        mkernel.gemm_reduce_scatter(ctx, a, DeviceArray.empty((48, 64), "bfloat16"), out)
    with pytest.raises(ValueError, match="out overlaps a"):
        mkernel.gemm_reduce_scatter(ctx, a, b, DeviceArray(a.ptr, (64, 48), "bfloat16", None, a.device, a))
    with pytest.raises(ValueError, match="read-only"):
        mkernel.gemm_reduce_scatter(ctx, a, b, DeviceArray(out.ptr, (64, 48), "bfloat16", None, out.device, out,
                                                           readonly=True))
    with pytest.raises(ValueError, match="m_sizes"):
        mkernel.gemm_reduce_scatter(ctx, a, b, out, options=GemmRsOptions(m_sizes=(1,) * (P + 1)))
    with pytest.raises(ValueError, match="out must have shape"):
        mkernel.gemm_reduce_scatter(ctx, a, b, poisoned((65, 48), "bfloat16"))
    if P > 1:  # ranks disagree on N (a call no rank made before): every rank raises
        n = 48 + 8 * ctx.local_rank
        with pytest.raises(ValueError, match="disagree"):
            mkernel.gemm_reduce_scatter(ctx, a, DeviceArray.empty((64, n), "bfloat16"))
    ctx.synchronize()
    assert np.isnan(download(out)).all(), "a failing call launched something"


def test_zzz_missing_peer_times_out(ctx):
    """A rank that never makes the call: the other raises CommTimeout (op gemm_rs, naming the peer)."""
    if ctx.local_size < 2:
        pytest.skip("needs 2 ranks")
    P = ctx.local_size
    a, _ = upload(np.ones((256 * P, 128)), "bfloat16")
    b, _ = upload(np.ones((128, 256)), "bfloat16")
    out = DeviceArray.empty((256, 256), "bfloat16")
    opts = GemmRsOptions(path="fused")
    assert_missing_peer_times_out(lambda c2: mkernel.gemm_reduce_scatter(c2, a, b, out, options=opts), "gemm_rs")


def test_zzz_mismatched_call_after_agreement(ctx):
    """Two calls agreed on earlier (the host exchanges nothing more), then rank 0 repeats one while rank 1
    makes the other: every rank raises CommMismatch naming the other, from the call signatures the ranks
    announce on the device before any partial is pushed."""
    if ctx.local_size != 2:
        pytest.skip("needs exactly 2 ranks")
    from mpi4py import MPI

    c2 = mkernel.init(MPI.COMM_WORLD.Dup(), timeout=5.0)
    opts = GemmRsOptions(path="fused")
    b, _ = upload(np.ones((128, 256)), "bfloat16")
    shards = {m: upload(np.ones((m, 128)), "bfloat16")[0] for m in (512, 768)}
    for m, a in shards.items():
        mkernel.gemm_reduce_scatter(c2, a, b, options=opts)
    c2.synchronize()
    c2.world.Barrier()
    m = 512 if c2.rank == 0 else 768
    mkernel.gemm_reduce_scatter(c2, shards[m], b, options=opts)
    with pytest.raises(mkernel.CommMismatch) as ei:
        c2.synchronize()
    rec = ei.value.record
    assert rec["op"] == "gemm_rs" and rec["rank"] == c2.rank and rec["peer"] == 1 - c2.rank, rec
    c2.world.Barrier()
