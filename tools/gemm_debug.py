#!/usr/bin/env python
"""One short GPU run (< 30 s) that tells a layout bug from a pipeline bug in mkernel.gemm.

    python tools/gemm_debug.py

For every tile config (0 = simple: 1 consumer warpgroup, 2 stages, every wgmma batch waited on;
1..6 = the pipelined ones: 4/5 = 128x192 / 128x224 tiles, 6 = ping-pong 64x256) and both B layouts, runs a few shapes and prints the relative Frobenius
error and the max abs error against a float64 numpy reference, one line per (config, layout).
A hang (deadlock) is detected by polling the stream for 10 s and reported before exiting.

Reading the table:
  * K = 64 (one k block, one tile) wrong everywhere -> descriptor / swizzle / fragment layout bug
    (for one layout only: the MN-major "kn" B descriptor, or the "nk" K-major one);
  * config 0 right but 1..3 wrong on multi-k-block shapes -> pipeline (mbarrier phase / release) bug;
  * only ragged shapes wrong -> masking / TMA out-of-bounds handling;
  * identity probe: A = I (64x64) reproduces B (64 x 256: every column of the widest tiles) exactly
    when the B path is right; the printed mismatch pattern (transposed? swizzled 8-row blocks?)
    localizes the bug;
  * only configs 4/5 wrong -> the n192/n224 wgmma wrappers or the 224-row "nk" B box; only config 6
    wrong (esp. on the last, many-tiles shape) -> ping-pong ring bookkeeping (positions j*nkb).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cuda.bindings import driver as cu  # noqa: E402

from mkernel.ops import gemm as G  # noqa: E402
from mkernel.core.arrays import DeviceArray  # noqa: E402
from mkernel.core.dtypes import bf16_to_f32, f32_to_bf16  # noqa: E402
from mkernel.core.driver import check  # noqa: E402

SHAPES = [# one block, two tiles: K blocks 4 < stages, 5, 16 (ping-pong parity aliasing, docs/gemm.md)
          (128, 256, 256), (128, 256, 320), (128, 256, 1024),
          (64, 128, 64), (128, 256, 64), (64, 128, 256), (300, 520, 1000), (129, 1000, 7), (1000, 384, 4097),
          # many tiles per block (ring reuse across tiles; ping-pong warpgroup alternation), ragged K
          (2100, 4100, 328)]


def dev(x):
    return DeviceArray.from_numpy(f32_to_bf16(x.astype(np.float32)), dtype="bfloat16")


def vals(d):
    h = d.to_numpy()
    return (bf16_to_f32(h) if d.dtype.name == "bfloat16" else h).astype(np.float64)


def wait(stream, what, timeout=10.0):
    t0 = time.time()
    while True:
        err, = cu.cuStreamQuery(stream)
        if err == cu.CUresult.CUDA_SUCCESS:
            return
        if err != cu.CUresult.CUDA_ERROR_NOT_READY:
            print(f"  {what}: CUDA error {err}", flush=True)
            os._exit(2)
        if time.time() - t0 > timeout:
            print(f"  {what}: HANG (no completion after {timeout:.0f} s) -> pipeline/barrier deadlock", flush=True)
            os._exit(3)
        time.sleep(0.001)


def run(cfg, layout, M, N, K, rng, stream):
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N) if layout == "kn" else (N, K)).astype(np.float32)
    da, db = dev(a), dev(b)
    av, bv = bf16_to_f32(f32_to_bf16(a)).astype(np.float64), bf16_to_f32(f32_to_bf16(b)).astype(np.float64)
    out = DeviceArray.empty((M, N), "float32").fill_nan()
    check(cu.cuCtxSynchronize())
    G.gemm(da, db, out, b_layout=layout, config=cfg, stream=stream)
    wait(stream, f"config {cfg} {layout} {M}x{N}x{K}")
    got = vals(out)
    ref = av @ (bv if layout == "kn" else bv.T)
    nan = int(np.isnan(got).sum())
    g = np.nan_to_num(got, nan=0.0)
    rel = np.linalg.norm(g - ref) / max(np.linalg.norm(ref), 1e-30)
    return rel, float(np.abs(g - ref).max()), nan, got, ref


def identity_probe(cfg, layout, stream):
    """A = I_64: C must equal B's 64 x N block exactly; print where it does not."""
    M, N, K = 64, 256, 64
    rng = np.random.default_rng(0)
    bk = np.round(rng.standard_normal((K, N)) * 8).astype(np.float32)  # exact in bf16
    b = bk if layout == "kn" else np.ascontiguousarray(bk.T)
    out = DeviceArray.empty((M, N), "float32").fill_nan()
    G.gemm(dev(np.eye(M, K, dtype=np.float32)), dev(b), out, b_layout=layout, config=cfg, stream=stream)
    wait(stream, f"identity probe config {cfg} {layout}")
    got = vals(out)
    bad = ~np.isclose(got, bk)
    if not bad.any():
        return "identity ok"
    r, c = np.argwhere(bad)[0]
    hits = np.argwhere(np.isclose(bk, got[r, c]))
    where = f"value found in B at {hits[:3].tolist()}" if len(hits) else "value not in B"
    tr = np.allclose(got[:64, :64], bk[:64, :64].T)
    return (f"identity BAD: {bad.sum()}/{bad.size} wrong, first C[{r},{c}]={got[r, c]:.0f} want {bk[r, c]:.0f} "
            f"({where}){'; C = B^T on the 64x64 block' if tr else ''}")


def main():
    t0 = time.time()
    from mkernel.core.device import on_device as _on_device

    with _on_device(None):
        stream = check(cu.cuStreamCreate(0))
        G.precompile([G.defines("bfloat16", "float32", c) for c in sorted(G.CONFIGS)])
        print(f"# compiled in {time.time() - t0:.1f} s; rel = relative Frobenius error, max = max abs error", flush=True)
        rng = np.random.default_rng(1)
        for cfg in sorted(G.CONFIGS):
            c = G.CONFIGS[cfg]
            for layout in ("kn", "nk"):
                parts = []
                for (M, N, K) in SHAPES:
                    rel, mx, nan, _, _ = run(cfg, layout, M, N, K, rng, stream)
                    flag = "" if rel < 1e-2 and nan == 0 else " <-- BAD"
                    parts.append(f"{M}x{N}x{K}: rel {rel:.1e} max {mx:.1e}" + (f" nan {nan}" if nan else "") + flag)
                probe = identity_probe(cfg, layout, stream)
                kind = "ping-pong" if c.pingpong else f"{c.consumers} consumer WG"
                print(f"config {cfg} ({c.bm}x{c.tile_n(layout)}, {c.stages} stages, {kind}) {layout}: {probe}")
                for p in parts:
                    print(f"    {p}")
                sys.stdout.flush()
    print(f"# done in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        sys.exit(print(__doc__))
    main()
