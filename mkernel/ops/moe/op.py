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
from ..gemm import grouped_gemm
from .layout import (EXCHANGE_THREADS, MAX_EXPERTS, MAX_K, SOURCE, SPECIALIZATIONS, THREADS, TILE, combine_layout,
                     dispatch_layout, kernel_defines, make_shape, route_layout)
from .options import MoeOptions

__all__ = ["MoeRouting", "MoePlan", "moe_route", "moe_dispatch", "moe_combine", "moe_layer"]

for _d, _o, _l in SPECIALIZATIONS:
    register_specialization(SOURCE, {"MK_DTYPE": _d, "MK_OUT_DTYPE": _o, "MK_LOGIT_DTYPE": _l})

_DEFAULT = MoeOptions()
_CODES = {"bfloat16": 0, "float16": 1, "float32": 2}
DATA_DTYPES = ("bfloat16", "float16", "float32")
LOGIT_DTYPES = ("bfloat16", "float32")


def _options(options, what: str) -> MoeOptions:
    o = _DEFAULT if options is None else options
    if o is not _DEFAULT:
        if not isinstance(o, MoeOptions):
            raise TypeError(f"{what}: options must be a MoeOptions, got {type(o).__name__}")
        checked_once(o)
    return o


def _one_node(ctx, what: str) -> None:
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
      row r (source rank s, its token t, choice j); rows past ``o[E_local]`` are not written.

    ``T, k, E, P, E_local, capacity`` (0: none), ``recv_rows`` (rows of the receive buffer).  Make one with
    :meth:`empty` to reuse across calls (``out=``; needed inside CUDA-graph captures)."""

    def __init__(self, ctx, T: int, k: int, E: int, options: MoeOptions | None = None):
        opts = _options(options, "mkernel.MoeRouting")
        P = ctx.local_size
        self.T, self.k, self.E, self.P = int(T), int(k), int(E), P
        _check_sizes("mkernel.MoeRouting", P, self.T, self.k, self.E)
        shape = make_shape(P, self.T, 0, self.k, self.E, opts)
        self.E_local, self.capacity, self.recv_rows = shape.El, shape.capacity, shape.r_cap
        self.options = opts
        dev = ctx.device
        self.ids = DeviceArray.empty((T, k), "int32", device=dev)
        self.weights = DeviceArray.empty((T, k), "float32", device=dev)
        self.slots = DeviceArray.empty((T, k), "int32", device=dev)
        self.expert_offsets = DeviceArray.empty((self.E_local + 1,), "int32", device=dev)
        self.recv_map = DeviceArray.empty((self.recv_rows,), "int32", device=dev)

    @classmethod
    def empty(cls, ctx, T: int, k: int, num_experts: int, options: MoeOptions | None = None) -> "MoeRouting":
        """Buffers for the routing of ``T`` tokens, top-``k`` of ``num_experts``, under ``options``."""
        return cls(ctx, T, k, num_experts, options)

    @property
    def _key(self) -> tuple:
        return (self.T, self.k, self.E, self.P, self.capacity, self.recv_rows, self.options.softmax, self.ids.device)

    def __repr__(self):
        return (f"MoeRouting(T={self.T}, k={self.k}, E={self.E}, P={self.P}, capacity={self.capacity}, "
                f"recv_rows={self.recv_rows})")


def _check_sizes(what: str, P: int, T: int, k: int, E: int) -> None:
    if not 0 < E <= MAX_EXPERTS or E % P:
        raise ValueError(f"{what}: the number of experts ({E}) must be in [1, {MAX_EXPERTS}] and a multiple of the "
                         f"number of local ranks ({P})")
    if not 1 <= k <= min(MAX_K, E):
        raise ValueError(f"{what}: k ({k}) must be in [1, min({MAX_K}, experts={E})]")
    if T < 0 or P * T * k >= 2 ** 31:
        raise ValueError(f"{what}: T ({T}) must be >= 0 with P * T * k < 2**31")


@dataclass(frozen=True)
class MoePlan:
    """What a MoE call runs: ``op``, ``grid`` (blocks of the main kernel), ``recv_rows``; the rest is the
    bound call's (digest, workspace layout and size)."""

    op: str
    grid: int = 0
    recv_rows: int = 0
    digest: int = field(default=0, repr=False)
    layout: object = field(default=None, repr=False, compare=False)
    ws_bytes: int = field(default=0, repr=False)


