"""No unbounded host wait: every host-side collective of a context ends within its limit (CPU only).

Ranks are threads sharing a fake communicator (tests/cpu/_fake_mpi.py) whose non-blocking collectives
complete only when every rank posts them -- a rank that never calls is a dead or stalled peer -- and,
for symmetric memory, a fake CUDA driver whose calls can fail on one simulated rank (out of memory, a
failed mapping).  The wait limit is lowered to fractions of a second (HOST_WAIT_MIN_S) so the timeouts
are quick.
"""
from __future__ import annotations

import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _fake_mpi import FakeMpiError, FakeWorld, run_ranks  # noqa: E402

from mkernel import CommError, CommTimeout, MkernelError  # noqa: E402
from mkernel.dist import hostwait, timeouts  # noqa: E402
from mkernel.dist.agreement import Agreement  # noqa: E402

LIMIT = 0.5  # HOST_WAIT_MIN_S in these tests; the timeouts are below it, so it is every wait's limit


@pytest.fixture(autouse=True)
def quick_limit(monkeypatch):
    monkeypatch.setattr(timeouts, "HOST_WAIT_MIN_S", LIMIT)


def _host(rank):
    return Agreement(rank, lambda: 0.01)


# ---- the bounded primitives -------------------------------------------------------------------------

def test_a_barrier_nobody_joins_times_out_and_breaks_the_agreement():
    world = FakeWorld(2)
    host = _host(0)
    t0 = time.monotonic()
    with pytest.raises(CommTimeout, match=r"rank 0 waited 0.5 s for the other ranks to join mkernel barrier"):
        host.barrier("mkernel barrier", world.comm(0))
    assert LIMIT <= time.monotonic() - t0 < LIMIT + 1
    assert host.broken and hostwait._abandoned[-1][0].world is world  # the request stays alive
    t0 = time.monotonic()
    for call in (lambda: host.barrier("x", world.comm(0)), lambda: host.exchange("x", [1], world.comm(0)),
                 lambda: host.exchange_bytes("x", b"ab", world.comm(0)), lambda: host.require("x")):
        with pytest.raises(CommTimeout, match="agreement is broken"):
            call()
    assert time.monotonic() - t0 < 0.1


def test_an_mpi_error_while_waiting_is_a_comm_error_and_breaks_the_agreement():
    world = FakeWorld(2)
    world.fail_tests = True
    host = _host(1)
    with pytest.raises(CommError, match="failed in MPI") as ei:
        host.exchange("mkernel.all_reduce", [5], world.comm(1))
    assert isinstance(ei.value.__cause__, FakeMpiError) and not isinstance(ei.value, CommTimeout)
    assert host.broken


def test_exchanges_complete_when_every_rank_joins():
    world = FakeWorld(3)

    def body(r):
        host = _host(r)
        c = world.comm(r)
        host.barrier("b", c)
        a = host.exchange("e", [r, 10 * r], c)
        b = host.exchange_bytes("v", b"x" * (r + 1), c)
        return a.tolist(), b

    res, errs = run_ranks(3, body)
    assert errs == [None] * 3
    for a, b in res:
        assert a == [[0, 0], [1, 10], [2, 20]] and b == [b"x", b"xx", b"xxx"]


def test_ranks_making_different_calls_raise_value_error_on_every_rank():
    """The digests differ: every rank takes the second (bounded) exchange and names the ranks that differ
    with their calls."""
    world = FakeWorld(3)

    def body(r):
        sig = ("bfloat16", (8,)) if r != 2 else ("bfloat16", (16,))
        return _host(r).agree("mkernel.all_reduce", sig, world.comm(r))

    _, errs = run_ranks(3, body)
    assert all(isinstance(e, ValueError) for e in errs), errs
    assert "has ('bfloat16', (8,)), ranks [2] have [('bfloat16', (16,))]" in str(errs[0])
    assert "ranks [0, 1] have" in str(errs[2])


