"""MoE expert parallelism on one node, on the op pipeline (:mod:`mkernel.ops.base`): routing, dispatch,
combine, and the unfused layer.  Kernels: ``cuda_src/ops/moe.cu``; design: docs/moe.md.

Every rank of the context takes part (``ctx.num_nodes`` must be 1): P = ``ctx.local_size`` ranks, E
experts in all, ``E_local = E / P`` on each, global expert e on rank ``e // E_local``.  Every rank routes the
same number of tokens T.  No host synchronization anywhere: counts, offsets and row counts stay on the
device, so the whole sequence can be captured into a CUDA graph once a call of each shape has run.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

from cuda.bindings import driver as cu

from ...core.arrays import DeviceArray
from ...core.compiler import kernel, register_specialization
from ...core.driver import check
from ...core.interop import as_device_array, require
from ...core.util import ceil_div
from ..base import BoundCall, Op, as_stream, check_no_overlap, checked_once
from .layout import (EXCHANGE_THREADS, MAX_EXPERTS, MAX_K, SOURCE, SPECIALIZATIONS, THREADS, TILE, combine_layout,
                     dispatch_layout, kernel_defines, low_latency_grid, low_latency_layout, make_shape, node_meta_words,
                     route_layout)
from .options import LOW_LATENCY_MAX_TOKENS, MoeOptions

__all__ = ["MoeRouting", "MoePlan", "moe_route", "moe_dispatch", "moe_combine", "moe_options", "one_node",
           "routing_arg", "DATA_DTYPES", "ACROSS_NODES", "check_sizes", "DTYPE_CODES"]

for _d, _o, _l in SPECIALIZATIONS:
    register_specialization(SOURCE, {"MK_DTYPE": _d, "MK_OUT_DTYPE": _o, "MK_LOGIT_DTYPE": _l})

_DEFAULT = MoeOptions()
DTYPE_CODES = {"bfloat16": 0, "float16": 1, "float32": 2}
DATA_DTYPES = ("bfloat16", "float16", "float32")
LOGIT_DTYPES = ("bfloat16", "float32")


def moe_options(options, what: str) -> MoeOptions:
    o = _DEFAULT if options is None else options
    if o is not _DEFAULT:
        if not isinstance(o, MoeOptions):
            raise TypeError(f"{what}: options must be a MoeOptions, got {type(o).__name__}")
        checked_once(o)
    return o


def one_node(ctx, what: str) -> None:
    if ctx.num_nodes != 1:
        raise ValueError(f"{what}: expert parallelism across nodes is not implemented yet (this context has "
                         f"{ctx.num_nodes} nodes); docs/moe.md")


class MoeRouting:
    """The routing of one call and the dispatch map (device arrays, this rank's):

    * ``ids`` int32 ``[T, k]``: global expert of each choice; ``weights`` float32 ``[T, k]``;
    * ``slots`` int32 ``[T, k]``: row of pair (t, j) in the receive buffer of rank ``ids // E_local``
      (-1: dropped by a capacity);
    * ``expert_offsets`` int32 ``[E_local + 1]``: this rank's receive layout -- local expert l's rows are
      ``[o[l], o[l+1])`` of ``x_recv``; ``o[E_local]`` rows were received;
    * ``recv_map`` int32 ``[recv_rows]``: after :func:`moe_dispatch`, ``s * T * k + t * k + j`` of received
      row r (source rank s, its token t, choice j); rows past ``o[E_local]`` are not written;
    * ``src_offsets`` int32 ``[E_local, P + 1]``: where source rank s's rows of local expert l start (``[l][P]``:
      the expert's end), written by :func:`moe_route` (throughput mode): the fused dispatch + GEMM runs this
      rank's own rows first by it (docs/moe.md, "Dispatch + grouped GEMM, fused"), and across nodes the proxy
      moves those ranges back;
    * across nodes only (else None): ``send_ranges`` int32 ``[E, 2]``, the slot ranges the proxy moves
      (docs/moe.md, "Across nodes"); ``node_pos`` int32
      ``[T, N]`` and ``node_meta`` int32 ``[N, 1 + T * (1 + 3k)]``, written by a dispatch with
      ``MoeOptions(node_dedup=True)`` and read by its combine (docs/moe.md, "Node-level de-duplication");
      ``dispatched_by``: the transport of the last dispatch made with it ("node", "rank" or None).

    P is the world size (every rank of the context, on every node); global expert e is on world rank
    ``e // E_local``.

    ``T, k, E, P, E_local, capacity`` (0: none), ``recv_rows`` (rows of the receive buffer).  Make one with
    :meth:`empty` to reuse across calls (``out=``; needed inside CUDA-graph captures)."""

    def __init__(self, ctx, T: int, k: int, E: int, options: MoeOptions | None = None):
        opts = moe_options(options, "mkernel.MoeRouting")
        P = ctx.size
        self.T, self.k, self.E, self.P = int(T), int(k), int(E), P
        check_sizes("mkernel.MoeRouting", P, self.T, self.k, self.E)
        if opts.mode == "low_latency" and self.T > LOW_LATENCY_MAX_TOKENS:
            raise ValueError(f"mkernel.MoeRouting: low-latency mode takes at most {LOW_LATENCY_MAX_TOKENS} tokens per "
                             f"rank, got T={self.T}")
        shape = make_shape(P, self.T, 0, self.k, self.E, opts)
        self.E_local, self.capacity, self.recv_rows = shape.El, shape.capacity, shape.r_cap
        self.options = opts
        dev = ctx.device
        self.ids = DeviceArray.empty((T, k), "int32", device=dev)
        self.weights = DeviceArray.empty((T, k), "float32", device=dev)
        self.slots = DeviceArray.empty((T, k), "int32", device=dev)
        self.expert_offsets = DeviceArray.empty((self.E_local + 1,), "int32", device=dev)
        self.recv_map = DeviceArray.empty((self.recv_rows,), "int32", device=dev)
        # src_offsets [E_local, P + 1]: first row of each source's rows of each local expert (end last)
        self.src_offsets = DeviceArray.empty((self.E_local, P + 1), "int32", device=dev)
        # across nodes (docs/moe.md "Across nodes"): send_ranges [E, 2] (first row, rows) of this rank's pairs
        # of each expert in its owner's buffer, the contiguous slot ranges the proxy moves
        self.send_ranges = self.node_pos = self.node_meta = self.dispatched_by = None
        if ctx.num_nodes > 1:
            self.send_ranges = DeviceArray.empty((E, 2), "int32", device=dev)
            N = ctx.num_nodes
            self.node_pos = DeviceArray.empty((T, N), "int32", device=dev)
            self.node_meta = DeviceArray.empty((N, node_meta_words(self.T, self.k)), "int32", device=dev)

    @classmethod
    def empty(cls, ctx, T: int, k: int, num_experts: int, options: MoeOptions | None = None) -> "MoeRouting":
        """Buffers for the routing of ``T`` tokens, top-``k`` of ``num_experts``, under ``options``."""
        return cls(ctx, T, k, num_experts, options)

    @property
    def _key(self) -> tuple:
        return (self.T, self.k, self.E, self.P, self.capacity, self.recv_rows, self.options.softmax, self.options.mode,
                self.ids.device)

    def __repr__(self):
        return (f"MoeRouting(T={self.T}, k={self.k}, E={self.E}, P={self.P}, capacity={self.capacity}, "
                f"recv_rows={self.recv_rows})")


def check_sizes(what: str, P: int, T: int, k: int, E: int) -> None:
    if not 0 < E <= MAX_EXPERTS or E % P:
        raise ValueError(f"{what}: the number of experts ({E}) must be in [1, {MAX_EXPERTS}] and a multiple of the "
                         f"number of local ranks ({P})")
    if not 1 <= k <= min(MAX_K, E):
        raise ValueError(f"{what}: k ({k}) must be in [1, min({MAX_K}, experts={E})]")
    if T < 0 or P * T * k >= 2 ** 31:
        raise ValueError(f"{what}: T ({T}) must be >= 0 with P * T * k < 2**31")


@dataclass(frozen=True)
class MoePlan:
    """What a MoE call runs: ``op``, ``grid`` (blocks of the main kernel), ``recv_rows``; ``swiglu`` (moe_layer):
    "epilogue" (in the gate/up GEMM's epilogue) or "kernel" (the separate mk_moe_swiglu), (moe_dispatch_gemm)
    "epilogue" with ``swiglu=True``, else ""; ``transport`` (dispatch / combine across nodes): "node" (a row
    crosses the network once per destination node) or "rank" (once per destination rank), else ""; ``combine``
    (moe_layer): "fused" (the down GEMM and the combine as one kernel, :func:`mkernel.moe_gemm_combine`),
    "kernel" (the down grouped GEMM, then :func:`mkernel.moe_combine`) or "layer" (everything after the routing
    as one kernel: ``MoeOptions.one_kernel``; also the plan of that kernel's op, ``moe_ffn_fused``), else "";
    the rest is the bound call's (digest, workspace layout -- ``moe_ffn_fused``: the pair (dispatch, combine)
    -- and size)."""

    op: str
    grid: int = 0
    recv_rows: int = 0
    digest: int = field(default=0, repr=False)
    layout: object = field(default=None, repr=False, compare=False)
    ws_bytes: int = field(default=0, repr=False)
    swiglu: str = ""
    transport: str = ""
    combine: str = ""


def _ptr(v: int = 0):
    return ctypes.c_uint64(v)


def _memcpy(dst: int, src: int, n: int, stream: int) -> None:
    if n:
        check(cu.cuMemcpyAsync(cu.CUdeviceptr(dst), cu.CUdeviceptr(src), n, cu.CUstream(stream)))


def _copy_given(R: MoeRouting):
    """A bound call's ``pre``: the given ids / weights become the routing's own (kept for combine)."""
    n = R.T * R.k * 4

    def pre(stream, c):
        _memcpy(c.routing.ids.ptr, c.ids.ptr, n, stream)
        _memcpy(c.routing.weights.ptr, c.weights.ptr, n, stream)
    return pre


def _cooperative_grid(ctx, k, options: MoeOptions, what: str) -> int:
    if k.max_active_blocks_per_sm(THREADS) < 1:
        raise RuntimeError(f"{what}: the kernel cannot be resident")
    return max(1, min(ctx.sm_count, options.blocks or ctx.sm_count))


class _Launches(BoundCall):
    """Prepared launches; ``ptrs`` maps a call attribute path to the ctypes field re-pointed each call;
    ``pre(stream, call)`` runs first (copies)."""

    def __init__(self, plan, launches, ptrs, keep, pre=None, after=None):
        self.plan, self._launches, self._ptrs, self._keep, self._pre = plan, launches, ptrs, keep, pre
        self.after = after

    def run(self, stream, call):
        for fn, arg in self._ptrs:
            arg.value = fn(call)
        if self._pre is not None:
            self._pre(stream, call)
        for ln in self._launches:
            ln.submit()
        if self.after is not None:
            self.after(stream)


def routing_source(what: str, call, logits, topk_ids, topk_weights, stream) -> tuple:
    """Import a call's routing source -- logits, or topk_ids and topk_weights (one of the two) -- into
    ``call.logits`` / ``call.ids`` / ``call.weights``; returns its part of the bound-call key."""
    name = what.rsplit(".", 1)[-1]
    if logits is not None:
        if topk_ids is not None or topk_weights is not None:
            raise ValueError(f"{what}: pass logits or topk_ids / topk_weights, not both")
        lg = call.logits = as_device_array(logits, name=f"{name}: logits", stream=stream)
        call.ids = call.weights = None
        return (lg.dtype.name, lg.shape, lg.strides)
    if topk_ids is None or topk_weights is None:
        raise ValueError(f"{what}: pass logits, or topk_ids and topk_weights")
    call.logits = None
    I = call.ids = as_device_array(topk_ids, name=f"{name}: topk_ids", stream=stream)
    W = call.weights = as_device_array(topk_weights, name=f"{name}: topk_weights", stream=stream)
    return ("given", I.dtype.name, I.shape, I.strides, W.dtype.name, W.shape, W.strides)


class _Call:
    __slots__ = ("key", "stream", "logits", "ids", "weights", "routing", "x", "o", "options", "sig", "grid")


# --------------------------------------------------------------------------------------------
# routing
# --------------------------------------------------------------------------------------------
class _Route(Op):
    generation_keyed = True
    name = "moe_route"
    what = "mkernel.moe_route"

    def nodes(self, ctx):
        one_node(ctx, self.what)

    def __call__(self, ctx, logits, topk_ids, topk_weights, k, num_experts, out, stream, options):
        ctx.check()
        s = as_stream(stream)
        opts = moe_options(options, self.what)
        if opts.mode == "low_latency" or (isinstance(out, MoeRouting) and out.options.mode == "low_latency"):
            raise ValueError(f"{self.what}: low-latency mode routes inside mkernel.moe_dispatch (pass logits or "
                             f"topk_ids / topk_weights there)")
        call = _Call()
        call.stream, call.options = s, opts
        mode = routing_source(self.what, call, logits, topk_ids, topk_weights, s)
        if logits is not None:
            lg = call.logits
            if lg.ndim != 2:
                raise ValueError(f"{self.what}: logits must be [T, E], got shape {tuple(lg.shape)}")
            if k is None:
                raise ValueError(f"{self.what}: k is required with logits")
            T, E = lg.shape
            if num_experts is not None and num_experts != E:
                raise ValueError(f"{self.what}: num_experts={num_experts} but logits has {E} columns")
        else:
            if num_experts is None:
                raise ValueError(f"{self.what}: num_experts is required with topk_ids / topk_weights")
            I = call.ids
            if I.ndim != 2:
                raise ValueError(f"{self.what}: topk_ids must be [T, k], got shape {tuple(I.shape)}")
            T, kk = I.shape
            if k is not None and k != kk:
                raise ValueError(f"{self.what}: k={k} but topk_ids has {kk} columns")
            k, E = kk, int(num_experts)
        check_sizes(self.what, ctx.size, T, int(k), E)
        if out is None:
            out = MoeRouting(ctx, T, int(k), E, opts)
        elif not isinstance(out, MoeRouting):
            raise TypeError(f"{self.what}: out must be a MoeRouting, got {type(out).__name__}")
        call.routing = out
        call.key = (mode, T, int(k), E, out._key, s, opts, ctx.workspace_generation)
        self.invoke(ctx.op_state(self.name), call, ctx)
        return out

    def validate(self, ctx, call):
        self.nodes(ctx)
        R = call.routing
        if call.logits is not None:
            require(call.logits, f"{self.what}: logits", dtypes=LOGIT_DTYPES, device=ctx.device)
            T, E = call.logits.shape
            k = R.k
        else:
            require(call.ids, f"{self.what}: topk_ids", dtypes=("int32",), device=ctx.device)
            require(call.weights, f"{self.what}: topk_weights", dtypes=("float32",), device=ctx.device,
                    shape=tuple(call.ids.shape))
            (T, k), E = call.ids.shape, R.E
        if (R.T, R.k, R.E, R.P) != (T, k, E, ctx.size) or R.ids.device != ctx.device:
            raise ValueError(f"{self.what}: out is {R!r} on cuda:{R.ids.device}; this call needs T={T}, k={k}, "
                             f"E={E}, P={ctx.size} on cuda:{ctx.device}")
        if R.options != call.options:
            raise ValueError(f"{self.what}: out was made with other options ({R.options}) than this call's")

    def _kernels(self, call):
        d = kernel_defines(0, 0, DTYPE_CODES[call.logits.dtype.name] if call.logits is not None else 2)
        return [kernel(SOURCE, d, n) for n in ("mk_moe_route_tiles", "mk_moe_route_exchange", "mk_moe_route_slots")]

    def compile(self, ctx, call):
        self._kernels(call)

    def agree(self, ctx, call):
        R = call.routing
        src = call.logits.dtype.name if call.logits is not None else "given"
        return ctx.agree(self.what, (src, R.T, R.k, R.E, R.capacity, R.recv_rows, repr(call.options)), ctx.world)

    def describe_call(self, call):
        return repr(call.routing)

    def plan(self, ctx, call, digest):
        R = call.routing
        L, total = route_layout(ctx.local_size, R.T, R.E)
        return MoePlan(self.name, ceil_div(R.T, TILE), R.recv_rows, digest, L, total)

    def bind(self, ctx, call, p: MoePlan) -> BoundCall:
        R = call.routing
        tiles, _, slots = self._kernels(call)
        ws, keep, scratch_off = self.route_workspace(ctx, call, p)
        shape = make_shape(ctx.size, R.T, 0, R.k, R.E, call.options)
        tile_cnt = ws.ptr + scratch_off
        base = tile_cnt + ceil_div(R.T, TILE) * R.E * 4
        lg, ids, w, sl, offs = _ptr(), _ptr(), _ptr(), _ptr(), _ptr()
        ptrs = [(lambda c: c.logits.ptr if c.logits is not None else 0, lg), (lambda c: c.routing.ids.ptr, ids),
                (lambda c: c.routing.weights.ptr, w), (lambda c: c.routing.slots.ptr, sl),
                (lambda c: c.routing.expert_offsets.ptr, offs)]
        st = call.stream
        launches = []
        if R.T:
            launches.append(tiles.prepare(p.grid, TILE, [lg, ids, w, sl, _ptr(tile_cnt), shape], stream=st))
        launches.append(self.exchange_launch(ctx, call, p, ws, keep, [_ptr(tile_cnt), ctypes.c_int32(p.grid), offs,
                                                                      _ptr(base)], ptrs, shape))
        if R.T:
            g = max(1, min(ceil_div(R.T * R.k, 256), 8 * ctx.sm_count))
            launches.append(slots.prepare(g, 256, [ids, sl, _ptr(tile_cnt), _ptr(base), shape], stream=st))
        pre = _copy_given(R) if call.logits is None else None
        return _Launches(p, launches, ptrs, keep, pre)

    def route_workspace(self, ctx, call, p):
        """(workspace, what the bound call keeps alive, byte offset of the tile_cnt / base scratch)."""
        ws = ctx.workspace(("moe_route",), p.ws_bytes, call.stream, self.what)
        return ws, (ws,), p.layout.scratch_off

    def exchange_launch(self, ctx, call, p, ws, keep, mid, ptrs, shape):
        """The prepared launch of the count exchange; ``mid``: (tile_cnt, ntiles, expert_offsets, base)."""
        exch = self._kernels(call)[1]
        so = _ptr()
        ptrs.append((lambda c: c.routing.src_offsets.ptr, so))
        return exch.prepare(1, EXCHANGE_THREADS, [ctx.comm_args(self.name, p.digest)] + mid +
                            [so, _ptr(ws.ptr), _ptr(ws.peer_table), p.layout, shape], stream=call.stream)


# --------------------------------------------------------------------------------------------
# dispatch and combine
# --------------------------------------------------------------------------------------------
def routing_arg(what: str, routing, ctx) -> MoeRouting:
    if not isinstance(routing, MoeRouting):
        raise TypeError(f"{what}: routing must be the MoeRouting of mkernel.moe_route, got {type(routing).__name__}")
    if routing.P != ctx.size or routing.ids.device != ctx.device:
        raise ValueError(f"{what}: routing was made for {routing.P} ranks on cuda:{routing.ids.device}")
    return routing


class _Exchange(Op):
    """Dispatch and combine: one cooperative kernel each, same bound-call shape."""
    generation_keyed = True

    def __init__(self, name: str):
        self.name, self.what = name, "mkernel." + name

    def nodes(self, ctx):
        one_node(ctx, self.what)

    def __call__(self, ctx, x, routing, out, out_dtype, stream, options):
        ctx.check()
        s = as_stream(stream)
        opts = moe_options(options, self.what)
        R = routing_arg(self.what, routing, ctx)
        X = as_device_array(x, name=f"{self.name}: {self.x_name}", stream=s)
        if X.ndim != 2:
            raise ValueError(f"{self.what}: {self.x_name} must be 2-D, got shape {tuple(X.shape)}")
        H = X.shape[1]
        rows = R.T if self.name == "moe_combine" else R.recv_rows
        if out is None:
            od = out_dtype or X.dtype.name
            if od not in DATA_DTYPES:
                raise TypeError(f"{self.what}: out_dtype must be one of {DATA_DTYPES}, got {od!r}")
            O = result = DeviceArray.empty((rows, H), od, device=ctx.device)
        else:
            O = as_device_array(out, name=f"{self.name}: out", stream=s)
            result = out
        check_no_overlap(self.what, ((O, "out", X, self.x_name),))
        call = _Call()
        call.stream, call.x, call.o, call.routing, call.options = s, X, O, R, opts
        call.key = (X.shape, X.strides, X.dtype, X.device, O.shape, O.strides, O.dtype, O.device, O.readonly,
                    X.ptr % 16 == 0, O.ptr % 16 == 0, R._key, s, opts, ctx.workspace_generation)
        self.invoke(ctx.op_state(self.name), call, ctx)
        return result

    def validate(self, ctx, call):
        self.nodes(ctx)
        R, X, O = call.routing, call.x, call.o
        dts = DATA_DTYPES if self.name == "moe_dispatch" else ("bfloat16", "float16", "float32")
        rows_in = R.T if self.name == "moe_dispatch" else R.recv_rows
        require(X, f"{self.what}: {self.x_name}", dtypes=dts, device=ctx.device, shape=(rows_in, None), align=16)
        H = X.shape[1]
        if (H * X.dtype.itemsize) % 16:
            raise ValueError(f"{self.what}: rows of {self.x_name} must be a multiple of 16 bytes (H={H} "
                             f"{X.dtype.name})")
        rows_out = R.recv_rows if self.name == "moe_dispatch" else R.T
        require(O, f"{self.what}: out", device=ctx.device, shape=(rows_out, H), align=16, writable=True)
        if self.name == "moe_dispatch":
            if O.dtype != X.dtype:
                raise TypeError(f"{self.what}: out must be {X.dtype.name}, got {O.dtype.name}")
        elif O.dtype.name not in (X.dtype.name, "float32"):
            raise TypeError(f"{self.what}: out must be {X.dtype.name} or float32, got {O.dtype.name}")

    def _defines(self, call):
        if self.name == "moe_dispatch":
            return kernel_defines(0, 0, 2)
        return kernel_defines(DTYPE_CODES[call.x.dtype.name], DTYPE_CODES[call.o.dtype.name], 2)

    def compile(self, ctx, call):
        kernel(SOURCE, self._defines(call), "mk_" + self.name)

    def agree(self, ctx, call):
        R, X = call.routing, call.x
        return ctx.agree(self.what, (X.dtype.name, call.o.dtype.name, X.shape[1], R.T, R.k, R.E, R.recv_rows,
                                     R.capacity, repr(call.options), ctx.sm_count), ctx.world)

    def describe_call(self, call):
        return f"{call.x.dtype.name}{list(call.x.shape)} -> {call.o.dtype.name}{list(call.o.shape)} {call.routing!r}"

    def plan(self, ctx, call, digest):
        R, X = call.routing, call.x
        row_bytes = X.shape[1] * X.dtype.itemsize
        if self.name == "moe_dispatch":
            L, total = dispatch_layout(ctx.local_size, R.T, row_bytes, R.recv_rows)
        else:
            L, total = combine_layout(ctx.local_size, R.T, R.k, row_bytes)
        k = kernel(SOURCE, self._defines(call), "mk_" + self.name)
        return MoePlan(self.name, _cooperative_grid(ctx, k, call.options, self.what), R.recv_rows, digest, L, total)

    def bind(self, ctx, call, p: MoePlan) -> BoundCall:
        R = call.routing
        k = kernel(SOURCE, self._defines(call), "mk_" + self.name)
        ws = ctx.workspace((self.name,), p.ws_bytes, call.stream, self.what)
        shape = make_shape(ctx.local_size, R.T, call.x.shape[1], R.k, R.E, R.options)
        x, o, ids, w, sl, offs, rmap = (_ptr() for _ in range(7))
        ptrs = [(lambda c: c.x.ptr, x), (lambda c: c.o.ptr, o), (lambda c: c.routing.ids.ptr, ids),
                (lambda c: c.routing.weights.ptr, w), (lambda c: c.routing.slots.ptr, sl),
                (lambda c: c.routing.expert_offsets.ptr, offs), (lambda c: c.routing.recv_map.ptr, rmap)]
        tail = [_ptr(ws.ptr), _ptr(ws.peer_table), p.layout, shape]
        comm = ctx.comm_args(self.name, p.digest)
        if self.name == "moe_dispatch":
            args = [comm, x, ids, sl, offs, o, rmap] + tail
        else:
            args = [comm, x, ids, w, sl, offs, rmap, o] + tail
        launch = k.prepare(p.grid, THREADS, args, stream=call.stream, cooperative=True)
        return _Launches(p, [launch], ptrs, (ws,))


class _DispatchLowLatency(Op):
    """Low-latency mode: routing and dispatch in one cooperative kernel (mk_moe_dispatch_ll), buffers of
    fixed size (the routing's, made at creation), no host-side size anywhere (docs/moe.md)."""
    generation_keyed = True

    name = "moe_dispatch_ll"
    what = "mkernel.moe_dispatch"

    def __call__(self, ctx, x, routing, out, logits, topk_ids, topk_weights, stream, options):
        ctx.check()
        s = as_stream(stream)
        opts = moe_options(options, self.what)
        R = routing
        X = as_device_array(x, name="moe_dispatch: x", stream=s)
        if X.ndim != 2:
            raise ValueError(f"{self.what}: x must be 2-D, got shape {tuple(X.shape)}")
        O = result = DeviceArray.empty((R.recv_rows, X.shape[1]), X.dtype.name, device=ctx.device) if out is None \
            else as_device_array(out, name="moe_dispatch: out", stream=s)
        if out is not None:
            result = out
        call = _Call()
        call.stream, call.x, call.o, call.routing, call.options = s, X, O, R, opts
        if (logits is None) == (topk_ids is None and topk_weights is None):
            raise ValueError(f"{self.what}: low-latency mode routes here: pass logits, or topk_ids and topk_weights")
        src = routing_source(self.what, call, logits, topk_ids, topk_weights, s)
        check_no_overlap(self.what, ((O, "out", X, "x"),))
        call.key = (X.shape, X.strides, X.dtype, X.device, O.shape, O.strides, O.dtype, O.device, O.readonly,
                    X.ptr % 16 == 0, O.ptr % 16 == 0, src, R._key, s, opts, ctx.workspace_generation)
        self.invoke(ctx.op_state(self.name), call, ctx)
        return result

    def validate(self, ctx, call):
        one_node(ctx, self.what)
        R, X, O = call.routing, call.x, call.o
        if call.options != R.options:
            raise ValueError(f"{self.what}: the routing was made with other options ({R.options}) than this call's")
        require(X, f"{self.what}: x", dtypes=DATA_DTYPES, device=ctx.device, shape=(R.T, None), align=16)
        H = X.shape[1]
        if (H * X.dtype.itemsize) % 16:
            raise ValueError(f"{self.what}: rows of x must be a multiple of 16 bytes (H={H} {X.dtype.name})")
        require(O, f"{self.what}: out", dtypes=(X.dtype.name,), device=ctx.device, shape=(R.recv_rows, H), align=16,
                writable=True)
        if call.logits is not None:
            require(call.logits, f"{self.what}: logits", dtypes=LOGIT_DTYPES, device=ctx.device, shape=(R.T, R.E))
            if not call.logits.is_contiguous():
                raise ValueError(f"{self.what}: logits must be C-contiguous")
        else:
            require(call.ids, f"{self.what}: topk_ids", dtypes=("int32",), device=ctx.device, shape=(R.T, R.k))
            require(call.weights, f"{self.what}: topk_weights", dtypes=("float32",), device=ctx.device,
                    shape=(R.T, R.k))
            if not (call.ids.is_contiguous() and call.weights.is_contiguous()):
                raise ValueError(f"{self.what}: topk_ids and topk_weights must be C-contiguous")
        if ctx.resident_sms < ctx.local_size:
            raise RuntimeError(f"{self.what}: low-latency mode needs >= {ctx.local_size} SMs of this rank's share")

    def _kernel(self, call):
        lc = DTYPE_CODES[call.logits.dtype.name] if call.logits is not None else 2
        return kernel(SOURCE, kernel_defines(0, 0, lc), "mk_moe_dispatch_ll")

    def compile(self, ctx, call):
        if self._kernel(call).max_active_blocks_per_sm(THREADS) < 1:
            raise RuntimeError(f"{self.what}: the low-latency kernel cannot be resident")

    def agree(self, ctx, call):
        R, X = call.routing, call.x
        src = call.logits.dtype.name if call.logits is not None else "given"
        return ctx.agree(self.what, ("low_latency", src, X.dtype.name, X.shape[1], R.T, R.k, R.E, R.recv_rows,
                                     repr(call.options), ctx.resident_sms), ctx.world)

    def describe_call(self, call):
        return f"low-latency {call.x.dtype.name}{list(call.x.shape)} {call.routing!r}"

    def plan(self, ctx, call, digest):
        R, X = call.routing, call.x
        L, total = low_latency_layout(ctx.local_size, R.T, R.k, R.E, X.shape[1] * X.dtype.itemsize)
        g = low_latency_grid(ctx.local_size, R.T, ctx.resident_sms, call.options.blocks)
        return MoePlan(self.name, g, R.recv_rows, digest, L, total)

    def bind(self, ctx, call, p: MoePlan) -> BoundCall:
        R = call.routing
        k = self._kernel(call)
        ws = ctx.workspace((self.name,), p.ws_bytes, call.stream, self.what)
        shape = make_shape(ctx.local_size, R.T, call.x.shape[1], R.k, R.E, R.options)
        lg, x, ids, w, sl, offs, o, rmap = (_ptr() for _ in range(8))
        ptrs = [(lambda c: c.logits.ptr if c.logits is not None else 0, lg), (lambda c: c.x.ptr, x),
                (lambda c: c.routing.ids.ptr, ids), (lambda c: c.routing.weights.ptr, w),
                (lambda c: c.routing.slots.ptr, sl), (lambda c: c.routing.expert_offsets.ptr, offs),
                (lambda c: c.o.ptr, o), (lambda c: c.routing.recv_map.ptr, rmap)]
        args = [ctx.comm_args(self.name, p.digest), lg, x, ids, w, sl, offs, o, rmap, _ptr(ws.ptr),
                _ptr(ws.peer_table), p.layout, shape]
        launch = k.prepare(p.grid, THREADS, args, stream=call.stream, cooperative=True)
        pre = _copy_given(R) if call.logits is None else None
        return _Launches(p, [launch], ptrs, (ws,), pre)


class _Dispatch(_Exchange):
    x_name = "x"


class _Combine(_Exchange):
    x_name = "y_recv"


# The ops of the inter-node path (mkernel/ops/moe/internode.py fills this when the package is imported):
# "route", "dispatch", "combine" -> op objects taking the same arguments as the one-node ones.
ACROSS_NODES: dict = {}


def _across(ctx, what: str, default):
    return ACROSS_NODES[what] if ctx.num_nodes > 1 else default


_ROUTE = _Route()
_DISPATCH = _Dispatch("moe_dispatch")
_DISPATCH_LL = _DispatchLowLatency()
_COMBINE = _Combine("moe_combine")


def moe_route(ctx, logits=None, *, topk_ids=None, topk_weights=None, k: int | None = None,
              num_experts: int | None = None, out: MoeRouting | None = None, stream=None,
              options: MoeOptions | None = None) -> MoeRouting:
    """Route this rank's T tokens to the experts and lay out every rank's receive buffer, on the device.

    ``logits``: ``[T, E]`` bf16 or fp32 (C-contiguous); top-``k`` per token (ties: the lower expert), weights
    per ``options.softmax``.  Or ``topk_ids`` int32 ``[T, k]`` and ``topk_weights`` float32 ``[T, k]``
    (copied) with ``num_experts`` E.  E must be a multiple of ``P = ctx.local_size`` (E / P experts per
    rank) and at most 1024; ``k <= 32``; T the same on every rank.  The per-expert counts are exchanged
    between the ranks on the device (bounded waits); nothing is read on the host.  Returns a
    :class:`MoeRouting` (``out`` when given, from :meth:`MoeRouting.empty`)."""
    return _across(ctx, "route", _ROUTE)(ctx, logits, topk_ids, topk_weights, k, num_experts, out, stream, options)


def moe_dispatch(ctx, x, routing: MoeRouting, x_recv=None, *, logits=None, topk_ids=None, topk_weights=None,
                 stream=None, options: MoeOptions | None = None):
    """Send every token row once to each rank holding one of its experts; returns ``x_recv``.

    Low-latency mode (``routing`` made by :meth:`MoeRouting.empty` with ``MoeOptions(mode="low_latency")``,
    T <= 256, the same ``options`` here): this call also routes -- pass ``logits [T, E]`` (bf16 / fp32) or
    ``topk_ids`` int32 / ``topk_weights`` float32 ``[T, k]`` -- in one kernel, filling every field of
    ``routing`` as :func:`moe_route` would (the same slot order); CUDA-graph capturable after one call.

    ``x``: ``[T, H]`` bf16 / fp16 / fp32, C-contiguous, rows a multiple of 16 bytes; ``routing``: this call's
    :func:`moe_route` result.  ``x_recv``: ``[routing.recv_rows, H]`` of x's dtype (allocated when None):
    rows ``[o[l], o[l+1])`` (``o = routing.expert_offsets``, on the device) are local expert l's, grouped by
    source rank then token; rows past ``o[E_local]`` are not written.  Fills ``routing.recv_map``."""
    R = routing_arg("mkernel.moe_dispatch", routing, ctx)
    if R.options.mode == "low_latency":
        return _DISPATCH_LL(ctx, x, R, x_recv, logits, topk_ids, topk_weights, stream, options)
    if logits is not None or topk_ids is not None or topk_weights is not None:
        raise ValueError("mkernel.moe_dispatch: logits / topk_ids / topk_weights are for low-latency mode; in "
                         "throughput mode route with mkernel.moe_route first")
    return _across(ctx, "dispatch", _DISPATCH)(ctx, x, R, x_recv, None, stream, options)


def moe_combine(ctx, y_recv, routing: MoeRouting, out=None, *, out_dtype: str | None = None, stream=None,
                options: MoeOptions | None = None):
    """Return expert outputs to their tokens' owners and sum them: ``out[t] = sum_j weights[t, j] * y(t, j)``.

    ``y_recv``: ``[routing.recv_rows, H]`` bf16 / fp16 / fp32 in the receive order of the
    :func:`moe_dispatch` that used ``routing``; ``out``: ``[T, H]`` of y's dtype or float32 (allocated when
    None, ``out_dtype``).  The sum runs in fp32 in j order (bit-reproducible, no atomics); dropped pairs add
    nothing.  Returns ``out``."""
    return _across(ctx, "combine", _COMBINE)(ctx, y_recv, routing, out, out_dtype, stream, options)
