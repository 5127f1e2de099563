"""MoE routing, dispatch and combine across nodes (``ctx.num_nodes > 1``): the one-node ops
(:mod:`mkernel.ops.moe.op`) with the count exchange and the row traffic to ranks on other nodes going through
this rank's CPU proxy (RDMA or TCP), ranks on this node keeping NVLink.  Kernels:
``cuda_src/ops/moe_internode.cu``; design: docs/moe.md, "Across nodes".  Ranks must be node-major with the
same number on every node; P is the world size.  Same slot order as one node: bit-identical results.

With ``MoeOptions(node_dedup=True)`` dispatch and combine take the node path (``cuda_src/ops/moe_node.cuh``;
docs/moe.md, "Node-level de-duplication"): a row crosses the network once per destination node.  Its
workspace and proxy are its own (``<op>_node``): its grid barrier counts two arrivals per call.
"""
from __future__ import annotations

from cuda.bindings import driver as cu

from ...core.compiler import kernel, register_specialization
from ...core.driver import check
from ...core.frees import mark_proxy_launch
from ..collectives.internode import check_layout, proxy_state
from .layout import (EXCHANGE_THREADS, INTERNODE_GRID, INTERNODE_SOURCE, SPECIALIZATIONS, THREADS, make_shape,
                     node_meta_offsets, x_combine_layout, x_dispatch_layout, x_node_combine_layout,
                     x_node_dispatch_layout, x_route_layout)
from .op import ACROSS_NODES, MoePlan, _Combine, _Dispatch, _Launches, _ptr, _Route, moe_options

__all__ = ["grid"]

for _d, _o in sorted({(d, o) for d, o, _ in SPECIALIZATIONS}):
    register_specialization(INTERNODE_SOURCE, {"MK_DTYPE": _d, "MK_OUT_DTYPE": _o})


def _kernel(name: str, dtype: int = 0, out: int = 0):
    return kernel(INTERNODE_SOURCE, {"MK_DTYPE": dtype, "MK_OUT_DTYPE": out}, name)


def grid(ctx) -> int:
    """Blocks of the dispatch / combine kernels: fixed per context (their grid barrier counts arrivals
    across calls), within this rank's SM share."""
    return max(1, min(INTERNODE_GRID, ctx.resident_sms))


def _nodes(ctx, what: str, routing=None) -> None:
    check_layout(ctx)
    if routing is not None and routing.send_ranges is None:
        raise ValueError(f"{what}: the routing was made on a one-node context; make it with this context")


class _XRoute(_Route):
    def nodes(self, ctx):
        _nodes(ctx, self.what)

    def compile(self, ctx, call):
        super().compile(ctx, call)
        _kernel("mk_moe_x_route_exchange")

    def plan(self, ctx, call, digest):
        p = super().plan(ctx, call, digest)
        X, total = x_route_layout(ctx.local_size, ctx.num_nodes, call.routing.T, call.routing.E)
        return MoePlan(p.op, p.grid, p.recv_rows, digest, X, total)

    def bind(self, ctx, call, p):
        bound = super().bind(ctx, call, p)
        bound.after = mark_proxy_launch  # (its kernels wait on the proxy: core/frees.py)
        return bound

    def route_workspace(self, ctx, call, p):
        st = proxy_state(ctx, self.name, p.ws_bytes, call.stream)
        return st.ws, (st.ws, st), p.layout.c_off

    def exchange_launch(self, ctx, call, p, ws, keep, mid, ptrs, shape):
        st = keep[1]
        sr, so = _ptr(), _ptr()
        ptrs += [(lambda c: c.routing.send_ranges.ptr, sr), (lambda c: c.routing.src_offsets.ptr, so)]
        args = [ctx.comm_args(self.name, p.digest), st.proxy.ring_device_struct()] + mid + [
            sr, so, _ptr(ws.ptr), _ptr(ws.peer_table), p.layout, shape]
        return _kernel("mk_moe_x_route_exchange").prepare(1, EXCHANGE_THREADS, args, stream=call.stream)


def _node_path(call) -> bool:
    return call.options.node_dedup


def _check_node_map(what: str, routing, options) -> None:
    """A node-path combine reads the node map (``routing.node_pos`` / ``node_meta``) its dispatch wrote."""
    if options.node_dedup and getattr(routing, "dispatched_by", "node") != "node":
        raise ValueError(f"{what}: MoeOptions(node_dedup=True) combines what a node_dedup dispatch sent, but this "
                         f"routing's last dispatch was {routing.dispatched_by or 'none'!r}: dispatch it with the "
                         f"same options first")


