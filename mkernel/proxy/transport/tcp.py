"""TCP transport: one socket per ordered pair of ranks (sender -> receiver), a receiver thread.

Set-up (collective): rank 0 draws a 32-byte job secret, shared with the host names through the
exchanger's ``allgather``; every rank listens on an ephemeral port of its advertised address (never
a wildcard), addresses are exchanged, every rank connects to every other one, and each connection
is authenticated with a mutual HMAC challenge-response on the secret (:mod:`.auth`): a process
that does not know it, claims a rank that is out of range or already connected, or answers with a
wrong MAC is refused, and accepting goes on until every peer arrived or ``timeout`` passed.  A rank
whose listener or connections fail still takes part in every exchange of the set-up, carrying its
error (``(None, message)`` in the address table, the message in the closing status exchange), so
every rank raises a CommError naming it at the same step instead of waiting for it; the exchanges
themselves are bounded (:mod:`.exchange`).
Address: ``addr`` or ``$MKERNEL_TCP_ADDR`` if set, loopback when all ranks share a host name, else
the address the host name resolves to.

Wire format (little-endian), one message per :class:`~mkernel.transport.PeerBatch`:
``u32 kind (1 = batch, 2 = bye), u32 n_data, u32 n_flags, u32 0``, then ``n_data`` records
``(u32 win, u32 0, u64 dst_offset, u64 nbytes)``, then ``n_flags`` records
``(u32 win, u32 0, u64 offset, u64 value)``, then the payloads back to back.  A message holds at
most MAX_RECORDS records (a larger batch goes as several messages, its flags in the last ones).
The receiver checks everything it reads before it allocates or copies (kind, record count, window
index, every range inside its window, flag alignment): a malformed message is a CommError naming
the peer.  The receiver copies
every payload into its window (host: straight from the socket; GPU: through pinned staging and a
synchronized HtoD copy) and only then stores the flags, so "flag visible => data complete".

A sender's batch is complete when the kernel accepted the bytes (``sendmsg`` returned).  EOF
without ``bye`` means the peer died: the error surfaces from ``post``/``progress``.  Every socket
operation is bounded by ``timeout``: a peer that stops reading (the send blocks) or stops in the
middle of a message it is sending is a CommError naming it.
"""
from __future__ import annotations

import os
import selectors
import socket
import struct
import threading
import time

import numpy as np

from ...core.driver import ignore_other_threads_captures
from ...dist.wire import recv_into_exact
from ...errors import CommError
from . import PeerBatch, Transport
from .auth import SECRET_BYTES, accept_peers, connect_peer, new_secret

__all__ = ["TcpTransport"]

KIND_BATCH, KIND_BYE = 1, 2
_LABEL = b"mkernel-tcp-1"
_HDR = struct.Struct("<IIII")
MAX_RECORDS = 4096  # n_data + n_flags of one message; the sender splits larger batches
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


