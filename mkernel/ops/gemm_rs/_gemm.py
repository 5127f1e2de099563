"""The GEMM planning API GEMM+ReduceScatter builds on: the public names of :mod:`mkernel.ops.gemm`
(tile configs, the specialization defines, the tile-cost model).  One import place, so the op never
reaches into the GEMM's modules."""
from __future__ import annotations

try:
    from ..gemm import (CONFIGS, GROUP_M, OUT_DTYPES, IN_DTYPES, TileConfig, auto_plan, choose_config,  # noqa: F401
                        config_cost, defines, tile_count, workers)
except ImportError:  # the GEMM package before its planning API was split out (engine.py)
    from ..gemm import engine as _E

    CONFIGS, GROUP_M, OUT_DTYPES, IN_DTYPES, TileConfig = (_E.CONFIGS, _E.GROUP_M, _E.OUT_DTYPES, _E.IN_DTYPES,
                                                           _E.TileConfig)
    auto_plan, choose_config, config_cost, defines = _E._auto_plan, _E.choose_config, _E.config_cost, _E._defines
    tile_count, workers = _E._tiles, _E.workers

__all__ = ["CONFIGS", "GROUP_M", "OUT_DTYPES", "IN_DTYPES", "TileConfig", "auto_plan", "choose_config", "config_cost",
           "defines", "tile_count", "workers"]
