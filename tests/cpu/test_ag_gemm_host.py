"""Host side of AllGather+GEMM on the CPU: bad input raises before any launch (and before any exchange),
the kernels of the plan are compiled before the ranks exchange their signatures, the plan is the
planner's on the exchanged values, the agreed digest reaches the kernels, and a repeated call with new
arrays of the same layout re-points its bound call (tensor maps, AgArgs pointers, B's staging source, the
copy-engine path's copy list) instead of planning, exchanging or binding again.  The context is a
stand-in, arrays carry fake device pointers, kernels, tensor maps and the side stream are fakes: nothing
touches a GPU."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from mkernel.core.arrays import DeviceArray
from mkernel.dist.signals import MkComm
from mkernel.ops import base as BASE
from mkernel.ops.ag_gemm import AgGemmOptions
from mkernel.ops.ag_gemm import op as OPM
from mkernel.ops.ag_gemm import planner as PL
from mkernel.ops.ag_gemm.layout import AgArgs
from mkernel.ops.base import OpState
from mkernel.ops.gemm import kernels as GK
from mkernel.ops.gemm import operands as GO

_next = [1 << 20]


def arr(shape, dtype="bfloat16", device=0, ptr=None, strides=None, readonly=False):
    p = ptr if ptr is not None else _next[0]
    a = DeviceArray(p, shape, dtype, strides, device, None, readonly=readonly)
    _next[0] += max(1 << 24, (a.nbytes + 4095) // 4096 * 4096)
    return a


class FakeWs:
    def __init__(self, nbytes):
        self.ptr, self.peer_table, self.nbytes = 1 << 40, 1 << 41, nbytes

    @staticmethod
    def peer_ptr(j, offset=0):
        return (1 << 44) * (j + 1) + offset


class FakeAgreement:
    """Every rank's vector is this rank's, but for the columns of ``ctx.peer_columns`` ({column: value of
    every rank}); every exchange is logged."""

    def __init__(self, ctx):
        self.ctx = ctx

    def exchange(self, what, vec, comm):
        self.ctx.log.append(dict(exchange=what, vec=tuple(int(v) for v in vec)))
        rows = np.tile(np.asarray(vec, dtype=np.int64), (self.ctx.local_size, 1))
        if len(vec) > 1:
            for col, vals in self.ctx.peer_columns.items():
                rows[:, col] = vals
        return rows


class FakeCtx:
    device, rank, local_rank, num_nodes, sm_count, resident_sms = 0, 0, 0, 1, 132, 132
    node_comm = object()

    def __init__(self, log, P=2):
        self.size = self.local_size = P
        self.log = log
        self.peer_columns = {}
        self.agreement = FakeAgreement(self)
        self.states = {}
        self.workspace_generation = 0
        self.workspaces = []

    def check(self):
        pass

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


class FakeMap:
    """A tensor map whose first 8 bytes are its base address."""

    def __init__(self, ptr, dtype, dims, strides, box, **kw):
        self.ptr, self.spec = ptr, (dtype, tuple(dims), tuple(strides), tuple(box))
        self.buf = ctypes.create_string_buffer(ptr.to_bytes(8, "little"), 128)

    def point(self, ptr):
        self.ptr = ptr
        self.buf[0:8] = ptr.to_bytes(8, "little")


def _value(a):
    if isinstance(a, AgArgs):
        return {f: getattr(a, f) for f in ("a_shard", "ws", "c", "gathered_out", "c_vec_ok", "c_tma", "local_map",
                                           "n_comm", "gather_only", "M_total", "N", "K", "chunk_rows", "splits",
                                           "split_from", "ce_go_off", "me", "P")} | {"offs": list(a.offs[:a.P + 1])}
    if isinstance(a, MkComm):
        return dict(sig=a.sig)
    if isinstance(a, ctypes.Array):
        return int.from_bytes(a.raw[:8], "little")  # a tensor map: its base address
    return getattr(a, "value", a)


class FakeLaunch:
    def __init__(self, log, name, args, info):
        self.log, self.name, self.args, self.info = log, name, args, info

    def submit(self):  # (reads the argument objects' values at submission, as the driver does)
        self.log.append(dict(op=self.name, values=[_value(a) for a in self.args], **self.info))


class FakeKernel:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def max_active_blocks_per_sm(self, threads, smem=0):
        return 1

    def prepare(self, grid, block, args, *, stream=None, smem=0, cooperative=False, **kw):
        info = dict(grid=grid, block=block, stream=stream, cooperative=cooperative)
        self.log.append(dict(prepared=self.name, **info))
        return FakeLaunch(self.log, self.name, list(args), info)


class FakeFork:
    def __init__(self, log):
        self.log = log

    def fork(self, s, begin=None):
        self.log.append(dict(fork=True))

    def copies(self, lst):
        self.log.append(dict(copies=[(int(d), int(s), n) for d, s, n in lst]))

    def join(self, s):
        self.log.append(dict(join=True))


@pytest.fixture
def env(monkeypatch, mkenv):
    for v in ("PATH", "TAIL_SPLIT", "MODEL", "FUSED_AUTO"):
        mkenv("MKERNEL_AG_GEMM_" + v)
    log = []

    def get_kernel(i, o, c, name):
        log.append(dict(kernel=name, config=c, out=o))
        return FakeKernel(log, f"{name}:{c}")

    monkeypatch.setattr(OPM, "_kernel", get_kernel)
    monkeypatch.setattr(OPM, "TensorMapArg", FakeMap)
    monkeypatch.setattr(GO, "TensorMapArg", FakeMap)  # (B's and C's maps)
    monkeypatch.setattr(GO, "_clear_i32", lambda ptr, n, stream: log.append(dict(clear=(ptr, n))))
    monkeypatch.setattr(GK, "get", lambda i, o, c, name, swap=False: FakeKernel(log, name))  # (B's staging copy)
    monkeypatch.setattr(GK, "num_sms", lambda device: 132)
    monkeypatch.setattr(OPM, "ForkedCopies", lambda side: FakeFork(log))
    monkeypatch.setattr(OPM, "copy_async", lambda copies, stream: log.append(dict(copy=[tuple(c) for c in copies])))
    monkeypatch.setattr(OPM, "gemm", lambda a, b, o, *, b_layout, stream: log.append(
        dict(gemm=(a.ptr, a.shape, b.ptr, o.ptr, o.shape, b_layout, stream))))
    monkeypatch.setattr(OPM, "warm_gemm", lambda *a: log.append(dict(warm_gemm=a)))
    monkeypatch.setattr(DeviceArray, "empty", classmethod(lambda cls, shape, dtype, device=None: arr(shape, dtype)))
    monkeypatch.setattr(BASE, "is_capturing", lambda stream: False)
    monkeypatch.setattr(OPM, "require_gemm_device", lambda what, device: None)  # (a Hopper, as far as the op asks)
    yield FakeCtx(log), log


def launches(log, prefix="mk_ag"):
    return [e for e in log if e.get("op", "").startswith(prefix)]


def prepared(log):
    return [e for e in log if "prepared" in e]


def exchanges(log):
    return [e for e in log if "exchange" in e]


def call(ctx, a, b, out=None, **kw):
    return OPM.ag_gemm(ctx, a, b, out, **kw)


def test_bad_inputs_raise_before_anything_runs(env):
    ctx, log = env
    Mr, K, N = 256, 512, 384
    a, b, o = arr((Mr, K)), arr((K, N)), arr((2 * Mr, N))
    with pytest.raises(TypeError, match="a_shard has dtype float32"):
        call(ctx, arr((Mr, K), "float32"), arr((K, N), "float32"))
    with pytest.raises(TypeError, match="must match"):
        call(ctx, a, arr((K, N), "float16"))
    with pytest.raises(TypeError, match="host array"):
        call(ctx, np.ones((Mr, K), np.float16), b)
    with pytest.raises(ValueError, match="2-D"):
        call(ctx, arr((2, Mr, K)), b)
    with pytest.raises(ValueError, match="inner dimensions"):
        call(ctx, a, arr((N, K)))
    with pytest.raises(ValueError, match="b_layout"):
        call(ctx, a, b, b_layout="km")
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        call(ctx, arr((Mr, 7)), arr((7, N)))
    with pytest.raises(ValueError, match="C-contiguous"):
        call(ctx, arr((Mr, K), strides=(2 * K, 1)), b)
    with pytest.raises(ValueError, match="is on cuda:1"):
        call(ctx, a, arr((K, N), device=1))
    with pytest.raises(ValueError, match="comm_sms"):
        call(ctx, a, b, comm_sms=-1)
    with pytest.raises(ValueError, match="comm_sms"):
        call(ctx, a, b, comm_sms=[4])
    with pytest.raises(ValueError, match="path"):
        call(ctx, a, b, path="fastest")
    with pytest.raises(ValueError, match="config"):
        call(ctx, a, b, config=7)
    with pytest.raises(TypeError, match="options must be an AgGemmOptions"):
        call(ctx, a, b, options=dict(path="fused"))
    with pytest.raises(ValueError, match="m_sizes"):
        call(ctx, a, b, m_sizes=[Mr + 1, Mr])
    with pytest.raises(ValueError, match="m_sizes"):
        call(ctx, a, b, m_sizes=[Mr])
    with pytest.raises(ValueError, match=r"out has shape \(513, 384\), expected \(512, 384\)"):
        call(ctx, a, b, arr((2 * Mr + 1, N)), m_sizes=[Mr, Mr])
    with pytest.raises(ValueError, match="out has shape"):
        call(ctx, a, b, arr((2 * Mr, N + 1)))
    with pytest.raises(TypeError, match="out has dtype float16"):
        call(ctx, a, b, arr((2 * Mr, N), "float16"))
    with pytest.raises(ValueError, match="unit column stride"):
        call(ctx, a, b, arr((2 * Mr, N), strides=(2 * N, 2)))
    with pytest.raises(ValueError, match="out is read-only"):
        call(ctx, a, b, arr((2 * Mr, N), readonly=True))
    with pytest.raises(ValueError, match="gathered_a must be"):
        call(ctx, a, b, o, gathered_a=arr((2 * Mr, K - 8)))
    with pytest.raises(ValueError, match="gathered_a must be C-contiguous"):
        call(ctx, a, b, o, gathered_a=arr((2 * Mr, K), strides=(K + 8, 1)))
    with pytest.raises(ValueError, match="out overlaps a_shard"):
        call(ctx, a, b, DeviceArray(a.ptr + 1024, (2 * Mr, N), "bfloat16", None, 0, None))
    with pytest.raises(ValueError, match="out overlaps b"):
        call(ctx, a, b, DeviceArray(b.ptr + b.nbytes - 2, (2 * Mr, N), "bfloat16", None, 0, None))
    with pytest.raises(ValueError, match="out overlaps gathered_a"):
        call(ctx, a, b, o, gathered_a=DeviceArray(o.ptr, (2 * Mr, K), "bfloat16", None, 0, None))
    ctx.local_size = 17
    with pytest.raises(ValueError, match="17 local ranks"):
        call(ctx, a, b)
    ctx.local_size = 2
    assert log == [] and ctx.workspaces == []
    # out's rows need the agreed sum of every rank's rows: checked after the exchange, before any launch
    with pytest.raises(ValueError, match=r"out has shape \(513, 384\), expected \(512, 384\)"):
        call(ctx, a, b, arr((2 * Mr + 1, N)))
    assert len(exchanges(log)) == 1 and prepared(log) == [] and launches(log) == [] and ctx.workspaces == []


def test_ranks_disagreeing_raise(env):
    ctx, log = env
    a, b = arr((256, 512)), arr((512, 384))
    ctx.peer_columns = {2: [512, 520]}  # K
    with pytest.raises(ValueError, match=r"ranks disagree on the call: K differs across local ranks: \[512, 520\]"):
        call(ctx, a, b)
    ctx.peer_columns = {4: [4, 5]}  # comm_sms
    with pytest.raises(ValueError, match="comm_sms differs"):
        call(ctx, a, b, comm_sms=4)
    ctx.peer_columns = {9: [1, 0]}  # config 5's width depends on the layout
    with pytest.raises(ValueError, match="layouts differ"):
        call(ctx, a, arr((384, 512)), b_layout="nk", config=5)
    ctx.peer_columns = {1: [256, 300]}
    with pytest.raises(ValueError, match=r"m_sizes=\[256, 256\] but the ranks hold shards of \[256, 300\] rows"):
        call(ctx, a, b, m_sizes=[256, 256])
    assert prepared(log) == [] and launches(log) == [] and ctx.workspaces == []


def test_copy_engine_call_and_repointing(env):
    """The first call compiles the plan's kernels, then exchanges (once), then binds; a call with new arrays
    of the same layout -- a_shard, b, out, gathered_a -- re-points the same prepared launch: the local-rows
    map and AgArgs.a_shard, B's map, the output map and fields, gathered_out, the copy list's sources."""
    ctx, log = env
    Mr, K, N = 2048, 8192, 5120
    a, b, o, ga = arr((Mr, K)), arr((N, K)), arr((2 * Mr, N)), arr((2 * Mr, K))
    assert call(ctx, a, b, o, gathered_a=ga, b_layout="nk") is o
    p = ctx.last_plan("ag_gemm")
    assert p == PL.plan([Mr, Mr], N, K, 2, 132, gathered=True, b_layout="nk") and p.path == "fused_ce"
    kern = f"mk_ag_gemm_nk:{p.config}"
    first_kernel = next(i for i, e in enumerate(log) if e.get("kernel") == "mk_ag_gemm_nk")
    (ex,) = exchanges(log)
    assert first_kernel < log.index(ex)  # compiled before the exchange (equal shards: the plan was known)
    assert ex["vec"] == (0, Mr, K, N, -1, 1, 0, -1, 0, 1)
    assert [e["prepared"] for e in prepared(log)] == [f"mk_ag_release:{p.config}", kern]
    (fused,) = [e for e in prepared(log) if e["prepared"] == kern]
    assert fused["grid"] == p.workers and not fused["cooperative"]
    ag = ctx.op_state("ag_gemm").data["sigs"]
    (agreed,) = ag.values()
    assert ctx.workspaces == [(("ag_gemm",), agreed.layout.total)]

    def last_run():
        run = launches(log, kern)[-1]["values"]
        return run[0], run[1], run[2], run[3], run[4], run[5]

    tma, tmb, tmal, tmc, comm, args = last_run()
    assert comm == dict(sig=agreed.digest)  # the agreed digest reaches the kernel (MkComm.sig)
    assert tma == (1 << 40) + agreed.layout.data_off and (tmb, tmal, tmc) == (b.ptr, a.ptr, o.ptr)
    assert (args["a_shard"], args["c"], args["gathered_out"]) == (a.ptr, o.ptr, ga.ptr)
    assert args["local_map"] == 1 and args["gather_only"] == 1 and args["n_comm"] == 0 and args["c_tma"] == 1
    assert args["offs"] == [0, Mr, 2 * Mr] and args["ce_go_off"] == agreed.layout.go_off
    copies = [e["copies"] for e in log if "copies" in e]
    assert copies[-1] and all(s - a.ptr < Mr * K * 2 for d, s, n in copies[-1] if n > 8 * 64)
    assert launches(log, "mk_ag_release")[-1]["values"][1]["gathered_out"] == ga.ptr
    (gcopy,) = [e["copy"] for e in log if "copy" in e]  # the gathered A: our rows from a_shard, the peer's
    rb = Mr * K * 2  # from the workspace
    assert gcopy == [(ga.ptr, a.ptr, rb), (ga.ptr + rb, (1 << 40) + agreed.layout.data_off + rb, rb)]
    n_prepared, n_log = len(prepared(log)), len(log)
    a2, b2, o2, ga2 = arr((Mr, K)), arr((N, K)), arr((2 * Mr, N)), arr((2 * Mr, K))
    call(ctx, a2, b2, o2, gathered_a=ga2, b_layout="nk")
    assert len(prepared(log)) == n_prepared and len(exchanges(log)) == 1 and ctx.last_plan("ag_gemm") is p
    assert not any("kernel" in e for e in log[n_log:])  # (no compile stage either: the key was bound)
    tma, tmb, tmal, tmc, comm, args = last_run()
    assert (tmb, tmal, tmc) == (b2.ptr, a2.ptr, o2.ptr)
    assert (args["a_shard"], args["c"], args["gathered_out"]) == (a2.ptr, o2.ptr, ga2.ptr)
    new_copies = [e["copies"] for e in log if "copies" in e][-1]
    assert [(d, n) for d, s, n in new_copies] == [(d, n) for d, s, n in copies[-1]]  # same destinations
    assert [s - a2.ptr for d, s, n in new_copies if n > 8 * 64] == [s - a.ptr for d, s, n in copies[-1] if n > 8 * 64]
    assert [e["copy"] for e in log if "copy" in e][-1] == [(ga2.ptr, a2.ptr, rb), (ga2.ptr + rb, gcopy[1][1], rb)]
    assert launches(log, "mk_ag_release")[-1]["values"][1]["gathered_out"] == ga2.ptr
    assert len(ctx.workspaces) == 1


def test_sm_path_and_fresh_outputs(env):
    """The SM-communication path (comm_sms forces it): one cooperative launch; out=None allocates a new
    output every call, which the bound call re-points at (no new bind)."""
    ctx, log = env
    Mr, K, N = 1024, 1024, 1024
    a, b = arr((Mr, K)), arr((K, N))
    r1 = call(ctx, a, b, comm_sms=6)
    r2 = call(ctx, a, b, comm_sms=6)
    p = ctx.last_plan("ag_gemm")
    assert p.path == "fused" and p.comm_sms == 6 and r1.shape == (2 * Mr, N) and r1.ptr != r2.ptr
    (fused,) = prepared(log)
    assert fused["cooperative"] and fused["grid"] == 6 + p.workers
    runs = launches(log, "mk_ag_gemm_kn")
    assert [r["values"][3] for r in runs] == [r1.ptr, r2.ptr]  # C's map
    assert [r["values"][5]["c"] for r in runs] == [r1.ptr, r2.ptr]
    assert runs[-1]["values"][5]["n_comm"] == 6 and runs[-1]["values"][5]["gathered_out"] is None
    assert len(exchanges(log)) == 1


def test_unfused_path(env):
    """The gather kernel, mkernel.gemm on the gathered rows, the release kernel; a new a_shard and gathered_a
    re-point the gather kernel's AgArgs."""
    ctx, log = env
    Mr, K, N = 300, 256, 260
    a, b, o, ga = arr((Mr, K)), arr((K, N)), arr((2 * Mr, N), "float32"), arr((2 * Mr, K))
    call(ctx, a, b, o, gathered_a=ga, comm_sms=0, stream=9)
    p = ctx.last_plan("ag_gemm")
    assert p.path == "unfused"
    (warm,) = [e["warm_gemm"] for e in log if "warm_gemm" in e]  # mkernel.gemm's kernel, before the exchange
    assert warm == (2 * Mr, N, K, "bfloat16", "float32", "kn", 0)
    assert log.index(next(e for e in log if "warm_gemm" in e)) < log.index(exchanges(log)[0])
    g = [e for e in prepared(log) if e["prepared"].startswith("mk_ag_gather")][0]
    assert g["cooperative"] and g["grid"] == p.gather_blocks and g["stream"] == 9
    a2, ga2 = arr((Mr, K)), arr((2 * Mr, K))
    call(ctx, a2, b, o, gathered_a=ga2, comm_sms=0, stream=9)
    gathers = launches(log, "mk_ag_gather")
    assert [(r["values"][1]["a_shard"], r["values"][1]["gathered_out"]) for r in gathers] == [(a.ptr, ga.ptr),
                                                                                                (a2.ptr, ga2.ptr)]
    gemms = [e["gemm"] for e in log if "gemm" in e]
    ws_rows = (1 << 40) + ctx.op_state("ag_gemm").data["sigs"][next(iter(ctx.op_state("ag_gemm").data["sigs"]))] \
        .layout.data_off
    assert gemms == [(ws_rows, (2 * Mr, K), b.ptr, o.ptr, (2 * Mr, N), "kn", 9)] * 2
    assert len(launches(log, "mk_ag_release")) == 2 and len(prepared(log)) == 2


