"""mkernel.ring_attention on the GPU(s), under mpirun (-np 1 and -np 2; two ranks may share one GPU).

Every rank draws the same global q, k, v (shared seed), takes its shard (contiguous, or zigzag for causal),
and compares its (out, lse) with a float64 numpy reference of full attention over the whole sequence, its
rows picked out.  Outputs are NaN-poisoned first; shapes are not multiples of the 128-row tiles.
Tolerance: |out - ref| <= 2e-2 * (|ref| + 0.05 * max|v|) (bf16 / fp16 inputs, fp32 accumulation and merge,
one rounding of out); lse within 1e-3 absolute (fp32 with exp2/log2 approximations).
"""
from __future__ import annotations

import numpy as np
import pytest

import mkernel
from mkernel.core.arrays import DeviceArray
from mkernel.core.compiler import precompile_source, registered_specializations
from mkernel.ops.attention.reference import attention_reference
from mkernel.ops.ring_attention import zigzag_indices

from _util import capture, assert_missing_peer_times_out, download, precompiled_with_long_timeout, upload

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


@pytest.fixture(scope="module", autouse=True)
def _setup(_contexts):
    """The merge specializations of the attention kernel compiled on local rank 0 too (the others load them)."""
    ctx = _contexts["ctx"]
    if ctx.local_rank == 0:
        merge = [d for src, d in registered_specializations() if src == "ops/attention_fwd.cu" and d.get("MK_ATTN_MERGE")]
        try:
            precompile_source("ops/attention_fwd.cu", merge)
        except Exception as exc:  # noqa: BLE001  (kernels then compile lazily)
            print(f"precompile failed, compiling lazily: {exc!r}")
    if ctx.local_rank == 0:
        from mkernel.ops.attention_bwd import kernels as BK

        try:  # the backward's partial kernels (mma, wgmma) and the default specialization's pre / convert kernels
            precompile_source(BK.SOURCE, [BK.partial_defines(t, d) for t in BK.DTYPES for d in BK.HEAD_DIMS]
                              + [BK.wgmma_partial_defines(t, d) for t in BK.DTYPES for d in BK.HEAD_DIMS]
                              + [BK.defines(t, d, BK.DEFAULT_BLOCK_Q[d]) for t in BK.DTYPES for d in BK.HEAD_DIMS])
        except Exception as exc:  # noqa: BLE001
            print(f"precompile failed, compiling lazily: {exc!r}")
    if ctx.local_rank == 0 and ctx.num_nodes > 1:
        try:  # the control kernels across nodes
            precompile_source("ops/ring_attention_x.cu")
        except Exception as exc:  # noqa: BLE001
            print(f"precompile failed, compiling lazily: {exc!r}")
    if ctx.local_rank == 0:
        try:  # the persistent kernels
            precompile_source("ops/ring_attention_fused.cu")
        except Exception as exc:  # noqa: BLE001
            print(f"precompile failed, compiling lazily: {exc!r}")
    yield from precompiled_with_long_timeout(_contexts, "ops/ring_attention.cu")


def _ring(ctx):
    """(rank, P) of the ring: the node's ranks, or the world's when the context spans several nodes."""
    return (ctx.rank, ctx.size) if ctx.num_nodes > 1 else (ctx.local_rank, ctx.local_size)


def _rows(ctx, S, causal):
    r, P = _ring(ctx)
    if causal:
        return zigzag_indices(S, P, r)
    n = S // P
    return np.arange(r * n, (r + 1) * n)


def _to_layout(x, layout):
    return np.ascontiguousarray(x if layout == "bshd" else x.transpose(0, 2, 1, 3))


