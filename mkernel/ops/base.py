"""The op pipeline every op goes through (placeholder: the eager-call cache until the pipeline lands)."""
from __future__ import annotations

FAST_MAX = 256


def fast_get(ctx, key):
    """What an op stored for ``key`` on context ``ctx`` (None: nothing, or ``key`` is None)."""
    return None if key is None else ctx.__dict__.get("_fast_calls", {}).get(key)


def fast_put(ctx, key, value) -> None:
    """Store ``value`` for ``key`` on ``ctx`` (nothing when ``key`` is None; all entries are dropped when
    there are FAST_MAX)."""
    if key is None:
        return
    cache = ctx.__dict__.setdefault("_fast_calls", {})
    if len(cache) >= FAST_MAX:
        cache.clear()
    cache[key] = value
