"""Authenticated socket set-up: a shared secret and a mutual HMAC-SHA256 challenge-response.

Used by the TCP transport (secret: 32 random bytes rank 0 draws per job and shares over the
exchanger) and by :class:`~.exchange.SocketExchanger` (secret: the rendezvous token).  Nothing a
connection says is trusted before it proved it knows the secret.

Handshake on a fresh connection from a *connector* (rank ``rc``) to a *listener* (rank ``rl``);
``label`` names the protocol (so a MAC of one protocol is never valid in another)::

    listener  -> connector: nonce_l                                   (32 random bytes)
    connector -> listener : i32 rc, nonce_c (32 bytes), mac_c
    listener  -> connector: mac_l                                     (only if mac_c is valid)

    mac_c = HMAC-SHA256(secret, label || b"C" || nonce_l || nonce_c || i32 rc || i32 rl)
    mac_l = HMAC-SHA256(secret, label || b"L" || nonce_l || nonce_c || i32 rc || i32 rl)

The listener refuses (closes the connection, keeps accepting) a rank it does not expect (out of
range, itself), a rank already accepted (duplicate) and a wrong MAC, compared with
``hmac.compare_digest``.  Handshakes run concurrently (a connection that stalls does not delay the
others) and everything is bounded by a deadline.  The connector checks ``mac_l``, so it only sends
data to a listener that knows the secret too.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import selectors
import socket
import struct
import time

from ...dist.wire import recv_exact
from ...errors import CommError

__all__ = ["SECRET_BYTES", "NONCE_BYTES", "MAC_BYTES", "new_secret", "accept_peers", "connect_peer"]

SECRET_BYTES = 32
NONCE_BYTES = 32
MAC_BYTES = 32
_RANK = struct.Struct("<i")
_RESPONSE_BYTES = _RANK.size + NONCE_BYTES + MAC_BYTES
MAX_PENDING = 64  # handshakes in progress at once; further connections are closed at once

log = logging.getLogger("mkernel")


def new_secret() -> bytes:
    """A fresh per-job secret."""
    return secrets.token_bytes(SECRET_BYTES)


def _mac(secret: bytes, label: bytes, side: bytes, nonce_l: bytes, nonce_c: bytes, rc: int, rl: int) -> bytes:
    msg = label + side + nonce_l + nonce_c + _RANK.pack(rc) + _RANK.pack(rl)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def _closed() -> ConnectionError:
    return ConnectionError("connection closed during the handshake")


class _Pending:
    __slots__ = ("nonce", "buf", "addr")

    def __init__(self, nonce: bytes, addr):
        self.nonce, self.buf, self.addr = nonce, bytearray(), addr


def accept_peers(srv: socket.socket, secret: bytes, label: bytes, my_rank: int, expected, deadline: float,
                 what: str, cancel=None) -> dict[int, socket.socket]:
    """Accept one authenticated connection from each rank in ``expected`` on the listening socket
    ``srv``, until ``deadline`` (``time.monotonic()``).  Returns ``{rank: socket}`` (blocking
    sockets, no timeout set).  Raises :class:`CommError` naming the missing ranks (and what was
    refused) when the deadline passes first, or soon after ``cancel`` (a ``threading.Event``) is set."""
    expected = set(expected)
    got: dict[int, socket.socket] = {}
    refused: list[str] = []
    sel = selectors.DefaultSelector()
    srv.setblocking(False)
    sel.register(srv, selectors.EVENT_READ, None)

    def refuse(c: socket.socket, p: _Pending, reason: str) -> None:
        sel.unregister(c)
        c.close()
        msg = f"{p.addr}: {reason}"
        refused.append(msg)
        log.warning("%s: refused a connection from %s", what, msg)

    try:
        while expected - got.keys():
            left = deadline - time.monotonic()
            if left <= 0 or (cancel is not None and cancel.is_set()):
                missing = sorted(expected - got.keys())
                why = "timed out" if left <= 0 else "set-up abandoned"
                raise CommError(f"{what}: {why} waiting for ranks {missing} to connect"
                                + (f"; refused: {refused}" if refused else ""), {"peer": missing[0]})
            for key, _ in sel.select(timeout=min(left, 0.1)):
                if key.data is None:  # the listening socket: new connections
                    while True:
                        try:
                            c, addr = srv.accept()
                        except (BlockingIOError, InterruptedError):
                            break
                        if len(sel.get_map()) > MAX_PENDING:
                            c.close()
                            refused.append(f"{addr}: too many handshakes in progress")
                            continue
                        nonce = secrets.token_bytes(NONCE_BYTES)
                        try:
                            c.settimeout(max(0.05, deadline - time.monotonic()))
                            c.sendall(nonce)
                            c.setblocking(False)
                        except OSError as exc:
                            c.close()
                            refused.append(f"{addr}: {exc!r}")
                            continue
                        sel.register(c, selectors.EVENT_READ, _Pending(nonce, addr))
                    continue
                c, p = key.fileobj, key.data
                try:
                    chunk = c.recv(_RESPONSE_BYTES - len(p.buf))
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    refuse(c, p, f"{exc!r}")
                    continue
                if not chunk:
                    refuse(c, p, "closed during the handshake")
                    continue
                p.buf += chunk
                if len(p.buf) < _RESPONSE_BYTES:
                    continue
                (rank,) = _RANK.unpack_from(p.buf, 0)
                nonce_c = bytes(p.buf[_RANK.size:_RANK.size + NONCE_BYTES])
                mac_c = bytes(p.buf[_RANK.size + NONCE_BYTES:])
                if rank not in expected:
                    refuse(c, p, f"claims rank {rank}, not one this rank expects")
                    continue
                if rank in got:
                    refuse(c, p, f"claims rank {rank}, which already connected")
                    continue
                if not hmac.compare_digest(mac_c, _mac(secret, label, b"C", p.nonce, nonce_c, rank, my_rank)):
                    refuse(c, p, f"claims rank {rank} with a wrong MAC")
                    continue
                sel.unregister(c)
                try:
                    c.settimeout(max(0.05, deadline - time.monotonic()))
                    c.sendall(_mac(secret, label, b"L", p.nonce, nonce_c, rank, my_rank))
                    c.settimeout(None)
                except OSError as exc:
                    c.close()
                    refused.append(f"{p.addr}: rank {rank}: {exc!r}")
                    continue
                got[rank] = c
    except BaseException:
        for c in got.values():
            c.close()
        raise
    finally:
        for key in list(sel.get_map().values()):
            if key.data is not None:
                key.fileobj.close()
        sel.close()
    return got


def connect_peer(addr, secret: bytes, label: bytes, my_rank: int, peer_rank: int, timeout: float) -> socket.socket:
    """Connect to ``addr`` (a ``(host, port)`` pair) where rank ``peer_rank`` listens and run the
    connector's side of the handshake.  Returns the socket (timeout ``timeout`` set).  Raises
    OSError (unreachable, timed out, closed: the listener refused us) or :class:`CommError` (the
    listener failed to prove it knows the secret)."""
    s = socket.create_connection(addr, timeout=timeout)
    try:
        nonce_l = recv_exact(s, NONCE_BYTES, _closed)
        nonce_c = secrets.token_bytes(NONCE_BYTES)
        s.sendall(_RANK.pack(my_rank) + nonce_c + _mac(secret, label, b"C", nonce_l, nonce_c, my_rank, peer_rank))
        mac_l = recv_exact(s, MAC_BYTES, _closed)
        if not hmac.compare_digest(mac_l, _mac(secret, label, b"L", nonce_l, nonce_c, my_rank, peer_rank)):
            raise CommError(f"rank {my_rank}: the listener at {addr} (rank {peer_rank}) failed to authenticate",
                            {"peer": peer_rank})
    except BaseException:
        s.close()
        raise
    return s
