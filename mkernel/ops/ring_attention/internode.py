"""Ring attention forward across nodes: the same step schedule over the WORLD ring (world rank r attends at
step s to world rank ``(r - s) mod P``'s K/V block, P = L * N node-major ranks).  A block owned on this node is
pulled by the copy engines from the owner's home copy (NVLink, as on one node); a block owned on another node
is pushed by its owner through the owner's CPU proxy (WRITE of its home into the reader's receive buffer
``s % 2``, then a FLAG), after the reader granted that buffer.  The control kernels are
cuda_src/ops/ring_attention_x.cu; the attention launches are the one-node path's (common.py).
docs/ring_attention.md, "Across nodes".

The host submits :func:`x_program`, a list of actions on the caller's stream ("S") and the context's side
stream ("X"); tests/cpu/test_ring_attention_host.py runs the same program for every rank of emulated nodes.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from cuda.bindings import driver as cu

from ...core.arrays import DeviceArray
from ...core.compiler import kernel as compiled_kernel, register_specialization
from ...core.driver import check
from ...core.frees import mark_proxy_launch
from ...core.streams import Events, copy_async
from ...core.util import round_up
from ...dist.signals import workspace_control
from ..attention import kernels as AK
from ..base import BoundCall
from ..collectives.internode import proxy_state
from .common import (VALUE_OFF, RingLayout, attention_launches, begin_launch, chunked_copies, gate_launch,
                     launch_step)

__all__ = ["XSOURCE", "RingXLayout", "x_workspace_layout", "XStep", "x_steps", "kv_actions", "x_program", "ONE",
           "xkernel", "compile_controls", "XTransport", "RingXBound"]

OP = "ring_attention"
XSOURCE = "ops/ring_attention_x.cu"
register_specialization(XSOURCE, {})
_X_KERNELS = ("mk_ring_x_drain", "mk_ring_x_grant", "mk_ring_x_push", "mk_ring_x_wait", "mk_ring_x_send")


class RingXLayout(ctypes.Structure):
    """Mirror of MkRingXLayout in cuda_src/ops/ring_attention_x.cu (byte offsets in the op's workspace)."""

    _fields_ = [("grant_off", ctypes.c_uint64), ("ready_off", ctypes.c_uint64), ("calls_off", ctypes.c_uint64),
                ("home_off", ctypes.c_uint64), ("buf_off", ctypes.c_uint64), ("buf_stride", ctypes.c_uint64),
                ("bytes", ctypes.c_uint64)]


def x_workspace_layout(L: int, N: int, kv_block_bytes: int, flag_rows: int = 1,
                       words: int = 3) -> tuple[RingLayout, RingXLayout, int]:
    """``(local control layout, inter-node layout, total bytes)`` of the op's workspace (the proxy's window 0)
    for L ranks per node, N nodes and K/V blocks (K then V) of ``kv_block_bytes``: the one-node control words
    of the L local ranks (``flag_rows`` rows of flags), grant[P], ready[P], calls[P] and ``words - 3`` more
    u64[P] arrays after calls (offsets that depend on L and N only: docs/design.md, "Control words never
    move"), then home and the two receive buffers (256-byte aligned)."""
    P = L * N
    consumed_off, flags_off, end = workspace_control(L, flag_rows)
    X = RingXLayout()
    X.grant_off = round_up(end, 256)
    X.ready_off = X.grant_off + 8 * P
    X.calls_off = X.ready_off + 8 * P
    blk = round_up(max(kv_block_bytes, 16), 256)
    X.home_off = round_up(X.grant_off + 8 * P * words, 4096)
    X.buf_off, X.buf_stride, X.bytes = X.home_off + blk, blk, kv_block_bytes
    return RingLayout(consumed_off, flags_off), X, X.buf_off + 2 * blk


@dataclass(frozen=True)
class XStep:
    """Ring step ``step`` >= 1 of one world rank: it reads ``source``'s block into buffer ``slot`` (over the
    network when ``remote_source``) and its own block is read by ``target`` (pushed there by this rank when
    ``remote_target``; a target on this node pulls it)."""

    step: int
    source: int
    target: int
    remote_source: bool
    remote_target: bool
    slot: int


def x_steps(rank: int, L: int, N: int) -> tuple:
    """World rank ``rank``'s steps 1 .. P-1 (node-major ranks: node = rank // L)."""
    P = L * N
    if L < 1 or N < 1 or not 0 <= rank < P:
        raise ValueError(f"ring_attention: rank {rank} out of range for {L} ranks x {N} nodes")
    out = []
    for s in range(1, P):
        src, dst = (rank - s) % P, (rank + s) % P
        out.append(XStep(s, src, dst, src // L != rank // L, dst // L != rank // L, s % 2))
    return tuple(out)


def kv_actions(st: XStep) -> list:
    """The side stream's actions of step ``st`` that bring its block (after the buffer is free): grant (a
    remote source), push (a remote target, after our grant: it waits for the target's grant), then xwait (a
    remote source) or pull (a local one), then the event arrived."""
    s = st.step
    acts = [("X", "grant", s, st.source)] if st.remote_source else []
    if st.remote_target:
        acts.append(("X", "push", s, st.target, st.slot))
    acts.append(("X", "xwait", s, st.source) if st.remote_source else ("X", "pull", s, st.source))
    acts.append(("X", "arrived", s))
    return acts


def x_program(rank: int, L: int, N: int) -> tuple:
    """The actions of one call of world rank ``rank``, in submission order; each ``(stream, action, *args)``:

    * S fork: the side stream X waits for the caller's stream S (the previous call's launches are done);
    * X begin (mk_ring_begin: the epoch; local peers announced; they finished pulling our home of the last
      call), X drain (mk_ring_x_drain: our proxy finished reading our home), X home (k, v -> home; the value
      slot -> every local peer's ready[me]);
    * S attend s (step s's launches; s >= 1: after X's arrived s), S done s (recorded where step s + 2 reuses
      the buffer);
    * per step s >= 1, on X: wait_done s - 2 (S finished reading buffer s % 2); grant s src (a remote source:
      buffer free); push s dst slot (a remote target, after our grant: waits dst's grant); then either xwait
      s src (remote: flag and call word) or pull s src (local: mk_ring_wait gate, copy-engine pull, consumed);
      arrived s (:func:`kv_actions`);
    * X join: S waits for X."""
    P = L * N
    prog = [("S", "fork"), ("X", "begin"), ("X", "drain"), ("X", "home"), ("S", "attend", 0)]
    if 2 < P:
        prog.append(("S", "done", 0))
    for st in x_steps(rank, L, N):
        s = st.step
        if s >= 2:
            prog.append(("X", "wait_done", s - 2))
        prog += kv_actions(st)
        prog.append(("S", "attend", s))
        if s + 2 < P:
            prog.append(("S", "done", s))
    prog.append(("X", "join"))
    return tuple(prog)


ONE = ((1, 1, 1), 32)  # a control kernel's grid and block


def xkernel(name: str):
    """Control kernel ``name`` of ring_attention_x.cu (compiled or loaded)."""
    return compiled_kernel(XSOURCE, {}, name)


def compile_controls() -> None:
    """Compile (or load) the inter-node control kernels (before the ranks agree)."""
    for name in _X_KERNELS:
        xkernel(name)


class XTransport:
    """The K/V transport of one bound call across nodes, prepared once and submitted action by action: the
    call's frame (fork, begin, drain, home, join), the events (done, wait_done, arrived) and the actions of
    :func:`kv_actions` in ``program``.  ``consumed_on_pull``: a local pull raises its source's consumed[me]
    (the forward); the backward raises it after its partial sum instead (docs/ring_attention.md, "Backward
    across nodes").  ``events``: more event names (``self.ev``)."""

    def __init__(self, ctx, comm, st, lay: RingLayout, X: RingXLayout, program: tuple, kv: int, pieces: int,
                 consumed_on_pull: bool, events: tuple = ()):
        L, me, node = ctx.local_size, ctx.local_rank, ctx.rank // ctx.local_size
        ws = st.ws
        side = ctx.side_stream()
        self.side_handle, self.side = side, cu.CUstream(side)
        self.prox, wsp = st.proxy.ring_device_struct(), ctypes.c_void_p(ws.ptr)
        self._home, self._kv = ws.ptr + X.home_off, kv
        bufs = (ws.ptr + X.buf_off, ws.ptr + X.buf_off + X.buf_stride)
        self._begin = begin_launch(comm, ws, lay, side)
        self._drain = xkernel("mk_ring_x_drain").prepare(*ONE, [comm, self.prox], stream=side)
        self._announce = [(ws.peer_ptr(j, lay.flags_off + 8 * me), ws.ptr + VALUE_OFF, 8) for j in range(L) if j != me]
        self._acts = {}  # (action, step) -> prepared launch or (gate, copies)
        for a in program:
            if a[1] == "grant":
                self._acts[("grant", a[2])] = xkernel("mk_ring_x_grant").prepare(
                    *ONE, [comm, self.prox, wsp, X, ctypes.c_int32(a[3])], stream=side)
            elif a[1] == "push":
                self._acts[("push", a[2])] = xkernel("mk_ring_x_push").prepare(
                    *ONE, [comm, self.prox, wsp, X, ctypes.c_int32(a[3]), ctypes.c_int32(a[4])], stream=side)
            elif a[1] == "xwait":
                self._acts[("xwait", a[2])] = xkernel("mk_ring_x_wait").prepare(
                    *ONE, [comm, wsp, X, ctypes.c_int32(a[3])], stream=side)
            elif a[1] == "pull":
                s, j = a[2], a[3] - node * L  # (a source on this node: its local rank)
                cps = chunked_copies(bufs[s % 2], ws.peer_ptr(j, X.home_off), 2 * kv, pieces)
                if consumed_on_pull:
                    cps.append((ws.peer_ptr(j, lay.consumed_off + 8 * me), ws.ptr + VALUE_OFF, 8))
                self._acts[("pull", s)] = (gate_launch(comm, ws, lay, j, side), cps)
        P = ctx.size
        self.ev = Events("fork", "join", *events, *[f"arrived{s}" for s in range(P)], *[f"done{s}" for s in range(P)])

    def proxy_launch(self, launch) -> None:
        """``launch()`` on the side stream, noted as waiting on the proxy (core/frees.py)."""
        launch()
        mark_proxy_launch(self.side_handle)

    def wait_arrived(self, step: int, s) -> None:
        """The caller's stream ``s`` waits for step ``step``'s block (step 0: its own, nothing to wait for)."""
        if step > 0:
            check(cu.cuStreamWaitEvent(s, getattr(self.ev, f"arrived{step}"), 0))

    def submit(self, a: tuple, s, call) -> None:
        """Submit transport action ``a`` (of the program) for ``call``; ``s``: the caller's stream."""
        act, side, ev = a[1], self.side, self.ev
        if act == "done":
            check(cu.cuEventRecord(getattr(ev, f"done{a[2]}"), s))
        elif act == "wait_done":
            check(cu.cuStreamWaitEvent(side, getattr(ev, f"done{a[2]}"), 0))
        elif act == "arrived":
            check(cu.cuEventRecord(getattr(ev, f"arrived{a[2]}"), side))
        elif act == "pull":
            gate, cps = self._acts[("pull", a[2])]
            gate()
            copy_async(cps, side)
        elif act in ("grant", "push", "xwait"):
            self.proxy_launch(self._acts[(act, a[2])])
        elif act == "fork":
            check(cu.cuEventRecord(ev.fork, s))
            check(cu.cuStreamWaitEvent(side, ev.fork, 0))
        elif act == "begin":
            self._begin()
        elif act == "drain":
            self.proxy_launch(self._drain)
        elif act == "home":
            copy_async([(self._home, call.k.ptr, self._kv), (self._home + self._kv, call.v.ptr, self._kv)]
                       + self._announce, side)
        elif act == "join":
            check(cu.cuEventRecord(ev.join, side))
            check(cu.cuStreamWaitEvent(s, ev.join, 0))
        else:
            raise AssertionError(f"ring attention across nodes: unknown action {a}")


class RingXBound(BoundCall):
    """A ring attention call across nodes bound to one layout: the running fp32 output, the attention launches
    (common.py), and the K/V transport of :func:`x_program` (:class:`XTransport`)."""

    def __init__(self, ctx, call, plan, digest: int):
        B, S, _, Hq, _, D = call.dims
        self.plan = plan
        self.acc = DeviceArray.empty((B, Hq, S, D), "float32", device=ctx.device)
        self.buffers = (self.acc,)
        self._q_ss = AK.bshd(call.q, call.layout)[1][1]
        self._o_ss = AK.bshd(call.out, call.layout)[1][1]
        self._it, kv = call.q.dtype.itemsize, call.k.nbytes
        lay, X, total = x_workspace_layout(ctx.local_size, ctx.num_nodes, 2 * kv)
        self.state = st = proxy_state(ctx, OP, total, call.stream)
        self.ws = st.ws
        self.program = x_program(ctx.rank, ctx.local_size, ctx.num_nodes)
        self.xt = XTransport(ctx, ctx.comm_args(OP, digest), st, lay, X, self.program, kv,
                             call.options.pull_chunks, True)
        bufs = (st.ws.ptr + X.buf_off, st.ws.ptr + X.buf_off + X.buf_stride)
        self._steps = attention_launches(ctx, call, plan, bufs, self.acc)

    def run(self, stream, call) -> None:
        s = cu.CUstream(stream)
        for a in self.program:
            if a[1] == "attend":
                self.xt.wait_arrived(a[2], s)
                launch_step(self._steps[a[2]], call, self._q_ss, self._o_ss, self._it)
            else:
                self.xt.submit(a, s, call)
