"""How GEMM+ReduceScatter runs: the options object (``options=``) and the planner's cost model.

Every rank must pass equal options (they are part of the agreed call signature).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields

__all__ = ["GemmRsOptions", "CostModel", "PATHS", "PARTIAL_DTYPES"]

PATHS = ("fused", "unfused")
PARTIAL_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class CostModel:
    """The planner's constants (H200, NVLink 4 through NVSwitch); times in seconds, rates per second."""

    gemm_rate: float = 700e12       # dense bf16/fp16 FLOP/s of the whole GPU (mkernel.gemm measured 705-712)
    link_bw: float = 300e9          # B/s a GPU sends (and receives) over NVLink with SM stores (all-gather
                                    # 1 GiB: 276-291 GB/s)
    sm_push_bw: float = 20e9        # B/s one SM's register stores into a peer (ag_gemm's per-block rate): a
                                    # peer tile's epilogue holds its SM for tile_bytes / sm_push_bw at least
    sm_read_bw: float = 40e9        # B/s one SM's L2 reads of the peers' partials in an own tile's epilogue
    rs_bw: float = 270e9            # B/s per link direction of the unfused reduce-scatter (mkernel.reduce_scatter,
                                    # SM path; docs/collectives.md)
    rs_latency: float = 12e-6       # s a reduce-scatter call costs beyond its bytes (launch, flag round trips)
    launch_latency: float = 6e-6    # s per kernel launch
    fuse_margin: float = 0.97       # fuse only if predicted fused < margin x predicted unfused

    def checked(self) -> "CostModel":
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"CostModel.{f.name} must be a number > 0, got {v!r}")
        return self


@dataclass(frozen=True)
class GemmRsOptions:
    """Options of :func:`mkernel.gemm_reduce_scatter`.

    ``path``: "fused" (one kernel: GEMM tiles pushed to their owners as they finish) or "unfused"
    (:func:`mkernel.gemm` then :func:`mkernel.reduce_scatter`); None: the planner's choice by predicted
    time.  ``config``: the fused kernel's tile config (``mkernel.ops.gemm_rs.FUSED_CONFIGS``; None: the
    GEMM's heuristic over them).  ``partial_dtype``: the dtype the fused kernel sends partial tiles in
    (None: out's; "float32" with a 16-bit out doubles the bytes sent and keeps every partial exact to
    fp32; the unfused path always reduces in out's dtype).  ``m_sizes``: rows of the result each local
    rank keeps, in local-rank order (any sequence of ints; None: M split as evenly as possible, the
    first M % P ranks one more row).  ``model``: the planner's constants.
    """

    path: str | None = None
    config: int | None = None
    partial_dtype: str | None = None
    m_sizes: tuple | None = None
    model: CostModel = field(default_factory=CostModel)

    def __post_init__(self):
        if self.m_sizes is not None:  # any sequence of integers (numpy's too) -> a tuple of ints
            try:
                object.__setattr__(self, "m_sizes", tuple(operator.index(m) for m in self.m_sizes))
            except TypeError:
                pass  # (checked() names it)

    def checked(self) -> "GemmRsOptions":
        """Self, or a ValueError / TypeError naming the first field out of range."""
        from .layout import FUSED_CONFIGS

        if self.path not in (None,) + PATHS:
            raise ValueError(f"GemmRsOptions.path must be None, 'fused' or 'unfused', got {self.path!r}")
        if self.config is not None and self.config not in FUSED_CONFIGS:
            raise ValueError(f"GemmRsOptions.config must be None or one of {FUSED_CONFIGS}, got {self.config!r}")
        if self.partial_dtype not in (None,) + PARTIAL_DTYPES:
            raise ValueError(f"GemmRsOptions.partial_dtype must be None or one of {PARTIAL_DTYPES}, "
                             f"got {self.partial_dtype!r}")
        if self.m_sizes is not None:
            if not isinstance(self.m_sizes, tuple) or not all(isinstance(m, int) and not isinstance(m, bool)
                                                              and m >= 0 for m in self.m_sizes):
                raise ValueError(f"GemmRsOptions.m_sizes must be a tuple of ints >= 0, got {self.m_sizes!r}")
        if not isinstance(self.model, CostModel):
            raise TypeError(f"GemmRsOptions.model must be a CostModel, got {type(self.model).__name__}")
        self.model.checked()
        return self
