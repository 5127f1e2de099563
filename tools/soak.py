"""Soak: many back-to-back calls per op with changing data, every output checked against a float64 reference.

    PYTHONPATH=$PWD mpirun -np 2 python tools/soak.py --op all --calls 10000
    PYTHONPATH=$PWD python tools/soak.py --op gemm,attention,attention_backward --calls 10000   (one process:
        the single-GPU ops need no context; under mpirun every rank runs its own)

Every rank draws the same ``--sets`` input sets (a shared seed, so each rank computes every reference in
float64 numpy), uploads them once and then makes ``--calls`` calls per op, cycling through the sets (the
data changes every call), ``--batch`` calls back to back into distinct NaN-poisoned outputs with no host
synchronization between them, then one ``ctx.synchronize()`` and a check of each output.  A call is a
*mismatch* when any element of any of its outputs is NaN or off its reference by more than the op's
tolerance (below).  Prints one line per op (calls, mismatches, first mismatch, seconds) and exits 1 when any
rank saw a mismatch or an error.  Shapes are small and not multiples of any tile (the point is many calls,
not bandwidth), so a 10,000-call run of every op fits in a few minutes on one H200, with 2 ranks sharing it.

The attention ops alternate: even sets non-causal, odd sets causal (two bound calls, back to back).
``attention`` (out, lse) and ``attention_backward`` (dq, dk, dv; its out and lse fed from the float64
forward, so only the backward is checked) run on one GPU, GQA 4:1 / 2:1.  ``ring_attention`` (out, lse) runs
over the node's ranks: non-causal on contiguous shards, causal on zigzag shards (``mkernel.zigzag_shard``),
against float64 attention over the whole sequence (``ring_attention_persistent``: the same through
``RingAttentionOptions(persistent=True)``).  ``moe``: route (fresh top-k ids and weights every set)
-> dispatch -> combine of the received rows, one ``MoeRouting`` rewritten by every call; checks x_recv
(the rows received) and out.  ``moe_layer``: the whole layer (default path) routed from fresh logits,
against ``mkernel.ops.moe.reference.layer_reference``.

Tolerances (elementwise, ``|got - ref| <= tol``): all_gather exact; all_reduce / reduce_scatter (fp32)
``1e-5 * sum_r |x_r|``; GEMM ops (bf16 in, fp32 accumulation, bf16 out) ``2^-7 |ref| + 2^-7 * sqrt(K) *
rms(a) * rms(b)`` -- the output's rounding plus accumulation-order noise -- and for GEMM+ReduceScatter /
GEMM+AllReduce ``+ 2^-8 * sum_r |partial_r|``: the ranks' partials are rounded to bf16 before the sum.

Attention (bf16 in, N(0, 1) data, D <= 128; every bound twice the worst case of the roundings it names, the
slack absorbing the fp32 terms of ~1e-4 relative: the scores' sums of D products, ex2/lg2.approx, the sums
over keys, the ring's fp32 merge of its steps):

* attention / ring_attention out: ``2^-7 (|ref| + P|v|)``, ``(P|v|)_i = sum_j p_ij |v_j|`` -- P rounded to
  bf16 before P V (<= 2^-8 P|v|) and out rounded once (<= 2^-8 |ref|).  lse (fp32): ``2^-10`` absolute --
  the scores' fp32 sums (<= D 2^-23 scale sum_d |q_d k_d|, about 1e-4) and the approximations (~2^-22);
  no row is fully masked (S_q = S_k), so every lse is finite.
* attention_backward, each gradient ``2^-7 (|ref| + mag)``, the gradient's own rounding (2^-8 |ref|) plus:
  dv: ``mag = P^T |dO|`` (P rounded before P^T dO); dq, dk: ``mag = scale G |K|``, ``scale G^T |Q|`` with
  ``G = |dS| + P (sum_d |dO O| + 2^-6 |dO| |V|^T)`` -- dS rounded before its GEMMs (2^-8 |dS|), Dsum from
  the bf16-rounded O (2^-8 P sum_d |dO O|), dP and Dsum fp32 sums of <= 128 products (<= 2^-16 of their
  magnitude; 2^-14 allowed), P's error from the scores and lse (~1e-4 relative: ~1e-4 |dS|).  dk, dv (and
  their mag) sum over each KV head's query heads.

MoE: x_recv exact (dispatch moves bits; the rows received, ``[0, expert_offsets[-1])``); combine's out
(fp32, ``sum_j w_j y_j`` in j order) ``2^-20 sum_j |w_j y_j|`` -- k products and k - 1 additions rounded to
fp32, <= k 2^-24 sum_j |w_j y_j| (k = 2 here; the bound holds to k = 16).  moe_layer (bf16 out): ``2^-5
max |ref|`` over the rank's output, tests/gpu/test_moe.py's layer bound -- h, act and y rounded to bf16 (3
roundings of 2^-8, amplified at most ~4 through SwiGLU and the down projection), out once more.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import mkernel  # noqa: E402
from mkernel import DeviceArray, bf16_to_f32, f32_to_bf16  # noqa: E402
from mkernel.core.driver import check, cu  # noqa: E402
from mkernel.ops.moe import reference as moe_ref  # noqa: E402

OPS = ("all_reduce", "all_gather", "reduce_scatter", "ag_gemm", "gemm_rs", "gemm_ar", "gemm", "attention",
       "attention_backward", "moe", "moe_layer", "ring_attention", "ring_attention_persistent")
ONE_GPU = ("gemm", "attention", "attention_backward")  # (need no context: every process runs its own)


def _bf16_bits(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bf16 bits of x, their exact float64 values)."""
    bits = f32_to_bf16(x.astype(np.float32))
    return bits, bf16_to_f32(bits).astype(np.float64)


