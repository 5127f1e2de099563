"""The attention forward kernel (``cuda_src/ops/attention_fwd.cu``): its specializations (registered so CI
compiles every one), launch geometry, argument struct and the compiled kernel of a specialization.
docs/attention.md, "Kernel"."""
from __future__ import annotations

import ctypes

from ...core.arrays import DeviceArray
from ...core.compiler import kernel as _compiled_kernel, register_specialization
from ...core.tensormap import TensorMapArg

__all__ = ["SOURCE", "KERNEL", "DTYPES", "HEAD_DIMS", "BM", "BN", "THREADS", "DTYPE_CODES", "AttnFwdArgs",
           "AttnMergeArgs", "LOG2E", "defines", "stages", "smem_bytes", "get", "bshd", "tensor_map"]

SOURCE = "ops/attention_fwd.cu"
KERNEL = "mk_attention_fwd"
DTYPES = ("bfloat16", "float16")
DTYPE_CODES = {"bfloat16": 0, "float16": 1}  # MK_ATTN_DT (mk_common.cuh's MK_DTYPE_*)
HEAD_DIMS = (64, 128)
BM = 128  # query rows per block (two consumer warpgroups of 64)
BN = 128  # keys per K/V tile
THREADS = 384  # a producer and two consumer warpgroups
LOG2E = 1.4426950408889634


def stages(head_dim: int) -> int:
    """K/V ring depth of the ``head_dim`` kernel (MK_STAGES)."""
    return 4 if head_dim == 64 else 2


def smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory per block (MK_SMEM_BYTES): alignment slack, Q, the K and V rings, barriers."""
    return 1024 + BM * head_dim * 2 + 2 * stages(head_dim) * BN * head_dim * 2 + 256


def defines(dtype: str, head_dim: int, causal: bool, merge: bool = False) -> dict:
    """The specialization's defines; ``merge``: the epilogue merges into a running fp32 result (ring
    attention, docs/ring_attention.md "Merge"; the kernel then takes an :class:`AttnMergeArgs` too)."""
    d = {"MK_ATTN_DT": DTYPE_CODES[dtype], "MK_ATTN_D": head_dim, "MK_ATTN_CAUSAL": int(bool(causal))}
    if merge:
        d["MK_ATTN_MERGE"] = 1
    return d


for _dt in DTYPES:
    for _d in HEAD_DIMS:
        for _c in (False, True):
            for _m in (False, True):
                register_specialization(SOURCE, defines(_dt, _d, _c, _m))


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


def get(dtype: str, head_dim: int, causal: bool, merge: bool = False):
    """The forward kernel of this specialization (compiled or loaded on first use, then memoized)."""
    return _compiled_kernel(SOURCE, defines(dtype, head_dim, causal, merge), KERNEL)


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
