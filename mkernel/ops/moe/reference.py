"""float64 numpy references of the MoE ops (tests, benchmarks, examples): routing, the receive layout,
dispatch, combine and the whole layer, for all ranks at once.  Same rules as the kernels (docs/moe.md):
top-k ties to the lower expert index; rows on rank d grouped by local expert, then source rank, then
token, then j; an expert keeps its first ``capacity`` pairs in that order; rows at or past ``r_cap`` are
dropped."""
from __future__ import annotations

import numpy as np

__all__ = ["topk_reference", "layout_reference", "dispatch_reference", "combine_reference", "layer_reference",
           "send_ranges_reference", "src_offsets_reference"]


def topk_reference(logits, k: int, softmax: str = "topk"):
    """``(ids int32 [T, k], weights float64 [T, k])`` of ``logits [T, E]``: the k largest (ties: the lower
    index), weights = softmax over the k ("topk") or over all E taken at the k ("all")."""
    lg = np.asarray(logits, dtype=np.float64)
    ids = np.argsort(-lg, axis=1, kind="stable")[:, :k].astype(np.int32)
    top = np.take_along_axis(lg, ids.astype(np.int64), axis=1)
    mx = lg.max(axis=1, keepdims=True)
    p = np.exp(top - mx)
    den = np.exp(lg - mx).sum(axis=1, keepdims=True) if softmax == "all" else p.sum(axis=1, keepdims=True)
    return ids, p / den


def layout_reference(ids: list, E: int, capacity: int = 0, r_cap: int | None = None) -> list[dict]:
    """Per rank d of ``P = len(ids)`` (``ids[s]``: rank s's ``[T, k]`` expert ids): ``slots`` ([T, k] int32:
    row of (t, j) in its destination's receive buffer, -1 dropped), ``expert_offsets`` ([E/P + 1]),
    ``recv_src`` ([R]: ``s * T * k + t * k + j`` of each received row)."""
    P = len(ids)
    El = E // P
    T, k = ids[0].shape
    cap = capacity if capacity > 0 else 1 << 62
    r_cap = P * T * min(k, El) if r_cap is None else r_cap
    slots = [np.full((T, k), -1, np.int32) for _ in range(P)]
    out = []
    pairs_of = {e: [] for e in range(E)}
    for s in range(P):
        for t in range(T):
            for j in range(k):
                e = int(ids[s][t, j])
                if 0 <= e < E:
                    pairs_of[e].append((s, t, j))
    for d in range(P):
        offs, src, start = [], [], 0
        for l in range(El):
            offs.append(min(start, r_cap))
            kept = pairs_of[d * El + l][:cap]
            for q, (s, t, j) in enumerate(kept):
                if start + q < r_cap:
                    slots[s][t, j] = start + q
                    src.append(s * T * k + t * k + j)
            start += len(kept)
        offs.append(min(start, r_cap))
        out.append({"expert_offsets": np.array(offs, np.int32), "recv_src": np.array(src, np.int64)})
    for d in range(P):
        out[d]["slots"] = slots[d]
    return out


def dispatch_reference(xs: list, layouts: list[dict], k: int) -> list:
    """x_recv of every rank (``[R, H]``, rows ``[0, expert_offsets[-1])``) from every rank's ``x [T, H]``."""
    T = xs[0].shape[0]
    res = []
    for lay in layouts:
        v = lay["recv_src"]
        res.append(np.stack([xs[i // (T * k)][(i % (T * k)) // k] for i in v]) if len(v) else
                   np.zeros((0, xs[0].shape[1]), xs[0].dtype))
    return res


def combine_reference(ys: list, ids: list, weights: list, slots: list, E: int) -> list:
    """out of every rank (float64 ``[T, H]``): ``sum_j weights[t, j] * ys[owner(e)][slots[t, j]]`` over kept pairs."""
    P = len(ids)
    El = E // P
    res = []
    for s in range(P):
        T, k = ids[s].shape
        o = np.zeros((T, ys[0].shape[1]))
        for t in range(T):
            for j in range(k):
                r = slots[s][t, j]
                if r >= 0:
                    o[t] += float(weights[s][t, j]) * np.asarray(ys[int(ids[s][t, j]) // El][r], np.float64)
        res.append(o)
    return res


def layer_reference(xs: list, ids: list, weights: list, slots: list, w_gate_up: list, w_down: list) -> list:
    """The whole layer in float64 for every rank: out[t] = sum over kept (t, j) of weights[t, j] *
    (silu(x W_g^T) * (x W_u^T)) W_down^T with expert e = ids[t, j] (``w_gate_up[d]``: ``[El, 2F, H]``, gate
    rows first; ``w_down[d]``: ``[El, H, F]``)."""
    P = len(xs)
    El = w_gate_up[0].shape[0]
    F = w_gate_up[0].shape[1] // 2
    res = []
    for s in range(P):
        x = np.asarray(xs[s], np.float64)
        o = np.zeros_like(x)
        for e in range(P * El):
            sel = np.argwhere((ids[s] == e) & (slots[s] >= 0))
            if len(sel) == 0:
                continue
            t, j = sel[:, 0], sel[:, 1]
            wg = np.asarray(w_gate_up[e // El][e % El], np.float64)
            h = x[t] @ wg.T
            a = h[:, :F] / (1 + np.exp(-h[:, :F])) * h[:, F:]
            y = a @ np.asarray(w_down[e // El][e % El], np.float64).T
            np.add.at(o, t, weights[s][t, j][:, None] * y)
        res.append(o)
    return res


def send_ranges_reference(slots, ids, E: int):
    """``[E, 2]`` int64 of one rank (``slots``, ``ids``: its ``[T, k]``): (first row, rows) of its kept pairs of
    each expert in the owner's receive buffer (the route kernel's ``send_ranges``; (0, 0) when none -- the
    kernel writes the start row then).  The rows are contiguous (asserted): one proxy WRITE per expert."""
    out = np.zeros((E, 2), np.int64)
    for e in range(E):
        rows = np.sort(slots[(ids == e) & (slots >= 0)])
        if rows.size:
            assert np.array_equal(rows, np.arange(rows[0], rows[0] + rows.size)), f"expert {e}: rows not contiguous"
            out[e] = rows[0], rows.size
    return out


def src_offsets_reference(layout: dict, P: int, T: int, k: int):
    """``[E_local, P + 1]`` int64 of one rank's ``layout`` (an entry of :func:`layout_reference`): the first
    row of source s's rows of local expert l (s = P: the expert's end) -- the route kernel's ``src_offsets``,
    the contiguous row ranges combine sends back to each source."""
    o, src = layout["expert_offsets"], np.asarray(layout["recv_src"]) // (T * k)
    El = len(o) - 1
    out = np.zeros((El, P + 1), np.int64)
    for l in range(El):
        seg = src[o[l]:o[l + 1]]
        assert np.all(np.diff(seg) >= 0), "rows of an expert not grouped by source"
        out[l] = [o[l] + int(np.sum(seg < s)) for s in range(P + 1)]
    return out
