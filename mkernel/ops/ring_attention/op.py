"""Ring attention forward across the GPUs of a node, on the op pipeline (mkernel/ops/base.py).

The sequence is sharded over the node's P ranks; each rank keeps its queries and attends, in P steps, to
every rank's K/V block: step s reads the block of local rank ``(r - s) mod P``, pulled by the copy engines
from that rank's workspace (its *home* copy of this call's k, v) into one of two receive buffers on the
context's side stream while the tensor cores work on the previous block.  The attention kernel is
``mkernel.attention``'s (cuda_src/ops/attention_fwd.cu) in its MK_ATTN_MERGE specialization: its epilogue
merges each partial result into a running fp32 one by the log-sum-exp rule and writes ``out`` (the dtype)
on a row's last step.  Causal attention needs zigzag sharding (:func:`mkernel.zigzag_shard`).
A context spanning several nodes runs the same schedule over the world ranks (internode.py).
docs/ring_attention.md.
"""
from __future__ import annotations

from dataclasses import replace

from cuda.bindings import driver as cu

from ...core.arrays import DeviceArray, contiguous_strides
from ...core.device import on_device
from ...core.driver import check
from ...core.streams import Events, copy_async
from ...dist.signals import workspace_control
from ..attention import kernels as AK
from ..attention.op import check_arrays, check_layout, prepare_arrays
from ..base import BoundCall, Op, as_stream, checked_once
from ..collectives.internode import check_layout as check_nodes
from .options import RingAttentionOptions
from .plan import RingPlan, make_plan
from . import fused as FU
from . import internode as XR
from .common import (SOURCE, VALUE_OFF, RingLayout, attention_launches, begin_launch, chunked_copies, control,
                     gate_launch, gated_pull, launch_step)

__all__ = ["ring_attention", "RingPlan", "SOURCE", "VALUE_OFF", "RingLayout", "workspace_layout", "check_ring",
           "attention_launches", "launch_step"]

