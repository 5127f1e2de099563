"""MoE routing, dispatch, combine and the unfused layer against float64 numpy (mkernel.ops.moe.reference), on
every rank of ``mpirun -np N python -m pytest`` (N = 1 or 2; two ranks may share one GPU: the timeout is
raised to 60 s and no kernel needs its peer's to be resident).

Every rank draws all ranks' inputs from a generator seeded identically (fresh per test), so each rank can
build the whole reference.  Routing metadata (ids, slots, offsets, recv map) must match exactly; data
moves (dispatch) bit-exactly; combine within fp32 accumulation of bf16 rows (rounded to out's dtype);
the layer within bf16 rounding of the intermediate h / act / y (tolerance stated at the test).  Outputs
are NaN-poisoned first.
"""
from __future__ import annotations

import numpy as np
import pytest

import mkernel
from mkernel import MoeOptions
from mkernel.core.arrays import DeviceArray
from mkernel.ops.moe import reference as ref

from _util import capture, assert_missing_peer_times_out, download, poisoned, precompiled_with_long_timeout, upload

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

SOURCE = "ops/moe.cu"


@pytest.fixture(scope="module", autouse=True)
def _setup(_contexts):
    yield from precompiled_with_long_timeout(_contexts, SOURCE)


def _sync_stage(ctx, stage: str, slack: float = 30.0) -> None:
    """Wait for the default stream with a deadline (the context timeout + ``slack``): every device wait is
    bounded by the timeout, so a kernel still running past the deadline is stuck outside any bounded wait
    (a divergent warp primitive, an unbounded loop).  That names ``stage`` on stderr (uncaptured) and ends
    the process: nothing later could run on a stuck GPU, and mpirun then stops the job instead of hanging."""
    import os
    import sys
    import time

    from cuda.bindings import driver as cu
    from mkernel.core.driver import check

    print(f"[rank {ctx.rank}] moe smoke: {stage} ...", file=sys.__stderr__, flush=True)
    ev = check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
    try:
        check(cu.cuEventRecord(ev, cu.CUstream(0)))
        deadline = time.monotonic() + ctx.timeout + slack
        while True:
            r, = cu.cuEventQuery(ev)
            if r != cu.CUresult.CUDA_ERROR_NOT_READY:
                break
            if time.monotonic() > deadline:
                print(f"[rank {ctx.rank}] moe smoke: {stage} did not finish within the context timeout "
                      f"({ctx.timeout} s) + {slack} s: a kernel is stuck outside any bounded wait", file=sys.__stderr__,
                      flush=True)
                os._exit(3)
            time.sleep(1e-3)
    finally:
        cu.cuEventDestroy(ev)
    ctx.synchronize()  # raises what the kernels reported (a timeout names op, peer and flag)


def test_smoke_each_kernel_finishes(ctx, shared_rng):
    """First, so that a hang names its kernel: routing alone, then dispatch, then combine (H = 136 bf16: 17
    vectors per row, not a multiple of a warp's 32 lanes -- the shape that deadlocked mk_moe_combine), each
    waited for with a deadline (_sync_stage)."""
    P, me = ctx.local_size, ctx.local_rank
    T, k, E, H = 333, 1, 3 * P, 136
    R, ids, ws = _route_given(ctx, shared_rng, T, k, E, "random")
    _sync_stage(ctx, "moe_route (given ids: copies, mk_moe_route_tiles, _exchange, _slots)")
    lay = _check_layout(R, ids, E, me)
    xs = [upload(shared_rng.standard_normal((T, H)), "bfloat16") for _ in range(P)]
    xr = poisoned((R.recv_rows, H), "bfloat16")
    mkernel.moe_dispatch(ctx, xs[me][0], R, xr)
    _sync_stage(ctx, "moe_dispatch (mk_moe_dispatch)")
    _check_dispatch(R, xs, xr, lay, k, me)
    out = poisoned((T, H), "float32")
    mkernel.moe_combine(ctx, xr, R, out)
    _sync_stage(ctx, "moe_combine (mk_moe_combine)")
    assert not np.isnan(download(out)).any()


def test_combine_fp32_rows_not_a_multiple_of_8(ctx, shared_rng):
    """fp32 y with H % 8 == 4 (rows of 16-byte multiples, as validate allows): every column is summed."""
    P, me = ctx.local_size, ctx.local_rank
    T, k, E, H = 50, 2, 2 * P, 12
    R, ids, ws = _route_given(ctx, shared_rng, T, k, E, "random")
    x, _ = upload(shared_rng.standard_normal((T, H)), "float32")
    mkernel.moe_dispatch(ctx, x, R)  # (fills R.recv_map, which combine reads)
    ys = [upload(shared_rng.standard_normal((R.recv_rows, H)), "float32") for _ in range(P)]
    out = poisoned((T, H), "float32")
    mkernel.moe_combine(ctx, ys[me][0], R, out)
    _sync_stage(ctx, "moe_combine fp32 H=12")
    lay = ref.layout_reference(ids, E, 0, R.recv_rows)
    want = ref.combine_reference([y[1] for y in ys], ids, ws, [l["slots"] for l in lay], E)[me]
    got = download(out)
    assert not np.isnan(got).any()
    assert np.abs(got - want).max() <= 2.0 ** -20 * (np.abs(want).max() + k * max(np.abs(y[1]).max() for y in ys))


def _ids(rng, P, T, k, E, mode):
    """Every rank's [T, k] int32 expert ids (distinct per token) under a routing ``mode``."""
    out = []
    for _ in range(P):
        if mode == "random":
            ids = np.argsort(rng.random((T, E)), axis=1)[:, :k]
        elif mode == "one_expert":  # every token's first choice is expert 0; the rest random
            rest = np.argsort(rng.random((T, E - 1)), axis=1)[:, :k - 1] + 1
            ids = np.concatenate([np.zeros((T, 1), np.int64), rest], axis=1)
        elif mode == "rank0_only":  # rank 1 (and up) receives nothing
            El = E // P
            ids = np.argsort(rng.random((T, El)), axis=1)[:, :k]
        elif mode == "own_only":  # every rank picks only its own experts: every received row is local
            El = E // P
            ids = np.argsort(rng.random((T, El)), axis=1)[:, :k] + len(out) * El
        else:
            raise AssertionError(mode)
        out.append(ids.astype(np.int32))
    return out


def _route_given(ctx, rng, T, k, E, mode, options=None):
    P, me = ctx.local_size, ctx.local_rank
    ids = _ids(rng, P, T, k, E, mode)
    ws = [rng.random((T, k)).astype(np.float32) for _ in range(P)]
    R = mkernel.moe_route(ctx, topk_ids=DeviceArray.from_numpy(ids[me]),
                          topk_weights=DeviceArray.from_numpy(ws[me]), num_experts=E, options=options)
    return R, ids, ws


def _check_layout(R, ids, E, me, capacity=0):
    lay = ref.layout_reference(ids, E, capacity, R.recv_rows)
    np.testing.assert_array_equal(R.slots.to_numpy(), lay[me]["slots"])
    np.testing.assert_array_equal(R.expert_offsets.to_numpy(), lay[me]["expert_offsets"])
    if R.options.mode == "throughput":  # (moe_route's count exchange writes src_offsets; low-latency mode none)
        T, k = ids[me].shape
        np.testing.assert_array_equal(R.src_offsets.to_numpy(), ref.src_offsets_reference(lay[me], len(ids), T, k))
    return lay


def _check_dispatch(R, xs, xr, lay, k, me):
    """recv_map and the received rows (the first expert_offsets[-1]) bit-exact against the float64 layout;
    returns those rows (float64)."""
    n = int(lay[me]["expert_offsets"][-1])
    np.testing.assert_array_equal(R.recv_map.to_numpy()[:n], lay[me]["recv_src"])
    want = ref.dispatch_reference([x[1] for x in xs], lay, k)[me]
    np.testing.assert_array_equal(download(xr)[:n], want)
    return want


def _expert_outputs(rng, R, H, P):
    """Every rank's expert outputs y [recv_rows, H] (random, bf16 uploads)."""
    return [upload(rng.standard_normal((R.recv_rows, H)), "bfloat16") for _ in range(P)]


def _check_combine(ctx, ys, R, ids, ws, lay, E, k, me, out_dtype="float32", tol=2.0 ** -20, options=None):
    """combine of ``ys`` into a NaN-poisoned out, against float64: within ``tol`` (fp32 accumulation: 2^-20;
    a bf16 out: 2^-8) of the output's scale plus the k summed rows' scale."""
    T, H = ids[me].shape[0], ys[0][1].shape[1]
    out = poisoned((T, H), out_dtype)
    mkernel.moe_combine(ctx, ys[me][0], R, out, options=options)
    ctx.synchronize()
    want = ref.combine_reference([y[1] for y in ys], ids, ws, [l["slots"] for l in lay], E)[me]
    got = download(out)
    assert got.shape == want.shape and not np.isnan(got).any()
    if T:
        assert np.abs(got - want).max() <= tol * (np.abs(want).max() + k * np.abs(ys[0][1]).max()) + 1e-6


