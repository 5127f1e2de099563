"""Context on the CPU: the kernel-argument structs it hands out (no GPU: only the fields they read)."""
from __future__ import annotations

import pytest


def test_context_timeout_updates_cached_comm_args():
    """ops keep the MkComm structs comm_args hands out; a new timeout must reach them."""
    from mkernel.dist.context import Context

    ctx = object.__new__(Context)  # no GPU: only the fields comm_args reads
    ctx._timeout, ctx._comm_cache, ctx._err_dev = 5.0, {}, 0x1000
    ctx.rank = ctx.local_rank = ctx.node = 0
    ctx.size = ctx.local_size = 2
    ctx.num_nodes = 1
    c = ctx.comm_args("ag_gemm")
    assert ctx.comm_args("ag_gemm") is c and c.timeout_ns == 5_000_000_000 and c.local_size == 2
    ctx.timeout = 0.25
    assert c.timeout_ns == 250_000_000 and ctx.timeout == 0.25
    with pytest.raises(ValueError, match="timeout"):
        ctx.timeout = 0


def test_workspace_setup_inside_a_capture_raises_clearly(monkeypatch):
    """Creating or growing an op's workspace (a collective allocation that synchronizes the device)
    while the op's stream is being captured raises a RuntimeError naming the op -- before any driver
    call could invalidate the caller's capture; a workspace that already fits is returned as usual."""
    from mkernel.dist import context as X

    ctx = object.__new__(X.Context)
    ctx._workspaces = {}

    class WS:
        nbytes = 1 << 20

    def no_alloc(nbytes, comm=None):
        raise AssertionError("allocated inside a capture")

    ctx.alloc_symmetric = no_alloc
    monkeypatch.setattr(X, "is_capturing", lambda stream: True)
    with pytest.raises(RuntimeError, match=r"mkernel.all_reduce: .*before capturing"):
        ctx.workspace(("collective", "all_reduce"), 4096, stream=7, what="mkernel.all_reduce")
    ctx._workspaces[("collective", "all_reduce")] = ws = WS()
    assert ctx.workspace(("collective", "all_reduce"), 4096, stream=7) is ws  # fits: no setup, no error
    with pytest.raises(RuntimeError, match="larger communication workspace"):
        ctx.workspace(("collective", "all_reduce"), 2 << 20, stream=7)


def test_comm_args_carry_the_call_signature():
    """comm_args(op, sig): one struct per (op, signature), its sig field set; timeouts reach every one."""
    from mkernel.dist.context import Context

    ctx = object.__new__(Context)
    ctx._timeout, ctx._comm_cache, ctx._err_dev = 5.0, {}, 0x1000
    ctx.rank = ctx.local_rank = ctx.node = 0
    ctx.size = ctx.local_size = 2
    ctx.num_nodes = 1
    a, b = ctx.comm_args("all_reduce", 0x1234), ctx.comm_args("all_reduce", 0xFFFFFFFF)
    assert a is not b and (a.sig, b.sig) == (0x1234, 0xFFFFFFFF) and ctx.comm_args("all_reduce", 0x1234) is a
    assert ctx.comm_args("ag_gemm").sig == 0
    ctx.timeout = 1.5
    assert a.timeout_ns == b.timeout_ns == 1_500_000_000


def test_agree_returns_a_stable_digest_and_exchanges_once():
    """agree: the first call of a signature exchanges (bounded allgather), later ones return the cached
    32-bit digest -- the same on every rank for the same call (the kernels compare it on the device)."""
    import numpy as np

    from mkernel.dist.agreement import Agreement

    ag = Agreement(0, lambda: 5.0)
    exchanges = []

    def fake_exchange(what, vec, comm):
        exchanges.append(int(vec[0]))
        return np.array([vec, vec])  # two ranks, same call

    ag.exchange = fake_exchange
    world = object()
    d1 = ag.agree("mkernel.all_reduce", ("bfloat16", (8,), False), world)
    d2 = ag.agree("mkernel.all_reduce", ("bfloat16", (8,), False), world)
    d3 = ag.agree("mkernel.all_reduce", ("bfloat16", (9,), False), world)
    assert d1 == d2 != d3 and 0 <= d1 < 1 << 32 and exchanges == [d1, d3]


def test_a_timed_out_exchange_breaks_the_agreement():
    """An exchange that times out leaves an MPI request a late rank would pair with: every later
    exchange of that agreement raises at once instead of hanging."""
    from mkernel import CommTimeout
    from mkernel.dist.agreement import Agreement

    class NeverComm:
        def Get_size(self):
            return 2

        def Iallgather(self, send, recv):
            class Req:
                def Test(self):
                    return False
            return Req()

    ag = Agreement(3, lambda: 0.05)  # (bounded by 4 x max(timeout, 1 s))
    import time

    t0 = time.monotonic()
    with pytest.raises(CommTimeout, match="rank 3 waited 4.0 s"):
        ag.exchange("mkernel.test", [1], NeverComm())
    assert 3.9 < time.monotonic() - t0 < 6
    t0 = time.monotonic()
    with pytest.raises(CommTimeout, match="agreement is broken"):
        ag.agree("mkernel.test", ("x",), NeverComm())
    assert time.monotonic() - t0 < 0.1