def _bf16(x: np.ndarray) -> tuple[DeviceArray, np.ndarray]:
    """(device bf16 copy, its exact float64 values)."""
    bits, vals = _bf16_bits(x)
    return DeviceArray.from_numpy(bits, dtype="bfloat16"), vals


def _f32(x: np.ndarray) -> tuple[DeviceArray, np.ndarray]:
    x = x.astype(np.float32)
    return DeviceArray.from_numpy(x), x.astype(np.float64)


def _host(o: DeviceArray) -> np.ndarray:
    h = o.to_numpy()
    return bf16_to_f32(h).astype(np.float64) if o.dtype.name == "bfloat16" else h.astype(np.float64)


def _einsum(spec, *xs):
    return np.einsum(spec, *xs, optimize=True)


def _attention_ref(q, k, v, causal, do=None) -> dict:
    """float64 attention of ``q [B, S, H_q, D]``, ``k / v [B, S, H_kv, D]`` (query head h reads KV head
    ``h // (H_q / H_kv)``; causal: key j <= query i) with the magnitudes the tolerances scale with (module
    docstring): ``out``, ``lse [B, H_q, S]``, ``out_mag = P |v|``; given ``do``, also ``dq / dk / dv`` and
    their ``*_mag``."""
    B, S, Hq, D = q.shape
    Hkv, scale = k.shape[2], 1.0 / np.sqrt(D)
    g = Hq // Hkv
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = _einsum("bihd,bjhd->bhij", q, kk) * scale
    if causal:
        s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    p /= l

    def pv(a, x):  # sum_j a_ij x_j
        return _einsum("bhij,bjhd->bihd", a, x)

    def ptx(a, x):  # sum_i a_ij x_i, summed over each KV head's query heads
        return _einsum("bhij,bihd->bjhd", a, x).reshape(B, S, Hkv, g, D).sum(3)
    r = {"out": pv(p, vv), "lse": (m + np.log(l))[..., 0], "out_mag": pv(p, np.abs(vv))}
    if do is None:
        return r
    o = r["out"]
    ds = p * (_einsum("bihd,bjhd->bhij", do, vv) - _einsum("bihd,bihd->bhi", do, o)[..., None])
    # |dS| + P (sum_d |dO O| + 2^-6 |dO| |V|^T): what dS's rounding and its inputs' errors scale with
    gm = np.abs(ds) + p * (_einsum("bihd,bihd->bhi", np.abs(do), np.abs(o))[..., None]
                           + 2.0 ** -6 * _einsum("bihd,bjhd->bhij", np.abs(do), np.abs(vv)))
    r.update(dq=scale * pv(ds, kk), dq_mag=scale * pv(gm, np.abs(kk)), dk=scale * ptx(ds, q),
             dk_mag=scale * ptx(gm, np.abs(q)), dv=ptx(p, do), dv_mag=ptx(p, np.abs(do)))
    return r


def _attention_outs(r: dict, names) -> list:
    """(name, shape, dtype, reference, tolerance) of bf16 attention outputs: ``2^-7 (|ref| + ref_mag)``."""
    return [(n, r[n].shape, "bfloat16", r[n], 2.0 ** -7 * (np.abs(r[n]) + r[n + "_mag"])) for n in names]


