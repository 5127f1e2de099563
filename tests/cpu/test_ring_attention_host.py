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


# ------------------------------------------------------------------ backward
from mkernel.ops.ring_attention import backward as RB  # noqa: E402


def _attn_grads(q, k, v, do, scale, mask, lse, dsum):
    """float64 backward of one (query rows, key rows) pair with the global lse and Dsum: (dq, dk, dv);
    q, do [Sq, D], k, v [Sk, D], mask [Sq, Sk] (True: visible)."""
    s = q @ k.T * scale
    p = np.where(mask, np.exp(s - lse[:, None]), 0.0)
    dv = p.T @ do
    ds = p * (do @ v.T - dsum[:, None])
    return scale * ds @ k, scale * ds.T @ q, dv


@pytest.mark.parametrize("P,causal", list(itertools.product([1, 2, 3, 4], [False, True])))
def test_backward_schedule_gives_the_full_gradients(P, causal):
    """The backward's decomposition in float64: every rank's launches (plan rows, key rows, mask) with the
    global lse, dQ accumulated over the steps, each block's partials summed by its owner over the rows
    partial_rows says -- equal to the gradients of full attention over the whole sequence."""
    rng = np.random.default_rng(P + 10 * causal)
    S_loc, D = 6, 4
    S = S_loc * P
    q, k, v, do = (rng.standard_normal((S, D)) for _ in range(4))
    scale = 0.7
    full = np.tril(np.ones((S, S), bool)) if causal else np.ones((S, S), bool)
    s = np.where(full, q @ k.T * scale, -np.inf)
    lse = np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1)
    p = np.exp(s - lse[:, None])
    o = p @ v
    dsum = (do * o).sum(1)
    want = _attn_grads(q, k, v, do, scale, full, lse, dsum)
    rows = [zigzag_indices(S, P, r) if causal else np.arange(r * S_loc, (r + 1) * S_loc) for r in range(P)]
    dq = [np.zeros((S_loc, D)) for _ in range(P)]
    parts = {}  # (owner, src) -> (dk partial, dv partial) of the owner's S_loc rows
    for r in range(P):
        plan = make_plan(r, P, S_loc, causal)
        for ln in plan.launches:
            j = plan.sources[ln.step]
            qi, kj = rows[r][ln.q0:ln.q1], rows[j][:ln.kv_rows]
            nq, nk = ln.q1 - ln.q0, ln.kv_rows
            mask = (np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq) if ln.causal else np.ones((nq, nk), bool)
            gq, gk, gv = _attn_grads(q[qi], k[kj], v[kj], do[qi], scale, mask, lse[qi], dsum[qi])
            dq[r][ln.q0:ln.q1] += gq
            pk, pv = np.full((S_loc, D), np.nan), np.full((S_loc, D), np.nan)  # unwritten rows: never read
            pk[:nk], pv[:nk] = gk, gv
            assert RB.partial_step(j, r, P) == ln.step and RB.partial_rows(j, r, P, S_loc, causal) == nk
            parts[(j, r)] = (pk, pv)
    for j in range(P):
        dk, dv = np.zeros((S_loc, D)), np.zeros((S_loc, D))
        for i in range(P):  # local-rank order, as mk_attn_bwd_part_sum
            n = RB.partial_rows(j, i, P, S_loc, causal)
            dk[:n] += parts[(j, i)][0][:n]
            dv[:n] += parts[(j, i)][1][:n]
        np.testing.assert_allclose(dk, want[1][rows[j]], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(dv, want[2][rows[j]], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(dq[j], want[0][rows[j]], rtol=1e-10, atol=1e-12)


def test_backward_workspace_layout():
    a = RB.backward_workspace_layout(4, 1 << 20, 3 << 20)
    b = RB.backward_workspace_layout(4, 5 << 20, 7 << 20)
    assert (a.home.consumed_off, a.home.flags_off, a.parts.flags_off, a.data_off) == \
        (b.home.consumed_off, b.home.flags_off, b.parts.flags_off, b.data_off)  # control words never move
    assert a.parts.consumed_off == a.home.consumed_off and a.parts.flags_off > a.home.flags_off
    assert a.parts.flags_off + 8 * 4 <= a.data_off and a.data_off % 256 == 0 and a.part_off % 256 == 0
    assert a.part_off == a.data_off + 3 * a.kv_stride and a.total == a.part_off + 4 * a.part_stride
    assert RO.VALUE_OFF + 8 <= a.home.consumed_off


def _bwd_args(B=1, S=64, Hq=4, Hkv=2, D=128, dt="bfloat16"):
    q, k, v = _arr((B, S, Hq, D), dt), _arr((B, S, Hkv, D), dt), _arr((B, S, Hkv, D), dt)
    return q, k, v, _arr((B, S, Hq, D), dt), _arr((B, Hq, S), "float32"), _arr((B, S, Hq, D), dt)


def test_backward_bad_inputs_raise_before_launch(ctx, monkeypatch):
    monkeypatch.setattr(RB, "require_gemm_device", lambda what, device: None)
    monkeypatch.setattr(RB._RingAttentionBwd, "compile", lambda self, ctx, call: pytest.fail("compiled bad input"))
    f = mkernel.ring_attention_backward
    q, k, v, o, lse, do = _bwd_args()
    with pytest.raises(ValueError, match="same local sequence"):
        f(ctx, q, _arr((1, 32, 2, 128)), _arr((1, 32, 2, 128)), o, lse, do)
    a = _bwd_args(S=63)
    with pytest.raises(ValueError, match="even local"):
        f(ctx, *a, causal=True)
    with pytest.raises(ValueError, match="contiguous"):
        f(ctx, q, _arr((1, 64, 2, 128), strides=(64 * 4 * 128, 4 * 128, 128, 1)), v, o, lse, do)
    with pytest.raises(ValueError, match="head dim"):
        f(ctx, *_bwd_args(D=96))
    with pytest.raises(ValueError, match="multiple"):
        f(ctx, *_bwd_args(Hq=3))
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        f(ctx, *_bwd_args(dt="float32"))
    with pytest.raises(ValueError, match="lse"):
        f(ctx, q, k, v, o, _arr((1, 4, 32), "float32"), do)
    with pytest.raises(ValueError, match="dk has shape"):
        f(ctx, q, k, v, o, lse, do, dk=_arr((1, 64, 4, 128)))
    with pytest.raises(ValueError, match="layout"):
        f(ctx, q, k, v, o, lse, do, layout="sbhd")
    with pytest.raises(TypeError, match="RingAttentionOptions"):
        f(ctx, q, k, v, o, lse, do, options=mkernel.AttentionBwdOptions())
    with pytest.raises(ValueError, match="softmax_scale"):
        f(ctx, q, k, v, o, lse, do, softmax_scale=0.0)
    with pytest.raises(TypeError, match="dout is required"):
        f(ctx, q, k, v, o, lse, None)
    with pytest.raises(ValueError, match="overlap"):
        f(ctx, q, k, v, o, lse, do, dq=q)
    ctx.num_nodes = 2
    with pytest.raises(ValueError, match="inside one node"):
        f(ctx, q, k, v, o, lse, do)


def test_backward_partial_kernels_compile_clean():
    from mkernel.ops.attention_bwd import kernels as BK

    for dt in BK.DTYPES:
        for d in BK.HEAD_DIMS:
            assert (BK.SOURCE, BK.partial_defines(dt, d)) in CP.registered_specializations()
    # (the no-spill compile of every partial specialization: tests/cpu/test_attention_bwd_host.py)