def test_a_dead_rank_in_an_agreement_times_out_every_other_rank():
    world = FakeWorld(3)

    def body(r):
        if r == 1:
            return None  # dead: never joins
        t0 = time.monotonic()
        try:
            _host(r).agree("mkernel.all_gather", ("float32", (4,)), world.comm(r))
        except CommTimeout:
            return time.monotonic() - t0
        return "returned"

    res, errs = run_ranks(3, body)
    assert errs == [None] * 3
    assert all(LIMIT <= res[r] < LIMIT + 1 for r in (0, 2)), res


# ---- symmetric memory with a fake driver ----------------------------------------------------------

class FakeDriver:
    """The CUDA driver calls SymmetricBuffer makes, per simulated rank (``FakeDriver.rank``: thread-local).
    ``fail[(rank, call)]``: the exception that call raises on that rank."""

    def __init__(self):
        from cuda.bindings import driver as cu

        self.CUresult = cu.CUresult
        self.CUipcMem_flags = types.SimpleNamespace(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS=1)
        self.local = threading.local()
        self.lock = threading.Lock()
        self.live: dict = {}  # rank -> {ptr: nbytes} allocated and not freed
        self.mapped: dict = {}  # rank -> set of mapped peer pointers
        self.fail: dict = {}
        self.next = 1 << 32

    @property
    def rank(self):
        return self.local.rank

    def _maybe_fail(self, call):
        exc = self.fail.get((self.rank, call))
        if exc is not None:
            raise exc

    def _ok(self, *values):
        return (self.CUresult.CUDA_SUCCESS, *values)

    def cuMemAlloc(self, n):
        self._maybe_fail("cuMemAlloc")
        with self.lock:
            p, self.next = self.next, self.next + (1 << 32)
            self.live.setdefault(self.rank, {})[p] = n
        return self._ok(p)

    def cuMemFree(self, p):
        with self.lock:
            del self.live[self.rank][p]
        return self._ok()

    def cuMemsetD8(self, p, v, n):
        return self._ok()

    def cuCtxSynchronize(self):
        self._maybe_fail("cuCtxSynchronize")
        return self._ok()

    def cuMemcpyHtoD(self, dst, src, n):
        return self._ok()

    class CUipcMemHandle:
        reserved = b""

    def cuIpcGetMemHandle(self, p):
        h = self.CUipcMemHandle()
        h.reserved = p.to_bytes(8, "little") * 8
        return self._ok(h)

    def cuIpcOpenMemHandle(self, h, flags):
        self._maybe_fail("cuIpcOpenMemHandle")
        p = int.from_bytes(bytes(h.reserved)[:8], "little") + 7  # "mapped here"
        with self.lock:
            self.mapped.setdefault(self.rank, set()).add(p)
        return self._ok(p)

    def cuIpcCloseMemHandle(self, p):
        with self.lock:
            self.mapped[self.rank].remove(p)
        return self._ok()

    def held(self, rank):
        return len(self.live.get(rank, {})), len(self.mapped.get(rank, set()))


class SymCtx:
    """What SymmetricBuffer reads from its context."""

    device = 0

    def __init__(self, rank, comm, world_ranks):
        self.agreement = _host(rank)
        self.node_comm = comm
        self.local_world_ranks = world_ranks
        self._symmetric = []


@pytest.fixture
def drv(monkeypatch):
    from mkernel.dist import symmetric

    d = FakeDriver()
    monkeypatch.setattr(symmetric, "cu", d)
    return d


def _alloc_on_ranks(drv, size, body_of_rank, world_ranks=None):
    from mkernel.dist.symmetric import SymmetricBuffer

    world = FakeWorld(size)
    ctxs = [SymCtx(r, world.comm(r), world_ranks or list(range(size))) for r in range(size)]

    def body(r):
        drv.local.rank = r
        return body_of_rank(r, ctxs[r], lambda n: SymmetricBuffer(ctxs[r], n, ctxs[r].node_comm))

    return ctxs, run_ranks(size, body)


