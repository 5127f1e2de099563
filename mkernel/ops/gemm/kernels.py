"""The compiled GEMM kernels and the device facts a plan needs: the kernel of a specialization, the SM
count, a compiled kernel's resource usage.  (The driver-facing pieces the CPU tests replace by fakes.)"""
from __future__ import annotations

from cuda.bindings import driver as cu

from ...core.compiler import kernel as _compiled_kernel
from ...core.device import context_handle, current_context as context
from ...core.driver import device_attribute
from .configs import SOURCE, defines
from .swiglu import KERNEL as SWIGLU_KERNEL, SOURCE as SWIGLU_SOURCE

__all__ = ["get", "num_sms", "usage", "context", "context_handle"]


def get(in_dtype: str, out_dtype: str, config: int, name: str, swap: bool = False):
    """Kernel ``name`` of gemm.cu (gemm_swiglu.cu for its kernel) compiled for ``config`` (compiled or loaded on
    first use, then memoized)."""
    source = SWIGLU_SOURCE if name == SWIGLU_KERNEL else SOURCE
    return _compiled_kernel(source, defines(in_dtype, out_dtype, config, swap), name)


def num_sms(device: int) -> int:
    return device_attribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device)


def usage(mod, name: str) -> dict:
    """ptxas's resource report of kernel ``name`` of module ``mod``; registers from the driver where NVRTC
    returned no report (as the NVRTC 13.0 of the H200 image does)."""
    u = dict(mod.resource_usage.get(name, {}))
    if "registers" not in u:
        u["registers"] = mod.function(name).attribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS)
    return u