def _messages(data: list, flags: list):
    """Split one batch into messages of at most MAX_RECORDS records: all data first, the flags in
    the last messages (so "flag visible => data complete" holds across them)."""
    i = j = 0
    while True:
        d = data[i:i + MAX_RECORDS]
        i += len(d)
        f = flags[j:j + MAX_RECORDS - len(d)] if i >= len(data) else []
        j += len(f)
        yield d, f
        if i >= len(data) and j >= len(flags):
            return


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
        addr = self.addr or os.environ.get("MKERNEL_TCP_ADDR")
        if addr:
            if addr.strip() in ("0.0.0.0", "", "*"):
                raise CommError(f"tcp transport rank {self.rank}: the address ({addr!r}, addr= or MKERNEL_TCP_ADDR) "
                                "must be this host's address that peers reach, not a wildcard")
            return addr.strip()
        if same_host:
            return "127.0.0.1"
        return socket.gethostbyname(socket.gethostname())

    def connect(self) -> None:
        """Collective: listen on the advertised address, exchange addresses and the job secret, then
        connect to every peer and accept every peer, each connection authenticated (:mod:`.auth`); a
        closing status exchange tells every rank whether every rank succeeded."""
        hello = self.ex.allgather((socket.gethostname(), new_secret() if self.rank == 0 else None))
        secret = hello[0][1]
        if not isinstance(secret, bytes) or len(secret) != SECRET_BYTES:
            raise CommError(f"tcp transport rank {self.rank}: no valid job secret from rank 0")
        same = len({h for h, _ in hello}) == 1
        srv, mine, error = None, None, None
        try:
            my = self._my_addr(same)
            srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)  # inherited by accepted sockets
                srv.bind((my, 0))  # the advertised address only: never a wildcard
                srv.listen(max(128, self.size))
            except OSError as exc:
                raise CommError(f"tcp transport rank {self.rank}: cannot listen on {my}: {exc}") from exc
            mine = (my, srv.getsockname()[1])
        except CommError as exc:
            error = exc
            if srv is not None:
                srv.close()
                srv = None
        table = self.ex.allgather(mine if error is None else (None, str(error)))
        failed = {r: t[1] for r, t in enumerate(table) if t[0] is None}
        if failed:
            if srv is not None:
                srv.close()
            if error is not None:
                raise error
            raise CommError(f"tcp transport rank {self.rank}: set-up failed on ranks {sorted(failed)}: "
                            f"{next(iter(failed.values()))}", {"peer": min(failed)})
        try:
            self._connect_all(srv, secret, table)
        except Exception as exc:  # noqa: BLE001 - every failure goes to the peers in the status exchange
            error = exc if isinstance(exc, CommError) else CommError(
                f"tcp transport rank {self.rank}: connecting failed: {exc!r}")
            if error is not exc:
                error.__cause__ = exc
        finally:
            srv.close()
        # every rank learns whether every rank connected (a rank that failed does not leave the others
        # waiting for it): None, or the failure
        status = self.ex.allgather(None if error is None else str(error))
        others = sorted(r for r, m in enumerate(status) if m is not None and r != self.rank)
        if error is not None or others:
            for sk in list(self.out.values()) + list(self.inc.values()):
                sk.close()
            self.out, self.inc = {}, {}
            if not others:
                raise error
            msg = f"set-up failed on ranks {others}: {status[others[0]]}"
            exc = CommError(f"tcp transport rank {self.rank}: {msg}" if error is None else f"{error}; {msg}",
                            {"peer": others[0]})
            raise exc from error
        self._rx_thread = threading.Thread(target=self._rx_loop, name=f"mkernel-tcp-rx-{self.rank}", daemon=True)
        self._rx_thread.start()

    def _connect_all(self, srv, secret: bytes, table: list) -> None:
        """Connect to every peer and accept every peer on ``srv`` before the deadline; CommError otherwise
        (nothing kept)."""
        try:
            accepted: dict = {}
            deadline = time.monotonic() + self.timeout
            cancel = threading.Event()

            def accept():
                try:
                    accepted["peers"] = accept_peers(srv, secret, _LABEL, self.rank,
                                                     [r for r in range(self.size) if r != self.rank], deadline,
                                                     f"tcp transport rank {self.rank}", cancel)
                except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                    accepted["error"] = exc

            acceptor = threading.Thread(target=accept, name=f"mkernel-tcp-accept-{self.rank}", daemon=True)
            acceptor.start()
            ok = False
            try:
                for r in range(self.size):
                    if r == self.rank:
                        continue
                    host, port = table[r]
                    try:
                        s = connect_peer((host, port), secret, _LABEL, self.rank, r,
                                         max(0.05, deadline - time.monotonic()))
                    except OSError as exc:
                        raise CommError(f"tcp transport rank {self.rank}: connecting to rank {r} at {host}:{port} "
                                        f"failed: {exc!r}", {"peer": r}) from exc
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
                    s.settimeout(self.timeout)
                    self.out[r] = s
                ok = True
            finally:
                if not ok:
                    cancel.set()
                acceptor.join(max(0.0, deadline - time.monotonic()) + 1.0)
                if not ok:
                    for c in accepted.get("peers", {}).values():
                        c.close()
            if "error" in accepted:
                raise accepted["error"]
            if "peers" not in accepted:
                raise CommError(f"tcp transport rank {self.rank}: accepting peers did not finish in {self.timeout} s")
            self.inc = accepted["peers"]
            for c in self.inc.values():
                c.settimeout(self.timeout)  # read only when readable: bounds a message that stops half-way
        except BaseException:
            for s in self.out.values():
                s.close()
            self.out = {}
            raise

    # ---- send side ------------------------------------------------------------------------------
    def _check(self):
        if self.error is not None:
            raise self.error

    def post(self, batches: list[PeerBatch]) -> int:
        self._check()
        for b in batches:
            for data, flags in _messages(b.data, b.flags):
                desc = np.zeros(len(data), _DESC)
                fl = np.zeros(len(flags), _DESC)
                payload = []
                for i, (w, src, dst, n) in enumerate(data):
                    desc[i] = (w, 0, dst, n)
                    win = self.windows[w]
                    if win.kind == "host":
                        payload.append(win.read(src, n))
                    else:
                        payload.append(win.read(src, n).copy())  # GPU: staged DtoH copy
                for i, (w, off, v) in enumerate(flags):
                    fl[i] = (w, 0, off, v)
                hdr = _HDR.pack(KIND_BATCH, len(data), len(flags), 0)
                try:
                    _sendall_iov(self.out[b.dst], [hdr, desc, fl, *payload])
                except OSError as exc:
                    self.error = CommError(f"tcp transport rank {self.rank}: sending to rank {b.dst} failed (peer "
                                           f"dead, or not reading for {self.timeout} s?): {exc!r}", {"peer": b.dst})
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
        ignore_other_threads_captures()  # (its copies into GPU windows: as the proxy thread's, core/driver.py)
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

    def _malformed(self, peer: int, what: str) -> CommError:
        return CommError(f"tcp transport rank {self.rank}: malformed message from rank {peer}: {what}", {"peer": peer})

    def _check_records(self, peer: int, data: np.ndarray, flags: np.ndarray) -> None:
        """Every record names an existing window, every range lies inside it, every flag is an
        aligned u64 inside it (u64 arithmetic that cannot wrap: n <= size, then off <= size - n)."""
        sizes = np.array([w.nbytes for w in self.windows], np.uint64)
        for name, recs in (("data", data), ("flag", flags)):
            if not len(recs):
                continue
            bad = recs["win"] >= len(sizes)
            if bad.any():
                i = int(np.argmax(bad))
                raise self._malformed(peer, f"{name} record {i} names window {int(recs['win'][i])} of {len(sizes)}")
            size = sizes[recs["win"]]
            n = recs["n"] if name == "data" else np.full(len(recs), 8, np.uint64)
            bad = (n > size) | (recs["off"] > size - np.minimum(n, size))
            if name == "flag":
                bad |= (recs["off"] % 8) != 0
            if bad.any():
                i = int(np.argmax(bad))
                w, off = int(recs["win"][i]), int(recs["off"][i])
                raise self._malformed(peer, f"{name} record {i}: [{off}, {off + int(n[i])}) of window {w} "
                                            f"({int(size[i])} bytes){' (unaligned flag)' if name == 'flag' else ''}")

    def _rx_one(self, s: socket.socket, peer: int) -> bool:
        hdr = bytearray(_HDR.size)
        try:
            recv_into_exact(s, memoryview(hdr))
            kind, nd, nf, reserved = _HDR.unpack(hdr)
            if kind == KIND_BYE and nd == nf == reserved == 0:
                self._byes.add(peer)
                return False
            if kind != KIND_BATCH or reserved:
                raise self._malformed(peer, f"header kind {kind}, reserved {reserved}")
            if nd + nf > MAX_RECORDS:
                raise self._malformed(peer, f"{nd} data + {nf} flag records (at most {MAX_RECORDS})")
            desc = np.empty(nd + nf, _DESC)
            recv_into_exact(s, memoryview(desc).cast("B"))
            data, flags = desc[:nd], desc[nd:]
            self._check_records(peer, data, flags)
            data_l = list(zip(data["win"].tolist(), data["off"].tolist(), data["n"].tolist()))
            total = sum(n for _, _, n in data_l)
            if total and total <= _SMALL:  # one recv, then scatter
                buf = self._scratch[:total]
                recv_into_exact(s, memoryview(buf))
                pos = 0
                for w, off, n in data_l:
                    self.windows[w].write(off, buf[pos:pos + n])
                    pos += n
            elif total:
                for w, off, n in data_l:
                    self._rx_large(s, self.windows[w], off, n)
            self.bytes_received += total
            for w, off, v in zip(flags["win"].tolist(), flags["off"].tolist(), flags["n"].tolist()):
                self.windows[w].write_u64(off, v)
            return True
        except TimeoutError as exc:
            raise CommError(f"tcp transport rank {self.rank}: rank {peer} stopped in the middle of a message: "
                            f"nothing for {self.timeout} s (stalled or dead?)", {"peer": peer}) from exc
        except (ConnectionError, OSError) as exc:
            if self._closing and peer in self._byes:
                return False
            raise CommError(f"tcp transport rank {self.rank}: rank {peer} closed the connection without "
                            f"saying bye (peer dead?): {exc!r}", {"peer": peer}) from exc

    def _rx_large(self, s, win, off, n):
        win.check_range(off, n)
        if win.kind == "host":
            recv_into_exact(s, memoryview(win.host_view()[off:off + n]))
            return
        st = win.rx_staging()  # not win.staging(): the proxy thread reads through that one meanwhile
        pos = 0
        while pos < n:
            m = min(len(st), n - pos)
            recv_into_exact(s, memoryview(st[:m]))
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
