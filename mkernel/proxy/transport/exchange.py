"""Connection set-up exchange: ``allgather`` of small plain values between ranks.

Transports only need ``rank``, ``size``, ``allgather(obj) -> list`` (index = rank) and
``barrier()``.  :class:`MpiExchanger` wraps an mpi4py communicator (or a context's communicator over
another bootstrap, :mod:`mkernel.dist.group`: the same methods); :class:`SocketExchanger` is a
tiny TCP rendezvous (rank 0 listens at ``host:port``) for processes started without MPI (the
soft-RoCE VM tests, ``bench/proxy.py --socket``).  :func:`as_exchanger` accepts either, or an mpi4py
comm.  Every wait of both is bounded: :class:`MpiExchanger` through non-blocking MPI collectives with a
deadline, or a group's allgather on a helper thread (run by an :class:`~mkernel.dist.agreement.Agreement`,
which breaks on a timeout), :class:`SocketExchanger` through socket timeouts; a rank that does not
answer in time is a :class:`~mkernel.CommError` (:class:`~mkernel.CommTimeout` from MPI).  A context
whose inter-node set-up fails is failed from then on (mkernel/ops/collectives/internode.py).

What the transports exchange: host names, ``(address, port)`` tuples, the TCP job secret
(bytes), verbs QP descriptions (dicts keyed by rank with ints, strings and lists of tuples),
``("error", message)`` tuples and None.  :class:`SocketExchanger` carries exactly these through
:func:`encode` / :func:`decode` (:mod:`mkernel.dist.wire`: tagged JSON that decodes to plain data and
nothing else; never pickle: unpickling socket data runs code).  The rendezvous is authenticated
with a shared token (argument or ``$MKERNEL_EXCHANGE_TOKEN``; mutual HMAC challenge-response,
:mod:`.auth`) and every message is bounded (:data:`MAX_MESSAGE`).
"""
from __future__ import annotations

import os
import socket
import struct
import time

from ...dist.agreement import Agreement
from ...dist.timeouts import validate_timeout
from ...dist.wire import decode, encode, recv_exact
from ...errors import CommError
from .auth import accept_peers, connect_peer

__all__ = ["Exchanger", "MpiExchanger", "SocketExchanger", "as_exchanger", "encode", "decode", "MAX_MESSAGE"]

MAX_MESSAGE = 16 << 20  # bytes of one encoded message (an allgather result included)
_LABEL = b"mkernel-exchange-1"
_LEN = struct.Struct("<Q")
class Exchanger:
    rank = 0
    size = 1

    def allgather(self, obj) -> list:
        raise NotImplementedError

    def barrier(self) -> None:
        self.allgather(None)

    def close(self) -> None:
        pass


class MpiExchanger(Exchanger):
    """Over an mpi4py communicator or a :class:`~mkernel.dist.group.Group`: plain values (:func:`encode`)
    through bounded collectives.  ``host``: the :class:`~mkernel.dist.agreement.Agreement` to run them
    through (a context's, sharing its timeout and its broken state), else a private one under ``timeout``
    seconds (default 30); every wait is bounded by its ``limit``."""

    WHAT = "inter-node transport set-up"

    def __init__(self, comm, timeout: float | None = None, host: Agreement | None = None):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        if host is None:
            t = 30.0 if timeout is None else validate_timeout(timeout, "exchange timeout")
            host = Agreement(self.rank, lambda: t)
        self.host = host

    def allgather(self, obj):
        b = encode(obj)
        if len(b) > MAX_MESSAGE:
            raise ValueError(f"exchange: message of {len(b)} bytes exceeds the {MAX_MESSAGE}-byte limit")
        out = []
        for r, data in enumerate(self.host.exchange_bytes(self.WHAT, b, self.comm)):
            try:
                out.append(decode(data))
            except ValueError as exc:
                raise CommError(f"exchange: rank {r} sent a malformed message: {exc}", {"peer": r}) from None
        return out

    def barrier(self):
        self.host.barrier(self.WHAT, self.comm)


def _closed() -> ConnectionError:
    return ConnectionError("exchange: peer closed the connection")


def _send_obj(s: socket.socket, obj) -> None:
    b = encode(obj)
    if len(b) > MAX_MESSAGE:
        raise ValueError(f"exchange: message of {len(b)} bytes exceeds the {MAX_MESSAGE}-byte limit")
    s.sendall(_LEN.pack(len(b)) + b)


def _recv_obj(s: socket.socket, who: str):
    (n,) = _LEN.unpack(recv_exact(s, _LEN.size, _closed))
    if n > MAX_MESSAGE:
        raise CommError(f"exchange: {who} announced a {n}-byte message (limit {MAX_MESSAGE})")
    try:
        return decode(recv_exact(s, n, _closed))
    except ValueError as exc:
        raise CommError(f"exchange: {who} sent a malformed message: {exc}") from None


