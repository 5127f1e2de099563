"""How a GEMM is planned: the options object (``options=``) and its defaults.

The defaults are the heuristic's (docs/gemm.md, "Configurations"); the ``MKERNEL_GEMM_*`` overrides of
:mod:`mkernel.core.env` apply to the default object only (experiments, benchmarks comparing plans).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ...core import env
from ..base import options_hash
from .configs import CONFIGS

__all__ = ["GemmOptions"]


@dataclass(frozen=True)
class GemmOptions:
    """Options of :func:`mkernel.gemm` and :func:`mkernel.grouped_gemm`.

    ``config``: force a tile config id (``CONFIGS``; the heuristic still picks its split plan);
    ``splits``: force the split-K factor on every tile (clamped to what the config allows); ``swap``: force
    (True) or forbid (False) computing a B "nk" call transposed (``C^T = B A^T``).  Forcing any of the three
    takes the call off the decode kernel.  ``candidates``: restrict the heuristic's configs (ids; ignored
    where none of them applies).  ``pdl``: programmatic dependent launches always (True), never (False) or
    where the heuristic says (None).  ``epilogue``: "tma" (TMA stores where the config stages its output)
    or "registers".  ``gemv``: let decode-shaped calls (M <= 16, B "nk") take the decode kernel;
    ``transposed``: let the heuristic choose transposed plans.  ``deterministic``: bit-identical results call
    after call: no split-K plan (its blocks add their partial tiles in arrival order); the decode kernel and
    cluster split-K (a fixed order) stay allowed (docs/gemm.md, "Determinism")."""

    config: int | None = None
    splits: int | None = None
    swap: bool | None = None
    candidates: tuple | None = None
    pdl: bool | None = None
    epilogue: str = "tma"
    gemv: bool = True
    transposed: bool = True
    deterministic: bool = False

    __hash__ = options_hash  # (hashed once: part of every bound-call key)

    @classmethod
    def default(cls) -> "GemmOptions":
        """The defaults with the environment's overrides (cached until :func:`mkernel.core.env.reload`)."""
        gen = env.generation()
        if _default[0] != gen:
            o = cls(config=env.get("MKERNEL_GEMM_CONFIG"), candidates=env.get("MKERNEL_GEMM_CANDIDATES"),
                    pdl=env.get("MKERNEL_GEMM_PDL"), epilogue=env.get("MKERNEL_GEMM_EPILOGUE", "tma"),
                    gemv=env.get("MKERNEL_GEMM_GEMV") is not False,
                    transposed=env.get("MKERNEL_GEMM_SWAP") is not False)
            _default[:] = [gen, o.checked()]
        return _default[1]

    def with_forced(self, config=None, splits=None, swap=None) -> "GemmOptions":
        """These options with the keyword overrides of :func:`mkernel.gemm` (None: keep)."""
        if config is None and splits is None and swap is None:
            return self
        return replace(self, config=self.config if config is None else config,
                       splits=self.splits if splits is None else splits, swap=self.swap if swap is None else swap)

    @property
    def forced(self) -> bool:
        """A config, a split factor or an orientation is forced."""
        return self.config is not None or self.splits is not None or self.swap is not None

    def checked(self) -> "GemmOptions":
        """Self, or a ValueError naming the first field out of range."""
        if self.config is not None and self.config not in CONFIGS:
            raise ValueError(f"GemmOptions.config: unknown config {self.config}; known: {sorted(CONFIGS)}")
        if self.splits is not None and (not isinstance(self.splits, int) or self.splits < 1):
            raise ValueError(f"GemmOptions.splits must be None or an int >= 1, got {self.splits!r}")
        if self.epilogue not in ("tma", "registers"):
            raise ValueError(f"GemmOptions.epilogue must be 'tma' or 'registers', got {self.epilogue!r}")
        if self.deterministic not in (True, False):
            raise ValueError(f"GemmOptions.deterministic must be True or False, got {self.deterministic!r}")
        if self.deterministic and self.splits is not None and self.splits > 1:
            raise ValueError(f"GemmOptions: splits={self.splits} adds partial tiles in arrival order; "
                             "it cannot be deterministic")
        for name in ("swap", "pdl"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"GemmOptions.{name} must be None, True or False, got {getattr(self, name)!r}")
        if self.candidates is not None and not all(c in CONFIGS for c in self.candidates):
            raise ValueError(f"GemmOptions.candidates: unknown configs in {self.candidates}")
        return self


_default: list = [None, None]
