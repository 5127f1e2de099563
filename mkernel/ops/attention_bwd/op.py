"""Flash-attention backward on one GPU: :func:`attention_backward` (``cuda_src/ops/attention_bwd.cu``;
docs/attention_bwd.md).

Given the forward's inputs q, k, v, its output ``out`` and log-sum-exp ``lse`` (what
``mkernel.attention`` returns) and the output gradient ``dout``, computes dq, dk, dv.  Three or four
launches on the caller's stream: the preprocess (Dsum = rowsum(dO * O), the fp32 dQ accumulator
zeroed), the main kernel (dK, dV per KV block; dQ added into the accumulator with fp32 atomics), the
conversion of the accumulator into dq -- or, deterministic, a dQ kernel summing over the KV blocks in
order instead of the atomics and the conversion.  Workspaces (Dsum, the accumulator) belong to the
bound call, so a call can be captured into a CUDA graph and replayed.

Every call goes through the op pipeline (mkernel/ops/base.py): the first call of a layout -- shapes,
strides, dtypes, devices, addresses modulo 16, causal, scale, options, stream -- validates, compiles
and binds; later calls re-point the bound launches at the new arrays.
"""
from __future__ import annotations

import ctypes
import dataclasses
import math

from cuda.bindings import driver as cu

from ...core.archs import require_gemm_device
from ...core.arrays import DeviceArray
from ...core.device import on_device
from ...core.interop import as_device_array
from ..attention.kernels import tensor_map
from ..base import BoundCall, Op, as_stream, check_no_overlap, checked_once, device_state
from . import kernels as K
from .options import AttentionBwdOptions

__all__ = ["attention_backward", "BwdArgs", "PartSumArgs", "AttentionBwdPlan", "LAYOUTS", "last_plan",
           "current_context", "layout_dims", "layout_strides", "check_arrays", "prepare_arrays"]

LAYOUTS = ("bshd", "bhsd")
_GRID_YZ_MAX = 65535


class BwdArgs(ctypes.Structure):
    """``MkAttnBwdArgs`` of attention_bwd.cu (element strides (batch, seq, head); lse's (batch, head, seq))."""

    _fields_ = ([(n, ctypes.c_void_p) for n in ("q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv", "dq_acc",
                                                "dsum")]
                + [(n, ctypes.c_int64 * 3) for n in ("q_s", "k_s", "v_s", "o_s", "do_s", "dq_s", "dk_s", "dv_s",
                                                     "lse_s")]
                + [(n, ctypes.c_int32) for n in ("B", "Hq", "Hkv", "Sq", "Sk", "causal")]
                + [("scale", ctypes.c_float), ("scale_log2", ctypes.c_float)]
                + [("part_k", ctypes.c_void_p), ("part_v", ctypes.c_void_p), ("acc_pitch", ctypes.c_int32),
                   ("pad_", ctypes.c_int32)])


class PartSumArgs(ctypes.Structure):
    """``MkAttnPartSumArgs`` of attention_bwd.cu (MKATT_PARTIAL): up to ``kernels.MAX_PARTS`` fp32 dK / dV
    partials ([S, B, H_kv, D], the first ``rows[i]`` rows of source i written), summed in source order into
    dk, dv (element strides (batch, seq, head))."""

    _fields_ = [("part_k", ctypes.c_void_p * K.MAX_PARTS), ("part_v", ctypes.c_void_p * K.MAX_PARTS),
                ("dk", ctypes.c_void_p), ("dv", ctypes.c_void_p), ("dk_s", ctypes.c_int64 * 3),
                ("dv_s", ctypes.c_int64 * 3), ("rows", ctypes.c_int32 * K.MAX_PARTS)] + [
                (n, ctypes.c_int32) for n in ("P", "B", "Hkv", "S")]


