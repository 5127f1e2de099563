"""GEMM+AllReduce's device-facing layout: the fused kernel's specializations, the bandwidth path's row split
over owners, the symmetric workspace and the kernel's argument struct -- pure functions of the agreed plan.

Workspace of local rank j (the same offsets on every local rank; cuda_src/ops/gemm_ar.cu has the picture)::

    [0]              epoch state                          (signals.workspace_control)
    [consumed_off]   call header: consumed[P], entered[P], sig[P][2]
    [flags_off]      ready[src][FLAGS_PER_SOURCE] u64     ready[src][t] = call that delivered src's partial of t
    [gflags_off]     gath[owner][FLAGS_PER_SOURCE] u64    (bandwidth) gath[o][t] = call whose reduced tile t of
                                                          owner o landed here
    [data_off]       partial slots                        latency: P slots, slot s = rank s's partials of every
                                                          tile; bandwidth: P - 1 slots, slot (src - j + P) % P - 1
                                                          = src's partials of j's tiles
    [gdata_off]      P - 1 gather slots                   (bandwidth) slot (o - j + P) % P - 1 = owner o's
                                                          reduced tiles, out's dtype

Everything before ``data_off`` depends on P only (docs/design.md, "Control words never move"): a call of
another shape or path never finds its flags on bytes an earlier call left as data.  Tile t of a slot lies at
t * tile bytes (whole tiles, fragment-ordered: mk_gemm_comm.cuh MkFrag).
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

from ...core.compiler import register_specialization
from ...core.util import round_up
from ...dist.signals import workspace_control
from .. import gemm as G  # the GEMM package's public planning API
from ..gemm_comm import FLAG_ROWS_PER_SOURCE, FLAGS_PER_SOURCE, MAXP, GatherLayout, OwnerRows, RsLayout

__all__ = ["SOURCE", "MAXP", "LATENCY_CONFIGS", "TRANSPOSED_CONFIGS", "BANDWIDTH_CONFIGS", "ArArgs",
           "kernel_defines", "owner_rows", "control_offsets", "tile_bytes", "WsLayout", "latency_workspace",
           "bandwidth_workspace", "PATH_CODES"]

SOURCE = "ops/gemm_ar.cu"
# Tile configs of the fused kernel: cooperative, one slab per consumer warpgroup, no clusters.  Latency path:
# 64 x 128 and 128 x 256 tiles, and config 53's 64 x 64 "kn" tile (twice the tiles of 64 x 128 for a
# decode call's few rows: twice the SMs streaming B; with B "nk" it is 64 x 16, left to the transposed
# plans).  Transposed (B "nk" only): mkernel.gemm's decode tiles, 64 x 16 / 64 x 32 over N x M.
# Bandwidth path: gemm_rs's set.
LATENCY_CONFIGS = (1, 3, 53)
TRANSPOSED_CONFIGS = (53, 54)
BANDWIDTH_CONFIGS = (1, 2, 3, 4, 5)
PATH_CODES = {"latency": 0, "bandwidth": 1}  # MK_AR_PATH
_DT = {"bfloat16": 0, "float16": 1, "float32": 2}  # mk_common.cuh MK_DTYPE_*


class ArArgs(ctypes.Structure):
    """``struct ArArgs`` of cuda_src/ops/gemm_ar.cu (200 bytes)."""

    _fields_ = [("ws", ctypes.c_void_p), ("peers", ctypes.c_void_p), ("c", ctypes.c_void_p), ("ldc", ctypes.c_int64),
                ("L", RsLayout), ("G", GatherLayout), ("rows", OwnerRows), ("M", ctypes.c_int32),
                ("K", ctypes.c_int32), ("c_vec_ok", ctypes.c_int32), ("c_tma", ctypes.c_int32),
                ("pad", ctypes.c_int32)]


assert ctypes.sizeof(ArArgs) == 200


def kernel_defines(in_dtype: str, out_dtype: str, config: int, path: str, partial_dtype: str | None = None,
                   transposed: bool = False) -> dict:
    """The specialization of gemm_ar.cu: the GEMM's defines of (in, out, config; transposed: MK_GEMM_SWAP)
    plus the scheme (MK_AR_PATH) and the partial dtype (MK_AR_PARTIAL; omitted when it is out's, the
    kernel's default)."""
    if transposed and path != "latency":
        raise ValueError("gemm_ar: transposed tiles exist on the latency path only")
    d = dict(G.defines(in_dtype, out_dtype, config, swap=transposed))
    d["MK_AR_PATH"] = PATH_CODES[path]
    if partial_dtype is not None and partial_dtype != out_dtype:
        d["MK_AR_PARTIAL"] = _DT[partial_dtype]
    return d


# CI compiles these (tests/cpu/test_runtime.py): every config of each scheme for bf16 in with out bf16
# (partials bf16 or fp32) or fp32 -- the registers a specialization needs depend on the config and on the
# 16- or 32-bit partials and out, not on bf16 vs fp16 -- and one config of each scheme for fp16 (out fp16
# or fp32).
_BF16_MODES = (("bfloat16", "bfloat16", None), ("bfloat16", "float32", None), ("bfloat16", "bfloat16", "float32"))
_FP16_MODES = (("float16", "float16", None), ("float16", "float32", None))
for _i, _o, _p in _BF16_MODES:
    for _c in BANDWIDTH_CONFIGS:
        register_specialization(SOURCE, kernel_defines(_i, _o, _c, "bandwidth", _p))
    for _c in LATENCY_CONFIGS:
        register_specialization(SOURCE, kernel_defines(_i, _o, _c, "latency", _p))
    for _c in TRANSPOSED_CONFIGS:
        register_specialization(SOURCE, kernel_defines(_i, _o, _c, "latency", _p, transposed=True))
for _i, _o, _p in _FP16_MODES:
    register_specialization(SOURCE, kernel_defines(_i, _o, 3, "bandwidth", _p))
    register_specialization(SOURCE, kernel_defines(_i, _o, 1, "latency", _p))
    register_specialization(SOURCE, kernel_defines(_i, _o, 53, "latency", _p, transposed=True))


# --------------------------------------------------------------------------------------------
# the bandwidth path's owners
# --------------------------------------------------------------------------------------------
def owner_rows(M: int, P: int, bm: int) -> tuple:
    """Rows each of P owners reduces on the bandwidth path: M's ceil(M / bm) tile rows split as evenly as
    possible (the first ones one more), so every owner's rows start on a tile boundary and the owners' tile
    grids are the plain GEMM's -- only the last tile row ends inside a tile, at M (the kernel's TMA stores
    clip there)."""
    num_m = math.ceil(M / bm)
    q, r = divmod(num_m, P)
    out, row = [], 0
    for j in range(P):
        end = min(M, row + (q + (1 if j < r else 0)) * bm)
        out.append(end - row)
        row = end
    return tuple(out)


# --------------------------------------------------------------------------------------------
# the workspace
# --------------------------------------------------------------------------------------------
def control_offsets(P: int) -> tuple:
    """(consumed_off, flags_off, gflags_off, end) of the control region: a function of P only (ready flags
    then gather flags, P rows of FLAGS_PER_SOURCE each)."""
    consumed, flags, end = workspace_control(P, 2 * P * FLAG_ROWS_PER_SOURCE)
    return consumed, flags, flags + 8 * P * FLAGS_PER_SOURCE, end


def tile_bytes(bm: int, bn: int, itemsize: int) -> int:
    """Bytes of one tile in a slot (the whole bm x bn tile, whatever its valid part)."""
    return bm * bn * itemsize


@dataclass(frozen=True)
class WsLayout:
    """The workspace of one plan: the kernel's MkRsLayout / MkGatherLayout fields and the total size."""

    consumed_off: int
    flags_off: int
    gflags_off: int
    data_off: int
    slot_bytes: int
    gdata_off: int
    gslot_bytes: int
    total: int

    def rs_struct(self) -> RsLayout:
        L = RsLayout()
        L.consumed_off, L.flags_off, L.data_off, L.slot_bytes = (self.consumed_off, self.flags_off, self.data_off,
                                                                 self.slot_bytes)
        L.flag_stride = FLAGS_PER_SOURCE
        return L

    def gather_struct(self) -> GatherLayout:
        g = GatherLayout()
        g.flags_off, g.data_off, g.slot_bytes = self.gflags_off, self.gdata_off, self.gslot_bytes
        return g


def latency_workspace(P: int, tiles: int, bm: int, bn: int, partial_itemsize: int) -> WsLayout:
    """The latency path's workspace: P slots of ``tiles`` partial tiles (slot s: rank s's; a rank's own slot
    is used with P > 2 only).  Raises if the tiles outnumber the flags."""
    if tiles > FLAGS_PER_SOURCE:
        raise ValueError(f"gemm_ar: {tiles} tiles, the workspace has {FLAGS_PER_SOURCE} ready flags per source")
    consumed, flags, gflags, end = control_offsets(P)
    data = round_up(end, 4096)
    slot = round_up(tiles * tile_bytes(bm, bn, partial_itemsize), 4096)
    return WsLayout(consumed, flags, gflags, data, slot, data + P * slot, 0, data + P * slot)


def bandwidth_workspace(m_sizes, N: int, bm: int, bn: int, partial_itemsize: int, out_itemsize: int) -> WsLayout:
    """The bandwidth path's workspace for owners of ``m_sizes`` rows: P - 1 partial slots and P - 1 gather
    slots, each holding the largest owner's tiles.  Raises if an owner would have more tiles than flags."""
    P = len(m_sizes)
    most = max(math.ceil(m / bm) for m in m_sizes) * math.ceil(N / bn)
    if most > FLAGS_PER_SOURCE:
        raise ValueError(f"gemm_ar: {most} tiles per owner, the workspace has {FLAGS_PER_SOURCE} ready flags")
    consumed, flags, gflags, end = control_offsets(P)
    data = round_up(end, 4096)
    slot = round_up(most * tile_bytes(bm, bn, partial_itemsize), 4096)
    gslot = round_up(most * tile_bytes(bm, bn, out_itemsize), 4096)
    gdata = data + (P - 1) * slot
    return WsLayout(consumed, flags, gflags, data, slot, gdata, gslot, gdata + (P - 1) * gslot)
