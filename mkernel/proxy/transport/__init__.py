"""Inter-node transports used by the CPU proxy (mkernel/proxy.py).

A transport moves byte ranges between the *memory windows* of ranks (window ``i`` is the same
logical buffer on every rank) and raises u64 flags in them:

* ``verbs`` (:mod:`.verbs`): RDMA through pyverbs, one RC queue pair per peer.
* ``tcp`` (:mod:`.tcp`): sockets between the proxies; the receiver copies and then raises flags.

:func:`select_transport` picks one: the ``name`` argument, else ``$MKERNEL_TRANSPORT``, else
``verbs`` when pyverbs imports and an active RDMA port exists, else ``tcp``.

Contract every transport keeps (the proxy's protocol, docs/internode.md):
* ``post(batches)`` takes a list of :class:`PeerBatch` and returns an increasing int token.  For each
  batch, every data range is placed at the destination before any of the batch's flags becomes
  visible there ("flag visible => data complete"); batches to one destination are delivered in
  post order.
* ``progress()`` drives completions and returns the tokens whose *local* side finished (source
  bytes read, so the producer may reuse them).
* an error (dead peer, NIC error) raises from ``post``/``progress`` as :class:`mkernel.CommError`.
* ``close()`` is collective over the ranks that are alive: it flushes, tells peers, waits for them
  (bounded by a timeout) and frees resources.
"""
from __future__ import annotations

import os
from typing import NamedTuple

from .exchange import Exchanger, MpiExchanger, SocketExchanger, as_exchanger
from .window import GpuWindow, HostWindow, Window, as_window

__all__ = ["Transport", "PeerBatch", "select_transport", "transport_names", "Exchanger", "MpiExchanger",
           "SocketExchanger", "as_exchanger", "Window", "HostWindow", "GpuWindow", "as_window"]


class PeerBatch(NamedTuple):
    """Work for one destination: ``data`` = [(win, src_offset, dst_offset, nbytes)], then
    ``flags`` = [(flag_win, flag_offset, value)] raised after all of ``data`` landed."""

    dst: int
    data: list
    flags: list


class Transport:
    """Base class.  ``Transport(exchanger, windows, **options)``; ``connect()`` is collective."""

    name = "base"

    def __init__(self, exchanger, windows, **options):
        self.ex = as_exchanger(exchanger)
        self.rank, self.size = self.ex.rank, self.ex.size
        self.windows: list[Window] = [as_window(w) for w in windows]
        self.options = options
        self._token = 0

    def next_token(self) -> int:
        self._token += 1
        return self._token

    def connect(self) -> None:
        raise NotImplementedError

    def post(self, batches: list[PeerBatch]) -> int:
        raise NotImplementedError

    def progress(self) -> list[int]:
        raise NotImplementedError

    def close(self, timeout: float = 10.0) -> None:
        raise NotImplementedError


def transport_names() -> list[str]:
    return ["verbs", "tcp"]


def select_transport(name: str | None = None):
    """The Transport class to use: ``name`` > ``$MKERNEL_TRANSPORT`` > verbs if usable > tcp."""
    name = (name or os.environ.get("MKERNEL_TRANSPORT") or "").strip().lower() or None
    if name is None:
        from . import verbs

        name = "verbs" if verbs.available() else "tcp"
    if name == "tcp":
        from .tcp import TcpTransport

        return TcpTransport
    if name in ("verbs", "ib", "rdma"):
        from .verbs import VerbsTransport, require_pyverbs

        require_pyverbs()
        return VerbsTransport
    raise ValueError(f"unknown transport {name!r}; choose one of {transport_names()}")
