"""Ring attention backward across nodes on the CPU (mkernel/ops/ring_attention/internode_bwd.py): the
workspace layout, the program's order, a float64 emulation of every rank's program over emulated nodes
against the float64 gradients of full attention, the host's submission order (fake driver), the path choice.
The control kernels' compile check (mk_ring_x_send included): test_ring_attention_host.py."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

from mkernel.ops.attention.reference import attention_reference
from mkernel.ops.ring_attention import RingAttentionOptions, make_plan
from mkernel.ops.ring_attention import backward as RB
from mkernel.ops.ring_attention import common as RC
from mkernel.ops.ring_attention import internode as XR
from mkernel.ops.ring_attention import internode_bwd as XB
from mkernel.ops.ring_attention.plan import partial_rows, partial_step

from test_ring_attention_host import (NODE_SHAPES, _FakeWs, _World, _XCtx, _arr, _attn_grads, _bwd_args,  # noqa: F401
                                     _failures_without, _fake_driver, ctx)


# ------------------------------------------------------------------ layout and program
def test_x_backward_workspace_layout():
    a = XB.x_backward_workspace_layout(2, 3, 1 << 20, 3 << 20)
    b = XB.x_backward_workspace_layout(2, 3, 5 << 20, 7 << 20)
    fields = lambda w: (w.home.consumed_off, w.home.flags_off, w.parts.flags_off, w.X.grant_off, w.X.ready_off,
                        w.X.calls_off, w.XP.ready_off, w.X.home_off)
    assert fields(a) == fields(b)  # control words never move
    assert a.parts.flags_off > a.home.flags_off and a.parts.consumed_off == a.home.consumed_off
    assert a.XP.ready_off == a.X.calls_off + 8 * 6 and a.XP.ready_off + 8 * 6 <= a.X.home_off
    assert (a.XP.grant_off, a.XP.calls_off, a.XP.home_off, a.XP.bytes) == (a.X.grant_off, a.X.calls_off,
                                                                          a.X.home_off, a.X.bytes)
    assert a.part_off == a.X.buf_off + 2 * a.X.buf_stride and a.part_off % 256 == 0 and a.part_stride % 256 == 0
    assert a.inbox_off == a.part_off + 6 * a.part_stride and a.total == a.inbox_off + 4 * a.part_stride


@pytest.mark.parametrize("L,N", NODE_SHAPES)
def test_inbox_slots_are_a_bijection(L, N):
    P = L * N
    for owner in range(P):
        remote = [i for i in range(P) if i // L != owner // L]
        assert sorted(XB.inbox_slot(owner, i, L) for i in remote) == list(range(P - L))


@pytest.mark.parametrize("L,N", NODE_SHAPES)
def test_x_backward_program_sends_every_partial_once(L, N):
    """Every step s >= 1's partial goes to its block's owner exactly once, after the wait for done s; every
    other rank's partial of our block is waited for once (lwait: this node, pwait: another) before the sum;
    the K/V actions are the forward's."""
    P = L * N
    for r in range(P):
        prog = XB.x_backward_program(r, L, N)
        x = [a for a in prog if a[0] == "X"]
        parts = [a for a in x if a[1] == "part"]
        assert sorted(a[2] for a in parts) == list(range(1, P))
        for a in parts:
            s, owner, remote = a[2], a[3], a[4]
            assert owner == (r - s) % P and remote == (owner // L != r // L)
            assert x.index(("X", "wait_done", s)) < x.index(a)
        waits = [a for a in x if a[1] in ("lwait", "pwait")]
        assert sorted(a[2] for a in waits) == [i for i in range(P) if i != r]
        assert all((a[1] == "lwait") == (a[2] // L == r // L) for a in waits)
        assert prog.index(("X", "parts")) > max(prog.index(a) for a in waits + parts)
        assert prog.index(("S", "sum")) > prog.index(("S", "attend", P - 1))
        fwd = [a for a in XR.x_program(r, L, N) if a[1] in ("grant", "push", "xwait", "pull", "arrived")]
        assert [a for a in prog if a[1] in ("grant", "push", "xwait", "pull", "arrived")] == fwd


# ------------------------------------------------------------------ float64 emulation
class _BwdWorld(_World):
    """The forward's emulated world (test_ring_attention_host._World) running x_backward_program: each
    step's main-kernel launches in float64 (dQ accumulated, the block's partial written to the rank's
    partial buffer of the step, tagged (owner, call, source); unwritten rows NaN), partials sent home through
    the proxy (delivered in any order, reading the source buffer when delivered) or read over NVLink by a
    local owner at its sum, which checks every tag and adds the partials in world-rank order."""

    make_program = staticmethod(XB.x_backward_program)

    def __init__(self, L, N, calls, causal, rng, S_loc=6, D=4):
        super().__init__(L, N, calls, causal, rng, S_loc, D)
        P = self.P
        self.douts = [rng.standard_normal((S_loc * P, D)) for _ in range(calls)]
        self.refs = []
        for (q, k, v), do in zip(self.data, self.douts):
            o, lse, gq, gk, gv = attention_reference(*(x[None, :, None] for x in (q, k, v)), causal, self.scale,
                                                     do[None, :, None])
            self.refs.append((lse[0, 0], (do * o[0, :, 0]).sum(1), gq[0, :, 0], gk[0, :, 0], gv[0, :, 0]))
        self.part = [[None] * P for _ in range(P)]
        self.inbox = [[None] * P for _ in range(P)]
        self.lparts = [[0] * P for _ in range(P)]  # [owner][source] (local peers)
        self.pready = [[0] * P for _ in range(P)]  # [owner][source] (remote)
        self.dq = [None] * P

    def may_run(self, r, action, e):
        act, *args = action
        if act == "sum":
            return self._evok(r, "parts", e)
        if act == "consumed":
            return self._evok(r, "summed", e)
        if act == "lwait":
            return self.lparts[r][args[0]] >= e and self.entered[r][args[0]] >= e
        if act == "pwait":
            return self.pready[r][args[0]] >= e and self.xcalls[r][args[0]] >= e
        return super().may_run(r, action, e)

    def execute(self, r, stream):
        (act, *args), e = self.queues[(r, stream)][0]
        if act in ("pull", "pre", "part", "pwait", "sum", "consumed", "parts", "summed"):
            self.queues[(r, stream)].pop(0)
            getattr(self, "x_" + act)(r, e, *args)
        else:
            super().execute(r, stream)

    def x_pull(self, r, e, s, j):  # (no consumed: raised after the sum)
        self.buf[r][s % 2] = self.home[j]

    def x_pre(self, r, e):
        self.dq[r] = np.zeros((len(self.rows[r]), self.data[0][0].shape[1]))

    def x_parts(self, r, e):
        self.ev[r]["parts"] = e

    def x_summed(self, r, e):
        self.ev[r]["summed"] = e

    def x_part(self, r, e, s, owner, remote):
        if remote:
            self.inflight[r].append(("pwrite", owner, XB.inbox_slot(owner, r, self.L), r, s, self.epoch[r]))
        else:
            self.lparts[owner][r] = self.value[r]

    def x_pwait(self, r, e, src):
        assert self.xcalls[r][src] == e

    def x_consumed(self, r, e):
        for j in range(self.P):
            if j != r and self._local(j, r):
                self.consumed[j][r] = self.value[r]

    def deliver(self, r, i):
        if self.inflight[r][i][0] != "pwrite":
            return super().deliver(r, i)
        _, dst, slot, src, s, v = self.inflight[r].pop(i)
        self.inbox[dst][slot] = self.part[src][s]
        self.pready[dst][src] = v

    def attend(self, r, s, e):
        q, k, v = self.data[e - 1]
        do = self.douts[e - 1]
        lse, dsum = self.refs[e - 1][:2]
        src = self.plans[r].sources[s]
        if s > 0:
            assert self.buf[r][s % 2] == (src, e), (r, s, e, self.buf[r][s % 2])
        qi, kj = self.rows[r], self.rows[src]
        S_loc, D = len(qi), q.shape[1]
        pk, pv = np.full((S_loc, D), np.nan), np.full((S_loc, D), np.nan)
        for ln in self.plans[r].launches:
            if ln.step != s:
                continue
            nq, nk = ln.q1 - ln.q0, ln.kv_rows
            mask = (np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq) if ln.causal else np.ones((nq, nk), bool)
            rq, rk = qi[ln.q0:ln.q1], kj[:nk]
            gq, gk, gv = _attn_grads(q[rq], k[rk], v[rk], do[rq], self.scale, mask, lse[rq], dsum[rq])
            self.dq[r][ln.q0:ln.q1] += gq
            pk[:nk], pv[:nk] = gk, gv
        self.part[r][s] = (src, e, r, pk, pv)

    def x_sum(self, r, e):
        P, L = self.P, self.L
        S_loc, D = self.dq[r].shape
        dk, dv = np.zeros((S_loc, D)), np.zeros((S_loc, D))
        for i in range(P):  # world-rank order, as mk_attn_bwd_part_sum
            if i == r:
                got = self.part[r][0]
            elif self._local(i, r):
                got = self.part[i][partial_step(r, i, P)]
            else:
                got = self.inbox[r][XB.inbox_slot(r, i, L)]
            assert got is not None and got[:3] == (r, e, i), (r, e, i, got and got[:3])
            n = partial_rows(r, i, P, S_loc, self.causal)
            dk[:n] += got[3][:n]
            dv[:n] += got[4][:n]
        self.results[(r, e)] = (self.dq[r].copy(), dk, dv)


@pytest.mark.parametrize("L,N,causal", [(L, N, c) for L, N in NODE_SHAPES for c in (False, True)])
def test_x_backward_emulation_gives_full_gradients(L, N, causal):
    """float64 emulation of the backward across nodes (every rank's x_backward_program, 3 calls, random
    interleavings): no deadlock, every step reads its source's block of this call, every sum reads each
    source's partial of this call, and dq, dk, dv equal the float64 gradients of full attention over the
    whole sequence (causal: zigzag over the world ranks) on each rank's rows."""
    for seed in range(3):
        w = _BwdWorld(L, N, 3, causal, np.random.default_rng(100 * seed + 10 * L + N + 7))
        w.run()
        for e in range(1, 4):
            _, _, gq, gk, gv = w.refs[e - 1]
            for r in range(w.P):
                dq, dk, dv = w.results[(r, e)]
                rows = w.rows[r]
                np.testing.assert_allclose(dq, gq[rows], rtol=1e-10, atol=1e-12)
                np.testing.assert_allclose(dk, gk[rows], rtol=1e-10, atol=1e-12)
                np.testing.assert_allclose(dv, gv[rows], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("skip,L,N", [("pwait", 1, 2), ("lwait", 2, 2), ("sum", 2, 2), ("wait_done", 1, 2),
                                      ("wait_done", 2, 2), ("push", 2, 2)])
def test_x_backward_emulation_catches_a_missing_wait(monkeypatch, skip, L, N):
    """Without one of the program's waits some interleaving reads a wrong block or partial: a sum before a
    remote (pwait) or local (lwait) partial is there, or before the waits (sum); a partial sent, or a
    buffer granted or pulled into, before its step is done (wait_done); a push overwriting a buffer still
    read (push).  (drain and begin's consumed wait are not needed by the backward -- every reader of our
    home and partials sends us its partial of our block after reading, and our sum waits for it -- which
    test_x_backward_emulation_needs_no_drain shows.)"""
    assert _failures_without(monkeypatch, _BwdWorld, skip, lambda seed: _BwdWorld(L, N, 4, False,
                                                                               np.random.default_rng(seed)), 30) > 0


@pytest.mark.parametrize("skip", ["drain", "begin"])
def test_x_backward_emulation_needs_no_drain(monkeypatch, skip):
    """The backward stays correct without the drain or begin's wait for consumed (they stay: the transport
    is the forward's, and begin takes the epoch): docs/ring_attention.md, "Backward across nodes"."""
    assert _failures_without(monkeypatch, _BwdWorld, skip, lambda seed: _BwdWorld(2, 2, 4, seed % 2 == 1,
                                                                               np.random.default_rng(seed)), 10) == 0


# ------------------------------------------------------------------ submission order (fake driver)
class _Compute:
    """Stands in for common.BackwardLaunches: logs its launches."""

    log = None

    def __init__(self, ctx, c, plan, recv, part, srcs, rows):
        self.recv, self.part, self.srcs, self.rows, self.buffers = recv, part, srcs, rows, ()

    part_half = staticmethod(RC.BackwardLaunches.part_half)

    def point(self, call):
        self.log.append(("point",))

    def pre(self):
        self.log.append(("pre",))

    def step(self, s, call):
        self.log.append(("attend", s))

    def finish(self):
        self.log.append(("sum",))


def _bwd_x_bound(monkeypatch, log):
    """A RingBwdXBound of world rank 1 of 2 x 2 on fakes that log every submission in order."""
    Kern, Cu, Ev, St = _fake_driver(log)
    _Compute.log = log
    for mod in (XR, XB):
        monkeypatch.setattr(mod, "cu", Cu)
        monkeypatch.setattr(mod, "check", lambda r: r)
        monkeypatch.setattr(mod, "copy_async", lambda cps, s: log.append(("copy", tuple(cps))))
        monkeypatch.setattr(mod, "xkernel", Kern)
    monkeypatch.setattr(XB, "proxy_state", lambda ctx, op, nbytes, stream=None: St())
    monkeypatch.setattr(XB, "BackwardLaunches", _Compute)
    monkeypatch.setattr(RC, "control", Kern)  # (begin_launch / gate_launch)
    monkeypatch.setattr(XR, "mark_proxy_launch", lambda h: log.append(("mark", h)))
    monkeypatch.setattr(XR, "Events", Ev)
    ctx = _XCtx()
    q, k, v, o, lse, do = _bwd_args()
    c = RB._Call()
    c.q, c.k, c.v, c.o, c.lse, c.do = q, k, v, o, lse, do
    c.dims, c.layout, c.stream, c.causal, c.options = (1, 64, 64, 4, 2, 128), "bshd", 5, True, RingAttentionOptions()
    plan = make_plan(ctx.rank, ctx.size, 64, True, 2 * k.nbytes)
    return XB.RingBwdXBound(ctx, c, plan, 0x1234), c


def test_x_backward_bound_submits_the_program_in_order(ctx, monkeypatch):
    """World rank 1 of 2 nodes x 2: each action of x_backward_program becomes its launch / copies / event, in
    order, on the right stream; every launch that waits on the proxy is followed by mark_proxy_launch; the
    partial sum reads each source's partial where it lands."""
    log = []
    bound, call = _bwd_x_bound(monkeypatch, log)
    bound.run(5, call)
    kv, half = call.k.nbytes, RC.BackwardLaunches.part_half(call)
    W = XB.x_backward_workspace_layout(2, 2, 2 * kv, 2 * half)
    ws, X, val = _FakeWs(), W.X, _FakeWs.ptr + RC.VALUE_OFF
    want = [("point",), ("record", "fork", 5), ("wait", "fork", 77), ("mk_ring_begin",), ("mk_ring_x_drain",),
            ("mark", 77),
            ("copy", ((ws.ptr + X.home_off, call.k.ptr, kv), (ws.ptr + X.home_off + kv, call.v.ptr, kv),
                      (ws.peer_ptr(0, W.home.flags_off + 8), val, 8))),
            ("pre",), ("attend", 0), ("record", "done0", 5)]
    # step 1: source 0 (this node: pulled, no consumed), target 2 (other node: pushed into its buffer 1)
    want += [("mk_ring_x_push", 2, 1), ("mark", 77), ("mk_ring_wait", 0),
             ("copy", ((ws.ptr + X.buf_off + X.buf_stride, ws.peer_ptr(0, X.home_off), 2 * kv),)),
             ("record", "arrived1", 77), ("wait", "arrived1", 5), ("attend", 1), ("record", "done1", 5)]
    # step 2: source 3 and target 3 (the other node)
    want += [("wait", "done0", 77), ("mk_ring_x_grant", 3), ("mark", 77), ("mk_ring_x_push", 3, 0), ("mark", 77),
             ("mk_ring_x_wait", 3), ("mark", 77), ("record", "arrived2", 77), ("wait", "arrived2", 5),
             ("attend", 2), ("record", "done2", 5)]
    # step 3: after done 1, step 1's partial (owner 0, this node) is announced: parts flag [1] of local rank 0
    want += [("wait", "done1", 77), ("copy", ((ws.peer_ptr(0, W.parts.flags_off + 8), val, 8),)),
             ("mk_ring_x_grant", 2), ("mark", 77), ("mk_ring_x_wait", 2), ("mark", 77), ("record", "arrived3", 77),
             ("wait", "arrived3", 5), ("attend", 3), ("record", "done3", 5)]
    # the partials of steps 2 (owner 3) and 3 (owner 2) go home through the proxy, into slot 1 of their inbox
    for s, owner in ((2, 3), (3, 2)):
        want += [("wait", f"done{s}", 77),
                 ("mk_ring_x_send", owner, W.part_off + s * W.part_stride, W.inbox_off + 1 * W.part_stride,
                  2 * half, W.XP.ready_off + 8 * 1), ("mark", 77)]
    # every other rank's partial of our block, the sum, consumed to the local peer, join
    want += [("mk_ring_wait", 0), ("mk_ring_x_wait", 2), ("mark", 77), ("mk_ring_x_wait", 3), ("mark", 77),
             ("record", "parts", 77), ("wait", "parts", 5), ("sum",), ("record", "summed", 5),
             ("wait", "summed", 77), ("copy", ((ws.peer_ptr(0, W.home.consumed_off + 8), val, 8),)),
             ("record", "join", 77), ("wait", "join", 5)]
    assert log == want
    part = [ws.ptr + W.part_off + s * W.part_stride for s in range(4)]
    assert bound.compute.srcs == [ws.peer_ptr(0, W.part_off + 3 * W.part_stride), part[0],  # (rank 0: step 3)
                                  ws.ptr + W.inbox_off, ws.ptr + W.inbox_off + W.part_stride]
    assert bound.compute.rows == [64, 64, 32, 32]  # (causal: a source above the owner sees its low chunk)
    assert bound.compute.part == part and bound.compute.recv == [ws.ptr + X.buf_off, ws.ptr + X.buf_off + X.buf_stride]


def test_backward_bind_picks_the_path_by_node_count(ctx, monkeypatch):
    monkeypatch.setattr(RB, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(RB, "RingBwdXBound", lambda *a: "across nodes")
    monkeypatch.setattr(RB, "_RingBwdBound", lambda *a: "one node")
    c = RB._Call()
    plan = make_plan(0, 2, 8, False)
    assert RB._RING_BWD.bind(ctx, c, plan) == "one node"
    assert RB._RING_BWD.bind(_XCtx(), c, plan) == "across nodes"


def test_backward_plan_is_the_world_ring(ctx):
    c = RB._Call()
    c.q, c.k, c.v, c.o, c.lse, c.do = _bwd_args()
    c.dims, c.causal, c.layout, c.options = (1, 64, 64, 4, 2, 128), True, "bshd", RingAttentionOptions()
    plan = RB._RING_BWD.plan(_XCtx(), c, 7)
    assert (plan.P, plan.rank, plan.sources) == (4, 1, (1, 0, 3, 2))
    assert (plan.backward_kernel, plan.backward_fallback) == ("wgmma", "")  # (the same kernels as on one node)
