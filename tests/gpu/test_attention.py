"""GPU tests of mkernel.attention (forward) against a float64 numpy reference.

Inputs are fresh N(0, 1) data rounded to the input dtype (the reference uses those exact values); out and
lse are NaN-poisoned first, so an unwritten element fails.  Tolerances: the kernel rounds P to the input
dtype before P V and O to the output dtype, so for out the relative Frobenius error must stay below 1e-2
(bf16) / 3e-3 (fp16) and every element within 0.02 + 0.02 |ref| (bf16) / 0.005 + 0.005 |ref| (fp16); lse
(fp32 throughout, approximate exp2/log2) within 2e-3 + 1e-4 |ref| absolute.  Rows that see no key must be
exactly 0 with lse -inf.  Sequence lengths 1, 77, 129, 300, 1000, 4097 (none a multiple of the 128-row
tiles), D 64 and 128, GQA ratios 1/4/8, causal with S_q < S_k and S_q > S_k, both layouts, strided views
(q, k, v sliced out of one packed qkv buffer, a padded out), graph replay, 1000 back-to-back calls.
Every correctness case runs with both schedules (``AttentionOptions(schedule="default" | "pingpong")``: two
kernels, the ping-pong one with 192-row query blocks at D = 64); each checks ``last_plan().schedule``.
Skipped without a Hopper GPU; about two minutes on an H200 (mostly the float64 reference).
"""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

import mkernel
from mkernel.core.arrays import DeviceArray
from mkernel.core.compiler import precompile_source
from mkernel.ops.attention import kernels as AK, last_plan
from mkernel.ops.attention.reference import attention_reference

from _util import download, poisoned, upload

pytestmark = pytest.mark.gpu  # skipped by tests/conftest.py without a Hopper GPU

