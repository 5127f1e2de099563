"""Which GPU architectures the ops run on, and the one clear error for a device that is not one of them.

The GEMM-based ops (``gemm``, ``grouped_gemm``, ``ag_gemm``, ``gemm_reduce_scatter``) are built on TMA,
wgmma and setmaxnreg, which exist on compute capability 9.0 only (``sm_90a``: H100, H200, GH200; the
wgmma instructions are not part of Blackwell's ``sm_100a``).  The collectives use none of these: they
compile for every architecture NVRTC targets (``sm_75`` and newer with NVRTC 13).  Ops check their
device on the first call of a layout, before NVRTC runs.
"""
from __future__ import annotations

import functools

from cuda.bindings import driver as cu
from cuda.bindings import nvrtc

from ..errors import DeviceError
from .driver import check, device_attribute, device_name

__all__ = ["GEMM_CAPABILITIES", "GEMM_OPS", "capability", "require_gemm_device", "arch_runs_gemm",
           "nvrtc_archs", "require_nvrtc_arch"]

GEMM_CAPABILITIES = ((9, 0),)
GEMM_OPS = ("gemm", "grouped_gemm", "ag_gemm", "gemm_reduce_scatter")
_SUPPORTED = "compute capability 9.0 (Hopper: H100, H200, GH200; kernels built for sm_90a)"

_checked: set[int] = set()  # devices that passed require_gemm_device


def capability(device: int) -> tuple[int, int]:
    """``(major, minor)`` compute capability of ``device``."""
    A = cu.CUdevice_attribute
    return (device_attribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device),
            device_attribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device))


def require_gemm_device(what: str, device: int) -> None:
    """Raise :class:`~mkernel.DeviceError` naming ``what``, the device and its compute capability unless
    ``device`` runs the GEMM kernels (a dict lookup after the first pass)."""
    if device in _checked:
        return
    cc = capability(device)
    if cc not in GEMM_CAPABILITIES:
        name = device_name(device)
        raise DeviceError(
            f"{what} needs a GPU of {_SUPPORTED}; cuda:{device}{f' ({name})' if name else ''} has compute capability "
            f"{cc[0]}.{cc[1]}.  The collectives (all_gather, reduce_scatter, all_reduce) run on compute capability "
            "7.5 and newer")
    _checked.add(device)


def arch_runs_gemm(arch: str) -> bool:
    """Whether an NVRTC architecture name (``sm_90a``, ``sm_90``) is one the GEMM kernels compile for."""
    return arch.rstrip("a") in {f"sm_{a}{b}" for a, b in GEMM_CAPABILITIES}


@functools.lru_cache(maxsize=None)
def nvrtc_archs() -> tuple[int, ...]:
    """The architectures this NVRTC compiles for, as numbers (90 for ``sm_90``)."""
    return tuple(int(a) for a in check(nvrtc.nvrtcGetSupportedArchs()))


def require_nvrtc_arch(arch: str) -> None:
    """Raise :class:`~mkernel.DeviceError` when NVRTC cannot target ``arch`` (``sm_XY`` or ``sm_XYa``)."""
    digits = arch[3:].rstrip("af") if arch.startswith("sm_") else ""
    archs = nvrtc_archs()
    if not digits.isdigit() or int(digits) not in archs:
        raise DeviceError(f"NVRTC cannot compile for {arch}: it targets sm_{archs[0]} to sm_{archs[-1]} "
                          f"({', '.join(f'sm_{a}' for a in archs)})")
