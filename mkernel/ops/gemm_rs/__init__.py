"""GEMM + ReduceScatter (row-parallel tensor parallelism), fused into one persistent kernel."""
from .layout import FUSED_CONFIGS
from .options import CostModel, GemmRsOptions
from .planner import RsPlan

__all__ = ["GemmRsOptions", "CostModel", "RsPlan", "FUSED_CONFIGS"]
