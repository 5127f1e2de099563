"""MoE layer benchmark on N ranks of one node (docs/moe.md):

    mpirun --allow-run-as-root --oversubscribe --bind-to none -np N python bench/moe.py [--shapes deepseek,mixtral]
        [--tokens 128,512,4096,16384] [--json out.json]

Per shape and tokens per rank: (a) torch: all_to_all_single dispatch + per-expert matmul loop + SwiGLU +
all_to_all_single combine (NCCL; the baseline); (b) ours, unfused pieces timed separately
(moe_route, moe_dispatch, moe_combine) and the whole mkernel.moe_layer, (c) ours fused: moe_dispatch_gemm
alone and the layer with MoeOptions(fused=True); at <= 256 tokens per rank also low-latency mode
(MoeOptions(mode="low_latency"): routing + dispatch in one kernel, and the layer).  With ranks sharing one
GPU the numbers say nothing about NVLink (marked "shared GPU").
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {  # name: (hidden, expert ffn, experts per rank (by P), k)
    "deepseek": (7168, 2048, 8, 8),
    "deepseek32": (7168, 2048, 32, 8),
    "mixtral": (4096, 14336, None, 2),  # 8 experts in all
}


def _time(fn, ctx, iters=10, warmup=3):
    for _ in range(warmup):
        fn()
    ctx.synchronize()
    ctx.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    ctx.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def _torch_layer(torch, dist, x, ids, w, wg, wd, P, El):
    """all_to_all dispatch (one row per (token, expert): the usual torch recipe), per-expert matmuls, SwiGLU,
    all_to_all combine, weighted sum."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    dest = flat[order] // El
    send_counts = torch.bincount(dest, minlength=P)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    sc, rc = send_counts.tolist(), recv_counts.tolist()  # (the host sync every torch recipe pays)
    xs = x[order // k]
    xr = x.new_empty((sum(rc), x.shape[1]))
    dist.all_to_all_single(xr, xs, rc, sc)
    er = flat.new_empty(sum(rc))
    dist.all_to_all_single(er, flat[order].contiguous(), rc, sc)
    y = torch.empty_like(xr)
    F = wd.shape[2]
    for l in range(El):
        m = (er % El) == l
        if m.any():
            h = xr[m] @ wg[l].T
            y[m] = (torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ wd[l].T
    yb = x.new_empty((T * k, x.shape[1]))
    dist.all_to_all_single(yb, y, sc, rc)
    out = torch.zeros((T, x.shape[1]), dtype=torch.float32, device=x.device)
    out.index_add_(0, order // k, yb.float() * w.reshape(-1)[order, None])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="deepseek,mixtral")
    ap.add_argument("--tokens", default="128,512,4096")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from _common import bootstrap, rank0_print, shutdown, write_json

    torch = dist = None
    if args.no_torch:
        import mkernel
        ctx = mkernel.init()
    else:
        ctx = bootstrap(nccl=True)
        import torch
        import torch.distributed as dist
    import mkernel
    from mkernel import DeviceArray, MoeOptions, f32_to_bf16

    P, me = ctx.local_size, ctx.local_rank
    shared = len(set(ctx.node_comm.allgather(ctx.device))) < P  # ranks sharing a GPU
    rows = []
    for name in args.shapes.split(","):
        H, F, el, k = SHAPES[name]
        El = el if el is not None else max(1, 8 // P)
        E = El * P
        for T in (int(t) for t in args.tokens.split(",")):
            rng = np.random.default_rng(me)
            lg = DeviceArray.from_numpy(rng.standard_normal((T, E)).astype(np.float32))
            x = DeviceArray.from_numpy(f32_to_bf16(rng.standard_normal((T, H)).astype(np.float32)), dtype="bfloat16")
            wg = DeviceArray.from_numpy(f32_to_bf16(rng.standard_normal((El, 2 * F, H)).astype(np.float32) / H ** 0.5),
                                        dtype="bfloat16")
            wd = DeviceArray.from_numpy(f32_to_bf16(rng.standard_normal((El, H, F)).astype(np.float32) / F ** 0.5),
                                        dtype="bfloat16")
            try:
                R = mkernel.moe_route(ctx, lg, k=k)
                xr = mkernel.moe_dispatch(ctx, x, R)
                y = DeviceArray.empty(tuple(xr.shape), "bfloat16")
                res = {"shape": name, "T": T, "H": H, "F": F, "E": E, "k": k, "P": P, "shared_gpu": shared,
                       "route_us": _time(lambda: mkernel.moe_route(ctx, lg, k=k, out=R), ctx, args.iters),
                       "dispatch_us": _time(lambda: mkernel.moe_dispatch(ctx, x, R, xr), ctx, args.iters),
                       "combine_us": _time(lambda: mkernel.moe_combine(ctx, y, R), ctx, args.iters)}
                out = DeviceArray.empty((T, H), "bfloat16")
                res["layer_us"] = _time(lambda: mkernel.moe_layer(ctx, x, wg, wd, lg, k=k, out=out), ctx, args.iters)
                fused = MoeOptions(fused=True)
                h = DeviceArray.empty((R.recv_rows, 2 * F), "bfloat16")
                res["dispatch_gemm_us"] = _time(lambda: mkernel.moe_dispatch_gemm(ctx, x, R, wg, h, x_recv=xr), ctx,
                                                args.iters)
                res["fused_us"] = _time(lambda: mkernel.moe_layer(ctx, x, wg, wd, lg, k=k, out=out, options=fused), ctx,
                                        args.iters)
                if T <= 256:
                    ll = MoeOptions(mode="low_latency")
                    Rl = mkernel.MoeRouting.empty(ctx, T, k, E, ll)
                    xl = DeviceArray.empty((Rl.recv_rows, H), "bfloat16")
                    res["ll_dispatch_us"] = _time(lambda: mkernel.moe_dispatch(ctx, x, Rl, xl, logits=lg, options=ll),
                                                  ctx, args.iters)
                    res["ll_combine_us"] = _time(lambda: mkernel.moe_combine(ctx, xl, Rl, options=ll), ctx, args.iters)
                    res["ll_layer_us"] = _time(lambda: mkernel.moe_layer(ctx, x, wg, wd, lg, k=k, out=out, options=ll),
                                               ctx, args.iters)
            except Exception as exc:  # noqa: BLE001 -- e.g. out of memory at the largest sizes
                res = {"shape": name, "T": T, "error": repr(exc)[:200]}
            if torch is not None and "error" not in res:
                dev = torch.device("cuda", ctx.device)
                tx = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
                tl = torch.randn(T, E, device=dev)
                tw, ti = torch.topk(torch.softmax(tl, -1), k)
                twg = torch.randn(El, 2 * F, H, device=dev, dtype=torch.bfloat16) / H ** 0.5
                twd = torch.randn(El, H, F, device=dev, dtype=torch.bfloat16) / F ** 0.5
                res["torch_us"] = _time(lambda: _torch_layer(torch, dist, tx, ti, tw, twg, twd, P, El), ctx, args.iters)
            rank0_print(ctx.world, res)
            rows.append(res)
    if args.json and me == 0:
        write_json(args.json, rows)
    shutdown(ctx) if not args.no_torch else ctx.close()


if __name__ == "__main__":
    main()