@pytest.mark.parametrize("T,k,E_local,mode", [(1000, 8, 4, "random"), (333, 1, 3, "random"), (517, 2, 4, "one_expert"),
                                              (300, 2, 2, "rank0_only"), (0, 2, 2, "random"), (70, 8, 8, "random")])
def test_route_dispatch_combine_given_ids(ctx, shared_rng, T, k, E_local, mode):
    P, me = ctx.local_size, ctx.local_rank
    E = E_local * P
    if k > E:
        pytest.skip("k > E")
    R, ids, ws = _route_given(ctx, shared_rng, T, k, E, mode)
    H = 136  # (17 vectors of 8 bf16: not a multiple of the warp's 32 lanes)
    xs = [upload(shared_rng.standard_normal((T, H)), "bfloat16") for _ in range(P)]
    xr = poisoned((R.recv_rows, H), "bfloat16")
    mkernel.moe_dispatch(ctx, xs[me][0], R, xr)
    ctx.synchronize()
    lay = _check_layout(R, ids, E, me)
    _check_dispatch(R, xs, xr, lay, k, me)
    # combine: expert outputs y (random, per rank), summed back with the weights
    ys = _expert_outputs(shared_rng, R, H, P)
    for od, tol in (("float32", 2.0 ** -20), ("bfloat16", 2.0 ** -8)):
        _check_combine(ctx, ys, R, ids, ws, lay, E, k, me, od, tol)


@pytest.mark.parametrize("ldt", ["float32", "bfloat16"])
@pytest.mark.parametrize("softmax", ["topk", "all"])
def test_route_from_logits(ctx, shared_rng, ldt, softmax):
    P, me = ctx.local_size, ctx.local_rank
    T, k, E = 777, 4, 8 * P
    logits = [upload(shared_rng.standard_normal((T, E)), ldt) for _ in range(P)]
    R = mkernel.moe_route(ctx, logits[me][0], k=k, options=MoeOptions(softmax=softmax))
    ctx.synchronize()
    ids, w = ref.topk_reference(logits[me][1], k, softmax)
    np.testing.assert_array_equal(R.ids.to_numpy(), ids)
    np.testing.assert_allclose(R.weights.to_numpy(), w, rtol=1e-5, atol=1e-6)
    all_ids = [ref.topk_reference(l[1], k)[0] for l in logits]
    _check_layout(R, all_ids, E, me)


