"""Collectives across nodes: NVLink inside a node, the CPU proxy (RDMA or TCP) across nodes.

Hierarchical and rail-aligned: across nodes every rank exchanges data only with the ranks of the
same local index on the other nodes, then NVLink spreads it inside the node; each kernel is one
persistent, cooperative launch (``cuda_src/internode.cu``) that pushes commands to this rank's
proxy (``mkernel/proxy.py``).  Used by :func:`mkernel.all_gather` / ``reduce_scatter`` /
``all_reduce`` when the context has more than one node (real, or emulated with
``MKERNEL_RANKS_PER_NODE``); ranks must be node-major (world rank = node * L + local rank) with the
same number of ranks L on every node, which ``mpirun``'s default by-slot mapping gives.

Every call is checked on the device against the agreed signature: each rank announces ``(call, digest)``
to the ranks that read what it writes, and a slot is read only after its writer's announcement matched
(:class:`mkernel.CommMismatch` otherwise; docs/internode.md, "Call signatures").

No host synchronization between calls; every wait (NVLink flags, proxy ring room, proxy completion)
is under the context timeout; a dead remote rank gives :class:`mkernel.CommTimeout` naming it.
"""
from __future__ import annotations

import ctypes

from cuda.bindings import driver as cu

from ...core.arrays import DeviceArray
from ...core.compiler import kernel, register_specialization
from ...core.driver import check
from ...core.frees import mark_proxy_launch
from ...core.streams import is_capturing, stream_handle
from ...core.util import round_up
from ...dist.signals import MK_ERR_PROXY
from ...errors import CommError

__all__ = ["all_gather", "reduce_scatter", "all_reduce", "InterLayout", "check_layout", "layout", "call_word",
           "call_offset", "ProxyState", "proxy_state"]

_SOURCE = "ops/internode.cu"
_THREADS = 512
GRID = 32  # blocks per call; fixed per context (the grid barrier counts arrivals across calls)

for _code in (0, 1, 2):
    register_specialization(_SOURCE, {"MK_DTYPE": _code})


class InterLayout(ctypes.Structure):
    """``struct InterLayout`` of ``cuda_src/ops/internode.cu`` (byte offsets in the op's workspace)."""

    _fields_ = [("consumed_off", ctypes.c_uint64), ("calls_off", ctypes.c_uint64), ("ready_off", ctypes.c_uint64),
                ("data_off", ctypes.c_uint64), ("slot_bytes", ctypes.c_uint64), ("L", ctypes.c_int32),
                ("N", ctypes.c_int32)]


def call_word(epoch: int, sig: int) -> int:
    """The u64 world rank r writes into every reader's ``calls[r][epoch & 1]`` when it starts call ``epoch``
    of signature ``sig`` (``inter_call_word`` in internode.cu): the call number in the high half, so a
    waiter for ``>= epoch << 32`` waits for the announcement, the signature in the low half."""
    return ((int(epoch) & 0xFFFFFFFF) << 32) | (int(sig) & 0xFFFFFFFF)


def call_offset(Lo: InterLayout, rank: int, epoch: int) -> int:
    """Byte offset of world rank ``rank``'s announcement of call ``epoch`` in a reader's workspace."""
    return Lo.calls_off + 16 * rank + 8 * (epoch & 1)


