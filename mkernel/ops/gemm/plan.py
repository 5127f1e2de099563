"""GEMM plans bound to launches: everything one call launches (compiled kernel, grid, tensor maps, packed
arguments, staging and split-K buffers), built on the first call of a layout (the op pipeline's bind,
mkernel/ops/base.py) and re-pointed at each later call's arrays; and ``describe`` (what a call would
launch).  A bound call's buffers serve calls on its one stream only (the stream is in the key).
docs/gemm.md, "Operand staging".
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import numpy as np

from ...core.arrays import DeviceArray
from ...core.compiler import compile_module
from ...core.device import on_device as _on_device
from . import gemv, kernels
from .bound import GemmBound, GemmPlan
from .configs import CONFIGS, GROUP_M, GROUPED_CANDIDATES, SOURCE, TileConfig, defines
from .options import GemmOptions
from .heuristic import (choose_config, grid_size, misaligned_rows, orient_and_plan, pdl_auto, scheduler_units,
                        tile_count, use_pdl)
from .operands import (ClearBeforeFirstUse, a_arg, b_arg, c_arg, gate_up_arg, row_misaligned, split_workspace,
                       vec_ok, zero_fill_launch)
from .swiglu import KERNEL as SWIGLU_KERNEL, swiglu_candidates

__all__ = ["GemmArgs", "GemmPlan", "GemmBound", "bind_gemm", "bind_grouped", "describe"]


class GemmArgs(ctypes.Structure):
    """Mirror of MkGemmArgs in cuda_src/gemm/gemm.cu (80 bytes)."""

    _fields_ = [
        ("c", ctypes.c_void_p),
        ("group_offsets", ctypes.c_void_p),
        ("ldc", ctypes.c_int64),
        ("M", ctypes.c_int32),
        ("N", ctypes.c_int32),
        ("K", ctypes.c_int32),
        ("num_groups", ctypes.c_int32),
        ("group_m", ctypes.c_int32),
        ("c_vec_ok", ctypes.c_int32),
        ("offsets_i32", ctypes.c_int32),
        ("c_tma", ctypes.c_int32),
        ("partials", ctypes.c_void_p),
        ("counters", ctypes.c_void_p),
        ("splits", ctypes.c_int32),
        ("split_from", ctypes.c_int32),
    ]


assert ctypes.sizeof(GemmArgs) == 80


def _prepare_all(launches, stream: int) -> list:
    """Prepared launches of ``(kernel, grid, block, args)`` tuples on ``stream``."""
    return [k.prepare(g, b, a, stream=stream) for k, g, b, a in launches]


def bind_gemm(A, B, O, M, N, K, b_layout, options, stream: int) -> GemmBound:
    """The bound call of ``O[M, N] = A @ B`` (B ``[K, N]`` "kn" / ``[N, K]`` "nk") for arrays of these layouts,
    on ``stream``: the heuristic's plan (options: GemmOptions), its launches prepared."""
    in_dtype, out_dtype, dev = A.dtype.name, O.dtype.name, A.device
    ldc = O.strides[0] if M > 1 else N
    sms = kernels.num_sms(dev)
    if K == 0:
        fill = zero_fill_launch(O, M, N, ldc, in_dtype, dev)
        dst = fill[3][0]

        def set_fill(call):
            dst.value = call.O.ptr
        return GemmBound(GemmPlan("fill"), _prepare_all([fill], stream), None, None, None, set_fill, [])
    mis = (row_misaligned(A, M, K), row_misaligned(B, *((K, N) if b_layout == "kn" else (N, K))))
    gemv_ok = options.gemv and gemv.supported(A, B, M, N, K, b_layout) and gemv.worthwhile(N, sms)
    choice = orient_and_plan(M, N, K, b_layout, sms, options, mis, gemv_ok)
    if choice is None:  # decode-shaped (M <= 16): a stream of B
        return gemv.bind(A, B, O, M, N, K, stream, use_pdl(True, options.pdl))
    swap, cfg, sp, split_from = choice
    # the kernel's problem: M x N x K of A [M, K] and B, or swapped N x M x K of B [N, K] and A ("nk")
    KA, KB, KM, KN = (B, A, N, M) if swap else (A, B, M, N)
    a = a_arg(KA, KM, K, cfg, in_dtype, out_dtype, dev)
    b = b_arg(KB, K, KN, b_layout, cfg, in_dtype, out_dtype, dev)
    keep = a.keep + b.keep
    if swap:  # stored transposed from registers (no C map: any valid map goes in its place)
        tmc, c_tma, vec = None, 0, 0
    else:
        tmc, c_tma = c_arg(O, M, N, ldc, cfg, options.epilogue)
        vec = vec_ok(O, ldc, M)
    args = GemmArgs(O.ptr, None, ldc, KM, KN, K, 1, GROUP_M, vec, 0, c_tma)
    tiles = tile_count(cfg, KM, KN, b_layout)
    clears = ()
    if sp > 1:  # split-K workspace: fp32 running sums and counters per split tile (zero; the kernel keeps them so)
        ws, partials, counters = split_workspace(tiles - split_from, cfg.bm * cfg.tile_n(b_layout), dev)
        keep.append(ws)
        clears = (ClearBeforeFirstUse(ws.ptr, ws.size),)
        args.partials, args.counters, args.splits, args.split_from = partials, counters, sp, split_from
    else:
        args.splits, args.split_from, split_from = 1, tiles, tiles
    kernel = kernels.get(in_dtype, out_dtype, cfg.id, f"mk_gemm_{b_layout}", swap)
    grid = grid_size(cfg, scheduler_units(tiles, sp, split_from), sms)
    if cfg.cluster > 1:  # no more clusters than fit at once (a GPC's SMs may not all group up)
        fit = kernel.max_active_clusters(grid, cfg.threads, cfg.smem, cfg.cluster)
        grid = max(cfg.cluster, min(grid, fit * cfg.cluster))
    # swapped plans in clusters launch without PDL (9008x248x5752 on config 48: 63.6 us with, 57.0 without;
    # docs/journal/gemm.md entry 66)
    dependent = use_pdl(pdl_auto(KM, KN, K, cfg=cfg, blocks=grid, sms=sms) and not (swap and cfg.cluster > 1),
                        options.pdl)
    launch = kernel.prepare(grid, cfg.threads, [a.map.buf, b.map.buf, (tmc or a.map).buf, args], stream=stream,
                            smem=cfg.smem, cluster=(cfg.cluster, 1, 1) if cfg.cluster > 1 else None,
                            dependent=dependent)
    pre = _prepare_all([op.stage for op in (a, b) if op.stage is not None], stream)
    staged = tuple(n for n, op in (("a", a), ("b", b)) if op.stage is not None)
    plan = GemmPlan("tiles", cfg.id, swap, sp, split_from, grid, dependent, staged)

    def set_out(call):
        O2 = call.O
        args.c = O2.ptr
        if tmc is not None:
            tmc.point(O2.ptr)
    return GemmBound(plan, pre, launch, a, b, set_out, keep, clears)


