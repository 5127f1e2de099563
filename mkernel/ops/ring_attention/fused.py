"""Ring attention forward in one persistent kernel per call (``RingAttentionOptions(persistent=True)``, one node):
cuda_src/ops/ring_attention_fused.cu.  Every block runs the online softmax of its query tiles over the K/V of
every ring step in registers (no partial results, no merge pass, one launch per call); the other ranks'
K/V blocks are pulled by the copy engines into slots of the workspace (all P - 1 of them: memory of the whole
sequence's K/V, as the all-gather scheme) while the kernel starts on the local block.  docs/ring_attention.md,
"One persistent kernel"."""
from __future__ import annotations

import ctypes

import numpy as np
from cuda.bindings import driver as cu

from ...core.arrays import DeviceArray
from ...core.compiler import kernel as compiled_kernel, register_specialization
from ...core.driver import check
from ...core.streams import Events, copy_async
from ...dist.signals import workspace_control
from ..attention import kernels as AK
from ..base import BoundCall
from .common import VALUE_OFF, RingLayout, begin_launch, chunked_copies, gate_launch

__all__ = ["SOURCE", "KERNEL", "RingFusedArgs", "FusedLayout", "fused_workspace_layout", "get", "grid_size",
           "num_tiles", "RingFusedBound"]

SOURCE = "ops/ring_attention_fused.cu"
KERNEL = "mk_ring_attention_fused"


def defines(dtype: str, head_dim: int) -> dict:
    return {"MK_ATTN_DT": AK.DTYPE_CODES[dtype], "MK_ATTN_D": head_dim}


for _dt in AK.DTYPES:
    for _d in AK.HEAD_DIMS:
        register_specialization(SOURCE, defines(_dt, _d))


def get(dtype: str, head_dim: int):
    """The persistent ring kernel of ``(dtype, head_dim)`` (compiled or loaded on first use)."""
    return compiled_kernel(SOURCE, defines(dtype, head_dim), KERNEL)


