#!/usr/bin/env python
"""Flash-attention backward with mkernel on torch tensors, checked against torch SDPA's autograd.

    python examples/attention_bwd.py

q [B, H_q, S, D], k / v [B, H_kv, S, D] (torch's layout: layout="bhsd"), GQA 4:1, causal, bf16.  The
forward's out and lse come from torch's flash forward (same contract as mkernel.attention: natural-log
lse [B, H_q, S] fp32).  docs/attention_bwd.md.
"""
import torch
import torch.nn.functional as F

import mkernel

B, HQ, HKV, S, D = 2, 16, 4, 1000, 128
torch.manual_seed(0)
q = torch.randn(B, HQ, S, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B, HKV, S, D, device="cuda", dtype=torch.bfloat16)
v = torch.randn(B, HKV, S, D, device="cuda", dtype=torch.bfloat16)
dout = torch.randn_like(q)
kr, vr = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, kr, vr, 0.0, True, False)[:2]

dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
mkernel.attention_backward(q, k, v, out, lse, dout, dq, dk, dv, causal=True, layout="bhsd",
                           stream=torch.cuda.current_stream())

qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, kr, vr))
ref = torch.autograd.grad(F.scaled_dot_product_attention(qq, kk, vv, is_causal=True), (qq, kk, vv), dout)
ref_dk = ref[1].float().view(B, HKV, HQ // HKV, S, D).sum(2)
ref_dv = ref[2].float().view(B, HKV, HQ // HKV, S, D).sum(2)
for name, got, want in (("dq", dq, ref[0].float()), ("dk", dk, ref_dk), ("dv", dv, ref_dv)):
    err = ((got.float() - want).norm() / want.norm()).item()
    print(f"{name}: relative error vs torch {err:.2e}")
    assert err < 2e-2, name
