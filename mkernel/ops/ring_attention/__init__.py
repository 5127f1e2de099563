"""Ring attention across the GPUs of a node or of several nodes: :func:`ring_attention`,
:func:`ring_attention_backward`, zigzag sharding helpers.
docs/ring_attention.md."""
from .backward import ring_attention_backward
from .op import RingPlan, ring_attention
from .options import RingAttentionOptions
from .plan import classify, make_plan, zigzag_indices
from .zigzag import zigzag_shard, zigzag_unshard

__all__ = ["ring_attention", "ring_attention_backward", "RingAttentionOptions", "RingPlan", "zigzag_shard", "zigzag_unshard",
           "zigzag_indices", "classify", "make_plan"]