def _token(token) -> bytes:
    token = token if token is not None else os.environ.get("MKERNEL_EXCHANGE_TOKEN")
    if not token:
        raise ValueError("SocketExchanger needs a shared token: pass token= or set MKERNEL_EXCHANGE_TOKEN (the same "
                         "secret string on every rank, e.g. `python -c 'import secrets; print(secrets.token_hex(16))'`)")
    return token.encode() if isinstance(token, str) else bytes(token)


def _port(port) -> int:
    if port is None:
        env = os.environ.get("MKERNEL_EXCHANGE_PORT", "").strip()
        if not env:
            raise ValueError("SocketExchanger needs a port: pass port= or set MKERNEL_EXCHANGE_PORT")
        port = env
    try:
        port = int(port)
    except (TypeError, ValueError):
        raise ValueError(f"SocketExchanger: bad port {port!r}") from None
    if not 0 < port < 65536:
        raise ValueError(f"SocketExchanger: port {port} out of range")
    return port


class SocketExchanger(Exchanger):
    """Star rendezvous over TCP: rank 0 listens on ``(host, port)``, the others connect (retrying
    for ``timeout`` s).  ``allgather`` sends to rank 0, which answers everyone with the full list.

    ``port`` (or ``$MKERNEL_EXCHANGE_PORT``) has no default; ``host`` defaults to
    ``$MKERNEL_EXCHANGE_ADDR``, else loopback; ``token`` (str or bytes, or
    ``$MKERNEL_EXCHANGE_TOKEN``) is the secret every rank must share: a connection that does not
    prove it knows it is refused, and rank 0 keeps accepting until every rank arrived or ``timeout``
    passed."""

    def __init__(self, rank: int, size: int, host: str | None = None, port: int | None = None,
                 timeout: float = 60.0, token: str | bytes | None = None):
        if not 0 <= rank < size:
            raise ValueError(f"SocketExchanger: rank {rank} out of range for size {size}")
        self.rank, self.size, self.timeout = rank, size, timeout
        host = host or os.environ.get("MKERNEL_EXCHANGE_ADDR") or "127.0.0.1"
        port, secret = _port(port), _token(token)
        self._peers: list[socket.socket] = []
        if size == 1:
            return
        deadline = time.monotonic() + timeout
        if rank == 0:
            srv = socket.create_server((host, port), reuse_port=False, backlog=max(128, size))
            try:
                got = accept_peers(srv, secret, _LABEL, 0, range(1, size), deadline,
                                   f"exchange rank 0 at {host}:{port}")
            finally:
                srv.close()
            for c in got.values():
                c.settimeout(timeout)
            self._peers = [got[r] for r in range(1, size)]
        else:
            while True:
                try:
                    s = connect_peer((host, port), secret, _LABEL, rank, 0, max(0.05, deadline - time.monotonic()))
                    break
                except OSError as exc:
                    if time.monotonic() > deadline:
                        raise ConnectionError(f"exchange: rank {rank} could not reach rank 0 at {host}:{port} "
                                              f"within {timeout} s: {exc!r}") from exc
                    time.sleep(0.05)
            s.settimeout(timeout)
            self._peers = [s]

    def allgather(self, obj):
        if self.size == 1:
            return [decode(encode(obj))]
        if self.rank == 0:
            out = [decode(encode(obj))] + [self._io(r, _recv_obj, c, f"rank {r}") for r, c in enumerate(self._peers, 1)]
            for r, c in enumerate(self._peers, 1):
                self._io(r, _send_obj, c, out)
            return out
        self._io(0, _send_obj, self._peers[0], obj)
        out = self._io(0, _recv_obj, self._peers[0], "rank 0")
        if not isinstance(out, list) or len(out) != self.size:
            raise CommError(f"exchange: rank 0 answered the allgather with {type(out).__name__}, not a list of "
                            f"{self.size} values")
        return out

    def _io(self, peer: int, fn, *args):
        """``fn(*args)`` on the socket to or from ``peer``: a socket error or timeout is a CommError naming it."""
        try:
            return fn(*args)
        except OSError as exc:
            raise CommError(f"exchange: rank {self.rank}: rank {peer} did not answer within {self.timeout} s or "
                            f"closed the connection (dead or stalled?): {exc!r}", {"peer": peer}) from exc

    def close(self):
        for s in self._peers:
            s.close()
        self._peers = []


def as_exchanger(x, timeout: float | None = None) -> Exchanger:
    """``x`` if it is an Exchanger, else an :class:`MpiExchanger` over the mpi4py communicator ``x``
    (bounded by ``timeout``)."""
    if isinstance(x, Exchanger):
        return x
    if hasattr(x, "allgather") and hasattr(x, "Get_rank"):
        return MpiExchanger(x, timeout)
    raise TypeError(f"need an mpi4py communicator or an Exchanger, got {type(x).__name__}")
