"""Probe: MoE routing across (emulated) nodes with a short timeout; on failure print each rank's proxy
counters and the control words of its routing workspace (calls / ready / consumed).
Run: mpirun -np 2 -x MKERNEL_RANKS_PER_NODE=1 python experiments/moe_internode_probe.py"""
from __future__ import annotations

import faulthandler
import sys
import threading

import numpy as np
from mpi4py import MPI

import mkernel
from mkernel import DeviceArray


def words(ws, off, n):
    return DeviceArray(ws.ptr + off, (n,), "int64").to_numpy()


def main():
    ctx = mkernel.init(MPI.COMM_WORLD, timeout=float(sys.argv[1]) if len(sys.argv) > 1 else 5.0)
    P, me = ctx.size, ctx.rank
    print(f"rank {me}: size {P} nodes {ctx.num_nodes} node {ctx.node} local {ctx.local_rank}/{ctx.local_size}",
          flush=True)
    x = DeviceArray.from_numpy(np.arange(64, dtype=np.float32) + me)
    o = DeviceArray.empty((64 * P,), "float32")
    try:
        mkernel.all_gather(ctx, x, o)
        ctx.synchronize()
        print(f"rank {me}: all_gather ok={np.array_equal(o.to_numpy(), np.concatenate([np.arange(64) + r for r in range(P)]))}",
              flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"rank {me}: all_gather failed: {exc}", flush=True)
    rng = np.random.default_rng(1)
    T, k, E = 64, 2, 2 * P
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    w = rng.random((T, k)).astype(np.float32)
    if "prewarm" in sys.argv:  # the proxy's window staging made before the kernel that needs it runs
        from mkernel.ops.collectives.internode import proxy_state
        from mkernel.ops.moe.layout import x_route_layout
        st = proxy_state(ctx, "moe_route", x_route_layout(ctx.local_size, ctx.num_nodes, T, E)[1])
        st.window.staging(), st.window.rx_staging()
        print(f"rank {me}: prewarmed", flush=True)
    try:
        R = mkernel.moe_route(ctx, topk_ids=DeviceArray.from_numpy(ids), topk_weights=DeviceArray.from_numpy(w),
                              num_experts=E)
        ctx.synchronize()
        print(f"rank {me}: route ok, expert_offsets {R.expert_offsets.to_numpy()}", flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"rank {me}: route failed: {exc}", flush=True)
        print(f"rank {me}: threads {[t.name for t in threading.enumerate()]}", flush=True)
        faulthandler.dump_traceback(sys.stdout, all_threads=True)
    st = ctx.op_state("internode_moe_route").data.get("proxy")
    if st is not None:
        pr = st.proxy
        from mkernel.ops.moe.layout import x_route_layout
        X, total = x_route_layout(ctx.local_size, ctx.num_nodes, T, E)
        print(f"rank {me}: proxy stats {dict(pr.stats)} tail {int(pr.ring.tail[0])} done {int(pr.ring.done[0])} "
              f"error {pr.error!r} ws {st.ws.nbytes} layout total {total}", flush=True)
        print(f"rank {me}: epoch+ {words(st.ws, 0, 4)} consumed {words(st.ws, X.consumed_off, P)} "
              f"calls {words(st.ws, X.calls_off, 2 * P)} ready {words(st.ws, X.ready_off, P)}", flush=True)
        seq = pr.ring.seq[:8]
        print(f"rank {me}: ring seq[:8] {seq} cmds[:4] {pr.ring.cmds[:4]}", flush=True)


if __name__ == "__main__":
    main()
