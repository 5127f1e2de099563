"""TCP transport: one socket per ordered pair of ranks (sender -> receiver), a receiver thread.

Set-up (collective): every rank listens on an ephemeral port of its address, addresses are
exchanged with ``allgather``, every rank connects to every other one and says who it is.  Address:
``$MKERNEL_TCP_ADDR`` if set, loopback when all ranks share a host name, else the address the
host name resolves to.

Wire format (little-endian), one message per :class:`~mkernel.transport.PeerBatch`:
``u32 kind (1 = batch, 2 = bye), u32 n_data, u32 n_flags, u32 0``, then ``n_data`` records
``(u32 win, u32 0, u64 dst_offset, u64 nbytes)``, then ``n_flags`` records
``(u32 win, u32 0, u64 offset, u64 value)``, then the payloads back to back.  The receiver copies
every payload into its window (host: straight from the socket; GPU: through pinned staging and a
synchronized HtoD copy) and only then stores the flags, so "flag visible => data complete".

A sender's batch is complete when the kernel accepted the bytes (``sendmsg`` returned).  EOF
without ``bye`` means the peer died: the error surfaces from ``post``/``progress``.
"""
from __future__ import annotations

import os
import selectors
import socket
import struct
import threading

import numpy as np

from ...errors import CommError
from . import PeerBatch, Transport

__all__ = ["TcpTransport"]

KIND_BATCH, KIND_BYE = 1, 2
_HDR = struct.Struct("<IIII")
_DESC = np.dtype([("win", "<u4"), ("pad", "<u4"), ("off", "<u8"), ("n", "<u8")])
_IOV_MAX = 512
_SMALL = 256 << 10  # payloads up to this size are received in one call and scattered


def _sendall_iov(sock: socket.socket, bufs: list) -> None:
    bufs = [memoryview(b).cast("B") for b in bufs if len(memoryview(b).cast("B"))]
    i = 0
    while i < len(bufs):
        chunk = bufs[i:i + _IOV_MAX]
        sent = sock.sendmsg(chunk)
        # skip fully-sent buffers, trim a partial one
        while sent and i < len(bufs):
            n = len(bufs[i])
            if sent >= n:
                sent -= n
                i += 1
            else:
                bufs[i] = bufs[i][sent:]
                sent = 0


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionResetError("connection closed")
        got += k