def bind_grouped(A, B, O, T, N, K, G, host_offs, dev_offs, b_layout, options, stream: int,
                 swiglu: bool = False) -> GemmBound:
    """The bound call of a grouped GEMM (api.grouped_gemm) with host offsets ``host_offs`` (uploaded here) or
    device offsets ``dev_offs`` (re-pointed per call).  ``swiglu`` (api.grouped_gemm_swiglu): B is a gate/up
    weight ``[G, N, K]`` (N = 2F) and O the act ``[T, N / 2]``."""
    in_dtype, out_dtype, dev = A.dtype.name, O.dtype.name, A.device
    n_out = N // 2 if swiglu else N  # columns of O
    ldc = O.strides[0] if T > 1 else n_out
    sms = kernels.num_sms(dev)
    keep = []
    if host_offs is not None:
        sizes = np.diff(host_offs)

        def tiles_of(c):
            return int(np.sum((sizes + c.bm - 1) // c.bm)) * math.ceil(N / c.tile_n(b_layout))

        offs_buf = DeviceArray.from_numpy(host_offs.astype(np.int64))
        keep.append(offs_buf)
        offs_ptr, offs_i32 = offs_buf.ptr, 0
    else:
        def tiles_of(c):  # upper bound without reading the offsets
            return (math.ceil(T / c.bm) + G) * math.ceil(N / c.tile_n(b_layout))

        offs_ptr, offs_i32 = dev_offs.ptr, int(dev_offs.dtype.name == "int32")
    if K == 0:
        # rows [o[0], o[G]) must become zero; without host offsets every row is zeroed (documented)
        r0, r1 = (int(host_offs[0]), int(host_offs[-1])) if host_offs is not None else (0, T)
        if r1 <= r0:
            return GemmBound(GemmPlan("empty"), [], None, None, None, lambda call: None, keep)
        row0 = r0 * ldc * O.dtype.itemsize
        fill = zero_fill_launch(_Sub(O.ptr + row0, O.dtype), r1 - r0, n_out, ldc, in_dtype, dev)
        dst = fill[3][0]

        def set_fill(call):
            dst.value = call.O.ptr + row0
        return GemmBound(GemmPlan("fill"), _prepare_all([fill], stream), None, None, None, set_fill, keep)
    cfg = CONFIGS[options.config] if options.config is not None else choose_config(
        tiles_of, sms, k=K, layout=b_layout, candidates=swiglu_candidates(n_out) if swiglu else GROUPED_CANDIDATES,
        allowed=options.candidates)
    a = a_arg(A, T, K, cfg, in_dtype, out_dtype, dev)
    b = (gate_up_arg(B, K, n_out, cfg, in_dtype, out_dtype, dev) if swiglu else
         b_arg(B, K, N, b_layout, cfg, in_dtype, out_dtype, dev))
    keep += a.keep + b.keep
    tmc, c_tma = c_arg(O, T, n_out, ldc, cfg, options.epilogue)
    args = GemmArgs(O.ptr, offs_ptr, ldc, T, N, K, G, GROUP_M, vec_ok(O, ldc, T), offs_i32, c_tma, None, None, 1, 0)
    grid = grid_size(cfg, tiles_of(cfg), sms)
    kernel = kernels.get(in_dtype, out_dtype, cfg.id, SWIGLU_KERNEL if swiglu else f"mk_grouped_gemm_{b_layout}")
    dependent = use_pdl(pdl_auto(T, N, K, G, cfg), options.pdl)
    launch = kernel.prepare(grid, cfg.threads, [a.map.buf, b.map.buf, (tmc or a.map).buf, args], stream=stream,
                            smem=cfg.smem, dependent=dependent)
    pre = _prepare_all([op.stage for op in (a, b) if op.stage is not None], stream)
    staged = tuple(n for n, op in (("a", a), ("b", b)) if op.stage is not None)

    def set_ptrs(call):
        args.c = call.O.ptr
        if tmc is not None:
            tmc.point(call.O.ptr)
        if dev_offs is not None:
            args.group_offsets = call.offsets.ptr
    return GemmBound(GemmPlan("tiles", cfg.id, False, 1, 0, grid, dependent, staged), pre, launch, a, b, set_ptrs,
                     keep)


@dataclass
class _Sub:
    """A bare (ptr, dtype) view for the zero-fill launch."""

    ptr: int
    dtype: object


def describe(M: int, N: int, K: int, *, in_dtype: str = "bfloat16", out_dtype: str | None = None,
             b_layout: str = "kn", config: int | None = None, device: int | None = None, options=None) -> dict:
    """What ``gemm`` would launch for this shape (dense operands): config, tile, split-K factor, grid, threads,
    shared memory, registers per thread (ptxas, or the driver: kernels.usage), spilled bytes (None without a
    ptxas report), the NVRTC compile time of the module (0 if it came from cache) and whether it is computed
    transposed (``swapped``: the tile, tiles and grid are then the N x M x K problem's)."""
    out_dtype = out_dtype or in_dtype
    with _on_device(device) as (_, dev):
        sms = kernels.num_sms(dev)
        opts = (options or GemmOptions.default()).with_forced(config=config)
        gemv_ok = opts.gemv and gemv.shape_ok(M, N, K, b_layout) and gemv.worthwhile(N, sms)
        choice = orient_and_plan(M, N, K, b_layout, sms, opts, misaligned_rows(M, N, K, b_layout), gemv_ok)
        if choice is None:
            return gemv.describe(M, N, K, in_dtype, out_dtype)  # (aligned, contiguous operands assumed)
        swapped, cfg, sp, sf = choice
        if swapped:
            M, N = N, M
        mod = compile_module(SOURCE, defines(in_dtype, out_dtype, cfg.id, swapped))
        usage = kernels.usage(mod, f"mk_gemm_{b_layout}")
    tiles = tile_count(cfg, M, N, b_layout)
    return dict(config=cfg.id, swapped=swapped, bm=cfg.bm, bn=cfg.tile_n(b_layout), stages=cfg.stages,
                threads=cfg.threads, smem=cfg.smem, pingpong=cfg.pingpong, tma_store=cfg.tma_store, splits=sp,
                split_tiles=(tiles - sf) if sp > 1 else 0,
                registers=usage.get("registers"),
                spills=usage["spill_stores"] + usage["spill_loads"] if "spill_stores" in usage else None,
                compile_seconds=mod.compile_seconds, cached=mod.cached, tiles=tiles,
                grid=grid_size(cfg, scheduler_units(tiles, sp, sf), sms))
