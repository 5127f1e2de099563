"""One rank of a fault scenario under ``mpirun -disable-auto-cleanup`` (not collected: no test_ functions).

    python tests/faults/_mpi_worker.py SCENARIO OUTDIR

Started by tests/faults/test_mpi_faults.py.  Every rank writes what it saw to ``OUTDIR/rank<r>.json``
(events: name, wall-clock time, exception type and message) and leaves with ``os._exit`` (MPI_Finalize
could wait for a dead rank) once every rank that is alive has written it: hydra ends the whole job when
the first rank leaves without MPI_Finalize.  Hydra tells the ranks that one died with SIGUSR1, whose
default action ends the process: the ranks ignore it, as a job that outlives a rank must.  The victim of a kill scenario writes ``OUTDIR/victim.pid`` when it has
reached the point where it is to die and sleeps there; the harness kills it with SIGKILL, and the other
ranks, which wait for that file, are then inside the collective.  The victim runs under a shell
that outlives it (``sh -c "python ...; sleep"``): the launcher does not learn of the death, as with a
host that dies silently, and the other ranks find out only through their bounded waits (hydra's own
failure notices race with the dying rank and tear the whole job down now and then).  The CPU paths only: topology, the
agreement and symmetric memory with a fake CUDA driver (tests/cpu/test_host_waits.py has the same one).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "cpu"))

from mpi4py import MPI  # noqa: E402

from mkernel.dist.agreement import Agreement  # noqa: E402
from mkernel.dist.timeouts import host_wait_limit  # noqa: E402
from mkernel.dist.topology import Topology  # noqa: E402

TIMEOUT = 0.5  # the context timeout of every scenario; its host wait limit is host_wait_limit(TIMEOUT)
LIMIT = host_wait_limit(TIMEOUT)
STALL = LIMIT + 1.5  # a stalled rank sleeps this long: past the others' limit, within their re-init's
SIG = ("bfloat16", (4096,), False)


class Log:
    def __init__(self, out: Path, rank: int):
        self.path, self.rank, self.events = out / f"rank{rank}.json", rank, []

    def add(self, name, exc=None, **kw):
        e = {"event": name, "t": time.time(), **kw}
        if exc is not None:
            e.update(type=type(exc).__name__, msg=str(exc), record=getattr(exc, "record", None))
        self.events.append(e)
        self.path.write_text(json.dumps({"rank": self.rank, "events": self.events}, default=str))

    def attempt(self, name, fn):
        """Run ``fn``; log ``name`` with how long it took and what it raised (None when it returned)."""
        t0 = time.monotonic()
        try:
            v = fn()
        except Exception as exc:  # noqa: BLE001 - the outcome is the point
            self.add(name, exc, dt=time.monotonic() - t0)
            return exc
        self.add(name, dt=time.monotonic() - t0)
        return v


def wait_for_victim(out: Path, within: float = 30.0) -> None:
    t0 = time.monotonic()
    while not (out / "victim.pid").exists():
        if time.monotonic() - t0 > within:
            raise RuntimeError("the victim never got ready")
        time.sleep(0.005)
    time.sleep(0.05)  # the harness kills it now


def become_victim(out: Path) -> None:
    (out / "victim.pid.tmp").write_text(f"{os.getpid()} {os.getppid()}")
    os.replace(out / "victim.pid.tmp", out / "victim.pid")
    time.sleep(120)  # killed here
    raise RuntimeError("the victim was not killed")


def init():
    topo = Topology.from_comm(timeout=TIMEOUT)
    return topo, Agreement(topo.rank, lambda: TIMEOUT)


# ---- the fake driver of the symmetric scenarios ------------------------------------------------------

def fake_driver(fail_alloc: bool):
    """The CUDA calls SymmetricBuffer makes, in this process; cuMemAlloc runs out of memory when
    ``fail_alloc`` (until ``drv.fail_alloc`` is reset)."""
    from cuda.bindings import driver as cu

    from mkernel.errors import CudaError

    rank = MPI.COMM_WORLD.Get_rank()
    drv = types.SimpleNamespace(CUresult=cu.CUresult, fail_alloc=fail_alloc, live={}, mapped=set(), next=[rank << 40],
                                CUipcMem_flags=types.SimpleNamespace(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS=1))
    ok = cu.CUresult.CUDA_SUCCESS

    def alloc(n):
        if drv.fail_alloc:
            raise CudaError(2, "CUDA_ERROR_OUT_OF_MEMORY: out of memory")
        p = drv.next[0] = drv.next[0] + (1 << 32)
        drv.live[p] = n
        return ok, p

    def free(p):
        del drv.live[p]
        return (ok,)

    class Handle:
        reserved = b""

    def get_handle(p):
        h = Handle()
        h.reserved = p.to_bytes(8, "little") * 8
        return ok, h

    def open_handle(h, flags):
        p = int.from_bytes(bytes(h.reserved)[:8], "little") + 7
        drv.mapped.add(p)
        return ok, p

    def close_handle(p):
        drv.mapped.remove(p)
        return (ok,)

    drv.cuMemAlloc, drv.cuMemFree, drv.CUipcMemHandle = alloc, free, Handle
    drv.cuIpcGetMemHandle, drv.cuIpcOpenMemHandle, drv.cuIpcCloseMemHandle = get_handle, open_handle, close_handle
    drv.cuMemsetD8 = lambda p, v, n: (ok,)
    drv.cuCtxSynchronize = lambda: (ok,)
    drv.cuMemcpyHtoD = lambda d, s, n: (ok,)
    drv.cuStreamDestroy = lambda s: (ok,)
    drv.cuMemFreeHost = lambda p: (ok,)
    from mkernel.dist import context, symmetric

    symmetric.cu = drv
    context.cu = drv
    return drv


class SymCtx:
    device = 0

    def __init__(self, topo, ag):
        self.agreement, self.node_comm, self.local_world_ranks = ag, topo.node_comm, topo.local_world_ranks
        self._symmetric = []


def cpu_context(topo, ag, bufs):
    """A Context without a GPU: the fields close() and check() use (the driver is the fake one)."""
    from mkernel.dist.context import Context

    ctx = object.__new__(Context)
    ctx.rank, ctx._closed, ctx._closers, ctx._checks, ctx._op_states = topo.rank, False, [], [], {}
    ctx._symmetric, ctx._workspaces, ctx._ws_gen, ctx._side, ctx._err_host = list(bufs), {}, 0, None, 0
    ctx._record_lock = threading.Lock()
    ctx.agreement, ctx.error_record = ag, types.SimpleNamespace(code=0, raise_if_set=lambda: None)
    ctx.topology = topo  # (MPI communicators: closing the topology closes nothing)
    return ctx


# ---- scenarios ----------------------------------------------------------------------------------------

def sc_agree_kill(out, log):
    """The last rank is killed while the others are inside an agreement exchange."""
    topo, ag = init()
    ag.agree("mkernel.warmup", SIG, topo.world)
    if topo.rank == topo.size - 1:
        become_victim(out)
    wait_for_victim(out)
    log.attempt("agree", lambda: ag.agree("mkernel.all_reduce", SIG, topo.world))
    log.attempt("agree_again", lambda: ag.agree("mkernel.all_gather", SIG, topo.world))


def sc_init_kill(out, log):
    """The last rank is killed while the others are inside mkernel.init's collectives (it never joins)."""
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if rank == size - 1:
        t0 = time.monotonic()
        while not all((out / f"entering{r}").exists() for r in range(size - 1)) and time.monotonic() - t0 < 30:
            time.sleep(0.005)
        time.sleep(0.2)
        become_victim(out)
    (out / f"entering{rank}").touch()
    log.attempt("init", lambda: init())


