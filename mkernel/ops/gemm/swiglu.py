"""The grouped gate/up GEMM with SwiGLU in its epilogue (:func:`grouped_gemm_swiglu`,
``cuda_src/gemm/gemm_swiglu.cu``): which tile configs it runs on and what F each needs.

Each consumer warpgroup's ``WN`` accumulator columns hold ``pair_width = WN / 2`` gate columns and the
matching up columns (the weight is read through a paired TMA view, not re-laid out), so F must be a
multiple of a candidate config's pair width.  docs/moe.md, "SwiGLU epilogue".
"""
from __future__ import annotations

from ...core.compiler import register_specialization
from .configs import CONFIGS, GROUPED_CANDIDATES, IN_DTYPES, TileConfig, defines

__all__ = ["SOURCE", "KERNEL", "SWIGLU_CONFIGS", "pair_width", "swiglu_candidates"]

SOURCE = "gemm/gemm_swiglu.cu"
KERNEL = "mk_grouped_gemm_swiglu"
# the grouped GEMM's candidates (no clusters: a cluster's blocks would straddle groups)
SWIGLU_CONFIGS = GROUPED_CANDIDATES


def pair_width(cfg: TileConfig | int) -> int:
    """Gate columns per consumer warpgroup accumulator (MkGateUpB::PAIR): half its ``WN`` columns."""
    c = CONFIGS[cfg] if isinstance(cfg, int) else cfg
    return c.tile_n("nk") // c.wg_n // 2


def swiglu_candidates(F: int) -> tuple:
    """The configs whose pair width divides ``F`` (empty: the fused epilogue cannot run this F)."""
    return tuple(c for c in SWIGLU_CONFIGS if F > 0 and F % pair_width(c) == 0)


for _dt in IN_DTYPES:  # act in the input's dtype
    for _c in SWIGLU_CONFIGS:
        register_specialization(SOURCE, defines(_dt, _dt, _c))
