"""Ring attention backward across the GPUs of a node, on the op pipeline (mkernel/ops/base.py).

Given the forward's q, k, v, out and (global) lse of this rank's rows and the output gradient dout, computes
dq, dk, dv of this rank's rows.  The K/V blocks circulate as in the forward (copy-engine pulls from each
owner's home copy into two receive buffers, on the context's side stream; the same schedule of launches,
:func:`make_plan`).  Step s runs one of ``mkernel.attention_backward``'s main kernels (the TMA + wgmma one,
or the mma one where TMA cannot read the arrays: ``common.backward_kernel``) in its MKATT_PARTIAL
specialization (cuda_src/ops/attention_bwd.cu) for this rank's query rows against the block of rank
``(r - s) mod P``: dQ adds into one fp32 accumulator over every step (zeroed once, converted once), the
block's fp32 dK / dV partial goes to this rank's partial buffer of step s in its symmetric workspace.  At
the end each owner reads the P partials of its block (its own and its peers', over NVLink) and sums them in
local-rank order: deterministic dK / dV.  docs/ring_attention.md, "Backward".
A context spanning several nodes runs the same launches over the world ring (internode_bwd.py).
"""
from __future__ import annotations

from dataclasses import replace

from cuda.bindings import driver as cu

from ...core.arrays import DeviceArray
from ...core.archs import require_gemm_device
from ...core.device import on_device
from ...core.driver import check
from ...core.streams import Events, copy_async
from ...core.util import round_up
from ...dist.signals import MAX_CHUNKS, workspace_control
from ..attention_bwd import kernels as BK
from ..attention_bwd.op import LAYOUTS, check_arrays, prepare_arrays
from ..base import BoundCall, Op, as_stream, checked_once
from .common import (VALUE_OFF, BackwardLaunches, RingLayout, backward_kernel, begin_launch, chunked_copies, control,
                     gate_launch, gated_pull)
from .internode import compile_controls
from .internode_bwd import RingBwdXBound
from .op import check_ring
from .options import RingAttentionOptions
from .plan import RingPlan, make_plan, partial_rows, partial_step

__all__ = ["ring_attention_backward", "BackwardLayout", "backward_workspace_layout", "partial_rows",
           "partial_step"]

OP = "ring_attention_backward"
WHAT = "mkernel.ring_attention_backward"


class BackwardLayout:
    """Offsets of the backward's symmetric workspace: ``home`` (the K/V ready flags, row 0) and ``parts``
    (the partial ready flags, row 1) as the control kernels' layouts, ``data_off`` (home, receive buffer 0,
    receive buffer 1, each ``kv_stride`` bytes), ``part_off`` (P partial buffers, each ``part_stride``
    bytes: dK then dV fp32 ``[S_local, B, H_kv, D]``; buffer s holds this rank's partial of step s), and
    ``total`` bytes."""

    __slots__ = ("home", "parts", "data_off", "kv_stride", "part_off", "part_stride", "total")


def backward_workspace_layout(P: int, kv_block_bytes: int, part_bytes: int) -> BackwardLayout:
    """The workspace layout for P local ranks, K/V blocks (K then V) of ``kv_block_bytes`` and dK / dV
    partials (both) of ``part_bytes``; the control words sit at offsets that depend on P only."""
    consumed_off, flags_off, end = workspace_control(P, 2)
    L = BackwardLayout()
    L.home = RingLayout(consumed_off, flags_off)
    L.parts = RingLayout(consumed_off, flags_off + 8 * MAX_CHUNKS)
    L.data_off = round_up(end, 256)
    L.kv_stride = round_up(kv_block_bytes, 256)
    L.part_off = L.data_off + 3 * L.kv_stride
    L.part_stride = round_up(part_bytes, 256)
    L.total = L.part_off + P * L.part_stride
    return L


class _Call:
    __slots__ = ("key", "stream", "q", "k", "v", "o", "do", "lse", "dq", "dk", "dv", "causal", "scale", "layout",
                 "options", "dims", "digest")