def sc_split_kill(out, log):
    """The last rank is killed inside mkernel.init between the bounded duplicate and the host split (MPI's
    Split_type has no non-blocking form): the others, inside the split, must still raise at the limit."""
    from mkernel.dist import hostwait

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if rank == size - 1:
        hostwait.blocking = lambda *a, **k: become_victim(out)  # dies where the split would run
    else:
        log.add("threads", level=MPI.Query_thread(), multiple=MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    log.attempt("init", lambda: init())


def sc_agree_stall(out, log):
    """Rank 1 sleeps past the limit before it joins an agreement; the others time out, then every rank
    discards its agreement and initialises again, and the new one agrees."""
    topo, ag = init()
    ag.agree("mkernel.warmup", SIG, topo.world)
    if topo.rank == 1:
        time.sleep(STALL)
    log.attempt("agree", lambda: ag.agree("mkernel.all_reduce", SIG, topo.world))
    r = log.attempt("reinit", lambda: init())
    if not isinstance(r, Exception):
        topo2, ag2 = r
        log.attempt("agree_after_reinit", lambda: ag2.agree("mkernel.all_reduce", SIG, topo2.world))
        log.attempt("barrier_after_reinit", lambda: ag2.barrier("mkernel barrier", topo2.world))


def sc_mismatch(out, log):
    """Ranks making different calls at the host agreement: another size on rank 1, another op on rank 2
    (ValueError on every rank, the agreement stays usable); then rank 1 alone makes a call the others
    have agreed before (they do not exchange again: rank 1 times out, the device check would catch the
    others), and every rank initialises again."""
    topo, ag = init()
    r = topo.rank
    ag.agree("mkernel.all_reduce", SIG, topo.world)
    sig = ("bfloat16", (8192,), False) if r == 1 else SIG
    log.attempt("other_size", lambda: ag.agree("mkernel.all_gather", sig, topo.world))
    what = "mkernel.reduce_scatter" if r == 2 else "mkernel.all_gather"
    log.attempt("other_op", lambda: ag.agree(what, SIG, topo.world))
    log.attempt("same_call_after", lambda: ag.agree("mkernel.all_gather", ("float32", (16,), False), topo.world))
    if r == 1:
        log.attempt("new_call_alone", lambda: ag.agree("mkernel.all_reduce", ("float32", (7,), False), topo.world))
    else:
        log.attempt("agreed_call", lambda: ag.agree("mkernel.all_reduce", SIG, topo.world))
        time.sleep(LIMIT / 2)  # (what their device-side wait would take to time out)
    res = log.attempt("reinit", lambda: init())
    if not isinstance(res, Exception):
        topo2, ag2 = res
        log.attempt("agree_after_reinit", lambda: ag2.agree("mkernel.all_reduce", SIG, topo2.world))


def sc_symmetric_oom(out, log):
    """cuMemAlloc runs out of memory on rank 1 inside a symmetric allocation: every rank raises
    MemoryError naming it, nobody keeps memory, and the next allocation works."""
    from mkernel.dist.symmetric import SymmetricBuffer

    topo, ag = init()
    drv = fake_driver(fail_alloc=topo.rank == 1)
    ctx = SymCtx(topo, ag)
    log.attempt("alloc_oom", lambda: SymmetricBuffer(ctx, 1 << 34, topo.node_comm))
    log.add("held_after_oom", live=len(drv.live), mapped=len(drv.mapped))
    drv.fail_alloc = False
    b = log.attempt("alloc_retry", lambda: SymmetricBuffer(ctx, 1 << 20, topo.node_comm))
    if not isinstance(b, Exception):
        log.attempt("free", b.free)
    log.add("held_at_end", live=len(drv.live), mapped=len(drv.mapped))


def sc_symmetric_kill(out, log):
    """A buffer is allocated on every rank, then the last rank is killed while the others allocate the
    next one: they raise CommTimeout within the limit, and closing their context is local and leaks both
    buffers instead of waiting for the dead rank."""
    from mkernel.dist.symmetric import SymmetricBuffer

    topo, ag = init()
    drv = fake_driver(fail_alloc=False)
    ctx = SymCtx(topo, ag)
    b1 = SymmetricBuffer(ctx, 1 << 20, topo.node_comm)
    ctx._symmetric.append(b1)
    if topo.rank == topo.size - 1:
        become_victim(out)
    wait_for_victim(out)
    log.attempt("alloc", lambda: SymmetricBuffer(ctx, 1 << 21, topo.node_comm))
    c = cpu_context(topo, ag, ctx._symmetric)
    log.add("failure", reason=c.failure())
    log.attempt("close", c.close)
    log.add("held_after_close", live=len(drv.live), mapped=len(drv.mapped), leaked=b1.leaked)


SCENARIOS = {k[3:]: v for k, v in globals().items() if k.startswith("sc_")}


def main():
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    name, out = sys.argv[1], Path(sys.argv[2])
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    log = Log(out, rank)
    rc = 0
    try:
        SCENARIOS[name](out, log)
        log.add("done")
    except Exception as exc:  # noqa: BLE001
        log.add("crashed", exc, tb=traceback.format_exc())
        rc = 1
    leave(out, rank, [r for r in range(size) if not (name.endswith("_kill") and r == size - 1)], rc)


def leave(out: Path, rank: int, alive: list, rc: int) -> None:
    """Report this rank's exit, wait (at most 30 s) until every rank in ``alive`` did, and leave without
    MPI_Finalize (a dead rank would hold it)."""
    sys.stdout.flush()
    (out / f"exit{rank}").touch()
    t0 = time.monotonic()
    while not all((out / f"exit{r}").exists() for r in alive) and time.monotonic() - t0 < 30:
        time.sleep(0.01)
    os._exit(rc)


if __name__ == "__main__":
    main()
