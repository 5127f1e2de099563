"""How AllGather+GEMM runs: the options object (``options=``) and its defaults.

The defaults are the planner's automatic choices (docs/ag_gemm.md, "Design"); the ``MKERNEL_AG_GEMM_*``
overrides of :mod:`mkernel.core.env` apply to the default object only (experiments, benchmarks comparing
plans).  ``path``, ``comm_sms`` and ``config`` are part of the signature the local ranks exchange: ranks
passing different values raise before anything is launched.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field, replace

from ...core import env
from ..base import options_hash
from .layout import FUSED_CONFIGS
from .planner import PATHS, CostModel

__all__ = ["AgGemmOptions", "CostModel", "PATHS"]


@dataclass(frozen=True)
class AgGemmOptions:
    """Options of :func:`mkernel.ag_gemm`.

    ``path``: force "fused_ce" (copy-engine communication), "fused" (SM communication) or "unfused";
    None lets the cost model decide.  ``comm_sms``: communication blocks of the "fused" kernel (an int
    > 0 forces that path with that many), 0 forces "unfused", None lets the model decide.  ``config``:
    force the fused kernel's tile config (``FUSED_CONFIGS``, or 0: the debug config).  ``tail_split``:
    split the fused kernel's partial last wave (and, on the copy-engine path, the tiles the late chunks
    feed) along K where the model predicts any gain (True), never (False), or where it predicts a 4 %
    gain (None).  ``fused_auto``: let the automatic plan choose "fused" too (off: on 2 x H200 it lost to
    "fused_ce" on three of five probe shapes and its model is not calibrated; docs/journal/validation.md,
    docs/journal/ag_gemm.md).  ``model``: the planner's constants (:class:`CostModel`).
    """

    path: str | None = None
    comm_sms: int | None = None
    config: int | None = None
    tail_split: bool | None = None
    fused_auto: bool = False
    model: CostModel = field(default_factory=CostModel)

    def __post_init__(self):
        for name in ("comm_sms", "config"):  # numpy's integers too -> int (a bool stays: checked() names it)
            v = getattr(self, name)
            if isinstance(v, numbers.Integral) and not isinstance(v, (bool, int)):
                object.__setattr__(self, name, int(v))

    __hash__ = options_hash  # (hashed once: part of every bound-call key)

    @classmethod
    def default(cls) -> "AgGemmOptions":
        """The defaults with the environment's overrides (cached until :func:`mkernel.core.env.reload`):
        ``MKERNEL_AG_GEMM_PATH`` (path), ``MKERNEL_AG_GEMM_TAIL_SPLIT`` (tail_split: auto, 0 or 1),
        ``MKERNEL_AG_GEMM_FUSED_AUTO`` (fused_auto: 1), ``MKERNEL_AG_GEMM_MODEL`` (``field=value,...`` of the
        model, e.g. ``per_block_bw=15e9,link_bw=280e9``)."""
        gen = env.generation()
        if _default[0] != gen:
            path = env.get("MKERNEL_AG_GEMM_PATH")
            if path is not None and path not in PATHS:
                raise ValueError(f"mkernel: MKERNEL_AG_GEMM_PATH must be one of {PATHS}, got {path!r}")
            o = cls(path=path, tail_split=env.get("MKERNEL_AG_GEMM_TAIL_SPLIT"),
                    fused_auto=env.get("MKERNEL_AG_GEMM_FUSED_AUTO") is True,
                    model=CostModel.from_spec(env.get("MKERNEL_AG_GEMM_MODEL", "")))
            _default[:] = [gen, o.checked(), {}]
        return _default[1]

    def with_forced(self, path=None, comm_sms=None, config=None) -> "AgGemmOptions":
        """These options with the keyword overrides of :func:`mkernel.ag_gemm` (None: keep).  The result of
        the same overrides of the default options is the same object every call (a cheap key)."""
        if path is None and comm_sms is None and config is None:
            return self
        memo = _default[2] if self is _default[1] else None
        k = (path, comm_sms, config)
        try:
            o = memo.get(k) if memo is not None else None
        except TypeError:  # (an unhashable override: checked() names it)
            memo = o = None
        if o is None:
            o = replace(self, path=self.path if path is None else path,
                        comm_sms=self.comm_sms if comm_sms is None else comm_sms,
                        config=self.config if config is None else config)
            if memo is not None:
                if len(memo) >= 256:
                    memo.clear()
                memo[k] = o
        return o

    def checked(self) -> "AgGemmOptions":
        """Self, or a ValueError / TypeError naming the first field out of range."""
        if self.path not in (None,) + PATHS:
            raise ValueError(f"AgGemmOptions.path must be None or one of {PATHS}, got {self.path!r}")
        c = self.comm_sms
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 0):
            raise ValueError(f"AgGemmOptions.comm_sms must be None or an int >= 0, got {c!r}")
        if self.config is not None and (isinstance(self.config, bool) or self.config not in (0,) + FUSED_CONFIGS):
            raise ValueError(f"AgGemmOptions.config {self.config!r} is not one of the fused kernel's tile configs "
                             f"{[0, *FUSED_CONFIGS]} (mkernel.ops.gemm.CONFIGS)")
        if self.tail_split not in (None, True, False):
            raise ValueError(f"AgGemmOptions.tail_split must be None, True or False, got {self.tail_split!r}")
        if self.fused_auto not in (True, False):
            raise ValueError(f"AgGemmOptions.fused_auto must be True or False, got {self.fused_auto!r}")
        if not isinstance(self.model, CostModel):
            raise TypeError(f"AgGemmOptions.model must be a CostModel, got {type(self.model).__name__}")
        self.model.checked()
        return self


_default: list = [None, None, {}]  # [env generation, the default options, with_forced memo of them]