def test_symmetric_allocation_and_free_on_every_rank(drv):
    def body(r, ctx, alloc):
        b = alloc(1000)
        assert b.peer_ptrs[r] == b.ptr and len(b.peer_ptrs) == 3 and drv.held(r) == (2, 2)
        ctx.agreement.barrier("all mapped", ctx.node_comm)
        b.free()
        return b

    ctxs, (res, errs) = _alloc_on_ranks(drv, 3, body)
    assert errs == [None] * 3
    assert all(drv.held(r) == (0, 0) for r in range(3)) and all(b.freed and not b.leaked for b in res)


def test_out_of_memory_on_one_rank_raises_memory_error_on_every_rank_naming_it(drv):
    """cuMemAlloc fails on local rank 1 (world rank 5): every rank raises MemoryError naming rank 5, nobody
    keeps memory, and the context stays usable (the exchange completed: nothing was abandoned)."""
    from mkernel.errors import CudaError

    drv.fail[(1, "cuMemAlloc")] = CudaError(2, "CUDA_ERROR_OUT_OF_MEMORY: out of memory")

    def body(r, ctx, alloc):
        t0 = time.monotonic()
        try:
            alloc(1 << 30)
        except MemoryError as exc:
            err = exc
        else:
            return "allocated"
        assert time.monotonic() - t0 < LIMIT  # told by the failing rank, not timed out
        assert ctx.agreement.broken is None
        if r == 1:
            drv.fail.clear()
        ctx.agreement.barrier("retry", ctx.node_comm)
        b = alloc(4096)  # a smaller allocation works on every rank
        ctx.agreement.barrier("mapped", ctx.node_comm)
        b.free()
        return err

    ctxs, (res, errs) = _alloc_on_ranks(drv, 3, body, world_ranks=[4, 5, 6])
    assert errs == [None] * 3, errs
    for e in res:
        assert isinstance(e, MemoryError) and "out of device memory on rank 5" in str(e), e
    assert "here: CUDA_ERROR_OUT_OF_MEMORY" in str(res[1])
    assert all(drv.held(r) == (0, 0) for r in range(3))


def test_a_failed_mapping_on_one_rank_raises_on_every_rank_and_frees_everything(drv):
    from mkernel.errors import CudaError

    drv.fail[(2, "cuIpcOpenMemHandle")] = CudaError(201, "CUDA_ERROR_INVALID_CONTEXT")

    def body(r, ctx, alloc):
        alloc(1 << 20)

    _, (_, errs) = _alloc_on_ranks(drv, 3, body)
    for e in errs:
        assert isinstance(e, CommError) and "mapping a 1048576-byte symmetric buffer: failed on rank 2" in str(e), e
    assert all(drv.held(r) == (0, 0) for r in range(3))


def test_symmetric_sizes_that_differ_raise_value_error_on_every_rank(drv):
    def body(r, ctx, alloc):
        alloc(4096 if r else 8192)

    _, (_, errs) = _alloc_on_ranks(drv, 2, body)
    assert all(isinstance(e, ValueError) and "sizes differ" in str(e) for e in errs), errs
    assert all(drv.held(r) == (0, 0) for r in range(2))


def test_a_missing_rank_in_a_symmetric_allocation_times_out_and_leaks(drv):
    """A rank that never arrives: the others raise CommTimeout within the limit; their copies are leaked
    (a peer may hold the handle), the agreement is broken."""
    def body(r, ctx, alloc):
        if r == 2:
            return None
        t0 = time.monotonic()
        with pytest.raises(CommTimeout, match="symmetric allocation of 4096 bytes"):
            alloc(4096)
        assert time.monotonic() - t0 < LIMIT + 1 and ctx.agreement.broken
        return True

    _, (res, errs) = _alloc_on_ranks(drv, 3, body)
    assert errs == [None] * 3 and res[:2] == [True, True]
    assert drv.held(0) == (1, 0) and drv.held(1) == (1, 0)


