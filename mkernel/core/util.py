"""Integer helpers shared by workspace layouts, strides and paddings."""
from __future__ import annotations

__all__ = ["round_up", "ceil_div"]


def round_up(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m``."""
    return (x + m - 1) // m * m


def ceil_div(x: int, m: int) -> int:
    """``ceil(x / m)`` for non-negative integers."""
    return -(-x // m)
