"""GEMM plans: everything one call launches (compiled kernel, grid, tensor maps, packed arguments, staging
and split-K buffers), built once per shape and cached, and ``describe`` (what a call would launch).

A plan is cached in a bounded LRU keyed by the operands' pointers, shapes, strides and dtypes, the output's
layout (not its address: another output of that layout re-points the launch), the overrides and the
stream, so a repeated call re-encodes nothing.  Its buffers serve calls on that one stream only.  A plan
with buffers that runs while its stream is captured into a CUDA graph is kept for the life of the process
(the graph replays its buffers even after the LRU evicts the plan).  docs/gemm.md, "Operand staging".
"""
from __future__ import annotations

import ctypes
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ...core.arrays import DeviceArray
from ...core.compiler import compile_module
from ...core.device import on_device as _on_device
from ...core.streams import is_capturing
from . import gemv, kernels
from .configs import CONFIGS, GROUP_M, GROUPED_CANDIDATES, SOURCE, TileConfig, defines
from .heuristic import (choose_config, grid_size, misaligned_rows, orient_and_plan, pdl_auto, scheduler_units,
                        tile_count, use_pdl)
from .operands import (ClearBeforeFirstUse, a_operand, b_operand, c_map, point_out, row_misaligned,
                       split_workspace, vec_ok, zero_fill_launch)

__all__ = ["GemmArgs", "Plan", "cached_plan", "plan_gemm", "plan_grouped", "describe"]


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


@dataclass
class Plan:
    cfg: TileConfig
    kernel: object
    grid: int
    args: list
    pre: list  # staging launches: (kernel, grid, block, args)
    keep: list  # device buffers the launches use
    splits: int = 1  # split-K factor of the split tiles (plain GEMM)
    split_from: int = 0  # tiles before this one (rasterized order) are not split
    pinned: bool = False  # captured into a CUDA graph: never freed (see run)
    zero: ClearBeforeFirstUse | None = None  # split-K sums and counters
    with_out: object = None  # plain GEMM: O -> the launch arguments for another output of the same layout
    dependent: bool = False  # a programmatic dependent launch (heuristic.use_pdl)
    swapped: bool = False  # plain GEMM computed transposed (C^T = B A^T)

    def run(self, stream, out=None):
        if self.keep and (not self.pinned or (self.zero is not None and self.zero.pending)):
            capturing = is_capturing(stream)
            if capturing and not self.pinned:
                # a graph replays this plan's buffers long after the LRU may have evicted the plan
                self.pinned = True
                with _plans_lock:
                    _pinned.append(self)
            if self.zero is not None:
                self.zero(stream, capturing)
        for k, g, b, a in self.pre:
            k.launch(g, b, a, stream=stream)
        if self.kernel is not None:
            args = self.args if out is None or self.with_out is None else self.with_out(out)
            self.kernel.launch(self.grid, self.cfg.threads, args, stream=stream, smem=self.cfg.smem,
                               cluster=(self.cfg.cluster, 1, 1) if self.cfg.cluster > 1 else None,
                               dependent=self.dependent)


_plans: "OrderedDict[tuple, Plan]" = OrderedDict()
_plans_lock = threading.Lock()
_PLANS_MAX = 64
_pinned: list = []  # plans with buffers that were captured into a CUDA graph (kept for the process's life)


def cached_plan(key, build):
    """The plan of ``key`` from the LRU, else ``build()``'s (then cached)."""
    with _plans_lock:
        p = _plans.get(key)
        if p is not None:
            _plans.move_to_end(key)
            return p
    p = build()
    with _plans_lock:
        _plans[key] = p
        while len(_plans) > _PLANS_MAX:
            _plans.popitem(last=False)
    return p


