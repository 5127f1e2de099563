"""Ring attention backward across nodes: the forward's world ring (internode.py: K/V blocks pulled from this
node over NVLink, pushed by their owners through the CPU proxy from other nodes) with the backward's launches
(common.BackwardLaunches: dQ accumulated locally in fp32, each step's fp32 dK / dV partial in this rank's
partial buffer of that step).  A partial of a block owned on this node is read by its owner over NVLink at
the end (as on one node); a partial of a block owned on another node is sent home through the proxy
(mk_ring_x_send: WRITE into the owner's inbox, FLAG pready) once its step is done.  Each owner sums the P
partials of its block in world-rank order (deterministic dK / dV).  docs/ring_attention.md, "Backward
across nodes".

The host submits :func:`x_backward_program`; tests/cpu/test_ring_attention_bwd_x.py runs the same program
for every rank of emulated nodes.
"""
from __future__ import annotations

import ctypes

from cuda.bindings import driver as cu

from ...core.driver import check
from ...core.streams import copy_async
from ...core.util import round_up
from ...dist.signals import MAX_CHUNKS
from ..base import BoundCall
from ..collectives.internode import proxy_state
from .common import VALUE_OFF, BackwardLaunches, RingLayout, gate_launch
from .internode import ONE, RingXLayout, XTransport, kv_actions, x_steps, x_workspace_layout, xkernel
from .plan import partial_rows, partial_step

__all__ = ["BwdXLayout", "x_backward_workspace_layout", "inbox_slot", "x_backward_program", "RingBwdXBound"]

OP = "ring_attention_backward"


class BwdXLayout:
    """The backward's workspace across nodes (the proxy's window 0): ``home`` / ``parts`` (the local control
    words: K/V ready flags in row 0, partial ready flags in row 1), ``X`` (the K/V transport's layout, as the
    forward's), ``XP`` (``X`` with ``ready_off`` at pready[P]: the remote partials' flags), ``part_off`` (P
    partial buffers, ``part_stride`` bytes each: dK then dV fp32 ``[S_local, B, H_kv, D]``; buffer s holds
    this rank's partial of step s), ``inbox_off`` (P - L slots: the partials of our block from the ranks of
    other nodes, :func:`inbox_slot`), ``total`` bytes."""

    __slots__ = ("home", "parts", "X", "XP", "part_off", "part_stride", "inbox_off", "total")


def x_backward_workspace_layout(L: int, N: int, kv_block_bytes: int, part_bytes: int) -> BwdXLayout:
    """The layout for L ranks per node, N nodes, K/V blocks (K then V) of ``kv_block_bytes`` and partials
    (dK and dV) of ``part_bytes``; the control words (pready after calls) sit at offsets that depend on L and
    N only (docs/design.md, "Control words never move")."""
    P = L * N
    home, X, end = x_workspace_layout(L, N, kv_block_bytes, flag_rows=2, words=4)
    b = BwdXLayout()
    b.home, b.parts, b.X = home, RingLayout(home.consumed_off, home.flags_off + 8 * MAX_CHUNKS), X
    b.XP = RingXLayout.from_buffer_copy(X)
    b.XP.ready_off = X.calls_off + 8 * P
    b.part_off, b.part_stride = end, round_up(part_bytes, 256)
    b.inbox_off = b.part_off + P * b.part_stride
    b.total = b.inbox_off + (P - L) * b.part_stride
    return b