class AttentionBwdPlan:
    """What a call launches (``last_plan``): the kernels in order, the main kernel's grid and query block,
    whether dQ is deterministic."""

    __slots__ = ("kernels", "grid", "block_q", "deterministic", "fallback")

    def __init__(self, kernels: tuple, grid: tuple, block_q: int, deterministic: bool):
        self.kernels, self.grid, self.block_q, self.deterministic = kernels, grid, block_q, deterministic
        self.fallback = ""

    def __repr__(self) -> str:
        return (f"AttentionBwdPlan(kernels={self.kernels}, grid={self.grid}, block_q={self.block_q}, "
                f"deterministic={self.deterministic})")


def layout_dims(x: DeviceArray, layout: str) -> tuple[int, int, int, int]:
    """(batch, seq, heads, head dim) of a 4-D ``x`` in ``layout``."""
    b, a1, a2, d = x.shape
    return (b, a1, a2, d) if layout == "bshd" else (b, a2, a1, d)


def layout_strides(x: DeviceArray, layout: str) -> tuple[int, int, int]:
    """(batch, seq, head) element strides of ``x`` in ``layout``."""
    s0, s1, s2, _ = x.strides
    return (s0, s1, s2) if layout == "bshd" else (s0, s2, s1)


def _check_rows(what: str, name: str, x: DeviceArray) -> None:
    """The kernels read and write whole 16-byte pieces of head-dim rows: unit head-dim stride, 16-byte aligned
    base, every other stride (of a dim longer than 1) a multiple of 8 elements."""
    if x.strides[3] != 1:
        raise ValueError(f"{what}: {name} must have a contiguous head dim (stride 1), got strides {x.strides}")
    if x.size and x.ptr % 16:
        raise ValueError(f"{what}: {name} must start at a 16-byte aligned address, got 0x{x.ptr:x}")
    for n, s in zip(x.shape[:3], x.strides[:3]):
        if n > 1 and s % 8:
            raise ValueError(f"{what}: {name}'s strides (in elements) must be multiples of 8 (16 bytes), got "
                             f"{x.strides}")


