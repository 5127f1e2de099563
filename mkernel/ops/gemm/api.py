"""GEMM and grouped GEMM on Hopper (TMA + wgmma, warp-specialized, persistent): ``cuda_src/gemm/gemm.cu``.

``gemm(a, b)``: ``C[M, N] = A[M, K] @ B`` with A row-major ``[M, K]`` and B either row-major ``[K, N]``
(``b_layout="kn"``) or ``[N, K]`` (``b_layout="nk"``, weights as frameworks store them, i.e. ``C = A @ B.T``).
``grouped_gemm(a, b, group_offsets)``: for every group g, ``C[o[g]:o[g+1]] = A[o[g]:o[g+1]] @ B[g]`` with B
``[G, K, N]`` ("kn") or ``[G, N, K]`` ("nk") (MoE experts; groups may be empty and uneven).

Inputs are bf16 or fp16 (A and B alike), accumulation is fp32, the output is bf16, fp16 or fp32 (default:
the input dtype; pass ``out=`` or ``out_dtype=``).  Arrays are anything with ``__cuda_array_interface__`` or
DLPack on the current device.  Any M, N, K works: tiles at the edges are masked (TMA zero-fills
out-of-bounds loads, the epilogue masks stores); K == 0 writes zeros.

TMA needs 16-byte-aligned base addresses and row strides.  An operand that violates this (e.g. K = 7 for
row-major A, N odd for a "kn" B, a misaligned view, a non-unit inner stride) is first staged on the device
into a dense zero-padded copy (one extra pass over that operand), so every shape works; aligned operands are
read in place.  The output needs a unit column stride (any row stride): with a 16-byte aligned base and row
stride it is written through shared memory and TMA stores, otherwise with masked stores from registers.

Few output tiles (small M or N): K is split; every split adds its fp32 partial into one running sum per
tile and the tile's last split to finish stores it, in the same kernel; with a partial last wave only its
tiles may be split.  Each call's launch is a cached plan (plan.py).
"""
from __future__ import annotations

import numpy as np

from ...core.compiler import precompile_source
from ...core.device import on_device as _on_device
from ...core.interop import as_device_array
from ...core.streams import stream_handle
from .configs import CONFIGS, SOURCE, settings_key
from .operands import array_key, check_device, check_operands, out_layout_key, prepare_out
from .plan import cached_plan, plan_gemm, plan_grouped

__all__ = ["gemm", "grouped_gemm", "precompile"]


def gemm(a, b, out=None, *, b_layout: str = "kn", out_dtype: str | None = None, stream=None,
         config: int | None = None, splits: int | None = None, swap: bool | None = None):
    """``out[M, N] = a[M, K] @ b`` (``b`` is ``[K, N]`` for ``b_layout="kn"``, ``[N, K]`` for "nk").

    a, b: bf16 or fp16 (same dtype), 2-D, on the current device, any strides (staged if TMA cannot
    read them in place, see module doc).  out: ``[M, N]`` bf16/fp16/fp32 with unit column stride, or
    None to allocate one of ``out_dtype`` (default a's dtype).  stream: any stream-like object (None:
    the legacy default stream).  config: force a tile config id (``CONFIGS``; debugging and
    benchmarks).  splits: force the split-K factor (1 = none; clamped to what the config allows,
    ``max_splits``); by default the heuristic splits K when the output tiles cannot fill the SMs (the
    splits of a tile add into one fp32 sum, the last to finish stores it, in the same kernel).  swap:
    force (True) or forbid (False) computing B "nk" calls transposed, ``C^T = B A^T`` (the kernel's tiles
    run along B's rows, A's few rows as their columns; stored transposed); None: the heuristic.  Returns
    ``out``.  Asynchronous with respect to the host.
    """
    A, B, M, K, N, _ = check_operands(a, b, b_layout, what="mkernel.gemm", stream=stream)
    in_dtype = A.dtype.name
    O_in = None if out is None else as_device_array(out, name="gemm: out", stream=stream)
    if config is not None and config not in CONFIGS:
        raise ValueError(f"mkernel.gemm: unknown config {config}; known: {sorted(CONFIGS)}")
    if swap and b_layout != "nk":
        raise ValueError('mkernel.gemm: swap=True needs b_layout="nk" (B [N, K] as the transposed '
                         "problem's K-major A operand)")
    if swap and config is not None and CONFIGS[config].pingpong:
        raise ValueError(f"mkernel.gemm: config {config} (ping-pong) has no swapped kernel")
    dev = check_device([A, B] + ([O_in] if O_in is not None else []), ["a", "b", "out"])
    with _on_device(dev):
        O = prepare_out(O_in, out_dtype, in_dtype, (M, N), dev)
        if M == 0 or N == 0:
            return out if out is not None else O
        # One plan per (operands, output layout, stream), its launch re-pointed at each call's output:
        # a fresh output every call (out=None) or a rotating set of buffers must not cost a new plan
        # (tensor maps, split-K workspace, LRU eviction freeing memory) per call.  Per stream: a plan's
        # workspace is never used by two calls that may run concurrently.
        okey = out_layout_key(O) if K > 0 else array_key(O)  # K = 0: the plan is a fill of O itself
        key = ("gemm", dev, b_layout, config, splits, swap, settings_key(), array_key(A), array_key(B), okey,
               stream_handle(stream))
        plan = cached_plan(key, lambda: plan_gemm(A, B, O, M, N, K, in_dtype, b_layout, dev, config, splits, swap))
        plan.run(stream, out=O)
    return out if out is not None else O


