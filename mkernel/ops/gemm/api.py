"""GEMM and grouped GEMM on Hopper (TMA + wgmma, warp-specialized, persistent): ``cuda_src/gemm/gemm.cu``.

``gemm(a, b)``: ``C[M, N] = A[M, K] @ B`` with A row-major ``[M, K]`` and B either row-major ``[K, N]``
(``b_layout="kn"``) or ``[N, K]`` (``b_layout="nk"``, weights as frameworks store them, i.e. ``C = A @ B.T``).
``grouped_gemm(a, b, group_offsets)``: for every group g, ``C[o[g]:o[g+1]] = A[o[g]:o[g+1]] @ B[g]`` with B
``[G, K, N]`` ("kn") or ``[G, N, K]`` ("nk") (MoE experts; groups may be empty and uneven).

Inputs are bf16 or fp16 (A and B alike), accumulation is fp32, the output is bf16, fp16 or fp32 (default:
the input dtype; pass ``out=`` or ``out_dtype=``).  Arrays are any CUDA arrays (``__cuda_array_interface__``,
DLPack, torch tensors, mkernel DeviceArrays) on one device.  Any M, N, K works: tiles at the edges are masked
(TMA zero-fills out-of-bounds loads, the epilogue masks stores); K == 0 writes zeros.

TMA needs 16-byte-aligned base addresses and row strides.  An operand that violates this (e.g. K = 7 for
row-major A, N odd for a "kn" B, a misaligned view, a non-unit inner stride) is first staged on the device
into a dense zero-padded copy (one extra pass over that operand), so every shape works; aligned operands are
read in place.  The output needs a unit column stride (any row stride): with a 16-byte aligned base and row
stride it is written through shared memory and TMA stores, otherwise with masked stores from registers.

Few output tiles (small M or N): K is split; every split adds its fp32 partial into one running sum per
tile and the tile's last split to finish stores it, in the same kernel; with a partial last wave only its
tiles may be split.

Every call goes through the op pipeline (mkernel/ops/base.py): the first call of a layout -- shapes,
strides, dtypes, devices, the addresses modulo 16, the options, the stream -- plans and binds its launches;
later calls with new arrays of that layout re-point them.  What ran: :func:`last_plan`.
"""
from __future__ import annotations

import numpy as np

from ...core.archs import require_gemm_device
from ...core.arrays import DeviceArray
from ...core.compiler import precompile_source
from ...core.device import on_device
from ...core.interop import as_device_array
from ..base import Op, as_stream, check_no_overlap, checked_once, device_state
from .configs import CONFIGS, OUT_DTYPES, SOURCE
from .operands import check_arrays, check_device, layout_key, prepare_out
from .options import GemmOptions
from .plan import bind_gemm, bind_grouped
from .swiglu import SWIGLU_CONFIGS, pair_width, swiglu_candidates

__all__ = ["gemm", "grouped_gemm", "grouped_gemm_swiglu", "precompile", "last_plan"]


def _output(what: str, out, out_dtype, A: DeviceArray, B: DeviceArray, shape: tuple, stream: int):
    """(out as a DeviceArray, what the op returns): a new array of ``out_dtype`` (default a's) when ``out`` is
    None, else ``out`` imported and checked not to overlap a or b."""
    if out is None:
        od = out_dtype or A.dtype.name
        if od not in OUT_DTYPES:
            raise TypeError(f"{what}: out_dtype {od} not in {OUT_DTYPES}")
        O = DeviceArray.empty(shape, od, device=A.device)
        return O, O
    O = as_device_array(out, name=f"{what.rsplit('.', 1)[-1]}: out", stream=stream)
    check_no_overlap(what, ((O, "out", A, "a"), (O, "out", B, "b")))
    return O, out


class _Call:
    __slots__ = ("key", "stream", "A", "B", "O", "M", "N", "K", "G", "b_layout", "options", "out_dtype",
                 "offsets", "host_offs")


def _options(options, config, splits, swap, what: str) -> GemmOptions:
    o = GemmOptions.default() if options is None else options
    if not isinstance(o, GemmOptions):
        raise TypeError(f"{what}: options must be a GemmOptions, got {type(o).__name__}")
    return o.with_forced(config, splits, swap)


