"""The attention backward's kernels (``cuda_src/ops/attention_bwd.cu``): registered specializations, their
defines, launch geometry and shared-memory sizes.  docs/attention_bwd.md, section "Kernels"."""
from __future__ import annotations

from ...core.compiler import kernel, register_specialization

__all__ = ["SOURCE", "DTYPES", "HEAD_DIMS", "BLOCK_Q", "DEFAULT_BLOCK_Q", "WARPS", "DQ_WARPS", "DQ_BLOCK_K",
           "KERNELS", "WGMMA_KERNEL", "PARTIAL_KERNELS", "MAX_PARTS", "partial_defines", "wgmma_partial_defines",
           "WGMMA_BLOCK_KV", "WGMMA_BLOCK_Q", "WGMMA_THREADS", "WGMMA_STAGES", "defines", "wgmma_defines",
           "get_partial", "specializations", "main_smem", "dq_smem", "wgmma_smem", "get"]

SOURCE = "ops/attention_bwd.cu"
DTYPES = {"bfloat16": 0, "float16": 1}  # MKATT_DTYPE (mk_common.cuh dtype codes)
HEAD_DIMS = (64, 128)
BLOCK_Q = (32, 64)  # main kernel's query rows per step (MKATT_BR)
DEFAULT_BLOCK_Q = {64: 64, 128: 32}  # registers: dK, dV (D / 8 x 4 x 2 fp32) + S^T, dP^T (BR / 8 x 4 x 2)
WARPS = 8  # main kernel: KV rows per block = 16 x WARPS
DQ_WARPS = 4  # deterministic dQ kernel: query rows per block = 16 x DQ_WARPS
DQ_BLOCK_K = 64  # deterministic dQ kernel: KV rows per step
ROW_KERNEL_ROWS = 8  # mk_attn_bwd_pre / mk_attn_bwd_convert: one warp per row, 256 threads
KERNELS = ("mma", "wgmma")  # main kernel choices (AttentionBwdOptions.kernel)
WGMMA_KERNEL = "mk_attn_bwd_wgmma"  # the TMA + wgmma main kernel (its own specialization: MKATT_WGMMA=1)
WGMMA_BLOCK_KV = 128  # KV rows per block (64 per consumer warpgroup)
WGMMA_BLOCK_Q = 64  # query rows per step
WGMMA_THREADS = 384  # a producer and two consumer warpgroups
WGMMA_STAGES = 3  # Q / dO / lse / Dsum ring slots


def defines(dtype: str, d: int, block_q: int) -> dict:
    return dict(MKATT_DTYPE=DTYPES[dtype], MKATT_D=d, MKATT_WARPS=WARPS, MKATT_BR=block_q,
                MKATT_DQ_WARPS=DQ_WARPS, MKATT_DQ_BK=DQ_BLOCK_K)


def wgmma_defines(dtype: str, d: int) -> dict:
    """The specialization holding only ``mk_attn_bwd_wgmma``."""
    return dict(MKATT_DTYPE=DTYPES[dtype], MKATT_D=d, MKATT_WGMMA=1)


PARTIAL_KERNELS = ("mk_attn_bwd_main", "mk_attn_bwd_part_sum")  # the MKATT_PARTIAL specialization's kernels
MAX_PARTS = 8  # MKATT_MAX_PARTS: partials one mk_attn_bwd_part_sum adds (the local ranks of a node)


def partial_defines(dtype: str, d: int) -> dict:
    """The ring backward's specialization (MKATT_PARTIAL=1, the default query block): the main kernel writing
    fp32 dK / dV partials, and their fixed-order sum (docs/ring_attention.md, "Backward")."""
    return {**defines(dtype, d, DEFAULT_BLOCK_Q[d]), "MKATT_PARTIAL": 1}


def wgmma_partial_defines(dtype: str, d: int) -> dict:
    """The ring backward's wgmma main kernel (MKATT_WGMMA=1, MKATT_PARTIAL=1: ``mk_attn_bwd_wgmma`` writing
    the fp32 partials of :func:`partial_defines`' main kernel; docs/ring_attention.md, "Backward")."""
    return {**wgmma_defines(dtype, d), "MKATT_PARTIAL": 1}


def specializations() -> list[dict]:
    """Every (dtype, head dim, block_q) of the mma kernels, every (dtype, head dim) of the wgmma kernel and
    of the ring backward's partial kernels (mma and wgmma)."""
    return ([defines(t, d, br) for t in DTYPES for d in HEAD_DIMS for br in BLOCK_Q]
            + [wgmma_defines(t, d) for t in DTYPES for d in HEAD_DIMS]
            + [partial_defines(t, d) for t in DTYPES for d in HEAD_DIMS]
            + [wgmma_partial_defines(t, d) for t in DTYPES for d in HEAD_DIMS])


for _d in specializations():
    register_specialization(SOURCE, _d)


def main_smem(d: int, block_q: int) -> int:
    """Bytes of ``MkAttnMainSmem``: K, V (BC rows), Q, dO (two buffers of block_q rows), dS^T, lse, Dsum;
    rows padded to D + 8 elements."""
    ld, bc = d + 8, 16 * WARPS
    return 2 * (2 * bc * ld + 4 * block_q * ld + bc * (block_q + 8)) + 4 * 4 * block_q


def dq_smem(d: int) -> int:
    """Bytes of ``MkAttnDqSmem``: Q, dO (16 x DQ_WARPS rows), K, V (two buffers of DQ_BLOCK_K rows)."""
    ld = d + 8
    return 2 * (2 * 16 * DQ_WARPS * ld + 4 * DQ_BLOCK_K * ld)


def wgmma_smem(d: int) -> int:
    """Bytes of the wgmma kernel's dynamic shared memory (MKW_SMEM_BYTES): 1024 alignment slack, K, V
    (128 rows), the Q and dO ring (64 rows a slot), two dS^T buffers (128 x 64), the lse / Dsum ring, 128
    bytes of barriers."""
    return (1024 + 2 * WGMMA_BLOCK_KV * d * 2 + 2 * WGMMA_STAGES * WGMMA_BLOCK_Q * d * 2
            + 2 * WGMMA_BLOCK_KV * WGMMA_BLOCK_Q * 2 + 2 * WGMMA_STAGES * WGMMA_BLOCK_Q * 4 + 128)


def get_partial(dtype: str, d: int, name: str):
    """The compiled (or cached) ring-backward kernel ``name``: ``mk_attn_bwd_wgmma`` from
    :func:`wgmma_partial_defines`, the others (PARTIAL_KERNELS) from :func:`partial_defines`."""
    if name == WGMMA_KERNEL:
        return kernel(SOURCE, wgmma_partial_defines(dtype, d), name)
    return kernel(SOURCE, partial_defines(dtype, d), name)


def get(dtype: str, d: int, block_q: int, name: str):
    """The compiled (or cached) kernel ``name``: ``mk_attn_bwd_wgmma`` from its own specialization (block_q
    unused), the others from the (dtype, d, block_q) one."""
    if name == WGMMA_KERNEL:
        return kernel(SOURCE, wgmma_defines(dtype, d), name)
    return kernel(SOURCE, defines(dtype, d, block_q), name)
