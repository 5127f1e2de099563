"""Ring attention forward (mkernel.ring_attention) across the ranks of one node, against
(a) NCCL all-gather of K/V + torch SDPA (the all-gather context-parallel scheme) and
(b) a host-driven ring of torch's flash-attention op with LSE merge + NCCL P2P (ring-flash-attn's scheme),
and the single-GPU mkernel.attention on the local shard against the whole local K/V (the compute bound).

    mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 python bench/ring_attention.py \
        [--b 1] [--hq 32] [--hkv 8] [--d 128] [--s 8192,32768] [--causal 0,1] [--json out.json]

TFLOP/s per GPU = 4 B H_q S_total S_local D / t (causal counted at half).  With 2 ranks on one GPU the
numbers measure nothing but correctness of the harness: they are marked "pending (shared GPU)".
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from _common import bootstrap, shutdown, time_stats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--s", default="8192,32768", help="total sequence lengths")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    ctx = bootstrap(nccl=True)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import mkernel

    P, r = ctx.local_size, ctx.local_rank
    persistent = mkernel.RingAttentionOptions(persistent=True)
    shared = ctx.gpu_sharers > 1
    rows = []
    for S in [int(x) for x in a.s.split(",")]:
        for causal in [bool(int(c)) for c in a.causal.split(",")]:
            Sl = S // P
            B, Hq, Hkv, D = a.b, a.hq, a.hkv, a.d
            q = torch.randn(B, Sl, Hq, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(B, Sl, Hkv, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            out = torch.empty_like(q)
            lse = torch.empty(B, Hq, Sl, device="cuda", dtype=torch.float32)
            s = torch.cuda.current_stream().cuda_stream

            def ours():
                mkernel.ring_attention(ctx, q, k, v, out, lse=lse, causal=causal, stream=s)

            def ours_persistent():  # RingAttentionOptions(persistent=True): one persistent kernel per call
                mkernel.ring_attention(ctx, q, k, v, out, lse=lse, causal=causal, stream=s, options=persistent)

            kg = torch.empty(P, B, Sl, Hkv, D, device="cuda", dtype=torch.bfloat16)
            vg = torch.empty_like(kg)

            def allgather_sdpa():  # (a); causal: the all-gathered sequence is in zigzag order, so the mask
                # is the zigzag one (a dense boolean mask: what this scheme must do without reordering)
                dist.all_gather_into_tensor(kg, k)
                dist.all_gather_into_tensor(vg, v)
                K = kg.permute(1, 0, 2, 3, 4).reshape(B, S, Hkv, D).transpose(1, 2)
                V = vg.permute(1, 0, 2, 3, 4).reshape(B, S, Hkv, D).transpose(1, 2)
                return F.scaled_dot_product_attention(q.transpose(1, 2), K, V, attn_mask=mask, enable_gqa=True)

            mask = None
            if causal:
                pos = torch.tensor(np.concatenate([mkernel.ops.ring_attention.zigzag_indices(S, P, j)
                                                   for j in range(P)]), device="cuda")
                mine = pos[r * Sl:(r + 1) * Sl]
                mask = mine[:, None] >= pos[None, :]

            def host_ring():  # (b): torch flash op per step, LSE merge, NCCL send/recv of the next block
                kc, vc = k, v
                o_acc = l_acc = None
                for step in range(P):
                    if step < P - 1:
                        kn, vn = torch.empty_like(kc), torch.empty_like(vc)
                        ops = [dist.P2POp(dist.isend, kc, (r + 1) % P), dist.P2POp(dist.isend, vc, (r + 1) % P),
                               dist.P2POp(dist.irecv, kn, (r - 1) % P), dist.P2POp(dist.irecv, vn, (r - 1) % P)]
                        reqs = dist.batch_isend_irecv(ops)
                    j = (r - step) % P
                    c = causal and step == 0
                    if causal and step > 0:
                        qq, kk, vv = (q, kc[:, :Sl // 2], vc[:, :Sl // 2]) if j < r else (q[:, Sl // 2:], kc, vc)
                    else:
                        qq, kk, vv = q, kc, vc
                    o, l = torch.ops.aten._scaled_dot_product_flash_attention(
                        qq.transpose(1, 2), kk.transpose(1, 2).repeat_interleave(Hq // Hkv, 1),
                        vv.transpose(1, 2).repeat_interleave(Hq // Hkv, 1), is_causal=c)[:2]
                    o = o.float()
                    lo = Sl - qq.shape[1]
                    if o_acc is None:
                        o_acc, l_acc = o, l
                    else:
                        la = l_acc[:, :, lo:]
                        m = torch.maximum(la, l)
                        wa, wn = torch.exp(la - m), torch.exp(l - m)
                        tot = wa + wn
                        o_acc[:, :, lo:] = (o_acc[:, :, lo:] * (wa / tot)[..., None] + o * (wn / tot)[..., None])
                        l_acc[:, :, lo:] = m + torch.log(tot)
                    if step < P - 1:
                        for q_ in reqs:
                            q_.wait()
                        kc, vc = kn, vn
                return o_acc

            def single():  # the compute bound: local q against a local block as long as the whole sequence
                mkernel.attention(qs, ks, vs, causal=False, stream=s)

            qs, ks, vs = q, k.repeat(1, P, 1, 1), v.repeat(1, P, 1, 1)
            flops = 4 * B * Hq * S * Sl * D * (0.5 if causal else 1.0)
            res = {"S": S, "S_local": Sl, "causal": causal, "P": P, "B": B, "H_q": Hq, "H_kv": Hkv, "D": D}
            for name, fn in (("mkernel_ring", ours), ("mkernel_ring_persistent", ours_persistent),
                             ("allgather_sdpa", allgather_sdpa), ("host_ring_flash", host_ring),
                             ("mkernel_single_equiv", single)):
                try:
                    t = time_stats(fn, warmup=3, reps=10, barrier=ctx.world.Barrier)["median_ms"]
                    res[name + "_ms"] = t
                    res[name + "_tflops"] = flops / (t * 1e-3) / 1e12 * (1.0 if name != "mkernel_single_equiv"
                                                                         else (2.0 if causal else 1.0))
                except Exception as exc:  # noqa: BLE001 - a baseline that cannot run on this torch is reported
                    res[name + "_error"] = repr(exc)[:200]
            per_rank = ctx.world.allgather(res.get("mkernel_ring_ms"))
            res["rank_spread"] = (max(per_rank) / min(per_rank) - 1.0) if all(per_rank) else None
            if shared:
                res["note"] = "pending (ranks share one GPU: timings not meaningful)"
            rows.append(res)
            if ctx.rank == 0:
                print(json.dumps(res))
    if ctx.rank == 0 and a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    shutdown(ctx)


if __name__ == "__main__":
    main()
