"""mkernel.ring_attention on the CPU: the zigzag index math and shard/unshard against numpy, the chunk-pair
classification and every rank's launches (work balance, first / final rows), the control kernels and the
merge specializations compile for sm_90a with no spills, and bad arguments raise before any launch."""
from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest

import mkernel
from mkernel.core import compiler as CP
from mkernel.core.arrays import DeviceArray
from mkernel.ops.attention import op as AO
from mkernel.ops.ring_attention import RingAttentionOptions, classify, make_plan, zigzag_indices
from mkernel.ops.ring_attention import common as RC
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
    ctx.num_nodes, ctx.size, ctx.node_of_rank = 2, 4, [0, 1, 0, 1]  # (not node-major)
    with pytest.raises(ValueError, match="node-major"):
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
    ctx.num_nodes, ctx.size, ctx.node_of_rank = 2, 4, [0, 1, 0, 1]  # (not node-major)
    with pytest.raises(ValueError, match="node-major"):
        f(ctx, q, k, v, o, lse, do)


def test_backward_partial_kernels_compile_clean():
    from mkernel.ops.attention_bwd import kernels as BK

    for dt in BK.DTYPES:
        for d in BK.HEAD_DIMS:
            assert (BK.SOURCE, BK.partial_defines(dt, d)) in CP.registered_specializations()
            assert (BK.SOURCE, BK.wgmma_partial_defines(dt, d)) in CP.registered_specializations()
    # (the no-spill compile of every partial specialization, mma and wgmma: tests/cpu/test_attention_bwd_host.py)


# ------------------------------------------------------------------ across nodes
from mkernel.ops.ring_attention import internode as XR  # noqa: E402

NODE_SHAPES = [(1, 2), (2, 2), (1, 3), (3, 2), (2, 3), (4, 2)]  # (L ranks per node, N nodes)