class _RingAttentionBwd(Op):
    generation_keyed = True
    name = OP

    def __call__(self, ctx, q, k, v, out, lse, dout, dq, dk, dv, causal, softmax_scale, layout, stream, options):
        ctx.check()
        options = _DEFAULT if options is None else options
        if not isinstance(options, RingAttentionOptions):
            raise TypeError(f"{WHAT}: options must be a RingAttentionOptions, got {type(options).__name__}")
        if layout not in LAYOUTS:
            raise ValueError(f"{WHAT}: layout must be one of {LAYOUTS}, got {layout!r}")
        s = as_stream(stream)
        c = _Call()
        c.stream, c.layout, c.causal, c.options = s, layout, bool(causal), options
        prepare_arrays(WHAT, c, q, k, v, out, lse, dout, dq, dk, dv, softmax_scale)
        if not c.scale > 0:
            raise ValueError(f"{WHAT}: softmax_scale must be finite and > 0, got {softmax_scale!r}")
        B, Sq, Sk, Hq, Hkv, D = c.dims
        c.key = (layout, c.causal, c.scale, options, s,
                 *[x.layout_key() for x in (c.q, c.k, c.v, c.o, c.lse, c.do, c.dq, c.dk, c.dv)], ctx.workspace_generation)
        result = (dq if dq is not None else c.dq, dk if dk is not None else c.dk, dv if dv is not None else c.dv)
        if B == 0 or Sq == 0 or Hq == 0:
            self.validate(ctx, c)  # (nothing to compute on any rank: equal shapes; the arguments are checked)
            return result
        self.invoke(ctx.op_state(OP), c, ctx)
        return result

    def validate(self, ctx, c):
        checked_once(c.options)
        check_arrays(WHAT, c)
        check_ring(WHAT, ctx, c.dims, c.causal, c.q, c.k, c.v)
        P = ctx.size if ctx.num_nodes > 1 else ctx.local_size
        if P > BK.MAX_PARTS:  # (one mk_attn_bwd_part_sum adds every partial of a block)
            raise ValueError(f"{WHAT}: at most {BK.MAX_PARTS} ranks in the ring, got {P}")
        if c.options.backward_kernel == "wgmma" and backward_kernel(c)[0] != "wgmma":
            raise ValueError(f"{WHAT}: backward_kernel='wgmma' needs TMA-readable arrays: {backward_kernel(c)[1]}")
        require_gemm_device(WHAT, c.q.device)

    def compile(self, ctx, c):
        dt, D = c.q.dtype.name, c.dims[5]
        main = BK.WGMMA_KERNEL if backward_kernel(c)[0] == "wgmma" else "mk_attn_bwd_main"
        with on_device(ctx.device):
            for name in ("mk_attn_bwd_pre", "mk_attn_bwd_convert"):
                BK.get(dt, D, BK.DEFAULT_BLOCK_Q[D], name)
            for name in (main, "mk_attn_bwd_part_sum"):
                BK.get_partial(dt, D, name)
            if ctx.local_size > 1 or ctx.num_nodes > 1:
                control("mk_ring_begin")
                control("mk_ring_wait")
            if ctx.num_nodes > 1:
                compile_controls()

    def agree(self, ctx, c):
        B, Sq, Sk, Hq, Hkv, D = c.dims
        sig = (OP, c.q.dtype.name, B, Sq, Hq, Hkv, D, c.layout, c.causal, round(c.scale, 9), c.options.pull_chunks)
        return ctx.agree(WHAT, sig, ctx.node_comm if ctx.num_nodes == 1 else ctx.world)

    def describe_call(self, c):
        B, Sq, Sk, Hq, Hkv, D = c.dims
        return (f"B={B} S_local={Sq} H_q={Hq} H_kv={Hkv} D={D} {c.q.dtype.name} layout={c.layout} "
                f"causal={c.causal}")

    def plan(self, ctx, c, digest):
        c.digest = digest
        rank, P = (ctx.local_rank, ctx.local_size) if ctx.num_nodes == 1 else (ctx.rank, ctx.size)
        kern, why = backward_kernel(c)
        return replace(make_plan(rank, P, c.dims[1], c.causal, c.k.nbytes * 2), backward_kernel=kern,
                       backward_fallback=why)

    def bind(self, ctx, c, plan):
        with on_device(ctx.device):
            if ctx.num_nodes > 1:
                return RingBwdXBound(ctx, c, plan, getattr(c, "digest", 0))
            return _RingBwdBound(ctx, c, plan, getattr(c, "digest", 0))