def test_free_with_a_missing_rank_times_out_and_leaks(drv):
    def body(r, ctx, alloc):
        b = alloc(4096)
        ctx._symmetric.append(b)
        ctx.agreement.barrier("mapped", ctx.node_comm)
        if r == 0:
            return b  # never frees: the others must not wait for it forever
        with pytest.raises(CommTimeout, match="freeing a 4096-byte symmetric buffer"):
            b.free()
        assert b.freed and b.leaked and ctx._symmetric == []
        return b

    _, (res, errs) = _alloc_on_ranks(drv, 3, body)
    assert errs == [None] * 3, errs
    assert drv.held(1) == (2, 2) and drv.held(2) == (2, 2)  # nothing freed under a peer that may map it


def test_free_after_a_device_failure_on_one_rank_leaks_on_every_rank(drv):
    from mkernel.errors import CudaError

    def body(r, ctx, alloc):
        b = alloc(4096)
        ctx.agreement.barrier("mapped", ctx.node_comm)
        if r == 1:
            drv.fail[(1, "cuCtxSynchronize")] = CudaError(700, "CUDA_ERROR_ILLEGAL_ADDRESS")
        ctx.agreement.barrier("failed", ctx.node_comm)
        b.free()

    _, (_, errs) = _alloc_on_ranks(drv, 2, body)
    assert all(isinstance(e, CommError) and "the device failed on rank 1" in str(e) for e in errs), errs
    assert drv.held(0) == (2, 1) and drv.held(1) == (2, 1)


# ---- the context ----------------------------------------------------------------------------------

class _Buf:
    def __init__(self, nbytes, free_error=None):
        self.nbytes, self.freed, self.leaked, self.free_error = nbytes, False, False, free_error
        self.frees = 0

    def free(self):
        self.frees += 1
        if self.free_error is not None:
            raise self.free_error
        self.freed = True

    def abandon(self):
        self.freed = self.leaked = True


def _closable_ctx(monkeypatch, bufs, broken=None, record_code=0):
    from mkernel.dist import context as X

    freed_host = []
    fake_cu = types.SimpleNamespace(cuCtxSynchronize=lambda: None, cuStreamDestroy=lambda s: None,
                                    cuMemFreeHost=lambda p: freed_host.append(p))
    monkeypatch.setattr(X, "cu", fake_cu)
    monkeypatch.setattr(X, "check", lambda r: None)
    ctx = object.__new__(X.Context)
    ctx.rank, ctx._closed, ctx._closers, ctx._checks, ctx._op_states = 0, False, [], [], {}
    ctx._symmetric, ctx._workspaces, ctx._ws_gen, ctx._side, ctx._err_host = list(bufs), {}, 0, None, 0x5000
    ctx._record_lock = threading.Lock()
    ctx.agreement = _host(0)
    ctx.agreement.broken = broken
    ctx.error_record = types.SimpleNamespace(code=record_code)
    ctx.topology = types.SimpleNamespace(close=lambda: None)
    return ctx, freed_host


@pytest.mark.parametrize("failure", ["agreement broken", "kernel error", "proxy error"])
def test_close_of_a_failed_context_is_local_and_leaks(monkeypatch, failure):
    bufs = [_Buf(4096, AssertionError("a collective free on a failed context")) for _ in range(3)]
    ctx, freed_host = _closable_ctx(monkeypatch, bufs, broken="x timed out" if failure == "agreement broken" else None,
                                    record_code=2 if failure == "kernel error" else 0)
    if failure == "proxy error":
        def proxy_check():
            raise CommError("tcp transport rank 0: rank 1 closed the connection")
        ctx.add_check(proxy_check)
    assert ctx.failure() is not None
    t0 = time.monotonic()
    ctx.close()
    assert time.monotonic() - t0 < 0.1
    assert all(b.frees == 0 and b.leaked for b in bufs) and freed_host == [0x5000]
    with pytest.raises(MkernelError, match="this context was closed"):
        ctx.check()
    ctx.close()  # idempotent


