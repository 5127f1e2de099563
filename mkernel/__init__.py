"""mkernel: fused multi-GPU, multi-node compute+communication kernels.

Kernels are CUDA C++ in ``cuda_src/``, compiled at run time by NVRTC and launched through the CUDA
driver API (cuda-python).  Arrays come and go through ``__cuda_array_interface__`` and DLPack.

    import mkernel
    ctx = mkernel.init()                      # MPI.COMM_WORLD; one GPU per rank
    y = mkernel.all_reduce(ctx, x)            # x: any CUDA array (torch, cupy, jax, DeviceArray)
    ctx.synchronize()                         # raises mkernel.CommTimeout if a peer never came
"""
from .arrays import DeviceArray, as_device_array, bf16_to_f32, dtype_of, f32_to_bf16
from .collectives import all_gather, all_reduce, reduce_scatter
from .context import Context, init
from .gemm_engine import gemm, grouped_gemm
from . import gemv  # noqa: F401 (registers the decode-shaped kernel's specializations)
from .ag_gemm import ag_gemm
from .errors import CommError, CommMismatch, CommTimeout, CompileError, CudaError, MkernelError
from .topology import Topology

__version__ = "0.1.0"

__all__ = [
    "init", "Context", "Topology", "DeviceArray", "as_device_array", "dtype_of", "bf16_to_f32", "f32_to_bf16",
    "all_gather", "reduce_scatter", "all_reduce", "gemm", "grouped_gemm", "ag_gemm",
    "MkernelError", "CudaError", "CompileError", "CommError", "CommMismatch", "CommTimeout",
]
