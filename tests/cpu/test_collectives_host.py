"""Host side of the collectives on the CPU: argument checks raise before any launch, the plan
(one-shot vs two-phase, shard alignment, chunking, grid, path) is what the kernels expect, and a
repeated call re-points its bound launch instead of planning again.  The context is a stand-in and
arrays carry fake device pointers: nothing touches a GPU."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from mkernel.core import env as ENV
from mkernel.core.arrays import DeviceArray
from mkernel.dist.signals import MAX_CHUNKS, MkComm
from mkernel.ops.base import OpState
from mkernel.ops.collectives import CollectiveOptions
from mkernel.ops.collectives import api as C
from mkernel.ops.collectives import layout as LY


class FakeWs:
    def __init__(self, nbytes):
        self.ptr, self.peer_table, self.nbytes = 1 << 40, 1 << 41, nbytes

    @staticmethod
    def peer_ptr(j, offset=0):
        return (1 << 44) * (j + 1) + offset


class FakeCtx:
    device, size, local_size, rank, local_rank, num_nodes, sm_count, resident_sms = 0, 2, 2, 0, 0, 1, 132, 132
    world = object()

    def __init__(self):
        self.agreed = []
        self.sym = None  # what symmetric_region returns
        self._ws_gen = 0
        self.states = {}
        self.workspaces = []

    def symmetric_region(self, ptr, nbytes):
        return self.sym

    def check(self):
        pass

    def agree(self, what, signature, comm=None):
        self.agreed.append((what, signature))
        return 0x5000 + len(self.agreed)  # the call's signature (MkComm.sig)

    def op_state(self, name):
        return self.states.setdefault(name, OpState(name))

    def last_plan(self, name):
        return self.states[name].last_plan

    def workspace(self, key, nbytes, stream=None, what=""):
        self.workspaces.append((key, nbytes))
        return FakeWs(nbytes)

    def comm_args(self, op, sig=0):
        c = MkComm()
        c.sig = sig
        return c

    def side_stream(self):
        return 11


class FakeLaunch:
    def __init__(self, log, name, grid, args, stream):
        self.log, self.name, self.grid, self.args, self.stream = log, name, grid, args, stream

    def submit(self):  # (reads the argument objects' values at submission, as the driver does)
        self.log.append(dict(op=self.name, grid=self.grid, stream=self.stream,
                             values=[getattr(a, "value", a) for a in self.args]))


class FakeKernel:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def prepare(self, grid, block, args, *, stream=None, cooperative=False, **kw):
        self.log.append(dict(prepared=self.name, grid=grid))
        return FakeLaunch(self.log, self.name, grid, list(args), stream)

    def launch(self, grid, block, args, *, stream=None, **kw):
        self.log.append(dict(op=self.name, grid=grid, stream=stream, values=[getattr(a, "value", a) for a in args]))


class FakeFork:
    """ForkedCopies without a driver: records fork / copies / resume / join in ``FakeFork.log``."""

    log: list = []

    def __init__(self, side):
        pass

    def fork(self, s, begin=None):
        FakeFork.log.append("fork")
        if begin is not None:
            begin(11)

    def resume(self, s):
        FakeFork.log.append("resume")

    def copies(self, lst):
        FakeFork.log.append([(int(d), int(s), n) for d, s, n in lst])

    def join(self, s):
        FakeFork.log.append("join")


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("MKERNEL_COLL_CE", raising=False)
    ENV.reload()
    log = []
    monkeypatch.setattr(C, "_residency_checked", lambda ctx, op, dtype, threads=512: FakeKernel(log, op))
    monkeypatch.setattr(C, "ForkedCopies", FakeFork)
    yield FakeCtx(), log
    monkeypatch.undo()
    ENV.reload()


_next = [1 << 20]


def arr(shape, dtype="float32", device=0, ptr=None, strides=None):
    p = ptr if ptr is not None else _next[0]
    a = DeviceArray(p, shape, dtype, strides, device, None)
    _next[0] += max(1 << 24, (a.nbytes + 4095) // 4096 * 4096)
    return a


def launches(log):
    return [e for e in log if "values" in e]


def test_bad_inputs_raise_before_launch(env):
    ctx, log = env
    with pytest.raises(TypeError, match="all_reduce: x must be bfloat16, float16 or float32, got int32"):
        C.all_reduce(ctx, arr((8,), "int32"), arr((8,), "int32"))
    with pytest.raises(TypeError, match="host array"):
        C.all_reduce(ctx, np.ones(4, np.float32), arr((4,)))
    with pytest.raises(ValueError, match="x must be contiguous"):
        C.all_reduce(ctx, arr((8, 4), strides=(8, 2)), arr((8, 4)))
    with pytest.raises(ValueError, match="x is on cuda:1, expected cuda:0"):
        C.all_reduce(ctx, arr((8,), device=1), arr((8,)))
    with pytest.raises(ValueError, match="x must be 4-byte aligned"):
        C.all_reduce(ctx, arr((8,), ptr=(1 << 40) + 2), arr((8,)))
    with pytest.raises(ValueError, match=r"out must be float32 \(8,\), got float32 \(3,\)"):
        C.all_reduce(ctx, arr((8,)), arr((3,)))
    with pytest.raises(ValueError, match=r"out must be float32 \(8,\), got bfloat16 \(8,\)"):
        C.all_reduce(ctx, arr((8,)), arr((8,), "bfloat16"))
    x = arr((16,))
    with pytest.raises(ValueError, match="overlaps x without being x"):
        C.all_reduce(ctx, x, DeviceArray(x.ptr + 4, (16,), "float32", None, 0, None))
    with pytest.raises(ValueError, match="multiple of the number of ranks"):
        C.reduce_scatter(ctx, arr((7,)), arr((3,)))
    with pytest.raises(ValueError, match="out must not overlap x"):
        C.reduce_scatter(ctx, x, DeviceArray(x.ptr, (8,), "float32", None, 0, None))
    out = arr((8,))
    with pytest.raises(ValueError, match="not this rank's own rows"):
        C.all_gather(ctx, DeviceArray(out.ptr + 4, (4,), "float32", None, 0, None), out)
    with pytest.raises(TypeError, match="all_gather: x: unsupported __cuda_array_interface__ typestr '<f8'"):
        C.all_gather(ctx, _bad_gather_dtype(), arr((8,)))
    ro = DeviceArray(arr((8,)).ptr, (8,), "float32", None, 0, None, readonly=True)
    with pytest.raises(ValueError, match="out is read-only"):
        C.all_reduce(ctx, arr((8,)), ro)
    with pytest.raises(ValueError, match="ce_max_chunks"):
        C.all_reduce(ctx, arr((8,)), arr((8,)), options=CollectiveOptions(ce_max_chunks=0))
    assert log == [] and ctx.agreed == []


def _bad_gather_dtype():
    class CAI:  # a float64 producer: not a dtype the collectives take
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f8", "data": (1 << 41, False), "version": 3}

    return CAI()


def test_plans(env):
    ctx, log = env
    C.all_gather(ctx, arr((5, 3), "bfloat16"), arr((10, 3), "bfloat16"))
    ag = ctx.last_plan("all_gather")
    own = arr((8,), "int64")
    C.all_gather(ctx, DeviceArray(own.ptr, (4,), "int64", None, 0, None), own)  # in place: own rows
    ag2 = ctx.last_plan("all_gather")
    C.reduce_scatter(ctx, arr((6, 2), "float16"), arr((3, 2), "float16"))
    rs = ctx.last_plan("reduce_scatter")
    C.all_reduce(ctx, arr((1000,), "bfloat16"), arr((1000,), "bfloat16"))
    ar1 = ctx.last_plan("all_reduce")
    n = CollectiveOptions().one_shot_limit(2)  # bf16: twice the one-shot limit of 2 ranks, in bytes
    C.all_reduce(ctx, arr((n + 1,), "bfloat16"), arr((n + 1,), "bfloat16"))
    ar2 = ctx.last_plan("all_reduce")
    assert (ag.op, ag.path, ag.sm_args, ag.layout.slot_bytes) == ("all_gather", "sm", (30,), 256)
    assert ag2.sm_args == (32,)  # one byte-oriented kernel for every dtype
    assert (rs.op, rs.sm_args) == ("reduce_scatter", (6,))
    assert ar1.one_shot and ar1.sm_args == (1000, 1000, 1) and ar1.layout.slot_bytes == 2048
    shard = ar2.shard
    assert not ar2.one_shot and ar2.sm_args == (n + 1, shard, 0) and shard % 8 == 0 and 2 * shard >= n + 1
    assert ar2.layout.slot_bytes == LY.round_up(shard * 2, 256)
    assert ar2.ws_bytes == ar2.layout.data0_off + 2 * 2 * ar2.layout.slot_bytes
    assert ctx.agreed[0][1] == ("bfloat16", (5, 3), False)  # (dtype, shape, copy engines)
    sigs = [e["values"][0].sig for e in launches(log)]
    assert sigs == [0x5001, 0x5002, 0x5003, 0x5004, 0x5005]  # agree's digest reaches the kernel


def test_repeated_calls_repoint_the_bound_launch(env):
    """A call with new arrays of the same layout (shapes, strides, dtypes, devices), stream, options and
    workspace generation re-points the first call's prepared launch: no checks again, no agreement, no
    plan, no packing -- only the pointers change.  Anything else in the key binds anew."""
    ctx, log = env
    x, o = arr((1000,), "bfloat16"), arr((1000,), "bfloat16")
    C.all_reduce(ctx, x, o)
    x2, o2 = arr((1000,), "bfloat16"), arr((1000,), "bfloat16")
    C.all_reduce(ctx, x2, o2)
    prepared = [e for e in log if "prepared" in e]
    runs = launches(log)
    assert len(prepared) == 1 and len(runs) == 2 and len(ctx.agreed) == 1  # (the second call: no agreement)
    assert runs[0]["values"][1:3] == [x.ptr, o.ptr] and runs[1]["values"][1:3] == [x2.ptr, o2.ptr]
    C.all_reduce(ctx, x, o, stream=5)  # another stream
    C.all_reduce(ctx, x, o, stream=5, options=CollectiveOptions(min_chunk=64 * 1024))  # other options
    ctx._ws_gen = 1  # a workspace was reallocated
    C.all_reduce(ctx, x, o, stream=5)
    C.all_reduce(ctx, x, x, stream=5)  # in place
    assert len([e for e in log if "prepared" in e]) == 5
    assert len(set(ctx.agreed)) == 1  # one signature (the fake does not cache agreed ones, as Agreement does)

    class CAI:  # a foreign array of the same layout: the same bound launch
        __cuda_array_interface__ = {"shape": (1000,), "typestr": "<V2", "data": (x2.ptr, False), "version": 2}

    C.all_reduce(ctx, CAI(), o2, stream=5)
    assert len([e for e in log if "prepared" in e]) == 5 and launches(log)[-1]["values"][1:3] == [x2.ptr, o2.ptr]
    ctx.check = lambda: (_ for _ in ()).throw(RuntimeError("kernel failed"))
    n = len(log)
    with pytest.raises(RuntimeError, match="kernel failed"):
        C.all_reduce(ctx, x, o, stream=5)  # a bound call checks the error record first
    assert len(log) == n


@pytest.mark.parametrize("slot", [16, 1000, 4 << 20, 32 << 20, 64 << 20, (1 << 30) + 12345])
def test_layout(slot):
    L, total, grid = LY.sm_layout(2, slot, 132, 2, CollectiveOptions().min_chunk)
    assert L.chunk_bytes % 16 == 0 and L.nchunks * L.chunk_bytes >= L.slot_bytes >= slot
    assert (L.nchunks - 1) * L.chunk_bytes < L.slot_bytes
    assert 1 <= grid <= min(L.nchunks, 132 if L.slot_bytes >= LY.LARGE_SLOT_BYTES else LY.SMALL_SLOT_BLOCKS)
    assert L.data0_off % 4096 == 0 and L.flags_off + 8 * 2 * 2 * L.flag_stride <= L.data0_off
    assert L.nchunks <= L.flag_stride == MAX_CHUNKS
    assert L.consumed_off + 8 * 4 * 2 <= L.flags_off  # consumed[P], entered[P], sig[P][2]
    assert total == L.data0_off + 2 * 2 * L.slot_bytes


@pytest.mark.parametrize("P", [2, 3, 8])
def test_control_words_do_not_move_with_the_size(P):
    """Every call of an op shares its workspace: the epoch, call header and flags sit at offsets of P
    only, on the SM and the copy-engine path alike, so a flag never lies on bytes an earlier call of
    another size left in its slots (tests/gpu test_stale_slot_bytes_are_never_flags); no plan cuts a
    slot into more chunks than there are flags, even on a GPU with many SMs or with the copy-engine
    chunking raised through the environment."""
    slots = [16, 1000, 65536, 1 << 20, 5 << 20, 32 << 20, 1 << 30, (1 << 34) + 12345]
    mc = CollectiveOptions().min_chunk
    layouts = [LY.sm_layout(P, s, g, ph, mc)[0] for s in slots for g in (8, 132, 1024) for ph in (1, 2)]
    layouts += [LY.ce_layout(P, s, ph, 8, 4)[0] for s in slots for ph in (1, 2)]
    control = {(L.consumed_off, L.flags_off, L.data0_off, L.flag_stride) for L in layouts}
    assert len(control) == 1, control
    assert all(1 <= L.nchunks <= L.flag_stride for L in layouts)
    assert LY.ce_layout(P, 1 << 40, 1, MAX_CHUNKS // 2, MAX_CHUNKS // 2)[0].nchunks <= MAX_CHUNKS


def test_copy_engine_choice(env, monkeypatch):
    """Large messages go through the copy engines (the choice is part of the agreed signature); the
    one-shot all-reduce and a single local rank never do; CollectiveOptions.copy_engines (or
    MKERNEL_COLL_CE for the default options) forces either way."""
    ctx, log = env
    MiB = 1 << 20  # the whole decision from an op's input size (what the benchmark labels its rows by)
    o = CollectiveOptions()
    assert LY.copy_engine_path("all_gather", 256 * MiB, 2, 2, o) and not LY.copy_engine_path("all_gather", 255 * MiB, 2, 2, o)
    assert LY.copy_engine_path("reduce_scatter", 128 * MiB, 2, 2, o)
    assert not LY.copy_engine_path("reduce_scatter", 127 * MiB, 2, 2, o)
    assert LY.copy_engine_path("all_reduce", 128 * MiB, 2, 2, o) and not LY.copy_engine_path("all_reduce", 126 * MiB, 2, 2, o)
    assert not LY.copy_engine_path("all_reduce", 1 << 40, 2, 1, o)
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        lim = o.ce_min_bytes(op)
        assert not LY.use_copy_engines(op, lim - 1, 2, o) and LY.use_copy_engines(op, lim, 2, o)
        assert not LY.use_copy_engines(op, 1 << 40, 1, o)
    ce = CollectiveOptions(copy_engines=True)
    C.all_gather(ctx, arr((5, 3), "bfloat16"), arr((10, 3), "bfloat16"), options=ce)
    C.reduce_scatter(ctx, arr((6, 2), "float16"), arr((3, 2), "float16"), options=ce)
    C.all_reduce(ctx, arr((1000,), "bfloat16"), arr((1000,), "bfloat16"), options=ce)  # one-shot: kernel path
    n = o.one_shot_limit(2) // 4 + 1  # just past the (SM) one-shot limit
    C.all_reduce(ctx, arr((n,), "float32"), arr((n,), "float32"), options=ce)  # two ranks: one-shot on the copy engines
    plans = [ctx.states[op].last_plan for op in ("all_gather", "reduce_scatter")]
    assert [(p.path, p.count, p.shard) for p in plans] == [("ce", 30, 0), ("ce", 6, 0)]
    ar = ctx.last_plan("all_reduce")
    assert (ar.path, ar.one_shot, ar.count, ar.shard) == ("ce", True, n, n)
    assert ar.layout.slot_bytes >= 4 * n
    monkeypatch.setattr(C, "CE_ONE_SHOT_MAX_RANKS", 1)
    C.all_reduce(ctx, arr((n,), "float32"), arr((n,), "float32"), options=CollectiveOptions(copy_engines=True, ce_blocks=8))
    ar2 = ctx.last_plan("all_reduce")  # reduce-scatter + all-gather on the copy engines
    sh = ar2.shard
    assert (ar2.path, ar2.one_shot, ar2.count, ar2.grid) == ("ce", False, n, 8) and sh % 4 == 0 and 2 * sh >= n
    assert sh == -(-n // 2 + 3) // 4 * 4 or sh == (-(-n // 2) + 3) // 4 * 4  # 16-byte shards
    assert ar2.layout.data1_off == ar2.layout.data0_off + 2 * ar2.layout.slot_bytes
    assert [a[1][2] for a in ctx.agreed] == [True, True, False, True, True]
    monkeypatch.setenv("MKERNEL_COLL_CE", "0")
    ENV.reload()
    assert CollectiveOptions.default().copy_engines is False
    assert not LY.use_copy_engines("all_reduce", 1 << 40, 2, CollectiveOptions.default())
    monkeypatch.setenv("MKERNEL_COLL_CE", "sometimes")
    with pytest.raises(ValueError, match="MKERNEL_COLL_CE"):
        ENV.reload()
    with pytest.raises(ValueError, match="MKERNEL_COLL_CE"):
        CollectiveOptions.default()


def test_copy_engine_bound_call(env):
    """The copy-engine bound call: begin kernel, pushes, receiving kernel; the pushes follow the arrays
    (a new x re-points the data copies, the flags stay)."""
    ctx, log = env
    FakeFork.log = copies = []
    ce = CollectiveOptions(copy_engines=True)
    x1, x2, o = arr((4096,), "float32"), arr((4096,), "float32"), arr((8192,), "float32")
    C.all_gather(ctx, x1, o, options=ce)
    C.all_gather(ctx, x2, o, options=ce)
    forks = [c for c in copies if isinstance(c, list)]
    assert copies.count("fork") == 2 and copies.count("join") == 2 and len(forks) == 2
    d1 = [s for d, s, n in forks[0] if n != 8]
    d2 = [s for d, s, n in forks[1] if n != 8]
    assert d1 == [x1.ptr] and d2 == [x2.ptr]
    assert [f for f in forks[0] if f[2] == 8] == [f for f in forks[1] if f[2] == 8]
    names = [e["op"] for e in launches(log)]
    assert names == ["coll_ce_begin", "all_gather_ce"] * 2


@pytest.mark.parametrize("slot", [16, 1000, 3 << 20, 8 << 20, 512 << 20, (1 << 30) + 12345])
def test_ce_layout(slot):
    L, total = LY.ce_layout(3, slot, 2, 8, 4)
    assert L.chunk_bytes % 4096 == 0 and L.chunk_bytes >= LY.CE_MIN_CHUNK
    full = L.nchunks - L.tail_pieces + 1 if L.tail_pieces else L.nchunks  # chunks (the last one cut in pieces)
    assert 1 <= full <= 8 and full * L.chunk_bytes >= L.slot_bytes >= slot
    assert (full - 1) * L.chunk_bytes < L.slot_bytes
    assert L.tail_pieces in (0, 4)
    # the chunks partition every message that fits the slot, in order, in 4 KiB-aligned pieces
    for nbytes in {slot, L.slot_bytes, max(1, slot // 3), 4096 * 5 + 16}:
        nbytes = min(nbytes, L.slot_bytes)
        pos = 0
        for c in range(L.nchunks):
            off, n = LY.ce_chunk(L, nbytes, c)
            assert off % 4096 == 0 and (n == 0 or off == pos), (c, off, n, pos)
            pos += n
        assert pos == nbytes
    if L.tail_pieces:  # the last piece is at most a quarter chunk (4 KiB rounding)
        off, n = LY.ce_chunk(L, L.slot_bytes, L.nchunks - L.tail_pieces)
        assert n <= -(-L.chunk_bytes // L.tail_pieces) + 4096
    assert LY.CE_VALUE_OFF + 8 <= L.consumed_off and L.consumed_off + 8 * 3 <= L.flags_off
    assert L.flags_off + 8 * 2 * 3 * L.flag_stride <= L.data0_off and L.data0_off % 4096 == 0
    assert L.nchunks <= L.flag_stride == MAX_CHUNKS
    assert total == L.data0_off + 2 * 3 * L.slot_bytes


class _Ws:
    ptr = 1 << 40

    @staticmethod
    def peer_ptr(j, offset=0):
        return (1 << 44) * (j + 1) + offset


def test_ce_pushes():
    """Rank-rotated destinations, each chunk's data then its flag (copied from the value slot); a
    destination that gets fewer bytes still gets every chunk's flag."""
    P, me = 3, 1
    L, _ = LY.ce_layout(P, 5 << 20, 2, 8, 4)  # 3 chunks of 2 MiB, the last one in 4 pieces of 512 KiB
    assert (L.chunk_bytes, L.nchunks, L.tail_pieces) == (2 << 20, 2 + 4, 4)
    sizes = {2: 5 << 20, 0: 1 << 20}
    pushes = C._ce_pushes(_Ws, L, P, me, 1, lambda d: 1000 * (d + 1) << 20, lambda d: sizes[d])
    got = [(int(d), int(s), n) for d, s, n in pushes]
    value = _Ws.ptr + LY.CE_VALUE_OFF
    want = []
    for dst in (2, 0):
        for c in range(L.nchunks):
            off, n = LY.ce_chunk(L, sizes[dst], c)
            if n:
                want.append((_Ws.peer_ptr(dst, L.data1_off + me * L.slot_bytes + off), (1000 * (dst + 1) << 20) + off, n))
            want.append((_Ws.peer_ptr(dst, L.flags_off + 8 * ((1 * P + me) * L.flag_stride + c)), value, 8))
    assert got == want
    assert sum(n for _, _, n in got if n != 8) == sum(sizes.values())
    sent = C._ce_pushes(_Ws, L, P, me, 0, lambda d: 0, lambda d: sizes[d], sent_flags=True)
    own = [int(d) for d, _, _ in sent if _Ws.peer_ptr(me) <= int(d) < _Ws.peer_ptr(me + 1)]
    assert own == [_Ws.peer_ptr(me, L.flags_off + 8 * (me * L.flag_stride + c)) for c in range(L.nchunks)]
    last_peer = [i for i, (d, _, _) in enumerate(sent) if int(d) >= _Ws.peer_ptr(0) and int(d) < _Ws.peer_ptr(1)]
    assert min(i for i, (d, _, _) in enumerate(sent) if int(d) in own) > min(last_peer)  # after the last peer's chunk


