"""AllGather + GEMM (column-parallel tensor parallelism) in one persistent kernel: docs/ag_gemm.md.

Modules: :mod:`.options` (AgGemmOptions), :mod:`.planner` (CostModel, AgPlan, plan: pure functions),
:mod:`.layout` (the kernel's argument struct and workspace), :mod:`.op` (the op on the pipeline)."""
from .op import ag_gemm, precompile
from .options import AgGemmOptions
from .planner import PATHS, AgPlan, CostModel

__all__ = ["ag_gemm", "AgGemmOptions", "AgPlan", "CostModel", "PATHS", "precompile"]
