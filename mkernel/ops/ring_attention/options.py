"""Options of :func:`mkernel.ring_attention` (``options=``): a frozen dataclass, part of every bound-call key."""
from __future__ import annotations

from dataclasses import dataclass

from ..base import options_hash

__all__ = ["RingAttentionOptions", "BACKWARD_KERNELS"]

BACKWARD_KERNELS = ("auto", "wgmma", "mma")


@dataclass(frozen=True)
class RingAttentionOptions:
    """Options of :func:`mkernel.ring_attention`.

    ``heavy_first``: the attention kernel's query-block order (:class:`mkernel.AttentionOptions`); it matters
    for the causal step 0 only (the persistent kernel always takes the longest query tiles first).
    ``pull_chunks``: each K/V block is pulled from its owner in this many copies (1..8) on the side stream;
    more pieces let the next step's gate run earlier on nothing, fewer cost fewer copy launches
    (docs/ring_attention.md, "Transfers").  ``persistent``: one persistent kernel per call
    instead of one launch per ring step: each query tile's online softmax runs over every step's K/V in
    registers (no partial results to merge); the workspace then holds every rank's K/V block (the memory of
    the whole sequence's K/V, as the all-gather scheme) instead of two.  One node only (across nodes the
    step path runs; the plan says which: ``RingPlan.persistent``).  docs/ring_attention.md, "One persistent
    kernel".  ``backward_kernel`` (:func:`mkernel.ring_attention_backward` only): the main kernel of its
    steps, ``"wgmma"`` (TMA + wgmma), ``"mma"`` (mma.sync) or ``"auto"`` (the default: ``"wgmma"`` unless
    TMA cannot read q, dout, k or v, e.g. a zero stride; ``RingPlan.backward_kernel`` / ``backward_fallback``
    say which ran and why); docs/ring_attention.md, "Backward"."""

    heavy_first: bool = True
    pull_chunks: int = 1
    persistent: bool = False
    backward_kernel: str = "auto"

    __hash__ = options_hash  # (hashed once: part of every bound-call key)

    def checked(self) -> "RingAttentionOptions":
        """Self, or a ValueError naming the first field out of range."""
        if self.heavy_first not in (True, False):
            raise ValueError(f"RingAttentionOptions.heavy_first must be True or False, got {self.heavy_first!r}")
        if type(self.pull_chunks) is not int or not 1 <= self.pull_chunks <= 8:
            raise ValueError(f"RingAttentionOptions.pull_chunks must be an int in 1..8, got {self.pull_chunks!r}")
        if type(self.persistent) is not bool:
            raise ValueError(f"RingAttentionOptions.persistent must be True or False, got {self.persistent!r}")
        if self.backward_kernel not in BACKWARD_KERNELS:
            raise ValueError(f"RingAttentionOptions.backward_kernel must be one of {BACKWARD_KERNELS}, got "
                             f"{self.backward_kernel!r}")
        return self
