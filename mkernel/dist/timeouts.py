"""Timeouts: the one check every timeout of mkernel goes through.

A timeout is a number of seconds, finite, above zero and at most :data:`MAX_TIMEOUT_S` (one day).
Zero, negative and NaN values would make every wait fail at once or never; infinity and huge values
cannot be represented in the device's nanosecond counters and would turn a dead peer into a hang.
"""
from __future__ import annotations

import math
import os

__all__ = ["DEFAULT_TIMEOUT_S", "MAX_TIMEOUT_S", "HOST_WAIT_FACTOR", "HOST_WAIT_MIN_S", "validate_timeout",
           "resolve_timeout", "host_wait_limit"]

DEFAULT_TIMEOUT_S = 5.0
MAX_TIMEOUT_S = 86400.0  # one day
# Host-side collective waits (agreement, symmetric allocation and free, set-up exchanges) allow the ranks
# to arrive this many timeouts apart, and at least HOST_WAIT_MIN_S: a rank compiling a kernel or
# allocating reaches them later than its peers without anything being wrong.
HOST_WAIT_FACTOR = 4.0
HOST_WAIT_MIN_S = 4.0


def validate_timeout(value, what: str = "timeout") -> float:
    """``value`` (a number, or a string holding one) as float seconds; ValueError naming ``what``
    for anything that is not a number, not finite, <= 0 or above MAX_TIMEOUT_S."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number of seconds, got {value!r}")
    try:
        t = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{what} must be a number of seconds, got {value!r}") from None
    if math.isnan(t) or math.isinf(t):
        raise ValueError(f"{what} must be a finite number of seconds, got {value!r}")
    if t <= 0:
        raise ValueError(f"{what} must be > 0 seconds, got {value!r}")
    if t > MAX_TIMEOUT_S:
        raise ValueError(f"{what} must be at most {MAX_TIMEOUT_S:g} seconds (one day), got {value!r}")
    return t


def resolve_timeout(value=None, env: str = "MKERNEL_TIMEOUT", default: float = DEFAULT_TIMEOUT_S) -> float:
    """``value`` if given, else ``$env`` if set and not empty, else ``default``; validated."""
    if value is not None:
        return validate_timeout(value, "timeout")
    v = os.environ.get(env)
    if v is not None and v.strip() != "":
        return validate_timeout(v, env)
    return validate_timeout(default, "default timeout")


def host_wait_limit(timeout: float) -> float:
    """Seconds a host-side collective wait may take under a timeout of ``timeout`` seconds:
    HOST_WAIT_FACTOR x the timeout, at least HOST_WAIT_MIN_S."""
    return max(HOST_WAIT_MIN_S, HOST_WAIT_FACTOR * float(timeout))