def test_mismatch_record_raises_comm_mismatch():
    """An MK_ERR_MISMATCH record (a peer announced another call signature) -> CommMismatch naming both."""
    import ctypes

    import mkernel
    from mkernel.dist.signals import MK_ERR_MISMATCH, OPS, ErrorRecordView, MkErrorRecord

    rec = MkErrorRecord()
    rec.rank, rec.op, rec.peer, rec.flag_index = 0, OPS["all_reduce"], 0x40000000 | 1, -1001
    rec.expected, rec.seen, rec.code = 0xABCD, 0x1234, MK_ERR_MISMATCH
    view = ErrorRecordView(ctypes.addressof(rec), [0, 7])
    with pytest.raises(mkernel.CommMismatch, match=r"peer rank 7 made a different call.*0x0000abcd here, "
                                                   r"0x00001234 there") as ei:
        view.raise_if_set()
    assert isinstance(ei.value, mkernel.CommError) and ei.value.record["peer"] == 7


def test_symmetric_views_and_region_lookup():
    """SymmetricBuffer.array: a view of this rank's copy at an offset (bounds and alignment checked);
    Context.symmetric_region finds the live node-wide buffer holding a range (not a freed one, not one
    over a smaller communicator, not a range that runs past the end)."""
    from mkernel.dist.context import Context
    from mkernel.dist.symmetric import SymmetricBuffer

    class Ctx:
        device = 0

    def fake(ptr, nbytes, local_size=2, seq=0):
        b = object.__new__(SymmetricBuffer)
        b.ctx, b.ptr, b.nbytes, b.local_size, b.freed, b.seq = Ctx, ptr, nbytes, local_size, False, seq
        return b
    b = fake(1 << 30, 1 << 20)
    v = b.array((4, 100), "bfloat16", offset=4096)
    assert (v.ptr, tuple(v.shape), v.dtype.name, v.owner) == ((1 << 30) + 4096, (4, 100), "bfloat16", b)
    with pytest.raises(ValueError, match="does not fit"):
        b.array((1 << 20,), "float32")
    with pytest.raises(ValueError, match="misaligned"):
        b.array((10,), "float32", offset=2)
    ctx = object.__new__(Context)
    ctx.local_size = 2
    gone, small = fake(1 << 32, 1 << 20), fake(1 << 33, 1 << 20, local_size=1)
    gone.freed = True
    ctx._symmetric = [gone, small, b]
    assert ctx.symmetric_region((1 << 30) + 100, 1000) == (b, 100)
    assert ctx.symmetric_region((1 << 30) + (1 << 20) - 10, 11) is None  # runs past the end
    assert ctx.symmetric_region((1 << 32) + 5, 10) is None and ctx.symmetric_region((1 << 33), 10) is None
    assert ctx.symmetric_region(5, 10) is None


# ---- timeouts ------------------------------------------------------------------------------------

BAD_TIMEOUTS = [0, 0.0, -1, -1e-9, float("nan"), float("inf"), float("-inf"), "abc", "", None, True, [1],
                86400.001, 1e300, 10**400, "nan", "inf"]


@pytest.mark.parametrize("value", BAD_TIMEOUTS, ids=repr)
def test_validate_timeout_rejects(value):
    from mkernel.dist.timeouts import validate_timeout

    with pytest.raises(ValueError, match="my timeout"):
        validate_timeout(value, "my timeout")


def test_validate_timeout_accepts():
    import numpy as np

    from mkernel.dist.timeouts import MAX_TIMEOUT_S, validate_timeout

    for v, want in [(5, 5.0), (0.001, 0.001), (" 2.5 ", 2.5), (np.float32(0.5), 0.5), (MAX_TIMEOUT_S, 86400.0),
                    (4398.05, 4398.05), (5000, 5000.0)]:
        got = validate_timeout(v, "t")
        assert type(got) is float and got == want


def test_context_init_validates_the_timeout_first(monkeypatch):
    """Context(timeout=) and MKERNEL_TIMEOUT are checked before any collective set-up (a bad value on
    one rank must not leave the others waiting in the topology exchange)."""
    from mkernel.dist import context as X

    def reached(*a, **k):
        raise AssertionError("set-up reached")

    monkeypatch.setattr(X.Topology, "from_comm", staticmethod(reached))
    monkeypatch.setattr(X, "cu_init", lambda: None)  # (the driver check comes between the two)
    monkeypatch.delenv("MKERNEL_TIMEOUT", raising=False)
    for bad in (0, -3, float("nan"), float("inf"), 1e7, "soon"):
        with pytest.raises(ValueError, match="timeout"):
            X.Context(timeout=bad)
    monkeypatch.setenv("MKERNEL_TIMEOUT", "nan")
    with pytest.raises(ValueError, match="MKERNEL_TIMEOUT"):
        X.Context()
    with pytest.raises(AssertionError, match="set-up reached"):  # an explicit valid value wins over the env
        X.Context(timeout=2)
    for ok in ("", "7.5"):
        monkeypatch.setenv("MKERNEL_TIMEOUT", ok)
        with pytest.raises(AssertionError, match="set-up reached"):
            X.Context()


