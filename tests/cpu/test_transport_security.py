"""Strangers on the set-up sockets (CPU only, loopback only).

* the authenticated handshake (mkernel/proxy/transport/auth.py): wrong MAC, no secret, duplicate,
  out-of-range and own ranks are refused, a silent connection does not block the others, and a
  listener that does not know the secret is refused by the connector;
* the SocketExchanger: no pickle (a crafted payload never runs), oversized length refused, wrong
  token refused, plain values round-trip exactly, no default port.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import secrets
import socket
import struct
import threading
import time

import numpy as np
import pytest

from mkernel.errors import CommError
from mkernel.proxy.transport import Exchanger, SocketExchanger
from mkernel.proxy.transport import auth
from mkernel.proxy.transport.exchange import MAX_MESSAGE, decode, encode

LO = "127.0.0.1"
TCP_LABEL = b"mkernel-tcp-1"


def _free_port():
    s = socket.socket()
    s.bind((LO, 0))
    p = s.getsockname()[1]
    s.close()
    return p


def _mac(secret, label, side, nonce_l, nonce_c, rc, rl):
    msg = label + side + nonce_l + nonce_c + struct.pack("<i", rc) + struct.pack("<i", rl)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def _answer(sock, claim_rank, secret, label, listener_rank, garbage=False):
    """The connector's half of the handshake on a connected socket; True if the listener let us in
    (sent back its MAC), False if it closed the connection."""
    try:
        nonce_l = b""
        while len(nonce_l) < 32:
            chunk = sock.recv(32 - len(nonce_l))
            if not chunk:
                return False
            nonce_l += chunk
        nonce_c = secrets.token_bytes(32)
        if garbage:
            sock.sendall(secrets.token_bytes(4 + 32 + 32))
        else:
            sock.sendall(struct.pack("<i", claim_rank) + nonce_c
                         + _mac(secret, label, b"C", nonce_l, nonce_c, claim_rank, listener_rank))
        return len(sock.recv(32)) == 32
    except OSError:
        return False
    finally:
        sock.close()


class _Group:
    """Ranks as threads of this process: allgather through two barriers; ``hook(round, table)``
    runs once per allgather after every rank contributed and before any returns."""

    def __init__(self, size, hook=None):
        self.size, self.hook, self.round = size, hook, 0
        self.slots = [None] * size
        self.result = None
        self.b1 = threading.Barrier(size, action=self._gathered, timeout=60)
        self.b2 = threading.Barrier(size, timeout=60)

    def _gathered(self):
        self.result = [decode(encode(v)) for v in self.slots]  # what a SocketExchanger delivers
        if self.hook is not None:
            self.hook(self.round, self.result)
        self.round += 1


class _ThreadEx(Exchanger):
    def __init__(self, group, rank):
        self.g, self.rank, self.size = group, rank, group.size

    def allgather(self, obj):
        self.g.slots[self.rank] = obj
        self.g.b1.wait()
        out = list(self.g.result)
        self.g.b2.wait()
        return out


# ---- the handshake ----------------------------------------------------------------------------------

def _listener():
    srv = socket.create_server((LO, 0))
    return srv, srv.getsockname()


def _accept_in_thread(srv, secret, expected, timeout=10.0):
    box = {}

    def run():
        try:
            box["peers"] = auth.accept_peers(srv, secret, TCP_LABEL, 0, expected, time.monotonic() + timeout, "test")
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_handshake_refuses_strangers_duplicates_and_out_of_range():
    secret = auth.new_secret()
    srv, addr = _listener()
    t, box = _accept_in_thread(srv, secret, [1, 2])
    try:
        silent = socket.create_connection(addr)  # stalls: must not block the others
        assert not _answer(socket.create_connection(addr), 1, secret, TCP_LABEL, 0, garbage=True)   # no secret
        assert not _answer(socket.create_connection(addr), 1, b"x" * 32, TCP_LABEL, 0)              # wrong MAC
        assert not _answer(socket.create_connection(addr), 1, secret, b"mkernel-exchange-1", 0)     # other protocol
        assert not _answer(socket.create_connection(addr), 7, secret, TCP_LABEL, 0)                 # out of range
        assert not _answer(socket.create_connection(addr), -1, secret, TCP_LABEL, 0)                # out of range
        assert not _answer(socket.create_connection(addr), 0, secret, TCP_LABEL, 0)                 # the listener itself
        one = auth.connect_peer(addr, secret, TCP_LABEL, 1, 0, 10.0)
        assert not _answer(socket.create_connection(addr), 1, secret, TCP_LABEL, 0)                 # duplicate
        two = auth.connect_peer(addr, secret, TCP_LABEL, 2, 0, 10.0)
        t.join(15)
        assert "error" not in box, box.get("error")
        assert sorted(box["peers"]) == [1, 2]
        silent.settimeout(5)
        got = b""
        while chunk := silent.recv(64):  # the listener sent its nonce, then closed the connection
            got += chunk
        assert len(got) == 32
        # the accepted sockets are connected to the right peers
        box["peers"][1].sendall(b"to-one")
        assert one.recv(6) == b"to-one"
        box["peers"][2].sendall(b"to-two")
        assert two.recv(6) == b"to-two"
        for s in (one, two, silent, *box["peers"].values()):
            s.close()
    finally:
        srv.close()


def test_handshake_times_out_naming_the_missing_rank():
    secret = auth.new_secret()
    srv, addr = _listener()
    t, box = _accept_in_thread(srv, secret, [1], timeout=1.0)
    assert not _answer(socket.create_connection(addr), 1, b"y" * 32, TCP_LABEL, 0)
    t.join(10)
    srv.close()
    err = box.get("error")
    assert isinstance(err, CommError) and "[1]" in str(err) and "wrong MAC" in str(err), err


def test_connector_refuses_a_listener_without_the_secret():
    srv, addr = _listener()

    def fake():
        c, _ = srv.accept()
        c.sendall(secrets.token_bytes(32))
        c.recv(68)
        c.sendall(secrets.token_bytes(32))  # a MAC it cannot compute
        time.sleep(0.5)
        c.close()

    t = threading.Thread(target=fake, daemon=True)
    t.start()
    with pytest.raises(CommError, match="failed to authenticate"):
        auth.connect_peer(addr, auth.new_secret(), TCP_LABEL, 1, 0, 10.0)
    t.join(5)
    srv.close()


# ---- SocketExchanger ----------------------------------------------------------------------------

def test_exchange_encoding_round_trips_what_the_transports_send():
    verbs_info = {"qpn": {1: 17, 2: 18}, "psn": {1: 5, 2: 6}, "lid": 0, "gid": "fe80:0000:0000:0000:0000:0000:0000:0001",
                  "mtu": 5, "notify": "write", "win": [(4096, 0x1234, 1 << 20), (0, 77, 64)]}
    values = [None, "host-a", ("10.0.0.1", 40000), ("host", secrets.token_bytes(32)), ("error", "boom"),
              verbs_info, [1, 2.5, True, False, [], {}, ()], {"nested": {("a", 1): [b"", b"\xff"]}},
              np.int64(3)]
    for v in values:
        got = decode(encode(v))
        assert got == (int(v) if isinstance(v, np.integer) else v)
        assert type(got) is (int if isinstance(v, np.integer) else type(v))
    got = decode(encode(verbs_info))
    assert type(got["win"][0]) is tuple and list(got["qpn"]) == [1, 2]
    with pytest.raises(TypeError):
        encode(object())
    with pytest.raises(ValueError):
        encode(float("nan"))
    for bad in (b"\x80\x04K\x01.", b'{"x": 1}', b'{"b": "***"}', b'NaN', b"[" * 100000, b'{"d": [[[1], 2]]}'):
        with pytest.raises(ValueError):
            decode(bad)


def test_exchange_needs_an_explicit_port_and_a_token(monkeypatch):
    monkeypatch.delenv("MKERNEL_EXCHANGE_PORT", raising=False)
    monkeypatch.delenv("MKERNEL_EXCHANGE_TOKEN", raising=False)
    with pytest.raises(ValueError, match="port"):
        SocketExchanger(0, 2, LO, token="t")
    with pytest.raises(ValueError, match="token"):
        SocketExchanger(0, 2, LO, 12345)


def _exchanger_in_thread(rank, size, port, token, timeout=10.0):
    box = {}

    def run():
        try:
            box["ex"] = SocketExchanger(rank, size, LO, port, timeout=timeout, token=token)
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_exchange_round_trip_with_env_port_and_token(monkeypatch):
    port = _free_port()
    monkeypatch.setenv("MKERNEL_EXCHANGE_PORT", str(port))
    monkeypatch.setenv("MKERNEL_EXCHANGE_TOKEN", "s3cret")
    t, box = _exchanger_in_thread(0, 2, None, None)
    ex1 = SocketExchanger(1, 2, LO, timeout=10)
    t.join(10)
    ex0 = box["ex"]
    res = {}
    th = threading.Thread(target=lambda: res.__setitem__(0, ex0.allgather(("127.0.0.1", 5, b"\x01"))))
    th.start()
    res[1] = ex1.allgather({"qpn": {0: 3}})
    th.join(10)
    assert res[0] == res[1] == [("127.0.0.1", 5, b"\x01"), {"qpn": {0: 3}}]
    ex0.close(), ex1.close()


def _framed(payload: bytes) -> bytes:
    return struct.pack("<Q", len(payload)) + payload


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_exchange_never_unpickles(tmp_path):
    marker = str(tmp_path / "pwned")
    evil = pickle.dumps(_Evil(marker))
    assert not os.path.exists(marker)
    # (a) a stranger without the token sends the pickle as its "hello"
    port = _free_port()
    t, box = _exchanger_in_thread(0, 2, port, "tok", timeout=1.5)
    time.sleep(0.2)
    s = socket.create_connection((LO, port), timeout=5)
    s.recv(32)
    s.sendall(_framed(evil))
    t.join(10)
    s.close()
    assert isinstance(box.get("error"), CommError), box
    assert not os.path.exists(marker)
    # (b) a rank with the token sends the pickle as its allgather contribution
    port = _free_port()
    t, box = _exchanger_in_thread(0, 2, port, "tok")
    ex1 = SocketExchanger(1, 2, LO, port, timeout=10, token="tok")
    t.join(10)
    ex1._peers[0].sendall(_framed(evil))
    with pytest.raises(CommError, match="malformed"):
        box["ex"].allgather(None)
    assert not os.path.exists(marker)
    ex1.close(), box["ex"].close()


def test_exchange_refuses_an_oversized_message():
    port = _free_port()
    t, box = _exchanger_in_thread(0, 2, port, b"tok")
    ex1 = SocketExchanger(1, 2, LO, port, timeout=10, token=b"tok")
    t.join(10)
    ex1._peers[0].sendall(struct.pack("<Q", 1 << 40))
    with pytest.raises(CommError, match="limit"):
        box["ex"].allgather(None)
    with pytest.raises(ValueError, match="limit"):
        ex1.allgather(b"\0" * MAX_MESSAGE)
    ex1.close(), box["ex"].close()


def test_exchange_refuses_a_wrong_token():
    port = _free_port()
    t, box = _exchanger_in_thread(0, 2, port, "right", timeout=1.5)
    with pytest.raises((ConnectionError, CommError)):
        SocketExchanger(1, 2, LO, port, timeout=1.5, token="wrong")
    t.join(10)
    err = box.get("error")
    assert isinstance(err, CommError) and "wrong MAC" in str(err), err