def _ptr(v: int = 0):
    return ctypes.c_uint64(v)


def _memcpy(dst: int, src: int, n: int, stream: int) -> None:
    if n:
        check(cu.cuMemcpyAsync(cu.CUdeviceptr(dst), cu.CUdeviceptr(src), n, cu.CUstream(stream)))


def _cooperative_grid(ctx, k, options: MoeOptions, what: str) -> int:
    if k.max_active_blocks_per_sm(THREADS) < 1:
        raise RuntimeError(f"{what}: the kernel cannot be resident")
    return max(1, min(ctx.sm_count, options.blocks or ctx.sm_count))


class _Launches(BoundCall):
    """Prepared launches; ``ptrs`` maps a call attribute path to the ctypes field re-pointed each call;
    ``pre(stream, call)`` runs first (copies)."""

    def __init__(self, plan, launches, ptrs, keep, pre=None):
        self.plan, self._launches, self._ptrs, self._keep, self._pre = plan, launches, ptrs, keep, pre

    def run(self, stream, call):
        for fn, arg in self._ptrs:
            arg.value = fn(call)
        if self._pre is not None:
            self._pre(stream, call)
        for ln in self._launches:
            ln.submit()


class _Call:
    __slots__ = ("key", "stream", "logits", "ids", "weights", "routing", "x", "o", "options", "sig")


# --------------------------------------------------------------------------------------------
# routing
# --------------------------------------------------------------------------------------------
class _Route(Op):
    generation_keyed = True
    name = "moe_route"
    what = "mkernel.moe_route"

    def __call__(self, ctx, logits, topk_ids, topk_weights, k, num_experts, out, stream, options):
        ctx.check()
        s = as_stream(stream)
        opts = _options(options, self.what)
        call = _Call()
        call.stream, call.options = s, opts
        if logits is not None:
            if topk_ids is not None or topk_weights is not None:
                raise ValueError(f"{self.what}: pass logits or topk_ids / topk_weights, not both")
            lg = call.logits = as_device_array(logits, name="moe_route: logits", stream=s)
            if lg.ndim != 2:
                raise ValueError(f"{self.what}: logits must be [T, E], got shape {tuple(lg.shape)}")
            if k is None:
                raise ValueError(f"{self.what}: k is required with logits")
            T, E = lg.shape
            if num_experts is not None and num_experts != E:
                raise ValueError(f"{self.what}: num_experts={num_experts} but logits has {E} columns")
            call.ids = call.weights = None
            mode = (lg.dtype.name, lg.strides)
        else:
            if topk_ids is None or topk_weights is None or num_experts is None:
                raise ValueError(f"{self.what}: pass logits (and k), or topk_ids, topk_weights and num_experts")
            call.logits = None
            I = call.ids = as_device_array(topk_ids, name="moe_route: topk_ids", stream=s)
            W = call.weights = as_device_array(topk_weights, name="moe_route: topk_weights", stream=s)
            if I.ndim != 2:
                raise ValueError(f"{self.what}: topk_ids must be [T, k], got shape {tuple(I.shape)}")
            T, kk = I.shape
            if k is not None and k != kk:
                raise ValueError(f"{self.what}: k={k} but topk_ids has {kk} columns")
            k, E = kk, int(num_experts)
            mode = ("given", I.dtype.name, I.shape, I.strides, W.dtype.name, W.shape, W.strides)
        _check_sizes(self.what, ctx.local_size, T, int(k), E)
        if out is None:
            out = MoeRouting(ctx, T, int(k), E, opts)
        elif not isinstance(out, MoeRouting):
            raise TypeError(f"{self.what}: out must be a MoeRouting, got {type(out).__name__}")
        call.routing = out
        call.key = (mode, T, int(k), E, out._key, s, opts, ctx.workspace_generation)
        self.invoke(ctx.op_state(self.name), call, ctx)
        return out

    def validate(self, ctx, call):
        _one_node(ctx, self.what)
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
        if (R.T, R.k, R.E, R.P) != (T, k, E, ctx.local_size) or R.ids.device != ctx.device:
            raise ValueError(f"{self.what}: out is {R!r} on cuda:{R.ids.device}; this call needs T={T}, k={k}, "
                             f"E={E}, P={ctx.local_size} on cuda:{ctx.device}")
        if R.options != call.options:
            raise ValueError(f"{self.what}: out was made with other options ({R.options}) than this call's")

    def _kernels(self, call):
        d = kernel_defines(0, 0, _CODES[call.logits.dtype.name] if call.logits is not None else 2)
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
        tiles, exch, slots = self._kernels(call)
        ws = ctx.workspace(("moe_route",), p.ws_bytes, call.stream, self.what)
        L = p.layout
        shape = make_shape(ctx.local_size, R.T, 0, R.k, R.E, call.options)
        tile_cnt = ws.ptr + L.scratch_off
        base = tile_cnt + ceil_div(R.T, TILE) * R.E * 4
        lg, ids, w, sl, offs = _ptr(), _ptr(), _ptr(), _ptr(), _ptr()
        ptrs = [(lambda c: c.logits.ptr if c.logits is not None else 0, lg), (lambda c: c.routing.ids.ptr, ids),
                (lambda c: c.routing.weights.ptr, w), (lambda c: c.routing.slots.ptr, sl),
                (lambda c: c.routing.expert_offsets.ptr, offs)]
        st = call.stream
        launches = []
        if R.T:
            launches.append(tiles.prepare(p.grid, TILE, [lg, ids, w, sl, _ptr(tile_cnt), shape], stream=st))
        launches.append(exch.prepare(1, EXCHANGE_THREADS, [ctx.comm_args(self.name, p.digest), _ptr(tile_cnt),
                                                            ctypes.c_int32(p.grid), offs, _ptr(base), _ptr(ws.ptr),
                                                            _ptr(ws.peer_table), L, shape], stream=st))
        if R.T:
            g = max(1, min(ceil_div(R.T * R.k, 256), 8 * ctx.sm_count))
            launches.append(slots.prepare(g, 256, [ids, sl, _ptr(tile_cnt), _ptr(base), shape], stream=st))
        pre = None
        if call.logits is None:
            n = R.T * R.k * 4

            def pre(stream, c):  # the given ids / weights become the routing's own (kept for combine)
                _memcpy(c.routing.ids.ptr, c.ids.ptr, n, stream)
                _memcpy(c.routing.weights.ptr, c.weights.ptr, n, stream)
        return _Launches(p, launches, ptrs, (ws,), pre)