def plan_gemm(A, B, O, M, N, K, in_dtype, b_layout, dev, config, splits=None, swap=None):
    """The plan of ``O[M, N] = A @ B`` (a Plan, or gemv.Plan for a decode-shaped call)."""
    out_dtype = O.dtype.name
    ldc = O.strides[0] if M > 1 else N
    sms = kernels.num_sms(dev)
    if K == 0:
        pre = [zero_fill_launch(O, M, N, ldc, in_dtype, dev)]
        return Plan(CONFIGS[1], None, 0, [], pre, [])
    mis = (row_misaligned(A, M, K), row_misaligned(B, *((K, N) if b_layout == "kn" else (N, K))))
    gemv_ok = gemv.supported(A, B, M, N, K, b_layout) and gemv.worthwhile(N, sms)
    choice = orient_and_plan(M, N, K, b_layout, sms, config, splits, swap, mis, gemv_ok)
    if choice is None:  # decode-shaped (M <= 16): a stream of B
        return gemv.plan(A, B, O, M, N, K)
    swap, cfg, sp, split_from = choice
    # the kernel's problem: M x N x K of A [M, K] and B, or swapped N x M x K of B [N, K] and A ("nk")
    KA, KB, KM, KN = (B, A, N, M) if swap else (A, B, M, N)
    tma, pre, keep = a_operand(KA, KM, K, cfg, in_dtype, out_dtype, dev)
    tmb, pre_b, keep_b = b_operand(KB, K, KN, b_layout, cfg, in_dtype, out_dtype, dev)
    pre, keep = pre + pre_b, keep + keep_b
    if swap:  # stored transposed from registers (no C map: any valid map goes in its place)
        tmc, c_tma, vec = tma, 0, 0
    else:
        tmc, c_tma = c_map(O, M, N, ldc, cfg, tma)
        vec = vec_ok(O, ldc, M)
    args = GemmArgs(O.ptr, None, ldc, KM, KN, K, 1, GROUP_M, vec, 0, c_tma)
    tiles = tile_count(cfg, KM, KN, b_layout)
    if sp > 1:  # split-K workspace: fp32 running sums and counters per split tile (zero; the kernel keeps them so)
        n_split = tiles - split_from
        ws, partials, counters = split_workspace(n_split, cfg.bm * cfg.tile_n(b_layout), dev)
        keep += [ws]
        args.partials, args.counters, args.splits, args.split_from = partials, counters, sp, split_from
    else:
        args.splits, args.split_from, split_from = 1, tiles, tiles
    maps = [tma, tmb, tmc]
    kernel = kernels.get(in_dtype, out_dtype, cfg.id, f"mk_gemm_{b_layout}", swap)
    grid = grid_size(cfg, scheduler_units(tiles, sp, split_from), sms)
    if cfg.cluster > 1:  # no more clusters than fit at once (a GPC's SMs may not all group up)
        fit = kernel.max_active_clusters(grid, cfg.threads, cfg.smem, cfg.cluster)
        grid = max(cfg.cluster, min(grid, fit * cfg.cluster))
    # swapped plans in clusters launch without PDL (9008x248x5752 on config 48: 63.6 us with, 57.0 without;
    # docs/journal/gemm.md entry 66)
    dependent = use_pdl(pdl_auto(KM, KN, K, cfg=cfg, blocks=grid, sms=sms) and not (swap and cfg.cluster > 1))
    plan = Plan(cfg, kernel, grid, [*maps, args], pre, keep, sp, split_from, dependent=dependent, swapped=swap)
    if sp > 1:
        plan.zero = ClearBeforeFirstUse(ws.ptr, ws.size)

    o_ptr = O.ptr  # not O: a cached plan must not keep the caller's output alive

    def with_out(O2: DeviceArray) -> list:
        """The launch arguments for output O2 (same shape, dtype and strides as O; any base address)."""
        if O2.ptr == o_ptr:
            return plan.args
        a2 = GemmArgs.from_buffer_copy(args)
        if swap:
            a2.c = O2.ptr
            return [tma, tmb, tmc, a2]
        return [tma, tmb, point_out(a2, O2, M, N, ldc, cfg, tma), a2]
    plan.with_out = with_out
    return plan


@dataclass
class _Sub:
    """A bare (ptr, dtype) view for the zero-fill launch."""

    ptr: int
    dtype: object


def plan_grouped(A, B, O, T, N, K, G, host_offs, dev_offs, in_dtype, b_layout, dev, config) -> Plan:
    """The plan of a grouped GEMM (api.grouped_gemm) with host offsets ``host_offs`` or device offsets
    ``dev_offs``."""
    out_dtype = O.dtype.name
    ldc = O.strides[0] if T > 1 else N
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
        if host_offs is not None:
            r0, r1 = int(host_offs[0]), int(host_offs[-1])
        else:
            r0, r1 = 0, T
        pre = []
        if r1 > r0:
            sub = _Sub(O.ptr + r0 * ldc * O.dtype.itemsize, O.dtype)
            pre = [zero_fill_launch(sub, r1 - r0, N, ldc, in_dtype, dev)]
        return Plan(CONFIGS[1], None, 0, [], pre, keep)
    cfg = CONFIGS[config] if config is not None else choose_config(
        tiles_of, sms, k=K, layout=b_layout, candidates=GROUPED_CANDIDATES)
    tma, pre, keep_a = a_operand(A, T, K, cfg, in_dtype, out_dtype, dev)
    tmb, pre_b, keep_b = b_operand(B, K, N, b_layout, cfg, in_dtype, out_dtype, dev)
    pre, keep = pre + pre_b, keep + keep_a + keep_b
    tmc, c_tma = c_map(O, T, N, ldc, cfg, tma)
    args = GemmArgs(O.ptr, offs_ptr, ldc, T, N, K, G, GROUP_M, vec_ok(O, ldc, T), offs_i32, c_tma, None, None, 1, 0)
    maps = [tma, tmb, tmc]
    grid = grid_size(cfg, tiles_of(cfg), sms)
    kernel = kernels.get(in_dtype, out_dtype, cfg.id, f"mk_grouped_gemm_{b_layout}")
    return Plan(cfg, kernel, grid, [*maps, args], pre, keep, dependent=use_pdl(pdl_auto(T, N, K, G, cfg)))


def describe(M: int, N: int, K: int, *, in_dtype: str = "bfloat16", out_dtype: str | None = None,
             b_layout: str = "kn", config: int | None = None, device: int | None = None) -> dict:
    """What ``gemm`` would launch for this shape (dense operands): config, tile, split-K factor, grid, threads,
    shared memory, registers per thread (ptxas, or the driver: kernels.usage), spilled bytes (None without a
    ptxas report), the NVRTC compile time of the module (0 if it came from cache) and whether it is computed
    transposed (``swapped``: the tile, tiles and grid are then the N x M x K problem's)."""
    out_dtype = out_dtype or in_dtype
    with _on_device(device) as (_, dev):
        sms = kernels.num_sms(dev)
        gemv_ok = gemv.shape_ok(M, N, K, b_layout) and gemv.worthwhile(N, sms)
        choice = orient_and_plan(M, N, K, b_layout, sms, config, None, None, misaligned_rows(M, N, K, b_layout),
                                 gemv_ok)
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
