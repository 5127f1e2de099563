"""What ring attention's one-node and across-nodes paths share: the control kernels' source and layout
mirror, the attention launches of a plan (the MK_ATTN_MERGE forward, docs/ring_attention.md, "Merge") and
the backward's compute launches (docs/ring_attention.md, "Backward")."""
from __future__ import annotations

import ctypes
import math

from cuda.bindings import driver as cu

from ...core.arrays import DeviceArray
from ...core.compiler import kernel as compiled_kernel, register_specialization
from ...core.driver import check
from ...core.streams import copy_async
from ...core.util import round_up
from ..attention import kernels as AK
from ..attention_bwd import kernels as BK
from ..attention_bwd.op import BwdArgs, PartSumArgs, layout_strides

__all__ = ["SOURCE", "VALUE_OFF", "RingLayout", "control", "attention_launches", "launch_step", "gated_pull",
           "begin_launch", "gate_launch", "chunked_copies", "BackwardLaunches"]

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


def _bwd_strides(a: BwdArgs, c) -> None:
    for name, x in (("q_s", c.q), ("k_s", c.k), ("v_s", c.v), ("o_s", c.o), ("do_s", c.do), ("dq_s", c.dq),
                    ("dk_s", c.dk), ("dv_s", c.dv)):
        getattr(a, name)[:] = layout_strides(x, c.layout)
    a.lse_s[:] = c.lse.strides


class BackwardLaunches:
    """The ring backward's kernels on the caller's stream, for the one-node and the across-nodes path: Dsum
    and the fp32 dQ accumulator (``buffers``), mk_attn_bwd_pre over all rows, per plan launch the
    MKATT_PARTIAL main kernel (step s >= 1 reads ``recv[s % 2]``; it writes its dK / dV partial to
    ``part[s]``), then the fixed-order sum of the partials ``srcs[i]`` (``rows[i]`` rows of source i) into
    dk, dv and the conversion of dQ.  docs/ring_attention.md, "Backward"."""

    def __init__(self, ctx, c, plan, recv: list, part: list, srcs: list, rows: list):
        B, S, _, Hq, Hkv, D = c.dims
        dt = c.q.dtype.name
        self._it = c.q.dtype.itemsize
        self.dsum = DeviceArray.empty((B * Hq * S,), "float32", device=ctx.device)
        self.acc = DeviceArray.empty((B * Hq * S * D,), "float32", device=ctx.device)
        self.buffers = (self.dsum, self.acc)
        half = self.part_half(c)
        self._ss = {n: layout_strides(x, c.layout)[1] for n, x in (("q", c.q), ("o", c.o), ("do", c.do))}
        bq = BK.DEFAULT_BLOCK_Q[D]
        # preprocess (Dsum, the accumulator zeroed) and conversion over all S local rows
        self._full = a = BwdArgs()
        _bwd_strides(a, c)
        a.B, a.Hq, a.Hkv, a.Sq, a.Sk, a.causal = B, Hq, Hkv, S, S, int(c.causal)
        a.scale, a.scale_log2 = c.scale, c.scale * math.log2(math.e)
        a.dsum, a.dq_acc, a.acc_pitch = self.dsum.ptr, self.acc.ptr, S
        rows_grid = -(-(B * Hq * S) // BK.ROW_KERNEL_ROWS)
        self.pre = BK.get(dt, D, bq, "mk_attn_bwd_pre").prepare(rows_grid, 32 * BK.ROW_KERNEL_ROWS, [a],
                                                                stream=c.stream)
        self._convert = BK.get(dt, D, bq, "mk_attn_bwd_convert").prepare(rows_grid, 32 * BK.ROW_KERNEL_ROWS, [a],
                                                                         stream=c.stream)
        # the main kernel per launch: its query rows [q0, q1) (a window of the accumulator: pitch S)
        main = BK.get_partial(dt, D, "mk_attn_bwd_main")
        self.steps = [[] for _ in range(plan.P)]
        for ln in plan.launches:
            a = BwdArgs()
            _bwd_strides(a, c)
            nq = ln.q1 - ln.q0
            a.B, a.Hq, a.Hkv, a.Sq, a.Sk, a.causal = B, Hq, Hkv, nq, ln.kv_rows, int(ln.causal)
            a.scale, a.scale_log2 = c.scale, c.scale * math.log2(math.e)
            a.dsum, a.dq_acc, a.acc_pitch = self.dsum.ptr + 4 * ln.q0, self.acc.ptr + 4 * D * ln.q0, S
            a.part_k, a.part_v = part[ln.step], part[ln.step] + half
            if ln.step > 0:
                a.k, a.v = recv[ln.step % 2], recv[ln.step % 2] + c.k.nbytes
            launch = main.prepare((-(-ln.kv_rows // (16 * BK.WARPS)), Hkv, B), 32 * BK.WARPS, [a], stream=c.stream,
                                  smem=BK.main_smem(D, bq))
            self.steps[ln.step].append((ln, a, launch))
        # the fixed-order sum of this rank's block's partials
        self._sum_args = sa = PartSumArgs()
        for i, (src, n) in enumerate(zip(srcs, rows)):
            sa.part_k[i], sa.part_v[i] = src, src + half
            sa.rows[i] = n
        sa.dk_s[:], sa.dv_s[:] = layout_strides(c.dk, c.layout), layout_strides(c.dv, c.layout)
        sa.P, sa.B, sa.Hkv, sa.S = len(srcs), B, Hkv, S
        self._sum = BK.get_partial(dt, D, "mk_attn_bwd_part_sum").prepare(
            -(-(S * B * Hkv * D // 4) // 256), 256, [sa], stream=c.stream)

    @staticmethod
    def part_half(c) -> int:
        """Bytes of one fp32 partial (dK or dV) ``[S_local, B, H_kv, D]``; a partial buffer holds both."""
        B, S, _, _, Hkv, D = c.dims
        return S * B * Hkv * D * 4

    def point(self, call) -> None:
        """Re-point the preprocess, conversion and sum at ``call``'s arrays."""
        f = self._full
        f.q, f.k, f.v, f.o, f.dout, f.lse = call.q.ptr, call.k.ptr, call.v.ptr, call.o.ptr, call.do.ptr, call.lse.ptr
        f.dq, f.dk, f.dv = call.dq.ptr, call.dk.ptr, call.dv.ptr
        self._sum_args.dk, self._sum_args.dv = call.dk.ptr, call.dv.ptr

    def step(self, step: int, call) -> None:
        """Step ``step``'s main-kernel launches, re-pointed at ``call``'s rows (step 0: its own k, v)."""
        it = self._it
        for ln, a, launch in self.steps[step]:
            a.q = call.q.ptr + ln.q0 * self._ss["q"] * it
            a.o = call.o.ptr + ln.q0 * self._ss["o"] * it
            a.dout = call.do.ptr + ln.q0 * self._ss["do"] * it
            a.lse = call.lse.ptr + ln.q0 * call.lse.strides[2] * 4
            if step == 0:
                a.k, a.v = call.k.ptr, call.v.ptr
            launch()

    def finish(self) -> None:
        """The partial sum into dk, dv, then dq from the accumulator."""
        self._sum()
        self._convert()