def test_one_shot_limits():
    o = CollectiveOptions()
    assert o.one_shot_limit(2) == 32 << 20 and o.one_shot_limit(3) == o.one_shot_limit(8) == 256 << 10
    assert CollectiveOptions(one_shot_max_bytes=0).one_shot_limit(2) == 0
    assert LY.one_shot(1 << 40, 1, o) and not LY.one_shot((32 << 20) + 1, 2, o)


def test_ce_pushes_chunk_major_for_reductions():
    """Reductions push chunk-major (chunk c reaches every peer before chunk c+1 leaves), so a receiver
    that needs chunk c from everyone is not held up by a whole slot to another peer; with 2 ranks the
    two orders are one; the sent flag of chunk c follows its last push."""
    L, _ = LY.ce_layout(4, 5 << 20, 1, 8, 4)  # 3 chunks (the last in pieces)
    size = lambda d: 5 << 20  # noqa: E731
    P, me = 4, 1
    offs = {LY.ce_chunk(L, 5 << 20, c)[0]: c for c in range(L.nchunks)}  # chunk index of each offset
    data = [c for c in range(L.nchunks) if LY.ce_chunk(L, 5 << 20, c)[1]]  # chunks with bytes (not empty pieces)
    K = L.nchunks

    def order(lst):  # (destination rank, chunk) of each data copy
        return [((int(d) >> 44) - 1, offs[int(d) % (1 << 44) - L.data0_off - me * L.slot_bytes])
                for d, _, n in lst if n != 8]
    peer = C._ce_pushes(_Ws, L, P, me, 0, lambda d: 0, size)
    chunk = C._ce_pushes(_Ws, L, P, me, 0, lambda d: 0, size, chunk_major=True, sent_flags=True)
    assert order(peer) == [(d, c) for d in (2, 3, 0) for c in data]
    assert order(chunk) == [(d, c) for c in data for d in (2, 3, 0)]
    own = [i for i, (d, _, _) in enumerate(chunk) if (int(d) >> 44) - 1 == me]
    data_to_0 = [i for i, (d, _, n) in enumerate(chunk) if n != 8 and (int(d) >> 44) - 1 == 0]
    assert len(own) == K and all(o > d for o, d in zip(own, data_to_0))  # after chunk c's last push
    assert len(data) < K  # (5 MiB: the last chunk's third and fourth pieces are empty: flags only)
    L2, _ = LY.ce_layout(2, 5 << 20, 1, 8, 4)
    two = [C._ce_pushes(_Ws, L2, 2, 0, 0, lambda d: 0, size, chunk_major=cm) for cm in (False, True)]
    assert [(int(d), int(s), n) for d, s, n in two[0]] == [(int(d), int(s), n) for d, s, n in two[1]]