def test_key_changes_bind_anew_without_a_new_exchange(env):
    """Another stream, options, or alignment class of an argument binds anew (the agreed signature is
    kept: no exchange); another local signature exchanges again.  An unaligned a_shard is not read in
    place: the kernel copies it into the workspace (local_map 0) and the copy engines leave an SM free."""
    ctx, log = env
    Mr, K, N = 2048, 8192, 5120
    a, b, o = arr((Mr, K)), arr((N, K)), arr((2 * Mr, N))
    call(ctx, a, b, o, b_layout="nk")
    call(ctx, a, b, o, b_layout="nk", stream=5)
    base = arr((Mr * K + 8,))
    a_odd = DeviceArray(base.ptr + 8, (Mr, K), "bfloat16", None, 0, None)
    call(ctx, a_odd, b, o, b_layout="nk")
    fused = [e for e in prepared(log) if e["prepared"].startswith("mk_ag_gemm")]
    assert len(fused) == 3 and len(exchanges(log)) == 1
    assert fused[2]["grid"] == 131 and launches(log, "mk_ag_gemm")[-1]["values"][5]["local_map"] == 0
    copies = [e["copies"] for e in log if "copies" in e][-1]
    assert any(d == (1 << 40) + ctx.op_state("ag_gemm").data["sigs"][next(iter(
        ctx.op_state("ag_gemm").data["sigs"]))].layout.data_off and s == a_odd.ptr for d, s, n in copies)
    call(ctx, a, b, o, b_layout="nk", options=AgGemmOptions(tail_split=False))  # another signature
    assert len(exchanges(log)) == 2
    ctx.workspace_generation = 1  # (a workspace grew)
    call(ctx, a, b, o, b_layout="nk")
    assert len(exchanges(log)) == 2 and len([e for e in prepared(log) if e["prepared"].startswith("mk_ag_gemm")]) == 5