@pytest.mark.parametrize("L,N", NODE_SHAPES)
def test_x_steps_pair_every_push_with_a_remote_read(L, N):
    """At step s world rank r pushes to t = r + s exactly when t reads r's block over the network at step s,
    into the buffer t reads it from; blocks of this node are pulled; every rank reads each other rank once."""
    P = L * N
    steps = {r: XR.x_steps(r, L, N) for r in range(P)}
    for r in range(P):
        assert [st.source for st in steps[r]] == [source_rank(r, s, P) for s in range(1, P)]
        assert sum(st.remote_source for st in steps[r]) == P - L == sum(st.remote_target for st in steps[r])
        for st in steps[r]:
            assert st.remote_source == (st.source // L != r // L) and st.slot == st.step % 2
            back = steps[st.target][st.step - 1]
            assert back.source == r and back.remote_source == st.remote_target and back.slot == st.slot


def test_x_workspace_layout_control_words_fixed():
    a, xa, ta = XR.x_workspace_layout(2, 3, 1 << 20)
    b, xb, tb = XR.x_workspace_layout(2, 3, 5 << 20)
    assert (a.consumed_off, a.flags_off) == (b.consumed_off, b.flags_off)
    assert (xa.grant_off, xa.ready_off, xa.calls_off, xa.home_off) == (xb.grant_off, xb.ready_off, xb.calls_off,
                                                                        xb.home_off)
    ws_a = RO.workspace_layout(2, 1 << 20)[0]
    assert (a.consumed_off, a.flags_off) == (ws_a.consumed_off, ws_a.flags_off)  # the one-node control words
    assert xa.grant_off >= a.flags_off + 8 * 1024 and xa.calls_off + 8 * 6 <= xa.home_off
    assert xa.home_off % 4096 == 0 and xa.buf_stride % 256 == 0 and xa.buf_off == xa.home_off + xa.buf_stride
    assert ta == xa.buf_off + 2 * xa.buf_stride and xa.bytes == 1 << 20
    assert ctypes.sizeof(XR.RingXLayout) == 56


def test_x_program_orders_grant_before_push():
    """On the side stream a step's grant precedes its push (a push waits for its target's grant of the same
    step, so the waits cannot close a cycle around the ring) and a buffer is granted or pulled into only
    after the step two back finished reading it."""
    prog = XR.x_program(1, 2, 2)
    x = [a for a in prog if a[0] == "X"]
    for s in range(1, 4):
        i = {a[1]: n for n, a in enumerate(x) if len(a) > 2 and a[2] == s}
        if "grant" in i and "push" in i:
            assert i["grant"] < i["push"]
        if s >= 2:
            wd = x.index(("X", "wait_done", s - 2))
            assert all(wd < n for n, a in enumerate(x) if a[1] in ("grant", "pull") and a[2] == s)
    assert x[:3] == [("X", "begin"), ("X", "drain"), ("X", "home")] and prog[0] == ("S", "fork")


def _merge(acc, o, l):
    """log-sum-exp merge of a partial (o [n, D], lse [n]) into acc (None: start)."""
    if acc is None:
        return o, l
    ao, al = acc
    m = np.logaddexp(al, l)
    w1, w2 = np.exp(al - m), np.exp(l - m)
    return np.nan_to_num(w1)[:, None] * ao + np.nan_to_num(w2)[:, None] * o, m


def _partial(q, k, v, scale, causal):
    s = q @ k.T * scale
    if causal:
        nq, nk = s.shape
        s = np.where(np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq, s, -np.inf)
    m = s.max(1)
    p = np.exp(s - m[:, None])
    return (p / p.sum(1)[:, None]) @ v, m + np.log(p.sum(1))


class _World:
    """Every world rank of L x N emulated nodes running ``x_program`` for ``calls`` calls: streams, events,
    device flags, copy-engine pulls and each rank's proxy (commands delivered in any order, a WRITE reading
    its source when delivered), actions picked at random among those that may run, each rank's streams and
    network at their own random speed (the draw weights).  Buffers and homes carry
    (owner, call) tags: a step that reads another block than its plan's source of this call fails."""

    make_program = staticmethod(XR.x_program)

    def __init__(self, L, N, calls, causal, rng, S_loc=6, D=4):
        self.L, self.N, self.P = L, N, L * N
        P = self.P
        self.rng, self.causal, self.scale = rng, causal, 0.6
        S = S_loc * P
        self.rows = [zigzag_indices(S, P, r) if causal else np.arange(r * S_loc, (r + 1) * S_loc) for r in range(P)]
        self.data = [tuple(rng.standard_normal((S, D)) for _ in range(3)) for _ in range(calls)]  # q, k, v per call
        self.plans = [make_plan(r, P, S_loc, causal) for r in range(P)]
        self.queues = {}
        for r in range(P):
            prog = self.make_program(r, L, N)
            for stream in "SX":
                q = []
                for e in range(1, calls + 1):
                    q += [(a[1:], e) for a in prog if a[0] == stream]
                    if stream == "S":
                        q.append((("wait_join",), e))
                self.queues[(r, stream)] = q
        self.ev = [{} for _ in range(P)]
        self.epoch, self.value = [0] * P, [0] * P
        self.home = [None] * P
        self.buf = [[None, None] for _ in range(P)]
        self.ready_l = [[0] * P for _ in range(P)]  # [reader][owner] (local peers)
        self.entered = [[0] * P for _ in range(P)]
        self.consumed = [[0] * P for _ in range(P)]  # [owner][reader] (local peers)
        self.grant = [[0] * P for _ in range(P)]  # [owner][reader]
        self.xready = [[0] * P for _ in range(P)]  # [reader][owner]
        self.xcalls = [[0] * P for _ in range(P)]
        self.inflight = [[] for _ in range(P)]
        self.acc = [None] * P
        self.results = {}
        self.speed = {(r, x): rng.uniform(0.01, 1.0) for r in range(P) for x in ("S", "X", "net")}

    def _evok(self, r, name, e):
        return self.ev[r].get(name, 0) >= e

    def _local(self, a, b):
        return a // self.L == b // self.L

    def runnable(self, r, stream):
        if not self.queues[(r, stream)]:
            return False
        return self.may_run(r, *self.queues[(r, stream)][0])

    def may_run(self, r, action, e):
        """Whether the queue head ``action`` of call ``e`` may run on rank ``r`` (its waits are met)."""
        act, *args = action
        if act == "attend":
            return args[0] == 0 or self._evok(r, f"arrived{args[0]}", e)
        if act == "wait_join":
            return self._evok(r, "join", e)
        if act in ("wait_done",):
            return self._evok(r, f"done{args[0]}", e)
        if act == "begin":  # (the side stream's first action: after the fork event)
            return self._evok(r, "fork", e) and all(
                self.consumed[r][j] >= e - 1 for j in range(self.P) if j != r and self._local(j, r))
        if act == "drain":
            return not self.inflight[r]
        if act == "push":
            return self.grant[r][args[1]] >= e
        if act == "xwait":
            return self.xready[r][args[1]] >= e and self.xcalls[r][args[1]] >= e
        if act == "pull":
            j = args[1]
            return self.ready_l[r][j] >= e and self.entered[r][j] >= e
        return True

    def execute(self, r, stream):
        (act, *args), e = self.queues[(r, stream)].pop(0)
        P = self.P
        if act in ("fork", "done", "arrived", "join"):
            self.ev[r][act + (str(args[0]) if args else "")] = e
        elif act == "begin":
            self.epoch[r] = self.value[r] = e
            for j in range(P):
                if j != r and self._local(j, r):
                    self.entered[j][r] = e
        elif act == "home":
            self.home[r] = (r, e)
            for j in range(P):
                if j != r and self._local(j, r):
                    self.ready_l[j][r] = self.value[r]
        elif act == "grant":
            self.inflight[r].append(("flag", self.grant, args[1], r, self.epoch[r]))
        elif act == "push":
            dst, slot = args[1], args[2]
            self.inflight[r].append(("flag", self.xcalls, dst, r, self.epoch[r]))
            self.inflight[r].append(("write", dst, slot, r, self.epoch[r]))
        elif act == "xwait":
            assert self.xcalls[r][args[1]] == e
        elif act == "pull":
            s, j = args
            self.buf[r][s % 2] = self.home[j]
            self.consumed[j][r] = self.value[r]
        elif act == "attend":
            self.attend(r, args[0], e)

    def deliver(self, r, i):
        cmd = self.inflight[r].pop(i)
        if cmd[0] == "flag":
            _, table, dst, src, v = cmd
            table[dst][src] = v
        else:
            _, dst, slot, src, v = cmd
            self.buf[dst][slot] = self.home[src]
            self.xready[dst][src] = v

    def attend(self, r, s, e):
        q, k, v = self.data[e - 1]
        src = self.plans[r].sources[s]
        if s > 0:
            assert self.buf[r][s % 2] == (src, e), (r, s, e, self.buf[r][s % 2])
        qi, kj = self.rows[r], self.rows[src]
        if s == 0:
            self.acc[r] = None
        for ln in self.plans[r].launches:
            if ln.step != s:
                continue
            o, l = _partial(q[qi[ln.q0:ln.q1]], k[kj[:ln.kv_rows]], v[kj[:ln.kv_rows]], self.scale, ln.causal)
            full = (np.zeros((len(qi), q.shape[1])), np.full(len(qi), -np.inf)) if self.acc[r] is None else self.acc[r]
            mo, ml = _merge((full[0][ln.q0:ln.q1], full[1][ln.q0:ln.q1]), o, l)
            full[0][ln.q0:ln.q1], full[1][ln.q0:ln.q1] = mo, ml
            self.acc[r] = full
        if s == self.P - 1:
            self.results[(r, e)] = self.acc[r]

    def run(self):
        while True:
            moves = [("q", r, st) for r in range(self.P) for st in "SX" if self.runnable(r, st)]
            moves += [("d", r, i) for r in range(self.P) for i in range(len(self.inflight[r]))]
            if not moves:
                break
            w = np.array([self.speed[(r, x if k == "q" else "net")] for k, r, x in moves])
            kind, r, x = moves[self.rng.choice(len(moves), p=w / w.sum())]
            self.execute(r, x) if kind == "q" else self.deliver(r, x)
        stuck = {key: q[0] for key, q in self.queues.items() if q}
        assert not stuck, f"deadlock: {stuck}"


@pytest.mark.parametrize("L,N,causal", [(L, N, c) for L, N in NODE_SHAPES for c in (False, True)])
def test_x_world_ring_emulation_gives_full_attention(L, N, causal):
    """float64 emulation of the ring across nodes (every rank's x_program, 3 calls, random interleavings):
    no deadlock, every step reads its source's block of this call, and each rank's merged result is full
    attention over the whole sequence (causal: zigzag over the world ranks) for its rows."""
    for seed in range(3):
        w = _World(L, N, 3, causal, np.random.default_rng(100 * seed + 10 * L + N))
        w.run()
        S = len(w.data[0][0])
        full = np.tril(np.ones((S, S), bool)) if causal else np.ones((S, S), bool)
        for e in range(1, 4):
            q, k, v = w.data[e - 1]
            s = np.where(full, q @ k.T * w.scale, -np.inf)
            lse = np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1)
            o = np.exp(s - lse[:, None]) @ v
            for r in range(w.P):
                got_o, got_l = w.results[(r, e)]
                np.testing.assert_allclose(got_o, o[w.rows[r]], rtol=1e-10, atol=1e-12)
                np.testing.assert_allclose(got_l, lse[w.rows[r]], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("skip,L,N", [("push", 2, 2), ("drain", 1, 2), ("wait_done", 2, 2), ("begin", 2, 2)])
def test_x_world_emulation_catches_a_missing_wait(monkeypatch, skip, L, N):
    """The emulation is sharp: without one of the program's waits some interleaving reads a wrong block (a
    push that does not wait for the reader's grant overwrites a buffer still read; a home copy that does not
    wait for the proxy (drain) or for the local readers (begin) lets the next call's block be read; a grant
    or pull before the step two back finished reading the buffer overwrites it)."""
    assert _failures_without(monkeypatch, _World, skip, lambda seed: _World(L, N, 4, False,
                                                                         np.random.default_rng(seed)), 30) > 0


def _failures_without(monkeypatch, world_cls, skip: str, make, seeds: int) -> int:
    """How many of the worlds ``make(seed)`` (seed < ``seeds``) fail (AssertionError: a wrong block or
    partial read, or a deadlock) when action ``skip`` may run as soon as it is first in its queue (after the
    fork when it is begin: the side stream's first wait)."""
    orig = world_cls.runnable

    def eager(self, r, stream):
        q = self.queues[(r, stream)]
        if q and q[0][0][0] == skip and (skip != "begin" or self._evok(r, "fork", q[0][1])):
            return True
        return orig(self, r, stream)

    monkeypatch.setattr(world_cls, "runnable", eager)
    failed = 0
    for seed in range(seeds):
        try:
            make(seed).run()
        except AssertionError:
            failed += 1
    return failed


def test_x_control_kernels_compile_clean():
    mod = CP.compile_module(XR.XSOURCE, {}, arch="sm_90a")
    for name in ("mk_ring_x_drain", "mk_ring_x_grant", "mk_ring_x_push", "mk_ring_x_wait", "mk_ring_x_send"):
        u = mod.resource_usage[name]
        assert u.get("spill_stores", 0) == 0 and u.get("stack", 0) == 0, u
    assert "warning" not in (mod.log or "").lower(), mod.log
    assert (XR.XSOURCE, {}) in CP.registered_specializations()


def test_zigzag_of_a_context_across_nodes_uses_world_ranks():
    class C:
        num_nodes, rank, size, local_rank, local_size = 2, 3, 4, 1, 2

    x = np.arange(16.0).reshape(1, 16, 1, 1)
    np.testing.assert_array_equal(mkernel.zigzag_shard(x, C(), 1), mkernel.zigzag_shard(x, (3, 4), 1))
    C.num_nodes = 1
    np.testing.assert_array_equal(mkernel.zigzag_shard(x, C(), 1), mkernel.zigzag_shard(x, (1, 2), 1))


class _XCtx(_Ctx):
    num_nodes, local_size, local_rank, rank, size = 2, 2, 1, 1, 4
    node_of_rank = [0, 0, 1, 1]

    def side_stream(self):
        return 77

    def comm_args(self, op, digest):
        return ("comm", op, digest)


class _FakeWs:
    ptr, peer_table, nbytes = 0x5000_0000, 0x6000_0000, 1 << 30

    def peer_ptr(self, j, off=0):
        return 0x7000_0000 * (j + 1) + off


def _fake_driver(log):
    """``(Kern, Cu, Ev, St)``: a kernel whose prepared launches log ``(name, int32 / uint64 arguments)`` (one
    warp on the side stream 77), a driver logging event records and waits, events named by their names, a
    proxy state on a fake workspace."""
    class Kern:
        def __init__(self, name):
            self.name = name

        def prepare(self, grid, threads, args, stream=None, **kw):
            assert stream == 77 and grid == (1, 1, 1) and threads == 32
            vals = tuple(a.value for a in args if isinstance(a, (ctypes.c_int32, ctypes.c_uint64)))
            return lambda: log.append((self.name,) + vals)

    class Cu:
        @staticmethod
        def CUstream(h):
            return ("stream", int(h))

        @staticmethod
        def cuEventRecord(ev, s):
            log.append(("record", ev, s[1]))

        @staticmethod
        def cuStreamWaitEvent(s, ev, flags):
            log.append(("wait", ev, s[1]))

    class Ev:
        def __init__(self, *names):
            for n in names:
                setattr(self, n, n)

    class St:
        ws = _FakeWs()
        proxy = type("Proxy", (), {"ring_device_struct": lambda self: "proxy"})()

    return Kern, Cu, Ev, St


def _x_bound(monkeypatch, log):
    """A RingXBound of world rank 1 of 2 x 2 on fakes that log every submission in order."""
    Kern, Cu, Ev, St = _fake_driver(log)
    monkeypatch.setattr(XR, "proxy_state", lambda ctx, op, nbytes, stream=None: St())
    monkeypatch.setattr(RC, "control", Kern)  # (begin_launch / gate_launch)
    monkeypatch.setattr(XR, "xkernel", Kern)
    monkeypatch.setattr(XR, "attention_launches", lambda ctx, call, plan, bufs, acc: [[s] for s in range(plan.P)])
    monkeypatch.setattr(XR, "launch_step", lambda launches, call, *a: log.append(("attend", launches[0])))
    monkeypatch.setattr(XR, "copy_async", lambda cps, s: log.append(("copy", tuple(cps))))
    monkeypatch.setattr(XR, "mark_proxy_launch", lambda h: log.append(("mark", h)))
    monkeypatch.setattr(XR, "Events", Ev)
    monkeypatch.setattr(XR, "cu", Cu)
    monkeypatch.setattr(XR, "check", lambda r: r)
    ctx = _XCtx()
    q, k, v = _arr((1, 64, 4, 128)), _arr((1, 64, 2, 128)), _arr((1, 64, 2, 128))
    call = RO._Call()
    call.q, call.k, call.v, call.out, call.lse = q, k, v, _arr((1, 64, 4, 128)), _arr((1, 4, 64), "float32")
    call.dims, call.layout, call.stream, call.causal = (1, 64, 64, 4, 2, 128), "bshd", 5, True
    call.options = RingAttentionOptions()
    plan = make_plan(ctx.rank, ctx.size, 64, True, 2 * k.nbytes)
    return XR.RingXBound(ctx, call, plan, 0x1234), call


def test_x_bound_submits_the_program_in_order(ctx, monkeypatch):
    """World rank 1 of 2 nodes x 2: each action of x_program becomes its launch / copies / event, in order,
    on the right stream; every launch that waits on the proxy is followed by mark_proxy_launch."""
    log = []
    bound, call = _x_bound(monkeypatch, log)
    bound.run(5, call)
    lay, X, _ = XR.x_workspace_layout(2, 2, 2 * call.k.nbytes)
    ws, kv = _FakeWs(), call.k.nbytes
    want = [("record", "fork", 5), ("wait", "fork", 77), ("mk_ring_begin",), ("mk_ring_x_drain",), ("mark", 77),
            ("copy", ((ws.ptr + X.home_off, call.k.ptr, kv), (ws.ptr + X.home_off + kv, call.v.ptr, kv),
                      (ws.peer_ptr(0, lay.flags_off + 8), ws.ptr + RO.VALUE_OFF, 8))),
            ("attend", 0), ("record", "done0", 5)]
    # step 1: source 0 (this node: pulled), target 2 (other node: pushed into its buffer 1)
    want += [("mk_ring_x_push", 2, 1), ("mark", 77), ("mk_ring_wait", 0),
             ("copy", ((ws.ptr + X.buf_off + X.buf_stride, ws.peer_ptr(0, X.home_off), 2 * kv),
                       (ws.peer_ptr(0, lay.consumed_off + 8), ws.ptr + RO.VALUE_OFF, 8))),
             ("record", "arrived1", 77), ("wait", "arrived1", 5), ("attend", 1), ("record", "done1", 5)]
    # step 2: source 3 and target 3 (the other node): grant, push into its buffer 0, wait
    want += [("wait", "done0", 77), ("mk_ring_x_grant", 3), ("mark", 77), ("mk_ring_x_push", 3, 0), ("mark", 77),
             ("mk_ring_x_wait", 3), ("mark", 77), ("record", "arrived2", 77), ("wait", "arrived2", 5), ("attend", 2)]
    # step 3: source 2 (other node), target 0 (this node: it pulls)
    want += [("wait", "done1", 77), ("mk_ring_x_grant", 2), ("mark", 77), ("mk_ring_x_wait", 2), ("mark", 77),
             ("record", "arrived3", 77), ("wait", "arrived3", 5), ("attend", 3), ("record", "join", 77),
             ("wait", "join", 5)]
    assert log == want


def test_bind_picks_the_path_by_node_count(ctx, monkeypatch):
    monkeypatch.setattr(XR, "RingXBound", lambda *a: "across nodes")
    monkeypatch.setattr(RO, "_RingBound", lambda *a: "one node")
    call = RO._Call()
    plan = make_plan(0, 2, 8, False)
    assert RO._RING.bind(ctx, call, plan) == "one node"
    x = _XCtx()
    assert RO._RING.bind(x, call, plan) == "across nodes"


def test_backward_across_nodes_at_most_max_parts_ranks(ctx, monkeypatch):
    """Across nodes the ring is the world's: one partial sum adds P <= MAX_PARTS partials."""
    monkeypatch.setattr(RB, "require_gemm_device", lambda what, device: None)
    monkeypatch.setattr(RB._RingAttentionBwd, "compile", lambda self, ctx, call: pytest.fail("compiled bad input"))
    ctx.num_nodes, ctx.local_size, ctx.size = 3, 3, 9
    ctx.node_of_rank = [r // 3 for r in range(9)]
    with pytest.raises(ValueError, match="at most 8 ranks in the ring, got 9"):
        mkernel.ring_attention_backward(ctx, *_bwd_args())
