"""mkernel: fused multi-GPU, multi-node compute+communication kernels.

Kernels are CUDA C++ in ``cuda_src/``, compiled at run time by NVRTC and launched through the CUDA
driver API (cuda-python).  Arrays come and go through ``__cuda_array_interface__`` and DLPack.
"""
from .errors import CommError, CommTimeout, CompileError, CudaError, MkernelError

__version__ = "0.1.0"
