"""GEMM + AllReduce against float64 numpy, on every rank of ``mpirun -np N python -m pytest``.

Every rank draws all ranks' A_r [M, K_r] and B_r from a generator seeded identically (fresh per test),
passes its own, and checks the whole ``C = sum_r A_r @ B_r`` elementwise:

    |got - C| <= tol(out) * |C| + (tol(partial) + K_max * 2**-23) * (sum_r |A_r| @ |B_r|)

(tol = 2**-8 bf16, 2**-11 fp16, 2**-22 fp32: the final rounding to out's dtype, the rounding of each
partial sent in the partial dtype, fp32 accumulation over K) -- and that every rank's output is the same
bytes (allgathered and compared).  Outputs are NaN-poisoned first, so an unwritten element fails, and
padded rows must stay NaN past N.

The tests also run with two ranks sharing one GPU (the kernels then take turns in time slices instead of
running side by side): the context's timeout is raised to 60 s for this module, and nothing here depends on
both ranks' kernels being resident at once.
"""
from __future__ import annotations

import numpy as np
import pytest
from cuda.bindings import driver as cu

import mkernel
from mkernel import GemmArOptions
from mkernel.core.arrays import DeviceArray
from mkernel.core.driver import check

from _util import (capture, TOL, assert_missing_peer_times_out, download, poisoned, precompiled_with_long_timeout, upload,
                   written_outside)

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

SOURCE = "ops/gemm_ar.cu"


@pytest.fixture(scope="module", autouse=True)
def _setup(_contexts):
    yield from precompiled_with_long_timeout(_contexts, SOURCE)


def _operands(rng, M, N, Ks, b_layout):
    """Every rank's A_r and B_r as float64 (same on every rank)."""
    As = [rng.standard_normal((M, K)) for K in Ks]
    Bs = [rng.standard_normal((K, N) if b_layout == "kn" else (N, K)) for K in Ks]
    return As, Bs


def _reference(As_exact, Bs_exact, b_layout):
    C = sum(a @ (b if b_layout == "kn" else b.T) for a, b in zip(As_exact, Bs_exact))
    scale = sum(np.abs(a) @ np.abs(b if b_layout == "kn" else b.T) for a, b in zip(As_exact, Bs_exact))
    return C, scale


def _check(got, ref, scale, out_dtype, partial_dtype, kmax, what):
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert not np.isnan(got).any(), f"{what}: NaN (unwritten?) at {np.argwhere(np.isnan(got))[:5].tolist()}"
    bound = TOL[out_dtype] * np.abs(ref) + (TOL[partial_dtype] + kmax * 2.0 ** -23) * scale + 1e-30
    bad = np.abs(got - ref) > bound
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} elements off; first at {list(i)}: got {got[i]}, "
                             f"want {ref[i]} (bound {bound[i]:.3e})")


def _same_on_every_rank(ctx, out: DeviceArray, what: str) -> None:
    """Every rank's ``out`` holds the same bytes (allgathered and compared)."""
    raw = out.to_numpy().tobytes()
    allraw = ctx.world.allgather(raw)
    bad = [r for r, x in enumerate(allraw) if x != allraw[0]]
    assert not bad, f"{what}: ranks {bad} hold other bytes than rank 0"


def _run(ctx, rng, M, N, Ks=None, K=None, *, dtype="bfloat16", out_dtype=None, b_layout="kn", path=None,
         config=None, partial_dtype=None, transposed=True, pad_out=0, what=""):
    """One call against numpy, every rank's output compared; returns the plan.  Ks: every rank's K_r
    (default K on every rank); pad_out: out's rows that many elements longer than N (a strided view of a
    NaN buffer)."""
    P, me = ctx.local_size, ctx.local_rank
    Ks = list(Ks) if Ks is not None else [K] * P
    As, Bs = _operands(rng, M, N, Ks, b_layout)
    a, _ = upload(As[me], dtype)
    b, _ = upload(Bs[me], dtype)
    As_x = [upload(x, dtype)[1] for x in As]
    Bs_x = [upload(x, dtype)[1] for x in Bs]
    od = out_dtype or dtype
    buf = poisoned((M, N + pad_out), od)
    out = DeviceArray(buf.ptr, (M, N), od, (N + pad_out, 1), buf.device, buf) if pad_out else buf
    opts = GemmArOptions(path=path, config=config, partial_dtype=partial_dtype, transposed=transposed)
    res = mkernel.gemm_all_reduce(ctx, a, b, out, b_layout=b_layout, out_dtype=out_dtype, options=opts)
    ctx.synchronize()
    assert res is out
    plan = ctx.last_plan("gemm_ar")
    C, scale = _reference(As_x, Bs_x, b_layout)
    h = download(buf)
    partial = plan.partial_dtype if plan.path in ("latency", "bandwidth") else od
    _check(h[:, :N], C, scale, od, partial, max(Ks), f"{what} ({plan})")
    if pad_out:
        assert not written_outside(h, M, N), f"{what}: wrote past N into the row padding"
    _same_on_every_rank(ctx, buf, what)
    return plan