def test_unequal_shards_compile_after_the_exchange_and_meet_again(env):
    """Shards of different sizes without m_sizes: the plan made before the exchange (every rank's M = ours)
    is not the agreed one, so the agreed plan's kernels are compiled after the exchange and the ranks meet
    once more on the host before anything is launched; with m_sizes given, the plan is known before."""
    ctx, log = env
    K, N = 8192, 5120
    ctx.peer_columns = {1: [512, 3000]}
    call(ctx, arr((512, K)), arr((N, K)), arr((3512, N)), b_layout="nk")
    p = ctx.last_plan("ag_gemm")
    assert p.m_sizes == (512, 3000) and p == PL.plan([512, 3000], N, K, 2, 132, b_layout="nk")
    ex = exchanges(log)
    assert [e["exchange"] for e in ex] == ["mkernel.ag_gemm's signature exchange", "mkernel.ag_gemm: kernels compiled"]
    (agreed,) = ctx.op_state("ag_gemm").data["sigs"].values()
    assert ex[1]["vec"] == (agreed.digest,) and agreed.offs == (0, 512, 3512)
    assert launches(log, "mk_ag_gemm")[-1]["values"][5]["offs"] == [0, 512, 3512]
    log.clear()
    call(ctx, arr((512, K)), arr((N, K)), arr((3512, N)), b_layout="nk", m_sizes=(512, 3000))
    assert [e["exchange"] for e in exchanges(log)] == ["mkernel.ag_gemm's signature exchange"]
    assert log.index(exchanges(log)[0]) > next(i for i, e in enumerate(log) if "kernel" in e)