def test_close_after_a_free_times_out_leaks_the_rest(monkeypatch):
    first = _Buf(4096, CommTimeout("rank 0 waited 4.0 s for the other ranks to join freeing ..."))
    rest = [_Buf(4096, AssertionError("waited again after a timeout")) for _ in range(2)]
    ctx, _ = _closable_ctx(monkeypatch, [first, *rest])
    ctx.close()
    assert first.frees == 1 and all(b.frees == 0 and b.leaked for b in rest)


def test_close_of_a_healthy_context_frees_collectively(monkeypatch):
    bufs = [_Buf(4096) for _ in range(3)]
    ctx, _ = _closable_ctx(monkeypatch, bufs)
    assert ctx.failure() is None
    ctx.close()
    assert all(b.frees == 1 and b.freed and not b.leaked for b in bufs)


def test_close_skips_the_frees_when_a_closer_failed(monkeypatch):
    """A closer (the inter-node proxy) that raises -- its peer is gone -- makes the frees local too."""
    bufs = [_Buf(4096, AssertionError("collective free after the proxy lost a peer"))]
    ctx, _ = _closable_ctx(monkeypatch, bufs)

    def closer():
        ctx.remove_closer(closer)
        raise CommError("proxy rank 0: close timed out waiting for ranks [1]")
    ctx.add_closer(closer)
    ctx.close()
    assert bufs[0].leaked and bufs[0].frees == 0


def test_a_broken_agreement_fails_every_later_op_at_check():
    from mkernel.dist.context import Context

    ctx = object.__new__(Context)
    ctx._closed, ctx.rank, ctx._checks = False, 0, []
    ctx.agreement = _host(0)
    ctx.error_record = types.SimpleNamespace(raise_if_set=lambda: None, code=0)
    ctx.check()
    ctx.agreement.broken = "mkernel.all_reduce: timed out"
    with pytest.raises(CommTimeout, match="agreement is broken.*mkernel.init"):
        ctx.check()


def test_a_failed_workspace_growth_leaves_no_freed_workspace_cached(monkeypatch):
    from mkernel.dist import context as X

    ctx = object.__new__(X.Context)
    old = _Buf(4096, CommTimeout("rank 0 waited ... freeing"))
    ctx._workspaces, ctx._ws_gen = {"k": old}, 3
    ctx.synchronize = lambda stream=None: None
    monkeypatch.setattr(X, "is_capturing", lambda s: False)
    with pytest.raises(CommTimeout):
        ctx.workspace("k", 8192)
    assert ctx._workspaces == {} and ctx._ws_gen > 3  # no bound call keeps using the old workspace


def test_topology_waits_are_bounded(monkeypatch):
    """Topology.from_comm with a rank missing from the duplicate: CommTimeout within the limit (no MPI)."""
    import mpi4py

    from mkernel.dist.topology import Topology

    world = FakeWorld(2)
    fake = types.SimpleNamespace(COMM_WORLD=world.comm(0), COMM_TYPE_SHARED=1)
    monkeypatch.setattr(mpi4py, "MPI", fake, raising=False)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", fake)
    t0 = time.monotonic()
    with pytest.raises(CommTimeout, match="mkernel.init"):
        Topology.from_comm(timeout=0.01)
    assert time.monotonic() - t0 < LIMIT + 1