def check_arrays(w: str, c) -> None:
    """The array checks of :func:`attention_backward` (dtypes, shapes, head dim, rows, devices, writable
    outputs); ``c`` has q, k, v, o, lse, do, dq, dk, dv (DeviceArrays), ``dims`` ((B, S_q, S_k, H_q, H_kv,
    D)) and ``layout``.  Raises ValueError / TypeError naming ``w``."""
    B, Sq, Sk, Hq, Hkv, D = c.dims
    dt = c.q.dtype.name
    if dt not in K.DTYPES:
        raise TypeError(f"{w}: q must be bfloat16 or float16, got {dt}")
    for x, n in ((c.k, "k"), (c.v, "v"), (c.o, "out"), (c.do, "dout"), (c.dq, "dq"), (c.dk, "dk"), (c.dv, "dv")):
        if x.dtype.name != dt:
            raise TypeError(f"{w}: {n} is {x.dtype.name}, q is {dt} (every array but lse has q's dtype)")
    if c.lse.dtype.name != "float32":
        raise TypeError(f"{w}: lse must be float32, got {c.lse.dtype.name}")
    if D not in K.HEAD_DIMS:
        raise ValueError(f"{w}: head dim {D} not supported (one of {K.HEAD_DIMS})")
    want = {"q": c.q.shape, "out": c.q.shape, "dout": c.q.shape, "dq": c.q.shape, "k": c.k.shape,
            "v": c.k.shape, "dk": c.k.shape, "dv": c.k.shape}
    lay = "[B, S, H, D]" if c.layout == "bshd" else "[B, H, S, D]"
    if layout_dims(c.k, c.layout)[0] != B or layout_dims(c.k, c.layout)[3] != D:
        raise ValueError(f"{w}: k {c.k.shape} does not match q {c.q.shape} in batch or head dim ({lay})")
    for x, n in ((c.v, "v"), (c.o, "out"), (c.do, "dout"), (c.dq, "dq"), (c.dk, "dk"), (c.dv, "dv")):
        if tuple(x.shape) != tuple(want[n]):
            raise ValueError(f"{w}: {n} has shape {x.shape}, expected {tuple(want[n])} ({lay}, layout="
                             f"{c.layout!r})")
    if tuple(c.lse.shape) != (B, Hq, Sq):
        raise ValueError(f"{w}: lse has shape {c.lse.shape}, expected [B, H_q, S_q] = {(B, Hq, Sq)}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"{w}: q's heads ({Hq}) must be a multiple of k/v's ({Hkv})")
    if B > _GRID_YZ_MAX or Hq > _GRID_YZ_MAX:
        raise ValueError(f"{w}: batch {B} and heads {Hq} must be at most {_GRID_YZ_MAX}")
    if max(Sq, Sk) >= 2 ** 31 - 256:
        raise ValueError(f"{w}: sequence lengths must be below 2^31 - 256")
    for x, n in ((c.q, "q"), (c.k, "k"), (c.v, "v"), (c.o, "out"), (c.do, "dout"), (c.dq, "dq"), (c.dk, "dk"),
                 (c.dv, "dv")):
        _check_rows(w, n, x)
    for x, n in ((c.dq, "dq"), (c.dk, "dk"), (c.dv, "dv")):
        if x.readonly:
            raise ValueError(f"{w}: {n} is read-only memory but the op writes it")
    for x, n in ((c.k, "k"), (c.v, "v"), (c.o, "out"), (c.lse, "lse"), (c.do, "dout"), (c.dq, "dq"),
                 (c.dk, "dk"), (c.dv, "dv")):
        if x.device != c.q.device:
            raise ValueError(f"{w}: {n} is on cuda:{x.device}, q on cuda:{c.q.device}")


def prepare_arrays(w: str, c, q, k, v, out, lse, dout, dq, dk, dv, softmax_scale) -> None:
    """The arrays of an attention backward call as DeviceArrays on ``c`` (q, k, v, o, lse, do, and dq, dk, dv,
    allocated contiguous when None), its ``dims`` (B, S_q, S_k, H_q, H_kv, D) and ``scale``; ``c.layout``
    and ``c.stream`` set before.  Raises (naming ``w``) on a missing input, a non-4-D one, a non-finite
    scale, or outputs overlapping the inputs or each other."""
    arrs = []
    for x, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "lse"), (dout, "dout")):
        if x is None:
            raise TypeError(f"{w}: {n} is required")
        arrs.append(as_device_array(x, name=f"{w.removeprefix('mkernel.')}: {n}", stream=c.stream))
    c.q, c.k, c.v, c.o, c.lse, c.do = arrs
    for x, n in ((c.q, "q"), (c.k, "k"), (c.v, "v"), (c.o, "out"), (c.do, "dout")):
        if x.ndim != 4:
            raise ValueError(f"{w}: {n} must be 4-D ({'[B, S, H, D]' if c.layout == 'bshd' else '[B, H, S, D]'} "
                             f"for layout={c.layout!r}), got shape {x.shape}")
    B, Sq, Hq, D = layout_dims(c.q, c.layout)
    _, Sk, Hkv, _ = layout_dims(c.k, c.layout)
    c.dims = (B, Sq, Sk, Hq, Hkv, D)
    if softmax_scale is None:
        c.scale = 1.0 / math.sqrt(D) if D > 0 else 1.0
    else:
        c.scale = float(softmax_scale)
        if not math.isfinite(c.scale):
            raise ValueError(f"{w}: softmax_scale must be finite, got {softmax_scale!r}")
    res = []
    for g, n, like in ((dq, "dq", c.q), (dk, "dk", c.k), (dv, "dv", c.v)):
        if g is None:
            res.append(DeviceArray.empty(like.shape, like.dtype.name, device=like.device))
        else:
            res.append(as_device_array(g, name=f"{w.removeprefix('mkernel.')}: {n}", stream=c.stream))
    c.dq, c.dk, c.dv = res
    outs = ((c.dq, "dq"), (c.dk, "dk"), (c.dv, "dv"))
    ins = ((c.q, "q"), (c.k, "k"), (c.v, "v"), (c.o, "out"), (c.lse, "lse"), (c.do, "dout"))
    check_no_overlap(w, [(o, on, i, n) for o, on in outs for i, n in ins]
                     + [(c.dq, "dq", c.dk, "dk"), (c.dq, "dq", c.dv, "dv"), (c.dk, "dk", c.dv, "dv")])