class _Gemm(Op):
    name = "gemm"
    what = "mkernel.gemm"

    def __call__(self, a, b, out, b_layout, out_dtype, stream, options):
        s = as_stream(stream)
        A = as_device_array(a, name="gemm: a", stream=s)
        B = as_device_array(b, name="gemm: b", stream=s)
        if out is not None:  # a layout already bound was checked then: only the addresses are new (overlap)
            O = as_device_array(out, name="gemm: out", stream=s)
            call = _Call()
            call.stream, call.A, call.B, call.O = s, A, B, O
            call.key = (b_layout, out_dtype, options, s, layout_key(A), layout_key(B), layout_key(O), O.readonly)
            check_no_overlap(self.what, ((O, "out", A, "a"), (O, "out", B, "b")))
            if self.invoke_bound(device_state(self.name, A.device), call) is not None:
                return out
        A, B, M, K, N, _ = check_arrays(A, B, b_layout, what=self.what)
        O, result = _output(self.what, out, out_dtype, A, B, (M, N), s)
        if M == 0 or N == 0:
            return result
        call = _Call()
        call.stream, call.A, call.B, call.O, call.M, call.N, call.K = s, A, B, O, M, N, K
        call.b_layout, call.options, call.out_dtype = b_layout, options, out_dtype
        call.key = (b_layout, out_dtype, options, s, layout_key(A), layout_key(B), layout_key(O), O.readonly)
        self.invoke(device_state(self.name, A.device), call)
        return result

    def validate(self, ctx, call):
        require_gemm_device(self.what, call.A.device)
        o = checked_once(call.options)
        if o.swap and call.b_layout != "nk":
            raise ValueError('mkernel.gemm: swap=True needs b_layout="nk" (B [N, K] as the transposed '
                             "problem's K-major A operand)")
        if o.swap and o.config is not None and CONFIGS[o.config].pingpong:
            raise ValueError(f"mkernel.gemm: config {o.config} (ping-pong) has no swapped kernel")
        check_device([call.A, call.B, call.O], ["a", "b", "out"])
        prepare_out(call.O, call.out_dtype, call.A.dtype.name, (call.M, call.N), call.A.device)
        if call.O.readonly:
            raise ValueError(f"{self.what}: out is read-only memory but the op writes it")

    def describe_call(self, call):
        return (f"M={call.M} N={call.N} K={call.K} {call.A.dtype.name} -> {call.O.dtype.name} "
                f"b_layout={call.b_layout}")

    def plan(self, ctx, call, digest):
        return None  # (planned and bound together: plan.bind_gemm)

    def bind(self, ctx, call, plan):
        with on_device(call.A.device):
            return bind_gemm(call.A, call.B, call.O, call.M, call.N, call.K, call.b_layout, call.options,
                             call.stream)