def test_the_mpi_exchanger_is_bounded_and_shares_the_context_state():
    from mkernel.proxy.transport import MpiExchanger

    world = FakeWorld(2)
    host = _host(0)
    ex = MpiExchanger(world.comm(0), host=host)
    with pytest.raises(CommTimeout, match="inter-node transport set-up"):
        ex.allgather(("host", 1234))
    assert host.broken  # the context's agreement: the context has failed too
    ex2 = MpiExchanger(FakeWorld(2).comm(0), timeout=0.01)
    with pytest.raises(CommTimeout):
        ex2.barrier()

    def body(r):
        e = MpiExchanger(shared.comm(r), timeout=0.01)
        out = e.allgather({"rank": r, "addr": ("127.0.0.1", 5000 + r), "secret": b"\x00\x01" if r == 0 else None})
        e.barrier()
        return out

    shared = FakeWorld(2)
    res, errs = run_ranks(2, body)
    assert errs == [None, None]
    assert res[0] == res[1] == [{"rank": 0, "addr": ("127.0.0.1", 5000), "secret": b"\x00\x01"},
                                {"rank": 1, "addr": ("127.0.0.1", 5001), "secret": None}]


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce", "ag_gemm", "gemm_reduce_scatter"])
def test_every_op_on_a_closed_context_raises_first(op):
    """Every op taking a context calls ctx.check() before it reads an argument: on a closed context the
    clear MkernelError, whatever the arguments (here none that would pass)."""
    import mkernel
    from mkernel.dist.context import Context

    ctx = object.__new__(Context)
    ctx._closed, ctx.rank, ctx._checks = True, 2, []
    with pytest.raises(MkernelError, match="rank 2: this context was closed; make a new one with mkernel.init"):
        getattr(mkernel, op)(ctx, None, None)
    with pytest.raises(MkernelError, match="this context was closed"):
        ctx.alloc_symmetric(4096)
    with pytest.raises(MkernelError, match="this context was closed"):
        ctx.barrier()


def test_a_blocking_mpi_split_is_bounded_on_a_helper_thread():
    """mkernel.init's two communicator splits (no non-blocking form in MPI) run on a helper thread under
    MPI_THREAD_MULTIPLE: a split that never returns (a rank died before it) is a CommTimeout at the limit;
    a result or an MPI error comes back to the caller; without threads the call runs inline."""
    import threading
    import time

    from mkernel.dist import hostwait
    from mkernel.errors import CommError, CommTimeout

    assert hostwait.blocking(lambda: 7, 1.0, "split", 0, True) == 7
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(CommTimeout, match="rank 3 waited 0.3 s .* mkernel.init \\(the node split\\)"):
        hostwait.blocking(lambda: release.wait(30), 0.3, "mkernel.init (the node split)", 3, True)
    assert 0.3 <= time.monotonic() - t0 < 1.5
    release.set()

    def mpi_error():
        raise RuntimeError("MPI_ERR_PROC_FAILED")

    with pytest.raises(CommError, match="failed in MPI") as ei:
        hostwait.blocking(mpi_error, 1.0, "split", 0, True)
    assert isinstance(ei.value.__cause__, RuntimeError)
    me = threading.get_ident()
    assert hostwait.blocking(threading.get_ident, 1.0, "split", 0, False) == me  # inline


def test_host_failure_reported_after_close_is_dropped(monkeypatch):
    """The proxy's thread may report a failure after close() freed the error record: nothing is written."""
    ctx, freed_host = _closable_ctx(monkeypatch, [])
    writes = []

    class Rec:
        code = 0

        def __setattr__(self, name, value):
            writes.append(name)
    ctx.error_record = types.SimpleNamespace(code=0, _rec=Rec())
    ctx.close()
    assert freed_host == [0x5000]
    ctx.report_host_failure(7)
    assert writes == []
    ctx2, _ = _closable_ctx(monkeypatch, [])  # (an open context takes the report)
    ctx2.error_record = types.SimpleNamespace(code=0, _rec=Rec())
    ctx2.report_host_failure(7)
    assert "code" in writes