# --------------------------------------------------------------------------------------------
# dispatch and combine
# --------------------------------------------------------------------------------------------
def _routing_arg(what: str, routing, ctx) -> MoeRouting:
    if not isinstance(routing, MoeRouting):
        raise TypeError(f"{what}: routing must be the MoeRouting of mkernel.moe_route, got {type(routing).__name__}")
    if routing.P != ctx.local_size or routing.ids.device != ctx.device:
        raise ValueError(f"{what}: routing was made for {routing.P} ranks on cuda:{routing.ids.device}")
    return routing


class _Exchange(Op):
    """Dispatch and combine: one cooperative kernel each, same bound-call shape."""
    generation_keyed = True

    def __init__(self, name: str):
        self.name, self.what = name, "mkernel." + name

    def __call__(self, ctx, x, routing, out, out_dtype, stream, options):
        ctx.check()
        s = as_stream(stream)
        opts = _options(options, self.what)
        R = _routing_arg(self.what, routing, ctx)
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
        _one_node(ctx, self.what)
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
        return kernel_defines(_CODES[call.x.dtype.name], _CODES[call.o.dtype.name], 2)

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


class _Dispatch(_Exchange):
    x_name = "x"


class _Combine(_Exchange):
    x_name = "y_recv"


# --------------------------------------------------------------------------------------------
# the layer (unfused composition)
# --------------------------------------------------------------------------------------------
class _LayerBound(BoundCall):
    """route -> dispatch -> grouped GEMM (gate/up) -> SwiGLU -> grouped GEMM (down) -> combine on one stream;
    the intermediate buffers belong to this bound call."""

    def __init__(self, ctx, call, plan):
        self.plan, self._ctx = plan, ctx
        X = call.x
        T, H = X.shape
        wg, wd = call.sig
        El, F2 = wg.shape[0], wg.shape[1]
        F = F2 // 2
        dev, dt = ctx.device, X.dtype.name
        self.routing = MoeRouting(ctx, T, call.routing.k, call.routing.E, call.options)
        rr = self.routing.recv_rows
        self._x_recv = DeviceArray.empty((rr, H), dt, device=dev)
        self._h = DeviceArray.empty((rr, F2), dt, device=dev)
        self._act = DeviceArray.empty((rr, F), dt, device=dev)
        self._y = DeviceArray.empty((rr, H), dt, device=dev)
        self.buffers = (self._x_recv, self._h, self._act, self._y)
        c = _CODES[dt]
        sw = kernel(SOURCE, kernel_defines(c, c, 2), "mk_moe_swiglu")
        self._h_arg, self._a_arg = _ptr(self._h.ptr), _ptr(self._act.ptr)
        rows = self.routing.expert_offsets.ptr + 4 * El
        g = max(1, min(ceil_div(rr * F // 8, 256), 8 * ctx.sm_count))
        self._swiglu = sw.prepare(g, 256, [self._h_arg, self._a_arg, _ptr(rows), ctypes.c_int32(rr),
                                           ctypes.c_int32(F)], stream=call.stream)

    def run(self, stream, call):
        ctx, R, opts = self._ctx, self.routing, call.options
        if call.logits is not None:
            moe_route(ctx, call.logits, k=R.k, out=R, stream=stream, options=opts)
        else:
            moe_route(ctx, topk_ids=call.ids, topk_weights=call.weights, num_experts=R.E, out=R, stream=stream,
                      options=opts)
        moe_dispatch(ctx, call.x, R, self._x_recv, stream=stream, options=opts)
        wg, wd = call.sig
        grouped_gemm(self._x_recv, wg, R.expert_offsets, out=self._h, b_layout="nk", stream=stream)
        self._swiglu.submit()
        grouped_gemm(self._act, wd, R.expert_offsets, out=self._y, b_layout="nk", stream=stream)
        moe_combine(ctx, self._y, R, call.o, stream=stream, options=opts)


@dataclass(frozen=True)
class _RoutingSpec:
    k: int
    E: int


class _Layer(Op):
    generation_keyed = True
    name = "moe_layer"
    what = "mkernel.moe_layer"

    def __call__(self, ctx, x, w_gate_up, w_down, logits, topk_ids, topk_weights, k, out, stream, options):
        ctx.check()
        s = as_stream(stream)
        opts = _options(options, self.what)
        X = as_device_array(x, name="moe_layer: x", stream=s)
        WG = as_device_array(w_gate_up, name="moe_layer: w_gate_up", stream=s)
        WD = as_device_array(w_down, name="moe_layer: w_down", stream=s)
        call = _Call()
        call.stream, call.x, call.options, call.sig = s, X, opts, (WG, WD)
        if WG.ndim != 3:
            raise ValueError(f"{self.what}: w_gate_up must be [E_local, 2F, H], got shape {tuple(WG.shape)}")
        E = WG.shape[0] * ctx.local_size
        if logits is not None:
            call.logits = as_device_array(logits, name="moe_layer: logits", stream=s)
            call.ids = call.weights = None
            if k is None:
                raise ValueError(f"{self.what}: k is required with logits")
            src = (call.logits.dtype, call.logits.shape, call.logits.strides)
        else:
            if topk_ids is None or topk_weights is None:
                raise ValueError(f"{self.what}: pass logits (and k), or topk_ids and topk_weights")
            call.logits = None
            call.ids = as_device_array(topk_ids, name="moe_layer: topk_ids", stream=s)
            call.weights = as_device_array(topk_weights, name="moe_layer: topk_weights", stream=s)
            if call.ids.ndim != 2:
                raise ValueError(f"{self.what}: topk_ids must be [T, k], got shape {tuple(call.ids.shape)}")
            k = call.ids.shape[1]
            src = ("given", call.ids.shape)
        call.routing = _RoutingSpec(int(k), E)
        T = X.shape[0] if X.ndim == 2 else 0
        if out is None:
            O = result = DeviceArray.empty((T, X.shape[-1]), X.dtype, device=ctx.device)
        else:
            O = as_device_array(out, name="moe_layer: out", stream=s)
            result = out
        call.o = O
        call.key = (X.shape, X.strides, X.dtype, WG.shape, WG.strides, WG.dtype, WD.shape, WD.strides, WD.dtype,
                    O.shape, O.dtype, src, int(k), s, opts, ctx.workspace_generation)
        bound = self.invoke(ctx.op_state(self.name), call, ctx)
        return result, bound.routing

    def validate(self, ctx, call):
        _one_node(ctx, self.what)
        X, (WG, WD) = call.x, call.sig
        require(X, f"{self.what}: x", dtypes=("bfloat16", "float16"), ndim=2, device=ctx.device)
        T, H = X.shape
        El, F2 = WG.shape[0], WG.shape[1]
        require(WG, f"{self.what}: w_gate_up", dtypes=(X.dtype.name,), shape=(El, F2, H), device=ctx.device)
        if F2 % 16 or F2 == 0:
            raise ValueError(f"{self.what}: w_gate_up's second dim (2F = {F2}) must be a positive multiple of 16")
        require(WD, f"{self.what}: w_down", dtypes=(X.dtype.name,), shape=(El, H, F2 // 2), device=ctx.device)
        _check_sizes(self.what, ctx.local_size, T, call.routing.k, call.routing.E)

    def plan(self, ctx, call, digest):
        return MoePlan(self.name)

    def describe_call(self, call):
        return f"x {call.x.dtype.name}{list(call.x.shape)} w_gate_up {list(call.sig[0].shape)} k={call.routing.k}"

    def bind(self, ctx, call, plan):
        return _LayerBound(ctx, call, plan)


_ROUTE = _Route()
_DISPATCH = _Dispatch("moe_dispatch")
_COMBINE = _Combine("moe_combine")
_LAYER = _Layer()


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
    return _ROUTE(ctx, logits, topk_ids, topk_weights, k, num_experts, out, stream, options)


def moe_dispatch(ctx, x, routing: MoeRouting, x_recv=None, *, stream=None, options: MoeOptions | None = None):
    """Send every token row once to each rank holding one of its experts; returns ``x_recv``.

    ``x``: ``[T, H]`` bf16 / fp16 / fp32, C-contiguous, rows a multiple of 16 bytes; ``routing``: this call's
    :func:`moe_route` result.  ``x_recv``: ``[routing.recv_rows, H]`` of x's dtype (allocated when None):
    rows ``[o[l], o[l+1])`` (``o = routing.expert_offsets``, on the device) are local expert l's, grouped by
    source rank then token; rows past ``o[E_local]`` are not written.  Fills ``routing.recv_map``."""
    return _DISPATCH(ctx, x, routing, x_recv, None, stream, options)


def moe_combine(ctx, y_recv, routing: MoeRouting, out=None, *, out_dtype: str | None = None, stream=None,
                options: MoeOptions | None = None):
    """Return expert outputs to their tokens' owners and sum them: ``out[t] = sum_j weights[t, j] * y(t, j)``.

    ``y_recv``: ``[routing.recv_rows, H]`` bf16 / fp16 / fp32 in the receive order of the
    :func:`moe_dispatch` that used ``routing``; ``out``: ``[T, H]`` of y's dtype or float32 (allocated when
    None, ``out_dtype``).  The sum runs in fp32 in j order (bit-reproducible, no atomics); dropped pairs add
    nothing.  Returns ``out``."""
    return _COMBINE(ctx, y_recv, routing, out, out_dtype, stream, options)


def moe_layer(ctx, x, w_gate_up, w_down, logits=None, *, topk_ids=None, topk_weights=None, k: int | None = None,
              out=None, stream=None, options: MoeOptions | None = None):
    """A whole MoE layer: route -> dispatch -> grouped GEMM (gate / up) -> SwiGLU -> grouped GEMM (down) ->
    combine, on ``stream``, no host synchronization (unfused: docs/moe.md).

    ``x``: ``[T, H]`` bf16 / fp16; ``w_gate_up``: this rank's experts ``[E_local, 2F, H]`` (gate rows
    ``[0, F)``, up rows ``[F, 2F)``); ``w_down``: ``[E_local, H, F]``; routing from ``logits [T, E]`` with
    ``k`` or from ``topk_ids`` / ``topk_weights`` (E = E_local * P).  Returns ``(out [T, H], routing)``:
    the routing is the dispatch map (:class:`MoeRouting`), owned by the op and rewritten by the next call
    of the same shapes."""
    return _LAYER(ctx, x, w_gate_up, w_down, logits, topk_ids, topk_weights, k, out, stream, options)