OP = "ring_attention"
WHAT = "mkernel.ring_attention"
def workspace_layout(P: int, kv_block_bytes: int) -> tuple[RingLayout, int, int]:
    """``(control layout, data_off, total bytes)`` of the op's symmetric workspace for P local ranks and K/V
    blocks (K then V) of ``kv_block_bytes``: the control words (at offsets that depend on P only), then
    three blocks: home, receive buffer 0, receive buffer 1 (each 256-byte aligned)."""
    consumed_off, flags_off, end = workspace_control(P, 1)
    data_off = -(-end // 256) * 256
    blk = -(-kv_block_bytes // 256) * 256
    return RingLayout(consumed_off, flags_off), data_off, data_off + 3 * blk


def _block_stride(kv_block_bytes: int) -> int:
    return -(-kv_block_bytes // 256) * 256


class _Call:
    __slots__ = ("key", "stream", "q", "k", "v", "out", "lse", "causal", "scale", "layout", "options", "dims", "digest")



def check_ring(what: str, ctx, dims: tuple, causal: bool, q, k, v) -> None:
    """The ring's own checks (forward and backward): node-major ranks, the same count on every node, when the
    context spans several nodes; equal shards (S_q = S_k), causal zigzag shards (S_local even), k and v
    contiguous (copied whole), the arrays on the context's GPU."""
    B, Sq, Sk, Hq, Hkv, D = dims
    if ctx.num_nodes != 1:
        check_nodes(ctx)
    if Sq != Sk:
        raise ValueError(f"{what}: q and k must hold the same local sequence length (equal shards), got S_q={Sq}, "
                         f"S_k={Sk}")
    if causal and Sq % 2:
        raise ValueError(f"{what}: causal attention needs zigzag shards (mkernel.zigzag_shard): an even local "
                         f"sequence length, got {Sq}")
    for x, n in ((k, "k"), (v, "v")):
        if x.strides != contiguous_strides(x.shape):
            raise ValueError(f"{what}: {n} must be contiguous in its layout (its block is copied to the peers "
                             f"whole), got strides {tuple(x.strides)} for shape {tuple(x.shape)}")
    if q.device != ctx.device:
        raise ValueError(f"{what}: the arrays are on device {q.device}, the context's GPU is {ctx.device}")


class _RingAttention(Op):
    generation_keyed = True
    name = OP

    def __call__(self, ctx, q, k, v, out, lse, causal, softmax_scale, layout, stream, options):
        ctx.check()
        options = _DEFAULT if options is None else options
        if not isinstance(options, RingAttentionOptions):
            raise TypeError(f"{WHAT}: options must be a RingAttentionOptions, got {type(options).__name__}")
        check_layout(WHAT, layout)
        s = as_stream(stream)
        Q, Kx, V, O, L, dims, scale = prepare_arrays(WHAT, q, k, v, out, lse, softmax_scale, layout, s)
        call = _Call()
        call.stream, call.q, call.k, call.v, call.out, call.lse = s, Q, Kx, V, O, L
        call.causal, call.scale, call.layout, call.options, call.dims = bool(causal), scale, layout, options, dims
        call.key = (layout, call.causal, options, s, *[x.layout_key() for x in (Q, Kx, V, O, L)],
                    ctx.workspace_generation)
        B, Sq, _, Hq, _, _ = dims
        if B == 0 or Sq == 0 or Hq == 0:
            self.validate(ctx, call)  # (nothing to compute on any rank: equal shapes; the arguments are checked)
            return (O if out is None else out), (L if lse is None else lse)
        self.invoke(ctx.op_state(OP), call, ctx)
        return (O if out is None else out), (L if lse is None else lse)

    def validate(self, ctx, call):
        checked_once(call.options)
        check_arrays(WHAT, call.q, call.k, call.v, call.out, call.lse, call.dims, call.layout)
        check_ring(WHAT, ctx, call.dims, call.causal, call.q, call.k, call.v)

    def compile(self, ctx, call):
        with on_device(ctx.device):
            dt, D = call.q.dtype.name, call.dims[5]
            if self._persistent(ctx, call):
                FU.get(dt, D)
            else:
                for c in ((False, True) if call.causal else (False,)):
                    AK.get(dt, D, c, merge=True)
            if ctx.local_size > 1 or ctx.num_nodes > 1:
                control("mk_ring_begin")
                control("mk_ring_wait")
            if ctx.num_nodes > 1:
                XR.compile_controls()

    def agree(self, ctx, call):
        B, Sq, Sk, Hq, Hkv, D = call.dims
        o = call.options
        sig = (OP, call.q.dtype.name, B, Sq, Hq, Hkv, D, call.layout, call.causal, round(call.scale, 9),
               o.heavy_first, o.pull_chunks, o.persistent)
        return ctx.agree(WHAT, sig, ctx.node_comm if ctx.num_nodes == 1 else ctx.world)

    def describe_call(self, call):
        B, Sq, Sk, Hq, Hkv, D = call.dims
        return (f"B={B} S_local={Sq} H_q={Hq} H_kv={Hkv} D={D} {call.q.dtype.name} layout={call.layout} "
                f"causal={call.causal}")

    def plan(self, ctx, call, digest):
        rank, P = (ctx.local_rank, ctx.local_size) if ctx.num_nodes == 1 else (ctx.rank, ctx.size)
        p = make_plan(rank, P, call.dims[1], call.causal, call.k.nbytes * 2)
        call.digest = digest
        return replace(p, persistent=True) if self._persistent(ctx, call) else p

    @staticmethod
    def _persistent(ctx, call) -> bool:
        return call.options.persistent and ctx.num_nodes == 1

    def bind(self, ctx, call, plan):
        if ctx.num_nodes > 1:
            return XR.RingXBound(ctx, call, plan, getattr(call, "digest", 0))
        if plan.persistent:
            return FU.RingFusedBound(ctx, call, plan, getattr(call, "digest", 0))
        return _RingBound(ctx, call, plan, getattr(call, "digest", 0))


class _RingBound(BoundCall):
    """A ring attention call bound to one layout: the running fp32 output (``acc``), per launch its tensor maps
    and argument structs, the control launches on the side stream and the pull copies."""

    def __init__(self, ctx, call: _Call, plan: RingPlan, digest: int):
        B, S, _, Hq, Hkv, D = call.dims
        self.plan = plan
        self.P = P = plan.P
        it = call.q.dtype.itemsize
        self.acc = DeviceArray.empty((B, Hq, S, D), "float32", device=ctx.device)
        self.buffers = (self.acc,)
        kv_bytes = call.k.nbytes
        (_, ss, _, _) = AK.bshd(call.q, call.layout)[1]
        (_, oss, _, _) = AK.bshd(call.out, call.layout)[1]
        self._q_ss, self._o_ss, self._it = ss, oss, it
        self.ws = None
        bufs = ()
        if P > 1:
            lay, data_off, total = workspace_layout(P, 2 * kv_bytes)
            self.ws = ws = ctx.workspace((OP,), total, call.stream, WHAT)
            blk = _block_stride(2 * kv_bytes)
            self._home = ws.ptr + data_off
            self._home_off = data_off
            bufs = tuple(ws.ptr + data_off + (1 + i) * blk for i in range(2))
            self._bufs = bufs
            self._kv_bytes = kv_bytes
            side = ctx.side_stream()
            self._side = cu.CUstream(side)
            self._comm = ctx.comm_args(OP, digest)
            self._lay = lay
            self._begin = begin_launch(self._comm, ws, lay, side)
            self._waits = [None] + [gate_launch(self._comm, ws, lay, src, side) for src in plan.sources[1:]]
            # pulls: step s copies the source's home into buffer s % 2, then (its last read of that home)
            # raises the source's consumed[me] from our value slot
            me = ctx.local_rank
            self._pulls = []
            for s, src in enumerate(plan.sources):
                if s == 0:
                    self._pulls.append(None)
                    continue
                cps = chunked_copies(bufs[s % 2], ws.peer_ptr(src, data_off), 2 * kv_bytes, call.options.pull_chunks)
                cps.append((ws.peer_ptr(src, lay.consumed_off + 8 * me), ws.ptr + VALUE_OFF, 8))
                self._pulls.append(cps)
            # the home copy of this call's k, v, then our value slot into every peer's ready[me]
            self._announce = [(ws.peer_ptr(j, lay.flags_off + 8 * me), ws.ptr + VALUE_OFF, 8)
                              for j in range(P) if j != me]
            self._ev = Events("fork", "join", *[f"arrived{s}" for s in range(P)], *[f"done{s}" for s in range(P)])
        self._steps = attention_launches(ctx, call, plan, bufs, self.acc)

    def run(self, stream, call) -> None:
        P = self.P
        s = cu.CUstream(stream)
        if P > 1:
            ev, side = self._ev, self._side
            check(cu.cuEventRecord(ev.fork, s))
            check(cu.cuStreamWaitEvent(side, ev.fork, 0))
            self._begin()
            copy_async([(self._home, call.k.ptr, self._kv_bytes), (self._home + self._kv_bytes, call.v.ptr,
                                                                  self._kv_bytes)] + self._announce, side)
        for step, launches in enumerate(self._steps):
            if step > 0:
                self._pull(step, s)
            launch_step(launches, call, self._q_ss, self._o_ss, self._it)
            if step + 2 < P:  # (step + 2 pulls into this step's buffer)
                check(cu.cuEventRecord(getattr(self._ev, f"done{step}"), s))
        if P > 1:
            check(cu.cuEventRecord(self._ev.join, self._side))
            check(cu.cuStreamWaitEvent(s, self._ev.join, 0))

    def _pull(self, step: int, s) -> None:
        """Bring step ``step``'s block: (side stream) once step - 2 no longer reads its buffer, gate on the
        source's flag, copy, tell the source; (caller's stream) wait for it."""
        ev, side = self._ev, self._side
        if step >= 2:
            check(cu.cuStreamWaitEvent(side, getattr(ev, f"done{step - 2}"), 0))
        gated_pull(ev, side, s, step, self._waits[step], self._pulls[step])


_RING = _RingAttention()
_DEFAULT = RingAttentionOptions()


def ring_attention(ctx, q, k, v, out=None, *, lse=None, causal: bool = False, softmax_scale: float | None = None,
                   layout: str = "bshd", stream=None, options: RingAttentionOptions | None = None):
    """Ring attention forward over the P ranks of ``ctx``'s node (of the whole world when ``ctx`` spans several
    nodes: node-major ranks, the same count per node): returns ``(out, lse)`` for this rank's query rows.

    The sequence is sharded over the ring's ranks in rank order, S_local rows each (non-causal:
    contiguous shards; ``causal=True``: zigzag shards, rank r holding chunks r and 2P-1-r of the 2P equal
    chunks, :func:`mkernel.zigzag_shard`; S_local even).  q: this rank's ``[B, S_local, H_q, D]``
    (``layout="bshd"``) or ``[B, H_q, S_local, D]`` (``"bhsd"``); k, v: ``[B, S_local, H_kv, D]`` (resp.
    ``[B, H_kv, S_local, D]``), contiguous in that layout.  bf16 or fp16 (all alike), D = 64 or 128, H_q a
    multiple of H_kv; every rank passes the same shapes.  q strides as :func:`mkernel.attention` (TMA).

    out: q's shape and dtype (or None to allocate); lse: contiguous float32 ``[B, H_q, S_local]`` (or None):
    ``ln(sum_j exp(softmax_scale * q_i . k_j))`` over every key j of the whole sequence that row i sees
    (causal: global positions j <= i).  softmax_scale: finite > 0, default ``1 / sqrt(D)``.  stream: any
    stream-like object or raw handle (None: the legacy default stream).  options: :class:`RingAttentionOptions`.

    Every rank makes the same call (checked once per signature on the host, then on the device per call:
    :class:`mkernel.CommMismatch`).  Asynchronous; every wait is bounded by ``ctx.timeout``
    (:class:`mkernel.CommTimeout` at ``ctx.check()`` / ``ctx.synchronize()``).  After the first call of a
    shape (which may allocate the op's workspace), calls can be captured into a CUDA graph.  The plan:
    ``ctx.last_plan("ring_attention")`` (:class:`RingPlan`)."""
    return _RING(ctx, q, k, v, out, lse, causal, softmax_scale, layout, stream, options)
