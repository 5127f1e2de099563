"""Hopper GEMM and grouped GEMM (TMA + wgmma), and the decode-shaped kernel.  docs/gemm.md.

Public API: :func:`gemm`, :func:`grouped_gemm`, :func:`grouped_gemm_swiglu` (the gate/up GEMM with SwiGLU in
its epilogue), :class:`GemmOptions`, :func:`describe` (what a call would
launch), :func:`last_plan` (what the latest call launched), :func:`precompile`.

Planning API for ops built on the GEMM's kernels (AllGather+GEMM; a fused kernel includes
``cuda_src/gemm/mk_gemm_configs.cuh`` and is compiled with :func:`defines`):

* configs -- :class:`TileConfig`, ``CONFIGS`` (id -> TileConfig), ``DTYPE_CODES``, ``IN_DTYPES``,
  ``OUT_DTYPES``, ``GROUP_M`` (the raster's super-row height), :func:`defines` (a specialization's
  preprocessor defines);
* cost model and plan choice (pure functions of shapes) -- :func:`choose_config`, :func:`config_cost`,
  :func:`auto_plan` (a plain GEMM's config and split-K plan), :func:`split_plan`, :func:`split_cost`,
  :func:`max_splits_for`, :func:`tile_count`, :func:`scheduler_units`, :func:`workers`,
  :func:`misaligned_rows`, :func:`load_bound`, ``TAIL_SPLIT_MIN_GAIN``;
* operands -- :func:`check_operands` / :func:`check_arrays`, :func:`a_arg` / :func:`b_arg` (a re-pointable
  :class:`OperandArg`: tensor map, staging launch, buffers to keep), :func:`c_arg` (the output's
  re-pointable map), :func:`layout_key` (what a bound call depends on of an array but its address),
  :func:`split_workspace` and :class:`ClearBeforeFirstUse` (split-K sums and counters); the older
  :func:`a_operand` / :func:`b_operand` / :func:`c_map` / :func:`point_out` return encoded bytes.
"""
from .api import gemm, grouped_gemm, grouped_gemm_swiglu, last_plan, precompile
from .options import GemmOptions
from .plan import GemmPlan, describe
from . import gemv  # noqa: F401 (registers the decode-shaped kernel's specializations)
from .configs import CONFIGS, DTYPE_CODES, GROUP_M, IN_DTYPES, OUT_DTYPES, TileConfig, defines
from .heuristic import (SMALL_M, SWAP_MAX_M, TAIL_SPLIT_MIN_GAIN, auto_plan, choose_config, config_cost, load_bound,
                        max_splits_for, misaligned_rows, scheduler_units, split_cost, split_plan, tile_count, workers)
from .operands import (ClearBeforeFirstUse, OperandArg, a_arg, a_operand, array_key, b_arg, b_operand, c_arg, c_map,
                       check_arrays, check_operands, gate_up_arg, layout_key, out_layout_key, point_out, split_workspace)
from .swiglu import SWIGLU_CONFIGS, pair_width, swiglu_candidates

__all__ = [
    "gemm", "grouped_gemm", "grouped_gemm_swiglu", "GemmOptions", "GemmPlan", "describe", "last_plan", "precompile",
    # planning API
    "TileConfig", "CONFIGS", "DTYPE_CODES", "IN_DTYPES", "OUT_DTYPES", "GROUP_M", "defines",
    "choose_config", "config_cost", "auto_plan", "split_plan", "split_cost", "max_splits_for", "tile_count",
    "scheduler_units", "workers", "misaligned_rows", "load_bound", "TAIL_SPLIT_MIN_GAIN", "SMALL_M", "SWAP_MAX_M",
    "check_operands", "check_arrays", "a_operand", "b_operand", "c_map", "point_out", "array_key", "out_layout_key",
    "OperandArg", "a_arg", "b_arg", "gate_up_arg", "c_arg", "layout_key",
    "SWIGLU_CONFIGS", "pair_width", "swiglu_candidates",
    "split_workspace", "ClearBeforeFirstUse",
]