def _run(ctx, rng, B, S, Hq, Hkv, D, *, causal, layout="bshd", dtype="bfloat16", calls=1, options=None):
    q = rng.standard_normal((B, S, Hq, D))
    k = rng.standard_normal((B, S, Hkv, D))
    v = rng.standard_normal((B, S, Hkv, D))
    rows = _rows(ctx, S, causal)
    qd, qx = upload(_to_layout(q[:, rows], layout), dtype)
    kd, kx = upload(_to_layout(k[:, rows], layout), dtype)
    vd, vx = upload(_to_layout(v[:, rows], layout), dtype)
    # the reference from the rounded values every rank holds
    from mkernel.core.dtypes import bf16_to_f32, f32_to_bf16

    def rnd(x):
        return bf16_to_f32(f32_to_bf16(x.astype(np.float32))).astype(np.float64) if dtype == "bfloat16" else \
            x.astype(np.float16).astype(np.float64)
    scale = 1.0 / np.sqrt(D)
    ref_o, ref_l = attention_reference(rnd(q), rnd(k), rnd(v), causal, scale)
    ref_o, ref_l = ref_o[:, rows], ref_l[:, :, rows]
    shape = qd.shape
    for _ in range(calls):
        out = DeviceArray.empty(shape, dtype).fill_nan()
        lse = DeviceArray.empty((B, Hq, len(rows)), "float32").fill_nan()
        mkernel.ring_attention(ctx, qd, kd, vd, out, lse=lse, causal=causal, layout=layout, options=options)
    ctx.synchronize()
    got = download(out)
    if layout == "bhsd":
        got = got.transpose(0, 2, 1, 3)
    what = f"B={B} S={S} Hq={Hq} Hkv={Hkv} D={D} causal={causal} {layout} {dtype} P={_ring(ctx)[1]} {options}"
    assert not np.isnan(got).any(), f"{what}: unwritten out"
    tol = 2e-2 * (np.abs(ref_o) + 0.05 * np.abs(v).max())
    bad = np.abs(got - ref_o) > tol
    assert not bad.any(), f"{what}: {bad.sum()} elements off, max err {np.abs(got - ref_o).max()}"
    gl = lse.to_numpy().astype(np.float64)
    assert np.abs(gl - ref_l).max() < 1e-3, f"{what}: lse max err {np.abs(gl - ref_l).max()}"
    return ctx.last_plan("ring_attention")


def _case_ids(cases) -> list:
    """Test ids of ``(B, S_local, H_q, H_kv, D, causal, layout)`` cases."""
    return [f"B{c[0]}-S{c[1]}-H{c[2]}x{c[3]}-D{c[4]}-{'causal' if c[5] else 'full'}-{c[6]}" for c in cases]


CASES = [  # (B, S_local, H_q, H_kv, D, causal, layout): S = S_local * P
    (1, 300, 4, 4, 128, False, "bshd"),
    (2, 340, 8, 2, 64, True, "bshd"),
    (1, 400, 8, 1, 128, True, "bhsd"),
    (1, 261, 4, 2, 64, False, "bhsd"),
    (2, 192, 8, 8, 128, True, "bshd"),
    (1, 130, 32, 8, 128, False, "bshd"),
]


@pytest.mark.parametrize("case", CASES, ids=_case_ids(CASES))
def test_against_float64(ctx, shared_rng, case):
    B, S_local, Hq, Hkv, D, causal, layout = case
    S = S_local * ctx.local_size
    plan = _run(ctx, shared_rng, B, S, Hq, Hkv, D, causal=causal, layout=layout)
    assert plan.P == ctx.local_size and len(plan.launches) == ctx.local_size


def test_float16(ctx, shared_rng):
    _run(ctx, shared_rng, 1, 2 * ctx.local_size * 150, 4, 2, 128, causal=True, dtype="float16")


def test_back_to_back_calls(ctx, shared_rng):
    """100 calls in a row (the double-buffered receive buffers and the flags cycle); the last is checked."""
    _run(ctx, shared_rng, 1, 2 * ctx.local_size * 130, 4, 2, 64, causal=False, calls=100)
    _run(ctx, shared_rng, 1, 2 * ctx.local_size * 130, 4, 2, 64, causal=True, calls=100)


def test_graph_capture(ctx, shared_rng):
    """After a first call, a call is captured into a CUDA graph and replayed on fresh inputs."""
    _graph_capture(ctx, shared_rng, 2 * _ring(ctx)[1] * 140)


