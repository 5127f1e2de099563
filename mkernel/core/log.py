"""mkernel's logger, ``logging.getLogger("mkernel")``, and the stderr handler ``MKERNEL_LOG`` turns on.

What it says, at which level:

* INFO: every NVRTC compile, before it starts (``compiling <source> <defines> for <arch> (cached in
  <dir>)``) and when it ends (with its seconds); a communication workspace created or grown; a plan
  that falls back to a slower path (its ``fallback``: why);
* DEBUG: every new bound call's plan (one line per first call of a layout: the op, the rank, the call's
  shapes and the plan); cubins loaded from the disk cache;
* WARNING: ranks sharing a GPU, a driver older than CUDA 13, a disk-cache entry that failed its check.

Applications configure it like any logger.  ``MKERNEL_LOG=1`` (or ``info``) adds a stderr handler at
INFO, ``MKERNEL_LOG=debug`` (or ``2``) at DEBUG; unset or ``0``: no handler (the records propagate to
the application's handlers as usual).
"""
from __future__ import annotations

import logging
import sys

from . import env

__all__ = ["log", "configure", "define_summary", "plan_line"]

log = logging.getLogger("mkernel")

_LEVELS = {"1": logging.INFO, "info": logging.INFO, "2": logging.DEBUG, "debug": logging.DEBUG}


class _EnvHandler(logging.StreamHandler):
    """The handler MKERNEL_LOG adds (one at most: :func:`configure` replaces it)."""


def configure() -> None:
    """Add (or remove) the stderr handler as ``MKERNEL_LOG`` says; the value is read through
    :mod:`mkernel.core.env`, so :func:`mkernel.core.env.reload` then ``configure()`` applies a change."""
    for h in [h for h in log.handlers if isinstance(h, _EnvHandler)]:
        log.removeHandler(h)
    try:
        raw = str(env.get("MKERNEL_LOG", "") or "").strip().lower()
    except ValueError:
        return
    if raw in ("", "0"):
        return
    level = _LEVELS.get(raw)
    if level is None:
        raise ValueError(f"mkernel: MKERNEL_LOG={raw!r}: expected 0, 1 (info), 2 (debug), info or debug")
    h = _EnvHandler(sys.stderr)
    h.setFormatter(logging.Formatter("mkernel[%(process)d] %(levelname)s %(message)s"))
    h.setLevel(level)
    log.addHandler(h)
    if log.getEffectiveLevel() > level:
        log.setLevel(level)


def define_summary(defines, limit: int = 120) -> str:
    """The defines that name a specialization, short: ``gemm_config=18 gemm_in=0 gemm_out=0`` (the
    ``MK_`` prefix dropped, a config's derived ``MK_CFG_*`` fields left out)."""
    parts = [f"{k[3:].lower() if k.startswith('MK_') else k}={v}" for k, v in sorted(defines.items())
             if not k.startswith("MK_CFG_")]
    s = " ".join(parts)
    return s if len(s) <= limit else s[:limit - 3] + "..."


def plan_line(op: str, rank, describe_call, plan) -> None:
    """Log a new bound call's plan: DEBUG, or INFO when the plan has a ``fallback`` (why it is slower
    than the op's main path); ``describe_call()`` gives the call's shapes (called only when logged)."""
    fallback = getattr(plan, "fallback", "") or ""
    level = logging.INFO if fallback else logging.DEBUG
    if not log.isEnabledFor(level):
        return
    call_desc = describe_call()
    desc = plan.describe() if hasattr(plan, "describe") else repr(plan)
    who = f"{op} [rank {rank}]" if rank is not None else op
    log.log(level, "%s: %s%s%s", who, f"{call_desc}: " if call_desc else "", desc,
            f" -- fallback: {fallback}" if fallback else "")


try:
    configure()
except ValueError as exc:  # a bad MKERNEL_LOG must not make `import mkernel` fail: say so once
    print(exc, file=sys.stderr)