# (name, M, N, K_r(r), b_layout, dtype, out dtype, path, extra)
CASES = [
    ("M1-nk-decode", 1, 4096, lambda r: 512, "nk", "bfloat16", None, "latency", {}),
    ("M1-kn", 1, 2048, lambda r: 384, "kn", "bfloat16", None, "latency", {}),
    ("M3-nk-fp32-out-odd-N", 3, 1000, lambda r: 264, "nk", "bfloat16", "float32", "latency", {}),
    ("M17-nk-transposed-54", 17, 2056, lambda r: 200 + 8 * r, "nk", "bfloat16", None, "latency", {}),
    ("M32-kn-fp16", 32, 1536, lambda r: 320, "kn", "float16", None, "latency", {}),
    ("M100-nk-plain", 100, 1032, lambda r: 136 + 8 * r, "nk", "bfloat16", None, "latency", {}),
    ("M255-kn-fp32-partials", 255, 776, lambda r: 512, "kn", "bfloat16", None, "latency",
     {"partial_dtype": "float32"}),
    ("M257-fp16-fp32-out", 257, 648, lambda r: 264, "nk", "float16", "float32", None, {}),
    ("N8-latency", 40, 8, lambda r: 128, "kn", "bfloat16", None, "latency", {}),
    ("padded-out-latency", 64, 328, lambda r: 192, "kn", "bfloat16", None, "latency", {"pad_out": 24}),
    ("K-unaligned-staged-transposed", 16, 512, lambda r: 100, "nk", "bfloat16", None, "latency", {}),
    ("long-K-decode", 8, 512, lambda r: 4096 + 64 * r, "nk", "bfloat16", None, "latency", {}),
    ("decode-plain-tiles-nk", 8, 1024, lambda r: 256, "nk", "bfloat16", None, "latency", {"transposed": False}),
    ("M1001-bandwidth-kn", 1001, 1000, lambda r: 256, "kn", "bfloat16", None, "bandwidth", {}),
    ("M777-bandwidth-nk", 777, 264, lambda r: 200, "nk", "bfloat16", None, "bandwidth", {}),
    ("M2048-bandwidth-fp32-out", 2048, 520, lambda r: 384, "kn", "bfloat16", "float32", "bandwidth", {}),
    ("bandwidth-fp16", 600, 648, lambda r: 264 + 64 * r, "nk", "float16", None, "bandwidth", {}),
    ("bandwidth-fp32-partials", 896, 768, lambda r: 1024, "nk", "bfloat16", None, "bandwidth",
     {"partial_dtype": "float32"}),
    ("padded-out-bandwidth", 700, 328, lambda r: 192, "nk", "bfloat16", None, "bandwidth", {"pad_out": 24}),
    ("few-rows-bandwidth", 3, 1024, lambda r: 128, "kn", "bfloat16", None, "bandwidth", {}),
    ("unfused-kn", 1000, 520, lambda r: 256, "kn", "bfloat16", None, "unfused", {}),
    ("unfused-strided-fp32-out", 512, 264, lambda r: 384, "nk", "float16", "float32", "unfused", {"pad_out": 8}),
    ("auto-decode-llama-o", 8, 8192, lambda r: 4096, "nk", "bfloat16", None, None, {}),
    ("auto-large", 4096, 4096, lambda r: 2048, "nk", "bfloat16", None, None, {}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_shapes(ctx, shared_rng, case):
    name, M, N, kf, layout, dtype, out_dtype, path, extra = case
    P = ctx.local_size
    plan = _run(ctx, shared_rng, M, N, Ks=[kf(r) for r in range(P)], dtype=dtype, out_dtype=out_dtype,
                b_layout=layout, path=path, what=name, **extra)
    if P == 1:
        assert plan.path == "gemm", plan
    elif path is not None:
        assert plan.path == path, plan


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("config", [1, 2, 3, 4, 5])
def test_every_bandwidth_config(ctx, shared_rng, layout, config):
    """Every tile config of the bandwidth path, rows and columns ending inside tiles."""
    plan = _run(ctx, shared_rng, 900 + 3 * ctx.local_size, 7 * 64 + 24, K=328, b_layout=layout, path="bandwidth",
                config=config, what=f"bandwidth config {config} {layout}")
    if ctx.local_size > 1:
        assert plan.path == "bandwidth" and plan.config == config, plan


@pytest.mark.parametrize("layout,config,M", [("kn", 1, 70), ("nk", 1, 70), ("kn", 3, 200), ("nk", 3, 130),
                                             ("kn", 53, 5), ("nk", 53, 11), ("nk", 54, 29)])
def test_every_latency_config(ctx, shared_rng, layout, config, M):
    """Every tile config of the latency path (config 53 "nk" and 54: transposed)."""
    plan = _run(ctx, shared_rng, M, 9 * 64 + 40, K=264, b_layout=layout, path="latency", config=config,
                what=f"latency config {config} {layout} M={M}")
    if ctx.local_size > 1:
        assert plan.path == "latency" and plan.config == config, plan
        assert plan.transposed == (layout == "nk" and config in (53, 54)), plan


@pytest.mark.parametrize("path,M,layout", [("latency", 24, "nk"), ("latency", 96, "kn"), ("bandwidth", 2048, "nk")])
def test_deterministic_bits_over_50_runs(ctx, shared_rng, path, M, layout):
    """deterministic=True: the same inputs give the same bits 50 times (every sum in a fixed order, whatever
    order the partials arrive in); deterministic=False runs the same fused kernel: same bits (one rank: the
    plain GEMM, whose default plan may split K and so is left out)."""
    P, me = ctx.local_size, ctx.local_rank
    N, K = 1536, 1024
    As, Bs = _operands(shared_rng, M, N, [K] * P, layout)
    a, _ = upload(As[me], "bfloat16")
    b, _ = upload(Bs[me], "bfloat16")
    opts = GemmArOptions(path=path)
    outs = [DeviceArray.empty((M, N), "bfloat16") for _ in range(50)]
    for o in outs:
        mkernel.gemm_all_reduce(ctx, a, b, o, b_layout=layout, deterministic=True, options=opts)
    other = DeviceArray.empty((M, N), "bfloat16")
    mkernel.gemm_all_reduce(ctx, a, b, other, b_layout=layout, options=opts)
    ctx.synchronize()
    first = outs[0].to_numpy()
    for i, o in enumerate(outs[1:] + ([other] if P > 1 else [])):
        np.testing.assert_array_equal(o.to_numpy(), first, err_msg=f"run {i + 1} differs")
    _same_on_every_rank(ctx, outs[0], f"deterministic {path}")
    plan = ctx.last_plan("gemm_ar")
    assert P == 1 or plan.path == path, plan


def test_back_to_back_1000_calls(ctx, shared_rng):
    """1000 calls with changing data and no host sync in between, cycling through the latency path
    (transposed and plain tiles), the bandwidth path, fp32 partials and the unfused path (the workspace's
    control words stay put whatever the path)."""
    P, me = ctx.local_size, ctx.local_rank
    calls = 1000
    modes = [  # (M, N, K, layout, options)
        (8, 256, 128, "nk", GemmArOptions(path="latency")),
        (40, 192, 64, "kn", GemmArOptions(path="latency")),
        (136, 136, 72, "nk", GemmArOptions(path="bandwidth")),
        (16, 128, 64, "kn", GemmArOptions(path="latency", partial_dtype="float32")),
        (64, 128, 64, "kn", GemmArOptions(path="unfused")),
    ]
    data = []
    for m, (M, N, K, layout, _) in enumerate(modes):
        n = len(range(m, calls, len(modes)))
        A = shared_rng.standard_normal((P, n, M, K))
        B = shared_rng.standard_normal((P, n, K, N) if layout == "kn" else (P, n, N, K))
        a, _ = upload(A[me], "bfloat16")
        b, _ = upload(B[me], "bfloat16")
        Ax = np.stack([upload(A[r], "bfloat16")[1] for r in range(P)])
        Bx = np.stack([upload(B[r], "bfloat16")[1] for r in range(P)])
        out = poisoned((n, M, N), "bfloat16")
        data.append((a, b, Ax, Bx, out))
    for i in range(calls):
        m, j = i % len(modes), i // len(modes)
        a, b, _, _, out = data[m]
        mkernel.gemm_all_reduce(ctx, a[j], b[j], out[j], b_layout=modes[m][3], options=modes[m][4])
    ctx.synchronize()
    for m, (M, N, K, layout, opts) in enumerate(modes):
        _, _, Ax, Bx, out = data[m]
        h = download(out)
        partial = opts.partial_dtype or "bfloat16"
        for j in range(h.shape[0]):
            C, scale = _reference(list(Ax[:, j]), list(Bx[:, j]), layout)
            _check(h[j], C, scale, "bfloat16", partial, K, f"call {j * len(modes) + m}")
        _same_on_every_rank(ctx, out, f"1000 calls, mode {m}")


def test_graph_capture_replay(ctx, shared_rng):
    """A latency, a bandwidth and an unfused call captured in one CUDA graph, replayed 30 times with new
    inputs."""
    P, me = ctx.local_size, ctx.local_rank
    M, N, K = 512, 384, 256
    stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
    a = DeviceArray.empty((M, K), "bfloat16")
    b = DeviceArray.empty((N, K), "bfloat16")
    o1 = DeviceArray.empty((16, N), "bfloat16")
    o2 = DeviceArray.empty((M, N), "bfloat16")
    o3 = DeviceArray.empty((M, N), "float32")
    a16 = DeviceArray(a.ptr, (16, K), "bfloat16", None, a.device, a)  # (the first 16 rows: a decode call)

    def calls(s):
        mkernel.gemm_all_reduce(ctx, a16, b, o1, b_layout="nk", stream=s, options=GemmArOptions(path="latency"))
        mkernel.gemm_all_reduce(ctx, a, b, o2, b_layout="nk", stream=s, options=GemmArOptions(path="bandwidth"))
        mkernel.gemm_all_reduce(ctx, a, b, o3, b_layout="nk", stream=s, out_dtype="float32",
                                options=GemmArOptions(path="unfused"))

    calls(stream)  # outside the capture: agreement, workspaces, plans
    ctx.synchronize(stream)
    graph = capture(stream, lambda: calls(int(stream)))
    gexec = check(cu.cuGraphInstantiate(graph, 0))
    for rep in range(30):
        As, Bs = _operands(shared_rng, M, N, [K] * P, "nk")
        src_a, _ = upload(As[me], "bfloat16")
        src_b, _ = upload(Bs[me], "bfloat16")
        a.copy_from(src_a, stream=stream)
        b.copy_from(src_b, stream=stream)
        for o in (o1, o2, o3):
            o.fill_nan(stream=stream)
        check(cu.cuGraphLaunch(gexec, stream))
        ctx.synchronize(stream)
        Ax, Bx = [upload(x, "bfloat16")[1] for x in As], [upload(x, "bfloat16")[1] for x in Bs]
        C, scale = _reference(Ax, Bx, "nk")
        C16, scale16 = _reference([x[:16] for x in Ax], Bx, "nk")
        _check(download(o1), C16, scale16, "bfloat16", "bfloat16", K, f"replay {rep} latency")
        _check(download(o2), C, scale, "bfloat16", "bfloat16", K, f"replay {rep} bandwidth")
        _check(download(o3), C, scale, "float32", "float32", K, f"replay {rep} unfused")
        if rep % 10 == 0:
            for o in (o1, o2, o3):
                _same_on_every_rank(ctx, o, f"replay {rep}")
    check(cu.cuGraphExecDestroy(gexec))
    check(cu.cuGraphDestroy(graph))
    check(cu.cuStreamDestroy(stream))


def test_repeated_calls_repoint(ctx, shared_rng):
    """The same layout with new arrays every call (out=None: a fresh output each time) re-points the bound
    launch: right results every call, on both fused paths."""
    P, me = ctx.local_size, ctx.local_rank
    for M, N, K in ((12, 640, 192), (640, 320, 192)):
        for it in range(3):
            As, Bs = _operands(shared_rng, M, N, [K] * P, "kn")
            a, _ = upload(As[me], "bfloat16")
            b, _ = upload(Bs[me], "bfloat16")
            out = mkernel.gemm_all_reduce(ctx, a, b)
            ctx.synchronize()
            C, scale = _reference([upload(x, "bfloat16")[1] for x in As], [upload(x, "bfloat16")[1] for x in Bs],
                                  "kn")
            plan = ctx.last_plan("gemm_ar")
            _check(download(out), C, scale, "bfloat16", "bfloat16", K, f"M={M} call {it} ({plan.path})")
            _same_on_every_rank(ctx, out, f"M={M} call {it}")


def test_forced_fallback_matches_the_fused_paths(ctx, shared_rng):
    """options.path="unfused" (our GEMM, then our all-reduce) against the latency and bandwidth paths on the
    same inputs: each within tolerance, and last_plan says which ran."""
    P, me = ctx.local_size, ctx.local_rank
    M, N, K = 48, 520, 640
    As, Bs = _operands(shared_rng, M, N, [K] * P, "nk")
    a, _ = upload(As[me], "bfloat16")
    b, _ = upload(Bs[me], "bfloat16")
    C, scale = _reference([upload(x, "bfloat16")[1] for x in As], [upload(x, "bfloat16")[1] for x in Bs], "nk")
    for path in ("unfused", "latency", "bandwidth"):
        out = poisoned((M, N), "bfloat16")
        mkernel.gemm_all_reduce(ctx, a, b, out, b_layout="nk", options=GemmArOptions(path=path))
        ctx.synchronize()
        plan = ctx.last_plan("gemm_ar")
        assert P == 1 or plan.path == path, plan
        _check(download(out), C, scale, "bfloat16", "bfloat16", K, path)
        _same_on_every_rank(ctx, out, path)


def test_bad_inputs_raise_before_launch(ctx):
    a = DeviceArray.empty((64, 64), "bfloat16")
    b = DeviceArray.empty((64, 48), "bfloat16")
    out = poisoned((64, 48), "bfloat16")
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        mkernel.gemm_all_reduce(ctx, DeviceArray.empty((64, 64), "float32"), b)
    with pytest.raises(TypeError, match="must match"):
        mkernel.gemm_all_reduce(ctx, a, DeviceArray.empty((64, 48), "float16"), out)
    with pytest.raises(ValueError, match="K differs"):
        mkernel.gemm_all_reduce(ctx, a, DeviceArray.empty((48, 64), "bfloat16"), out)
    with pytest.raises(ValueError, match="out overlaps a"):
        mkernel.gemm_all_reduce(ctx, a, b, DeviceArray(a.ptr, (64, 48), "bfloat16", None, a.device, a))
    with pytest.raises(ValueError, match="read-only"):
        mkernel.gemm_all_reduce(ctx, a, b, DeviceArray(out.ptr, (64, 48), "bfloat16", None, out.device, out,
                                                        readonly=True))
    with pytest.raises(ValueError, match="out must have shape"):
        mkernel.gemm_all_reduce(ctx, a, b, poisoned((32, 48), "bfloat16"))
    with pytest.raises(ValueError, match="GemmArOptions.path"):
        mkernel.gemm_all_reduce(ctx, a, b, out, options=GemmArOptions(path="fast"))
    if ctx.local_size > 1:  # ranks disagree on N (a call no rank made before): every rank raises
        n = 48 + 8 * ctx.local_rank
        with pytest.raises(ValueError, match="disagree"):
            mkernel.gemm_all_reduce(ctx, a, DeviceArray.empty((64, n), "bfloat16"))
    ctx.synchronize()
    assert np.isnan(download(out)).all(), "a failing call launched something"


@pytest.mark.parametrize("path", ["latency", "bandwidth"])
def test_zzz_missing_peer_times_out(ctx, path):
    """A rank that never makes the call: the other raises CommTimeout (op gemm_ar, naming the peer)."""
    if ctx.local_size < 2:
        pytest.skip("needs 2 ranks")
    a, _ = upload(np.ones((256, 128)), "bfloat16")
    b, _ = upload(np.ones((128, 256)), "bfloat16")
    out = DeviceArray.empty((256, 256), "bfloat16")
    opts = GemmArOptions(path=path)
    assert_missing_peer_times_out(lambda c2: mkernel.gemm_all_reduce(c2, a, b, out, options=opts), "gemm_ar")


def test_zzz_mismatched_call_after_agreement(ctx):
    """Two calls agreed on earlier (the host exchanges nothing more), then rank 0 repeats one while rank 1
    makes the other: every rank raises CommMismatch naming the other, from the call signatures the ranks
    announce on the device before any partial is pushed."""
    if ctx.local_size != 2:
        pytest.skip("needs exactly 2 ranks")
    from mpi4py import MPI

    c2 = mkernel.init(MPI.COMM_WORLD.Dup(), timeout=5.0)
    opts = GemmArOptions(path="latency")
    b, _ = upload(np.ones((128, 256)), "bfloat16")
    shards = {m: upload(np.ones((m, 128)), "bfloat16")[0] for m in (8, 24)}
    for m, a in shards.items():
        mkernel.gemm_all_reduce(c2, a, b, options=opts)
    c2.synchronize()
    c2.world.Barrier()
    m = 8 if c2.rank == 0 else 24
    mkernel.gemm_all_reduce(c2, shards[m], b, options=opts)
    with pytest.raises(mkernel.CommMismatch) as ei:
        c2.synchronize()
    rec = ei.value.record
    assert rec["op"] == "gemm_ar" and rec["rank"] == c2.rank and rec["peer"] == 1 - c2.rank, rec
    c2.world.Barrier()