def _graph_capture(ctx, shared_rng, S, options=None):
    from cuda.bindings import driver as cu

    from mkernel.core.driver import check

    B, H, D = 1, 4, 128
    rows = _rows(ctx, S, True)
    q, k, v = (shared_rng.standard_normal((B, S, H, D)) for _ in range(3))
    qd, kd, vd = (upload(x[:, rows], "bfloat16")[0] for x in (q, k, v))
    out = DeviceArray.empty(qd.shape, "bfloat16")
    lse = DeviceArray.empty((B, H, len(rows)), "float32")
    s = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    mkernel.ring_attention(ctx, qd, kd, vd, out, lse=lse, causal=True, stream=int(s), options=options)
    ctx.synchronize()
    g = capture(s, lambda: mkernel.ring_attention(ctx, qd, kd, vd, out, lse=lse, causal=True, stream=int(s),
                                                  options=options))
    ge = check(cu.cuGraphInstantiate(g, 0))
    ref = download(out)
    for _ in range(3):
        out.fill_nan()
        ctx.synchronize()
        check(cu.cuGraphLaunch(ge, s))
        ctx.synchronize(int(s))
        np.testing.assert_array_equal(download(out), ref)
    check(cu.cuGraphExecDestroy(ge))
    check(cu.cuGraphDestroy(g))
    check(cu.cuStreamDestroy(s))