def test_forked_copies_order(monkeypatch):
    """fork: the side stream waits for the caller, then runs begin, then the copies in order; resume:
    it waits for the caller again; join: the caller waits for it."""
    from mkernel.core import driver as DRV
    from mkernel.dist import sidestream as SIDE
    log = []

    class FakeCu:
        CUstream = staticmethod(lambda h: ("stream", int(h)))
        CUresult = DRV.cu.CUresult

        @staticmethod
        def cuEventRecord(ev, s):
            log.append(("record", ev, s))
            return (DRV.cu.CUresult.CUDA_SUCCESS,)

        @staticmethod
        def cuStreamWaitEvent(s, ev, flags):
            log.append(("wait", s, ev))
            return (DRV.cu.CUresult.CUDA_SUCCESS,)

    class FakeEvents:
        def __init__(self, *names):
            for n in names:
                setattr(self, n, n)

    monkeypatch.setattr(SIDE, "cu", FakeCu)
    monkeypatch.setattr(SIDE, "Events", FakeEvents)
    monkeypatch.setattr(SIDE, "copy_async", lambda copies, side: log.append(("copies", side, tuple(copies))))
    f = SIDE.ForkedCopies(11)
    side = ("stream", 11)
    f.fork("caller", lambda sd: log.append(("begin", sd)))
    f.copies(["a", "b"])
    f.resume("caller")
    f.copies(["c"])
    f.join("caller")
    assert log == [("record", "fork", "caller"), ("wait", side, "fork"), ("begin", side), ("copies", side, ("a", "b")),
                   ("record", "fork", "caller"), ("wait", side, "fork"), ("copies", side, ("c",)),
                   ("record", "join", side), ("wait", "caller", "join")]
    log.clear()
    SIDE.ForkedCopies(11).fork("caller")  # no begin
    assert log == [("record", "fork", "caller"), ("wait", side, "fork")]