def inbox_slot(owner: int, src: int, L: int) -> int:
    """The slot of world rank ``src``'s partial in ``owner``'s inbox (``src`` on another node): its index
    among the ranks of the other nodes, in world-rank order."""
    lo = (owner // L) * L
    assert not lo <= src < lo + L, (owner, src, L)
    return src if src < lo else src - L


def _part_action(st) -> tuple:
    return ("X", "part", st.step, st.source, st.remote_source)


def x_backward_program(rank: int, L: int, N: int) -> tuple:
    """The actions of one backward call of world rank ``rank``, in submission order, each ``(stream, action,
    *args)``: the forward's (internode.x_program: fork, begin, drain, home, the K/V actions of every step,
    join; a local pull does not raise consumed here) and

    * S pre (mk_attn_bwd_pre, before step 0), S attend s (step s's main-kernel launches), S done s (every
      step s >= 1: its partial is complete; step 0 too when step 2 reuses its buffer);
    * X part s owner remote: after X waited done s (the wait_done that gates step s + 2's buffer, or at the
      end for the last two steps), the partial of step s goes to its owner: a local owner's parts flag
      [me] is raised (it reads the partial over NVLink), a remote owner gets it through the proxy
      (mk_ring_x_send into its inbox, FLAG pready[me]);
    * X lwait src / pwait src: every source's partial of our block is there (a local source's parts flag:
      mk_ring_wait; a remote one's pready: mk_ring_x_wait on the XP layout); X parts: event;
    * S sum (after parts: mk_attn_bwd_part_sum, mk_attn_bwd_convert); with local peers, S summed and X
      consumed (after summed: consumed[me] raised in every local peer: done reading its home and partial)."""
    P = L * N
    steps = x_steps(rank, L, N)
    prog = [("S", "fork"), ("X", "begin"), ("X", "drain"), ("X", "home"), ("S", "pre"), ("S", "attend", 0)]
    if 2 < P:
        prog.append(("S", "done", 0))
    for st in steps:
        s = st.step
        if s >= 2:
            prog.append(("X", "wait_done", s - 2))
            if s >= 3:
                prog.append(_part_action(steps[s - 3]))
        prog += kv_actions(st)
        prog += [("S", "attend", s), ("S", "done", s)]
    for st in steps[max(0, P - 3):]:  # (steps P - 2 and P - 1: no later step waited for them)
        prog += [("X", "wait_done", st.step), _part_action(st)]
    node = rank // L
    prog += [("X", "lwait" if src // L == node else "pwait", src) for src in range(P) if src != rank]
    prog += [("X", "parts"), ("S", "sum")]
    if L > 1:
        prog += [("S", "summed"), ("X", "consumed")]
    prog.append(("X", "join"))
    return tuple(prog)


class RingBwdXBound(BoundCall):
    """A ring backward call across nodes bound to one layout: the compute launches (common.BackwardLaunches),
    the K/V transport (internode.XTransport) and per partial action of :func:`x_backward_program` its
    prepared flag copy or control launch."""

    def __init__(self, ctx, c, plan, digest: int):
        L, N, r = ctx.local_size, ctx.num_nodes, ctx.rank
        P, me, node = L * N, ctx.local_rank, ctx.rank // ctx.local_size
        self.plan = plan
        kv, half = c.k.nbytes, BackwardLaunches.part_half(c)
        W = x_backward_workspace_layout(L, N, 2 * kv, 2 * half)
        self.state = st = proxy_state(ctx, OP, W.total, c.stream)
        self.ws = ws = st.ws
        self.program = x_backward_program(r, L, N)
        comm = ctx.comm_args(OP, digest)
        self.xt = xt = XTransport(ctx, comm, st, W.home, W.X, self.program, kv, c.options.pull_chunks, False,
                                  ("parts", "summed"))
        wsp, value = ctypes.c_void_p(ws.ptr), ws.ptr + VALUE_OFF
        self._acts = {}
        for a in self.program:
            if a[1] == "part" and not a[4]:  # (a local owner: raise its parts flag [me])
                self._acts[a] = [(ws.peer_ptr(a[3] - node * L, W.parts.flags_off + 8 * me), value, 8)]
            elif a[1] == "part":
                u64 = ctypes.c_uint64
                self._acts[a] = xkernel("mk_ring_x_send").prepare(
                    *ONE, [comm, xt.prox, wsp, ctypes.c_int32(a[3]), u64(W.part_off + a[2] * W.part_stride),
                           u64(W.inbox_off + inbox_slot(a[3], r, L) * W.part_stride), u64(2 * half),
                           u64(W.XP.ready_off + 8 * r)], stream=xt.side_handle)
            elif a[1] == "lwait":
                self._acts[a] = gate_launch(comm, ws, W.parts, a[2] - node * L, xt.side_handle)
            elif a[1] == "pwait":
                self._acts[a] = xkernel("mk_ring_x_wait").prepare(*ONE, [comm, wsp, W.XP, ctypes.c_int32(a[2])],
                                                                  stream=xt.side_handle)
        self._consumed = [(ws.peer_ptr(j, W.home.consumed_off + 8 * me), value, 8) for j in range(L) if j != me]
        recv = [ws.ptr + W.X.buf_off, ws.ptr + W.X.buf_off + W.X.buf_stride]
        part = [ws.ptr + W.part_off + s * W.part_stride for s in range(P)]
        srcs = [self._partial_of(ws, W, i, r, L, part) for i in range(P)]  # (part: P buffers)
        rows = [partial_rows(r, i, P, c.dims[1], c.causal) for i in range(P)]
        self.compute = BackwardLaunches(ctx, c, plan, recv, part, srcs, rows)
        self.buffers = self.compute.buffers

    @staticmethod
    def _partial_of(ws, W: BwdXLayout, i: int, r: int, L: int, part: list) -> int:
        """Where world rank ``i``'s partial of our block (world rank ``r``'s) is read: our own buffer of step
        0, a local peer's buffer of its step (NVLink), or our inbox slot (sent through the proxy)."""
        if i == r:
            return part[0]
        if i // L == r // L:
            return ws.peer_ptr(i % L, W.part_off + partial_step(r, i, len(part)) * W.part_stride)
        return ws.ptr + W.inbox_off + inbox_slot(r, i, L) * W.part_stride

    def run(self, stream, call) -> None:
        s, xt = cu.CUstream(stream), self.xt
        self.compute.point(call)
        for a in self.program:
            act = a[1]
            if act == "pre":
                self.compute.pre()
            elif act == "attend":
                xt.wait_arrived(a[2], s)
                self.compute.step(a[2], call)
            elif act == "part" and not a[4]:
                copy_async(self._acts[a], xt.side)
            elif act in ("part", "pwait"):
                xt.proxy_launch(self._acts[a])
            elif act == "lwait":
                self._acts[a]()
            elif act == "parts":
                check(cu.cuEventRecord(xt.ev.parts, xt.side))
            elif act == "sum":
                check(cu.cuStreamWaitEvent(s, xt.ev.parts, 0))
                self.compute.finish()
            elif act == "summed":
                check(cu.cuEventRecord(xt.ev.summed, s))
            elif act == "consumed":
                check(cu.cuStreamWaitEvent(xt.side, xt.ev.summed, 0))
                copy_async(self._consumed, xt.side)
            else:
                xt.submit(a, s, call)
