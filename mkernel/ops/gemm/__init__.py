"""Hopper GEMM and grouped GEMM (TMA + wgmma), and the decode-shaped kernel."""
from .engine import gemm, grouped_gemm
from . import gemv  # noqa: F401 (registers the decode-shaped kernel's specializations)

__all__ = ["gemm", "grouped_gemm"]