def test_capacity_drops_deterministically(ctx, shared_rng):
    P, me = ctx.local_size, ctx.local_rank
    T, k, E = 400, 2, 4 * P
    opts = MoeOptions(expert_capacity=37)
    R, ids, ws = _route_given(ctx, shared_rng, T, k, E, "one_expert", options=opts)
    ctx.synchronize()
    assert R.capacity == 37 and R.recv_rows == 37 * (E // P)
    _check_layout(R, ids, E, me, capacity=37)


LAYER_PATHS = {"default": MoeOptions(), "fused": MoeOptions(fused=True),
               "low_latency": MoeOptions(mode="low_latency"), "swiglu_kernel": MoeOptions(swiglu_epilogue=False),
               "fused_swiglu_kernel": MoeOptions(fused=True, swiglu_epilogue=False),
               "fused_combine": MoeOptions(fused_combine=True),
               "fused_both": MoeOptions(fused=True, fused_combine=True)}
# (the others compute SwiGLU in the gate/up GEMM's epilogue; "fused" in the fused kernel's SwiGLU variant;
# "fused_combine" / "fused_both": the down GEMM + combine as one kernel, moe_gemm_combine -- not yet GPU-run)
SWIGLU_KERNEL_PATHS = ("swiglu_kernel", "fused_swiglu_kernel")


def _layer_inputs(rng, P, T, E_local, H, F):
    """Every rank's logits [T, E], x [T, H] and weights (gate/up [E_local, 2F, H], down [E_local, H, F]), bf16
    uploads of N(0, 1) / sqrt(fan-in) values (the same on every rank: a shared generator)."""
    E = E_local * P
    logits = [rng.standard_normal((T, E)).astype(np.float32) for _ in range(P)]
    xs = [upload(rng.standard_normal((T, H)), "bfloat16") for _ in range(P)]
    wgs = [upload(rng.standard_normal((E_local, 2 * F, H)) / np.sqrt(H), "bfloat16") for _ in range(P)]
    wds = [upload(rng.standard_normal((E_local, H, F)) / np.sqrt(F), "bfloat16") for _ in range(P)]
    return logits, xs, wgs, wds


def _layer_want(logits, xs, wgs, wds, k, E, me):
    """Rank ``me``'s layer output in float64 (top-k of the logits, the one-node slot order)."""
    ids = [ref.topk_reference(l, k)[0] for l in logits]
    wts = [ref.topk_reference(l, k)[1] for l in logits]
    lay = ref.layout_reference(ids, E)
    return ref.layer_reference([x[1] for x in xs], ids, wts, [l["slots"] for l in lay], [w[1] for w in wgs],
                               [w[1] for w in wds])[me]


@pytest.mark.parametrize("path", list(LAYER_PATHS))
@pytest.mark.parametrize("T,k,E_local,H,F", [(300, 2, 4, 256, 128), (129, 8, 8, 512, 256)])
def test_layer_against_float64(ctx, shared_rng, T, k, E_local, H, F, path):
    """The layer on each path (default: SwiGLU in the gate/up GEMM's epilogue; fused dispatch + gate/up GEMM
    with SwiGLU in its epilogue, or writing h for the separate kernel; low-latency dispatch; the separate
    SwiGLU kernel) against float64."""
    P, me = ctx.local_size, ctx.local_rank
    opts = LAYER_PATHS[path]
    if path == "low_latency" and T > 256:
        pytest.skip("low-latency mode takes <= 256 tokens per rank")
    E = E_local * P
    logits, xs, wgs, wds = _layer_inputs(shared_rng, P, T, E_local, H, F)
    out = poisoned((T, H), "bfloat16")
    o, R = mkernel.moe_layer(ctx, xs[me][0], wgs[me][0], wds[me][0], DeviceArray.from_numpy(logits[me]), k=k,
                             out=out, options=opts)
    ctx.synchronize()
    plan = ctx.op_state("moe_layer").last_plan
    assert plan.swiglu == ("kernel" if path in SWIGLU_KERNEL_PATHS else "epilogue")
    assert plan.combine == ("fused" if opts.fused_combine else "kernel")
    want = _layer_want(logits, xs, wgs, wds, k, E, me)
    got = download(o)
    # h, act and y are rounded to bf16 (3 roundings of 2**-8 relative, amplified by at most ~4 through
    # SwiGLU and the down projection), the out once more: 2**-5 of the output's scale
    err = np.abs(got - want).max()
    assert not np.isnan(got).any()
    assert err <= 2.0 ** -5 * np.abs(want).max(), err


@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
@pytest.mark.parametrize("offs,H,F,config", [
    ([0, 0, 300, 301, 301, 1000], 256, 128, None),   # empty groups, a 1-row group, rows not multiples of 128
    ([0, 129, 700], 512, 2048, None),
    ([5, 200, 455], 136, 96, 4),                      # 96-wide pairs (192-column tiles); rows outside [5, 455)
    ([0, 64, 200], 64, 192, 2),                       # several N tiles per group on 64-wide pairs
    ([0, 333, 900], 256, 320, 42),                    # 160-wide pairs (two n160 wgmmas, one TMA box per half)
    ([0, 500, 501], 192, 256, 18),                    # one consumer warpgroup, 64 x 256 tiles
    ([0, 300, 700], 128, 576, 40),                    # three consumer warpgroups (192-row tiles)
])
def test_grouped_gemm_swiglu_against_float64(ctx, shared_rng, offs, H, F, config, dt):
    """mkernel.ops.gemm.grouped_gemm_swiglu: act = silu(h[:, :F]) * h[:, F:] of h = a @ w[g].T per group, from
    fp32 accumulators (one rounding to the output dtype), against float64 of the rounded inputs; rows outside
    [o[0], o[G]) stay untouched (NaN-poisoned); host and device offsets give the same bits on one config."""
    from mkernel.ops import gemm as G

    T, E = offs[-1] + 7, len(offs) - 1
    a, av = upload(shared_rng.standard_normal((T, H)), dt)
    w, wv = upload(shared_rng.standard_normal((E, 2 * F, H)) / np.sqrt(H), dt)
    act = poisoned((T, F), dt)
    G.grouped_gemm_swiglu(a, w, offs, act, config=config)
    ctx.synchronize()
    plan = G.last_plan("grouped_gemm_swiglu")
    assert plan.config in G.swiglu_candidates(F) and (config is None or plan.config == config)
    got = download(act)
    want = np.full((T, F), np.nan)
    for g in range(E):
        h = av[offs[g]:offs[g + 1]] @ wv[g].T
        want[offs[g]:offs[g + 1]] = h[:, :F] / (1 + np.exp(-h[:, :F])) * h[:, F:]
    inside = slice(offs[0], offs[-1])
    assert np.isnan(got[:offs[0]]).all() and np.isnan(got[offs[-1]:]).all()
    assert not np.isnan(got[inside]).any()
    # fp32 sums and SwiGLU (relative 2**-20-ish), then one rounding to bf16 (2**-8) / fp16 (2**-11)
    tol = (2.0 ** -8 if dt == "bfloat16" else 2.0 ** -11) * np.abs(want[inside]).max() + 1e-6
    assert np.abs(got[inside] - want[inside]).max() <= tol
    d = DeviceArray.from_numpy(np.asarray(offs, np.int64))
    act2 = poisoned((T, F), dt)
    G.grouped_gemm_swiglu(a, w, d, act2, config=plan.config)  # (device offsets: the same tiles)
    ctx.synchronize()
    np.testing.assert_array_equal(download(act2)[inside], got[inside])


@pytest.mark.parametrize("F,opts", [(40, MoeOptions(swiglu_epilogue=True)), (40, MoeOptions(fused=True)),
                                    (72, MoeOptions(fused=True))])
def test_layer_swiglu_epilogue_falls_back_on_odd_F(ctx, shared_rng, F, opts):
    """F = 40 (no config pairs it), or fused with F = 72 (only grouped_gemm_swiglu's config 24 pairs it): the
    layer runs the separate SwiGLU kernel, and its plan says so."""
    P, me = ctx.local_size, ctx.local_rank
    T, k, El, H = 64, 2, 2, 128
    E = El * P
    logits, xs, wgs, wds = _layer_inputs(shared_rng, P, T, El, H, F)
    out = poisoned((T, H), "bfloat16")
    mkernel.moe_layer(ctx, xs[me][0], wgs[me][0], wds[me][0], DeviceArray.from_numpy(logits[me]), k=k, out=out,
                      options=opts)
    ctx.synchronize()
    assert ctx.op_state("moe_layer").last_plan.swiglu == "kernel"
    want = _layer_want(logits, xs, wgs, wds, k, E, me)
    got = download(out)
    assert not np.isnan(got).any()
    assert np.abs(got - want).max() <= 2.0 ** -5 * np.abs(want).max()


@pytest.mark.parametrize("T,k,E_local,mode,H,F2", [(1000, 8, 4, "random", 256, 264), (333, 1, 3, "random", 136, 128),
                                                   (517, 2, 4, "one_expert", 512, 520), (300, 2, 2, "rank0_only", 64, 96),
                                                   (0, 2, 2, "random", 128, 128), (70, 8, 8, "random", 192, 4096),
                                                   (700, 2, 2, "own_only", 128, 256)])
def test_dispatch_gemm_against_float64(ctx, shared_rng, T, k, E_local, mode, H, F2):
    """mkernel.moe_dispatch_gemm: x_recv and recv_map exactly as moe_dispatch's, h = x_recv @ w[l].T within
    bf16 rounding of an fp32 sum (2**-7 of the row scale); shapes not multiples of the 128-row blocks; tiles
    in the local-first order (own-row blocks first; "own_only": every block, none from a peer)."""
    P, me = ctx.local_size, ctx.local_rank
    E = E_local * P
    if k > E:
        pytest.skip("k > E")
    R, ids, ws = _route_given(ctx, shared_rng, T, k, E, mode)
    xs = [upload(shared_rng.standard_normal((T, H)), "bfloat16") for _ in range(P)]
    wg, wgv = upload(shared_rng.standard_normal((E_local, F2, H)) / np.sqrt(H), "bfloat16")
    xr = poisoned((R.recv_rows, H), "bfloat16")
    h = poisoned((R.recv_rows, F2), "bfloat16")
    got_h, got_xr = mkernel.moe_dispatch_gemm(ctx, xs[me][0], R, wg, h, x_recv=xr)
    _sync_stage(ctx, "moe_dispatch_gemm (mk_moe_dispatch_gemm)")
    assert got_h is h and got_xr is xr
    lay = _check_layout(R, ids, E, me)
    o = lay[me]["expert_offsets"]
    n = int(o[-1])
    want = _expert_products(_check_dispatch(R, xs, xr, lay, k, me), wgv, o)
    got = download(h)[:n]
    assert not np.isnan(got).any()
    if n:
        assert np.abs(got - want).max() <= 2.0 ** -7 * np.abs(want).max() + 1e-6


def _expert_products(xrv, wgv, o):
    """h [o[-1], 2F] in float64: each received row times its local expert's w_gate_up."""
    h = np.zeros((int(o[-1]), wgv.shape[1]))
    for l in range(len(o) - 1):
        h[o[l]:o[l + 1]] = xrv[o[l]:o[l + 1]].astype(np.float64) @ wgv[l].astype(np.float64).T
    return h


@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
@pytest.mark.parametrize("T,k,E_local,mode,H,F,config", [
    (1000, 8, 4, "random", 256, 128, None),     # config 2 (2F = 256), rows not multiples of 128
    (70, 8, 8, "random", 192, 2048, None),      # config 3, 16 N tiles per row block
    (517, 2, 4, "one_expert", 136, 96, None),   # config 4: 96-wide pairs; H = 136 (not a multiple of 64)
    (300, 2, 2, "rank0_only", 128, 112, None),  # config 5: 112-wide pairs
    (333, 1, 3, "random", 64, 192, 1),          # config 1: 64-row tiles, one consumer warpgroup
    (0, 2, 2, "random", 128, 128, None),        # nothing received: act untouched
])
def test_dispatch_gemm_swiglu_against_float64(ctx, shared_rng, T, k, E_local, mode, H, F, config, dt):
    """mkernel.moe_dispatch_gemm(swiglu=True): x_recv and recv_map exactly as moe_dispatch's; act =
    silu(h[:, :F]) * h[:, F:] of h = x_recv @ w[l].T from fp32 accumulators, one rounding to the output dtype,
    against float64; rows past o[E_local] stay NaN-poisoned; the plan says "epilogue"."""
    P, me = ctx.local_size, ctx.local_rank
    E = E_local * P
    if k > E:
        pytest.skip("k > E")
    opts = MoeOptions(gemm_config=config)
    R, ids, ws = _route_given(ctx, shared_rng, T, k, E, mode)
    xs = [upload(shared_rng.standard_normal((T, H)), dt) for _ in range(P)]
    wg, wgv = upload(shared_rng.standard_normal((E_local, 2 * F, H)) / np.sqrt(H), dt)
    xr = poisoned((R.recv_rows, H), dt)
    act = poisoned((R.recv_rows, F), dt)
    got_act, got_xr = mkernel.moe_dispatch_gemm(ctx, xs[me][0], R, wg, act, x_recv=xr, options=opts, swiglu=True)
    _sync_stage(ctx, "moe_dispatch_gemm swiglu (mk_moe_dispatch_gemm, MK_MOE_SWIGLU)")
    assert got_act is act and got_xr is xr
    assert ctx.op_state("moe_dispatch_gemm").last_plan.swiglu == "epilogue"
    lay = _check_layout(R, ids, E, me)
    o = lay[me]["expert_offsets"]
    n = int(o[-1])
    h = _expert_products(_check_dispatch(R, xs, xr, lay, k, me), wgv, o)
    want = h[:, :F] / (1 + np.exp(-h[:, :F])) * h[:, F:]
    got = download(act)
    assert np.isnan(got[n:]).all() and not np.isnan(got[:n]).any()
    if n:
        # fp32 sums and SwiGLU (relative 2**-20-ish), then one rounding to bf16 (2**-8) / fp16 (2**-11)
        tol = (2.0 ** -8 if dt == "bfloat16" else 2.0 ** -11) * np.abs(want).max() + 1e-6
        assert np.abs(got[:n] - want).max() <= tol


def test_dispatch_gemm_back_to_back(ctx, shared_rng):
    """200 fused calls with changing routings (arrival counters re-zeroed, epochs and staging handshakes
    across calls); every 50th checked."""
    P, me = ctx.local_size, ctx.local_rank
    T, k, E_local, H, F2 = 150, 2, 3, 128, 256
    E = E_local * P
    R = mkernel.MoeRouting.empty(ctx, T, k, E)
    h = DeviceArray.empty((R.recv_rows, F2), "bfloat16")
    wg, wgv = upload(shared_rng.standard_normal((E_local, F2, H)) / np.sqrt(H), "bfloat16")
    ones = DeviceArray.from_numpy(np.ones((T, k), np.float32))
    for it in range(200):
        ids = _ids(shared_rng, P, T, k, E, "random")
        xs = [upload(shared_rng.standard_normal((T, H)), "bfloat16") for _ in range(P)]
        mkernel.moe_route(ctx, topk_ids=DeviceArray.from_numpy(ids[me]), topk_weights=ones, num_experts=E, out=R)
        _, xr = mkernel.moe_dispatch_gemm(ctx, xs[me][0], R, wg, h)
        if it % 50 == 0:
            ctx.synchronize()
            lay = ref.layout_reference(ids, E)
            _check_dispatch(R, xs, xr, lay, k, me)
    ctx.synchronize()


# ---- the down GEMM + combine, fused (moe_gemm_combine; docs/moe.md "Down GEMM + combine, fused": not yet GPU-run)
def _gemm_combine_want(acts, wds, ids, ws, lay, E, me):
    """Rank ``me``'s out in float64: every rank's y = act @ w_down[l].T (rounded to bf16, as the kernel's
    staging rows are), summed by the owners as combine_reference does."""
    ys = []
    for d, lay_d in enumerate(lay):
        o = lay_d["expert_offsets"]
        y = np.zeros((acts[d].shape[0], wds[d].shape[1]))
        for l in range(len(o) - 1):
            y[o[l]:o[l + 1]] = acts[d][o[l]:o[l + 1]] @ wds[d][l].T
        ys.append(upload(y, "bfloat16")[1])
    return ref.combine_reference(ys, ids, ws, [l["slots"] for l in lay], E)[me]


@pytest.mark.parametrize("T,k,E_local,mode,H,F,capacity", [
    (300, 2, 4, "random", 256, 128, 0), (129, 8, 8, "random", 512, 256, 0), (333, 1, 3, "random", 136, 64, 0),
    (517, 2, 4, "one_expert", 264, 72, 0), (200, 2, 4, "rank0_only", 128, 64, 0), (1, 1, 2, "random", 64, 32, 0),
    (400, 2, 4, "one_expert", 256, 64, 37)])
def test_gemm_combine_against_float64(ctx, shared_rng, T, k, E_local, mode, H, F, capacity):
    """moe_gemm_combine after route + dispatch against float64 (NaN-poisoned out; random, one hot expert, a rank
    receiving nothing, top-1 / top-8, T = 1, H not a multiple of the tile width, a capacity dropping pairs);
    a second call gives the same bits (fixed summation order)."""
    P, me = ctx.local_size, ctx.local_rank
    E = E_local * P
    opts = MoeOptions(expert_capacity=capacity) if capacity else None
    R, ids, ws = _route_given(ctx, shared_rng, T, k, E, mode, options=opts)
    xs = [upload(shared_rng.standard_normal((T, 16)), "bfloat16") for _ in range(P)]
    mkernel.moe_dispatch(ctx, xs[me][0], R, options=opts)
    acts = [upload(shared_rng.standard_normal((R.recv_rows, F)), "bfloat16") for _ in range(P)]
    wds = [upload(shared_rng.standard_normal((E_local, H, F)) / np.sqrt(F), "bfloat16") for _ in range(P)]
    out = poisoned((T, H), "bfloat16")
    mkernel.moe_gemm_combine(ctx, acts[me][0], R, wds[me][0], out, options=opts)
    ctx.synchronize()
    assert ctx.op_state("moe_gemm_combine").last_plan.combine == "fused"
    lay = ref.layout_reference(ids, E, capacity, R.recv_rows)
    want = _gemm_combine_want([a[1] for a in acts], [w[1] for w in wds], ids, ws, lay, E, me)
    got = download(out)
    assert not np.isnan(got).any()
    # y rounded to bf16 (also in the reference), fp32 sums, out rounded once: 2**-7 of the scale
    scale = np.abs(want).max() + 1e-3
    assert np.abs(got - want).max() <= 2.0 ** -7 * scale
    first = out.to_numpy().copy()
    mkernel.moe_gemm_combine(ctx, acts[me][0], R, wds[me][0], out, options=opts)
    ctx.synchronize()
    np.testing.assert_array_equal(out.to_numpy(), first)


def test_gemm_combine_after_calls_of_other_sizes(ctx, shared_rng):
    """Calls of other T, k and H share the op's workspace: a call's pair counters lie where an earlier call's
    staging rows did (bf16 data there once made a counter wait forever).  Large rows first, then many small
    pairs, then the first again; each against float64."""
    P, me = ctx.local_size, ctx.local_rank
    for T, k, E_local, H, F in ((300, 2, 4, 256, 128), (129, 8, 8, 512, 64), (517, 2, 3, 136, 64),
                                (300, 2, 4, 256, 128)):
        E = E_local * P
        R, ids, ws = _route_given(ctx, shared_rng, T, k, E, "random")
        mkernel.moe_dispatch(ctx, upload(shared_rng.standard_normal((T, 16)), "bfloat16")[0], R)
        acts = [upload(shared_rng.standard_normal((R.recv_rows, F)), "bfloat16") for _ in range(P)]
        wds = [upload(shared_rng.standard_normal((E_local, H, F)) / np.sqrt(F), "bfloat16") for _ in range(P)]
        out = poisoned((T, H), "bfloat16")
        mkernel.moe_gemm_combine(ctx, acts[me][0], R, wds[me][0], out)
        ctx.synchronize()
        want = _gemm_combine_want([a[1] for a in acts], [w[1] for w in wds], ids, ws,
                                  ref.layout_reference(ids, E, 0, R.recv_rows), E, me)
        assert np.abs(download(out) - want).max() <= 2.0 ** -7 * (np.abs(want).max() + 1e-3), (T, k, H)


def test_gemm_combine_back_to_back_changing_routings(ctx, shared_rng):
    """200 route + dispatch + fused down GEMM + combine calls with fresh routings (the pair counters zeroed by
    their owners, epochs and staging handshakes across calls); every 50th checked against float64."""
    P, me = ctx.local_size, ctx.local_rank
    T, k, E_local, H, F = 150, 2, 3, 128, 64
    E = E_local * P
    R = mkernel.MoeRouting.empty(ctx, T, k, E)
    wds = [upload(shared_rng.standard_normal((E_local, H, F)) / np.sqrt(F), "bfloat16") for _ in range(P)]
    out = DeviceArray.empty((T, H), "bfloat16")
    x = DeviceArray.empty((T, 16), "bfloat16")
    for it in range(200):
        ids = _ids(shared_rng, P, T, k, E, "random")
        ws = [shared_rng.random((T, k)).astype(np.float32) for _ in range(P)]
        acts = [upload(shared_rng.standard_normal((R.recv_rows, F)), "bfloat16") for _ in range(P)]
        mkernel.moe_route(ctx, topk_ids=DeviceArray.from_numpy(ids[me]), topk_weights=DeviceArray.from_numpy(ws[me]),
                          num_experts=E, out=R)
        mkernel.moe_dispatch(ctx, x, R)
        mkernel.moe_gemm_combine(ctx, acts[me][0], R, wds[me][0], out)
        if it % 50 == 0:
            ctx.synchronize()
            lay = ref.layout_reference(ids, E)
            want = _gemm_combine_want([a[1] for a in acts], [w[1] for w in wds], ids, ws, lay, E, me)
            assert np.abs(download(out) - want).max() <= 2.0 ** -7 * (np.abs(want).max() + 1e-3)
    ctx.synchronize()


def test_gemm_combine_bad_inputs_raise_before_launch(ctx):
    P = ctx.local_size
    E = 2 * P
    R = mkernel.moe_route(ctx, DeviceArray.empty((10, E), "float32"), k=1)
    act, wd = DeviceArray.empty((R.recv_rows, 64), "bfloat16"), DeviceArray.empty((2, 128, 64), "bfloat16")
    with pytest.raises(ValueError):
        mkernel.moe_gemm_combine(ctx, DeviceArray.empty((3, 64), "bfloat16"), R, wd)  # not recv_rows rows
    with pytest.raises(TypeError):
        mkernel.moe_gemm_combine(ctx, act, R, wd, DeviceArray.empty((10, 128), "float32"))  # out not act's dtype
    with pytest.raises(ValueError):
        mkernel.moe_gemm_combine(ctx, act, R, DeviceArray.empty((2, 128, 32), "bfloat16"))  # F differs
    ctx.synchronize()


def test_gemm_combine_missing_peer_times_out(ctx):
    """Every rank routes, dispatches and runs the fused kernel once; then rank 0 alone runs it again: its wait
    for peer 1's call ends in CommTimeout naming moe_gemm_combine, rank 0 and peer 1."""
    if ctx.size < 2:
        pytest.skip("needs 2 ranks")
    T, E, H, F = 64, 2 * ctx.local_size, 128, 64
    made = {}

    def call(c2):
        if "R" not in made:  # (every rank, once: the routing and its dispatch)
            made["R"] = R = mkernel.moe_route(c2, DeviceArray.from_numpy(np.zeros((T, E), np.float32)), k=1)
            mkernel.moe_dispatch(c2, DeviceArray.empty((T, 16), "bfloat16"), R)
            made["act"] = DeviceArray.empty((R.recv_rows, F), "bfloat16")
            made["wd"] = DeviceArray.empty((2, H, F), "bfloat16")
        mkernel.moe_gemm_combine(c2, made["act"], made["R"], made["wd"])
    assert_missing_peer_times_out(call, "moe_gemm_combine")


# ---- the layer in one kernel (moe_layer with MoeOptions(one_kernel=True); docs/moe.md "The layer in one kernel":
# not yet GPU-run)
ONE = MoeOptions(one_kernel=True)


def _one_kernel_inputs(rng, P, T, k, E_local, mode, H, F, dt):
    """Every rank's ids [T, k], weights [T, k] (float32), x [T, H] and weights (gate/up [E_local, 2F, H], down
    [E_local, H, F]) uploaded in ``dt`` (N(0, 1) / sqrt(fan-in)), the same on every rank (a shared generator)."""
    E = E_local * P
    ids = _ids(rng, P, T, k, E, mode)
    ws = [rng.random((T, k)).astype(np.float32) for _ in range(P)]
    xs = [upload(rng.standard_normal((T, H)), dt) for _ in range(P)]
    wgs = [upload(rng.standard_normal((E_local, 2 * F, H)) / np.sqrt(H), dt) for _ in range(P)]
    wds = [upload(rng.standard_normal((E_local, H, F)) / np.sqrt(F), dt) for _ in range(P)]
    return ids, ws, xs, wgs, wds


def _one_kernel_layer(ctx, me, ids, ws, xs, wgs, wds, out, options=ONE, stream=None):
    return mkernel.moe_layer(ctx, xs[me][0], wgs[me][0], wds[me][0], topk_ids=DeviceArray.from_numpy(ids[me]),
                             topk_weights=DeviceArray.from_numpy(ws[me]), out=out, stream=stream, options=options)


def _one_kernel_want(ids, ws, xs, wgs, wds, lay, me):
    """Rank ``me``'s layer output in float64 (the kept pairs of ``lay``)."""
    return ref.layer_reference([x[1] for x in xs], ids, ws, [l["slots"] for l in lay], [w[1] for w in wgs],
                               [w[1] for w in wds])[me]


@pytest.mark.parametrize("T,k,E_local,mode,H,F,dt,config,capacity", [
    (300, 2, 4, "random", 256, 128, "bfloat16", None, 0),      # config 2 (64-wide pairs)
    (129, 8, 8, "random", 512, 256, "bfloat16", None, 0),      # top-8, config 3 (128-wide pairs)
    (333, 1, 3, "random", 136, 64, "float16", None, 0),        # top-1, fp16, H not a multiple of the tile width
    (517, 2, 4, "one_expert", 264, 96, "bfloat16", None, 0),   # one hot expert, config 4 (96-wide pairs)
    (300, 1, 4, "one_expert", 128, 112, "bfloat16", None, 0),  # every token to expert 0: empty experts, rank 1
    #                                                            receives nothing; config 5 (112-wide pairs)
    (200, 2, 4, "rank0_only", 192, 128, "float16", None, 0),   # ranks past 0 receive nothing
    (1, 1, 2, "random", 64, 64, "bfloat16", None, 0),          # one token
    (333, 2, 3, "random", 128, 192, "bfloat16", 1, 0),         # config 1: 64-row tiles, one consumer warpgroup
    (400, 2, 4, "one_expert", 256, 64, "bfloat16", None, 37),  # a capacity dropping pairs
])
def test_layer_one_kernel_against_float64(ctx, shared_rng, T, k, E_local, mode, H, F, dt, config, capacity):
    """moe_layer with one_kernel (route, then mk_moe_layer) against float64 and against the composed layer of
    the same inputs (NaN-poisoned outs): the plan says "layer" / "epilogue"; the routing returned is the
    dispatch map (slots, offsets and recv_map exactly the reference's); a second call gives the same bits."""
    P, me = ctx.local_size, ctx.local_rank
    E = E_local * P
    if k > E:
        pytest.skip("k > E")
    opts = MoeOptions(one_kernel=True, gemm_config=config, expert_capacity=capacity or None)
    ids, ws, xs, wgs, wds = _one_kernel_inputs(shared_rng, P, T, k, E_local, mode, H, F, dt)
    out = poisoned((T, H), dt)
    o, R = _one_kernel_layer(ctx, me, ids, ws, xs, wgs, wds, out, opts)
    _sync_stage(ctx, f"moe_layer one kernel (mk_moe_layer) T={T} k={k} H={H} F={F} {dt}")
    assert o is out
    plan = ctx.op_state("moe_layer").last_plan
    assert (plan.combine, plan.swiglu) == ("layer", "epilogue")
    assert ctx.op_state("moe_ffn_fused").last_plan.grid == ctx.resident_sms
    lay = _check_layout(R, ids, E, me, capacity)
    n = int(lay[me]["expert_offsets"][-1])
    np.testing.assert_array_equal(R.recv_map.to_numpy()[:n], lay[me]["recv_src"])
    want = _one_kernel_want(ids, ws, xs, wgs, wds, lay, me)
    got = download(out)
    assert not np.isnan(got).any()
    scale = np.abs(want).max() + 1e-3
    # act, y and out rounded to dt (3 roundings of <= 2**-8 relative, amplified by at most ~4 through SwiGLU and
    # the down projection): 2**-5 of the output's scale, as the composed layer's test
    assert np.abs(got - want).max() <= 2.0 ** -5 * scale
    composed = poisoned((T, H), dt)
    _one_kernel_layer(ctx, me, ids, ws, xs, wgs, wds, composed,
                      MoeOptions(gemm_config=config, expert_capacity=capacity or None))
    ctx.synchronize()
    assert ctx.op_state("moe_layer").last_plan.combine == "kernel"
    # the same roundings in both (act from fp32 accumulators, y, out), fp32 sums in other orders: the out's
    # rounding and rare one-ulp flips of act or y
    assert np.abs(got - download(composed)).max() <= 2.0 ** -6 * scale
    first = out.to_numpy().copy()
    _one_kernel_layer(ctx, me, ids, ws, xs, wgs, wds, out, opts)
    ctx.synchronize()
    np.testing.assert_array_equal(out.to_numpy(), first)


def test_layer_one_kernel_back_to_back_changing_routings(ctx, shared_rng):
    """200 one-kernel layers with fresh routings, choice weights and x each call, alternating between two token
    counts (two bound calls on one workspace; counters re-zeroed, epochs and staging handshakes across calls),
    the workspace's data region filled with 0xFF between some calls (what a call of another shape leaves there:
    the combine's counters must not read it as counts); every 25th call checked against float64."""
    from mkernel.ops.moe import layout as ML

    from _util import poison_workspace_tail

    P, me = ctx.local_size, ctx.local_rank
    k, E_local, H, F = 2, 3, 128, 64
    E = E_local * P
    wgs, wds = _one_kernel_inputs(shared_rng, P, 1, 1, E_local, "random", H, F, "bfloat16")[3:]
    outs = {T: DeviceArray.empty((T, H), "bfloat16") for T in (150, 37)}
    for it in range(200):
        T = 150 if it % 2 == 0 else 37
        ids = _ids(shared_rng, P, T, k, E, "random")
        ws = [shared_rng.random((T, k)).astype(np.float32) for _ in range(P)]
        xs = [upload(shared_rng.standard_normal((T, H)), "bfloat16") for _ in range(P)]
        _one_kernel_layer(ctx, me, ids, ws, xs, wgs, wds, outs[T])
        if it % 25 == 0:
            ctx.synchronize()
            assert ctx.op_state("moe_layer").last_plan.combine == "layer"
            want = _one_kernel_want(ids, ws, xs, wgs, wds, ref.layout_reference(ids, E), me)
            assert np.abs(download(outs[T]) - want).max() <= 2.0 ** -5 * (np.abs(want).max() + 1e-3)
        if it % 50 == 49:
            rr = P * T * min(k, E_local)
            first_data = ML.layer_layout(P, T, k, H * 2, H * 2, rr)[0].counts_off  # (the same for every shape)
            poison_workspace_tail(ctx, ctx._workspaces[("moe_ffn_fused",)], first_data)
    ctx.synchronize()


def test_layer_one_kernel_graph_replay(ctx, shared_rng):
    """moe_layer with one_kernel (route, the counters' memsets, the kernel) captured once into a CUDA graph after
    an eager call, replayed with fresh ids and rows copied into the captured buffers; each replay against
    float64."""
    from cuda.bindings import driver as cu
    from mkernel.core.driver import check

    P, me = ctx.local_size, ctx.local_rank
    T, k, E_local, H, F = 200, 2, 4, 128, 128
    E = E_local * P
    _, ws, _, wgs, wds = _one_kernel_inputs(shared_rng, P, T, k, E_local, "random", H, F, "bfloat16")
    ids_d = DeviceArray.empty((T, k), "int32")
    w_d = DeviceArray.from_numpy(ws[me])
    x_d = DeviceArray.empty((T, H), "bfloat16")
    out = DeviceArray.empty((T, H), "bfloat16")
    s = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    hs = int(s)

    def fill():
        ids = _ids(shared_rng, P, T, k, E, "random")
        xs = [upload(shared_rng.standard_normal((T, H)), "bfloat16") for _ in range(P)]
        src = DeviceArray.from_numpy(ids[me])
        check(cu.cuMemcpyDtoD(ids_d.ptr, src.ptr, ids_d.nbytes))
        check(cu.cuMemcpyDtoD(x_d.ptr, xs[me][0].ptr, x_d.nbytes))
        return ids, xs

    def seq():
        mkernel.moe_layer(ctx, x_d, wgs[me][0], wds[me][0], topk_ids=ids_d, topk_weights=w_d, out=out, stream=hs,
                          options=ONE)

    def check_out(v):
        ids, xs = v
        want = _one_kernel_want(ids, ws, xs, wgs, wds, ref.layout_reference(ids, E), me)
        got = download(out)
        assert not np.isnan(got).any() and np.abs(got - want).max() <= 2.0 ** -5 * (np.abs(want).max() + 1e-3)
    _replay(ctx, s, seq, fill, check_out)
    assert ctx.op_state("moe_layer").last_plan.combine == "layer"


def test_layer_one_kernel_falls_back(ctx, shared_rng):
    """one_kernel where the kernel cannot run: F = 40 (no fused config pairs it) or an fp32 out (the kernel's sums
    are stored in x's dtype): the layer runs the composed path, and its plan says so."""
    P, me = ctx.local_size, ctx.local_rank
    T, k, El, H = 64, 2, 2, 128
    E = El * P
    for F, out_dt, combine in ((40, "bfloat16", "kernel"), (64, "float32", "kernel")):
        ids, ws, xs, wgs, wds = _one_kernel_inputs(shared_rng, P, T, k, El, "random", H, F, "bfloat16")
        out = poisoned((T, H), out_dt)
        _one_kernel_layer(ctx, me, ids, ws, xs, wgs, wds, out)
        ctx.synchronize()
        assert ctx.op_state("moe_layer").last_plan.combine == combine
        want = _one_kernel_want(ids, ws, xs, wgs, wds, ref.layout_reference(ids, E), me)
        got = download(out)
        assert not np.isnan(got).any() and np.abs(got - want).max() <= 2.0 ** -5 * (np.abs(want).max() + 1e-3)


def test_layer_one_kernel_bad_inputs_raise_before_launch(ctx):
    """What only the one kernel needs is checked before the routing launches; a low-latency routing is refused."""
    from mkernel.ops.moe.fused_layer import moe_ffn_fused

    P = ctx.local_size
    E = 2 * P
    ids, w = DeviceArray.empty((10, 1), "int32"), DeviceArray.empty((10, 1), "float32")
    wg, wd = DeviceArray.empty((2, 128, 64), "bfloat16"), DeviceArray.empty((2, 64, 64), "bfloat16")
    x = DeviceArray.empty((10, 64), "bfloat16")
    with pytest.raises(ValueError, match="overlaps"):
        mkernel.moe_layer(ctx, x, wg, wd, topk_ids=ids, topk_weights=w, out=x, options=ONE)
    with pytest.raises(TypeError):
        mkernel.moe_layer(ctx, DeviceArray.empty((10, 64), "float16"), wg, wd, topk_ids=ids, topk_weights=w,
                          options=ONE)
    with pytest.raises(ValueError):
        MoeOptions(one_kernel=True, mode="low_latency").checked()
    R = mkernel.MoeRouting.empty(ctx, 10, 1, E, LL)
    with pytest.raises(ValueError, match="throughput-mode path"):
        moe_ffn_fused(ctx, x, R, wg, wd)
    ctx.synchronize()


def test_layer_one_kernel_missing_peer_times_out(ctx):
    """Every rank routes its tokens to its own first expert and runs the one kernel once; then rank 0 alone runs
    it again: its wait for peer 1's call ends in CommTimeout naming moe_ffn_fused, rank 0 and peer 1 (rank 0
    receives only its own rows, so nothing of this rank's own waits out first)."""
    from mkernel.ops.moe.fused_layer import moe_ffn_fused

    if ctx.size < 2:
        pytest.skip("needs 2 ranks")
    T, El, H, F = 64, 2, 128, 64
    E = El * ctx.local_size
    made = {}

    def call(c2):
        if "R" not in made:  # (every rank, once: the routing)
            lg = np.zeros((T, E), np.float32)
            lg[:, c2.local_rank * El] = 1.0
            made["R"] = mkernel.moe_route(c2, DeviceArray.from_numpy(lg), k=1)
            made["x"] = DeviceArray.empty((T, H), "bfloat16")
            made["wg"] = DeviceArray.empty((El, 2 * F, H), "bfloat16")
            made["wd"] = DeviceArray.empty((El, H, F), "bfloat16")
        moe_ffn_fused(c2, made["x"], made["R"], made["wg"], made["wd"])
    assert_missing_peer_times_out(call, "moe_ffn_fused")


LL = MoeOptions(mode="low_latency")


@pytest.mark.parametrize("T,k,E_local,mode", [(256, 8, 4, "random"), (128, 8, 32, "random"), (77, 1, 3, "random"),
                                              (200, 2, 4, "one_expert"), (100, 2, 2, "rank0_only"), (0, 2, 2, "random")])
def test_low_latency_dispatch_given_ids(ctx, shared_rng, T, k, E_local, mode):
    """Low-latency dispatch (routing + dispatch in one kernel): the routing, x_recv and recv_map equal the
    throughput path's reference exactly; combine on its routing as in throughput mode."""
    P, me = ctx.local_size, ctx.local_rank
    E = E_local * P
    if k > E:
        pytest.skip("k > E")
    ids = _ids(shared_rng, P, T, k, E, mode)
    ws = [shared_rng.random((T, k)).astype(np.float32) for _ in range(P)]
    H = 136
    xs = [upload(shared_rng.standard_normal((T, H)), "bfloat16") for _ in range(P)]
    R = mkernel.MoeRouting.empty(ctx, T, k, E, LL)
    xr = poisoned((R.recv_rows, H), "bfloat16")
    mkernel.moe_dispatch(ctx, xs[me][0], R, xr, topk_ids=DeviceArray.from_numpy(ids[me]),
                         topk_weights=DeviceArray.from_numpy(ws[me]), options=LL)
    _sync_stage(ctx, "moe_dispatch low-latency (mk_moe_dispatch_ll)")
    lay = _check_layout(R, ids, E, me)
    np.testing.assert_array_equal(R.ids.to_numpy(), ids[me])
    _check_dispatch(R, xs, xr, lay, k, me)
    _check_combine(ctx, _expert_outputs(shared_rng, R, H, P), R, ids, ws, lay, E, k, me, options=LL)


@pytest.mark.parametrize("ldt", ["float32", "bfloat16"])
def test_low_latency_routes_from_logits(ctx, shared_rng, ldt):
    P, me = ctx.local_size, ctx.local_rank
    T, k, E, H = 128, 8, 16 * P, 7168
    logits = [upload(shared_rng.standard_normal((T, E)), ldt) for _ in range(P)]
    xs = [upload(shared_rng.standard_normal((T, H)), "bfloat16") for _ in range(P)]
    R = mkernel.MoeRouting.empty(ctx, T, k, E, LL)
    xr = mkernel.moe_dispatch(ctx, xs[me][0], R, logits=logits[me][0], options=LL)
    ctx.synchronize()
    ids, w = ref.topk_reference(logits[me][1], k)
    np.testing.assert_array_equal(R.ids.to_numpy(), ids)
    np.testing.assert_allclose(R.weights.to_numpy(), w, rtol=1e-5, atol=1e-6)
    all_ids = [ref.topk_reference(l[1], k)[0] for l in logits]
    lay = _check_layout(R, all_ids, E, me)
    _check_dispatch(R, xs, xr, lay, k, me)


def test_low_latency_graph_replay_and_back_to_back(ctx, shared_rng):
    """Low-latency dispatch + combine captured once into a CUDA graph, replayed with fresh ids and rows;
    then 500 eager calls with changing routings (every 100th checked)."""
    T, k, E, H = 128, 2, 4 * ctx.local_size, 128
    R, xr, out, ids_d, w_d, x_d, s, fill = _graph_buffers(ctx, shared_rng, T, k, E, H, LL)
    hs = int(s)

    def seq():
        mkernel.moe_dispatch(ctx, x_d, R, xr, topk_ids=ids_d, topk_weights=w_d, stream=hs, options=LL)
        mkernel.moe_combine(ctx, xr, R, out, stream=hs, options=LL)
    _replay(ctx, s, seq, fill, lambda xv: np.testing.assert_array_equal(download(out), k * xv))
    for it in range(500):
        xv = fill()
        seq()
        if it % 100 == 0:
            ctx.synchronize(hs)
            np.testing.assert_array_equal(download(out), k * xv)
    ctx.synchronize(hs)


def test_new_paths_bad_inputs(ctx):
    P = ctx.local_size
    E = 4 * P
    with pytest.raises(ValueError, match="at most 256"):
        mkernel.MoeRouting.empty(ctx, 300, 2, E, LL)
    R = mkernel.MoeRouting.empty(ctx, 10, 2, E, LL)
    x = DeviceArray.empty((10, 64), "bfloat16")
    with pytest.raises(ValueError, match="low-latency mode routes"):
        mkernel.moe_dispatch(ctx, x, R, options=LL)
    with pytest.raises(ValueError, match="low-latency mode routes inside"):
        mkernel.moe_route(ctx, DeviceArray.empty((10, E), "float32"), k=2, options=LL)
    with pytest.raises(ValueError, match="throughput-mode path"):
        mkernel.moe_dispatch_gemm(ctx, x, R, DeviceArray.empty((E // P, 64, 64), "bfloat16"), options=LL)
    Rt = mkernel.MoeRouting.empty(ctx, 10, 2, E)
    with pytest.raises(ValueError):  # w_gate_up's H differs from x's
        mkernel.moe_dispatch_gemm(ctx, x, Rt, DeviceArray.empty((E // P, 64, 32), "bfloat16"))
    with pytest.raises(ValueError, match="low-latency mode"):
        mkernel.moe_dispatch(ctx, x, Rt, logits=DeviceArray.empty((10, E), "float32"))


def test_back_to_back_changing_routings(ctx, shared_rng):
    """1000 route+dispatch+combine calls with fresh routings each time, reusing one MoeRouting; every 100th
    checked (the epochs and staging handshakes must hold across calls)."""
    P, me = ctx.local_size, ctx.local_rank
    T, k, E, H = 97, 2, 4 * P, 64
    R = mkernel.MoeRouting.empty(ctx, T, k, E)
    xr = DeviceArray.empty((R.recv_rows, H), "bfloat16")
    out = DeviceArray.empty((T, H), "float32")
    ones = DeviceArray.from_numpy(np.ones((T, k), np.float32))
    for it in range(1000):
        ids = _ids(shared_rng, P, T, k, E, "random")
        x, xv = upload(shared_rng.standard_normal((T, H)), "bfloat16")
        mkernel.moe_route(ctx, topk_ids=DeviceArray.from_numpy(ids[me]), topk_weights=ones, num_experts=E, out=R)
        mkernel.moe_dispatch(ctx, x, R, xr)
        mkernel.moe_combine(ctx, xr, R, out)  # y = x_recv: out = k * x (every pair kept)
        if it % 100 == 0:
            ctx.synchronize()
            np.testing.assert_array_equal(download(out), k * xv)
    ctx.synchronize()


def _graph_buffers(ctx, shared_rng, T, k, E, H, options=None):
    """A captured route/dispatch/combine sequence's fixed buffers -- ``(R, xr, out, ids_d, w_d, x_d, s,
    fill)``: the routing under ``options``, the received rows, the combined output, the device ids and unit
    weights, the input rows, a non-blocking stream -- and ``fill()``, which copies fresh random ids and rows
    into ``ids_d`` and ``x_d`` and returns the rows' values."""
    from cuda.bindings import driver as cu
    from mkernel.core.driver import check

    P, me = ctx.local_size, ctx.local_rank
    R = mkernel.MoeRouting.empty(ctx, T, k, E, options)
    xr = DeviceArray.empty((R.recv_rows, H), "bfloat16")
    out = DeviceArray.empty((T, H), "float32")
    ids_d = DeviceArray.empty((T, k), "int32")
    w_d = DeviceArray.from_numpy(np.ones((T, k), np.float32))
    x_d = DeviceArray.empty((T, H), "bfloat16")
    s = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))

    def fill():
        ids = _ids(shared_rng, P, T, k, E, "random")
        x, xv = upload(shared_rng.standard_normal((T, H)), "bfloat16")
        src = DeviceArray.from_numpy(ids[me])  # (kept alive until the copy is done)
        check(cu.cuMemcpyDtoD(ids_d.ptr, src.ptr, ids_d.nbytes))
        check(cu.cuMemcpyDtoD(x_d.ptr, x.ptr, x_d.nbytes))
        return xv
    return R, xr, out, ids_d, w_d, x_d, s, fill


def _replay(ctx, s, seq, fill, check_out, n: int = 5):
    """Run ``seq`` on stream ``s`` once, capture it into a CUDA graph, then ``n`` times: ``fill()`` fresh
    inputs, replay, ``check_out(fill's result)``."""
    from cuda.bindings import driver as cu
    from mkernel.core.driver import check

    fill()
    seq()
    ctx.synchronize()
    g = capture(s, seq, "global")
    ge = check(cu.cuGraphInstantiate(g, 0))
    for _ in range(n):
        v = fill()
        ctx.synchronize()
        ctx.world.Barrier()
        check(cu.cuGraphLaunch(ge, s))
        ctx.synchronize(int(s))
        check_out(v)
    check(cu.cuGraphExecDestroy(ge))
    check(cu.cuGraphDestroy(g))


def test_graph_replay(ctx, shared_rng):
    T, k, E, H = 200, 2, 4 * ctx.local_size, 128
    R, xr, out, ids_d, w_d, x_d, s, fill = _graph_buffers(ctx, shared_rng, T, k, E, H)
    hs = int(s)

    def seq():
        mkernel.moe_route(ctx, topk_ids=ids_d, topk_weights=w_d, num_experts=E, out=R, stream=hs)
        mkernel.moe_dispatch(ctx, x_d, R, xr, stream=hs)
        mkernel.moe_combine(ctx, xr, R, out, stream=hs)
    _replay(ctx, s, seq, fill, lambda xv: np.testing.assert_array_equal(download(out), k * xv))


def test_bad_inputs_raise_before_launch(ctx):
    P = ctx.local_size
    E = 4 * P
    lg = DeviceArray.empty((10, E), "float32")
    with pytest.raises(ValueError, match="k is required"):
        mkernel.moe_route(ctx, lg)
    with pytest.raises(ValueError, match="k"):
        mkernel.moe_route(ctx, lg, k=E + 1)
    with pytest.raises(TypeError):
        mkernel.moe_route(ctx, DeviceArray.empty((10, E), "int32"), k=2)
    with pytest.raises(ValueError, match="multiple"):
        mkernel.moe_route(ctx, topk_ids=DeviceArray.empty((10, 2), "int32"),
                          topk_weights=DeviceArray.empty((10, 2), "float32"), num_experts=E + 1 if P > 1 else 2000)
    with pytest.raises(ValueError):
        mkernel.MoeOptions(softmax="nope").checked()
    R = mkernel.moe_route(ctx, lg, k=2)
    with pytest.raises(ValueError):
        mkernel.moe_dispatch(ctx, DeviceArray.empty((11, 64), "bfloat16"), R)  # T mismatch
    with pytest.raises(ValueError, match="16 bytes"):
        mkernel.moe_dispatch(ctx, DeviceArray.empty((10, 7), "bfloat16"), R)
    with pytest.raises(ValueError):
        mkernel.moe_combine(ctx, DeviceArray.empty((3, 64), "bfloat16"), R)  # not recv_rows rows
    ctx.synchronize()


def test_missing_peer_times_out(ctx):
    if ctx.size < 2:
        pytest.skip("needs 2 ranks")
    T, E = 64, 2 * ctx.local_size

    def call(c2):
        mkernel.moe_route(c2, DeviceArray.from_numpy(np.zeros((T, E), np.float32)), k=1)
    assert_missing_peer_times_out(call, "moe_route")


# --------------------------------------------------------------------------------------------
# across nodes (docs/moe.md "Across nodes"): run with
#   mpirun -np 2 -x MKERNEL_RANKS_PER_NODE=1 python -m pytest -m internode tests/gpu/test_moe.py
# P = the world size; every rank on another node is reached through the proxy.
# --------------------------------------------------------------------------------------------
def _needs_nodes(ctx):
    if ctx.num_nodes < 2:
        pytest.skip("needs >= 2 (emulated) nodes: MKERNEL_RANKS_PER_NODE")


@pytest.mark.internode
@pytest.mark.parametrize("node_dedup", [False, True], ids=["rank", "node"])
@pytest.mark.parametrize("T,k,E_local,mode,capacity", [(1000, 8, 4, "random", 0), (333, 1, 3, "random", 0),
                                                       (517, 2, 4, "one_expert", 0), (300, 2, 2, "rank0_only", 0),
                                                       (0, 2, 2, "random", 0), (70, 8, 8, "random", 0),
                                                       (257, 4, 4, "random", 40)])
def test_internode_route_dispatch_combine(ctx, shared_rng, T, k, E_local, mode, capacity, node_dedup):
    """Routing metadata exactly as the float64 layout reference (the one-node slot order), the proxy's
    slot ranges too; dispatch bit-exact; combine within fp32 accumulation; outputs NaN-poisoned first.  With
    node_dedup the node path (docs/moe.md "Node-level de-duplication"): the same results, plans "node"."""
    _needs_nodes(ctx)
    P, me = ctx.size, ctx.rank
    E = E_local * P
    if k > E:
        pytest.skip("k > E")
    opts = MoeOptions(expert_capacity=capacity or None, node_dedup=node_dedup)
    ids = _ids(shared_rng, P, T, k, E, mode)
    ws = [shared_rng.random((T, k)).astype(np.float32) for _ in range(P)]
    R = mkernel.moe_route(ctx, topk_ids=DeviceArray.from_numpy(ids[me]), topk_weights=DeviceArray.from_numpy(ws[me]),
                          num_experts=E, options=opts)
    H = 136
    xs = [upload(shared_rng.standard_normal((T, H)), "bfloat16") for _ in range(P)]
    xr = poisoned((R.recv_rows, H), "bfloat16")
    mkernel.moe_dispatch(ctx, xs[me][0], R, xr, options=opts)
    ctx.synchronize()
    lay = ref.layout_reference(ids, E, capacity, R.recv_rows)
    np.testing.assert_array_equal(R.slots.to_numpy(), lay[me]["slots"])
    np.testing.assert_array_equal(R.expert_offsets.to_numpy(), lay[me]["expert_offsets"])
    sr = ref.send_ranges_reference(lay[me]["slots"], ids[me], E)
    got_sr = R.send_ranges.to_numpy().astype(np.int64)
    np.testing.assert_array_equal(got_sr[:, 1], sr[:, 1])
    np.testing.assert_array_equal(got_sr[sr[:, 1] > 0, 0], sr[sr[:, 1] > 0, 0])
    np.testing.assert_array_equal(R.src_offsets.to_numpy(), ref.src_offsets_reference(lay[me], P, T, k))
    _check_dispatch(R, xs, xr, lay, k, me)
    _check_combine(ctx, _expert_outputs(shared_rng, R, H, P), R, ids, ws, lay, E, k, me, options=opts)
    want = "node" if node_dedup else "rank"
    assert [ctx.op_state(op).last_plan.transport for op in ("moe_dispatch", "moe_combine")] == [want, want]


@pytest.mark.internode
@pytest.mark.parametrize("node_every", [0, 3], ids=["rank", "switching"])
def test_internode_back_to_back_changing_routings(ctx, shared_rng, node_every):
    """50 calls, routing and sizes changing, no host sync between them; each call's result kept and checked.
    "switching": the node path (docs/moe.md "Node-level de-duplication") except every third call (each path
    has its own workspace and proxy)."""
    _needs_nodes(ctx)
    P, me, H, k = ctx.size, ctx.rank, 64, 2
    E = 2 * P
    runs = []
    for i in range(50):
        opts = MoeOptions(node_dedup=bool(node_every and i % node_every))
        T = int(shared_rng.integers(1, 200))
        ids = _ids(shared_rng, P, T, k, E, "random")
        ws = [shared_rng.random((T, k)).astype(np.float32) for _ in range(P)]
        R = mkernel.moe_route(ctx, topk_ids=DeviceArray.from_numpy(ids[me]),
                              topk_weights=DeviceArray.from_numpy(ws[me]), num_experts=E)
        xs = [upload(shared_rng.standard_normal((T, H)), "float32") for _ in range(P)]
        xr = poisoned((R.recv_rows, H), "float32")
        mkernel.moe_dispatch(ctx, xs[me][0], R, xr, options=opts)
        out = poisoned((T, H), "float32")
        mkernel.moe_combine(ctx, xr, R, out, options=opts)  # y = x: out[t] = sum_j w[t][j] * x[t] over kept pairs
        runs.append((T, ids, ws, xs, out))
    ctx.synchronize()
    for T, ids, ws, xs, out in runs:
        want = xs[me][1] * ws[me].astype(np.float64).sum(axis=1, keepdims=True)
        np.testing.assert_allclose(download(out), want, rtol=1e-5, atol=1e-5)


@pytest.mark.internode
def test_internode_missing_peer_times_out(ctx):
    _needs_nodes(ctx)
    T, E = 64, 2 * ctx.size

    def call(c2):
        mkernel.moe_route(c2, DeviceArray.from_numpy(np.zeros((T, E), np.float32)), k=1)
    assert_missing_peer_times_out(call, "moe_route")


# --------------------------------------------------------------------------------------------
# node-level de-duplication across nodes (docs/moe.md "Node-level de-duplication"): run with
#   mpirun -np 4 -x MKERNEL_RANKS_PER_NODE=2 python -m pytest -m internode tests/gpu/test_moe.py
#   mpirun -np 2 -x MKERNEL_RANKS_PER_NODE=1 python -m pytest -m internode tests/gpu/test_moe.py
# --------------------------------------------------------------------------------------------
_NODE = MoeOptions(node_dedup=True)


@pytest.mark.internode
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_internode_node_dedup_reproducible_and_close_to_per_rank(ctx, shared_rng, out_dtype):
    """The node path's combine twice: bit-identical (fixed j and node orders, no atomics); against the per-rank
    path's (j order over all pairs): within fp32 rounding."""
    _needs_nodes(ctx)
    P, me, T, k, H = ctx.size, ctx.rank, 513, 8, 256
    E = 4 * P
    R, ids, ws = _route_given(ctx, shared_rng, T, k, E, "random")
    xs = [upload(shared_rng.standard_normal((T, H)), "bfloat16") for _ in range(P)]
    xr = poisoned((R.recv_rows, H), "bfloat16")
    outs = []
    for opts in (_NODE, _NODE, None):
        mkernel.moe_dispatch(ctx, xs[me][0], R, xr, options=opts)
        out = poisoned((T, H), out_dtype)
        mkernel.moe_combine(ctx, xr, R, out, options=opts)
        outs.append(out)
    ctx.synchronize()
    a, b, c = (download(o) for o in outs)
    np.testing.assert_array_equal(a, b)
    tol = 2.0 ** -8 if out_dtype == "bfloat16" else 2.0 ** -20
    assert np.abs(a - c).max() <= tol * (np.abs(c).max() + k * np.abs(xs[me][1]).max())


@pytest.mark.internode
def test_internode_node_dedup_graph_replay(ctx, shared_rng):
    """route + node dispatch + node combine captured once (after a call of the shape) and replayed."""
    _needs_nodes(ctx)
    T, k, E, H = 200, 2, 4 * ctx.size, 128
    R, xr, out, ids_d, w_d, x_d, s, fill = _graph_buffers(ctx, shared_rng, T, k, E, H)
    hs = int(s)

    def seq():
        mkernel.moe_route(ctx, topk_ids=ids_d, topk_weights=w_d, num_experts=E, out=R, stream=hs)
        mkernel.moe_dispatch(ctx, x_d, R, xr, stream=hs, options=_NODE)
        mkernel.moe_combine(ctx, xr, R, out, stream=hs, options=_NODE)
    _replay(ctx, s, seq, fill, lambda xv: np.testing.assert_array_equal(download(out), k * xv))


@pytest.mark.internode
def test_internode_node_combine_needs_a_node_dispatch(ctx, shared_rng):
    _needs_nodes(ctx)
    R, _, _ = _route_given(ctx, shared_rng, 16, 2, 2 * ctx.size, "random")
    xr = DeviceArray.empty((R.recv_rows, 64), "bfloat16")
    mkernel.moe_dispatch(ctx, DeviceArray.empty((16, 64), "bfloat16"), R, xr)
    with pytest.raises(ValueError, match="node_dedup"):
        mkernel.moe_combine(ctx, xr, R, options=_NODE)
    ctx.synchronize()
