"""Flash-attention forward on Hopper, on the op pipeline (mkernel/ops/base.py): ``cuda_src/ops/attention_fwd.cu``.

``attention(q, k, v)`` computes ``O = softmax(scale * Q K^T + mask) V`` per (batch, query head) and the row
log-sum-exp ``lse = ln(sum_j exp(scale * q . k_j))`` over the unmasked keys j, in fp32.  K/V head
``h // (H_q / H_kv)`` serves query head h (GQA/MQA; K and V are read in place, never replicated).

The first call of a layout -- shapes, strides, dtypes, device, addresses modulo 16, causal, the options,
the stream -- validates, compiles and binds the launch (three TMA tensor maps and the argument struct);
later calls with new arrays of that layout patch the maps' addresses and launch.  No host synchronization
and no allocation when ``out`` and ``lse`` are given, so calls can be captured into CUDA graphs.
docs/attention.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ...core.archs import require_gemm_device
from ...core.arrays import DeviceArray
from ...core.device import context_handle as _context_handle, current_context as _current_context, on_device
from ...core.interop import as_device_array
from ..base import BoundCall, Op, as_stream, check_no_overlap, checked_once, device_state
from . import kernels as K
from .options import AttentionOptions

__all__ = ["attention", "last_plan", "AttentionPlan", "LAYOUTS", "check_arrays", "check_layout", "prepare_arrays"]

LAYOUTS = ("bshd", "bhsd")
_MAX_GRID_YZ = 65535  # gridDim.y (query heads) and gridDim.z (batch)


@dataclass(frozen=True)
class AttentionPlan:
    """What an attention call launched (``last_plan``): the kernel's head dim, dtype, causal flag, the grid
    ``(query blocks, H_q, B)``, threads, shared memory, the query-block order, the schedule
    (``AttentionOptions.schedule``) and its query rows and keys per block step (``block_m``, ``block_n``)."""

    head_dim: int
    dtype: str
    causal: bool
    grid: tuple
    threads: int
    smem: int
    heavy_first: bool
    fallback: str = ""
    schedule: str = "default"
    block_m: int = K.BM
    block_n: int = K.BN



class _Call:
    __slots__ = ("key", "stream", "q", "k", "v", "out", "lse", "causal", "scale", "layout", "options", "dims")


def _schedule(call) -> str:
    return K.pick_schedule(call.options.schedule, call.dims[5], call.dims[2])


class _Attention(Op):
    name = "attention"
    what = "mkernel.attention"

    def __call__(self, q, k, v, out, lse, causal, softmax_scale, layout, stream, options):
        w = self.what
        check_layout(w, layout)
        if options is None:
            options = _DEFAULT
        elif not isinstance(options, AttentionOptions):
            raise TypeError(f"{w}: options must be an AttentionOptions, got {type(options).__name__}")
        s = as_stream(stream)
        Q, Kx, V, O, L, dims, scale = prepare_arrays(w, q, k, v, out, lse, softmax_scale, layout, s)
        out, lse = (O if out is None else out), (L if lse is None else lse)
        B, Sq, Sk, Hq, Hkv, D = dims
        call = _Call()
        call.stream, call.q, call.k, call.v, call.out, call.lse = s, Q, Kx, V, O, L
        call.causal, call.scale, call.layout, call.options = bool(causal), scale, layout, options
        call.dims = (B, Sq, Sk, Hq, Hkv, D)
        call.key = (layout, call.causal, options, s, *[x.layout_key() for x in (Q, Kx, V, O, L)])
        if B == 0 or Sq == 0 or Hq == 0:
            self.validate(None, call)  # (nothing to compute; the arguments are still checked)
            return out, lse
        self.invoke(device_state(self.name, Q.device), call)
        return out, lse

    def validate(self, ctx, call):
        checked_once(call.options)
        check_arrays(self.what, call.q, call.k, call.v, call.out, call.lse, call.dims, call.layout)

    def compile(self, ctx, call):
        with on_device(call.q.device):
            K.get(call.q.dtype.name, call.dims[5], call.causal, _schedule(call))

    def describe_call(self, call):
        B, Sq, Sk, Hq, Hkv, D = call.dims
        return (f"B={B} S_q={Sq} S_k={Sk} H_q={Hq} H_kv={Hkv} D={D} {call.q.dtype.name} layout={call.layout} "
                f"causal={call.causal}")

    def plan(self, ctx, call, digest):
        B, Sq, Sk, Hq, Hkv, D = call.dims
        sched = _schedule(call)
        g = K.geometry(D, sched)
        return AttentionPlan(D, call.q.dtype.name, call.causal, (-(-Sq // g.bm), Hq, B), g.threads, g.smem,
                             call.options.heavy_first, schedule=sched, block_m=g.bm, block_n=g.bn)

    def bind(self, ctx, call, plan):
        with on_device(call.q.device):
            return _AttentionBound(call, plan)


class _AttentionBound(BoundCall):
    """An attention call bound to one layout: three re-pointable tensor maps, the argument struct, the
    prepared launch (in the CUDA context it was prepared in)."""

    def __init__(self, call: _Call, plan: AttentionPlan):
        B, Sq, Sk, Hq, Hkv, D = call.dims
        self.plan = plan
        # no keys (S_k = 0): K and V are never read; their maps cover q (a valid, non-null address)
        self._nokeys = Sk == 0
        kv = (call.q, call.q) if self._nokeys else (call.k, call.v)
        self._q = K.tensor_map(call.q, call.layout, plan.block_m)
        self._k, self._v = (K.tensor_map(x, call.layout, plan.block_n) for x in kv)
        ext, st = K.bshd(call.out, call.layout)
        self._args = K.AttnFwdArgs(call.out.ptr, call.lse.ptr, st[0], st[1], st[2], Sq, Sk, Hq, Hq // Hkv,
                                   call.scale * K.LOG2E, int(plan.heavy_first))
        kern = K.get(call.q.dtype.name, D, call.causal, plan.schedule)
        self._launch = kern.prepare(plan.grid, plan.threads, [self._q.buf, self._k.buf, self._v.buf, self._args],
                                    stream=call.stream, smem=plan.smem)
        self._ctx, self._device = _current_context()

    def run(self, stream, call) -> None:
        self._q.point(call.q.ptr)
        self._k.point(call.q.ptr if self._nokeys else call.k.ptr)
        self._v.point(call.q.ptr if self._nokeys else call.v.ptr)
        a = self._args
        a.out, a.lse, a.scale_log2 = call.out.ptr, call.lse.ptr, call.scale * K.LOG2E
        if _context_handle() != self._ctx:
            with on_device(self._device):
                self._launch()
        else:
            self._launch()


def check_layout(w: str, layout: str) -> None:
    """ValueError unless ``layout`` is one of :data:`LAYOUTS`."""
    if layout not in LAYOUTS:
        raise ValueError(f"{w}: layout must be 'bshd' ([B, S, H, D]) or 'bhsd' ([B, H, S, D]), got {layout!r}")


def prepare_arrays(w: str, q, k, v, out, lse, softmax_scale, layout: str, s: int) -> tuple:
    """An attention forward's arguments as DeviceArrays (``out`` and ``lse`` allocated when None), checked for
    4-D shapes, the scale and overlaps: ``(Q, K, V, O, L, (B, S_q, S_k, H_q, H_kv, D), scale)``."""
    Q = as_device_array(q, name=f"{w}: q", stream=s)
    Kx = as_device_array(k, name=f"{w}: k", stream=s)
    V = as_device_array(v, name=f"{w}: v", stream=s)
    for x, n in ((Q, "q"), (Kx, "k"), (V, "v")):
        if x.ndim != 4:
            raise ValueError(f"{w}: {n} must be 4-D ({'[B, S, H, D]' if layout == 'bshd' else '[B, H, S, D]'} for "
                             f"layout={layout!r}), got shape {tuple(x.shape)}")
    (B, Sq, Hq, D), _ = K.bshd(Q, layout)
    (_, Sk, Hkv, _), _ = K.bshd(Kx, layout)
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0
    else:
        scale = float(softmax_scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{w}: softmax_scale must be a finite number > 0, got {softmax_scale!r}")
    if out is None:
        if Q.dtype.name not in K.DTYPES:  # (checked again in validate; no allocation of an odd dtype)
            raise TypeError(f"{w}: q has dtype {Q.dtype.name}; expected bfloat16 or float16")
        O = DeviceArray.empty(Q.shape, Q.dtype, device=Q.device)
    else:
        O = as_device_array(out, name=f"{w}: out", stream=s)
    if lse is None:
        L = DeviceArray.empty((B, Hq, Sq), "float32", device=Q.device)
    else:
        L = as_device_array(lse, name=f"{w}: lse", stream=s)
    check_no_overlap(w, ((O, "out", Q, "q"), (O, "out", Kx, "k"), (O, "out", V, "v"), (L, "lse", Q, "q"),
                         (L, "lse", Kx, "k"), (L, "lse", V, "v"), (O, "out", L, "lse")))
    return Q, Kx, V, O, L, (B, Sq, Sk, Hq, Hkv, D), scale


def check_arrays(w: str, Q: DeviceArray, Kx: DeviceArray, V: DeviceArray, O: DeviceArray, L: DeviceArray, dims: tuple,
                 layout: str) -> None:
    """Every check of an attention forward's arrays (ValueError / TypeError naming the problem, ``w`` the
    op's name): dtypes, shapes, head dim, GQA, TMA-readable strides, out and lse, one device (a Hopper
    GPU).  ``dims``: ``(B, S_q, S_k, H_q, H_kv, D)``."""
    for x, n in ((Q, "q"), (Kx, "k"), (V, "v")):
        if x.dtype.name not in K.DTYPES:
            raise TypeError(f"{w}: {n} has dtype {x.dtype.name}; expected bfloat16 or float16")
    if Kx.dtype != Q.dtype or V.dtype != Q.dtype:
        raise TypeError(f"{w}: q, k, v must share one dtype, got {Q.dtype.name}, {Kx.dtype.name}, {V.dtype.name}")
    B, Sq, Sk, Hq, Hkv, D = dims
    lay = "[B, S, H, D]" if layout == "bshd" else "[B, H, S, D]"
    if tuple(Kx.shape) != tuple(V.shape):
        raise ValueError(f"{w}: k and v must have the same shape, got {tuple(Kx.shape)} and {tuple(V.shape)}")
    (Bk, _, _, Dk), _ = K.bshd(Kx, layout)
    if Bk != B or Dk != D:
        raise ValueError(f"{w}: q {tuple(Q.shape)} and k {tuple(Kx.shape)} ({lay}) differ in batch or head dim")
    if D not in K.HEAD_DIMS:
        raise ValueError(f"{w}: head dim {D} is not supported; supported: {K.HEAD_DIMS}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"{w}: query heads H_q={Hq} must be a multiple of the K/V heads H_kv={Hkv} (GQA/MQA)")
    if max(Sq, Sk) >= 2**31 - K.MAX_BM or Hq > _MAX_GRID_YZ or B > _MAX_GRID_YZ:
        raise ValueError(f"{w}: sizes out of range (S_q={Sq}, S_k={Sk} below 2**31 - {K.MAX_BM}; H_q={Hq}, B={B} at "
                         f"most {_MAX_GRID_YZ})")
    for x, n in ((Q, "q"), (Kx, "k"), (V, "v")):
        ext, st = K.bshd(x, layout)
        if st[3] != 1 and ext[3] > 1:
            raise ValueError(f"{w}: {n} must have a unit head-dim stride, got strides {tuple(x.strides)} (elements)")
        bad = [(e, s) for e, s in zip(ext[:3], st[:3]) if e > 1 and (s <= 0 or (s * x.dtype.itemsize) % 16)]
        if bad or x.ptr % 16:
            raise ValueError(f"{w}: {n} is read by TMA, which needs a 16-byte aligned base address and strides that "
                             f"are positive multiples of 16 bytes (8 elements); got ptr 0x{x.ptr:x}, strides "
                             f"{tuple(x.strides)} (elements) for shape {tuple(x.shape)}")
    if tuple(O.shape) != tuple(Q.shape) or O.dtype != Q.dtype:
        raise ValueError(f"{w}: out must have q's shape {tuple(Q.shape)} and dtype {Q.dtype.name}, got "
                         f"{tuple(O.shape)} {O.dtype.name}")
    ext, st = K.bshd(O, layout)
    if (st[3] != 1 and D > 1) or O.ptr % 4 or any(e > 1 and s % 2 for e, s in zip(ext[:3], st[:3])):
        raise ValueError(f"{w}: out needs a unit head-dim stride, even strides and a 4-byte aligned base (two "
                         f"elements per store); got ptr 0x{O.ptr:x}, strides {tuple(O.strides)}")
    if L.dtype.name != "float32" or tuple(L.shape) != (B, Hq, Sq) or not L.is_contiguous():
        raise ValueError(f"{w}: lse must be a contiguous float32 [B, H_q, S_q] = [{B}, {Hq}, {Sq}] array, got "
                         f"{L.dtype.name} {tuple(L.shape)} strides {tuple(L.strides)}")
    if O.readonly or L.readonly:
        raise ValueError(f"{w}: {'out' if O.readonly else 'lse'} is read-only memory but the op writes it")
    devs = {x.device for x in (Q, Kx, V, O, L)}
    if len(devs) != 1:
        raise ValueError(f"{w}: q, k, v, out and lse must be on one device, got devices "
                         f"{[x.device for x in (Q, Kx, V, O, L)]}")
    require_gemm_device(w, Q.device)



_ATTENTION = _Attention()
_DEFAULT = AttentionOptions()


def attention(q, k, v, out=None, *, lse=None, causal: bool = False, softmax_scale: float | None = None,
              layout: str = "bshd", ctx=None, stream=None, options: AttentionOptions | None = None):
    """Flash-attention forward on one GPU: returns ``(out, lse)``.

    q: ``[B, S_q, H_q, D]`` (``layout="bshd"``) or ``[B, H_q, S_q, D]`` (``"bhsd"``); k, v: ``[B, S_k, H_kv, D]``
    (resp. ``[B, H_kv, S_k, D]``), the same layout.  bf16 or fp16 (all three alike), D = 64 or 128, H_q a
    multiple of H_kv (query head h reads K/V head ``h // (H_q // H_kv)``).  Any CUDA arrays (CAI, DLPack,
    torch, DeviceArray) on one device; the head dim contiguous, other strides multiples of 16 bytes and a
    16-byte aligned base (TMA reads them in place; a ValueError otherwise).  Any S_q, S_k >= 0.

    out: q's shape, dtype and layout (unit head-dim stride, even strides), or None to allocate.  lse:
    contiguous float32 ``[B, H_q, S_q]``, or None to allocate; ``lse[b, h, i] = ln(sum_j exp(softmax_scale *
    q_i . k_j))`` over the keys j row i sees.  causal: query i sees keys ``j <= i + S_k - S_q`` (aligned
    bottom-right, as FlashAttention 2.1+); a row that sees no key gets out 0 and lse -inf.  softmax_scale:
    finite > 0, default ``1 / sqrt(D)``.  ctx: unused (single-GPU op; accepted so call sites can pass the
    context they have).  stream: any stream-like object or raw handle (None: the legacy default stream).
    options: :class:`AttentionOptions`.  Asynchronous with respect to the host; with ``out`` and ``lse``
    given it allocates nothing and can be captured into a CUDA graph.
    """
    return _ATTENTION(q, k, v, out, lse, causal, softmax_scale, layout, stream, options)


def last_plan(device: int | None = None) -> AttentionPlan | None:
    """The plan (:class:`AttentionPlan`) of the latest attention call on ``device`` (None: the current one)."""
    if device is None:
        with on_device(None) as (_, device):
            pass
    return device_state("attention", device).last_plan