def test_context_timeout_setter_validates():
    from mkernel.dist.context import Context

    ctx = object.__new__(Context)
    ctx._timeout, ctx._comm_cache, ctx._err_dev = 5.0, {}, 0x1000
    ctx.rank = ctx.local_rank = ctx.node = 0
    ctx.size = ctx.local_size = 2
    ctx.num_nodes = 1
    c = ctx.comm_args("all_reduce")
    for bad in (float("nan"), float("inf"), -1, 0, "x", 86401):
        with pytest.raises(ValueError, match="Context.timeout"):
            ctx.timeout = bad
        assert ctx.timeout == 5.0 and c.timeout_ns == 5_000_000_000
    ctx.timeout = 86400  # a day: exact in the device's 64-bit nanoseconds (beyond 32-bit microseconds)
    assert c.timeout_ns == 86_400_000_000_000 and c.timeout_ns >> 10 > 0xFFFFFFFF


def test_internode_proxy_gets_the_context_timeout(monkeypatch):
    """The inter-node collectives' proxy (and through it the transport) runs under the context's
    timeout, not a fixed default."""
    import mkernel.proxy as P
    import mkernel.proxy.transport.window as W
    from mkernel.ops.collectives import internode as I

    made = {}

    class FakeProxy:
        def __init__(self, comm, windows, **kw):
            made.update(kw)

        def start(self):
            return self

        def check(self):
            pass

    class FakeCtx:
        timeout = 12.5
        world = object()

        def add_closer(self, fn):
            pass

        def add_check(self, fn):
            pass

        def workspace(self, key, nbytes):
            return type("WS", (), {"ptr": 0x1000, "nbytes": nbytes})()

    monkeypatch.setattr(P, "Proxy", FakeProxy)

    class FakeWindow:
        def __init__(self, ptr, nbytes):
            pass

    monkeypatch.setattr(W, "GpuWindow", FakeWindow)
    I.ProxyState(FakeCtx(), "all_gather", 4096)
    assert made.get("timeout") == 12.5


def test_an_inter_node_set_up_inside_a_graph_capture_raises_first(monkeypatch):
    """Making an inter-node op's workspace and proxy synchronizes the device: inside a capture of the op's
    stream it raises a RuntimeError before touching anything; a state already made is returned as is."""
    import types

    from mkernel.ops.collectives import internode as I

    data = {}
    ctx = types.SimpleNamespace(op_state=lambda name: types.SimpleNamespace(data=data))
    monkeypatch.setattr(I, "is_capturing", lambda stream: True)
    monkeypatch.setattr(I, "ProxyState", lambda *a: pytest.fail("set up inside a capture"))
    with pytest.raises(RuntimeError, match="before capturing"):
        I.proxy_state(ctx, "ring_attention", 4096, stream=7)
    made = data["proxy"] = types.SimpleNamespace(ws=types.SimpleNamespace(nbytes=8192), closed=False)
    assert I.proxy_state(ctx, "ring_attention", 4096, stream=7) is made


def test_a_closed_context_refuses_every_op():
    """Every op calls ctx.check() first: on a closed context it raises a clear MkernelError."""
    from mkernel import MkernelError
    from mkernel.dist.context import Context

    ctx = object.__new__(Context)
    ctx._closed, ctx.rank, ctx._checks = True, 3, []
    with pytest.raises(MkernelError, match="rank 3: this context was closed"):
        ctx.check()


def test_every_multi_rank_op_has_an_error_record_id():
    """A kernel's error record names its op by id (mkernel/dist/signals.py OPS): every op object of the
    package that talks to peers must have one, or its first bind fails with a KeyError."""
    import sys

    import mkernel  # noqa: F401 -- imports every op module
    from mkernel.ops.base import Op
    from mkernel.dist.signals import OPS

    single_gpu = {"gemm", "grouped_gemm", "grouped_gemm_swiglu", "attention", "attention_backward", "moe_layer"}
    ops = set()
    for mod in list(sys.modules.values()):
        if not getattr(mod, "__name__", "").startswith("mkernel.ops"):
            continue
        for v in vars(mod).values():
            for o in (v.values() if isinstance(v, dict) else (v,)):
                if isinstance(o, Op):
                    ops.add(o.name)
    assert {"moe_dispatch_gemm", "moe_dispatch_ll", "ring_attention"} <= ops
    missing = sorted(ops - single_gpu - set(OPS))
    assert not missing, f"ops without an error-record id in mkernel/dist/signals.py OPS: {missing}"
