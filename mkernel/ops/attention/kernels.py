"""The attention forward kernel (``cuda_src/ops/attention_fwd.cu``): its specializations (registered so CI
compiles every one), launch geometry, argument struct and the compiled kernel of a specialization.
docs/attention.md, "Kernel"."""
from __future__ import annotations

import ctypes

from ...core.compiler import kernel as _compiled_kernel, register_specialization

__all__ = ["SOURCE", "KERNEL", "DTYPES", "HEAD_DIMS", "BM", "BN", "THREADS", "DTYPE_CODES", "AttnFwdArgs",
           "defines", "stages", "smem_bytes", "get"]

SOURCE = "ops/attention_fwd.cu"
KERNEL = "mk_attention_fwd"
DTYPES = ("bfloat16", "float16")
DTYPE_CODES = {"bfloat16": 0, "float16": 1}  # MK_ATTN_DT (mk_common.cuh's MK_DTYPE_*)
HEAD_DIMS = (64, 128)
BM = 128  # query rows per block (two consumer warpgroups of 64)
BN = 128  # keys per K/V tile
THREADS = 384  # a producer and two consumer warpgroups


def stages(head_dim: int) -> int:
    """K/V ring depth of the ``head_dim`` kernel (MK_STAGES)."""
    return 4 if head_dim == 64 else 2


def smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory per block (MK_SMEM_BYTES): alignment slack, Q, the K and V rings, barriers."""
    return 1024 + BM * head_dim * 2 + 2 * stages(head_dim) * BN * head_dim * 2 + 256


def defines(dtype: str, head_dim: int, causal: bool) -> dict:
    return {"MK_ATTN_DT": DTYPE_CODES[dtype], "MK_ATTN_D": head_dim, "MK_ATTN_CAUSAL": int(bool(causal))}


for _dt in DTYPES:
    for _d in HEAD_DIMS:
        for _c in (False, True):
            register_specialization(SOURCE, defines(_dt, _d, _c))


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


def get(dtype: str, head_dim: int, causal: bool):
    """The forward kernel of this specialization (compiled or loaded on first use, then memoized)."""
    return _compiled_kernel(SOURCE, defines(dtype, head_dim, causal), KERNEL)
