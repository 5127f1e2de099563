"""AllGather + GEMM (column-parallel tensor parallelism) in one persistent kernel."""
from .op import ag_gemm

__all__ = ["ag_gemm"]
