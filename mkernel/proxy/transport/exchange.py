"""Connection set-up exchange: ``allgather`` of small picklable objects between ranks.

Transports only need ``rank``, ``size``, ``allgather(obj) -> list`` (index = rank) and
``barrier()``.  :class:`MpiExchanger` wraps an mpi4py communicator; :class:`SocketExchanger` is a
tiny TCP rendezvous (rank 0 listens at ``host:port``) for processes started without MPI (the
soft-RoCE VM tests).  :func:`as_exchanger` accepts either, or an mpi4py comm.
"""
from __future__ import annotations

import pickle
import socket
import struct
import time

__all__ = ["Exchanger", "MpiExchanger", "SocketExchanger", "as_exchanger"]


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
    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def allgather(self, obj):
        return self.comm.allgather(obj)

    def barrier(self):
        self.comm.Barrier()


def _send_obj(s: socket.socket, obj) -> None:
    b = pickle.dumps(obj)
    s.sendall(struct.pack("<Q", len(b)) + b)


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = s.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("exchange: peer closed the connection")
        got += k
    return bytes(buf)


def _recv_obj(s: socket.socket):
    (n,) = struct.unpack("<Q", _recv_exact(s, 8))
    return pickle.loads(_recv_exact(s, n))


class SocketExchanger(Exchanger):
    """Star rendezvous over TCP: rank 0 listens on ``(host, port)``, the others connect (retrying
    for ``timeout`` s).  ``allgather`` sends to rank 0, which answers everyone with the full list."""

    def __init__(self, rank: int, size: int, host: str = "127.0.0.1", port: int = 29511, timeout: float = 60.0):
        self.rank, self.size, self.timeout = rank, size, timeout
        self._peers: list[socket.socket] = []
        if rank == 0:
            srv = socket.create_server((host, port), reuse_port=False)
            srv.settimeout(timeout)
            got = {}
            while len(got) < size - 1:
                c, _ = srv.accept()
                c.settimeout(timeout)
                r = _recv_obj(c)
                got[r] = c
            srv.close()
            self._peers = [got[r] for r in range(1, size)]
        else:
            t0 = time.monotonic()
            while True:
                try:
                    s = socket.create_connection((host, port), timeout=timeout)
                    break
                except OSError:
                    if time.monotonic() - t0 > timeout:
                        raise ConnectionError(f"exchange: rank {rank} could not reach rank 0 at {host}:{port}")
                    time.sleep(0.05)
            s.settimeout(timeout)
            _send_obj(s, rank)
            self._peers = [s]

    def allgather(self, obj):
        if self.size == 1:
            return [obj]
        if self.rank == 0:
            out = [obj] + [_recv_obj(c) for c in self._peers]
            for c in self._peers:
                _send_obj(c, out)
            return out
        _send_obj(self._peers[0], obj)
        return _recv_obj(self._peers[0])

    def close(self):
        for s in self._peers:
            s.close()
        self._peers = []


def as_exchanger(x) -> Exchanger:
    if isinstance(x, Exchanger):
        return x
    if hasattr(x, "allgather") and hasattr(x, "Get_rank"):
        return MpiExchanger(x)
    raise TypeError(f"need an mpi4py communicator or an Exchanger, got {type(x).__name__}")
