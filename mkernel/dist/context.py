"""Bootstrap, topology, and the per-rank context every op takes.

``mkernel.init(comm=None)`` returns a :class:`Context`; ``comm`` is an mpi4py communicator (default
``MPI.COMM_WORLD``) or any bootstrap object offering ``rank``, ``size``, ``allgather(bytes) -> list[bytes]``
and ``barrier()`` (:mod:`mkernel.dist.bootstrap`).  The context has:

* world ``rank``/``size``;
* ``node``/``num_nodes``: nodes come from a shared-memory split of the communicator;
  ``ranks_per_node`` (argument, or ``MKERNEL_RANKS_PER_NODE``) groups each host's ranks into smaller
  *emulated* nodes (e.g. 1: every rank its own node), so every multi-node code path runs on one box;
* ``local_rank``/``local_size``: the ranks of this (possibly emulated) node, joined by NVLink;
* ``device``: the GPU, by default the rank's index among the processes on its host (physical, so
  emulated nodes on one host use different GPUs), modulo the GPU count; ``device=`` or
  ``MKERNEL_DEVICE`` override it.

The context owns the host-mapped error record kernels write on a timeout, symmetric memory
(:mod:`mkernel.dist.symmetric`), per-op workspaces, the agreement on calls across ranks
(:mod:`mkernel.dist.agreement`) and every op's state (:meth:`Context.op_state`: bound calls, plans,
op-owned structures), all in one place.  With MPI its communicators are private duplicates of the one
it was made from: mkernel's exchanges never interleave with the application's MPI traffic.  With another
bootstrap, ``world`` is that bootstrap (the application must not use it concurrently with mkernel's
calls) and the node and host communicators are Unix-socket groups among the host's ranks
(:mod:`mkernel.dist.localgroup`).
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
from cuda.bindings import driver as cu

from ..core import frees
from ..core.device import cu_init
from ..core.driver import check, device_attribute
from ..core.log import log
from ..core.streams import is_capturing, stream_handle
from ..errors import DeviceError, MkernelError
from .agreement import Agreement
from .opstate import OpState
from .sharing import gpu_identity, shared_gpus, warn_shared_gpus
from .signals import OPS, ErrorRecordView, MkComm
from . import wire
from .timeouts import resolve_timeout, validate_timeout
from .topology import Topology

__all__ = ["init", "Context"]


def _env_int(name: str):
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


class Context:
    """Per-rank state: communicators, topology, GPU, error record, symmetric memory and workspaces."""

    def __init__(self, comm=None, *, device: int | None = None, ranks_per_node: int | None = None,
                 timeout: float | None = None):
        self._timeout = resolve_timeout(timeout)  # first: a bad value fails before any collective set-up
        cu_init()  # then the driver: a machine without one fails here, alone, with one DeviceError
        topo = Topology.from_comm(comm, ranks_per_node, timeout=self._timeout)
        self.topology = topo
        self.world, self.node_comm, self.host_comm = topo.world, topo.node_comm, topo.host_comm
        self.rank, self.size = topo.rank, topo.size
        self.node, self.num_nodes = topo.node, topo.num_nodes
        self.local_rank, self.local_size = topo.local_rank, topo.local_size
        self.emulated = topo.emulated
        self.local_world_ranks, self.node_of_rank = topo.local_world_ranks, topo.node_of_rank
        host_rank = topo.host_rank
        # GPU
        ndev = check(cu.cuDeviceGetCount())
        if ndev == 0:
            raise DeviceError("mkernel.init: the NVIDIA driver sees no CUDA GPU")
        dev = device if device is not None else _env_int("MKERNEL_DEVICE")
        self.device = int(dev) if dev is not None else host_rank % ndev
        if not 0 <= self.device < ndev:
            raise ValueError(f"mkernel.init: device {self.device} out of range (this host has {ndev})")
        self.agreement = Agreement(self.rank, lambda: self._timeout)
        ids = self.agreement.exchange_bytes("mkernel.init (GPU identities)",
                                            wire.encode((self.rank, gpu_identity(self.device))), topo.host_comm)
        entries = [wire.decode(b) for b in ids]
        warn_shared_gpus(self.rank, entries, topo.host_size, ndev)
        # the most ranks of this host on one GPU: the same on every rank of the host (so in every plan)
        self.gpu_sharers = max([1] + [len(r) for r in shared_gpus(entries).values()])
        from cuda.core import Device

        self._cu_device = Device(self.device)
        self._cu_device.set_current()
        self.cu_context = check(cu.cuCtxGetCurrent())
        A = cu.CUdevice_attribute
        self.sm_count = device_attribute(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.device)
        # SMs a kernel that waits for its peers' kernels may fill: all of them, or an equal share when
        # ranks share a GPU, so the sharers' kernels fit on it together (docs/reliability.md, "Ranks
        # sharing a GPU"); every op's grids and plans use this, never sm_count
        self.resident_sms = max(1, self.sm_count // self.gpu_sharers)
        # host-mapped error record
        flags = cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE
        self._err_host = int(check(cu.cuMemHostAlloc(4096, flags)))
        ctypes.memset(self._err_host, 0, 4096)
        self._err_dev = int(check(cu.cuMemHostGetDevicePointer(self._err_host, 0)))
        self.error_record = ErrorRecordView(self._err_host, self.local_world_ranks)
        # held while a host-side failure is written and while close() frees the record (report_host_failure
        # runs on the proxy's thread: a report after close() is dropped, never written to freed memory)
        self._record_lock = threading.Lock()
        self._workspaces: dict = {}
        self._ws_gen = 0  # bumped whenever a workspace is (re)allocated: bound calls are keyed on it
        self._op_states: dict = {}
        self._symmetric: list = []
        self._sym_seq = 0  # alloc_symmetric's count: a buffer's collective identity
        self._closers: list = []  # close() hooks of op state (e.g. inter-node proxies), run first
        self._checks: list = []   # check() hooks raising host-side failures (e.g. a proxy's)
        self._closed = False
        self._side = None  # side_stream()
        self._comm_cache: dict = {}

    # ------------------------------------------------------------------ kernel arguments
    @property
    def timeout(self) -> float:
        """Seconds every device-side wait of this context may take (settable; applies to later launches)."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        seconds = validate_timeout(seconds, "Context.timeout")
        self._timeout = seconds
        for c in self._comm_cache.values():  # ops keep these structs (launches copy them by value)
            c.timeout_ns = int(seconds * 1e9)

    def comm_args(self, op: str | int, sig: int = 0) -> MkComm:
        """The MkComm a kernel of ``op`` takes by value (cached per op and signature: launches copy it);
        ``sig``: the call signature ``agree`` returned, for kernels that check their peers'."""
        c = self._comm_cache.get((op, sig))
        if c is None:
            c = self._comm_cache[(op, sig)] = self._make_comm_args(op)
            c.sig = sig
        return c

    def _make_comm_args(self, op: str | int) -> MkComm:
        c = MkComm()
        c.err = self._err_dev
        c.timeout_ns = int(self.timeout * 1e9)
        c.rank, c.world_size = self.rank, self.size
        c.local_rank, c.local_size = self.local_rank, self.local_size
        c.node, c.num_nodes = self.node, self.num_nodes
        c.op = OPS[op] if isinstance(op, str) else int(op)
        return c

    # ------------------------------------------------------------------ errors
    def check(self) -> None:
        """Raise :class:`~mkernel.CommTimeout` if any kernel of this rank reported a failure or a host
        collective of this context timed out (non-blocking), :class:`~mkernel.MkernelError` if the context
        was closed (every op calls this first)."""
        if self._closed:
            raise MkernelError(f"mkernel: rank {self.rank}: this context was closed; make a new one with mkernel.init()")
        if self.agreement.broken is not None:
            self.agreement.require("mkernel")
        for fn in self._checks:  # host-side failures first: they carry the cause (e.g. the transport's)
            fn()
        self.error_record.raise_if_set()

    def synchronize(self, stream=None) -> None:
        """Wait for ``stream`` (or the whole device when None) and raise what the kernels reported."""
        if stream is None:
            r = cu.cuCtxSynchronize()
            frees.drain()
        else:
            # poll, sleeping between queries, so threads of this process that the GPU may be
            # waiting on (the inter-node proxy) keep getting the GIL
            s = cu.CUstream(stream_handle(stream))
            while True:
                r, = cu.cuStreamQuery(s)
                if r != cu.CUresult.CUDA_ERROR_NOT_READY:
                    break
                time.sleep(20e-6)
        self.check()
        check(r)

    def report_host_failure(self, code: int, peer: int = -1) -> None:
        """A host-side failure (e.g. the proxy's transport died): write the error record so every
        device-side wait of this rank stops; the failing component's check hook raises the cause.  Called
        from the proxy's thread too; a no-op once :meth:`close` has begun (the record is freed there)."""
        with self._record_lock:
            if self._closed:
                return
            rec = self.error_record._rec
            if rec.code == 0:
                rec.rank, rec.op, rec.peer, rec.flag_index = self.rank, OPS["proxy"], peer, -1
                rec.code = code

    def failure(self) -> str | None:
        """Why this context failed, or None while it is healthy: a host collective timed out or failed (the
        agreement is broken), a kernel of this rank reported an error, or a check hook (the inter-node
        proxy) raised.  A failed context must be discarded: :meth:`close` is then local."""
        if self.agreement.broken is not None:
            return f"host collective failed: {self.agreement.broken}"
        for fn in self._checks:  # (before the record: they carry the cause)
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - the hook's failure is the answer
                return f"{type(exc).__name__}: {exc}"
        if self.error_record.code != 0:
            return f"a kernel reported error code {self.error_record.code}"
        return None

    # ------------------------------------------------------------------ agreement across ranks
    def agree(self, what: str, signature: tuple, comm=None) -> int:
        """Check, once per distinct ``signature``, that every rank of ``comm`` (default: the world) makes
        the same call; returns the call's 32-bit digest (``MkComm.sig``).  See
        :meth:`mkernel.dist.agreement.Agreement.agree`."""
        return self.agreement.agree(what, signature, comm if comm is not None else self.world)

    def bounded_allgather(self, vec, what: str, comm=None):
        """Allgather one int64 vector per rank of ``comm`` (default: the world) -> ``[size, len]``,
        bounded by the timeout (:meth:`mkernel.dist.agreement.Agreement.exchange`)."""
        return self.agreement.exchange(what, vec, comm if comm is not None else self.world)

    # ------------------------------------------------------------------ op state
    def op_state(self, name: str):
        """The state of op ``name`` on this context (:class:`mkernel.dist.opstate.OpState`: bound calls,
        the last plan, op-owned data), created on first use and dropped by :meth:`close`."""
        st = self._op_states.get(name)
        if st is None:
            st = self._op_states[name] = OpState(name)
        return st

    def last_plan(self, op: str):
        """The plan of ``op``'s latest call on this context (None before the first)."""
        st = self._op_states.get(op)
        return None if st is None else st.last_plan

    @property
    def workspace_generation(self) -> int:
        """Bumped whenever a workspace is (re)allocated: every bound call keyed on it is rebuilt."""
        return self._ws_gen

    def add_closer(self, fn) -> None:
        """Run ``fn()`` first in :meth:`close` (op-owned resources: proxies, side structures)."""
        self._closers.append(fn)

    def remove_closer(self, fn) -> None:
        if fn in self._closers:
            self._closers.remove(fn)

    def add_check(self, fn) -> None:
        """Run ``fn()`` in :meth:`check` before the error record is read (host-side failures, e.g. a
        proxy's transport error, raise their own cause)."""
        self._checks.append(fn)

    def remove_check(self, fn) -> None:
        if fn in self._checks:
            self._checks.remove(fn)

    # ------------------------------------------------------------------ memory
    def alloc_symmetric(self, nbytes: int, comm=None):
        """Collectively allocate ``nbytes`` on every rank of this node and map every peer's copy (bounded;
        a failure on any rank raises on every rank: :class:`mkernel.dist.symmetric.SymmetricBuffer`)."""
        from .symmetric import SymmetricBuffer

        if self._closed:
            self.check()
        buf = SymmetricBuffer(self, nbytes, comm if comm is not None else self.node_comm)
        buf.seq = self._sym_seq  # (collective: the same number on every rank)
        self._sym_seq += 1
        self._symmetric.append(buf)
        return buf

    def symmetric_region(self, ptr: int, nbytes: int):
        """``(buffer, offset)`` when ``[ptr, ptr + nbytes)`` lies inside one live symmetric buffer of this
        context allocated over the whole node (:meth:`alloc_symmetric`), else None."""
        for buf in self._symmetric:
            if (not buf.freed and buf.local_size == self.local_size and buf.ptr <= ptr
                    and ptr + nbytes <= buf.ptr + buf.nbytes):
                return buf, ptr - buf.ptr
        return None

    def workspace(self, key, nbytes: int, stream=None, what: str = "mkernel"):
        """A cached symmetric workspace for ``key``, re-allocated (collectively) when it must grow.

        Every rank calls ops in the same order with the same sizes (checked by :meth:`agree`), so
        growth happens on all ranks at the same call.  A fresh workspace is zeroed: flags and epochs
        start at 0.  Creating or growing one allocates collectively and synchronizes the device, which
        a CUDA-graph capture forbids: when ``stream`` (the op's stream) is being captured, that raises
        a RuntimeError naming ``what`` before anything touches the capture.
        """
        ws = self._workspaces.get(key)
        if ws is not None and ws.nbytes >= nbytes:
            return ws
        if stream is not None and is_capturing(stream):
            raise RuntimeError(
                f"{what}: this call needs a larger communication workspace ({nbytes} bytes; a collective "
                "allocation that synchronizes the device), which cannot be set up while its stream is being "
                "captured into a CUDA graph: make one call of this size (or larger) before capturing")
        if ws is not None:
            self.synchronize()
            del self._workspaces[key]  # (a failed free or allocation leaves no freed workspace cached)
            self._ws_gen += 1
            ws.free()
        grow = max(nbytes, int(ws.nbytes * 1.5) if ws is not None else nbytes)
        log.info("%s [rank %d]: communication workspace %s %s %d bytes", what, self.rank, key,
                 f"grows from {ws.nbytes} to" if ws is not None else "created with", grow)
        ws = self.alloc_symmetric(grow)
        self._workspaces[key] = ws
        self._ws_gen += 1
        return ws

    def side_stream(self) -> int:
        """This rank's side stream (non-blocking, created on first use, destroyed by close()): ops
        fork work onto it (e.g. copy-engine transfers) and join it back with events, so the caller
        only ever sees its own stream; inside a CUDA graph capture the fork/join is captured too."""
        if self._side is None:
            self._side = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        return int(self._side)

    def barrier(self) -> None:
        """Every rank of the world reached this point (bounded: :class:`~mkernel.CommTimeout` after the
        agreement's limit, and the context is failed from then on)."""
        self.check()
        self.agreement.barrier("mkernel barrier", self.world)

    def close(self) -> None:
        """Stop the inter-node proxy, free workspaces and symmetric buffers, release the error record.

        On a healthy context the frees are collective over each node (every rank closes), each wait
        bounded.  A failed context (:meth:`failure`) closes locally and never waits for a peer: its
        symmetric buffers are leaked, not freed (a dead peer would never join the collective free, and a
        live one may still map them); their device memory returns when the process exits.  A collective
        free that times out leaves the context failed, and the buffers left are leaked the same way.
        Idempotent; every op on a closed context raises :class:`~mkernel.MkernelError`.
        """
        if self._closed:
            return
        self._closed = True
        try:
            check(cu.cuCtxSynchronize())
        except Exception:
            pass
        failed = self.failure()
        for fn in list(self._closers):  # a closer removes itself; each is bounded by the timeout
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - e.g. a proxy whose peer is gone: the frees are skipped
                failed = failed or f"{type(exc).__name__}: {exc}"
        for st in self._op_states.values():
            st.clear()
        self._op_states.clear()
        for ws in list(self._symmetric):
            if failed is None and not ws.freed:
                try:
                    ws.free()
                except Exception as exc:  # noqa: BLE001 - the rest are leaked, never waited for
                    failed = str(exc)
            if failed is not None and not ws.freed:
                ws.abandon()
        self._workspaces.clear()
        self._ws_gen += 1
        done = (lambda r: None) if failed is not None else check  # a failed device may fail these too
        if self._side is not None:
            done(cu.cuStreamDestroy(self._side))
            self._side = None
        with self._record_lock:  # (a report in flight on the proxy's thread finishes first)
            done(cu.cuMemFreeHost(self._err_host))
        self.topology.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"Context(rank={self.rank}/{self.size}, node={self.node}/{self.num_nodes}, "
                f"local_rank={self.local_rank}/{self.local_size}, device={self.device}"
                f"{', emulated nodes' if self.emulated else ''})")


def init(comm=None, *, device: int | None = None, ranks_per_node: int | None = None,
         timeout: float | None = None) -> Context:
    """Create the per-rank :class:`Context` (collective over ``comm``).

    ``comm``: an mpi4py communicator (default ``MPI.COMM_WORLD``) or a bootstrap object with ``rank``,
    ``size``, ``allgather(bytes) -> list[bytes]`` and ``barrier()``
    (:class:`mkernel.dist.bootstrap.Bootstrap`).  ``device`` (or env ``MKERNEL_DEVICE``): this rank's GPU
    ordinal (default: the rank's index among the ranks of its host, modulo the GPUs visible).
    ``ranks_per_node`` (or env ``MKERNEL_RANKS_PER_NODE``) splits each host into emulated nodes;
    ``timeout`` (seconds, or env ``MKERNEL_TIMEOUT``, default 5) bounds every device-side wait.
    Raises :class:`~mkernel.DeviceError` without a usable driver or GPU, ValueError for a bad argument.
    """
    return Context(comm, device=device, ranks_per_node=ranks_per_node, timeout=timeout)
