"""The attention forward kernel (``cuda_src/ops/attention_fwd.cu``): its specializations (registered so CI
compiles every one), launch geometry per schedule, argument struct and the compiled kernel of a
specialization.  docs/attention.md, "Kernel" and "Ping-pong schedule"."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ...core.arrays import DeviceArray
from ...core.compiler import kernel as _compiled_kernel, register_specialization
from ...core.tensormap import TensorMapArg

__all__ = ["SOURCE", "KERNEL", "DTYPES", "HEAD_DIMS", "SCHEDULES", "BM", "BN", "THREADS", "MAX_BM", "DTYPE_CODES",
           "AttnFwdArgs", "AttnMergeArgs", "LOG2E", "Geometry", "geometry", "defines", "stages", "smem_bytes", "get",
           "bshd", "tensor_map"]

SOURCE = "ops/attention_fwd.cu"
KERNEL = "mk_attention_fwd"
DTYPES = ("bfloat16", "float16")
DTYPE_CODES = {"bfloat16": 0, "float16": 1}  # MK_ATTN_DT (mk_common.cuh's MK_DTYPE_*)
HEAD_DIMS = (64, 128)
SCHEDULES = ("default", "pingpong")  # AttentionOptions.schedule
# the default schedule's geometry (both head dims)
BM = 128  # query rows per block (two consumer warpgroups of 64)
BN = 128  # keys per K/V tile
THREADS = 384  # a producer and two consumer warpgroups
MAX_BM = 192  # the largest query block of any schedule (index range checks)
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Geometry:
    """One kernel's block shape: consumer warpgroups ``wgs`` (64 query rows each, ``bm = 64 wgs``), keys per
    K/V tile ``bn``, K/V ring depth ``stages``; threads ``128 (1 + wgs)``; ``smem`` bytes of dynamic shared
    memory (MK_SMEM_BYTES: alignment slack, Q, the K and V rings, barriers)."""

    head_dim: int
    pingpong: bool
    wgs: int
    bn: int
    stages: int

    @property
    def bm(self) -> int:
        return 64 * self.wgs

    @property
    def threads(self) -> int:
        return 128 * (1 + self.wgs)

    @property
    def smem(self) -> int:
        d = self.head_dim
        return 1024 + self.bm * d * 2 + 2 * self.stages * self.bn * d * 2 + 256


# Ping-pong at D = 64: three consumer warpgroups (BM = 192) so two GEMM streams cover each softmax (the exp
# work per FLOP is twice D = 128's); at D = 128 two warpgroups and three K/V stages (the ring fits beside Q).
# docs/attention.md, "Ping-pong schedule".
_GEOMETRY = {
    ("default", 64): Geometry(64, False, 2, BN, 4),
    ("default", 128): Geometry(128, False, 2, BN, 2),
    ("pingpong", 64): Geometry(64, True, 3, 128, 4),
    ("pingpong", 128): Geometry(128, True, 2, 128, 3),
}


def pick_schedule(schedule: str, head_dim: int, seq_k: int) -> str:
    """The schedule that runs for ``AttentionOptions.schedule``: ``"auto"`` is ping-pong at D = 64 and at
    D = 128 below 8192 keys, the default schedule otherwise (measured: docs/attention.md, "Ping-pong
    schedule")."""
    if schedule != "auto":
        return schedule
    return "pingpong" if head_dim == 64 or seq_k < 8192 else "default"


def geometry(head_dim: int, schedule: str = "default") -> Geometry:
    """The block shape of the (``schedule``, ``head_dim``) kernel."""
    return _GEOMETRY[(schedule, head_dim)]


def stages(head_dim: int, schedule: str = "default") -> int:
    """K/V ring depth of the ``head_dim`` kernel (MK_STAGES)."""
    return geometry(head_dim, schedule).stages


def smem_bytes(head_dim: int, schedule: str = "default") -> int:
    """Dynamic shared memory per block (MK_SMEM_BYTES): alignment slack, Q, the K and V rings, barriers."""
    return geometry(head_dim, schedule).smem


def defines(dtype: str, head_dim: int, causal: bool, schedule: str = "default", merge: bool = False) -> dict:
    """The kernel's preprocessor defines; the default schedule's are the kernel's built-in values (none).
    ``merge``: the epilogue merges into a running fp32 result (ring attention, docs/ring_attention.md
    "Merge"; the kernel then takes an :class:`AttnMergeArgs` too); default schedule only."""
    d = {"MK_ATTN_DT": DTYPE_CODES[dtype], "MK_ATTN_D": head_dim, "MK_ATTN_CAUSAL": int(bool(causal))}
    g = geometry(head_dim, schedule)
    if g.pingpong:
        if merge:
            raise ValueError("the merge specialization (MK_ATTN_MERGE) exists for the default schedule only")
        d.update(MK_ATTN_PINGPONG=1, MK_ATTN_WGS=g.wgs, MK_ATTN_BN=g.bn, MK_ATTN_STAGES=g.stages)
    if merge:
        d["MK_ATTN_MERGE"] = 1
    return d


# every schedule's plain kernels; the merge kernels (ring attention) of the default schedule only
for _s in SCHEDULES:
    for _dt in DTYPES:
        for _d in HEAD_DIMS:
            for _c in (False, True):
                for _m in ((False, True) if _s == "default" else (False,)):
                    register_specialization(SOURCE, defines(_dt, _d, _c, _s, _m))


class AttnFwdArgs(ctypes.Structure):
    """Mirror of MkAttnFwdArgs in cuda_src/ops/attention_fwd.cu (64 bytes)."""

    _fields_ = [
        ("out", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),
        ("out_sb", ctypes.c_int64),
        ("out_ss", ctypes.c_int64),
        ("out_sh", ctypes.c_int64),
        ("s_q", ctypes.c_int32),
        ("s_k", ctypes.c_int32),
        ("h_q", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("scale_log2", ctypes.c_float),
        ("heavy_first", ctypes.c_int32),
    ]


assert ctypes.sizeof(AttnFwdArgs) == 64


class AttnMergeArgs(ctypes.Structure):
    """Mirror of MkAttnMergeArgs in cuda_src/ops/attention_fwd.cu (32 bytes; MK_ATTN_MERGE kernels only).
    The launch's query row q merges into row ``row0 + q`` of ``acc`` (fp32 ``[B, H_q, s_acc, D]``
    contiguous) and of the ``lse`` array (``[B, H_q, s_acc]``); rows in ``[final_lo, final_hi)`` store
    their merged output into ``out`` (dtype) instead of ``acc``; ``first``: no running result yet."""

    _fields_ = [
        ("acc", ctypes.c_void_p),
        ("row0", ctypes.c_int32),
        ("s_acc", ctypes.c_int32),
        ("first", ctypes.c_int32),
        ("final_lo", ctypes.c_int32),
        ("final_hi", ctypes.c_int32),
        ("pad", ctypes.c_int32),
    ]


assert ctypes.sizeof(AttnMergeArgs) == 32


def get(dtype: str, head_dim: int, causal: bool, schedule: str = "default", merge: bool = False):
    """The forward kernel of this specialization (compiled or loaded on first use, then memoized)."""
    return _compiled_kernel(SOURCE, defines(dtype, head_dim, causal, schedule, merge), KERNEL)


def bshd(x: DeviceArray, layout: str) -> tuple:
    """``(B, S, H, D)`` extents and element strides of a 4-D array in ``layout`` ("bshd" or "bhsd")."""
    if layout == "bshd":
        return x.shape, x.strides
    (b, h, s, d), (sb, sh, ss, sd) = x.shape, x.strides
    return (b, s, h, d), (sb, ss, sh, sd)


def tensor_map(x: DeviceArray, layout: str, rows: int, ptr: int | None = None, seq: int | None = None) -> TensorMapArg:
    """A 4-D tensor map ``{D, S, H, B}`` over ``x`` in its real layout, box ``{64, rows, 1, 1}``, 128B-swizzled
    (the kernel's [rows x 64] chunks).  ``ptr`` / ``seq``: map a sequence window of x instead (its first
    row's address and its length; x's strides).  Extents of 1 (whose stride TMA never steps) get a
    placeholder stride; S = 0 (no keys) maps one row that is never read."""
    (b, s, h, d), (sb, ss, sh, _) = bshd(x, layout)
    if seq is not None:
        s = seq
    it = x.dtype.itemsize
    dims = (d, max(s, 1), h, b)
    strides = [st * it if n > 1 else d * it for n, st in ((s, ss), (h, sh), (b, sb))]
    return TensorMapArg(x.ptr if ptr is None else ptr, x.dtype.name, dims, strides, (64, rows, 1, 1), swizzle=128)
