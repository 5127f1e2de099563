"""How GEMM+AllReduce runs: the options object (``options=``) and the planner's cost model.

Every rank must pass equal options (they are part of the agreed call signature).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..base import options_hash

__all__ = ["GemmArOptions", "CostModel", "PATHS", "PARTIAL_DTYPES"]

PATHS = ("latency", "bandwidth", "unfused")
PARTIAL_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class CostModel:
    """The planner's constants (H200, NVLink 4 through NVSwitch); times in seconds, rates per second.  The
    SM rates and the flag latency are estimates until measured with the fused kernels (docs/gemm_ar.md)."""

    gemm_rate: float = 700e12       # dense bf16/fp16 FLOP/s of the whole GPU (mkernel.gemm measured 705-712)
    hbm_bw: float = 4.1e12          # B/s the GPU streams weights at (decode GEMMs on 128 SMs: 128 MiB in 32.6 us)
    sm_load_bw: float = 51e9        # B/s one SM streams them at (64 SMs: 128 MiB in 39.4 us): the weight stream
                                    # of a call whose tiles occupy few SMs is bound by their count
    link_bw: float = 300e9          # B/s a GPU sends (and receives) over NVLink with SM stores (all-gather
                                    # 1 GiB: 276-291 GB/s)
    sm_push_bw: float = 20e9        # B/s one SM's register stores into a peer (ag_gemm's per-block rate)
    sm_read_bw: float = 40e9        # B/s one SM's L2 reads of the partials (or reduced tiles) peers pushed
    flag_latency: float = 3e-6      # s from a tile's last store to a waiting peer seeing its flag (fence drain,
                                    # NVLink, the waiter's back-off)
    ar_bw: float = 235e9            # bus B/s of the unfused all-reduce (mkernel.all_reduce 16 MiB: 232 GB/s)
    ar_latency: float = 14e-6       # s an all-reduce call costs beyond its bytes (64 KiB: 14.2 us)
    launch_latency: float = 6e-6    # s per kernel launch
    fuse_margin: float = 0.97       # fuse only if predicted fused < margin x predicted unfused

    def checked(self) -> "CostModel":
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"CostModel.{f.name} must be a number > 0, got {v!r}")
        return self


@dataclass(frozen=True)
class GemmArOptions:
    """Options of :func:`mkernel.gemm_all_reduce`.

    ``path``: "latency" (one kernel; every tile's partial pushed to every peer, every rank sums every tile:
    decode-sized M), "bandwidth" (one kernel; tiles reduce-scattered to their owners, the reduced tiles
    pushed back to every rank: large M) or "unfused" (:func:`mkernel.gemm` then :func:`mkernel.all_reduce`);
    None: the planner's choice by predicted time.  ``config``: the fused kernel's tile config (latency:
    ``mkernel.ops.gemm_ar.LATENCY_CONFIGS`` or, B "nk" only, ``TRANSPOSED_CONFIGS`` -- computed transposed;
    bandwidth: ``BANDWIDTH_CONFIGS``; None: the planner's pick).  ``partial_dtype``: the dtype partial
    tiles travel in (None: out's; "float32" with a 16-bit out doubles the bytes sent and keeps every partial
    exact to fp32).  ``transposed``: let the latency path compute decode-shaped B "nk" calls transposed
    (C^T = B A^T on 64 x 16 / 64 x 32 tiles, as mkernel.gemm does; False: plain tiles only).  ``model``:
    the planner's constants.
    """

    path: str | None = None
    config: int | None = None
    partial_dtype: str | None = None
    transposed: bool = True
    model: CostModel = field(default_factory=CostModel)

    __hash__ = options_hash  # (hashed once: part of every bound-call key)

    def checked(self) -> "GemmArOptions":
        """Self, or a ValueError / TypeError naming the first field out of range."""
        from .layout import BANDWIDTH_CONFIGS, LATENCY_CONFIGS, TRANSPOSED_CONFIGS

        if self.path not in (None,) + PATHS:
            raise ValueError(f"GemmArOptions.path must be None, 'latency', 'bandwidth' or 'unfused', got {self.path!r}")
        allowed = sorted(set(LATENCY_CONFIGS + TRANSPOSED_CONFIGS + BANDWIDTH_CONFIGS))
        if self.config is not None and (isinstance(self.config, bool) or self.config not in allowed):
            raise ValueError(f"GemmArOptions.config must be None or one of {tuple(allowed)}, got {self.config!r}")
        if self.partial_dtype not in (None,) + PARTIAL_DTYPES:
            raise ValueError(f"GemmArOptions.partial_dtype must be None or one of {PARTIAL_DTYPES}, "
                             f"got {self.partial_dtype!r}")
        if not isinstance(self.transposed, bool):
            raise TypeError(f"GemmArOptions.transposed must be a bool, got {type(self.transposed).__name__}")
        if not isinstance(self.model, CostModel):
            raise TypeError(f"GemmArOptions.model must be a CostModel, got {type(self.model).__name__}")
        self.model.checked()
        return self
