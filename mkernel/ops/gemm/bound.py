"""A GEMM call bound to launches: what it runs (GemmPlan, reported by last_plan) and the bound call that
re-points its launches at each call's arrays (GemmBound), shared by the tile kernels' plans (plan.py) and the
decode kernel's (gemv.py)."""
from __future__ import annotations

from dataclasses import dataclass

from ...core.device import on_device as _on_device
from ..base import BoundCall
from . import kernels
from .operands import OperandArg

__all__ = ["GemmPlan", "GemmBound"]


@dataclass(frozen=True)
class GemmPlan:
    """What a GEMM call launches (``last_plan``): ``kind`` "tiles" (the TMA + wgmma kernel), "gemv" (the
    decode kernel), "fill" (K = 0: zeros) or "empty"; the tile ``config`` (None otherwise), whether it is
    computed transposed (``swapped``), the split-K factor of the tiles from ``split_from`` on, the grid, and
    whether it launches as a programmatic dependent."""

    kind: str
    config: int | None = None
    swapped: bool = False
    splits: int = 1
    split_from: int = 0
    grid: int = 0
    dependent: bool = False
    staged: tuple = ()  # the operands staged into padded copies first ("a", "b")

    @property
    def fallback(self) -> str:
        """Why this plan is slower than reading the operands in place ("" when it is not)."""
        if not self.staged:
            return ""
        return (f"{' and '.join(self.staged)} staged into padded copies first (TMA needs 16-byte aligned bases and "
                "row strides and a unit inner stride)")


class GemmBound(BoundCall):
    """A GEMM bound to one layout of its operands: prepared launches (staging copies, the kernel), the
    operands' re-pointable tensor maps or staging sources, and a setter of the output's (and device group
    offsets') fields.  Each call re-points them and submits, in the context the launches were prepared in."""

    def __init__(self, plan: GemmPlan, pre: list, launch, a: OperandArg | None, b: OperandArg | None, set_ptrs,
                 buffers: list, clears: tuple = ()):
        self.plan, self._pre, self._launch, self._a, self._b, self._set = plan, pre, launch, a, b, set_ptrs
        self.buffers, self.clears = tuple(buffers), clears
        self._ctx, self._device = kernels.context()

    def run(self, stream, call) -> None:
        A, B = (call.B, call.A) if self.plan.swapped else (call.A, call.B)
        if self._a is not None:
            self._a.point(A.ptr)
            self._b.point(B.ptr)
        self._set(call)
        if kernels.context_handle() != self._ctx:
            with _on_device(self._device):
                self._submit()
        else:
            self._submit()

    def _submit(self) -> None:
        for p in self._pre:
            p.submit()
        if self._launch is not None:
            self._launch.submit()
