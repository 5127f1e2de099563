"""GEMM + ReduceScatter (row-parallel tensor parallelism), fused into one persistent kernel."""
from . import layout  # noqa: F401 (registers the fused kernel's specializations)
