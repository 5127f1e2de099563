"""MoE expert parallelism on one node: routing, dispatch, combine and the layer: docs/moe.md."""
from .layout import MoeLayout, MoeShape
from .op import MoePlan, MoeRouting, moe_combine, moe_dispatch, moe_route
from .fused import moe_dispatch_gemm
from .fused_combine import moe_gemm_combine
from .layer import moe_layer
from . import internode  # the inter-node ops (registers them with op.ACROSS_NODES)
from .options import MoeOptions
from . import reference

__all__ = ["moe_route", "moe_dispatch", "moe_combine", "moe_layer", "moe_dispatch_gemm", "moe_gemm_combine", "MoeRouting", "MoeOptions", "MoePlan",
           "MoeLayout", "MoeShape", "reference"]
