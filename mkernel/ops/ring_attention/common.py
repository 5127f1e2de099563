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
from ...core.tensormap import tma_compatible
from ...core.util import round_up
from ..attention import kernels as AK
from ..attention_bwd import kernels as BK
from ..attention_bwd.op import BwdArgs, PartSumArgs, layout_strides

__all__ = ["SOURCE", "VALUE_OFF", "RingLayout", "control", "attention_launches", "launch_step", "gated_pull",
           "begin_launch", "gate_launch", "chunked_copies", "BackwardLaunches", "backward_kernel"]

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


def _tma_readable(x: DeviceArray, layout: str) -> bool:
    """TMA can map ``x`` and any window of its rows (mkernel.core.tensormap's rules: 16-byte aligned base,
    every stride of an extent > 1 a positive multiple of 16 bytes below 2^40)."""
    (b, s, h, _), (sb, ss, sh, _) = AK.bshd(x, layout)
    it = x.dtype.itemsize
    return tma_compatible(x.ptr, [st * it for n, st in ((s, ss), (h, sh), (b, sb)) if n > 1])


def backward_kernel(c) -> tuple[str, str]:
    """The ring backward's main kernel for call ``c`` (``RingAttentionOptions.backward_kernel``) and, where
    "auto" falls back to "mma", why: "wgmma" needs TMA maps of q, dout, k and v (docs/ring_attention.md,
    "Backward"); the mma kernel reads any rows attention_backward accepts."""
    want = c.options.backward_kernel
    if want == "mma":
        return "mma", ""
    for x, n in ((c.q, "q"), (c.do, "dout"), (c.k, "k"), (c.v, "v")):
        if not _tma_readable(x, c.layout):
            return "mma", f"TMA cannot map {n} (strides {tuple(x.strides)})"
    return "wgmma", ""


class _StepMaps:
    """The wgmma main kernel's tensor maps of one plan launch: q and dout over its query rows [q0, q1)
    (re-pointed per call), k and v over the step's key rows [0, kv_rows) (step 0: the call's k, v, re-pointed
    per call; later steps: the receive buffer, fixed).  Boxes as attention_bwd's op.py."""

    def __init__(self, ctx, c, ln, recv: list):
        nq = ln.q1 - ln.q0
        self.q_off, self.do_off = (ln.q0 * layout_strides(x, c.layout)[1] * x.dtype.itemsize for x in (c.q, c.do))
        self.q = AK.tensor_map(c.q, c.layout, BK.WGMMA_BLOCK_Q, ptr=c.q.ptr + self.q_off, seq=nq)
        self.do = AK.tensor_map(c.do, c.layout, BK.WGMMA_BLOCK_Q, ptr=c.do.ptr + self.do_off, seq=nq)
        k, v = c.k, c.v
        if ln.step > 0:
            buf = recv[ln.step % 2]
            k = DeviceArray(buf, c.k.shape, c.k.dtype, c.k.strides, device=ctx.device)
            v = DeviceArray(buf + c.k.nbytes, c.k.shape, c.k.dtype, c.k.strides, device=ctx.device)
        self.k, self.v = (AK.tensor_map(x, c.layout, BK.WGMMA_BLOCK_KV, seq=ln.kv_rows) for x in (k, v))
        self.own_kv = ln.step == 0

    def bufs(self) -> list:
        return [self.q.buf, self.k.buf, self.v.buf, self.do.buf]  # mk_attn_bwd_wgmma's parameter order

    def point(self, call) -> None:
        self.q.point(call.q.ptr + self.q_off)
        self.do.point(call.do.ptr + self.do_off)
        if self.own_kv:
            self.k.point(call.k.ptr)
            self.v.point(call.v.ptr)


