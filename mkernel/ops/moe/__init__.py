"""MoE expert parallelism on one node: routing, dispatch, combine and the layer: docs/moe.md."""
from .layout import MoeLayout, MoeShape
from .op import MoePlan, MoeRouting, moe_combine, moe_dispatch, moe_layer, moe_route
from .options import MoeOptions
from . import reference

__all__ = ["moe_route", "moe_dispatch", "moe_combine", "moe_layer", "MoeRouting", "MoeOptions", "MoePlan",
           "MoeLayout", "MoeShape", "reference"]
