"""Ranks that share a GPU: more ranks than GPUs on a host (or ``MKERNEL_DEVICE`` / ``device=`` choosing
one GPU twice).  mkernel runs that way -- every op whose kernels wait for their peers' kernels plans and
launches within ``Context.resident_sms`` (the SMs divided by the most ranks on one GPU), so the sharers'
kernels fit on it together (docs/reliability.md, "Ranks sharing a GPU") -- but each op then has a share
of the GPU, so it is reported: one warning per shared GPU, logged by the lowest rank using it.
"""
from __future__ import annotations

import logging

from cuda.bindings import driver as cu

from ..core.driver import check

__all__ = ["gpu_identity", "shared_gpus", "warn_shared_gpus"]

log = logging.getLogger("mkernel")


def gpu_identity(device: int) -> str:
    """A name of the physical GPU behind ordinal ``device`` that is the same in every process of the host,
    whatever its ``CUDA_VISIBLE_DEVICES``: the PCI bus id, else the UUID, else the ordinal."""
    try:
        return check(cu.cuDeviceGetPCIBusId(32, check(cu.cuDeviceGet(device)))).split(b"\0", 1)[0].decode()
    except Exception:
        pass
    try:
        return "GPU-" + bytes(check(cu.cuDeviceGetUuid(check(cu.cuDeviceGet(device)))).bytes).hex()
    except Exception:
        return f"cuda:{device}"


def shared_gpus(entries) -> dict[str, list[int]]:
    """``{gpu: [world ranks]}`` for every GPU that more than one of ``entries`` (``(rank, gpu)`` pairs of
    one host) uses; ranks in increasing order."""
    by_gpu: dict[str, list[int]] = {}
    for rank, gpu in entries:
        by_gpu.setdefault(gpu, []).append(int(rank))
    return {g: sorted(r) for g, r in by_gpu.items() if len(r) > 1}


def warn_shared_gpus(rank: int, entries, host_size: int, num_gpus: int) -> None:
    """Log one warning per shared GPU of ``entries`` (this host's ``(rank, gpu)``), from its lowest rank."""
    for gpu, ranks in shared_gpus(entries).items():
        if ranks[0] == rank:
            log.warning("mkernel: ranks %s share the GPU %s (%d ranks on this host, %d GPUs visible): each op runs "
                        "on its share of the SMs; give each rank its own GPU (device=, MKERNEL_DEVICE or "
                        "CUDA_VISIBLE_DEVICES)",
                        ranks, gpu, host_size, num_gpus)
