"""Options of :func:`mkernel.attention` (``options=``): a frozen dataclass, part of every bound-call key."""
from __future__ import annotations

from dataclasses import dataclass

from ..base import options_hash

__all__ = ["AttentionOptions"]


@dataclass(frozen=True)
class AttentionOptions:
    """Options of :func:`mkernel.attention`.

    ``heavy_first``: launch the query blocks from the last one to the first.  With ``causal=True`` the last
    blocks have the most keys to visit; starting them first keeps the tail of the grid short (the blocks
    that run last are the cheap ones).  Without a mask every block costs the same and the order does not
    matter.  docs/attention.md, "Kernel".

    ``schedule``: which forward kernel runs.  ``"default"``: two consumer warpgroups of 64 query rows that
    overlap their own softmax with their own matrix products.  ``"pingpong"``: the consumer warpgroups also
    take turns issuing their matrix products, so one's softmax runs under another's GEMMs
    (FlashAttention-3's inter-warpgroup schedule; at D = 64 three consumer warpgroups and 192-row query
    blocks).  ``"auto"`` (the default): ping-pong at D = 64, and at D = 128 below 8192 keys; the default
    schedule from 8192 keys at D = 128, where it measured as fast or faster (docs/attention.md,
    "Ping-pong schedule")."""

    heavy_first: bool = True
    schedule: str = "auto"

    __hash__ = options_hash  # (hashed once: part of every bound-call key)

    def checked(self) -> "AttentionOptions":
        """Self, or a ValueError naming the first field out of range."""
        if self.heavy_first not in (True, False):
            raise ValueError(f"AttentionOptions.heavy_first must be True or False, got {self.heavy_first!r}")
        if self.schedule not in ("auto", "default", "pingpong"):
            raise ValueError(f"AttentionOptions.schedule must be 'auto', 'default' or 'pingpong', got "
                             f"{self.schedule!r}")
        return self