class RingFusedArgs(ctypes.Structure):
    """Mirror of MkRingFusedArgs in cuda_src/ops/ring_attention_fused.cu (104 bytes)."""

    _fields_ = [
        ("out", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),
        ("out_sb", ctypes.c_int64),
        ("out_ss", ctypes.c_int64),
        ("out_sh", ctypes.c_int64),
        ("arrived", ctypes.c_void_p),
        ("epoch", ctypes.c_void_p),
        ("b", ctypes.c_int32),
        ("s_loc", ctypes.c_int32),
        ("h_q", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("scale_log2", ctypes.c_float),
        ("P", ctypes.c_int32),
        ("me", ctypes.c_int32),
        ("causal", ctypes.c_int32),
        ("chunk", ctypes.c_int32),
        ("m_tiles", ctypes.c_int32),
        ("num_tiles", ctypes.c_int32),
        ("pad", ctypes.c_int32),
    ]


assert ctypes.sizeof(RingFusedArgs) == 104


class FusedLayout:
    """The persistent path's workspace (the op's symmetric one): the control words of the step path (same
    offsets: ``ctl``), then the K area and the V area, P slots of one K (V) block each; slot j of local rank
    j is its home (this call's k, v), slot j of every other rank the copy pulled from it."""

    def __init__(self, P: int, kv_bytes: int):
        consumed_off, flags_off, end = workspace_control(P, 1)
        self.ctl = RingLayout(consumed_off, flags_off)
        self.kv_bytes = kv_bytes
        self.k_off = -(-end // 256) * 256
        self.v_off = self.k_off + -(-P * kv_bytes // 256) * 256
        self.total = self.v_off + P * kv_bytes

    def k_slot(self, j: int) -> int:
        return self.k_off + j * self.kv_bytes

    def v_slot(self, j: int) -> int:
        return self.v_off + j * self.kv_bytes


def fused_workspace_layout(P: int, kv_bytes: int) -> FusedLayout:
    """:class:`FusedLayout` for P local ranks and K (and V) blocks of ``kv_bytes``."""
    return FusedLayout(P, kv_bytes)


def num_tiles(B: int, Hq: int, S: int, causal: bool) -> tuple[int, int, int]:
    """``(chunk rows, query tiles per chunk, tiles)``: causal shards are two zigzag chunks of S / 2 rows."""
    chunk = S // 2 if causal else S
    m_tiles = -(-chunk // AK.BM)
    return chunk, m_tiles, B * Hq * (2 if causal else 1) * m_tiles


def grid_size(tiles: int, resident_sms: int, P: int) -> int:
    """Blocks of the persistent kernel: at most the SMs the context may fill (its share of a shared GPU),
    one left for the side stream's gate kernels when there are peers."""
    return max(1, min(tiles, resident_sms - (1 if P > 1 else 0)))


class RingFusedBound(BoundCall):
    """A persistent ring attention call bound to one layout: the tensor maps (q, the local k and v, the K and
    V areas as ``[P * B, ...]`` arrays), the kernel's arguments, the arrival flags, the control launches and
    the pulls on the side stream."""

    def __init__(self, ctx, call, plan, digest: int):
        B, S, _, Hq, Hkv, D = call.dims
        P, me = plan.P, plan.rank
        self.plan = plan
        self.P = P
        self.buffers = ()
        self.arrived = DeviceArray.from_numpy(np.zeros(max(P, 1), np.int64), device=ctx.device)
        chunk, m_tiles, tiles = num_tiles(B, Hq, S, call.causal)
        self.grid = grid_size(tiles, ctx.resident_sms, P)
        kv = call.k.nbytes
        self._qmap = AK.tensor_map(call.q, call.layout, AK.BM)
        self._kmap = AK.tensor_map(call.k, call.layout, AK.BN)
        self._vmap = AK.tensor_map(call.v, call.layout, AK.BN)
        ost = AK.bshd(call.out, call.layout)[1]
        a = self.args = RingFusedArgs()
        a.out_sb, a.out_ss, a.out_sh = ost[0], ost[1], ost[2]
        a.arrived = a.epoch = self.arrived.ptr
        a.b, a.s_loc, a.h_q, a.group = B, S, Hq, Hq // Hkv
        a.scale_log2 = call.scale * AK.LOG2E
        a.P, a.me, a.causal = P, me, int(call.causal)
        a.chunk, a.m_tiles, a.num_tiles = chunk, m_tiles, tiles
        comm = ctx.comm_args("ring_attention", digest)
        self.ws = None
        krmap, vrmap = self._kmap, self._vmap
        if P > 1:
            L = self.layout = fused_workspace_layout(P, kv)
            self.ws = ws = ctx.workspace(("ring_attention",), L.total, call.stream, "mkernel.ring_attention")
            a.epoch = ws.ptr  # MkEpochState.epoch (offset 0), written by mk_ring_begin
            shape = (P * B, *call.k.shape[1:])
            krmap = AK.tensor_map(DeviceArray(ws.ptr + L.k_off, shape, call.k.dtype, call.k.strides,
                                              device=ctx.device), call.layout, AK.BN)
            vrmap = AK.tensor_map(DeviceArray(ws.ptr + L.v_off, shape, call.k.dtype, call.k.strides,
                                              device=ctx.device), call.layout, AK.BN)
            side = ctx.side_stream()
            self._side = cu.CUstream(side)
            self._begin = begin_launch(comm, ws, L.ctl, side)
            self._home = (ws.ptr + L.k_slot(me), ws.ptr + L.v_slot(me), kv)  # this call's k, v go here
            self._announce = [(ws.peer_ptr(j, L.ctl.flags_off + 8 * me), ws.ptr + VALUE_OFF, 8)
                              for j in range(P) if j != me]
            self._gates, self._pulls = [], []
            pieces = call.options.pull_chunks
            for src in plan.sources[1:]:
                self._gates.append(gate_launch(comm, ws, L.ctl, src, side))
                cps = chunked_copies(ws.ptr + L.k_slot(src), ws.peer_ptr(src, L.k_slot(src)), kv, pieces)
                cps += chunked_copies(ws.ptr + L.v_slot(src), ws.peer_ptr(src, L.v_slot(src)), kv, pieces)
                cps.append((ws.peer_ptr(src, L.ctl.consumed_off + 8 * me), ws.ptr + VALUE_OFF, 8))  # done with its home
                cps.append((self.arrived.ptr + 8 * src, ws.ptr + VALUE_OFF, 8))  # the kernel may read the slot
                self._pulls.append(cps)
            self._ev = Events("fork", "begun", "join")
        self._krmap, self._vrmap = krmap, vrmap  # (their descriptors are the launch's arguments)
        self._launch = get(call.q.dtype.name, D).prepare(
            (self.grid, 1, 1), AK.THREADS,
            [self._qmap.buf, self._kmap.buf, self._vmap.buf, krmap.buf, vrmap.buf, a, comm],
            stream=call.stream, smem=AK.smem_bytes(D))

    def run(self, stream, call) -> None:
        s = cu.CUstream(stream)
        a = self.args
        self._qmap.point(call.q.ptr)
        self._kmap.point(call.k.ptr)
        self._vmap.point(call.v.ptr)
        a.out, a.lse = call.out.ptr, call.lse.ptr
        if self.P > 1:
            ev, side = self._ev, self._side
            check(cu.cuEventRecord(ev.fork, s))
            check(cu.cuStreamWaitEvent(side, ev.fork, 0))
            self._begin()  # the call's epoch, which the kernel waits for in arrived[]
            check(cu.cuEventRecord(ev.begun, side))
            check(cu.cuStreamWaitEvent(s, ev.begun, 0))
            hk, hv, n = self._home
            copy_async([(hk, call.k.ptr, n), (hv, call.v.ptr, n)] + self._announce, side)
            for gate, cps in zip(self._gates, self._pulls):
                gate()
                copy_async(cps, side)
        self._launch()
        if self.P > 1:
            check(cu.cuEventRecord(self._ev.join, self._side))
            check(cu.cuStreamWaitEvent(s, self._ev.join, 0))
