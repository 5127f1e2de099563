"""Ring attention forward across the GPUs of a node: :func:`ring_attention`, zigzag sharding helpers.
docs/ring_attention.md."""
from .op import RingPlan, ring_attention
from .options import RingAttentionOptions
from .plan import classify, make_plan, zigzag_indices
from .zigzag import zigzag_shard, zigzag_unshard

__all__ = ["ring_attention", "RingAttentionOptions", "RingPlan", "zigzag_shard", "zigzag_unshard",
           "zigzag_indices", "classify", "make_plan"]