def test_bad_inputs_launch_nothing(ctx):
    B, S, H, D = 1, 64, 4, 128
    q = DeviceArray.empty((B, S, H, D), "bfloat16")
    odd = DeviceArray.empty((B, S - 1, H, D), "bfloat16")
    short = DeviceArray.empty((B, S // 2, H, D), "bfloat16")
    d96 = DeviceArray.empty((B, S, H, 96), "bfloat16")
    out = DeviceArray.empty((B, S, H, D), "bfloat16").fill_nan()
    with pytest.raises(ValueError, match="even local"):
        mkernel.ring_attention(ctx, odd, odd, odd, causal=True)
    with pytest.raises(ValueError, match="same local sequence"):
        mkernel.ring_attention(ctx, q, short, short, out)
    with pytest.raises(ValueError, match="head dim"):
        mkernel.ring_attention(ctx, d96, d96, d96)
    ctx.synchronize()
    assert np.isnan(download(out)).all(), "a failing call launched something"


def test_zigzag_device_helpers(ctx, shared_rng):
    P, S = max(2, ctx.local_size), 2 * 4 * 5
    x = shared_rng.standard_normal((2, S, 3, 8)).astype(np.float32)
    xd = DeviceArray.from_numpy(x)
    shards = [mkernel.zigzag_shard(xd, (r, P), 1) for r in range(P)]
    for r, sh in enumerate(shards):
        np.testing.assert_array_equal(sh.to_numpy(), mkernel.zigzag_shard(x, (r, P), 1))
    cat = DeviceArray.from_numpy(np.concatenate([s.to_numpy() for s in shards], axis=1))
    np.testing.assert_array_equal(mkernel.zigzag_unshard(cat, P, 1).to_numpy(), x)


def test_zzz_missing_peer_times_out(ctx):
    if ctx.local_size < 2:
        pytest.skip("needs 2 ranks")
    q, _ = upload(np.ones((1, 256, 4, 128)), "bfloat16")
    assert_missing_peer_times_out(lambda c2: mkernel.ring_attention(c2, q, q, q), "ring_attention")


# ------------------------------------------------------------------ one persistent kernel
PERSISTENT = mkernel.RingAttentionOptions(persistent=True)
P_CASES = CASES + [  # more tiles than blocks: each block runs many query tiles through every step
    (2, 1000, 16, 4, 128, True, "bshd"),
    (1, 2050, 8, 8, 64, False, "bhsd"),
    (3, 1, 2, 1, 128, False, "bshd"),
    (1, 2, 2, 2, 64, True, "bshd"),
]


@pytest.mark.parametrize("case", P_CASES, ids=_case_ids(P_CASES))
def test_persistent_against_float64(ctx, shared_rng, case):
    B, S_local, Hq, Hkv, D, causal, layout = case
    plan = _run(ctx, shared_rng, B, S_local * ctx.local_size, Hq, Hkv, D, causal=causal, layout=layout,
                options=PERSISTENT)
    assert plan.persistent == (ctx.num_nodes == 1)


def test_persistent_float16_and_back_to_back_alternating_paths(ctx, shared_rng):
    """fp16; then calls alternating between the persistent kernel and the step launches (one workspace,
    other layouts of it) and 60 persistent calls in a row (the arrival flags and the home slots cycle)."""
    S = 2 * ctx.local_size * 150
    _run(ctx, shared_rng, 1, S, 4, 2, 128, causal=True, dtype="float16", options=PERSISTENT)
    for i in range(6):
        _run(ctx, shared_rng, 1, S + 2 * ctx.local_size * i, 4, 2, 64, causal=bool(i % 2),
             options=PERSISTENT if i % 3 else None)
    _run(ctx, shared_rng, 1, S, 4, 2, 64, causal=True, calls=60, options=PERSISTENT)


def test_persistent_graph_capture(ctx, shared_rng):
    _graph_capture(ctx, shared_rng, 2 * _ring(ctx)[1] * 140, PERSISTENT)


def test_zzz_persistent_missing_peer_times_out(ctx):
    if ctx.local_size < 2:
        pytest.skip("needs 2 ranks")
    q, _ = upload(np.ones((1, 256, 4, 128)), "bfloat16")
    assert_missing_peer_times_out(lambda c2: mkernel.ring_attention(c2, q, q, q, options=PERSISTENT), "ring_attention")


# ------------------------------------------------------------------ backward
def _run_bwd(ctx, rng, B, S, Hq, Hkv, D, *, causal, layout="bshd", dtype="bfloat16", calls=1, options=None):
    """Every rank: its rows of q, k, v, dout and of the float64 forward's out / lse (rounded to the dtype /
    float32) in; its rows of dq, dk, dv out (NaN-poisoned first), against the float64 gradients of full
    attention.  Tolerance: relative Frobenius error <= 2e-2 and max error <= 8e-2 of max |ref| per tensor
    (bf16 / fp16 inputs and P, dS rounded to the dtype for the tensor cores, fp32 accumulation)."""
    q, k, v, do = (rng.standard_normal((B, S, h, D)) for h in (Hq, Hkv, Hkv, Hq))
    rows = _rows(ctx, S, causal)
    ups = [upload(_to_layout(x[:, rows], layout), dtype) for x in (q, k, v, do)]
    (qd, _), (kd, _), (vd, _), (dod, _) = ups
    scale = 1.0 / np.sqrt(D)
    # the reference from the rounded values every rank holds
    rq, rk, rv, rdo = (np.empty_like(x) for x in (q, k, v, do))
    P = _ring(ctx)[1]
    for r in range(P):
        idx = zigzag_indices(S, P, r) if causal else np.arange(r * (S // P), (r + 1) * (S // P))
        for dst, src in ((rq, q), (rk, k), (rv, v), (rdo, do)):
            dst[:, idx] = upload(src[:, idx], dtype)[1]
    ref_o, ref_l, gq, gk, gv = attention_reference(rq, rk, rv, causal, scale, rdo)
    od, _ = upload(_to_layout(ref_o[:, rows], layout), dtype)
    lse = DeviceArray.from_numpy(np.ascontiguousarray(ref_l[:, :, rows]).astype(np.float32))
    for _ in range(calls):
        dq, dk, dv = (DeviceArray.empty(x.shape, dtype).fill_nan() for x in (qd, kd, vd))
        mkernel.ring_attention_backward(ctx, qd, kd, vd, od, lse, dod, dq, dk, dv, causal=causal, layout=layout,
                                        options=options)
    ctx.synchronize()
    what = f"B={B} S={S} Hq={Hq} Hkv={Hkv} D={D} causal={causal} {layout} {dtype} P={P} {options}"
    for name, got, ref in (("dq", dq, gq), ("dk", dk, gk), ("dv", dv, gv)):
        g = download(got)
        if layout == "bhsd":
            g = g.transpose(0, 2, 1, 3)
        ref = ref[:, rows]
        assert not np.isnan(g).any(), f"{what} {name}: NaN (unwritten) at {np.argwhere(np.isnan(g))[:4].tolist()}"
        err = np.linalg.norm(g - ref) / np.linalg.norm(ref)
        assert err <= 2e-2, f"{what} {name}: relative Frobenius error {err:.3e}"
        worst = np.abs(g - ref).max() / np.abs(ref).max()
        assert worst <= 8e-2, f"{what} {name}: max error {worst:.3e} of max |ref|"
    return download(dk), download(dv)


BWD_CASES = [  # (B, S_local, H_q, H_kv, D, causal, layout): S = S_local * P
    (1, 300, 4, 4, 128, False, "bshd"),
    (2, 340, 8, 2, 64, True, "bshd"),
    (1, 262, 8, 1, 128, True, "bhsd"),
]


@pytest.mark.parametrize("case", BWD_CASES, ids=_case_ids(BWD_CASES))
def test_backward_against_float64(ctx, shared_rng, case):
    B, S_local, Hq, Hkv, D, causal, layout = case
    _run_bwd(ctx, shared_rng, B, S_local * ctx.local_size, Hq, Hkv, D, causal=causal, layout=layout)
    plan = ctx.last_plan("ring_attention_backward")
    assert plan.P == ctx.local_size and plan.backward_kernel == "wgmma" and not plan.backward_fallback


MMA_BWD = mkernel.RingAttentionOptions(backward_kernel="mma")


@pytest.mark.parametrize("case", BWD_CASES, ids=_case_ids(BWD_CASES))
def test_backward_mma_kernel_against_float64(ctx, shared_rng, case):
    """The mma main kernel (the fallback where TMA cannot map the arrays, or asked for) gives the same."""
    B, S_local, Hq, Hkv, D, causal, layout = case
    _run_bwd(ctx, shared_rng, B, S_local * ctx.local_size, Hq, Hkv, D, causal=causal, layout=layout,
             options=MMA_BWD)
    assert ctx.last_plan("ring_attention_backward").backward_kernel == "mma"


def test_backward_back_to_back_and_deterministic(ctx):
    """20 calls in a row (flags, partial buffers and receive buffers cycle), fp16; dk, dv bit-identical
    between two runs on the same inputs (the fixed-order sum)."""
    a = _run_bwd(ctx, np.random.default_rng(7), 1, 2 * ctx.local_size * 150, 4, 2, 64, causal=True,
                 dtype="float16", calls=20)
    b = _run_bwd(ctx, np.random.default_rng(7), 1, 2 * ctx.local_size * 150, 4, 2, 64, causal=True,
                 dtype="float16", calls=1)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


# ------------------------------------------------------------------ across nodes
# Run with emulated nodes (each rank its own node, the TCP proxy between them):
#   mpirun -np 2 -x MKERNEL_RANKS_PER_NODE=1 python -m pytest -m internode tests/gpu/test_ring_attention.py
def _needs_nodes(ctx):
    if ctx.num_nodes < 2:
        pytest.skip("needs >= 2 (emulated) nodes: MKERNEL_RANKS_PER_NODE")


X_CASES = [  # (B, S_local, H_q, H_kv, D, causal, layout): S = S_local * world size
    (1, 300, 4, 4, 128, False, "bshd"),
    (2, 340, 8, 2, 64, True, "bshd"),
    (1, 262, 8, 1, 128, True, "bhsd"),
    (1, 261, 4, 2, 64, False, "bhsd"),
]


X_IDS = _case_ids(X_CASES)


@pytest.mark.internode
@pytest.mark.parametrize("case", X_CASES, ids=X_IDS)
def test_internode_against_float64(ctx, shared_rng, case):
    """The world ring (every world rank's block; zigzag over the world ranks for causal) against the float64
    reference, outputs NaN-poisoned first."""
    _needs_nodes(ctx)
    B, S_local, Hq, Hkv, D, causal, layout = case
    plan = _run(ctx, shared_rng, B, S_local * ctx.size, Hq, Hkv, D, causal=causal, layout=layout)
    assert plan.P == ctx.size and plan.rank == ctx.rank and len(plan.sources) == ctx.size


@pytest.mark.internode
def test_internode_back_to_back_calls(ctx, shared_rng):
    """50 calls in a row each (grants, ready flags and the proxy's drain cycle), non-causal then causal, fp16
    too; the last call of each is checked."""
    _needs_nodes(ctx)
    _run(ctx, shared_rng, 1, 2 * ctx.size * 130, 4, 2, 64, causal=False, calls=50)
    _run(ctx, shared_rng, 1, 2 * ctx.size * 130, 4, 2, 64, causal=True, calls=50)
    _run(ctx, shared_rng, 1, 2 * ctx.size * 150, 4, 2, 128, causal=True, dtype="float16", calls=5)


@pytest.mark.internode
def test_internode_graph_capture(ctx, shared_rng):
    """Across nodes: a first call inside a capture raises (its workspace and proxy are set up with a device
    synchronization) and leaves the capture intact; after an eager call the call is captured and replays
    bit-identical to it."""
    from cuda.bindings import driver as cu

    from mkernel.core.driver import check

    _needs_nodes(ctx)
    S = 2 * ctx.size * 4096  # (larger than any earlier test's: the first call needs a larger workspace)
    x = upload(np.zeros((1, len(_rows(ctx, S, True)), 4, 128)), "bfloat16")[0]
    out = DeviceArray.empty(x.shape, "bfloat16")
    s = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    with pytest.raises(RuntimeError, match="before capturing"):
        capture(s, lambda: mkernel.ring_attention(ctx, x, x, x, out, causal=True, stream=int(s)))
    check(cu.cuStreamDestroy(s))
    del x, out
    _graph_capture(ctx, shared_rng, 2 * ctx.size * 140)


@pytest.mark.internode
def test_internode_zigzag_of_the_context_is_the_world_ring(ctx):
    _needs_nodes(ctx)
    x = np.arange(4 * ctx.size * 3, dtype=np.float32).reshape(1, 4 * ctx.size, 3)
    np.testing.assert_array_equal(mkernel.zigzag_shard(x, ctx, 1), mkernel.zigzag_shard(x, (ctx.rank, ctx.size), 1))


@pytest.mark.internode
@pytest.mark.parametrize("case", X_CASES, ids=X_IDS)
def test_internode_backward_against_float64(ctx, shared_rng, case):
    """The backward over the world ring (K/V and the dK / dV partials of blocks owned on another node
    through the proxy) against the float64 gradients, dq / dk / dv NaN-poisoned first."""
    _needs_nodes(ctx)
    B, S_local, Hq, Hkv, D, causal, layout = case
    _run_bwd(ctx, shared_rng, B, S_local * ctx.size, Hq, Hkv, D, causal=causal, layout=layout)
    plan = ctx.last_plan("ring_attention_backward")
    assert plan.P == ctx.size and plan.rank == ctx.rank


@pytest.mark.internode
def test_internode_backward_back_to_back_and_deterministic(ctx):
    """20 calls in a row (grants, partial flags, the inbox and the proxy's drain cycle), causal fp16 and
    non-causal bf16; dk, dv bit-identical between runs on the same inputs (the world-rank-order sum)."""
    _needs_nodes(ctx)
    a = _run_bwd(ctx, np.random.default_rng(7), 1, 2 * ctx.size * 150, 4, 2, 64, causal=True, dtype="float16",
                 calls=20)
    b = _run_bwd(ctx, np.random.default_rng(7), 1, 2 * ctx.size * 150, 4, 2, 64, causal=True, dtype="float16",
                 calls=1)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    _run_bwd(ctx, np.random.default_rng(8), 1, 2 * ctx.size * 130, 8, 2, 128, causal=False, calls=20)


@pytest.mark.internode
def test_zzz_internode_backward_missing_peer_times_out(ctx):
    """Rank 0 calls the backward alone: it waits first for its ring predecessor's call count and times out
    naming world rank P - 1."""
    _needs_nodes(ctx)
    q, _ = upload(np.ones((1, 256, 4, 128)), "bfloat16")
    lse = DeviceArray.from_numpy(np.zeros((1, 4, 256), np.float32))
    assert_missing_peer_times_out(lambda c2: mkernel.ring_attention_backward(c2, q, q, q, q, lse, q),
                                  "ring_attention_backward", peer=ctx.size - 1)


@pytest.mark.internode
def test_zzz_internode_missing_peer_times_out(ctx):
    """Rank 0 calls alone: it waits first for its ring predecessor's call count and times out naming world
    rank P - 1."""
    _needs_nodes(ctx)
    q, _ = upload(np.ones((1, 256, 4, 128)), "bfloat16")
    assert_missing_peer_times_out(lambda c2: mkernel.ring_attention(c2, q, q, q), "ring_attention",
                                  peer=ctx.size - 1)