class _Call:
    __slots__ = ("key", "stream", "q", "k", "v", "o", "do", "lse", "dq", "dk", "dv", "layout", "causal", "scale",
                 "options", "dims", "state")


def current_context() -> int:
    """The current CUDA context's handle (0: none), read on every call of a bound attention backward."""
    return int(cu.cuCtxGetCurrent()[1])


class _TmaMaps:
    """The wgmma kernel's tensor maps {D, S, H, B} (boxes {64, rows, 1, 1}, 128B-swizzled): q and dout with
    64-row boxes, k and v with 128-row boxes; re-pointed at every call's arrays.  S_q = 0 (nothing is
    read): the q and dout maps cover k (a valid, non-null address)."""

    def __init__(self, c):
        self._noq = c.dims[1] == 0
        self.q, self.do = (tensor_map(x, c.layout, K.WGMMA_BLOCK_Q, ptr=c.k.ptr if self._noq else None)
                           for x in (c.q, c.do))
        self.k, self.v = (tensor_map(x, c.layout, K.WGMMA_BLOCK_KV) for x in (c.k, c.v))

    def bufs(self) -> list:
        return [self.q.buf, self.k.buf, self.v.buf, self.do.buf]  # the kernel's parameter order

    def point(self, call) -> None:
        self.q.point(call.k.ptr if self._noq else call.q.ptr)
        self.k.point(call.k.ptr)
        self.v.point(call.v.ptr)
        self.do.point(call.k.ptr if self._noq else call.do.ptr)


class _Bound(BoundCall):
    def __init__(self, plan, launches, args: BwdArgs, buffers, ctx: int, device: int, maps=None):
        self.plan, self._launches, self._args = plan, launches, args
        self.buffers = tuple(buffers)
        self._ctx, self._device = ctx, device
        self._maps = maps

    def run(self, stream, call) -> None:
        if self._maps is not None:
            self._maps.point(call)
        a = self._args
        a.q, a.k, a.v, a.o, a.dout, a.lse = call.q.ptr, call.k.ptr, call.v.ptr, call.o.ptr, call.do.ptr, call.lse.ptr
        a.dq, a.dk, a.dv = call.dq.ptr, call.dk.ptr, call.dv.ptr
        if current_context() != self._ctx:
            with on_device(self._device):
                for launch in self._launches:
                    launch.submit()
        else:
            for launch in self._launches:
                launch.submit()


