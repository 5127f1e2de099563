"""mkernel: fused multi-GPU, multi-node compute+communication kernels.

Kernels are CUDA C++ in ``cuda_src/``, compiled at run time by NVRTC and launched through the CUDA
driver API (cuda-python).  Arrays come and go through ``__cuda_array_interface__`` and DLPack.

    import mkernel
    ctx = mkernel.init()                      # MPI.COMM_WORLD; one GPU per rank
    y = mkernel.all_reduce(ctx, x)            # x: any CUDA array (torch, cupy, jax, DeviceArray)
    ctx.synchronize()                         # raises mkernel.CommTimeout if a peer never came

Packages: :mod:`mkernel.core` (driver, compiler, launch, arrays), :mod:`mkernel.dist` (topology,
context, symmetric memory, signals), :mod:`mkernel.proxy` (inter-node proxy and transports),
:mod:`mkernel.ops` (the op pipeline and every op).
"""
from .core.arrays import DeviceArray
from .core.dtypes import bf16_to_f32, dtype_of, f32_to_bf16
from .core.interop import as_device_array
from .dist.bootstrap import Bootstrap
from .dist.context import Context, init
from .dist.topology import Topology
from .errors import CommError, CommMismatch, CommTimeout, CompileError, CudaError, DeviceError, MkernelError
from .ops.ag_gemm import AgGemmOptions, ag_gemm
from .ops.attention import AttentionOptions, attention
from .ops.attention_bwd import AttentionBwdOptions, attention_backward
from .ops.collectives import CollectiveOptions, all_gather, all_reduce, reduce_scatter
from .ops.gemm import GemmOptions, gemm, grouped_gemm
from .ops.gemm_ar import GemmArOptions, gemm_all_reduce
from .ops.gemm_rs import GemmRsOptions, gemm_reduce_scatter
from .ops.moe import MoeOptions, MoeRouting, moe_combine, moe_dispatch, moe_dispatch_gemm, moe_gemm_combine, moe_layer, moe_route
from .ops.ring_attention import (RingAttentionOptions, ring_attention, ring_attention_backward, zigzag_shard,
                                 zigzag_unshard)

__version__ = "0.1.0"

__all__ = [
    "init", "Context", "Topology", "Bootstrap", "DeviceArray", "as_device_array", "dtype_of", "bf16_to_f32", "f32_to_bf16",
    "all_gather", "reduce_scatter", "all_reduce", "gemm", "grouped_gemm", "ag_gemm", "gemm_reduce_scatter",
    "gemm_all_reduce", "attention", "attention_backward", "moe_route", "moe_dispatch", "moe_combine", "moe_layer",
    "moe_dispatch_gemm", "moe_gemm_combine", "ring_attention", "ring_attention_backward", "zigzag_shard", "zigzag_unshard", "RingAttentionOptions",
    "CollectiveOptions", "GemmOptions", "AgGemmOptions", "GemmRsOptions", "GemmArOptions", "AttentionOptions",
    "AttentionBwdOptions", "MoeOptions", "MoeRouting",
    "MkernelError", "CudaError", "DeviceError", "CompileError", "CommError", "CommMismatch", "CommTimeout",
]