def _is_host_sequence(x) -> bool:
    return isinstance(x, (list, tuple, np.ndarray))


def grouped_gemm(a, b, group_offsets, out=None, *, b_layout: str = "kn", out_dtype: str | None = None,
                 stream=None, config: int | None = None):
    """Grouped GEMM: ``out[o[g]:o[g+1]] = a[o[g]:o[g+1]] @ b[g]`` for g in range(G).

    a: ``[T, K]`` (T = total rows, e.g. tokens sorted by expert).  b: ``[G, K, N]`` ("kn") or
    ``[G, N, K]`` ("nk").  group_offsets o: G+1 nondecreasing row offsets with 0 <= o[0] and
    o[G] <= T; a host sequence (validated, uploaded once per distinct value) or a device array of
    int64/int32 (trusted, never read on the host: no synchronization).  Groups may be empty; rows of
    out outside [o[0], o[G]) are not written.  out: ``[T, N]`` or None (allocated, dtype ``out_dtype``
    or a's).  Returns out.
    """
    A, B, T, K, N, G = check_operands(a, b, b_layout, what="mkernel.grouped_gemm", grouped=True, stream=stream)
    in_dtype = A.dtype.name
    O_in = None if out is None else as_device_array(out, name="grouped_gemm: out", stream=stream)
    dev = check_device([A, B] + ([O_in] if O_in is not None else []), ["a", "b", "out"])
    host_offs = None
    dev_offs = None
    if _is_host_sequence(group_offsets):
        host_offs = np.asarray(group_offsets, dtype=np.int64).reshape(-1)
        if host_offs.shape[0] != G + 1:
            raise ValueError(f"mkernel.grouped_gemm: group_offsets has {host_offs.shape[0]} entries; b has G={G} "
                             f"groups, so G+1={G + 1} are needed")
        if G and (host_offs[0] < 0 or host_offs[-1] > T or np.any(np.diff(host_offs) < 0)):
            raise ValueError(f"mkernel.grouped_gemm: group_offsets must be nondecreasing within [0, {T}]")
        offs_key = ("host", host_offs.tobytes())
    else:
        D = dev_offs = as_device_array(group_offsets, name="grouped_gemm: group_offsets", stream=stream)
        if D.dtype.name not in ("int64", "int32"):
            raise TypeError(f"mkernel.grouped_gemm: device group_offsets must be int64 or int32, got {D.dtype.name}")
        if tuple(D.shape) != (G + 1,) or (G + 1 > 1 and D.strides[0] != 1):
            raise ValueError(f"mkernel.grouped_gemm: device group_offsets must be a contiguous [{G + 1}] array")
        check_device([A, D], ["a", "group_offsets"])
        offs_key = ("dev", D.ptr, D.dtype.name)
    if config is not None and config not in CONFIGS:
        raise ValueError(f"mkernel.grouped_gemm: unknown config {config}; known: {sorted(CONFIGS)}")
    if config is not None and CONFIGS[config].cluster > 1:
        raise ValueError(f"mkernel.grouped_gemm: config {config} runs in clusters of blocks; grouped problems "
                         "do not (choose another config)")
    with _on_device(dev):
        O = prepare_out(O_in, out_dtype, in_dtype, (T, N), dev)
        if T == 0 or N == 0 or G == 0:
            return out if out is not None else O
        key = ("grouped", dev, b_layout, config, settings_key(), array_key(A), array_key(B), array_key(O), offs_key)
        plan = cached_plan(key, lambda: plan_grouped(A, B, O, T, N, K, G, host_offs, dev_offs, in_dtype,
                                                     b_layout, dev, config))
        plan.run(stream)
    return out if out is not None else O


def precompile(specs=None, *, arch: str | None = None, workers: int | None = None) -> float:
    """Compile GEMM specializations into the disk cache in parallel worker processes.

    specs: iterable of define dicts (default: every registered gemm.cu specialization, configs.defines).
    Returns the summed NVRTC seconds.  Later ``compile_module`` calls of this process load the cubins from
    disk.
    """
    return precompile_source(SOURCE, specs, arch=arch, workers=workers)
