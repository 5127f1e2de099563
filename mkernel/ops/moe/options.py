"""How the MoE ops run: the options object (``options=``) of :func:`mkernel.moe_route`,
:func:`mkernel.moe_dispatch`, :func:`mkernel.moe_combine` and :func:`mkernel.moe_layer`.

Every rank must pass equal options (they are part of the agreed call signature).  docs/moe.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..base import options_hash

__all__ = ["MoeOptions", "SOFTMAX_MODES", "MODES", "FUSED_CONFIGS", "LOW_LATENCY_MAX_TOKENS"]

SOFTMAX_MODES = ("topk", "all")
MODES = ("throughput", "low_latency")
FUSED_CONFIGS = (1, 2, 3, 4, 5)  # GEMM tile configs of the fused kernel (cooperative, unclustered: docs/gemm.md)
LOW_LATENCY_MAX_TOKENS = 256  # tokens per rank in low-latency mode (moe.cu MOE_TILE: one routing tile)


@dataclass(frozen=True)
class MoeOptions:
    """Options of the MoE ops (docs/moe.md).

    ``softmax`` (routing from logits): "topk" -- the weights are the softmax over the k chosen logits;
    "all" -- the softmax over all E experts, taken at the k chosen (not renormalised: they sum to < 1).
    (Softmax over all E then renormalised over the top-k equals "topk".)
    ``expert_capacity``: rows each expert receives at most (per receiving rank, over all sources; pairs
    beyond it are dropped, the highest (source rank, token) first); ``capacity_factor``: the same as
    ``ceil(factor * P * T * k / E)`` rows; both None: dropless.  ``recv_rows``: rows of the receive buffer
    (None: the worst case ``P * T * min(k, E_local)``, or ``E_local * capacity`` when smaller); pairs that
    would land beyond it are dropped.  ``blocks``: blocks of the dispatch and combine kernels (0: one
    per SM).

    ``mode``: "throughput" (route, then dispatch: docs/moe.md) or "low_latency" (<= 256 tokens per rank,
    dropless: :func:`mkernel.moe_dispatch` routes and dispatches in one kernel with fixed-size buffers;
    docs/moe.md "Low-latency mode").  ``fused``: :func:`mkernel.moe_layer` runs the dispatch fused with
    the gate/up grouped GEMM (:func:`mkernel.moe_dispatch_gemm`; throughput mode only).  ``comm_blocks``:
    communication blocks of the fused kernel (0: chosen from the SM share); ``gemm_config``: its GEMM tile
    config (None: chosen; one of ``FUSED_CONFIGS``).  ``swiglu_epilogue``: :func:`mkernel.moe_layer` computes
    SwiGLU in the gate/up GEMM's epilogue (``mkernel.ops.gemm.grouped_gemm_swiglu``, or with ``fused`` the
    fused kernel's SwiGLU variant, ``moe_dispatch_gemm(..., swiglu=True)``: h is never written) where F suits
    that GEMM's configs, else the separate SwiGLU kernel (the layer's plan says which: ``MoePlan.swiglu``;
    docs/moe.md "SwiGLU epilogue": on by default, it never writes h).

    ``node_dedup`` (across nodes; no effect on one node): :func:`mkernel.moe_dispatch` sends a token row
    once per destination *node* (to the rank of this local rank there, which forwards it over NVLink) and
    :func:`mkernel.moe_combine` returns one fp32 partial sum per node (docs/moe.md, "Node-level
    de-duplication"); the op's plan says which (``MoePlan.transport``: "node" or "rank").  A combine with
    it needs a routing last dispatched with it.  Off by default: on the GPU it fails after calls of the
    per-rank path (docs/moe.md, "Node-level de-duplication", known failure).

    ``fused_combine``: :func:`mkernel.moe_layer` runs the down grouped GEMM fused with the combine
    (:func:`mkernel.moe_gemm_combine`: each output tile stored straight into its token owner's combine
    staging, the owners' sums started as their rows land; throughput mode only; GPU-tested, off until
    measured faster:
    docs/moe.md "Down GEMM + combine, fused"); ``comm_blocks`` and ``gemm_config`` apply to that kernel too
    (its sum blocks, its tile config).

    ``one_kernel``: :func:`mkernel.moe_layer` runs everything after the routing -- dispatch, gate/up grouped GEMM
    with SwiGLU in its epilogue, down grouped GEMM, combine -- as one persistent kernel (docs/moe.md, "The layer
    in one kernel"), where F is a multiple of a fused config's pair width and out has x's dtype, else the path
    the other options choose (the layer's plan says which: ``MoePlan.combine == "layer"``); throughput mode
    only; ``comm_blocks`` and ``gemm_config`` apply to it.  Off until GPU-validated.
    """

    softmax: str = "topk"
    expert_capacity: int | None = None
    capacity_factor: float | None = None
    recv_rows: int | None = None
    blocks: int = 0
    mode: str = "throughput"
    fused: bool = False
    comm_blocks: int = 0
    gemm_config: int | None = None
    swiglu_epilogue: bool = True
    node_dedup: bool = False
    fused_combine: bool = False
    one_kernel: bool = False

    __hash__ = options_hash

    def checked(self) -> "MoeOptions":
        """Self, or a ValueError naming the first field out of range."""
        if self.softmax not in SOFTMAX_MODES:
            raise ValueError(f"MoeOptions.softmax must be one of {SOFTMAX_MODES}, got {self.softmax!r}")
        for name in ("expert_capacity", "recv_rows"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 < v < 2 ** 31):
                raise ValueError(f"MoeOptions.{name} must be None or an int in [1, 2**31), got {v!r}")
        cf = self.capacity_factor
        if cf is not None and (not isinstance(cf, (int, float)) or isinstance(cf, bool) or not 0 < cf < 1e6):
            raise ValueError(f"MoeOptions.capacity_factor must be None or a number > 0, got {cf!r}")
        if cf is not None and self.expert_capacity is not None:
            raise ValueError("MoeOptions: give expert_capacity or capacity_factor, not both")
        if not isinstance(self.blocks, int) or isinstance(self.blocks, bool) or not 0 <= self.blocks <= 1024:
            raise ValueError(f"MoeOptions.blocks must be an int in [0, 1024], got {self.blocks!r}")
        if self.mode not in MODES:
            raise ValueError(f"MoeOptions.mode must be one of {MODES}, got {self.mode!r}")
        for name in ("fused", "swiglu_epilogue", "node_dedup", "fused_combine", "one_kernel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MoeOptions.{name} must be a bool, got {getattr(self, name)!r}")
        if self.mode == "low_latency":
            if self.fused or self.fused_combine or self.one_kernel:
                raise ValueError("MoeOptions: fused=True, fused_combine=True and one_kernel=True are throughput-mode "
                                 "paths (mode='throughput')")
            if self.expert_capacity is not None or self.capacity_factor is not None or self.recv_rows is not None:
                raise ValueError("MoeOptions: low-latency mode is dropless with fixed buffers: no expert_capacity, "
                                 "capacity_factor or recv_rows")
        c = self.comm_blocks
        if not isinstance(c, int) or isinstance(c, bool) or not 0 <= c <= 1024:
            raise ValueError(f"MoeOptions.comm_blocks must be an int in [0, 1024], got {c!r}")
        if self.gemm_config is not None and self.gemm_config not in FUSED_CONFIGS:
            raise ValueError(f"MoeOptions.gemm_config must be None or one of {FUSED_CONFIGS}, got {self.gemm_config!r}")
        return self
