"""AllGather + GEMM against float64 numpy, on every rank of ``mpirun -np N python -m pytest``.

Every rank draws all ranks' shards A_j and weights B_j from a generator seeded identically (fresh
per test), passes its own, and checks ``C_r = concat_j(A_j) @ B_r`` (relative Frobenius error below
1e-2; the output is NaN-poisoned first, so unwritten elements fail) and, where requested, the
gathered A exactly.
"""
from __future__ import annotations

import numpy as np
import pytest
from cuda.bindings import driver as cu

import mkernel
from mkernel.core.arrays import DeviceArray
from mkernel.core.driver import check
from mkernel.ops import ag_gemm as AG
from mkernel.ops import gemm as G
from mkernel.ops.ag_gemm import AgGemmOptions
from mkernel.ops.ag_gemm import layout as LY
from mkernel.ops.ag_gemm import planner as PL

from _util import (capture, assert_missing_peer_times_out, download, on_other_device, poison_workspace_tail, poisoned, rel_fro,
                   upload)

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

REL_TOL = 1e-2


@pytest.fixture(scope="module", autouse=True)
def _compiled(_contexts):
    """Compile every ag_gemm.cu specialization and the gemm.cu ones the unfused path may use into the
    disk cache, in parallel processes, on local rank 0 (the other ranks then load the cubins)."""
    ctx = _contexts["ctx"]
    if ctx.local_rank == 0:
        try:
            AG.precompile()
            G.precompile([G.defines(i, o, c) for i in ("bfloat16", "float16") for o in (i, "float32")
                          for c in (1, 2, 3)])
        except Exception as exc:  # noqa: BLE001  (kernels then compile lazily)
            print(f"precompile failed, compiling lazily: {exc!r}")
    ctx.world.Barrier()


def _ms(spec, P):
    return [int(spec(r, P)) for r in range(P)]


def _make(rng, m_sizes, N, K, dtype, b_layout):
    """Every rank's shard [M_j, K] and weight ([K, N] "kn" or [N, K] "nk"), float64 (same on all ranks)."""
    P = len(m_sizes)
    shards = [rng.standard_normal((m, K)) for m in m_sizes]
    bs = [rng.standard_normal((K, N) if b_layout == "kn" else (N, K)) for _ in range(P)]
    return shards, bs


def _force(path):
    """ag_gemm keywords that force a fused path: "fused" with 4 communication SMs, or "fused_ce"."""
    return dict(comm_sms=4) if path == "fused" else dict(path=path)


def _run_case(ctx, rng, m_sizes, N, K, *, dtype="bfloat16", b_layout="kn", comm_sms=None, gathered=False,
              out_dtype=None, config=None, path=None, misaligned=False, pass_m_sizes=False, options=None, what=""):
    """misaligned: pass a_shard 8 bytes past a 16-byte boundary (TMA cannot read it in place).
    pass_m_sizes: pass every rank's M_j (``m_sizes=``), as a caller must when ranks change M_j
    independently."""
    me = ctx.local_rank
    shards, bs = _make(rng, m_sizes, N, K, dtype, b_layout)
    a, _ = upload(shards[me], dtype)
    if misaligned:
        z = DeviceArray.empty((a.size + 4,), dtype)
        check(cu.cuMemcpyDtoD(z.ptr + 8, a.ptr, a.nbytes))
        a = DeviceArray(z.ptr + 8, tuple(a.shape), dtype, None, z.device, owner=z)
    exact_a = [upload(s, dtype)[1] for s in shards]
    b, exact_b = upload(bs[me], dtype)
    M = sum(m_sizes)
    out = poisoned((M, N), out_dtype or dtype)
    ga = poisoned((M, K), dtype) if gathered else None
    res = mkernel.ag_gemm(ctx, a, b, out, gathered_a=ga, b_layout=b_layout, comm_sms=comm_sms, config=config,
                          path=path, m_sizes=m_sizes if pass_m_sizes else None, options=options)
    ctx.synchronize()
    assert res is out
    plan = ctx.last_plan("ag_gemm")
    A = np.concatenate(exact_a, axis=0)
    Bkn = exact_b if b_layout == "kn" else exact_b.T
    err = rel_fro(download(out), A @ Bkn)
    assert err < REL_TOL, f"{what}: rel. Frobenius error {err:.3e} (plan: {plan.describe()})"
    if gathered:
        np.testing.assert_array_equal(download(ga), A, err_msg=f"{what}: gathered_a")
    return plan


