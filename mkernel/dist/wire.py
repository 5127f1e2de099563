"""Plain values as bytes and back, for every exchange between ranks that is not MPI's own: the context's
communicators over a non-MPI bootstrap (:mod:`.group`), the inter-node transports' set-up
(:mod:`mkernel.proxy.transport.exchange`).

Plain values are None, bool, int, float (finite), str, bytes, tuple, list and dict (keys of any of these
types).  The encoding is JSON in which every other object is a one-key tag (``{"b": base64}`` bytes,
``{"t": [...]}`` tuple, ``{"d": [[key, value], ...]}`` dict), so whatever a peer sends decodes to plain data
and nothing else (never pickle: unpickling received bytes runs code).  :func:`recv_exact` / :func:`recv_into_exact`
read a known number of bytes from a stream socket, for every socket protocol of the package.
"""
from __future__ import annotations

import base64
import json
import math
import operator

__all__ = ["encode", "decode", "recv_exact", "recv_into_exact"]


def _tag(obj):
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise ValueError(f"exchange: cannot send the non-finite float {obj!r}")
        return float(obj)
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {"b": base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, tuple):
        return {"t": [_tag(x) for x in obj]}
    if isinstance(obj, list):
        return [_tag(x) for x in obj]
    if isinstance(obj, dict):
        return {"d": [[_tag(k), _tag(v)] for k, v in obj.items()]}
    if hasattr(obj, "__index__"):  # numpy integers
        return operator.index(obj)
    raise TypeError(f"exchange: cannot send a {type(obj).__name__} (plain values only: None, bool, int, float, "
                    "str, bytes, tuple, list, dict)")


def _untag(x):
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, list):
        return [_untag(v) for v in x]
    if isinstance(x, dict) and len(x) == 1:
        (k, v), = x.items()
        if k == "b" and isinstance(v, str):
            return base64.b64decode(v.encode("ascii"), validate=True)
        if k == "t" and isinstance(v, list):
            return tuple(_untag(e) for e in v)
        if k == "d" and isinstance(v, list) and all(isinstance(e, list) and len(e) == 2 for e in v):
            out = {}
            for ek, ev in v:
                key = _untag(ek)
                try:
                    out[key] = _untag(ev)
                except TypeError:
                    raise ValueError(f"unhashable dict key {key!r}") from None
            return out
    raise ValueError(f"not a tagged value: {str(x)[:80]}")


def encode(obj) -> bytes:
    """``obj`` (plain values: None, bool, int, float, str, bytes, tuple, list, dict) as bytes."""
    return json.dumps(_tag(obj), separators=(",", ":"), allow_nan=False).encode()


def decode(data: bytes):
    """The value :func:`encode` made; ValueError for anything else (malformed or foreign input)."""
    try:
        return _untag(json.loads(data.decode("utf-8"), parse_constant=_no_constant))
    except (ValueError, TypeError, RecursionError, UnicodeDecodeError) as exc:
        raise ValueError(f"exchange: undecodable message: {exc}") from None


def _no_constant(name):
    raise ValueError(f"{name} is not allowed")


def recv_into_exact(sock, view: memoryview, closed=lambda: ConnectionResetError("connection closed")) -> None:
    """Fill ``view`` from stream socket ``sock``; the peer closing first raises ``closed()``."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise closed()
        got += k


def recv_exact(sock, n: int, closed=lambda: ConnectionResetError("connection closed")) -> bytes:
    """The next ``n`` bytes of stream socket ``sock``; the peer closing first raises ``closed()``."""
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), closed)
    return bytes(buf)
