#!/usr/bin/env python
"""Independent re-check of the decode route (not a test: shapes and inputs no test names, drawn from a
seed).  60 single calls -- M 1-16, N 1-20000, K a multiple of 8 up to 16000, random dtype pairs,
padded row strides on A, B and C, every other call with the routing thresholds lifted -- through
mkernel.gemm against a float64 numpy reference (fp32 outputs to 1e-4, bf16 / fp16 to 1e-2; outputs
NaN-poisoned, nothing may be written outside the views); then a 30-step dependent chain at M = 11 of
decode and forced GEMM-tile calls, eager, no host sync between steps.

    PYTHONPATH=. python tools/recheck_gemv.py [SEED]      (last line: RECHECK PASSED / FAILED)
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "tests" / "gpu"), str(Path(__file__).resolve().parent.parent)]

DTYPES = [("bfloat16", "bfloat16"), ("float16", "float32"), ("bfloat16", "float32"), ("float16", "float16")]


def single_calls(rng, G, GV, n: int = 60) -> tuple[int, int]:
    """(failures, calls that ran the decode kernel)."""
    from _util import corner, download, poisoned, rel_fro, upload, written_outside
    from mkernel.ops import gemm as G

    fails = routed = 0
    for case in range(n):
        lift = case % 2 == 1
        GV.MIN_BLOCK_FILL = 0.0 if lift else 0.5
        GV.ROUTE_MAX_TILE_FILL = float("inf") if lift else 0.75
        M, N, K = int(rng.integers(1, 17)), int(rng.integers(1, 20001)), 8 * int(rng.integers(1, 2001))
        ind, outd = DTYPES[int(rng.integers(0, 4))]
        pa, pb, pc = 8 * int(rng.integers(0, 4)), 8 * int(rng.integers(0, 4)), int(rng.integers(0, 40))
        abuf, av = upload(rng.standard_normal((M, K + pa), dtype=np.float32), ind)
        bbuf, bv = upload(rng.standard_normal((N, K + pb), dtype=np.float32) / np.float32(np.sqrt(K)), ind)
        cbuf = poisoned((M + 1, N + pc), outd)
        G.gemm(corner(abuf, M, K), corner(bbuf, N, K), corner(cbuf, M, N), b_layout="nk")
        is_gemv = G.last_plan().kind == "gemv"
        routed += is_gemv
        h = download(cbuf)
        tol = 1e-4 if outd == "float32" else 1e-2
        try:
            e = rel_fro(h[:M, :N], av[:, :K] @ bv[:, :K].T)
            outside = written_outside(h, M, N)
        except AssertionError as exc:  # a NaN left in the output
            e, outside = float("inf"), False
            print("  ", exc)
        ok = e < tol and not outside
        fails += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {M}x{N}x{K} {ind}->{outd} pads {pa}/{pb}/{pc} lift={lift} "
              f"{'gemv' if is_gemv else 'tiles'} err {e:.2e}{' WROTE OUTSIDE' if outside else ''}", flush=True)
    return fails, routed


def chain(rng, G, GV, steps: int = 30, M: int = 11) -> int:
    """Failures of a dependent chain x_{i+1} = x_i @ W_i^T (config 1 forced every seventh step)."""
    from _util import download, rel_fro, upload

    from mkernel.core.arrays import DeviceArray

    GV.MIN_BLOCK_FILL, GV.ROUTE_MAX_TILE_FILL = 0.0, float("inf")
    widths = [8 * int(rng.integers(1, 1000)) for _ in range(steps + 1)]
    x0, xv = upload(rng.standard_normal((M, widths[0]), dtype=np.float32), "bfloat16")
    ws = [upload(rng.standard_normal((widths[i + 1], widths[i]), dtype=np.float32) / np.float32(np.sqrt(widths[i])),
                 "bfloat16") for i in range(steps)]
    xs = [x0] + [DeviceArray.empty((M, widths[i + 1]), "bfloat16") for i in range(steps)]
    for x in xs[1:]:
        x.fill_nan()
    cfgs = [1 if i % 7 == 3 else None for i in range(steps)]
    for i in range(steps):
        G.gemm(xs[i], ws[i][0], xs[i + 1], b_layout="nk", config=cfgs[i])
    fails, prev = 0, xv
    for i in range(steps):
        got = download(xs[i + 1])
        e = rel_fro(got, prev @ ws[i][1].T)
        fails += e >= 1e-2
        if e >= 1e-2 or i % 10 == 9:
            print(f"{'ok  ' if e < 1e-2 else 'FAIL'} chain step {i} {M}x{widths[i + 1]}x{widths[i]} cfg={cfgs[i]} "
                  f"err {e:.2e}", flush=True)
        prev = got
    return fails


def main(argv):
    from mkernel.ops import gemm as G
    from mkernel.ops.gemm import gemv as GV

    rng = np.random.default_rng(int(argv[0]) if argv else 20261201)
    fails, routed = single_calls(rng, G, GV)
    fails += chain(rng, G, GV)
    print(f"RECHECK {'PASSED' if fails == 0 else 'FAILED'}: {fails} failures, {routed}/60 single calls on the decode kernel")
    return 1 if fails else 0


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        sys.exit(print(__doc__))
    sys.exit(main(sys.argv[1:]))
