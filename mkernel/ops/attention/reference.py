"""float64 numpy reference of attention (tests, tools, examples): the forward's out and lse and, given dO,
the backward's dq, dk, dv.  Same rules as the kernels (docs/attention.md, "Contract"): arrays [B, S, H, D]
(bshd); query head h reads KV head h // (H_q / H_kv); causal: query i sees keys j <= i + S_k - S_q
(bottom-right aligned); a row that sees no key has out 0, lse -inf and zero gradients."""
from __future__ import annotations

import numpy as np

__all__ = ["attention_reference"]


def attention_reference(q, k, v, causal: bool, scale: float, do=None):
    """``(out [B, S_q, H_q, D], lse [B, H_q, S_q])`` of ``q [B, S_q, H_q, D]``, ``k, v [B, S_k, H_kv, D]``
    in float64; with ``do`` (out's shape) ``(out, lse, dq, dk, dv)``."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    allowed = np.ones((Sq, Sk), bool)
    if causal:
        allowed = np.arange(Sk)[None, :] <= np.arange(Sq)[:, None] + (Sk - Sq)
    out = np.zeros_like(q)
    lse = np.full((B, Hq, Sq), -np.inf)
    grads = do is not None
    if grads:
        do = np.asarray(do, dtype=np.float64)
        dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(B):
        for h in range(Hq):
            kh = h // g
            Q, K, V = q[b, :, h], k[b, :, kh], v[b, :, kh]
            s = np.where(allowed, scale * Q @ K.T, -np.inf)
            m = s.max(axis=1, keepdims=True)
            live = np.isfinite(m[:, 0])
            e = np.where(allowed, np.exp(s - np.where(live[:, None], m, 0)), 0.0)
            z = e.sum(axis=1, keepdims=True)
            p = np.where(live[:, None], e / np.where(z > 0, z, 1), 0.0)
            lse[b, h] = np.where(live, m[:, 0] + np.log(np.where(z[:, 0] > 0, z[:, 0], 1)), -np.inf)
            o = p @ V
            out[b, :, h] = o
            if grads:
                dO = do[b, :, h]
                ds = p * (dO @ V.T - (dO * o).sum(axis=1, keepdims=True))
                dq[b, :, h] = scale * ds @ K
                dk[b, :, kh] += scale * ds.T @ Q
                dv[b, :, kh] += p.T @ dO
    return (out, lse, dq, dk, dv) if grads else (out, lse)