def test_split_k_buffers_cleared_before_first_use(env):
    """A split plan: the split-K sums and counters are the bound call's buffers, zeroed before its first
    call only."""
    ctx, log = env
    a, b = arr((512, 16384)), arr((26624, 16384))
    for _ in range(2):
        call(ctx, a, b, arr((1024, 26624)), b_layout="nk")
    p = ctx.last_plan("ag_gemm")
    assert p.splits > 1
    bound = next(iter(ctx.op_state("ag_gemm").calls.values()))
    assert len(bound.buffers) == 1 and len([e for e in log if "clear" in e]) == 1
    args = launches(log, "mk_ag_gemm")[-1]["values"][5]
    assert (args["splits"], args["split_from"]) == (p.splits, p.split_from)


def test_staged_b_repoints_its_staging_source(env):
    """A B whose rows TMA cannot address in place is staged by a copy kernel before the GEMM; a new B of the
    same layout re-points the copy's source."""
    ctx, log = env
    Mr, K, N = 1024, 1024, 1000
    a, o = arr((Mr, K)), arr((2 * Mr, N))
    b1, b2 = arr((K, N), strides=(N + 4, 1)), arr((K, N), strides=(N + 4, 1))  # 2008-byte rows
    call(ctx, a, b1, o, comm_sms=4)
    call(ctx, a, b2, o, comm_sms=4)
    stage = [e for e in log if e.get("op") == "mk_pad_copy_u16"]
    assert [e["values"][1] for e in stage] == [b1.ptr, b2.ptr]
    assert len([e for e in prepared(log) if e["prepared"] == "mk_pad_copy_u16"]) == 1
    assert len(next(iter(ctx.op_state("ag_gemm").calls.values())).buffers) == 1


