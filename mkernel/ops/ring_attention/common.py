"""What ring attention's one-node and across-nodes paths share: the control kernels' source and layout
mirror, and the attention launches of a plan (the MK_ATTN_MERGE forward, docs/ring_attention.md, "Merge")."""
from __future__ import annotations

import ctypes

from cuda.bindings import driver as cu

from ...core.arrays import DeviceArray
from ...core.compiler import kernel as compiled_kernel, register_specialization
from ...core.driver import check
from ...core.streams import copy_async
from ...core.util import round_up
from ..attention import kernels as AK

__all__ = ["SOURCE", "VALUE_OFF", "RingLayout", "control", "attention_launches", "launch_step", "gated_pull",
           "begin_launch", "gate_launch", "chunked_copies"]

SOURCE = "ops/ring_attention.cu"
VALUE_OFF = 32  # MK_RING_VALUE_OFF
register_specialization(SOURCE, {})


class RingLayout(ctypes.Structure):
    """Mirror of MkRingLayout in cuda_src/ops/ring_attention.cu."""

    _fields_ = [("consumed_off", ctypes.c_int32), ("flags_off", ctypes.c_int32)]


def control(name: str):
    """Control kernel ``name`` of ring_attention.cu (compiled or loaded)."""
    return compiled_kernel(SOURCE, {}, name)


def attention_launches(ctx, call, plan, bufs: tuple, acc: DeviceArray) -> list:
    """Per step, the attention launches of ``plan`` (MK_ATTN_MERGE into ``acc``): step 0 reads the local k, v,
    step s >= 1 the receive buffer ``bufs[s % 2]`` (K then V of ``call.k.nbytes`` each).  Entries
    ``(launch, q map, k map, v map, args, prepared launch)``; the k / v maps of step 0 only (re-pointed per
    call: :func:`launch_step`)."""
    B, S, _, Hq, Hkv, D = call.dims
    dt, it = call.q.dtype.name, call.q.dtype.itemsize
    kv_bytes = call.k.nbytes
    ss = AK.bshd(call.q, call.layout)[1][1]
    oss = AK.bshd(call.out, call.layout)[1][1]
    steps = [[] for _ in range(plan.P)]
    heavy = int(call.options.heavy_first)
    for ln in plan.launches:
        kv_rows = ln.kv_rows
        if ln.step == 0:
            kmap = AK.tensor_map(call.k, call.layout, AK.BN, seq=kv_rows)
            vmap = AK.tensor_map(call.v, call.layout, AK.BN, seq=kv_rows)
        else:
            buf = bufs[ln.step % 2]
            kb = DeviceArray(buf, call.k.shape, call.k.dtype, call.k.strides, device=ctx.device)
            vb = DeviceArray(buf + kv_bytes, call.k.shape, call.k.dtype, call.k.strides, device=ctx.device)
            kmap = AK.tensor_map(kb, call.layout, AK.BN, seq=kv_rows)
            vmap = AK.tensor_map(vb, call.layout, AK.BN, seq=kv_rows)
        nq = ln.q1 - ln.q0
        qmap = AK.tensor_map(call.q, call.layout, AK.BM, ptr=call.q.ptr + ln.q0 * ss * it, seq=nq)
        ost = AK.bshd(call.out, call.layout)[1]
        args = AK.AttnFwdArgs(call.out.ptr + ln.q0 * oss * it, call.lse.ptr, ost[0], ost[1], ost[2], nq, kv_rows,
                              Hq, Hq // Hkv, call.scale * AK.LOG2E, heavy)
        margs = AK.AttnMergeArgs(acc.ptr, ln.q0, S, int(ln.first), ln.final_lo, ln.final_hi, 0)
        kern = AK.get(dt, D, ln.causal, merge=True)
        launch = kern.prepare((-(-nq // AK.BM), Hq, B), AK.THREADS, [qmap.buf, kmap.buf, vmap.buf, args, margs],
                              stream=call.stream, smem=AK.smem_bytes(D))
        steps[ln.step].append((ln, qmap, kmap if ln.step == 0 else None, vmap if ln.step == 0 else None,
                               args, launch))
    return steps


def launch_step(launches: list, call, q_ss: int, o_ss: int, it: int) -> None:
    """Re-point one step's launches (:func:`attention_launches`) at ``call``'s arrays and launch them."""
    for ln, qmap, kmap, vmap, args, launch in launches:
        qmap.point(call.q.ptr + ln.q0 * q_ss * it)
        if kmap is not None:
            kmap.point(call.k.ptr)
            vmap.point(call.v.ptr)
        args.out, args.lse = call.out.ptr + ln.q0 * o_ss * it, call.lse.ptr
        launch()


def gated_pull(ev, side, s, step: int, wait, pulls) -> None:
    """Step ``step``'s pull of a block from this node: (``side`` stream) ``wait()`` launches the gate on its
    source's flag, then the copies ``pulls``; (caller's stream ``s``) wait for them (event ``arrived<step>``)."""
    wait()
    copy_async(pulls, side)
    arrived = getattr(ev, f"arrived{step}")
    check(cu.cuEventRecord(arrived, side))
    check(cu.cuStreamWaitEvent(s, arrived, 0))


def begin_launch(comm, ws, lay: RingLayout, side: int):
    """mk_ring_begin prepared on the side stream: the call's epoch, from the workspace ``ws`` (its control words
    at ``lay``)."""
    return control("mk_ring_begin").prepare((1, 1, 1), 32, [comm, ctypes.c_void_p(ws.ptr),
                                                            ctypes.c_void_p(ws.peer_table), lay], stream=side)


def gate_launch(comm, ws, lay: RingLayout, src: int, side: int):
    """mk_ring_wait prepared on the side stream: local rank ``src``'s flag of this call (at ``lay``) is raised."""
    return control("mk_ring_wait").prepare((1, 1, 1), 32, [comm, ctypes.c_void_p(ws.ptr), lay, ctypes.c_int32(src)],
                                           stream=side)


def chunked_copies(dst: int, src: int, nbytes: int, pieces: int) -> list:
    """The copy of ``nbytes`` from ``src`` to ``dst`` as about ``pieces`` copies of whole 256-byte multiples
    (RingAttentionOptions.pull_chunks)."""
    piece = round_up(max(256, -(-nbytes // pieces)), 256)
    return [(dst + o, src + o, min(piece, nbytes - o)) for o in range(0, nbytes, piece)]
