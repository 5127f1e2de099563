"""In-process unit tests of the proxy ring, batching and flag coalescing (fake transport)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from mkernel.errors import CommError
from mkernel.proxy import CMD_DTYPE, OP_BARRIER, OP_FLAG, OP_NOP, OP_WRITE, Proxy, Ring
from mkernel.proxy.engine import _coalesce
from mkernel.proxy.transport import Exchanger, Transport


class FakeEx(Exchanger):
    def __init__(self, rank=0, size=4):
        self.rank, self.size = rank, size

    def allgather(self, obj):
        return [obj] * self.size


class FakeTransport(Transport):
    name = "fake"

    def __init__(self, ex, windows, fail_after=None, **kw):
        super().__init__(ex, windows)
        self.posts, self.fail_after, self._done = [], fail_after, []
        self.error = None

    def connect(self):
        pass

    def post(self, batches):
        if self.fail_after is not None and len(self.posts) >= self.fail_after:
            raise CommError("fake transport: peer 2 is gone", {"peer": 2})
        self.posts.append(batches)
        t = self.next_token()
        self._done.append(t)
        return t

    def progress(self):
        out, self._done = self._done, []
        return out

    def close(self, timeout=10.0):
        pass


def make(capacity=16, **kw):
    ex = FakeEx()
    return Proxy(ex, [np.zeros(1 << 16, np.uint8), np.zeros(4096, np.uint8)], transport=FakeTransport,
                 ring_capacity=capacity, transport_options=kw)


def test_dtype_is_64_bytes_aligned():
    assert CMD_DTYPE.itemsize == 64
    assert CMD_DTYPE.fields["seq"][1] == 56


def test_ring_capacity_power_of_two():
    with pytest.raises(ValueError):
        Ring.host(12)


def test_batch_groups_data_then_max_flag_per_destination():
    p = make(64)
    prod = p.producer(5)
    for i in range(10):  # contiguous chunks to rank 1, same flag, growing value
        prod.push(OP_WRITE, 1, 0, 100 * i, 100 * i, 100, 1, 8, i + 1)
    prod.push(OP_WRITE, 2, 0, 5000, 7000, 10, 1, 16, 3)
    prod.push(OP_WRITE, 2, 0, 6000, 9000, 10, 1, 16, 2)   # lower value: implied by 3
    prod.push(OP_NOP)
    prod.push(OP_FLAG, 3, flag_win=1, flag_offset=24, flag_value=9)
    assert p._poll_once() == 14
    (batches,) = p.transport.posts
    by = {b.dst: b for b in batches}
    assert by[1].data == [(0, 0, 0, 1000)]          # ten contiguous chunks coalesced
    assert by[1].flags == [(1, 8, 10)]               # one flag write, the highest value
    assert by[2].data == [(0, 5000, 7000, 10), (0, 6000, 9000, 10)]
    assert by[2].flags == [(1, 16, 3)]
    assert by[3].data == [] and by[3].flags == [(1, 24, 9)]
    p._progress()
    assert int(p.ring.done[0]) == 14 and int(p.ring.tail[0]) == 14


def test_barrier_goes_to_every_other_rank():
    p = make()
    p.producer().push(OP_BARRIER, -1, flag_win=1, flag_offset=8 * 0, flag_value=5)
    p._poll_once()
    assert sorted(b.dst for b in p.transport.posts[0]) == [1, 2, 3]


def test_wraparound_and_backpressure_with_thread():
    p = make(4)
    prod = p.producer(5)
    p.start()
    for i in range(1000):
        prod.push(OP_WRITE, 1 + i % 3, 0, 8 * i, 8 * i, 8, 1, 8 * (i % 3), i + 1)
    prod.wait_done(999)
    p.close()
    assert prod.full_waits > 0
    sent = sum(len(b.data) for bs in p.transport.posts for b in bs)
    assert 0 < sent <= 1000
    flags = {}
    for bs in p.transport.posts:
        for b in bs:
            for w, o, v in b.flags:
                assert v > flags.get((b.dst, o), 0)  # flag values only grow per destination
                flags[(b.dst, o)] = v
    assert max(flags.values()) == 1000


def test_bad_destination_and_transport_error_surface_as_commerror():
    p = make()
    p.producer().push(OP_WRITE, 0, 0, 0, 0, 8, 1, 0, 1)  # to self
    with pytest.raises(CommError):
        p._poll_once()
    q = make(8, fail_after=0)
    prod = q.producer(5)
    q.start()
    prod.push(OP_WRITE, 1, 0, 0, 0, 8, 1, 0, 1)
    t0 = time.monotonic()
    while q.error is None and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    assert isinstance(q.error, CommError)
    with pytest.raises(CommError):
        q.check()
    with pytest.raises(CommError):
        q.close()


def test_coalesce():
    assert _coalesce([(0, 0, 0, 4), (0, 4, 4, 4), (0, 8, 12, 4), (1, 12, 16, 4), (0, 0, 0, 0)]) == \
        [(0, 0, 0, 8), (0, 8, 12, 4), (1, 12, 16, 4)]


def test_proxy_timeout_reaches_the_transport_and_is_validated():
    seen = {}

    class Recording(FakeTransport):
        def __init__(self, ex, windows, **kw):
            seen.update(kw)
            super().__init__(ex, windows, **kw)

    wins = [np.zeros(4096, np.uint8)]
    p = Proxy(FakeEx(), wins, transport=Recording, ring_capacity=16, timeout=2.5)
    assert seen["timeout"] == 2.5 and p.timeout == 2.5 and p.producer().timeout == 2.5
    p.close()
    seen.clear()  # an explicit transport option wins
    Proxy(FakeEx(), wins, transport=Recording, ring_capacity=16, timeout=2.5,
          transport_options={"timeout": 9.0}).close()
    assert seen["timeout"] == 9.0
    seen.clear()  # no timeout: the transport keeps its own default
    p = Proxy(FakeEx(), wins, transport=Recording, ring_capacity=16)
    assert "timeout" not in seen and p.timeout == 30.0
    p.close()
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="Proxy timeout"):
            Proxy(FakeEx(), wins, transport=Recording, ring_capacity=16, timeout=bad)


def test_windows_are_prepared_before_the_proxy_thread_runs():
    """A GPU window's copy streams and staging are made at set-up: made by the proxy's threads while a
    kernel waits on them, the driver calls could stall that kernel (docs/internode.md)."""
    from mkernel.proxy.transport.window import HostWindow

    made = []

    class Recording(HostWindow):
        def prepare(self):
            made.append(self)

    w = Recording(np.zeros(4096, np.uint8))
    p = Proxy(FakeEx(), [w], transport=FakeTransport, ring_capacity=16)
    assert made == [w] and p._thread is None  # (prepared by the constructor, before start())
    p.close()
