"""Ranks as threads of this process for the transport fault tests (loopback only).

``run_ranks(size, body)`` runs ``body(exchanger, rank)`` on ``size`` threads joined by an in-process
allgather (what a SocketExchanger delivers: plain values through encode/decode); ``fake_rank1`` plays
rank 1 of a 2-rank TCP job by hand -- valid handshakes, then whatever the test sends or withholds.
"""
from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

from mkernel.proxy.transport import auth

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
from _thread_ranks import Group, ThreadEx, run_ranks  # noqa: E402,F401  (re-exported for the fault tests)

LO = "127.0.0.1"
TCP_LABEL = b"mkernel-tcp-1"


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
