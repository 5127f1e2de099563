"""GEMM + ReduceScatter (row-parallel tensor parallelism), fused into one persistent kernel: docs/gemm_rs.md."""
from .layout import FUSED_CONFIGS
from .op import gemm_reduce_scatter
from .options import CostModel, GemmRsOptions
from .planner import RsPlan

__all__ = ["gemm_reduce_scatter", "GemmRsOptions", "CostModel", "RsPlan", "FUSED_CONFIGS"]