def _counter_reset(ws_ptr: int, p, R):
    """The node dispatch's ``pre``: zero the per-node batch counters (u32 cnt[N], moe_node.cuh) on the call's
    stream before the launch (graph-capturable)."""
    at, n = ws_ptr + node_meta_offsets(p.layout, R.T, R.k)[0], p.layout.N

    def pre(stream, c):
        check(cu.cuMemsetD32Async(cu.CUdeviceptr(at), 0, n, cu.CUstream(stream)))
    return pre


class _XExchange:
    """Dispatch / combine across nodes: the one-node op's checks, the inter-node kernel and workspace; the
    per-rank path, or the node path with ``MoeOptions.node_dedup``."""

    def __call__(self, ctx, x, routing, out, out_dtype, stream, options):
        opts = moe_options(options, self.what)
        if self.name == "moe_combine":
            _check_node_map(self.what, routing, opts)
        result = super().__call__(ctx, x, routing, out, out_dtype, stream, options)
        if self.name == "moe_dispatch":
            routing.dispatched_by = "node" if opts.node_dedup else "rank"
        return result

    def nodes(self, ctx):
        _nodes(ctx, self.what)

    def _xkernel(self, call):
        d = self._defines(call)
        prefix = "mk_moe_n_" if _node_path(call) else "mk_moe_x_"
        return _kernel(prefix + self.name[4:], d["MK_DTYPE"], d["MK_OUT_DTYPE"])

    def validate(self, ctx, call):
        super().validate(ctx, call)
        _nodes(ctx, self.what, call.routing)

    def compile(self, ctx, call):
        if self._xkernel(call).max_active_blocks_per_sm(THREADS) < 1:
            raise RuntimeError(f"{self.what}: the kernel cannot be resident")

    def _layout(self, ctx, call):
        R, X = call.routing, call.x
        H = X.shape[1]
        rb = H * X.dtype.itemsize
        L, N = ctx.local_size, ctx.num_nodes
        if _node_path(call):
            if self.name == "moe_dispatch":
                return x_node_dispatch_layout(L, N, R.T, R.k, rb, R.recv_rows)
            return x_node_combine_layout(L, N, R.T, R.k, H, rb)
        if self.name == "moe_dispatch":
            return x_dispatch_layout(L, N, R.T, rb, R.recv_rows)
        return x_combine_layout(L, N, R.T, R.k, rb, R.recv_rows)

    def plan(self, ctx, call, digest):
        lay, total = self._layout(ctx, call)
        return MoePlan(self.name, grid(ctx), call.routing.recv_rows, digest, lay, total,
                       transport="node" if _node_path(call) else "rank")

    def _args(self, call, ptr):
        """The kernel's data arguments (after MkComm, MkProxy) as ctypes fields re-pointed each call."""
        node = _node_path(call)
        if self.name == "moe_dispatch":
            names = ("x", "ids", "weights", "slots", "send_ranges", "expert_offsets", "o", "recv_map", "node_pos",
                     "node_meta")
            drop = ("send_ranges",) if node else ("weights", "node_pos", "node_meta")
        else:
            names = ("x", "ids", "weights", "slots", "expert_offsets", "src_offsets", "recv_map", "node_pos",
                     "node_meta", "o")
            drop = ("src_offsets",) if node else ("node_pos", "node_meta")
        return [ptr(n) for n in names if n not in drop]

    def bind(self, ctx, call, p: MoePlan):
        R = call.routing
        node = p.transport == "node"
        st = proxy_state(ctx, self.name + ("_node" if node else ""), p.ws_bytes, call.stream)
        shape = make_shape(ctx.size, R.T, call.x.shape[1], R.k, R.E, R.options)
        ptrs = []

        def ptr(name):
            field = _ptr()
            own = name in ("x", "o")
            ptrs.append(((lambda c, n=name: getattr(c, n).ptr) if own else
                         (lambda c, n=name: getattr(c.routing, n).ptr), field))
            return field
        args = [ctx.comm_args(self.name, p.digest), st.proxy.ring_device_struct()] + self._args(call, ptr) + [
            _ptr(st.ws.ptr), _ptr(st.ws.peer_table), p.layout, shape]
        launch = self._xkernel(call).prepare(p.grid, THREADS, args, stream=call.stream, cooperative=True)
        pre = _counter_reset(st.ws.ptr, p, R) if node and self.name == "moe_dispatch" else None
        return _Launches(p, [launch], ptrs, (st.ws, st), pre=pre, after=mark_proxy_launch)


class _XDispatch(_XExchange, _Dispatch):
    pass


class _XCombine(_XExchange, _Combine):
    pass


ACROSS_NODES.update(route=_XRoute(), dispatch=_XDispatch("moe_dispatch"), combine=_XCombine("moe_combine"))