def test_one_rank_and_empty_calls(env):
    ctx, log = env
    ctx.local_size = ctx.size = 1
    a, b, o, ga = arr((100, 64)), arr((64, 48)), arr((100, 48)), arr((100, 64))
    call(ctx, a, b, o, gathered_a=ga)
    assert ctx.last_plan("ag_gemm").reason == "P == 1: nothing to gather" and exchanges(log) == []
    assert [e["gemm"][:4] for e in log if "gemm" in e] == [(a.ptr, (100, 64), b.ptr, o.ptr)]
    assert [e["copy"] for e in log if "copy" in e] == [[(ga.ptr, a.ptr, a.nbytes)]]
    ctx.local_size = ctx.size = 2
    log.clear()
    r = call(ctx, arr((0, 64)), b)
    assert r.shape == (0, 48) and ctx.last_plan("ag_gemm").reason == "empty problem"
    assert launches(log) == [] and not any("gemm" in e for e in log)
    call(ctx, arr((32, 0)), arr((0, 48)), arr((64, 48)))  # K = 0: zeros by mkernel.gemm over [M_total, 0]
    (g,) = [e["gemm"] for e in log if "gemm" in e]
    assert g[1] == (64, 0) and g[4] == (64, 48) and launches(log) == [] and ctx.workspaces == []