class _RingBwdBound(BoundCall):
    """A ring backward call bound to one layout: the compute launches (common.BackwardLaunches) and (P > 1)
    the side-stream control launches, pulls and flag writes."""

    def __init__(self, ctx, c: _Call, plan: RingPlan, digest: int):
        self.plan = plan
        self.P = P = plan.P
        me = ctx.local_rank
        kv_bytes = c.k.nbytes
        half = BackwardLaunches.part_half(c)
        self._kv_bytes = kv_bytes
        extra = ()
        # partial buffers (P > 1: in the symmetric workspace, step s's at part_off + s * part_stride)
        self.ws = None
        if P > 1:
            L = backward_workspace_layout(P, 2 * kv_bytes, 2 * half)
            self.ws = ws = ctx.workspace((OP,), L.total, c.stream, WHAT)
            self._home = ws.ptr + L.data_off
            recv = [ws.ptr + L.data_off + (1 + i) * L.kv_stride for i in range(2)]
            part = [ws.ptr + L.part_off + s * L.part_stride for s in range(P)]
            side = ctx.side_stream()
            self._side = cu.CUstream(side)
            comm = ctx.comm_args(OP, digest)
            self._begin = begin_launch(comm, ws, L.home, side)
            self._kv_waits = [None] + [gate_launch(comm, ws, L.home, src, side) for src in plan.sources[1:]]
            self._part_waits = [gate_launch(comm, ws, L.parts, src, side) for src in range(P) if src != me]
            self._pulls = [None] + [chunked_copies(recv[s % 2], ws.peer_ptr(src, L.data_off), 2 * kv_bytes,
                                                   c.options.pull_chunks)
                                    for s, src in enumerate(plan.sources) if s > 0]
            value = ws.ptr + VALUE_OFF
            self._announce = [(ws.peer_ptr(j, L.home.flags_off + 8 * me), value, 8) for j in range(P) if j != me]
            # step s's partial is complete: raise its owner's parts flag [me]
            self._signal = [None] + [[(ws.peer_ptr(src, L.parts.flags_off + 8 * me), value, 8)]
                                     for s, src in enumerate(plan.sources) if s > 0]
            # after the sum: done reading every peer's home and its partial of our block
            self._consumed = [(ws.peer_ptr(j, L.home.consumed_off + 8 * me), value, 8) for j in range(P) if j != me]
            self._ev = Events("fork", "join", "parts", "summed", *[f"arrived{s}" for s in range(P)],
                              *[f"done{s}" for s in range(P)])
            srcs = [ws.peer_ptr(i, L.part_off + partial_step(me, i, P) * L.part_stride) if i != me else part[0]
                    for i in range(P)]
        else:
            one = DeviceArray.empty((2 * half // 4,), "float32", device=ctx.device)
            extra = (one,)
            recv, part, srcs = [], [one.ptr], [one.ptr]
        rows = [partial_rows(me, i, P, c.dims[1], c.causal) for i in range(P)]
        self.compute = BackwardLaunches(ctx, c, plan, recv, part, srcs, rows)
        self.buffers = self.compute.buffers + extra

    def run(self, stream, call) -> None:
        P = self.P
        s = cu.CUstream(stream)
        self.compute.point(call)
        if P > 1:
            ev, side = self._ev, self._side
            check(cu.cuEventRecord(ev.fork, s))
            check(cu.cuStreamWaitEvent(side, ev.fork, 0))
            self._begin()
            copy_async([(self._home, call.k.ptr, self._kv_bytes),
                        (self._home + self._kv_bytes, call.v.ptr, self._kv_bytes)] + self._announce, side)
        self.compute.pre()
        signalled = set()
        for step in range(P):
            if step > 0:
                self._pull(step, s, signalled)
            self.compute.step(step, call)
            if P > 1:
                check(cu.cuEventRecord(getattr(self._ev, f"done{step}"), s))
        if P > 1:
            ev, side = self._ev, self._side
            for step in range(1, P):
                if step not in signalled:
                    self._raise_part(step, signalled)
            for w in self._part_waits:
                w()
            check(cu.cuEventRecord(ev.parts, side))
            check(cu.cuStreamWaitEvent(s, ev.parts, 0))
        self.compute.finish()
        if P > 1:
            check(cu.cuEventRecord(ev.summed, s))
            check(cu.cuStreamWaitEvent(side, ev.summed, 0))
            copy_async(self._consumed, side)
            check(cu.cuEventRecord(ev.join, side))
            check(cu.cuStreamWaitEvent(s, ev.join, 0))

    def _raise_part(self, step: int, signalled: set) -> None:
        """(side stream) once step ``step``'s launches are done, raise its block owner's flag for us."""
        check(cu.cuStreamWaitEvent(self._side, getattr(self._ev, f"done{step}"), 0))
        copy_async(self._signal[step], self._side)
        signalled.add(step)

    def _pull(self, step: int, s, signalled: set) -> None:
        """Bring step ``step``'s block: (side stream) once step - 2 no longer reads its buffer (and its partial
        is then announced to its owner), gate on the source's flag, copy; (caller's stream) wait for it."""
        ev, side = self._ev, self._side
        if step >= 2:
            if step - 2 >= 1:
                self._raise_part(step - 2, signalled)
            else:
                check(cu.cuStreamWaitEvent(side, getattr(ev, f"done{step - 2}"), 0))
        gated_pull(ev, side, s, step, self._kv_waits[step], self._pulls[step])


_RING_BWD = _RingAttentionBwd()
_DEFAULT = RingAttentionOptions()


def ring_attention_backward(ctx, q, k, v, out, lse, dout, dq=None, dk=None, dv=None, *, causal: bool = False,
                            softmax_scale: float | None = None, layout: str = "bshd", stream=None,
                            options: RingAttentionOptions | None = None):
    """Ring attention backward over the P ranks of ``ctx``'s node (of the whole world when ``ctx`` spans several
    nodes: node-major ranks, the same count per node, P <= 8): returns ``(dq, dk, dv)`` of this rank's rows.

    Sharding as :func:`mkernel.ring_attention` (non-causal: contiguous shards in local-rank order; causal:
    zigzag shards, :func:`mkernel.zigzag_shard`, S_local even).  q, out, dout: this rank's
    ``[B, S_local, H_q, D]`` (``layout="bshd"``) or ``[B, H_q, S_local, D]`` (``"bhsd"``); k, v:
    ``[B, S_local, H_kv, D]`` (resp. ``[B, H_kv, S_local, D]``), contiguous in that layout; bf16 or fp16
    (all alike), D = 64 or 128, H_q a multiple of H_kv, row strides as :func:`mkernel.attention_backward`.
    lse: float32 ``[B, H_q, S_local]``, the forward's log-sum-exp over the whole sequence (what
    :func:`mkernel.ring_attention` returns).  dq, dk, dv: q's, k's, v's shapes and dtype (or None to
    allocate); dk, dv are the gradients of this rank's own K/V rows, summed over every rank's queries in
    fp32 in rank order (deterministic); dq accumulates with fp32 atomics (run-to-run rounding
    differences).  softmax_scale: finite > 0, default ``1 / sqrt(D)``.  stream: any stream-like object or raw
    handle (None: the legacy default stream).  options: :class:`RingAttentionOptions` (``pull_chunks``,
    ``backward_kernel``).

    Every rank makes the same call (checked once per signature on the host, then on the device per call).
    Asynchronous; every wait is bounded by ``ctx.timeout`` (:class:`mkernel.CommTimeout` at ``ctx.check()``
    / ``ctx.synchronize()``).  After the first call of a shape, calls can be captured into a CUDA graph.
    The plan: ``ctx.last_plan("ring_attention_backward")`` (:class:`RingPlan`, the forward's schedule, with
    the steps' main kernel: ``backward_kernel``, ``backward_fallback``)."""
    return _RING_BWD(ctx, q, k, v, out, lse, dout, dq, dk, dv, causal, softmax_scale, layout, stream, options)
