"""GEMM+ReduceScatter's device-facing layout: the row split, the tile order of the fused kernel, the
symmetric workspace and the kernel's argument struct -- pure functions of the agreed plan.

Workspace of local rank j (the same offsets on every local rank; cuda_src/ops/gemm_rs.cu has the picture)::

    [0]             epoch state                         (signals.workspace_control)
    [consumed_off]  call header: consumed[P], entered[P], sig[P][2]
    [flags_off]     ready[src][FLAGS_PER_SOURCE] u64    ready[src][t] = call that delivered src's tile t
    [data_off]      P - 1 slots of slot_bytes           slot (src - j + P) % P - 1: src's partial tiles of
                                                        j's rows, tile t at t * tile_bytes

Everything before ``data_off`` depends on P only (docs/design.md, "Control words never move"): a call
of another shape never finds its flags on bytes an earlier call left as data.  An owner keeps no slot
for itself (its own partial stays in registers): P - 1 slots, not P.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ...core.compiler import register_specialization
from ...core.util import round_up
from ...dist.signals import workspace_control
from .. import gemm as G  # the GEMM package's public planning API
from ..gemm_comm import (FLAG_ROWS_PER_SOURCE, FLAGS_PER_SOURCE, MAXP, OwnerRows, RsLayout, Tile, owner_tiles, raster,
                         row_offsets, tile_order)

__all__ = ["SOURCE", "MAXP", "FUSED_CONFIGS", "FLAG_ROWS_PER_SOURCE", "FLAGS_PER_SOURCE", "RsLayout", "OwnerRows",
           "RsArgs", "split_rows", "row_offsets", "owner_tiles", "tile_order", "raster", "Tile", "control_offsets",
           "workspace_layout", "tile_bytes", "kernel_defines", "WsLayout"]

SOURCE = "ops/gemm_rs.cu"
# Tile configs of the fused kernel: cooperative, one slab per consumer warpgroup, no clusters (config 5's
# 224-wide tile with B "nk" only, as for every GEMM kernel).
FUSED_CONFIGS = (1, 2, 3, 4, 5)
_DT = {"bfloat16": 0, "float16": 1, "float32": 2}  # mk_common.cuh MK_DTYPE_*


class RsArgs(ctypes.Structure):
    """``struct RsArgs`` of cuda_src/ops/gemm_rs.cu (176 bytes)."""

    _fields_ = [("ws", ctypes.c_void_p), ("peers", ctypes.c_void_p), ("c", ctypes.c_void_p), ("ldc", ctypes.c_int64),
                ("L", RsLayout), ("rows", OwnerRows), ("K", ctypes.c_int32), ("c_vec_ok", ctypes.c_int32),
                ("c_tma", ctypes.c_int32), ("pad", ctypes.c_int32)]


assert ctypes.sizeof(RsArgs) == 176


def kernel_defines(in_dtype: str, out_dtype: str, config: int, partial_dtype: str | None = None) -> dict:
    """The specialization of gemm_rs.cu: the GEMM's defines of (in, out, config) plus the partial dtype
    (MK_RS_PARTIAL; omitted when it is out's, the kernel's default)."""
    d = dict(G.defines(in_dtype, out_dtype, config))
    if partial_dtype is not None and partial_dtype != out_dtype:
        d["MK_RS_PARTIAL"] = _DT[partial_dtype]
    return d


# CI compiles these (tests/cpu/test_runtime.py): every fused config for bf16 / fp16 in, out of the input
# dtype or fp32 (partials of out's dtype), and fp32 partials of a 16-bit out.
for _i in G.IN_DTYPES:
    for _c in FUSED_CONFIGS:
        for _o, _p in ((_i, None), ("float32", None), (_i, "float32")):
            register_specialization(SOURCE, kernel_defines(_i, _o, _c, _p))


# --------------------------------------------------------------------------------------------
# the row split (the fused kernel's tile order: mkernel.ops.gemm_comm.tile_order)
# --------------------------------------------------------------------------------------------
def split_rows(M: int, P: int) -> tuple:
    """The default split of M rows over P ranks: as even as possible, the first M % P ranks one more."""
    q, r = divmod(M, P)
    return tuple(q + (1 if j < r else 0) for j in range(P))


# --------------------------------------------------------------------------------------------
# the workspace
# --------------------------------------------------------------------------------------------
def control_offsets(P: int) -> tuple:
    """(consumed_off, flags_off, end) of the control region: a function of P only."""
    return workspace_control(P, P * FLAG_ROWS_PER_SOURCE)


def tile_bytes(bm: int, bn: int, partial_itemsize: int) -> int:
    """Bytes of one partial tile in a slot (the whole bm x bn tile, whatever its valid part)."""
    return bm * bn * partial_itemsize


@dataclass(frozen=True)
class WsLayout:
    """The workspace of one plan: the kernel's MkRsLayout fields and the total size."""

    consumed_off: int
    flags_off: int
    data_off: int
    slot_bytes: int
    total: int

    def struct(self) -> RsLayout:
        L = RsLayout()
        L.consumed_off, L.flags_off, L.data_off, L.slot_bytes = (self.consumed_off, self.flags_off, self.data_off,
                                                                 self.slot_bytes)
        L.flag_stride = FLAGS_PER_SOURCE
        return L


def workspace_layout(m_sizes, N: int, bm: int, bn: int, partial_itemsize: int) -> WsLayout:
    """The workspace for P = len(m_sizes) owners of ``m_sizes`` rows, N columns, bm x bn tiles: every slot
    holds the largest owner's tiles.  Raises if an owner would have more tiles than it has flags."""
    P = len(m_sizes)
    most = max(owner_tiles(m, N, bm, bn) for m in m_sizes)
    if most > FLAGS_PER_SOURCE:
        raise ValueError(f"gemm_rs: {most} tiles per owner, the workspace has {FLAGS_PER_SOURCE} ready flags")
    consumed, flags, end = control_offsets(P)
    data = round_up(end, 4096)
    slot = round_up(most * tile_bytes(bm, bn, partial_itemsize), 4096)
    return WsLayout(consumed, flags, data, slot, data + (P - 1) * slot)