SEED = int(np.random.SeedSequence().entropy % (1 << 32))
SCHEDULES = AK.SCHEDULES
TOL = {"bfloat16": (1e-2, 0.02), "float16": (3e-3, 0.005)}  # (relative Frobenius, elementwise abs/rel)


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Every registered attention specialization compiled first, in parallel processes (disk cache)."""
    precompile_source(AK.SOURCE)


@pytest.fixture
def rng(request):
    """Fresh data per run; the printed seed (run seed mixed with the test id) reproduces a failure."""
    seed = zlib.crc32(request.node.nodeid.encode(), SEED)
    print(f"seed={seed} (run seed {SEED})")
    return np.random.default_rng(seed)


# ---- reference -------------------------------------------------------------------------------
def reference(q, k, v, causal, scale):
    """float64 (out [B, H_q, S_q, D], lse [B, H_q, S_q]) of q [B, H_q, S_q, D], k/v [B, H_kv, S_k, D]."""
    out, lse = attention_reference(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), causal, scale)
    return out.transpose(0, 2, 1, 3), lse


def to_bhsd(x, layout):
    return x if layout == "bhsd" else x.transpose(0, 2, 1, 3)


def check(out, lse, ref_out, ref_lse, layout, dtype, what):
    got = to_bhsd(download(out), layout)
    gl = download(lse)
    assert not np.isnan(got).any(), f"{what}: NaN (unwritten) in out at {np.argwhere(np.isnan(got))[:4].tolist()}"
    assert not np.isnan(gl).any(), f"{what}: NaN (unwritten) in lse at {np.argwhere(np.isnan(gl))[:4].tolist()}"
    fro, elem = TOL[dtype]
    err = float(np.linalg.norm(got - ref_out) / max(np.linalg.norm(ref_out), 1e-30))
    assert err < fro, f"{what}: out relative Frobenius error {err:.3e}"
    bad = np.abs(got - ref_out) > elem + elem * np.abs(ref_out)
    assert not bad.any(), (f"{what}: {int(bad.sum())} out elements off, first at {np.argwhere(bad)[0].tolist()}: "
                           f"{got[tuple(np.argwhere(bad)[0])]} vs {ref_out[tuple(np.argwhere(bad)[0])]}")
    dead = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(gl), dead), f"{what}: lse -inf pattern differs"
    assert (got[dead] == 0).all(), f"{what}: rows that see no key are not 0"
    le = np.abs(gl[~dead] - ref_lse[~dead])
    assert (le <= 2e-3 + 1e-4 * np.abs(ref_lse[~dead])).all(), f"{what}: lse error up to {le.max():.3e}"


def make(rng, B, S, H, D, layout, dtype):
    """(DeviceArray in ``layout``, float64 values as [B, H, S, D])."""
    shape = (B, S, H, D) if layout == "bshd" else (B, H, S, D)
    dev, exact = upload(rng.standard_normal(shape, dtype=np.float32), dtype)
    return dev, to_bhsd(exact, layout)


def run_case(rng, B, Sq, Sk, Hq, Hkv, D, causal, layout, dtype, scale=None, schedule="default"):
    q, qv = make(rng, B, Sq, Hq, D, layout, dtype)
    k, kv = make(rng, B, Sk, Hkv, D, layout, dtype)
    v, vv = make(rng, B, Sk, Hkv, D, layout, dtype)
    out = poisoned(q.shape, dtype)
    lse = poisoned((B, Hq, Sq), "float32")
    r_out, r_lse = mkernel.attention(q, k, v, out, lse=lse, causal=causal, softmax_scale=scale, layout=layout,
                                     options=mkernel.AttentionOptions(schedule=schedule))
    assert r_out is out and r_lse is lse
    p = last_plan()
    assert p.schedule == schedule and p.grid == (-(-Sq // p.block_m), Hq, B)
    ro, rl = reference(qv, kv, vv, causal, scale if scale is not None else 1 / math.sqrt(D))
    check(out, lse, ro, rl, layout, dtype,
          f"B={B} Sq={Sq} Sk={Sk} Hq={Hq} Hkv={Hkv} D={D} causal={causal} {layout} schedule={schedule}")


# ---- shapes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("B,Sq,Sk,Hq,Hkv,D,causal,layout,dtype", [
    (1, 1, 1, 2, 1, 128, False, "bshd", "bfloat16"),       # S = 1
    (1, 1, 1, 2, 2, 64, True, "bhsd", "float16"),
    (2, 77, 77, 8, 2, 64, True, "bshd", "bfloat16"),
    (1, 1000, 1000, 4, 4, 128, True, "bhsd", "float16"),
    (1, 4097, 4097, 2, 2, 128, False, "bshd", "bfloat16"),
    (1, 4097, 4097, 1, 1, 64, True, "bhsd", "bfloat16"),
    (1, 1, 4097, 8, 1, 64, True, "bshd", "bfloat16"),      # S_q = 1 (decode), MQA: sees every key
    (1, 1, 1000, 4, 4, 128, False, "bhsd", "float16"),
    (2, 300, 1000, 8, 1, 128, True, "bhsd", "bfloat16"),   # causal S_q < S_k, GQA 8
    (1, 1000, 300, 4, 1, 64, True, "bshd", "float16"),     # causal S_q > S_k: the first 700 rows see nothing
    (3, 129, 257, 16, 4, 64, False, "bhsd", "bfloat16"),
    (2, 1000, 1000, 32, 8, 128, False, "bshd", "bfloat16"),
    (1, 385, 385, 4, 2, 64, True, "bshd", "float16"),      # 2 query blocks of 192 and 1 row (ping-pong D = 64)
    (1, 2000, 2000, 2, 1, 64, False, "bshd", "bfloat16"),  # 16 key tiles: every ring slot reused 4 times
])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_shapes(rng, B, Sq, Sk, Hq, Hkv, D, causal, layout, dtype, schedule):
    run_case(rng, B, Sq, Sk, Hq, Hkv, D, causal, layout, dtype, schedule=schedule)


@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gqa_ratios(rng, ratio, D, causal, schedule):
    run_case(rng, 2, 333, 333, 8, 8 // ratio, D, causal, "bshd", "bfloat16", schedule=schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_large_scale(rng, schedule):
    """softmax_scale 1 (scores of standard deviation ~11): the running max moves a lot between tiles."""
    run_case(rng, 1, 500, 700, 2, 1, 128, False, "bshd", "bfloat16", scale=1.0, schedule=schedule)
    run_case(rng, 1, 700, 500, 2, 2, 64, True, "bhsd", "bfloat16", scale=0.9, schedule=schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_no_keys(rng, schedule):
    q, _ = make(rng, 1, 5, 2, 64, "bshd", "bfloat16")
    k = DeviceArray.empty((1, 0, 2, 64), "bfloat16")
    out, lse = mkernel.attention(q, k, k, poisoned(q.shape, "bfloat16"), lse=poisoned((1, 2, 5), "float32"),
                                 options=mkernel.AttentionOptions(schedule=schedule))
    assert (download(out) == 0).all() and np.isneginf(download(lse)).all()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_block_orders(rng, schedule):
    """Both query-block orders (heavy_first on and off) of each schedule, causal, against the reference."""
    B, S, Hq, Hkv = 2, 1500, 8, 2
    for D in (64, 128):
        q, qv = make(rng, B, S, Hq, D, "bshd", "bfloat16")
        k, kv = make(rng, B, S, Hkv, D, "bshd", "bfloat16")
        v, vv = make(rng, B, S, Hkv, D, "bshd", "bfloat16")
        ro, rl = reference(qv, kv, vv, True, 1 / math.sqrt(D))
        for hf in (True, False):
            out, lse = poisoned(q.shape, "bfloat16"), poisoned((B, Hq, S), "float32")
            mkernel.attention(q, k, v, out, lse=lse, causal=True,
                              options=mkernel.AttentionOptions(schedule=schedule, heavy_first=hf))
            assert last_plan().schedule == schedule and last_plan().heavy_first == hf
            check(out, lse, ro, rl, "bshd", "bfloat16", f"D={D} schedule={schedule} heavy_first={hf}")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_strided_views(rng, schedule):
    """q, k, v sliced out of one packed [B, S, 3, H, D] buffer (sequence stride 3*H*D), out a view of a
    buffer with padded heads (head stride D + 64)."""
    B, S, H, D = 2, 1000, 4, 128
    qkv, vals = upload(rng.standard_normal((B, S, 3, H, D), dtype=np.float32), "bfloat16")
    st = (S * 3 * H * D, 3 * H * D, D, 1)
    q, k, v = (DeviceArray(qkv.ptr + i * H * D * 2, (B, S, H, D), "bfloat16", st, qkv.device, qkv) for i in range(3))
    obuf = poisoned((B, S, H, D + 64), "bfloat16")
    out = DeviceArray(obuf.ptr, (B, S, H, D), "bfloat16", (S * H * (D + 64), H * (D + 64), D + 64, 1), obuf.device, obuf)
    lse = poisoned((B, H, S), "float32")
    mkernel.attention(q, k, v, out, lse=lse, causal=True, options=mkernel.AttentionOptions(schedule=schedule))
    ev = [to_bhsd(vals[:, :, i], "bshd") for i in range(3)]
    ro, rl = reference(*ev, True, 1 / math.sqrt(D))
    check(out, lse, ro, rl, "bshd", "bfloat16", "strided views")
    pad = download(obuf)[..., D:]
    assert np.isnan(pad).all(), "out's padding was written"


def test_thousand_calls(rng):
    """1000 back-to-back calls alternating two sets of arrays (one bound call re-pointed each time): the
    results equal the first calls' bit for bit (the kernel is deterministic) and the reference."""
    args = []
    for _ in range(2):
        q, qv = make(rng, 2, 1000, 8, 128, "bshd", "bfloat16")
        k, kv = make(rng, 2, 1000, 2, 128, "bshd", "bfloat16")
        v, vv = make(rng, 2, 1000, 2, 128, "bshd", "bfloat16")
        args.append((q, k, v, poisoned(q.shape, "bfloat16"), poisoned((2, 8, 1000), "float32"), (qv, kv, vv)))
    for q, k, v, o, l, _ in args:
        mkernel.attention(q, k, v, o, lse=l, causal=True)
    first = [(download(o), download(l)) for *_, o, l, _ in args]
    for i in range(1000):
        q, k, v, o, l, _ = args[i % 2]
        mkernel.attention(q, k, v, o, lse=l, causal=True)
    for (q, k, v, o, l, vals), (fo, fl) in zip(args, first):
        assert np.array_equal(download(o), fo) and np.array_equal(download(l), fl)
        ro, rl = reference(*vals, True, 1 / math.sqrt(128))
        check(o, l, ro, rl, "bshd", "bfloat16", "after 1000 calls")
    p = last_plan()
    assert p.grid == (8, 8, 2) and p.causal and p.head_dim == 128


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_graph_replay(rng, schedule):
    """A call captured into a CUDA graph replays with new data copied into its inputs."""
    from cuda.bindings import driver as cu

    from mkernel.core.driver import check as ok

    B, S, Hq, Hkv, D = 1, 777, 8, 2, 64
    q, _ = make(rng, B, S, Hq, D, "bhsd", "float16")
    k, _ = make(rng, B, S, Hkv, D, "bhsd", "float16")
    v, _ = make(rng, B, S, Hkv, D, "bhsd", "float16")
    out, lse = poisoned(q.shape, "float16"), poisoned((B, Hq, S), "float32")
    stream = ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
    ok(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
    mkernel.attention(q, k, v, out, lse=lse, causal=True, layout="bhsd", stream=int(stream),
                      options=mkernel.AttentionOptions(schedule=schedule))
    graph = ok(cu.cuStreamEndCapture(stream))
    gexec = ok(cu.cuGraphInstantiate(graph, 0))
    for rep in range(3):
        vals = []
        for x, h in ((q, Hq), (k, Hkv), (v, Hkv)):
            nx, nv = make(rng, B, S, h, D, "bhsd", "float16")
            x.copy_from(nx, stream=int(stream))
            vals.append(nv)
        out.fill_nan(stream=int(stream))
        lse.fill_nan(stream=int(stream))
        ok(cu.cuGraphLaunch(gexec, stream))
        ok(cu.cuStreamSynchronize(stream))
        ro, rl = reference(*vals, True, 1 / math.sqrt(D))
        check(out, lse, ro, rl, "bhsd", "float16", f"graph replay {rep}")
    ok(cu.cuGraphExecDestroy(gexec))
    ok(cu.cuGraphDestroy(graph))
    ok(cu.cuStreamDestroy(stream))


def test_bad_inputs_raise_before_launch(rng):
    q, _ = make(rng, 1, 100, 4, 128, "bshd", "bfloat16")
    k, _ = make(rng, 1, 100, 3, 128, "bshd", "bfloat16")
    out = poisoned(q.shape, "bfloat16")
    with pytest.raises(ValueError, match="multiple of the K/V heads"):
        mkernel.attention(q, k, k, out)
    with pytest.raises(ValueError, match="16-byte aligned"):
        mkernel.attention(DeviceArray(q.ptr + 8, (1, 99, 4, 128), "bfloat16", None, q.device, q), q, q)
    with pytest.raises(ValueError, match="head dim 96"):
        x = DeviceArray.empty((1, 10, 2, 96), "bfloat16")
        mkernel.attention(x, x, x)
    assert np.isnan(download(out)).all()  # nothing ran
