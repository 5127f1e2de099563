"""GEMM + AllReduce (row-parallel tensor parallelism without sequence parallelism, and the decode step),
fused into one persistent kernel: docs/gemm_ar.md."""
from .layout import BANDWIDTH_CONFIGS, LATENCY_CONFIGS, TRANSPOSED_CONFIGS
from .op import gemm_all_reduce
from .options import CostModel, GemmArOptions
from .planner import ArPlan

__all__ = ["gemm_all_reduce", "GemmArOptions", "CostModel", "ArPlan", "LATENCY_CONFIGS", "TRANSPOSED_CONFIGS",
           "BANDWIDTH_CONFIGS"]