def test_copy_list_and_gathered_copies():
    """The copy-engine path's copy out of the workspace into gathered_a: the whole data region, or -- when
    the GEMM read this rank's rows in place -- the peers' rows around ours, ours from a_shard."""
    assert OPM.gathered_copies(100, 1000, 5000, 40, 60, 90, False) == [(100, 1000, 90)]
    assert OPM.gathered_copies(100, 1000, 5000, 40, 60, 90, True) == [(100, 1000, 40), (140, 5000, 20),
                                                                      (160, 1060, 30)]
    assert OPM.gathered_copies(100, 1000, 5000, 0, 60, 60, True) == [(100, 5000, 60)]


@pytest.mark.parametrize("path", ["fused", "fused_ce", "unfused"])
def test_ranks_sharing_a_gpu_plan_for_their_share_of_the_sms(env, path):
    """Two ranks on one GPU (ctx.resident_sms = half the SMs): every kernel that waits for the peer's
    kernel fits beside it -- the plan is made for 66 SMs, the launched grids stay within them, and the
    last-wave split plans (those that filled every SM and deadlocked with 2 ranks on one H200) too."""
    ctx, log = env
    ctx.resident_sms = 66
    m_sizes, N, K = [700, 717], 3000, 4096  # test_last_wave_split's config-2 shape (splits on 132 SMs)
    a, b = arr((m_sizes[0], K)), arr((N, K))
    ctx.peer_columns = {1: [m_sizes[1]]}
    kw = dict(comm_sms=4) if path == "fused" else dict(path=path)
    call(ctx, a, b, b_layout="nk", **kw)
    p = ctx.last_plan("ag_gemm")
    assert p.path == path and p.comm_sms + p.workers <= 66 and p.gather_blocks <= 66, p.describe()
    assert all(e["grid"] <= 66 for e in prepared(log) if e["prepared"].startswith(("mk_ag_gemm", "mk_ag_gather")))


def test_a_bind_that_grows_a_workspace_files_its_call_under_the_new_generation(env, monkeypatch):
    """The first call of a layout allocates the op's workspace (the context's workspace generation moves):
    the bound call is filed under the new generation, so the second call re-points it instead of binding
    again (and holding a second set of launches); a later growth still rebinds."""
    ctx, log = env
    grown = ctx.workspace

    def workspace(key, nbytes, stream=None, what=""):
        if (key, nbytes) not in ctx.workspaces:
            ctx.workspace_generation += 1
        return grown(key, nbytes, stream, what)

    monkeypatch.setattr(ctx, "workspace", workspace)
    Mr, K, N = 2048, 8192, 5120
    a, b, o = arr((Mr, K)), arr((N, K)), arr((2 * Mr, N))
    call(ctx, a, b, o, b_layout="nk")
    n = len(prepared(log))
    call(ctx, arr((Mr, K)), b, arr((2 * Mr, N)), b_layout="nk")
    assert len(prepared(log)) == n and len(ctx.op_state("ag_gemm").calls) == 1
    ctx.workspace_generation += 1  # (another op's workspace grew)
    call(ctx, a, b, o, b_layout="nk")
    assert len(prepared(log)) > n
