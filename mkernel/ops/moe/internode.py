"""MoE routing, dispatch and combine across nodes (``ctx.num_nodes > 1``): the one-node ops
(:mod:`mkernel.ops.moe.op`) with the count exchange and the row traffic to ranks on other nodes going through
this rank's CPU proxy (RDMA or TCP), ranks on this node keeping NVLink.  Kernels:
``cuda_src/ops/moe_internode.cu``; design: docs/moe.md, "Across nodes".  Ranks must be node-major with the
same number on every node; P is the world size.  Same slot order as one node: bit-identical results.
"""
from __future__ import annotations

from ...core.compiler import kernel, register_specialization
from ...core.frees import mark_proxy_launch
from ..collectives.internode import check_layout, proxy_state
from .layout import (EXCHANGE_THREADS, INTERNODE_GRID, INTERNODE_SOURCE, SPECIALIZATIONS, THREADS, make_shape,
                     x_combine_layout, x_dispatch_layout, x_route_layout)
from .op import ACROSS_NODES, MoePlan, _Combine, _Dispatch, _Launches, _ptr, _Route

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


class _XExchange:
    """Dispatch / combine across nodes: the one-node op's checks, the inter-node kernel and workspace."""

    def nodes(self, ctx):
        _nodes(ctx, self.what)

    def _xkernel(self, call):
        d = self._defines(call)
        return _kernel("mk_moe_x_" + self.name[4:], d["MK_DTYPE"], d["MK_OUT_DTYPE"])

    def validate(self, ctx, call):
        super().validate(ctx, call)
        _nodes(ctx, self.what, call.routing)

    def compile(self, ctx, call):
        if self._xkernel(call).max_active_blocks_per_sm(THREADS) < 1:
            raise RuntimeError(f"{self.what}: the kernel cannot be resident")

    def plan(self, ctx, call, digest):
        R, X = call.routing, call.x
        rb = X.shape[1] * X.dtype.itemsize
        L, N = ctx.local_size, ctx.num_nodes
        if self.name == "moe_dispatch":
            lay, total = x_dispatch_layout(L, N, R.T, rb, R.recv_rows)
        else:
            lay, total = x_combine_layout(L, N, R.T, R.k, rb, R.recv_rows)
        return MoePlan(self.name, grid(ctx), R.recv_rows, digest, lay, total)

    def bind(self, ctx, call, p: MoePlan):
        R = call.routing
        st = proxy_state(ctx, self.name, p.ws_bytes, call.stream)
        shape = make_shape(ctx.size, R.T, call.x.shape[1], R.k, R.E, R.options)
        x, o, ids, w, sl, offs, rmap, sr, so = (_ptr() for _ in range(9))
        ptrs = [(lambda c: c.x.ptr, x), (lambda c: c.o.ptr, o), (lambda c: c.routing.ids.ptr, ids),
                (lambda c: c.routing.weights.ptr, w), (lambda c: c.routing.slots.ptr, sl),
                (lambda c: c.routing.expert_offsets.ptr, offs), (lambda c: c.routing.recv_map.ptr, rmap),
                (lambda c: c.routing.send_ranges.ptr, sr), (lambda c: c.routing.src_offsets.ptr, so)]
        head = [ctx.comm_args(self.name, p.digest), st.proxy.ring_device_struct()]
        tail = [_ptr(st.ws.ptr), _ptr(st.ws.peer_table), p.layout, shape]
        if self.name == "moe_dispatch":
            args = head + [x, ids, sl, sr, offs, o, rmap] + tail
        else:
            args = head + [x, ids, w, sl, offs, so, rmap, o] + tail
        launch = self._xkernel(call).prepare(p.grid, THREADS, args, stream=call.stream, cooperative=True)
        return _Launches(p, [launch], ptrs, (st.ws, st), after=mark_proxy_launch)


class _XDispatch(_XExchange, _Dispatch):
    pass


class _XCombine(_XExchange, _Combine):
    pass


ACROSS_NODES.update(route=_XRoute(), dispatch=_XDispatch("moe_dispatch"), combine=_XCombine("moe_combine"))