class TcpTransport(Transport):
    """``TcpTransport(exchanger, windows, addr=None, timeout=30.0)``."""

    name = "tcp"

    def __init__(self, exchanger, windows, addr: str | None = None, timeout: float = 30.0, **options):
        super().__init__(exchanger, windows, **options)
        self.addr, self.timeout = addr, timeout
        self.out: dict[int, socket.socket] = {}
        self.inc: dict[int, socket.socket] = {}
        self.error: BaseException | None = None
        self._done_tokens: list[int] = []
        self._byes: set[int] = set()
        self._closing = False
        self._rx_thread: threading.Thread | None = None
        self._scratch = np.empty(_SMALL, np.uint8)
        self._gpu_out = None
        self.bytes_sent = self.bytes_received = 0

    # ---- set-up -----------------------------------------------------------------------------------
    def _my_addr(self, same_host: bool) -> str:
        if self.addr or os.environ.get("MKERNEL_TCP_ADDR"):
            return self.addr or os.environ["MKERNEL_TCP_ADDR"]
        if same_host:
            return "127.0.0.1"
        return socket.gethostbyname(socket.gethostname())

    def connect(self) -> None:
        hosts = self.ex.allgather(socket.gethostname())
        same = len(set(hosts)) == 1
        my = self._my_addr(same)
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.bind(("0.0.0.0" if not same else my, 0))
        srv.listen(max(16, self.size))
        srv.settimeout(self.timeout)
        table = self.ex.allgather((my, srv.getsockname()[1]))
        try:
            for r in range(self.size):
                if r == self.rank:
                    continue
                s = socket.create_connection(table[r], timeout=self.timeout)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
                s.sendall(struct.pack("<i", self.rank))
                self.out[r] = s
            while len(self.inc) < self.size - 1:
                c, _ = srv.accept()
                c.settimeout(self.timeout)
                c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
                buf = bytearray(4)
                _recv_into(c, memoryview(buf))
                (r,) = struct.unpack("<i", buf)
                c.settimeout(None)
                self.inc[r] = c
        except OSError as exc:
            raise CommError(f"tcp transport rank {self.rank}: connection set-up failed: {exc}") from exc
        finally:
            srv.close()
        self.ex.barrier()
        self._rx_thread = threading.Thread(target=self._rx_loop, name=f"mkernel-tcp-rx-{self.rank}", daemon=True)
        self._rx_thread.start()

    # ---- send side ------------------------------------------------------------------------------
    def _check(self):
        if self.error is not None:
            raise self.error

    def post(self, batches: list[PeerBatch]) -> int:
        self._check()
        for b in batches:
            desc = np.zeros(len(b.data), _DESC)
            fl = np.zeros(len(b.flags), _DESC)
            payload = []
            for i, (w, src, dst, n) in enumerate(b.data):
                desc[i] = (w, 0, dst, n)
                win = self.windows[w]
                if win.kind == "host":
                    payload.append(win.read(src, n))
                else:
                    payload.append(win.read(src, n).copy())  # GPU: staged DtoH copy
            for i, (w, off, v) in enumerate(b.flags):
                fl[i] = (w, 0, off, v)
            hdr = _HDR.pack(KIND_BATCH, len(b.data), len(b.flags), 0)
            try:
                _sendall_iov(self.out[b.dst], [hdr, desc, fl, *payload])
            except OSError as exc:
                self.error = CommError(f"tcp transport rank {self.rank}: sending to rank {b.dst} failed "
                                       f"(peer dead?): {exc!r}", {"peer": b.dst})
                raise self.error from exc
            self.bytes_sent += sum(p.nbytes for p in payload)
        tok = self.next_token()
        self._done_tokens.append(tok)
        return tok

    def progress(self) -> list[int]:
        self._check()
        out, self._done_tokens = self._done_tokens, []
        return out

    # ---- receive side ---------------------------------------------------------------------------
    def _rx_loop(self) -> None:
        sel = selectors.DefaultSelector()
        for r, s in self.inc.items():
            sel.register(s, selectors.EVENT_READ, r)
        try:
            while len(self._byes) < len(self.inc):
                for key, _ in sel.select(timeout=0.5):
                    r = key.data
                    if not self._rx_one(key.fileobj, r):
                        sel.unregister(key.fileobj)
        except BaseException as exc:  # noqa: BLE001
            if self.error is None:
                self.error = exc if isinstance(exc, CommError) else CommError(
                    f"tcp transport rank {self.rank}: receive failed: {exc!r}")
        finally:
            sel.close()

    def _rx_one(self, s: socket.socket, peer: int) -> bool:
        hdr = bytearray(_HDR.size)
        try:
            _recv_into(s, memoryview(hdr))
            kind, nd, nf, _ = _HDR.unpack(hdr)
            if kind == KIND_BYE:
                self._byes.add(peer)
                return False
            if kind != KIND_BATCH:
                raise CommError(f"tcp transport rank {self.rank}: garbage from rank {peer} (kind {kind})")
            desc = np.empty(nd + nf, _DESC)
            _recv_into(s, memoryview(desc).cast("B"))
            data, flags = desc[:nd], desc[nd:]
            total = int(data["n"].sum()) if nd else 0
            if total and total <= _SMALL:  # one recv, then scatter
                buf = self._scratch[:total]
                _recv_into(s, memoryview(buf))
                pos = 0
                for w, off, n in zip(data["win"].tolist(), data["off"].tolist(), data["n"].tolist()):
                    self.windows[w].write(off, buf[pos:pos + n])
                    pos += n
            elif total:
                for w, off, n in zip(data["win"].tolist(), data["off"].tolist(), data["n"].tolist()):
                    self._rx_large(s, self.windows[w], off, n)
            self.bytes_received += total
            for w, off, v in zip(flags["win"].tolist(), flags["off"].tolist(), flags["n"].tolist()):
                self.windows[w].write_u64(off, v)
            return True
        except (ConnectionError, OSError) as exc:
            if self._closing and peer in self._byes:
                return False
            raise CommError(f"tcp transport rank {self.rank}: rank {peer} closed the connection without "
                            f"saying bye (peer dead?): {exc!r}", {"peer": peer}) from exc

    def _rx_large(self, s, win, off, n):
        win.check_range(off, n)
        if win.kind == "host":
            _recv_into(s, memoryview(win.host_view()[off:off + n]))
            return
        st = win.rx_staging()  # not win.staging(): the proxy thread reads through that one meanwhile
        pos = 0
        while pos < n:
            m = min(len(st), n - pos)
            _recv_into(s, memoryview(st[:m]))
            win.write_from_rx_staging(off + pos, m)
            pos += m

    # ---- shutdown ---------------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        for r, s in self.out.items():
            try:
                s.sendall(_HDR.pack(KIND_BYE, 0, 0, 0))
            except OSError:
                pass
        if self._rx_thread is not None:
            self._rx_thread.join(timeout)
            if self._rx_thread.is_alive() and self.error is None:
                missing = sorted(set(self.inc) - self._byes)
                self.error = CommError(f"tcp transport rank {self.rank}: close timed out waiting for ranks {missing}")
        for s in list(self.out.values()) + list(self.inc.values()):
            try:
                s.close()
            except OSError:
                pass
        self.out, self.inc = {}, {}