class BackwardLaunches:
    """The ring backward's kernels on the caller's stream, for the one-node and the across-nodes path: Dsum
    and the fp32 dQ accumulator (``buffers``), mk_attn_bwd_pre over all rows, per plan launch the main
    kernel of ``plan.backward_kernel`` in its partial form (MKATT_PARTIAL: mk_attn_bwd_wgmma, else
    mk_attn_bwd_main; step s >= 1 reads ``recv[s % 2]``; it writes its dK / dV partial to ``part[s]``), then
    the fixed-order sum of the partials ``srcs[i]`` (``rows[i]`` rows of source i) into dk, dv and the
    conversion of dQ.  docs/ring_attention.md, "Backward"."""

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
        wgmma = plan.backward_kernel == "wgmma"
        self.steps = [[] for _ in range(plan.P)]
        for ln in plan.launches:
            a = self._step_args(c, ln, part[ln.step], half, recv)
            maps = _StepMaps(ctx, c, ln, recv) if wgmma else None
            self.steps[ln.step].append((ln, a, maps, self._main_launch(c, ln, a, maps)))
        # the fixed-order sum of this rank's block's partials
        self._sum_args = sa = PartSumArgs()
        for i, (src, n) in enumerate(zip(srcs, rows)):
            sa.part_k[i], sa.part_v[i] = src, src + half
            sa.rows[i] = n
        sa.dk_s[:], sa.dv_s[:] = layout_strides(c.dk, c.layout), layout_strides(c.dv, c.layout)
        sa.P, sa.B, sa.Hkv, sa.S = len(srcs), B, Hkv, S
        self._sum = BK.get_partial(dt, D, "mk_attn_bwd_part_sum").prepare(
            -(-(S * B * Hkv * D // 4) // 256), 256, [sa], stream=c.stream)

    def _step_args(self, c, ln, part: int, half: int, recv: list) -> BwdArgs:
        """A plan launch's arguments: S_q = its query rows, S_k = its key rows, Dsum and the accumulator from
        row q0 at pitch S_local, the partial buffer ``part`` (dK then dV, ``half`` bytes each)."""
        B, S, _, Hq, Hkv, D = c.dims
        a = BwdArgs()
        _bwd_strides(a, c)
        a.B, a.Hq, a.Hkv, a.Sq, a.Sk, a.causal = B, Hq, Hkv, ln.q1 - ln.q0, ln.kv_rows, int(ln.causal)
        a.scale, a.scale_log2 = c.scale, c.scale * math.log2(math.e)
        a.dsum, a.dq_acc, a.acc_pitch = self.dsum.ptr + 4 * ln.q0, self.acc.ptr + 4 * D * ln.q0, S
        a.part_k, a.part_v = part, part + half
        if ln.step > 0:
            a.k, a.v = recv[ln.step % 2], recv[ln.step % 2] + c.k.nbytes
        return a

    @staticmethod
    def _main_launch(c, ln, a: BwdArgs, maps):
        """The prepared main kernel of one plan launch: mk_attn_bwd_wgmma when ``maps`` (its tensor maps)
        are given, else mk_attn_bwd_main; one block per 128 key rows, KV head and batch."""
        B, _, _, _, Hkv, D = c.dims
        dt = c.q.dtype.name
        if maps is not None:
            return BK.get_partial(dt, D, BK.WGMMA_KERNEL).prepare(
                (-(-ln.kv_rows // BK.WGMMA_BLOCK_KV), Hkv, B), BK.WGMMA_THREADS, [*maps.bufs(), a], stream=c.stream,
                smem=BK.wgmma_smem(D))
        return BK.get_partial(dt, D, "mk_attn_bwd_main").prepare(
            (-(-ln.kv_rows // (16 * BK.WARPS)), Hkv, B), 32 * BK.WARPS, [a], stream=c.stream,
            smem=BK.main_smem(D, BK.DEFAULT_BLOCK_Q[D]))

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
        for ln, a, maps, launch in self.steps[step]:
            a.q = call.q.ptr + ln.q0 * self._ss["q"] * it
            a.o = call.o.ptr + ln.q0 * self._ss["o"] * it
            a.dout = call.do.ptr + ln.q0 * self._ss["do"] * it
            a.lse = call.lse.ptr + ln.q0 * call.lse.strides[2] * 4
            if step == 0:
                a.k, a.v = call.k.ptr, call.v.ptr
            if maps is not None:
                maps.point(call)
            launch()

    def finish(self) -> None:
        """The partial sum into dk, dv, then dq from the accumulator."""
        self._sum()
        self._convert()
