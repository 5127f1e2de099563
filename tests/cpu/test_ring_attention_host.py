"""mkernel.ring_attention on the CPU: the zigzag index math and shard/unshard against numpy, the chunk-pair
classification and every rank's launches (work balance, first / final rows), the control kernels and the
merge specializations compile for sm_90a with no spills, and bad arguments raise before any launch."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import mkernel
from mkernel.core import compiler as CP
from mkernel.core.arrays import DeviceArray
from mkernel.ops.attention import op as AO
from mkernel.ops.ring_attention import RingAttentionOptions, classify, make_plan, zigzag_indices
from mkernel.ops.ring_attention import op as RO
from mkernel.ops.ring_attention.plan import source_rank, step_pairs


# ------------------------------------------------------------------ zigzag
@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
def test_zigzag_indices_partition_the_sequence(P):
    S = 2 * P * 5
    idx = [zigzag_indices(S, P, r) for r in range(P)]
    assert all(len(i) == S // P for i in idx)
    assert sorted(np.concatenate(idx).tolist()) == list(range(S))
    c = S // (2 * P)
    for r in range(P):
        assert idx[r][:c].tolist() == list(range(r * c, r * c + c))
        assert idx[r][c:].tolist() == list(range((2 * P - 1 - r) * c, (2 * P - r) * c))


def test_zigzag_shard_unshard_numpy_roundtrip():
    rng = np.random.default_rng(0)
    P, S = 4, 24
    for seq_dim, shape in ((1, (2, S, 3, 8)), (2, (2, 3, S, 8)), (-3, (2, S, 3, 8))):
        x = rng.standard_normal(shape)
        shards = [mkernel.zigzag_shard(x, (r, P), seq_dim) for r in range(P)]
        d = seq_dim % x.ndim
        for r, sh in enumerate(shards):
            np.testing.assert_array_equal(sh, np.take(x, zigzag_indices(S, P, r), axis=d))
        back = mkernel.zigzag_unshard(np.concatenate(shards, axis=d), P, seq_dim)
        np.testing.assert_array_equal(back, x)


def test_zigzag_bad_arguments():
    x = np.zeros((1, 10, 2, 8))
    with pytest.raises(ValueError, match="multiple of 2 \\* P"):
        mkernel.zigzag_shard(x, (0, 2), 1)
    with pytest.raises(ValueError, match="out of range"):
        mkernel.zigzag_shard(x, (2, 2), 1)
    with pytest.raises(ValueError, match="seq_dim"):
        mkernel.zigzag_shard(x, (0, 1), 4)


# ------------------------------------------------------------------ schedule
def test_classify():
    assert classify(3, 1) == "full" and classify(2, 2) == "diag" and classify(1, 3) == "skip"


def _pairs_of_launch(rank, P, C, ln):
    """The (global q chunk, global k chunk, kind) pairs a launch computes, from its rows and mask."""
    qs = (rank, 2 * P - 1 - rank)
    ks = (rank, 2 * P - 1 - rank) if ln.step == 0 else (source_rank(rank, ln.step, P), 2 * P - 1 - source_rank(rank, ln.step, P))
    out = set()
    for a in range(ln.q0 // C, ln.q1 // C):
        for b in range(ln.kv_rows // C):
            if ln.causal:  # bottom-right aligned over the local 2C x 2C: diag blocks on the diagonal, above skipped
                kind = "diag" if a == b else "full" if b < a else "skip"
            else:
                kind = "full"
            if kind != "skip":
                out.add((qs[a], ks[b], kind))
    return out


@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
def test_causal_zigzag_launches_match_the_classification(P):
    C = 3
    works = []
    for r in range(P):
        plan = make_plan(r, P, 2 * C, True)
        assert [ln.step for ln in plan.launches] == list(range(P))  # one launch per step
        for s in range(P):
            want = {(( r, 2 * P - 1 - r)[a], zk, kind) for a, b, kind in step_pairs(r, s, P) if kind != "skip"
                    for zk in [(source_rank(r, s, P), 2 * P - 1 - source_rank(r, s, P))[b]]}
            got = _pairs_of_launch(r, P, C, plan.launches[s])
            assert got == want, (r, s)
        works.append(plan.work)
    assert all(w == works[0] for w in works)  # every rank the same work: 2P chunk pairs (P / 2 * S_local^2)
    assert works[0] == pytest.approx(P / 2)


@pytest.mark.parametrize("P,causal", list(itertools.product([1, 2, 3, 5], [False, True])))
def test_first_and_final_rows(P, causal):
    S = 10
    for r in range(P):
        plan = make_plan(r, P, S, causal)
        first = [ln for ln in plan.launches if ln.first]
        assert len(first) == 1 and (first[0].q0, first[0].q1) == (0, S)  # step 0 starts every row
        ends = np.zeros(S, int)
        for ln in plan.launches:
            ends[ln.q0 + ln.final_lo:ln.q0 + ln.final_hi] += 1
            later = [l for l in plan.launches if l.step > ln.step]
            for row in range(ln.q0 + ln.final_lo, ln.q0 + ln.final_hi):
                assert not any(l.q0 <= row < l.q1 for l in later)
        assert (ends == 1).all()  # every row written to out exactly once, by its last launch


def test_noncausal_plan_and_sources():
    plan = make_plan(2, 4, 7, False)
    assert plan.sources == (2, 1, 0, 3)
    assert all((ln.q0, ln.q1, ln.kv_rows, ln.causal) == (0, 7, 7, False) for ln in plan.launches)
    with pytest.raises(ValueError, match="even"):
        make_plan(0, 2, 7, True)


def test_workspace_layout_control_words_fixed():
    a, off_a, tot_a = RO.workspace_layout(2, 1 << 20)
    b, off_b, tot_b = RO.workspace_layout(2, 3 << 20)
    assert (a.consumed_off, a.flags_off, off_a) == (b.consumed_off, b.flags_off, off_b)
    assert off_a % 256 == 0 and tot_b - off_b == 3 * (3 << 20)
    assert RO.VALUE_OFF + 8 <= a.consumed_off


def test_options_checked():
    with pytest.raises(ValueError, match="pull_chunks"):
        RingAttentionOptions(pull_chunks=0).checked()
    with pytest.raises(ValueError, match="heavy_first"):
        RingAttentionOptions(heavy_first=2).checked()


# ------------------------------------------------------------------ compile
def test_control_kernels_compile_clean():
    mod = CP.compile_module(RO.SOURCE, {}, arch="sm_90a")
    for name in ("mk_ring_begin", "mk_ring_wait"):
        u = mod.resource_usage[name]
        assert u.get("spill_stores", 0) == 0 and u.get("stack", 0) == 0, u
    assert (RO.SOURCE, {}) in CP.registered_specializations()


# ------------------------------------------------------------------ validation (no launch)
class _Ctx:
    num_nodes, local_rank, local_size, device, rank = 1, 0, 2, 0, 0
    workspace_generation = 0

    def __init__(self):
        self.states = {}

    def check(self):
        pass

    def op_state(self, name):
        from mkernel.dist.opstate import OpState

        return self.states.setdefault(name, OpState(name))


_ADDR = [0x10000000]


def _arr(shape, dtype="bfloat16", strides=None):
    _ADDR[0] += 1 << 28
    return DeviceArray(_ADDR[0], shape, dtype, strides, device=0)


@pytest.fixture
def ctx(monkeypatch):
    monkeypatch.setattr(AO, "require_gemm_device", lambda what, device: None)
    monkeypatch.setattr(DeviceArray, "empty", staticmethod(lambda shape, dtype, device=None: _arr(shape, dtype)))
    monkeypatch.setattr(RO._RingAttention, "compile", lambda self, ctx, call: pytest.fail("compiled bad input"))
    return _Ctx()


def test_bad_inputs_raise_before_launch(ctx):
    q, k = _arr((1, 64, 4, 128)), _arr((1, 64, 2, 128))
    v = _arr((1, 64, 2, 128))
    with pytest.raises(ValueError, match="same local sequence"):
        mkernel.ring_attention(ctx, q, _arr((1, 32, 2, 128)), _arr((1, 32, 2, 128)))
    with pytest.raises(ValueError, match="even local"):
        mkernel.ring_attention(ctx, _arr((1, 63, 4, 128)), _arr((1, 63, 2, 128)), _arr((1, 63, 2, 128)), causal=True)
    with pytest.raises(ValueError, match="contiguous"):
        kk = _arr((1, 64, 2, 128), strides=(64 * 4 * 128, 4 * 128, 128, 1))
        mkernel.ring_attention(ctx, q, kk, v)
    with pytest.raises(ValueError, match="head dim"):
        mkernel.ring_attention(ctx, _arr((1, 64, 4, 96)), _arr((1, 64, 2, 96)), _arr((1, 64, 2, 96)))
    with pytest.raises(ValueError, match="multiple of the K/V heads"):
        mkernel.ring_attention(ctx, _arr((1, 64, 3, 128)), k, v)
    with pytest.raises(TypeError, match="dtype"):
        mkernel.ring_attention(ctx, _arr((1, 64, 4, 128), "float32"), k, v)
    with pytest.raises(ValueError, match="layout"):
        mkernel.ring_attention(ctx, q, k, v, layout="sbhd")
    with pytest.raises(TypeError, match="RingAttentionOptions"):
        mkernel.ring_attention(ctx, q, k, v, options=mkernel.AttentionOptions())
    with pytest.raises(ValueError, match="softmax_scale"):
        mkernel.ring_attention(ctx, q, k, v, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="lse"):
        mkernel.ring_attention(ctx, q, k, v, lse=_arr((1, 4, 32), "float32"))
    ctx.num_nodes = 2
    with pytest.raises(ValueError, match="inside one node"):
        mkernel.ring_attention(ctx, q, k, v)
