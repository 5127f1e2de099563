"""Flash attention on Hopper (single GPU): :func:`attention` (forward).  docs/attention.md."""
from .op import attention, last_plan
from .options import AttentionOptions

__all__ = ["attention", "last_plan", "AttentionOptions"]