class Case:
    """One op: ``sets`` of (call, outputs)."""

    def __init__(self, op, ctx, rng, nsets):
        self.op, self.sets = op, []
        P = ctx.local_size if ctx is not None else 1
        me = ctx.local_rank if ctx is not None else 0
        for _ in range(nsets):
            self.sets.append(getattr(self, "_" + op)(ctx, rng, P, me))

    # each returns (fn(*outs) -> launches one call into outs, [(name, shape, dtype, reference, tolerance) per
    # output]); shape and dtype are the same in every set; an output larger than its reference is checked in
    # the reference's leading corner (moe's x_recv: the rows received)
    def _all_reduce(self, ctx, rng, P, me):
        n = 100_003
        xs = [_f32(rng.standard_normal(n)) for _ in range(P)]
        ref = sum(h for _, h in xs)
        x = xs[me][0]
        return (lambda o: mkernel.all_reduce(ctx, x, o)), [("out", (n,), "float32", ref,
                                                            1e-5 * sum(np.abs(h) for _, h in xs))]

    def _reduce_scatter(self, ctx, rng, P, me):
        n = 50_001
        xs = [_f32(rng.standard_normal(P * n)) for _ in range(P)]
        sl = slice(me * n, (me + 1) * n)
        ref = sum(h for _, h in xs)[sl]
        x = xs[me][0]
        return (lambda o: mkernel.reduce_scatter(ctx, x, o)), [("out", (n,), "float32", ref,
                                                                1e-5 * sum(np.abs(h) for _, h in xs)[sl])]

    def _all_gather(self, ctx, rng, P, me):
        n = 70_001
        xs = [_f32(rng.standard_normal(n)) for _ in range(P)]
        x = xs[me][0]
        ref = np.concatenate([h for _, h in xs])
        return (lambda o: mkernel.all_gather(ctx, x, o)), [("out", (P * n,), "float32", ref, 0.0)]

    @staticmethod
    def _gemm_tol(ref, a, b, K):
        rms = float(np.sqrt(np.mean(a * a) * np.mean(b * b)))
        return 2.0 ** -7 * np.abs(ref) + 2.0 ** -7 * np.sqrt(K) * rms

    def _ag_gemm(self, ctx, rng, P, me):
        ms, K, N = [250 + 3 * r for r in range(P)], 520, 1000
        As = [_bf16(rng.standard_normal((m, K))) for m in ms]
        b, hb = _bf16(rng.standard_normal((K, N)) / np.sqrt(K))  # (the same B on every rank)
        ha = np.concatenate([h for _, h in As])
        ref = ha @ hb
        a = As[me][0]
        return (lambda o: mkernel.ag_gemm(ctx, a, b, o)), [("out", (sum(ms), N), "bfloat16", ref,
                                                            self._gemm_tol(ref, ha, hb, K))]

    def _row_parallel(self, ctx, rng, P, me, fn, keep_rows):
        M, Ks, N = 1000 + 7, [264 + 8 * r for r in range(P)], 520
        As = [_bf16(rng.standard_normal((M, k))) for k in Ks]
        Bs = [_bf16(rng.standard_normal((k, N)) / np.sqrt(sum(Ks))) for k in Ks]
        ref = sum(ha @ hb for (_, ha), (_, hb) in zip(As, Bs))
        rows = slice(None)
        if keep_rows:
            offs = np.concatenate([[0], np.cumsum([M // P + (r < M % P) for r in range(P)])])
            rows = slice(int(offs[me]), int(offs[me + 1]))
        ha = np.concatenate([h for _, h in As], axis=1)
        hb = np.concatenate([h for _, h in Bs], axis=0)
        # + each rank's partial rounded to bf16 before the sum (gemm_ar rounds its own too: docs/gemm_ar.md)
        tol = (self._gemm_tol(ref, ha, hb, sum(Ks)) + 2.0 ** -8 * sum(np.abs(ha @ hb) for (_, ha), (_, hb) in zip(As, Bs)))[rows]
        a, b = As[me][0], Bs[me][0]
        return (lambda o: fn(ctx, a, b, o)), [("out", tuple(ref[rows].shape), "bfloat16", ref[rows], tol)]

    def _gemm_rs(self, ctx, rng, P, me):
        return self._row_parallel(ctx, rng, P, me, mkernel.gemm_reduce_scatter, True)

    def _gemm_ar(self, ctx, rng, P, me):
        return self._row_parallel(ctx, rng, P, me, mkernel.gemm_all_reduce, False)

    def _gemm(self, ctx, rng, P, me):
        M, K, N = 1000 + 7, 520, 1000
        (a, ha), (b, hb) = _bf16(rng.standard_normal((M, K))), _bf16(rng.standard_normal((K, N)) / np.sqrt(K))
        ref = ha @ hb
        return (lambda o: mkernel.gemm(a, b, o)), [("out", (M, N), "bfloat16", ref, self._gemm_tol(ref, ha, hb, K))]

    def _causal(self) -> bool:
        """Attention ops: odd sets causal, even ones not (the set being drawn is ``len(self.sets)``)."""
        return len(self.sets) % 2 == 1

    def _attention(self, ctx, rng, P, me):
        B, S, Hq, Hkv, D = 1, 333, 8, 2, 64
        causal = self._causal()
        (q, hq), (k, hk), (v, hv) = (_bf16(rng.standard_normal((B, S, h, D))) for h in (Hq, Hkv, Hkv))
        r = _attention_ref(hq, hk, hv, causal)
        return (lambda o, l: mkernel.attention(q, k, v, o, lse=l, causal=causal)), \
            _attention_outs(r, ("out",)) + [("lse", r["lse"].shape, "float32", r["lse"], 2.0 ** -10)]

    def _attention_backward(self, ctx, rng, P, me):
        B, S, Hq, Hkv, D = 1, 277, 4, 2, 128
        causal = self._causal()
        (q, hq), (k, hk), (v, hv), (do, hdo) = (_bf16(rng.standard_normal((B, S, h, D))) for h in (Hq, Hkv, Hkv, Hq))
        r = _attention_ref(hq, hk, hv, causal, hdo)
        (o, _), (lse, _) = _bf16(r["out"]), _f32(r["lse"])  # (the forward from float64: the backward alone)
        return (lambda dq, dk, dv: mkernel.attention_backward(q, k, v, o, lse, do, dq, dk, dv, causal=causal)), \
            _attention_outs(r, ("dq", "dk", "dv"))

    def _ring_attention_persistent(self, ctx, rng, P, me):
        return self._ring_attention(ctx, rng, P, me, mkernel.RingAttentionOptions(persistent=True))

    def _ring_attention(self, ctx, rng, P, me, options=None):
        B, S_loc, Hq, Hkv, D = 1, 262, 4, 2, 64  # (causal: zigzag chunks of 131 rows)
        causal = self._causal()
        full = [_bf16_bits(rng.standard_normal((B, S_loc * P, h, D))) for h in (Hq, Hkv, Hkv)]
        r = _attention_ref(*(h for _, h in full), causal)

        def mine(x, seq_dim=1):  # this rank's rows of the whole sequence
            if causal:
                return mkernel.zigzag_shard(x, (me, P), seq_dim)
            return np.take(x, np.arange(me * S_loc, (me + 1) * S_loc), axis=seq_dim)
        q, k, v = (DeviceArray.from_numpy(np.ascontiguousarray(mine(b)), dtype="bfloat16") for b, _ in full)
        r = {"out": mine(r["out"]), "out_mag": mine(r["out_mag"]), "lse": mine(r["lse"], 2)}
        return (lambda o, l: mkernel.ring_attention(ctx, q, k, v, o, lse=l, causal=causal, options=options)), \
            _attention_outs(r, ("out",)) + [("lse", r["lse"].shape, "float32", r["lse"], 2.0 ** -10)]

    def _moe(self, ctx, rng, P, me):
        T, k, E, H = 203, 2, 3 * P, 136
        if not hasattr(self, "routing"):  # one routing, rewritten by every call
            self.routing = mkernel.MoeRouting.empty(ctx, T, k, E)
        R = self.routing
        ids = [np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int32) for _ in range(P)]
        ws = [rng.random((T, k)).astype(np.float32) for _ in range(P)]  # (>= 0)
        xs = [_bf16(rng.standard_normal((T, H))) for _ in range(P)]
        lay = moe_ref.layout_reference(ids, E, 0, R.recv_rows)
        slots = [x["slots"] for x in lay]
        recv = moe_ref.dispatch_reference([h for _, h in xs], lay, k)
        out = moe_ref.combine_reference(recv, ids, ws, slots, E)[me]
        mag = moe_ref.combine_reference([np.abs(y) for y in recv], ids, ws, slots, E)[me]
        ids_d, ws_d, x = DeviceArray.from_numpy(ids[me]), DeviceArray.from_numpy(ws[me]), xs[me][0]

        def fn(x_recv, o):  # route -> dispatch -> combine of the received rows (y = x_recv)
            mkernel.moe_route(ctx, topk_ids=ids_d, topk_weights=ws_d, num_experts=E, out=R)
            mkernel.moe_dispatch(ctx, x, R, x_recv)
            mkernel.moe_combine(ctx, x_recv, R, o)
        return fn, [("x_recv", (R.recv_rows, H), "bfloat16", recv[me], 0.0),
                    ("out", (T, H), "float32", out, 2.0 ** -20 * mag)]

    def _moe_layer(self, ctx, rng, P, me):
        T, k, El, H, F = 203, 2, 3, 136, 40
        E = El * P
        logits = [rng.standard_normal((T, E)).astype(np.float32) for _ in range(P)]
        xs = [_bf16(rng.standard_normal((T, H))) for _ in range(P)]
        wgs = [_bf16(rng.standard_normal((El, 2 * F, H)) / np.sqrt(H)) for _ in range(P)]
        wds = [_bf16(rng.standard_normal((El, H, F)) / np.sqrt(F)) for _ in range(P)]
        routes = [moe_ref.topk_reference(lg, k) for lg in logits]
        ids = [i for i, _ in routes]
        slots = [x["slots"] for x in moe_ref.layout_reference(ids, E)]
        want = moe_ref.layer_reference([h for _, h in xs], ids, [w for _, w in routes], slots, [h for _, h in wgs],
                                       [h for _, h in wds])[me]
        lg, x, wg, wd = DeviceArray.from_numpy(logits[me]), xs[me][0], wgs[me][0], wds[me][0]
        return (lambda o: mkernel.moe_layer(ctx, x, wg, wd, lg, k=k, out=o)), \
            [("out", (T, H), "bfloat16", want, 2.0 ** -5 * np.abs(want).max())]


def soak(op, ctx, args) -> tuple[int, str]:
    """Runs ``args.calls`` calls of ``op``; returns (mismatches, description of the first)."""
    case = Case(op, ctx, np.random.default_rng(args.seed), args.sets)
    outs = [[DeviceArray.empty(shape, dt) for _, shape, dt, _, _ in case.sets[0][1]] for _ in range(args.batch)]
    sync = ctx.synchronize if ctx is not None else (lambda: check(cu.cuCtxSynchronize()))
    bad, first, done = 0, "", 0
    while done < args.calls:
        k = min(args.batch, args.calls - done)
        for j in range(k):
            for o in outs[j]:
                o.fill_nan()  # (stream-ordered before the calls: no host wait)
        for j in range(k):
            fn = case.sets[(done + j) % args.sets][0]
            fn(*outs[j])
        sync()
        for j in range(k):
            off_any = False
            for (name, _, _, ref, tol), o in zip(case.sets[(done + j) % args.sets][1], outs[j]):
                got = _host(o)[tuple(slice(0, n) for n in ref.shape)]
                err = np.abs(got - ref)
                off = ~(err <= tol)  # (NaN counts)
                if off.any():
                    off_any = True
                    if not first:
                        i = int(np.argmax(off.reshape(-1)))
                        first = (f"call {done + j}: {name}: {int(off.sum())} elements off, e.g. flat index {i}: got "
                                 f"{got.reshape(-1)[i]!r}, want {ref.reshape(-1)[i]!r}")
            bad += off_any
        done += k
    return bad, first


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", default="all", help=f"one of {', '.join(OPS)}, a comma list, or 'all'")
    ap.add_argument("--calls", type=int, default=10_000, help="calls per op")
    ap.add_argument("--batch", type=int, default=32, help="calls between two synchronizations")
    ap.add_argument("--sets", type=int, default=8, help="distinct input sets cycled through (attention ops: odd ones causal)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--timeout", type=float, default=None, help="context timeout (s)")
    args = ap.parse_args(argv)
    ops = OPS if args.op == "all" else tuple(args.op.split(","))
    for op in ops:
        if op not in OPS:
            ap.error(f"unknown op {op!r}")
    multi = [o for o in ops if o not in ONE_GPU]
    ctx = mkernel.init(timeout=args.timeout) if multi else None
    rank = ctx.rank if ctx is not None else 0
    total, failed = 0, False
    for op in ops:
        t0 = time.monotonic()
        try:
            bad, first = soak(op, ctx, args)
        except mkernel.MkernelError as exc:
            bad, first = args.calls, f"error: {exc}"
        dt = time.monotonic() - t0
        total += bad
        print(f"soak rank {rank} {op}: {args.calls} calls, {bad} mismatches, {dt:.1f} s"
              + (f"; first: {first}" if first else ""), flush=True)
        if first.startswith("error"):
            failed = True
            break  # the context failed: later ops would raise at once
    if ctx is not None and not failed:
        total = int(ctx.bounded_allgather([total], "soak: the mismatch counts").sum())
    print(f"soak rank {rank}: {'PASSED' if total == 0 else 'FAILED'} ({total} mismatches)", flush=True)
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
