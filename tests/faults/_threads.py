"""Ranks as threads of this process for the transport fault tests (loopback only).

``run_ranks(size, body)`` runs ``body(exchanger, rank)`` on ``size`` threads joined by an in-process
allgather (what a SocketExchanger delivers: plain values through encode/decode); ``fake_rank1`` plays
rank 1 of a 2-rank TCP job by hand -- valid handshakes, then whatever the test sends or withholds.
"""
from __future__ import annotations

import socket
import threading
import time

from mkernel.proxy.transport import Exchanger
from mkernel.proxy.transport import auth
from mkernel.proxy.transport.exchange import decode, encode

LO = "127.0.0.1"
TCP_LABEL = b"mkernel-tcp-1"


class Group:
    def __init__(self, size, timeout=60):
        self.size = size
        self.slots = [None] * size
        self.result = None
        self.b1 = threading.Barrier(size, action=self._gathered, timeout=timeout)
        self.b2 = threading.Barrier(size, timeout=timeout)

    def _gathered(self):
        self.result = [decode(encode(v)) for v in self.slots]


class ThreadEx(Exchanger):
    def __init__(self, group, rank):
        self.g, self.rank, self.size = group, rank, group.size

    def allgather(self, obj):
        self.g.slots[self.rank] = obj
        self.g.b1.wait()
        out = list(self.g.result)
        self.g.b2.wait()
        return out


def run_ranks(size, body, timeout=60):
    """``body(ex, rank)`` per rank; returns (results, errors); asserts no rank hung."""
    group = Group(size, timeout)
    results, errors = [None] * size, [None] * size

    def run(r):
        try:
            results[r] = body(ThreadEx(group, r), r)
        except BaseException as exc:  # noqa: BLE001
            errors[r] = exc

    ts = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    assert not any(t.is_alive() for t in ts), "a rank hung"
    return results, errors


def fake_rank1(ex):
    """Rank 1 of a 2-rank TCP job by hand: the set-up's exchanges and authenticated connections both ways.
    Returns (socket it sends on, socket it receives on)."""
    hello = ex.allgather((socket.gethostname(), None))
    secret = hello[0][1]
    srv = socket.create_server((LO, 0))
    table = ex.allgather((LO, srv.getsockname()[1]))
    box = {}

    def acc():
        box["peers"] = auth.accept_peers(srv, secret, TCP_LABEL, 1, [0], time.monotonic() + 20, "fake")

    t = threading.Thread(target=acc, daemon=True)
    t.start()
    out = auth.connect_peer(tuple(table[0]), secret, TCP_LABEL, 1, 0, 20.0)
    t.join(20)
    srv.close()
    ex.barrier()  # the transport's closing status exchange: None = set up
    return out, box["peers"][0]
