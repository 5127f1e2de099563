"""Soak: many back-to-back calls per op with changing data, every output checked against a float64 reference.

    PYTHONPATH=$PWD mpirun -np 2 python tools/soak.py --op all --calls 10000
    PYTHONPATH=$PWD python tools/soak.py --op gemm --calls 10000          (one process: the single-GPU GEMM)

Every rank draws the same ``--sets`` input sets (a shared seed, so each rank computes every reference in
float64 numpy), uploads them once and then makes ``--calls`` calls per op, cycling through the sets (the
data changes every call), ``--batch`` calls back to back into distinct NaN-poisoned outputs with no host
synchronization between them, then one ``ctx.synchronize()`` and a check of each output.  A call is a
*mismatch* when any element is NaN or off its reference by more than the op's tolerance (below).  Prints
one line per op (calls, mismatches, first mismatch, seconds) and exits 1 when any rank saw a mismatch or
an error.  Shapes are small and not multiples of any tile (the point is many calls, not bandwidth), so a
10,000-call run of every op fits in a few minutes on one H200, with 2 ranks sharing it.

Tolerances (elementwise, ``|got - ref| <= tol``): all_gather exact; all_reduce / reduce_scatter (fp32)
``1e-5 * sum_r |x_r|``; GEMM ops (bf16 in, fp32 accumulation, bf16 out) ``2^-7 |ref| + 2^-7 * sqrt(K) *
rms(a) * rms(b)`` -- the output's rounding plus accumulation-order noise -- and for GEMM+ReduceScatter /
GEMM+AllReduce ``+ 2^-8 * sum_r |partial_r|``: the ranks' partials are rounded to bf16 before the sum.
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

OPS = ("all_reduce", "all_gather", "reduce_scatter", "ag_gemm", "gemm_rs", "gemm_ar", "gemm")


def _bf16(x: np.ndarray) -> tuple[DeviceArray, np.ndarray]:
    """(device bf16 copy, its exact float64 values)."""
    bits = f32_to_bf16(x.astype(np.float32))
    return DeviceArray.from_numpy(bits, dtype="bfloat16"), bf16_to_f32(bits).astype(np.float64)


def _f32(x: np.ndarray) -> tuple[DeviceArray, np.ndarray]:
    x = x.astype(np.float32)
    return DeviceArray.from_numpy(x), x.astype(np.float64)


def _host(o: DeviceArray) -> np.ndarray:
    h = o.to_numpy()
    return bf16_to_f32(h).astype(np.float64) if o.dtype.name == "bfloat16" else h.astype(np.float64)


class Case:
    """One op: ``sets`` of (call, out-shape, reference, tolerance)."""

    def __init__(self, op, ctx, rng, nsets):
        self.op, self.sets = op, []
        P = ctx.local_size if ctx is not None else 1
        me = ctx.local_rank if ctx is not None else 0
        for _ in range(nsets):
            self.sets.append(getattr(self, "_" + op)(ctx, rng, P, me))

    # each returns (fn(out) -> launches one call into out, out shape, out dtype, reference, tolerance)
    def _all_reduce(self, ctx, rng, P, me):
        n = 100_003
        xs = [_f32(rng.standard_normal(n)) for _ in range(P)]
        ref = sum(h for _, h in xs)
        x = xs[me][0]
        return (lambda o: mkernel.all_reduce(ctx, x, o)), (n,), "float32", ref, 1e-5 * sum(np.abs(h) for _, h in xs)

    def _reduce_scatter(self, ctx, rng, P, me):
        n = 50_001
        xs = [_f32(rng.standard_normal(P * n)) for _ in range(P)]
        sl = slice(me * n, (me + 1) * n)
        ref = sum(h for _, h in xs)[sl]
        x = xs[me][0]
        return (lambda o: mkernel.reduce_scatter(ctx, x, o)), (n,), "float32", ref, \
            1e-5 * sum(np.abs(h) for _, h in xs)[sl]

    def _all_gather(self, ctx, rng, P, me):
        n = 70_001
        xs = [_f32(rng.standard_normal(n)) for _ in range(P)]
        x = xs[me][0]
        return (lambda o: mkernel.all_gather(ctx, x, o)), (P * n,), "float32", np.concatenate([h for _, h in xs]), 0.0

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
        return (lambda o: mkernel.ag_gemm(ctx, a, b, o)), (sum(ms), N), "bfloat16", ref, self._gemm_tol(ref, ha, hb, K)

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
        return (lambda o: fn(ctx, a, b, o)), tuple(ref[rows].shape), "bfloat16", ref[rows], tol

    def _gemm_rs(self, ctx, rng, P, me):
        return self._row_parallel(ctx, rng, P, me, mkernel.gemm_reduce_scatter, True)

    def _gemm_ar(self, ctx, rng, P, me):
        return self._row_parallel(ctx, rng, P, me, mkernel.gemm_all_reduce, False)

    def _gemm(self, ctx, rng, P, me):
        M, K, N = 1000 + 7, 520, 1000
        (a, ha), (b, hb) = _bf16(rng.standard_normal((M, K))), _bf16(rng.standard_normal((K, N)) / np.sqrt(K))
        ref = ha @ hb
        return (lambda o: mkernel.gemm(a, b, o)), (M, N), "bfloat16", ref, self._gemm_tol(ref, ha, hb, K)


def soak(op, ctx, args) -> tuple[int, str]:
    """Runs ``args.calls`` calls of ``op``; returns (mismatches, description of the first)."""
    case = Case(op, ctx, np.random.default_rng(args.seed), args.sets)
    outs = [DeviceArray.empty(case.sets[0][1], case.sets[0][2]) for _ in range(args.batch)]
    sync = ctx.synchronize if ctx is not None else (lambda: check(cu.cuCtxSynchronize()))
    bad, first, done = 0, "", 0
    while done < args.calls:
        k = min(args.batch, args.calls - done)
        for j in range(k):
            outs[j].fill_nan()  # (stream-ordered before the calls: no host wait)
        for j in range(k):
            fn = case.sets[(done + j) % args.sets][0]
            fn(outs[j])
        sync()
        for j in range(k):
            _, _, _, ref, tol = case.sets[(done + j) % args.sets]
            got = _host(outs[j])
            err = np.abs(got - ref)
            off = ~(err <= tol)  # (NaN counts)
            if off.any():
                bad += 1
                if not first:
                    i = int(np.argmax(off.reshape(-1)))
                    first = (f"call {done + j}: {int(off.sum())} elements off, e.g. flat index {i}: got "
                             f"{got.reshape(-1)[i]!r}, want {ref.reshape(-1)[i]!r}")
        done += k
    return bad, first


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", default="all", help=f"one of {', '.join(OPS)}, a comma list, or 'all'")
    ap.add_argument("--calls", type=int, default=10_000, help="calls per op")
    ap.add_argument("--batch", type=int, default=32, help="calls between two synchronizations")
    ap.add_argument("--sets", type=int, default=8, help="distinct input sets cycled through")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--timeout", type=float, default=None, help="context timeout (s)")
    args = ap.parse_args(argv)
    ops = OPS if args.op == "all" else tuple(args.op.split(","))
    for op in ops:
        if op not in OPS:
            ap.error(f"unknown op {op!r}")
    multi = [o for o in ops if o != "gemm"]
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