class _Grouped(Op):
    name = "grouped_gemm"
    what = "mkernel.grouped_gemm"
    swiglu = False  # out = silu(gate) * up of the [G, 2F, K] weight's product (_GroupedSwiGLU)

    def __call__(self, a, b, group_offsets, out, b_layout, out_dtype, stream, options):
        s = as_stream(stream)
        A = as_device_array(a, name="grouped_gemm: a", stream=s)
        B = as_device_array(b, name="grouped_gemm: b", stream=s)
        A, B, T, K, N, G = check_arrays(A, B, b_layout, what=self.what, grouped=True)
        call = _Call()
        call.offsets = call.host_offs = None
        if isinstance(group_offsets, (list, tuple, np.ndarray)):
            h = np.asarray(group_offsets, dtype=np.int64).reshape(-1)
            if h.shape[0] != G + 1:
                raise ValueError(f"{self.what}: group_offsets has {h.shape[0]} entries; b has G={G} groups, so "
                                 f"G+1={G + 1} are needed")
            if G and (h[0] < 0 or h[-1] > T or np.any(np.diff(h) < 0)):
                raise ValueError(f"{self.what}: group_offsets must be nondecreasing within [0, {T}]")
            call.host_offs = h
            offs_key = ("host", h.tobytes())
        else:
            D = call.offsets = as_device_array(group_offsets, name="grouped_gemm: group_offsets", stream=s)
            offs_key = ("dev",) + layout_key(D)
        O, result = _output(self.what, out, out_dtype, A, B, (T, N // 2 if self.swiglu else N), s)
        if T == 0 or N == 0 or G == 0:
            return result
        call.stream, call.A, call.B, call.O, call.M, call.N, call.K, call.G = s, A, B, O, T, N, K, G
        call.b_layout, call.options, call.out_dtype = b_layout, options, out_dtype
        call.key = (b_layout, out_dtype, options, s, layout_key(A), layout_key(B), layout_key(O), O.readonly,
                    offs_key)
        self.invoke(device_state(self.name, A.device), call)
        return result

    def validate(self, ctx, call):
        require_gemm_device(self.what, call.A.device)
        o = checked_once(call.options)
        if o.config is not None and CONFIGS[o.config].cluster > 1:
            raise ValueError(f"{self.what}: config {o.config} runs in clusters of blocks; grouped problems "
                             "do not (choose another config)")
        if o.splits is not None or o.swap is not None:
            raise ValueError(f"{self.what}: splits and swap apply to plain GEMMs only")
        D = call.offsets
        if D is not None:
            if D.dtype.name not in ("int64", "int32"):
                raise TypeError(f"{self.what}: device group_offsets must be int64 or int32, got {D.dtype.name}")
            if tuple(D.shape) != (call.G + 1,) or (call.G + 1 > 1 and D.strides[0] != 1):
                raise ValueError(f"{self.what}: device group_offsets must be a contiguous [{call.G + 1}] array")
            check_device([call.A, D], ["a", "group_offsets"])
        check_device([call.A, call.B, call.O], ["a", "b", "out"])
        if self.swiglu:
            self._validate_swiglu(call, o)
        prepare_out(call.O, call.out_dtype, call.A.dtype.name, (call.M, call.N // 2 if self.swiglu else call.N),
                    call.A.device)
        if call.O.readonly:
            raise ValueError(f"{self.what}: out is read-only memory but the op writes it")

    def _validate_swiglu(self, call, o) -> None:
        F2, dt = call.N, call.A.dtype.name
        cands = swiglu_candidates(F2 // 2) if F2 % 2 == 0 else ()
        if not cands:
            widths = sorted({pair_width(c) for c in SWIGLU_CONFIGS})
            raise ValueError(f"{self.what}: F = {F2 / 2:g} (b is [G, 2F, K]) must be a multiple of a tile "
                             f"config's pair width ({widths})")
        if o.config is not None and o.config not in cands:
            raise ValueError(f"{self.what}: config {o.config} cannot pair gate and up columns at F = {F2 // 2} "
                             f"(configs that can: {cands})")
        if call.O.dtype.name != dt:
            raise TypeError(f"{self.what}: out must be a's dtype ({dt}), got {call.O.dtype.name}")

    def describe_call(self, call):
        return (f"T={call.M} N={call.N} K={call.K} G={call.G} {call.A.dtype.name} -> {call.O.dtype.name} "
                f"b_layout={call.b_layout}")

    def plan(self, ctx, call, digest):
        return None

    def bind(self, ctx, call, plan):
        with on_device(call.A.device):
            return bind_grouped(call.A, call.B, call.O, call.M, call.N, call.K, call.G, call.host_offs,
                                call.offsets, call.b_layout, call.options, call.stream, self.swiglu)


class _GroupedSwiGLU(_Grouped):
    name = "grouped_gemm_swiglu"
    what = "mkernel.ops.gemm.grouped_gemm_swiglu"
    swiglu = True


_GEMM = _Gemm()
_GROUPED = _Grouped()
_GROUPED_SWIGLU = _GroupedSwiGLU()


def gemm(a, b, out=None, *, b_layout: str = "kn", out_dtype: str | None = None, stream=None,
         config: int | None = None, splits: int | None = None, swap: bool | None = None,
         options: GemmOptions | None = None):
    """``out[M, N] = a[M, K] @ b`` (``b`` is ``[K, N]`` for ``b_layout="kn"``, ``[N, K]`` for "nk").

    a, b: bf16 or fp16 (same dtype), 2-D, on one device, any strides (staged if TMA cannot read them in
    place, see module doc).  out: ``[M, N]`` bf16/fp16/fp32 with unit column stride, not overlapping a or b;
    or None to allocate a :class:`~mkernel.DeviceArray` of ``out_dtype`` (default a's dtype).  stream: any
    stream-like object or raw handle (None: the legacy default stream, not the framework's current one).
    options: a :class:`GemmOptions` (None: the defaults); ``config`` (a tile config id), ``splits`` (the
    split-K factor on every tile) and ``swap`` (compute a B "nk" call transposed, ``C^T = B A^T``: True,
    or never: False) override its fields.  Returns ``out``.  Asynchronous with respect to the host.
    """
    return _GEMM(a, b, out, b_layout, out_dtype, stream, _options(options, config, splits, swap, "mkernel.gemm"))


def grouped_gemm(a, b, group_offsets, out=None, *, b_layout: str = "kn", out_dtype: str | None = None,
                 stream=None, config: int | None = None, options: GemmOptions | None = None):
    """Grouped GEMM: ``out[o[g]:o[g+1]] = a[o[g]:o[g+1]] @ b[g]`` for g in range(G).

    a: ``[T, K]`` (T = total rows, e.g. tokens sorted by expert).  b: ``[G, K, N]`` ("kn") or
    ``[G, N, K]`` ("nk").  group_offsets o: G+1 nondecreasing row offsets with 0 <= o[0] and
    o[G] <= T; a host sequence (validated, uploaded once per distinct value) or a device array of
    int64/int32 (never read on the host: no synchronization; the kernel clamps every group to [0, T)).
    Groups may be empty; rows of out outside [o[0], o[G]) are not written.  out: ``[T, N]`` or None
    (allocated, dtype ``out_dtype`` or a's).  Returns out.
    """
    return _GROUPED(a, b, group_offsets, out, b_layout, out_dtype, stream,
                    _options(options, config, None, None, "mkernel.grouped_gemm"))


def grouped_gemm_swiglu(a, b, group_offsets, out=None, *, stream=None, config: int | None = None,
                        options: GemmOptions | None = None):
    """The gate/up grouped GEMM with SwiGLU in its epilogue: ``out[o[g]:o[g+1]] = silu(h[:, :F]) * h[:, F:]``
    with ``h = a[o[g]:o[g+1]] @ b[g].T``, h never written (docs/moe.md, "SwiGLU epilogue").

    b: ``[G, 2F, K]`` (gate rows ``[0, F)``, up rows ``[F, 2F)``, as :func:`mkernel.moe_layer` takes them); F a
    multiple of a tile config's pair width (``swiglu.swiglu_candidates``; 64 suits every F that is a multiple
    of 64), else ValueError.  out: ``[T, F]`` of a's dtype (or None: allocated).  a, group_offsets, stream,
    config, options: as :func:`grouped_gemm`.  fp32 accumulation and SwiGLU math, one rounding to out's
    dtype.  Returns out."""
    return _GROUPED_SWIGLU(a, b, group_offsets, out, "nk", None, stream,
                           _options(options, config, None, None, "mkernel.ops.gemm.grouped_gemm_swiglu"))


def last_plan(op: str = "gemm", device: int | None = None):
    """The plan (:class:`~mkernel.ops.gemm.plan.GemmPlan`) of the latest ``op`` ("gemm", "grouped_gemm" or
    "grouped_gemm_swiglu") call on ``device`` (None: the current one)."""
    if device is None:
        with on_device(None) as (_, device):
            pass
    return device_state(op, device).last_plan


def precompile(specs=None, *, arch: str | None = None, workers: int | None = None) -> float:
    """Compile GEMM specializations into the disk cache in parallel worker processes.

    specs: iterable of define dicts (default: every registered gemm.cu specialization, configs.defines).
    Returns the summed NVRTC seconds.  Later ``compile_module`` calls of this process load the cubins from
    disk.
    """
    return precompile_source(SOURCE, specs, arch=arch, workers=workers)
