"""Host side of the collectives on the CPU: argument checks raise before any launch, and the plan
(one-shot vs two-phase, shard alignment, chunking, grid) is what the kernels expect.  The context is
a stand-in and arrays carry fake device pointers: nothing touches a GPU."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from mkernel.ops.collectives import api as C
from mkernel.core.arrays import DeviceArray


class FakeCtx:
    device, size, local_size, rank, local_rank, num_nodes, sm_count = 0, 2, 2, 0, 0, 1, 132
    world = object()
    _ws_gen = 0  # Context's workspace generation

    def __init__(self):
        self.agreed = []
        self.sym = None  # what symmetric_region returns

    def symmetric_region(self, ptr, nbytes):
        return self.sym

    def check(self):
        pass

    def agree(self, what, signature, comm=None):
        self.agreed.append((what, signature))
        return 0x5000 + len(self.agreed)  # the call's signature (MkComm.sig)


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("MKERNEL_COLL_CE", raising=False)
    launches = []
    monkeypatch.setattr(C, "_launch", lambda ctx, op, dtype, slot, phases, head, stream, sig:
                        launches.append(dict(op=op, dtype=dtype.name, slot=slot, phases=phases, head=head, sig=sig)))
    return FakeCtx(), launches


_next = [1 << 20]


def arr(shape, dtype="float32", device=0, ptr=None, strides=None):
    p = ptr if ptr is not None else _next[0]
    a = DeviceArray(p, shape, dtype, strides, device, None)
    _next[0] += max(1 << 24, (a.nbytes + 4095) // 4096 * 4096)
    return a


def test_bad_inputs_raise_before_launch(env):
    ctx, launches = env
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
    assert launches == [] and ctx.agreed == []


def _bad_gather_dtype():
    class CAI:  # a float64 producer: not a dtype the collectives take
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f8", "data": (1 << 41, False), "version": 3}

    return CAI()


def test_plans(env):
    ctx, launches = env
    C.all_gather(ctx, arr((5, 3), "bfloat16"), arr((10, 3), "bfloat16"))
    own = arr((8,), "int64")
    C.all_gather(ctx, DeviceArray(own.ptr, (4,), "int64", None, 0, None), own)  # in place: own rows
    C.reduce_scatter(ctx, arr((6, 2), "float16"), arr((3, 2), "float16"))
    C.all_reduce(ctx, arr((1000,), "bfloat16"), arr((1000,), "bfloat16"))
    n = C.one_shot_max_bytes(2)  # bf16: twice the one-shot limit of 2 ranks, in bytes
    C.all_reduce(ctx, arr((n + 1,), "bfloat16"), arr((n + 1,), "bfloat16"))
    ag, ag2, rs, ar1, ar2 = launches
    assert (ag["op"], ag["dtype"], ag["slot"], ag["phases"]) == ("all_gather", "bfloat16", 30, 1)
    assert ag2["dtype"] == "bfloat16" and ag2["slot"] == 32  # one byte-oriented kernel for every dtype
    assert (rs["op"], rs["slot"], rs["head"][2].value) == ("reduce_scatter", 12, 6)
    assert (ar1["phases"], ar1["head"][4].value, ar1["slot"]) == (1, 1, 2000)  # one-shot
    shard = ar2["head"][3].value
    assert ar2["phases"] == 2 and ar2["head"][4].value == 0 and shard % 8 == 0 and 2 * shard >= n + 1
    assert ar2["slot"] == shard * 2
    assert [a[1] for a in ctx.agreed][0] == ("bfloat16", (5, 3), False)  # (dtype, shape, copy engines)
    assert [l["sig"] for l in launches] == [0x5001, 0x5002, 0x5003, 0x5004, 0x5005]  # agree's digest reaches the kernel


@pytest.mark.parametrize("slot", [16, 1000, 4 << 20, 32 << 20, 64 << 20, (1 << 30) + 12345])
def test_layout(slot):
    L, total, grid = C._layout(2, slot, 132, 2)
    assert L.chunk_bytes % 16 == 0 and L.nchunks * L.chunk_bytes >= L.slot_bytes >= slot
    assert (L.nchunks - 1) * L.chunk_bytes < L.slot_bytes
    assert 1 <= grid <= min(L.nchunks, 132 if L.slot_bytes >= C.LARGE_SLOT_BYTES else C.SMALL_SLOT_BLOCKS)
    assert L.data0_off % 4096 == 0 and L.flags_off + 8 * 2 * 2 * L.flag_stride <= L.data0_off
    assert L.nchunks <= L.flag_stride == C.MAX_CHUNKS
    assert L.consumed_off + 8 * 4 * 2 <= L.flags_off  # consumed[P], entered[P], sig[P][2]
    assert total == L.data0_off + 2 * 2 * L.slot_bytes


@pytest.mark.parametrize("P", [2, 3, 8])
def test_control_words_do_not_move_with_the_size(P, monkeypatch):
    """Every call of an op shares its workspace: the epoch, call header and flags sit at offsets of P
    only, on the SM and the copy-engine path alike, so a flag never lies on bytes an earlier call of
    another size left in its slots (tests/gpu test_stale_slot_bytes_are_never_flags); no plan cuts a
    slot into more chunks than there are flags, even on a GPU with many SMs or with the copy-engine
    chunking raised through the environment."""
    slots = [16, 1000, 65536, 1 << 20, 5 << 20, 32 << 20, 1 << 30, (1 << 34) + 12345]
    layouts = [C._layout(P, s, g, ph)[0] for s in slots for g in (8, 132, 1024) for ph in (1, 2)]
    layouts += [C._ce_layout(P, s, ph)[0] for s in slots for ph in (1, 2)]
    control = {(L.consumed_off, L.flags_off, L.data0_off, L.flag_stride) for L in layouts}
    assert len(control) == 1, control
    assert all(1 <= L.nchunks <= L.flag_stride for L in layouts)
    monkeypatch.setattr(C, "CE_MAX_CHUNKS", C.MAX_CHUNKS // 2)
    monkeypatch.setattr(C, "CE_TAIL_PIECES", C.MAX_CHUNKS // 2)
    assert C._ce_layout(P, 1 << 40, 1)[0].nchunks <= C.MAX_CHUNKS


def test_copy_engine_choice(env, monkeypatch):
    """Large messages go through the copy engines (the choice is part of the agreed signature); the
    one-shot all-reduce and a single local rank never do; MKERNEL_COLL_CE forces either way."""
    ctx, launches = env
    MiB = 1 << 20  # the whole decision from an op's input size (what the benchmark labels its rows by)
    assert C.copy_engine_path("all_gather", 256 * MiB, 2, 2) and not C.copy_engine_path("all_gather", 255 * MiB, 2, 2)
    assert C.copy_engine_path("reduce_scatter", 128 * MiB, 2, 2) and not C.copy_engine_path("reduce_scatter", 127 * MiB, 2, 2)
    assert C.copy_engine_path("all_reduce", 128 * MiB, 2, 2) and not C.copy_engine_path("all_reduce", 126 * MiB, 2, 2)
    assert not C.copy_engine_path("all_reduce", 1 << 40, 2, 1)
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        lim = C.CE_MIN_BYTES[op]
        assert not C.use_copy_engines(op, lim - 1, 2) and C.use_copy_engines(op, lim, 2)
        assert not C.use_copy_engines(op, 1 << 40, 1)
    ce_calls = []
    monkeypatch.setattr(C, "_ce_run", lambda ctx, op, dtype, msg, phases, x, o, count, shard, stream, sig,
                        direct=None: ce_calls.append((op, dtype.name, msg, phases, count, shard)))
    monkeypatch.setenv("MKERNEL_COLL_CE", "1")
    C.all_gather(ctx, arr((5, 3), "bfloat16"), arr((10, 3), "bfloat16"))
    C.reduce_scatter(ctx, arr((6, 2), "float16"), arr((3, 2), "float16"))
    C.all_reduce(ctx, arr((1000,), "bfloat16"), arr((1000,), "bfloat16"))  # one-shot: kernel path
    n = C.one_shot_max_bytes(2) // 4 + 1  # just past the (SM) one-shot limit
    C.all_reduce(ctx, arr((n,), "float32"), arr((n,), "float32"))  # two ranks: one-shot on the copy engines
    monkeypatch.setattr(C, "CE_ONE_SHOT_MAX_RANKS", 1)
    C.all_reduce(ctx, arr((n,), "float32"), arr((n,), "float32"))  # reduce-scatter + all-gather
    assert ce_calls[0] == ("all_gather", "bfloat16", 30, 1, 30, 0)
    assert ce_calls[1] == ("reduce_scatter", "float16", 12, 1, 6, 0)
    assert ce_calls[2] == ("all_reduce", "float32", 4 * n, 1, n, n)
    op, dt, msg, phases, count, sh = ce_calls[3]
    assert (op, dt, phases, count) == ("all_reduce", "float32", 2, n) and sh % 4 == 0 and 2 * sh >= n
    assert msg == sh * 4 and sh == C.round_up(-(-n // 2), 4)  # 16-byte shards
    assert [launch["op"] for launch in launches] == ["all_reduce"]  # the one-shot one
    assert [a[1][2] for a in ctx.agreed] == [True, True, False, True, True]
    monkeypatch.setenv("MKERNEL_COLL_CE", "0")
    assert not C.use_copy_engines("all_reduce", 1 << 40, 2)
    monkeypatch.setenv("MKERNEL_COLL_CE", "sometimes")
    with pytest.raises(ValueError, match="MKERNEL_COLL_CE"):
        C.use_copy_engines("all_gather", 1, 2)


@pytest.mark.parametrize("slot", [16, 1000, 3 << 20, 8 << 20, 512 << 20, (1 << 30) + 12345])
def test_ce_layout(slot):
    L, total = C._ce_layout(3, slot, 2)
    assert L.chunk_bytes % 4096 == 0 and L.chunk_bytes >= C.CE_MIN_CHUNK
    full = L.nchunks - L.tail_pieces + 1 if L.tail_pieces else L.nchunks  # chunks (the last one cut in pieces)
    assert 1 <= full <= C.CE_MAX_CHUNKS and full * L.chunk_bytes >= L.slot_bytes >= slot
    assert (full - 1) * L.chunk_bytes < L.slot_bytes
    assert L.tail_pieces in (0, C.CE_TAIL_PIECES)
    # the chunks partition every message that fits the slot, in order, in 4 KiB-aligned pieces
    for nbytes in {slot, L.slot_bytes, max(1, slot // 3), 4096 * 5 + 16}:
        nbytes = min(nbytes, L.slot_bytes)
        pos = 0
        for c in range(L.nchunks):
            off, n = C.ce_chunk(L, nbytes, c)
            assert off % 4096 == 0 and (n == 0 or off == pos), (c, off, n, pos)
            pos += n
        assert pos == nbytes
    if L.tail_pieces:  # the last piece is at most a quarter chunk (4 KiB rounding)
        off, n = C.ce_chunk(L, L.slot_bytes, L.nchunks - L.tail_pieces)
        assert n <= -(-L.chunk_bytes // L.tail_pieces) + 4096
    assert C.CE_VALUE_OFF + 8 <= L.consumed_off and L.consumed_off + 8 * 3 <= L.flags_off
    assert L.flags_off + 8 * 2 * 3 * L.flag_stride <= L.data0_off and L.data0_off % 4096 == 0
    assert L.nchunks <= L.flag_stride == C.MAX_CHUNKS
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
    L, _ = C._ce_layout(P, 5 << 20, 2)  # 3 chunks of 2 MiB, the last one in 4 pieces of 512 KiB
    assert (L.chunk_bytes, L.nchunks, L.tail_pieces) == (2 << 20, 2 + C.CE_TAIL_PIECES, C.CE_TAIL_PIECES)
    sizes = {2: 5 << 20, 0: 1 << 20}
    pushes = C._ce_pushes(_Ws, L, P, me, 1, lambda d: 1000 * (d + 1) << 20, lambda d: sizes[d])
    got = [(int(d), int(s), n) for d, s, n in pushes]
    value = _Ws.ptr + C.CE_VALUE_OFF
    want = []
    for dst in (2, 0):
        for c in range(L.nchunks):
            off, n = C.ce_chunk(L, sizes[dst], c)
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
    assert C.one_shot_max_bytes(2) == C.ONE_SHOT_MAX_BYTES_2RANKS >= C.ONE_SHOT_MAX_BYTES
    assert C.one_shot_max_bytes(3) == C.one_shot_max_bytes(8) == C.ONE_SHOT_MAX_BYTES


def test_ce_pushes_chunk_major_for_reductions():
    """Reductions push chunk-major (chunk c reaches every peer before chunk c+1 leaves), so a receiver
    that needs chunk c from everyone is not held up by a whole slot to another peer; with 2 ranks the
    two orders are one; the sent flag of chunk c follows its last push."""
    L, _ = C._ce_layout(4, 5 << 20, 1)  # 3 chunks (the last in pieces)
    size = lambda d: 5 << 20  # noqa: E731
    P, me = 4, 1
    offs = {C.ce_chunk(L, 5 << 20, c)[0]: c for c in range(L.nchunks)}  # chunk index of each offset
    data = [c for c in range(L.nchunks) if C.ce_chunk(L, 5 << 20, c)[1]]  # chunks with bytes (not empty pieces)
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
    L2, _ = C._ce_layout(2, 5 << 20, 1)
    two = [C._ce_pushes(_Ws, L2, 2, 0, 0, lambda d: 0, size, chunk_major=cm) for cm in (False, True)]
    assert [(int(d), int(s), n) for d, s, n in two[0]] == [(int(d), int(s), n) for d, s, n in two[1]]


def test_eager_fast_path_replays_identical_calls(env, monkeypatch):
    """A call repeated with the same DeviceArrays, stream and path settings replays the first call's
    prepared launch (no checks, no plan, no packing); another stream, MKERNEL_COLL_CE value or
    workspace generation, other arrays or foreign arrays take the full path; errors a kernel reported
    still raise first."""
    ctx, launches = env
    replays = []

    class Prepared:
        def __call__(self):
            replays.append(1)

    def fake_launch(ctx_, op, dtype, slot, phases, head, stream, sig):
        launches.append(op)
        return Prepared()

    monkeypatch.setattr(C, "_launch", fake_launch)
    x, o = arr((1000,), "bfloat16"), arr((1000,), "bfloat16")
    C.all_reduce(ctx, x, o)
    C.all_reduce(ctx, x, o)
    assert launches == ["all_reduce"] and replays == [1]
    C.all_reduce(ctx, x, o, stream=5)  # another stream
    monkeypatch.setenv("MKERNEL_COLL_CE", "0")  # another path setting
    C.all_reduce(ctx, x, o, stream=5)
    ctx._ws_gen = 1  # a workspace was reallocated
    C.all_reduce(ctx, x, o, stream=5)
    C.all_reduce(ctx, x, arr((1000,), "bfloat16"), stream=5)  # another output
    assert launches == ["all_reduce"] * 5 and replays == [1]
    C.all_reduce(ctx, x, o, stream=5)
    assert replays == [1, 1]
    y, og = arr((8, 4)), arr((16, 4))
    C.all_gather(ctx, y, og), C.all_gather(ctx, y, og)
    z, oz = arr((8, 4)), arr((4, 4))
    C.reduce_scatter(ctx, z, oz), C.reduce_scatter(ctx, z, oz)
    assert launches[-2:] == ["all_gather", "reduce_scatter"] and replays == [1, 1, 1, 1]

    class CAI:  # a foreign array over the same memory: never replayed (its memory may move)
        __cuda_array_interface__ = {"shape": (1000,), "typestr": "<V2", "data": (x.ptr, False), "version": 3}

    n = len(launches)
    monkeypatch.setattr(ctx, "check", lambda: (_ for _ in ()).throw(RuntimeError("kernel failed")), raising=False)
    with pytest.raises(RuntimeError, match="kernel failed"):
        C.all_reduce(ctx, x, o, stream=5)  # a replay checks the error record first
    assert len(launches) == n and replays == [1, 1, 1, 1]
    assert C._fast_key(ctx, "all_reduce", CAI(), o, 5) is None and C._fast_key(ctx, "all_reduce", x, None, 5) is None


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


def test_zero_copy_all_gather_into_symmetric_out(env, monkeypatch):
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
    seen = []
    monkeypatch.setattr(C, "_ce_run", lambda ctx_, op, dtype, msg, phases, x, o, count, shard, stream, sig,
                        direct=None: seen.append(direct))
    monkeypatch.setenv("MKERNEL_COLL_CE", "1")
    C.all_gather(ctx, arr((5, 3), "bfloat16"), arr((10, 3), "bfloat16"))
    assert seen == [(Buf, 4096)] and ctx.agreed[-1][1][-1] == "symmetric out: buffer #7 at byte 4096"
    monkeypatch.setenv("MKERNEL_COLL_CE", "0")  # the SM path never goes direct
    C.all_gather(ctx, arr((5, 3), "bfloat16"), arr((10, 3), "bfloat16"))
    assert len(ctx.agreed[-1][1]) == 3
    # the pushes of a direct all-gather (rank 1 of 3, 5 MiB messages)
    P, me, nb = 3, 1, 5 << 20
    L, _ = C._ce_layout(P, nb, 1)
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
    assert C.CollLayout.direct.offset == 56 and C.CollLayout.flag_stride.offset == 60
    assert ctypes.sizeof(C.CollLayout) == 64  # collectives.cu's struct

