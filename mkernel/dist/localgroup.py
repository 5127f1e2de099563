"""A group of ranks on one host over Unix-domain sockets: the node and host communicators of a context whose
job did not start with MPI.

:func:`local_group` builds one, collectively over the world group: the group's first rank (its leader)
listens on a socket in a fresh private directory (mode 0700: only this user's processes can reach it),
the path travels to the members through the world's allgather, each member connects and sends its index
in the group, and the leader removes the path once all are in (a connection from another user, an index
out of range or a second connection for one index is closed and ignored).  An allgather sends every
member's bytes to the leader, which answers each member with the whole list; messages are
length-prefixed and bounded (:data:`MAX_MESSAGE`).
"""
from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import time

from ..errors import CommError
from .group import Group
from .hostwait import group_allgather
from .wire import recv_exact

__all__ = ["LocalGroup", "local_group", "MAX_MESSAGE", "CONNECT_SECONDS"]

MAX_MESSAGE = 64 << 20     # bytes of one message (an allgather's whole answer included)
CONNECT_SECONDS = 60.0     # how long a group's ranks may take to reach its leader
_LEN = struct.Struct("<Q")
_IDX = struct.Struct("<i")


def _closed() -> CommError:
    return CommError("mkernel: a rank of this host's group closed its connection (did it exit?)")


def _send(s: socket.socket, data: bytes) -> None:
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"mkernel: a {len(data)}-byte message exceeds the host group's limit of {MAX_MESSAGE}")
    s.sendall(_LEN.pack(len(data)) + data)


def _recv(s: socket.socket) -> bytes:
    (n,) = _LEN.unpack(recv_exact(s, _LEN.size, _closed))
    if n > MAX_MESSAGE:
        raise CommError(f"mkernel: a rank of this host's group announced a {n}-byte message (limit {MAX_MESSAGE})")
    return recv_exact(s, n, _closed)


def _pack(items: list[bytes]) -> bytes:
    return _LEN.pack(len(items)) + b"".join(_LEN.pack(len(b)) + b for b in items)


def _unpack(data: bytes, size: int) -> list[bytes]:
    (n,), pos, out = _LEN.unpack_from(data, 0), _LEN.size, []
    if n != size:
        raise CommError(f"mkernel: the host group's leader answered {n} items, not {size}")
    for _ in range(n):
        (k,) = _LEN.unpack_from(data, pos)
        pos += _LEN.size
        out.append(data[pos:pos + k])
        pos += k
    return out


class LocalGroup(Group):
    """Index ``rank`` of ``size`` ranks of one host; ``peers``: the leader's sockets to indices 1.., in order
    (a member holds one socket, to the leader)."""

    def __init__(self, rank: int, size: int, peers: list):
        self.rank, self.size, self._peers = rank, size, peers

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        data = bytes(data)
        if self.size == 1:
            return [data]
        if self.rank == 0:
            out = [data] + [_recv(p) for p in self._peers]
            answer = _pack(out)
            for p in self._peers:
                _send(p, answer)
            return out
        _send(self._peers[0], data)
        return _unpack(_recv(self._peers[0]), self.size)

    def close(self) -> None:
        for p in self._peers:
            p.close()
        self._peers = []


def _same_user(conn: socket.socket) -> bool:
    if not hasattr(socket, "SO_PEERCRED"):
        return True  # (the directory's mode already keeps other users out)
    cred = struct.Struct("3i")
    _, uid, _ = cred.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, cred.size))
    return uid == os.getuid()


def _accept(srv: socket.socket, size: int, deadline: float) -> list:
    peers: dict[int, socket.socket] = {}
    while len(peers) < size - 1:
        left = deadline - time.monotonic()
        if left <= 0:
            for c in peers.values():
                c.close()
            missing = sorted(set(range(1, size)) - set(peers))
            raise CommError(f"mkernel: ranks {missing} of this host's group did not connect within "
                            f"{CONNECT_SECONDS:.0f} s")
        srv.settimeout(left)
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            continue
        try:
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            (idx,) = _IDX.unpack(recv_exact(conn, _IDX.size, _closed))
            ok = _same_user(conn) and 0 < idx < size and idx not in peers
        except (OSError, CommError, struct.error):
            ok = False
        if not ok:
            conn.close()
            continue
        conn.settimeout(None)
        peers[idx] = conn
    return [peers[i] for i in range(1, size)]


def _connect(path: str, idx: int, deadline: float) -> socket.socket:
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            s.connect(path)
            s.sendall(_IDX.pack(idx))
            s.settimeout(None)
            return s
        except OSError as exc:
            s.close()
            if time.monotonic() > deadline:
                raise CommError(f"mkernel: could not reach this host's group leader at {path}: {exc}") from None
            time.sleep(0.01)


def local_group(world: Group, members: list[int], timeout: float = CONNECT_SECONDS) -> LocalGroup:
    """Collective over every rank of ``world``: each rank passes the world ranks of its own group, in the
    group's order (groups are disjoint; every member of a group passes the same list, this rank among
    them); returns this rank's :class:`LocalGroup`."""
    me = world.Get_rank()
    idx, size = members.index(me), len(members)
    srv, tmp, path = None, None, ""
    if idx == 0 and size > 1:
        tmp = tempfile.mkdtemp(prefix="mkernel-group-")  # mode 0700
        path = os.path.join(tmp, "s")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(size)
    try:
        paths = group_allgather(world, path, timeout, "mkernel.init (this host's group)", me)
        if size == 1:
            return LocalGroup(0, 1, [])
        deadline = time.monotonic() + timeout
        if idx == 0:
            return LocalGroup(0, size, _accept(srv, size, deadline))
        return LocalGroup(idx, size, [_connect(paths[members[0]], idx, deadline)])
    finally:
        if srv is not None:
            srv.close()
            shutil.rmtree(tmp, ignore_errors=True)
