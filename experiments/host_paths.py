#!/usr/bin/env python
"""Where an eager call's host microseconds go, piece by piece (one GPU, one process).

    python experiments/host_paths.py

Measures, each as the median over rounds of N back-to-back calls (no synchronization inside a round):
  * launch routes for one small kernel: cuda.bindings cuLaunchKernelEx with a prepacked config,
    cuLaunchKernel with prepacked parameters, cuda.core's launch();
  * importing a torch tensor: as_device_array (accessor route), DLPack (__dlpack__ + capsule), CAI dict;
  * tensor maps: cuTensorMapEncodeTiled through cuda.bindings vs TensorMapArg.point (patched address),
    and that a patched map equals a freshly encoded one byte for byte on random aligned addresses;
  * torch.matmul's own host time for a small bf16 GEMM (the baseline the ops are held to).
Prints a table; no GPU time is measured.
"""
from __future__ import annotations

import ctypes
import statistics
import sys
import time
from pathlib import Path

if "-h" in sys.argv or "--help" in sys.argv:
    print(__doc__)
    raise SystemExit(0)

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

N, ROUNDS = 2000, 7


def per_call_us(fn, n=N, rounds=ROUNDS, sync=None) -> float:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 -- report the row as failed, measure the others
        print(f"  failed: {type(exc).__name__}: {exc}")
        return float("nan")
    for _ in range(50):
        fn()
    if sync:
        sync()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
        if sync:
            sync()
    return statistics.median(out)


def main():
    import numpy as np
    import torch
    from cuda.bindings import driver as cu

    from mkernel.core import tensormap as TM
    from mkernel.core.compiler import kernel
    from mkernel.core.driver import check
    from mkernel.core.interop import as_device_array

    torch.cuda.init()
    dev = torch.device("cuda", 0)
    s = torch.cuda.current_stream()
    sh = int(s.cuda_stream)
    sync = torch.cuda.synchronize
    rows = []

    # ---- launch routes: a one-block kernel (pad copy of 0 elements does nothing but launch)
    from mkernel.ops.gemm import defines

    k = kernel("gemm/gemm.cu", defines("bfloat16", "bfloat16", 1), "mk_pad_copy_u16")
    args = [ctypes.c_void_p(0), ctypes.c_void_p(0)] + [ctypes.c_int64(v) for v in (1, 0, 0, 0, 0, 0, 0, 0)]
    prep = k.prepare(1, 32, args, stream=sh)
    rows.append(("cuLaunchKernelEx, prepacked (PreparedLaunch.submit)", per_call_us(prep.submit, sync=sync)))
    f = prep.f
    addr = prep._addr
    st = cu.CUstream(sh)

    def plain():
        r, = cu.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, st, addr, 0)
    rows.append(("cuLaunchKernel, prepacked parameters", per_call_us(plain, sync=sync)))
    try:
        from cuda.core import LaunchConfig, launch
        from cuda.core import Stream as CStream

        cs = CStream.from_handle(sh)
        cfg = LaunchConfig(grid=1, block=32)
        ck = k.module._cuda_core_kernel(k.name) if hasattr(k.module, "_cuda_core_kernel") else None
        if ck is None:
            from cuda.core import ObjectCode

            ck = ObjectCode.from_cubin(k.module.cubin).get_kernel(k.name)
        a = (0, 0, np.int64(1), np.int64(0), np.int64(0), np.int64(0), np.int64(0), np.int64(0), np.int64(0),
             np.int64(0))
        rows.append(("cuda.core launch()", per_call_us(lambda: launch(cs, cfg, ck, *a), sync=sync)))
    except Exception as exc:  # noqa: BLE001
        rows.append((f"cuda.core launch(): failed ({type(exc).__name__}: {exc})", float("nan")))

    # ---- importing a torch tensor
    t = torch.randn(128, 8192, device=dev, dtype=torch.bfloat16)
    rows.append(("as_device_array(torch bf16) (accessors)", per_call_us(lambda: as_device_array(t, stream=sh))))

    def via_dlpack():
        from mkernel.core.interop import from_dlpack_capsule
        return from_dlpack_capsule(t.__dlpack__(stream=sh or 1))  # (DLPack: 1 = the legacy default stream)
    rows.append(("torch bf16 via __dlpack__ + capsule", per_call_us(via_dlpack, n=500)))
    t16 = t.half()
    rows.append(("torch fp16 __cuda_array_interface__ dict", per_call_us(lambda: t16.__cuda_array_interface__, n=500)))

    # ---- tensor maps
    base = t.data_ptr()

    def encode():
        TM._encode(base, "bfloat16", (8192, 128), (16384,), (64, 128), 128, 128)
    rows.append(("cuTensorMapEncodeTiled (cuda.bindings)", per_call_us(encode, n=500)))
    codec = TM.address_codec()
    m = TM.TensorMapArg(base, "bfloat16", (8192, 128), (16384,), (64, 128))
    flip = [base, base + 16384 * 4]
    i = [0]

    def point():
        i[0] ^= 1
        m.point(flip[i[0]])
    rows.append((f"TensorMapArg.point (codec {codec})", per_call_us(point)))
    rng = np.random.default_rng(1)
    bad = 0
    for _ in range(200):
        p = int(rng.integers(1, 1 << 44)) * 16
        m.point(p)
        if m.raw != TM._encode(p, "bfloat16", (8192, 128), (16384,), (64, 128), 128, 128):
            bad += 1
    rows.append((f"patched maps differing from encoded ones (of 200)", float(bad)))

    # ---- baselines
    a = torch.randn(16, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    o = torch.empty(16, 4096, device=dev, dtype=torch.bfloat16)
    rows.append(("torch.matmul(a, w.t(), out=o) 16x4096x4096", per_call_us(lambda: torch.matmul(a, w.t(), out=o), n=500,
                                                                            sync=sync)))
    sync()
    print(f"{'what':<60} {'us/call':>9}")
    for name, v in rows:
        print(f"{name:<60} {v:9.2f}")


if __name__ == "__main__":
    main()
