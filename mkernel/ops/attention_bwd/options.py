"""How the attention backward runs: the options object (``options=`` of :func:`mkernel.attention_backward`)."""
from __future__ import annotations

from dataclasses import dataclass

from ..base import options_hash

__all__ = ["AttentionBwdOptions"]


@dataclass(frozen=True)
class AttentionBwdOptions:
    """Options of :func:`mkernel.attention_backward`.

    ``deterministic``: dQ by a second kernel that sums each query block's dS K over the KV blocks in a
    fixed order (bit-identical results from run to run, about 1.5x the work) instead of fp32 atomics
    from every KV block (the default: run-to-run differences of fp32 rounding in dQ; dK and dV are
    deterministic either way).  The ``deterministic=True`` argument of the function sets it too.
    ``block_q``: query rows per step of the main kernel (None: 64 for head dim 64, 32 for 128; a
    registered value of ``mkernel.ops.attention_bwd.BLOCK_Q``; the mma kernel only).
    ``kernel``: the main kernel, ``"mma"`` (mma.sync) or ``"wgmma"`` (TMA + wgmma, warp-specialized, 128 KV
    rows x 64 query rows per step; docs/attention_bwd.md, "wgmma kernel"); ``"auto"`` (the default):
    ``"wgmma"``, or ``"mma"`` when ``block_q`` is given.  The deterministic mode with ``"wgmma"`` runs it
    for dK, dV and the mma path's dQ kernel.
    """

    deterministic: bool = False
    block_q: int | None = None
    kernel: str = "auto"

    __hash__ = options_hash

    def checked(self) -> "AttentionBwdOptions":
        """Self, or a ValueError / TypeError naming the first bad field."""
        from .kernels import BLOCK_Q, KERNELS

        if not isinstance(self.deterministic, bool):
            raise TypeError(f"AttentionBwdOptions.deterministic must be a bool, got {self.deterministic!r}")
        if self.block_q is not None and self.block_q not in BLOCK_Q:
            raise ValueError(f"AttentionBwdOptions.block_q must be None or one of {BLOCK_Q}, got {self.block_q!r}")
        if self.kernel != "auto" and self.kernel not in KERNELS:
            raise ValueError(f"AttentionBwdOptions.kernel must be 'auto' or one of {KERNELS}, got {self.kernel!r}")
        if self.kernel == "wgmma" and self.block_q is not None:
            raise ValueError("AttentionBwdOptions.block_q applies to kernel='mma' only (the wgmma kernel's query "
                             f"block is fixed), got block_q={self.block_q!r} with kernel='wgmma'")
        return self

    def main_kernel(self) -> str:
        """The main kernel that runs: ``kernel``, where ``"auto"`` is ``"wgmma"`` (about twice the mma
        kernel's speed on the H200) unless ``block_q`` names an mma specialization."""
        if self.kernel != "auto":
            return self.kernel
        return "mma" if self.block_q is not None else "wgmma"