class _AttnBwd(Op):
    name = "attention_backward"
    what = "mkernel.attention_backward"

    def __call__(self, q, k, v, out, lse, dout, dq, dk, dv, causal, softmax_scale, layout, deterministic, ctx,
                 stream, options):
        w = self.what
        s = as_stream(stream)
        if layout not in LAYOUTS:
            raise ValueError(f"{w}: layout must be one of {LAYOUTS}, got {layout!r}")
        if options is None:
            options = AttentionBwdOptions(deterministic=bool(deterministic))
        elif not isinstance(options, AttentionBwdOptions):
            raise TypeError(f"{w}: options must be an AttentionBwdOptions, got {type(options).__name__}")
        elif deterministic and not options.deterministic:
            options = dataclasses.replace(options, deterministic=True)
        c = _Call()
        c.stream, c.layout, c.causal, c.options = s, layout, bool(causal), options
        prepare_arrays(w, c, q, k, v, out, lse, dout, dq, dk, dv, softmax_scale)
        B, Sq, Sk, Hq, Hkv, D = c.dims
        c.state = ctx.op_state(self.name) if ctx is not None else device_state(self.name, c.q.device)
        c.key = (layout, c.causal, c.scale, options, s, ctx is not None,
                 *[x.layout_key() for x in (c.q, c.k, c.v, c.o, c.lse, c.do, c.dq, c.dk, c.dv)])
        if B and Hq and Hkv:
            self.invoke(c.state, c, ctx)
        return (dq if dq is not None else c.dq, dk if dk is not None else c.dk, dv if dv is not None else c.dv)

    def validate(self, ctx, c):
        w = self.what
        checked_once(c.options)
        check_arrays(w, c)
        if ctx is not None and getattr(ctx, "device", c.q.device) != c.q.device:
            raise ValueError(f"{w}: the arrays are on cuda:{c.q.device}, the context's device is cuda:{ctx.device}")
        require_gemm_device(w, c.q.device)

    def _block_q(self, c) -> int:
        """The mma kernels' specialization (the row kernels and the deterministic dQ kernel come from it for
        both main kernels)."""
        return c.options.block_q or K.DEFAULT_BLOCK_Q[c.dims[5]]

    def compile(self, ctx, c):
        main = K.WGMMA_KERNEL if c.options.main_kernel() == "wgmma" else "mk_attn_bwd_main"
        with on_device(c.q.device):
            for name in ("mk_attn_bwd_pre", main, "mk_attn_bwd_dq", "mk_attn_bwd_convert"):
                K.get(c.q.dtype.name, c.dims[5], self._block_q(c), name)

    def describe_call(self, c):
        B, Sq, Sk, Hq, Hkv, D = c.dims
        return (f"B={B} S_q={Sq} S_k={Sk} H_q={Hq} H_kv={Hkv} D={D} {c.q.dtype.name} layout={c.layout} "
                f"causal={c.causal}")

    def plan(self, ctx, c, digest):
        B, Sq, Sk, Hq, Hkv, D = c.dims
        det = c.options.deterministic
        bq = self._block_q(c)
        wg = c.options.main_kernel() == "wgmma"
        names = ["mk_attn_bwd_pre"] if B * Hq * Sq else []
        if Sk:
            names.append(K.WGMMA_KERNEL if wg else "mk_attn_bwd_main")
        if B * Hq * Sq:
            names.append("mk_attn_bwd_dq" if det else "mk_attn_bwd_convert")
        rows = K.WGMMA_BLOCK_KV if wg else 16 * K.WARPS
        return AttentionBwdPlan(tuple(names), (-(-Sk // rows), Hkv, B), K.WGMMA_BLOCK_Q if wg else bq, det)

    def bind(self, ctx, c, plan):
        B, Sq, Sk, Hq, Hkv, D = c.dims
        dt = c.q.dtype.name
        rows = B * Hq * Sq
        with on_device(c.q.device) as (hctx, dev):
            a = BwdArgs()
            for name, x in (("q_s", c.q), ("k_s", c.k), ("v_s", c.v), ("o_s", c.o), ("do_s", c.do), ("dq_s", c.dq),
                            ("dk_s", c.dk), ("dv_s", c.dv)):
                getattr(a, name)[:] = layout_strides(x, c.layout)
            a.lse_s[:] = c.lse.strides
            a.B, a.Hq, a.Hkv, a.Sq, a.Sk, a.causal = B, Hq, Hkv, Sq, Sk, int(c.causal)
            a.scale, a.scale_log2 = c.scale, c.scale * math.log2(math.e)
            buffers = []
            dsum = DeviceArray.empty((max(1, rows),), "float32", device=dev)
            buffers.append(dsum)
            a.dsum = dsum.ptr
            a.dq_acc = None
            if not plan.deterministic and rows:
                acc = DeviceArray.empty((rows * D,), "float32", device=dev)
                buffers.append(acc)
                a.dq_acc = acc.ptr
            launches, maps = [], None
            row_grid = -(-rows // K.ROW_KERNEL_ROWS)
            bq = self._block_q(c)
            for name in plan.kernels:
                kern = K.get(dt, D, bq, name)
                if name in ("mk_attn_bwd_pre", "mk_attn_bwd_convert"):
                    launches.append(kern.prepare(row_grid, 32 * K.ROW_KERNEL_ROWS, [a], stream=c.stream))
                elif name == "mk_attn_bwd_main":
                    launches.append(kern.prepare(plan.grid, 32 * K.WARPS, [a], stream=c.stream,
                                                 smem=K.main_smem(D, plan.block_q)))
                elif name == K.WGMMA_KERNEL:
                    maps = _TmaMaps(c)
                    launches.append(kern.prepare(plan.grid, K.WGMMA_THREADS, [*maps.bufs(), a], stream=c.stream,
                                                 smem=K.wgmma_smem(D)))
                else:
                    grid = (-(-Sq // (16 * K.DQ_WARPS)), Hq, B)
                    launches.append(kern.prepare(grid, 32 * K.DQ_WARPS, [a], stream=c.stream, smem=K.dq_smem(D)))
            return _Bound(plan, launches, a, buffers, int(hctx), dev, maps)


_OP = _AttnBwd()


def attention_backward(q, k, v, out, lse, dout, dq=None, dk=None, dv=None, *, causal: bool = False,
                       softmax_scale: float | None = None, layout: str = "bshd", deterministic: bool = False,
                       ctx=None, stream=None, options: AttentionBwdOptions | None = None):
    """Gradients ``(dq, dk, dv)`` of flash attention ``out = softmax(softmax_scale * q k^T + mask) v``.

    q, out, dout: ``[B, S_q, H_q, D]`` for ``layout="bshd"`` (``[B, H_q, S_q, D]`` for "bhsd"); k, v:
    ``[B, S_k, H_kv, D]`` (resp. ``[B, H_kv, S_k, D]``); all bfloat16 or all float16, on one device, head dim
    D 64 or 128, contiguous along D, 16-byte aligned, other strides multiples of 8 elements.  H_q a
    multiple of H_kv (GQA / MQA: query head h uses KV head h // (H_q / H_kv)).  lse: float32
    ``[B, H_q, S_q]``, the forward's natural-log log-sum-exp of ``softmax_scale * q.k_j`` over unmasked j
    (-inf for a fully masked row).  causal: query i sees keys j <= i + S_k - S_q (bottom-right aligned).
    softmax_scale: default 1/sqrt(D).  dq, dk, dv: arrays to write (q's, k's, v's shapes and dtype, any
    strides as above, not overlapping the inputs or each other) or None to allocate them (contiguous, in
    ``layout``).  dk, dv are summed over the query heads of each KV group.  deterministic (or
    ``options.deterministic``): bit-identical dq from run to run (see :class:`AttentionBwdOptions`).
    ctx: an optional :class:`mkernel.Context` whose op state keeps the bound calls (else the device's).
    stream: any stream-like object or raw handle (None: the legacy default stream).  Returns
    ``(dq, dk, dv)``; asynchronous with respect to the host.
    """
    return _OP(q, k, v, out, lse, dout, dq, dk, dv, causal, softmax_scale, layout, deterministic, ctx, stream,
               options)


def last_plan(device: int | None = None, ctx=None) -> AttentionBwdPlan | None:
    """The plan of the latest :func:`attention_backward` call on ``device`` (None: the current one), or of
    ``ctx``'s."""
    if ctx is not None:
        return ctx.op_state(_OP.name).last_plan
    if device is None:
        with on_device(None) as (_, device):
            pass
    return device_state(_OP.name, device).last_plan
