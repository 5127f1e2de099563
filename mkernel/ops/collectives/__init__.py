"""GPU-driven collectives (all-gather, reduce-scatter, all-reduce) over NVLink and, across nodes, the proxy."""
from .api import CollPlan, all_gather, all_reduce, reduce_scatter
from .options import CollectiveOptions

__all__ = ["all_gather", "reduce_scatter", "all_reduce", "CollectiveOptions", "CollPlan"]
