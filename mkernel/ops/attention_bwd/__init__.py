"""Flash-attention backward on one Hopper GPU (dq, dk, dv from the forward's out and lse): docs/attention_bwd.md."""
from .kernels import BLOCK_Q, HEAD_DIMS
from .op import LAYOUTS, AttentionBwdPlan, BwdArgs, attention_backward, last_plan
from .options import AttentionBwdOptions

__all__ = ["attention_backward", "AttentionBwdOptions", "AttentionBwdPlan", "BwdArgs", "last_plan", "LAYOUTS",
           "BLOCK_Q", "HEAD_DIMS"]