# (name, m_sizes(r, P), N, K, b_layout, mode, extra); mode: "fused:<comm_sms>", "ce" (copy engines),
# "unfused", "auto"
CASES = [
    ("equal-kn", lambda r, P: 256, 512, 512, "kn", "fused:8", {}),
    ("equal-nk", lambda r, P: 256, 512, 512, "nk", "fused:4", {"gathered": True}),
    ("odd-M-ragged-K", lambda r, P: 129, 200, 136, "kn", "fused:8", {"gathered": True}),
    ("unequal-M-nk", lambda r, P: 100 + 37 * r, 384, 256, "nk", "fused:6", {}),
    ("rank0-empty", lambda r, P: 0 if (r == 0 and P > 1) else 300, 256, 128, "kn", "fused:2", {"gathered": True}),
    ("one-row-each", lambda r, P: 1, 64, 64, "kn", "fused:1", {}),
    ("many-chunks-per-tile", lambda r, P: 64 + 8 * r, 256, 4096, "nk", "fused:8", {}),
    ("wide-K-odd-N", lambda r, P: 333, 1000, 1024, "kn", "auto", {"gathered": True}),
    ("auto-medium", lambda r, P: 1024, 1024, 1024, "nk", "auto", {}),
    ("auto-unequal", lambda r, P: 777 + 223 * (r % 2), 1000, 1024, "kn", "auto", {}),
    ("unfused-kn", lambda r, P: 300, 260, 200, "kn", "unfused", {"gathered": True}),
    ("unfused-unequal-nk", lambda r, P: 65 + 64 * r, 130, 64, "nk", "unfused", {}),
    ("auto-tiny-N", lambda r, P: 2048, 16, 2048, "kn", "auto", {}),
    ("fp16-nk", lambda r, P: 200, 300, 256, "nk", "fused:8", {"dtype": "float16"}),
    ("fp32-out", lambda r, P: 256, 256, 256, "kn", "fused:4", {"out_dtype": "float32"}),
    ("fp16-unfused-fp32-out", lambda r, P: 97, 96, 128, "kn", "unfused", {"dtype": "float16", "out_dtype": "float32"}),
    ("ce-equal-kn", lambda r, P: 256, 512, 512, "kn", "ce", {"gathered": True}),
    ("ce-odd-M-ragged-K", lambda r, P: 129, 200, 136, "kn", "ce", {"gathered": True}),
    ("ce-unequal-M-nk", lambda r, P: 100 + 37 * r, 384, 256, "nk", "ce", {}),
    ("ce-rank0-empty", lambda r, P: 0 if (r == 0 and P > 1) else 300, 256, 128, "kn", "ce", {"gathered": True}),
    ("ce-one-row-each", lambda r, P: 1, 64, 64, "kn", "ce", {}),
    ("ce-4-chunks-nk", lambda r, P: 1000 + 24 * r, 264, 512, "nk", "ce", {"gathered": True}),
    ("ce-fp16-fp32-out", lambda r, P: 200, 300, 256, "nk", "ce", {"dtype": "float16", "out_dtype": "float32"}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_shapes(ctx, shared_rng, case):
    name, spec, N, K, layout, mode, extra = case
    P = ctx.local_size
    m_sizes = _ms(spec, P)
    comm_sms = None if mode in ("auto", "ce") else 0 if mode == "unfused" else int(mode.split(":")[1])
    path = "fused_ce" if mode == "ce" else None
    plan = _run_case(ctx, shared_rng, m_sizes, N, K, b_layout=layout, comm_sms=comm_sms, path=path, what=name,
                     **extra)
    if P > 1 and mode.startswith("fused"):
        assert plan.path == "fused" and plan.comm_sms == comm_sms, plan.describe()
    elif P > 1 and mode == "ce":
        assert plan.path == "fused_ce" and plan.workers <= ctx.resident_sms, plan.describe()
    elif mode == "unfused" or P == 1:
        assert plan.path == "unfused", plan.describe()
    else:  # auto: what the model says for these agreed sizes
        want = PL.plan(m_sizes, N, K, 2, ctx.resident_sms, gathered=bool(extra.get("gathered")), b_layout=layout).path
        assert plan.path == want, plan.describe()


@pytest.mark.parametrize("path", ["fused", "fused_ce"])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("config", [0, 1, 2, 3, 4, 5])
def test_fused_every_config(ctx, shared_rng, layout, config, path):
    """Every tile config of the fused kernel, ragged M (tiles end inside a shard) and N."""
    m_sizes = _ms(lambda r, P: 150 + 50 * r, ctx.local_size)
    plan = _run_case(ctx, shared_rng, m_sizes, 520, 320, b_layout=layout, comm_sms=5 if path == "fused" else None,
                     config=config, gathered=True, path=path, what=f"config {config} {layout} {path}")
    if ctx.local_size > 1:
        assert plan.path == path and plan.config == config, plan.describe()


@pytest.mark.parametrize("path", ["fused", "fused_ce"])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("config", [2, 3, 4])
def test_last_wave_split(ctx, shared_rng, layout, config, path):
    """The fused kernel's partial last wave split along K (AgGemmOptions.tail_split=True): odd shards,
    ragged N; three calls with new data (the split-K counters return to zero after each)."""
    m_sizes = _ms(lambda r, P: 700 + 17 * r, ctx.local_size)
    # N per config such that, on 2 x H200, 144-540 tiles on ~130 workers leave a last wave the plan splits
    # on both paths (the copy-engine plan simulates the arrivals: where they bound the end, no split)
    N, K = {2: 3000, 3: 6000, 4: 9000}[config], 4096
    kw = dict(comm_sms=4) if path == "fused" else dict(path=path)
    for it in range(3):
        plan = _run_case(ctx, shared_rng, m_sizes, N, K, b_layout=layout, config=config,
                         options=AgGemmOptions(tail_split=True),
                         what=f"tail split config {config} {layout} {path} call {it}", **kw)
    if ctx.local_size > 1:
        want = PL.plan(m_sizes, N, K, 2, ctx.resident_sms, config=config, tail_split=True,
                        b_layout=layout, **({"comm_sms": 4} if path == "fused" else {"force_path": path}))
        assert (plan.path, plan.splits, plan.split_from) == (path, want.splits, want.split_from), plan.describe()
        if ctx.resident_sms == 132 and ctx.local_size == 2:  # the N above were picked for 2 x H200
            assert plan.splits > 1, plan.describe()


@pytest.mark.parametrize("spec", [lambda r, P: 2048, lambda r, P: 1500 + 1100 * (r % 2)], ids=["equal", "unequal"])
def test_last_chunk_split(ctx, shared_rng, spec):
    """Transfer-bound shapes (little compute per gathered byte): the copy-engine plan splits the tiles
    the late chunks feed along K over the idle workers; three calls with new data, against numpy."""
    m_sizes = _ms(spec, ctx.local_size)
    N, K = 300, 4096
    for it in range(3):
        plan = _run_case(ctx, shared_rng, m_sizes, N, K, b_layout="nk", what=f"last-chunk split call {it}")
    if ctx.local_size > 1:
        want = PL.plan(m_sizes, N, K, 2, ctx.resident_sms, b_layout="nk")
        assert (plan.path, plan.splits, plan.split_from) == (want.path, want.splits, want.split_from), plan.describe()
        if ctx.resident_sms >= 120:  # H100/H200
            assert plan.path == "fused_ce" and plan.splits > 1, plan.describe()


def test_mixed_b_layouts(ctx, shared_rng):
    """Ranks may hold their weights in different layouts ([K, N] on even ranks, [N, K] on odd ones): the
    plan is then made for "kn" (no 224-wide tile) on every rank; against numpy on both paths."""
    m_sizes = _ms(lambda r, P: 600 + 30 * r, ctx.local_size)
    layout = "nk" if ctx.local_rank % 2 else "kn"
    for path in ("fused_ce", "unfused"):
        plan = _run_case(ctx, shared_rng, m_sizes, 1344, 512, b_layout=layout, path=path,
                         what=f"mixed layouts {path}")
        if ctx.local_size > 1:
            assert plan.path == path and plan.config != 5, plan.describe()


def test_every_tile_split(ctx, shared_rng):
    """Fewer tiles than workers with a long K (64 rows per rank, K = 16384, copy engines forced): the plan
    splits every tile along K, the own shard's too (split_from = 0); three calls against numpy."""
    m_sizes = _ms(lambda r, P: 64, ctx.local_size)
    for it in range(3):
        plan = _run_case(ctx, shared_rng, m_sizes, 512, 16384, b_layout="nk", path="fused_ce",
                         what=f"every tile split call {it}")
    if ctx.local_size > 1:
        want = PL.plan(m_sizes, 512, 16384, 2, ctx.resident_sms, force_path="fused_ce", b_layout="nk")
        assert (plan.splits, plan.split_from) == (want.splits, want.split_from), plan.describe()
        if ctx.resident_sms >= 120:
            assert plan.splits > 1 and plan.split_from == 0, plan.describe()


@pytest.mark.parametrize("path", ["fused", "fused_ce"])
def test_unaligned_shard(ctx, shared_rng, path):
    """a_shard 8 bytes past a 16-byte boundary: TMA cannot read it in place, so its rows go through the
    workspace like a peer's (local_map off) -- same results."""
    m_sizes = _ms(lambda r, P: 300 + 20 * r, ctx.local_size)
    plan = _run_case(ctx, shared_rng, m_sizes, 200, 256, gathered=True, misaligned=True, what=f"unaligned {path}",
                     **_force(path))
    if ctx.local_size > 1:
        assert plan.path == path, plan.describe()


def test_m_sizes_argument(ctx, shared_rng):
    P, me = ctx.local_size, ctx.local_rank
    m_sizes = [40 + 24 * r for r in range(P)]
    shards, bs = _make(shared_rng, m_sizes, 96, 64, "bfloat16", "kn")
    a, _ = upload(shards[me], "bfloat16")
    b, eb = upload(bs[me], "bfloat16")
    out = poisoned((sum(m_sizes), 96), "bfloat16")
    mkernel.ag_gemm(ctx, a, b, out, m_sizes=m_sizes, comm_sms=3)
    ctx.synchronize()
    A = np.concatenate([upload(s, "bfloat16")[1] for s in shards])
    assert rel_fro(download(out), A @ eb) < REL_TOL


def test_stale_workspace_bytes_are_never_flags(ctx, shared_rng):
    """Every call shares the op's workspace, so bytes a call left in its data region must never read as
    a later call's ready flag or copy-engine go word, whatever the shapes: the control words sit at
    offsets of P only (mkernel/ops/ag_gemm/layout.py).  Before every call each rank fills its workspace
    from the previous call's first data byte to the end with 0xFF (as a flag: raised for any call).
    The sequence: a last shard of 16384 x 8192 (the gather path cuts it into 256 chunks of 64 rows --
    more flags than fitted before a 4 KiB data region when they moved with the shape) after a small
    call of the same K; copy-engine calls of different chunk counts (the go word once moved with them:
    a stale 1 let the copies start before the call was opened); the SM path between them.  (Whether
    a misplaced flag shows depends on timing -- the peer's rows usually land just after -- so the
    deterministic guard is tests/cpu test_control_words_do_not_move_with_the_shape.)"""
    P = ctx.local_size
    if P < 2:
        pytest.skip("needs 2 or more local ranks")
    small, big = [64] * (P - 1), 16384
    seq = [(small + [big], 64, 8192, "unfused"), (small + [1000], 64, 8192, "unfused"),
           (small + [big], 64, 8192, "unfused"), ([3000] * P, 256, 1024, "fused_ce"),
           ([700 + 64 * r for r in range(P)], 128, 2048, "fused"), ([9000] * P, 256, 512, "fused_ce"),
           ([1100] * P, 512, 1024, "fused_ce"), (small + [big], 64, 8192, "fused_ce")]
    prev_data_off = None
    for i, (ms, N, K, path) in enumerate(seq):
        if prev_data_off is not None:
            poison_workspace_tail(ctx, ctx._workspaces[("ag_gemm",)], prev_data_off)
        kw = dict(comm_sms=4) if path == "fused" else dict(path=path)
        plan = _run_case(ctx, shared_rng, ms, N, K, b_layout="nk", pass_m_sizes=True,
                         what=f"call {i} ({path}, M={ms}, K={K})", **kw)
        assert plan.path == path, plan.describe()
        prev_data_off = LY.workspace_layout(P, ms, plan.chunk_rows, K * 2).data_off


def test_back_to_back_1000_calls(ctx, shared_rng):
    """1000 calls (fused, unfused, auto with gathered A, copy engines with and without gathered A) with
    changing data, no host sync in between."""
    P, me = ctx.local_size, ctx.local_rank
    calls, Mr, K, N = 1000, 64, 64, 64
    M = Mr * P
    A_all = shared_rng.standard_normal((P, calls, Mr, K))
    B_all = shared_rng.standard_normal((P, calls, K, N))
    a, _ = upload(A_all[me], "bfloat16")
    b, eb = upload(B_all[me], "bfloat16")
    exact_a = np.stack([upload(A_all[r], "bfloat16")[1] for r in range(P)])  # [P, calls, Mr, K]
    out = poisoned((calls, M, N), "bfloat16")
    ga = poisoned((calls, M, K), "bfloat16")
    for i in range(calls):
        mode = i % 5
        if mode == 0:
            mkernel.ag_gemm(ctx, a[i], b[i], out[i], comm_sms=2)
        elif mode == 1:
            mkernel.ag_gemm(ctx, a[i], b[i], out[i], comm_sms=0)
        elif mode == 2:
            mkernel.ag_gemm(ctx, a[i], b[i], out[i], gathered_a=ga[i])
        elif mode == 3:
            mkernel.ag_gemm(ctx, a[i], b[i], out[i], path="fused_ce")
        else:
            mkernel.ag_gemm(ctx, a[i], b[i], out[i], gathered_a=ga[i], path="fused_ce")
    ctx.synchronize()
    h_out, h_ga = download(out), download(ga)
    for i in range(calls):
        A = exact_a[:, i].reshape(M, K)
        err = rel_fro(h_out[i], A @ eb[i])
        assert err < REL_TOL, f"call {i} (mode {i % 5}): rel. error {err:.3e}"
        if i % 5 in (2, 4):
            np.testing.assert_array_equal(h_ga[i], A, err_msg=f"call {i}: gathered_a")


@pytest.mark.parametrize("path", ["fused_ce", "unfused", "fused"])
def test_repeated_calls_repoint_the_bound_call(ctx, shared_rng, path):
    """Eager calls with fresh arrays of one layout (new a_shard, b, out and gathered_a every call, as
    callers with new torch tensors make them) re-point the first call's bound call -- its tensor maps,
    AgArgs pointers and copy list -- instead of binding again: right results every time, gathered_a
    included, the same bound call and plan; calling again with arrays of an earlier call is right too."""
    P, me = ctx.local_size, ctx.local_rank
    Mr, K, N = 200, 256, 320
    M = Mr * P
    kw = _force(path) if path != "unfused" else dict(comm_sms=0)
    st = ctx.op_state("ag_gemm")
    first = None
    for it in range(4):
        A_all = shared_rng.standard_normal((P, Mr, K))
        a, _ = upload(A_all[me], "bfloat16")
        b, eb = upload(shared_rng.standard_normal((K, N)), "bfloat16")
        out, ga = poisoned((M, N), "bfloat16"), poisoned((M, K), "bfloat16")
        if it == 3:  # the first call's arrays again, new data in them
            a0, b0, out0, ga0 = first[1:]
            a0.copy_from(a)
            b0.copy_from(b)
            out0.fill_nan()
            ga0.fill_nan()
            ctx.synchronize()
            a, b, out, ga = a0, b0, out0, ga0
        res = mkernel.ag_gemm(ctx, a, b, out, gathered_a=ga, **kw)
        plan = ctx.last_plan("ag_gemm")
        assert res is out and plan.path == (path if P > 1 else "unfused"), plan.describe()
        bound = next(reversed(st.calls.values()))  # (the call's bound call: the most recently used)
        if first is None:
            first = (bound, a, b, out, ga)
        assert bound is first[0] and bound.plan is plan, f"{path} call {it}: bound anew"
        ctx.synchronize()
        exact = np.concatenate([upload(A_all[r], "bfloat16")[1] for r in range(P)])
        assert rel_fro(download(out), exact @ eb) < REL_TOL, f"{path} call {it}"
        np.testing.assert_array_equal(download(ga), exact, err_msg=f"{path} call {it}: gathered_a")


def test_graph_capture_replay(ctx, shared_rng):
    """Capture a fused, an unfused and a copy-engine call in one CUDA graph; replay 100 times with new
    inputs."""
    P, me = ctx.local_size, ctx.local_rank
    Mr, K, N = 128, 256, 192
    M = Mr * P
    stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
    a = DeviceArray.empty((Mr, K), "bfloat16")
    b = DeviceArray.empty((N, K), "bfloat16")
    out1 = DeviceArray.empty((M, N), "bfloat16")
    out2 = DeviceArray.empty((M, N), "float32")
    out3 = DeviceArray.empty((M, N), "bfloat16")
    ga = DeviceArray.empty((M, K), "bfloat16")
    ga3 = DeviceArray.empty((M, K), "bfloat16")
    a.copy_from(upload(np.ones((Mr, K)), "bfloat16")[0])
    b.copy_from(upload(np.ones((N, K)), "bfloat16")[0])

    def calls(s):
        mkernel.ag_gemm(ctx, a, b, out1, gathered_a=ga, b_layout="nk", stream=s, comm_sms=4)
        mkernel.ag_gemm(ctx, a, b, out2, b_layout="nk", stream=s, comm_sms=0)
        mkernel.ag_gemm(ctx, a, b, out3, gathered_a=ga3, b_layout="nk", stream=s, path="fused_ce")

    calls(stream)  # outside the capture: signature exchange, workspace, plans
    ctx.synchronize(stream)
    graph = capture(stream, lambda: calls(int(stream)))
    gexec = check(cu.cuGraphInstantiate(graph, 0))
    from mkernel.core.dtypes import f32_to_bf16, bf16_to_f32

    for rep in range(100):
        As = shared_rng.standard_normal((P, Mr, K)).astype(np.float32)
        Bs = shared_rng.standard_normal((P, N, K)).astype(np.float32)
        ha = np.ascontiguousarray(f32_to_bf16(As[me]))
        hb = np.ascontiguousarray(f32_to_bf16(Bs[me]))
        check(cu.cuMemcpyHtoDAsync(a.ptr, ha.ctypes.data, ha.nbytes, stream))
        check(cu.cuMemcpyHtoDAsync(b.ptr, hb.ctypes.data, hb.nbytes, stream))
        out1.fill_nan(stream=stream)
        out2.fill_nan(stream=stream)
        out3.fill_nan(stream=stream)
        ga.fill_nan(stream=stream)
        ga3.fill_nan(stream=stream)
        check(cu.cuGraphLaunch(gexec, stream))
        ctx.synchronize(stream)
        A = bf16_to_f32(f32_to_bf16(As.reshape(M, K))).astype(np.float64)
        ref = A @ bf16_to_f32(hb).astype(np.float64).T
        for o in (out1, out2, out3):
            err = rel_fro(download(o), ref)
            assert err < REL_TOL, f"replay {rep}: rel. error {err:.3e}"
        np.testing.assert_array_equal(download(ga), A, err_msg=f"replay {rep}: gathered_a")
        np.testing.assert_array_equal(download(ga3), A, err_msg=f"replay {rep}: gathered_a (copy engines)")
    check(cu.cuGraphExecDestroy(gexec))
    check(cu.cuGraphDestroy(graph))
    check(cu.cuStreamDestroy(stream))


def test_bad_inputs_raise_before_launch(ctx):
    P = ctx.local_size
    a = DeviceArray.empty((32, 64), "bfloat16")
    b = DeviceArray.empty((64, 48), "bfloat16")
    out = poisoned((32 * P, 48), "bfloat16")
    with pytest.raises(TypeError, match="dtype"):
        mkernel.ag_gemm(ctx, DeviceArray.empty((32, 64), "int32"), b)
    with pytest.raises(TypeError, match="must match"):
        mkernel.ag_gemm(ctx, a, DeviceArray.empty((64, 48), "float16"))
    with pytest.raises(TypeError):
        mkernel.ag_gemm(ctx, np.ones((32, 64), dtype=np.float16), b)
    with pytest.raises(ValueError, match="2-D"):
        mkernel.ag_gemm(ctx, DeviceArray.empty((2, 32, 64), "bfloat16"), b)
    with pytest.raises(ValueError, match="inner dimensions"):
        mkernel.ag_gemm(ctx, a, DeviceArray.empty((48, 64), "bfloat16"))  # kn expects [64, N]
    with pytest.raises(ValueError, match="multiple of"):
        mkernel.ag_gemm(ctx, DeviceArray.empty((32, 7), "bfloat16"), DeviceArray.empty((7, 48), "bfloat16"))
    z = DeviceArray.empty((32, 128), "bfloat16")
    nc = DeviceArray(z.ptr, (32, 64), z.dtype, (128, 1), z.device, owner=z)
    with pytest.raises(ValueError, match="contiguous"):
        mkernel.ag_gemm(ctx, nc, b)
    with pytest.raises(ValueError, match="b_layout"):
        mkernel.ag_gemm(ctx, a, b, b_layout="km")
    with pytest.raises(ValueError, match="comm_sms"):
        mkernel.ag_gemm(ctx, a, b, comm_sms=-1)
    with pytest.raises(ValueError, match="path"):
        mkernel.ag_gemm(ctx, a, b, path="fastest")
    with pytest.raises(ValueError, match="m_sizes"):
        mkernel.ag_gemm(ctx, a, b, m_sizes=[33] * P)
    with pytest.raises(ValueError, match="out has shape"):
        mkernel.ag_gemm(ctx, a, b, DeviceArray.empty((32 * P + 1, 48), "bfloat16"))
    with pytest.raises(TypeError, match="out has dtype"):
        mkernel.ag_gemm(ctx, a, b, DeviceArray.empty((32 * P, 48), "float16"))
    with pytest.raises(ValueError, match="gathered_a"):
        mkernel.ag_gemm(ctx, a, b, out, gathered_a=DeviceArray.empty((32 * P, 63), "bfloat16"))
    if P > 1:
        with pytest.raises(ValueError, match="comm_sms"):  # all ranks agree, but too many for the GPU
            mkernel.ag_gemm(ctx, a, b, out, comm_sms=ctx.sm_count)
        # ranks disagree on K (a signature no rank has used yet): every rank raises.  A rank that
        # repeats an already-agreed signature while another changes it is not checked on the host
        # (no per-call host exchange); the device-side timeout catches that case.
        K = 64 + 8 * ctx.local_rank
        with pytest.raises(ValueError, match="disagree"):
            mkernel.ag_gemm(ctx, DeviceArray.empty((37, K), "bfloat16"), DeviceArray.empty((K, 40), "bfloat16"))
        with pytest.raises(ValueError, match="disagree"):
            mkernel.ag_gemm(ctx, a, b, comm_sms=2 + ctx.local_rank)
        # config 5's tile is 224 wide with B [N, K] and 256 with [K, N]: forced with mixed layouts
        bt = DeviceArray.empty((48, 64), "bfloat16")
        with pytest.raises(ValueError, match="layouts differ"):
            mkernel.ag_gemm(ctx, a, bt if ctx.local_rank % 2 else b, out, config=5,
                        b_layout="nk" if ctx.local_rank % 2 else "kn")
    w, _ = on_other_device(ctx.device, (32, 64), "bfloat16")
    if w is not None:
        with pytest.raises(ValueError, match="cuda:"):
            mkernel.ag_gemm(ctx, w, b)
    ctx.synchronize()
    assert np.isnan(download(out)).all(), "a failing call launched something"


@pytest.mark.parametrize("path", ["fused", "fused_ce"])
def test_zzz_missing_peer_times_out(ctx, path):
    """A rank that never makes the call: the other raises CommTimeout within the timeout."""
    if ctx.local_size < 2:
        pytest.skip("needs 2 ranks")
    a, _ = upload(np.ones((256, 128)), "bfloat16")
    b, _ = upload(np.ones((128, 256)), "bfloat16")
    out = DeviceArray.empty((256 * ctx.local_size, 256), "bfloat16")
    kw = _force(path)
    assert_missing_peer_times_out(lambda c2: mkernel.ag_gemm(c2, a, b, out, **kw), "ag_gemm")


@pytest.mark.parametrize("path", ["fused", "fused_ce", "unfused"])
def test_zzz_mismatched_call_after_agreement(ctx, path):
    """Two shard sizes agreed on earlier (the host exchanges nothing more), then rank 0 repeats one while
    rank 1 makes the other: every rank raises CommMismatch naming the other, from the call signatures
    the ranks announce on the device before anything is pushed."""
    if ctx.local_size < 2:
        pytest.skip("needs 2 ranks")
    from mpi4py import MPI

    c2 = mkernel.init(MPI.COMM_WORLD.Dup(), timeout=2.0)
    kw = _force(path) if path != "unfused" else dict(path="unfused")
    b, _ = upload(np.ones((128, 256)), "bfloat16")
    shards = {m: upload(np.ones((m, 128)), "bfloat16")[0] for m in (256, 384)}
    for m, a in shards.items():
        mkernel.ag_gemm(c2, a, b, DeviceArray.empty((m * c2.local_size, 256), "bfloat16"), **kw)
    c2.synchronize()
    c2.world.Barrier()
    m = 256 if c2.rank == 0 else 384
    mkernel.ag_gemm(c2, shards[m], b, DeviceArray.empty((m * c2.local_size, 256), "bfloat16"), **kw)
    with pytest.raises(mkernel.CommMismatch) as ei:
        c2.synchronize()
    rec = ei.value.record
    assert rec["op"] == "ag_gemm" and rec["rank"] == c2.rank and rec["peer"] == 1 - c2.rank, rec
    c2.world.Barrier()