def check_layout(ctx) -> None:
    """Node-major ranks, the same count on every node (what the kernels assume)."""
    L, N = ctx.local_size, ctx.num_nodes
    ok = ctx.size == L * N and list(ctx.node_of_rank) == [r // L for r in range(ctx.size)]
    if not ok:
        raise ValueError(f"mkernel: multi-node collectives need node-major ranks with the same number of ranks on "
                         f"every node (world rank = node*L + local rank); this job has nodes {ctx.node_of_rank}")


def layout(L: int, N: int, nslots: int, nflags: int, slot_bytes: int) -> tuple[InterLayout, int]:
    """(layout, workspace bytes) for L ranks per node, N nodes, ``nslots`` slots of ``slot_bytes`` and
    ``nflags`` ready flags.  Every control offset depends on L, N and the op's flag count only (the
    workspace serves every call of the op, whatever its size: docs/design.md, "Control words never move")."""
    P = L * N
    Lo = InterLayout()
    Lo.consumed_off = 128
    Lo.calls_off = Lo.consumed_off + 8 * P
    Lo.ready_off = round_up(Lo.calls_off + 16 * P, 256)
    Lo.data_off = round_up(Lo.ready_off + 8 * nflags, 4096)
    Lo.slot_bytes = round_up(max(slot_bytes, 16), 256)
    Lo.L, Lo.N = L, N
    return Lo, Lo.data_off + nslots * Lo.slot_bytes


def _layout(ctx, nslots: int, nflags: int, slot_bytes: int) -> tuple[InterLayout, int]:
    return layout(ctx.local_size, ctx.num_nodes, nslots, nflags, slot_bytes)


class ProxyState:
    """Workspace + proxy of one op on one context (re-made together when the workspace must grow)."""

    def __init__(self, ctx, op: str, nbytes: int):
        from ...proxy import Proxy
        from ...proxy.transport.window import GpuWindow

        self.ws = ctx.workspace(("internode", op), nbytes)
        self.window = GpuWindow(self.ws.ptr, self.ws.nbytes)

        try:
            self.proxy = Proxy(ctx.world, [self.window], ring_capacity=1024, timeout=ctx.timeout,
                               on_error=lambda exc: ctx.report_host_failure(MK_ERR_PROXY))
        except CommError as exc:
            # a failed set-up may leave MPI requests on the world communicator behind: the context has
            # failed (every later op raises the cause, close() is local)
            def failed(exc=exc):
                raise exc
            ctx.add_check(failed)
            ctx.report_host_failure(MK_ERR_PROXY)
            raise
        self.proxy.start()
        self.ctx = ctx
        ctx.add_closer(self.close)
        ctx.add_check(self.proxy.check)
        self.closed = False

    def close(self):
        if not self.closed:
            self.closed = True
            self.ctx.remove_closer(self.close)
            self.ctx.remove_check(self.proxy.check)
            self.proxy.close()


def proxy_state(ctx, op: str, nbytes: int, stream=None) -> ProxyState:
    """The workspace of inter-node ``op`` (at least ``nbytes``, zeroed when made) registered as window 0 of
    the op's own proxy; re-made (collectively, after a device sync) when it must grow.  Every rank calls it
    at the same call (the op's agreed sizes).  Making it synchronizes the device, which a CUDA-graph capture
    forbids: while ``stream`` (the op's stream) is being captured that raises a RuntimeError first."""
    data = ctx.op_state("internode_" + op).data
    st = data.get("proxy")
    if st is not None and st.ws.nbytes >= nbytes and not st.closed:
        return st
    if stream is not None and is_capturing(stream):
        raise RuntimeError(
            f"{op} across nodes: this call needs a larger workspace and proxy ({nbytes} bytes; a collective "
            "set-up that synchronizes the device), which cannot be made while its stream is being captured "
            "into a CUDA graph: make one call of this size (or larger) before capturing")
    if st is not None:
        ctx.synchronize()
        st.close()
    st = data["proxy"] = ProxyState(ctx, op, nbytes)
    return st


def _kernel(op: str, dtype_code: int):
    return kernel(_SOURCE, {"MK_DTYPE": dtype_code}, op)


def compile_for(op: str, dtype) -> None:
    """Compile (or load) the kernels of inter-node ``op`` for ``dtype`` (before the ranks agree)."""
    if op in ("all_gather", "all_reduce"):
        _kernel("mk_inter_all_gather", 0)
    if op in ("reduce_scatter", "all_reduce"):
        _kernel("mk_inter_reduce_scatter", dtype.code)


def _grid(ctx) -> int:
    return min(GRID, ctx.resident_sms)


def all_gather(ctx, x: DeviceArray, o: DeviceArray, stream, sig: int = 0) -> None:
    """``o`` (``[P*n, ...]``) = every world rank's ``x`` (``[n, ...]``) in world-rank order.  ``sig``: the
    agreed call's digest (``ctx.agree``), compared with every sender's before its data is read."""
    check_layout(ctx)
    P = ctx.size
    Lo, total = _layout(ctx, P, P, x.nbytes)
    st = proxy_state(ctx, "all_gather", total, stream)
    k = _kernel("mk_inter_all_gather", 0)
    args = [ctx.comm_args("internode_all_gather", sig), st.proxy.ring_device_struct(), ctypes.c_uint64(x.ptr),
            ctypes.c_uint64(o.ptr), ctypes.c_uint64(x.nbytes), ctypes.c_uint64(st.ws.ptr),
            ctypes.c_uint64(st.ws.peer_table), Lo]
    k.launch(_grid(ctx), _THREADS, args, stream=stream, cooperative=True)
    mark_proxy_launch(stream_handle(stream))


def reduce_scatter(ctx, x: DeviceArray, o: DeviceArray, stream, sig: int = 0) -> None:
    """``o`` (``[n, ...]``) on world rank r = sum over world ranks of ``x[r*n:(r+1)*n]``.  ``sig``: as
    :func:`all_gather`."""
    check_layout(ctx)
    L, N = ctx.local_size, ctx.num_nodes
    n = o.size
    Lo, total = _layout(ctx, L * N + 2 * N, L * N + N, n * x.dtype.itemsize)
    st = proxy_state(ctx, "reduce_scatter", total, stream)
    k = _kernel("mk_inter_reduce_scatter", x.dtype.code)
    args = [ctx.comm_args("internode_reduce_scatter", sig), st.proxy.ring_device_struct(), ctypes.c_uint64(x.ptr),
            ctypes.c_uint64(o.ptr), ctypes.c_uint64(n), ctypes.c_uint64(st.ws.ptr),
            ctypes.c_uint64(st.ws.peer_table), Lo]
    k.launch(_grid(ctx), _THREADS, args, stream=stream, cooperative=True)
    mark_proxy_launch(stream_handle(stream))


class _ARBuffers:
    def __init__(self, n_pad: int, P: int, dtype):
        self.inp = DeviceArray.empty((n_pad,), dtype)
        self.mid = DeviceArray.empty((n_pad // P,), dtype)
        self.out = DeviceArray.empty((n_pad,), dtype)


def all_reduce(ctx, x: DeviceArray, o: DeviceArray, stream, sig: int = 0) -> None:
    """``o`` = sum over world ranks of ``x``: reduce-scatter then all-gather, both hierarchical.

    Sizes that are not a multiple of the world size go through padded buffers cached per size
    (async copies on ``stream``: graph-capturable)."""
    P = ctx.size
    n = x.size
    isz = x.dtype.itemsize
    chunk = round_up(-(-n // P), max(1, 16 // isz))
    n_pad = chunk * P
    s = cu.CUstream(stream_handle(stream))
    bufs = ctx.op_state("internode_all_reduce").data
    key = (n_pad, x.dtype.name)
    b = bufs.get(key)
    if b is None:
        b = bufs[key] = _ARBuffers(n_pad, P, x.dtype)
    check(cu.cuMemcpyDtoDAsync(b.inp.ptr, x.ptr, n * isz, s))
    if n_pad > n:
        check(cu.cuMemsetD8Async(b.inp.ptr + n * isz, 0, (n_pad - n) * isz, s))
    reduce_scatter(ctx, b.inp, b.mid, stream, sig)
    all_gather(ctx, b.mid, b.out, stream, sig)
    check(cu.cuMemcpyDtoDAsync(o.ptr, b.out.ptr, n * isz, s))