def test_zero_copy_all_gather_into_symmetric_out(env):
    """An all-gather on the copy-engine path whose out lies in a symmetric buffer: the signature names
    the buffer and offset (every rank must pass the same rows), the layout is marked direct, and the
    data copies go straight into each peer's copy of out at this rank's rows (flags as before)."""
    ctx, _ = env

    class Buf:
        seq = 7

        @staticmethod
        def peer_ptr(j, offset=0):
            return (1 << 44) * (j + 1) + offset
    ctx.sym = (Buf, 4096)
    C.all_gather(ctx, arr((5, 3), "bfloat16"), arr((10, 3), "bfloat16"), options=CollectiveOptions(copy_engines=True))
    plan = ctx.last_plan("all_gather")
    assert plan.zero_copy and plan.layout.direct == 1 and ctx.agreed[-1][1][-1] == "symmetric out: buffer #7 at byte 4096"
    C.all_gather(ctx, arr((5, 3), "bfloat16"), arr((10, 3), "bfloat16"), options=CollectiveOptions(copy_engines=False))
    assert len(ctx.agreed[-1][1]) == 3 and not ctx.last_plan("all_gather").zero_copy  # the SM path never goes direct
    # the pushes of a direct all-gather (rank 1 of 3, 5 MiB messages)
    P, me, nb = 3, 1, 5 << 20
    L, _ = LY.ce_layout(P, nb, 1, 8, 4)
    flat = C._ce_pushes(_Ws, L, P, me, 0, lambda d: 1 << 30, lambda d: nb,
                        dst_of=lambda d: Buf.peer_ptr(d, 4096 + me * nb))
    data = [(int(d), int(s), n) for d, s, n in flat if n != 8]
    assert sum(n for *_, n in data) == 2 * nb
    for d, s, n in data:
        j = (d >> 44) - 1
        assert j in (2, 0) and d - Buf.peer_ptr(j, 4096 + me * nb) == s - (1 << 30)  # our rows of j's out
    flags = [int(d) for d, _, n in flat if n == 8]
    assert flags == [_Ws.peer_ptr(j, L.flags_off + 8 * (me * L.flag_stride + c))
                     for j in (2, 0) for c in range(L.nchunks)]
    assert LY.CollLayout.direct.offset == 56 and LY.CollLayout.flag_stride.offset == 60
    assert ctypes.sizeof(LY.CollLayout) == 64  # collectives.cu's struct
