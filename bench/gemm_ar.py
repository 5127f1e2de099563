#!/usr/bin/env python
"""GEMM + AllReduce (row-parallel projections without sequence parallelism, and the decode step): mkernel's
fused kernels against cuBLAS + NCCL, torch's symmetric-memory all-reduces, and the no-overlap floor, in the
same run.

    mpirun --allow-run-as-root --bind-to none -np 2 python bench/gemm_ar.py [--quick] [--out DIR]

Every rank holds ``A_r [M, K/P]`` (bf16, its share of the reduction) and its weight shard ``W_r [N, K/P]``
(stored [N, K] as frameworks do; mkernel ``b_layout="nk"``, torch ``A_r @ W_r.t()``); every rank gets
``C = sum_r A_r @ W_r.T`` ``[M, N]``.  Written for any P (one node).

Per shape, in the same run:
  (a) ``torch.matmul`` (cuBLAS) into ``[M, N]``, then NCCL ``all_reduce`` in place;
  (b) ``torch.matmul`` into a symmetric-memory buffer, then ``torch.ops.symm_mem.one_shot_all_reduce`` (b1)
      and ``two_shot_all_reduce_`` (b2), each where it runs here (else n/a, with the reason);
  (c) mkernel's GEMM alone and mkernel's all_reduce alone: floor = max of the two (perfect overlap);
  (d) ``mkernel.gemm_all_reduce`` with the automatic plan (latency, bandwidth or unfused: reported);
  (e) every other path forced (latency, bandwidth, unfused), where it is possible.
Shapes: Llama-3-70B / 405B row-parallel projections -- attention output ``o`` (K = hidden 8192 / 16384) and
MLP ``down`` (K = 28672 / 53248), N = hidden -- with the full K split over the ranks, decode M in {1, 8, 32,
128, 256} and prefill M in {2048, ..., 32768}; and mKernel's sweep M = N in {4096, ..., 32768} with K = M/16
per rank.  ``--quick``: 6 shapes.

Every method's output is checked against (a) (relative Frobenius error < 1e-2) on the first call.
Timing: CUDA events around batches of back-to-back calls on torch's current stream, an MPI barrier before
every batch, every method of a shape in the same alternating rounds, each batch behind a GPU-side delay
longer than its submission (GPU time alone); the host's submission time per eager call is reported beside;
for the decode shapes also the eager wall time per call (N back-to-back calls, then one synchronize: host and
GPU both count) of (a), (b1) and (d).  Reported: the max over ranks of each rank's median per-call time,
TFLOP/s per GPU (2 M N K_r / t), speedups of (d) over (a) and (b), overlap efficiency max(T_gemm,
T_all_reduce) / T_(d), the plan and the planner's prediction.  Writes ``<out>/gemm_ar_bench.{md,png,json}``
(default docs/).

NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set before torch is imported.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import _common as C  # noqa: E402

_f = C.fmt_or_na

C.setup_env()  # before torch is imported anywhere

DECODE_MS = (1, 8, 32, 128, 256)
PREFILL_MS = (2048, 4096, 8192, 16384, 32768)
MODELS = {  # name: (K = the full reduction, split over the ranks; N = hidden)
    "llama3-70b.o": (8192, 8192),
    "llama3-70b.down": (28672, 8192),
    "llama3-405b.o": (16384, 16384),
    "llama3-405b.down": (53248, 16384),
}
SWEEP = (4096, 8192, 16384, 32768)
PATHS = ("latency", "bandwidth", "unfused")
REL_TOL = 1e-2
WALL_CALLS = 200  # eager wall time: calls per round


def shapes(P: int, quick: bool):
    """[(name, M_total, N, K_r)]."""
    if quick:
        picks = [("llama3-70b.o", 1), ("llama3-70b.o", 32), ("llama3-70b.down", 256), ("llama3-70b.o", 4096),
                 ("llama3-405b.down", 8192)]
        out = [(name, m, MODELS[name][1], MODELS[name][0] // P) for name, m in picks]
        return out + [("sweep M=N", 8192, 8192, 8192 // 16)]
    out = [(name, m, N, K // P) for name, (K, N) in MODELS.items() for m in DECODE_MS + PREFILL_MS]
    return out + [("sweep M=N", m, m, m // 16) for m in SWEEP]


def is_decode(M: int) -> bool:
    return M <= max(DECODE_MS)


class TorchSymmMem:
    """torch's symmetric-memory all-reduces on a buffer the matmul writes, or the reason they are unavailable."""

    def __init__(self, torch, dist):
        self.torch, self.dist, self.reason, self.group, self.sm = torch, dist, None, None, None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            self.group = dist.group.WORLD.group_name
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:
                enable(self.group)
            self.sm = symm_mem
            self.one_shot = torch.ops.symm_mem.one_shot_all_reduce
            self.two_shot = torch.ops.symm_mem.two_shot_all_reduce_
        except Exception as exc:  # noqa: BLE001
            self.reason = f"{type(exc).__name__}: {exc}"[:200]

    def buffer(self, M: int, N: int, device):
        """A [M, N] bf16 symmetric-memory tensor (rendezvous done)."""
        buf = self.sm.empty((M, N), dtype=self.torch.bfloat16, device=device)
        self.sm.rendezvous(buf, self.group)
        return buf


def wall_us(fn, comm, n=WALL_CALLS, rounds=5) -> float:
    """Median over rounds of (n back-to-back calls + one synchronize) / n, microseconds (host and GPU both
    count: what an eager decode loop sees)."""
    import torch

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


def measure_shape(ctx, torch, dist, mk, symm, name, M, N, K, quick):
    from mkernel.core.interop import as_device_array

    P, comm = ctx.local_size, ctx.world
    dev = torch.device("cuda", ctx.device)
    g = torch.Generator(device=dev)
    g.manual_seed(17 + 7919 * ctx.rank + M + N + K)
    a = torch.randn(M, K, dtype=torch.bfloat16, device=dev, generator=g)
    w = torch.randn(N, K, dtype=torch.bfloat16, device=dev, generator=g) / (K * P) ** 0.5
    c_ref = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    c_ours = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    part_ours = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    ar_ours = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    stream = torch.cuda.current_stream()
    sh = int(stream.cuda_stream)
    A, W, CO, PO, RO = (as_device_array(t, stream=sh) for t in (a, w, c_ours, part_ours, ar_ours))
    flops = 2.0 * M * N * K
    est_ms = max(flops / 550e12, N * K * 2 / 3.5e12) * 1e3 + (M * N * 2) / 200e9 * 1e3 + 0.01
    rp = C.reps_for(est_ms, quick)
    rec = {"name": name, "M": M, "N": N, "K_per_rank": K, "P": P, "flops_per_gpu": flops, "decode": is_decode(M),
           **rp}

    def cublas_nccl():
        torch.matmul(a, w.t(), out=c_ref)
        dist.all_reduce(c_ref)

    def ours_auto():
        mk.gemm_all_reduce(ctx, A, W, CO, b_layout="nk", stream=sh)

    def ours_gemm():
        mk.gemm(A, W, PO, b_layout="nk", stream=sh)

    def ours_ar():
        mk.all_reduce(ctx, PO, RO, stream=sh)

    methods = C.Methods(ctx, rec, REL_TOL)
    add = methods.add
    add("nccl", cublas_nccl)  # also the reference c_ref
    add("ours", ours_auto, lambda: C.rel_err(torch, c_ours, c_ref))
    plan = ctx.last_plan("gemm_ar")
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    rec["plan"] = {"path": plan.path, "config": plan.config, "transposed": plan.transposed, "grid": plan.grid,
                   "partial_dtype": plan.partial_dtype, "pred_ms": ms(plan.predicted),
                   "pred_latency_ms": ms(plan.predicted_latency), "pred_bandwidth_ms": ms(plan.predicted_bandwidth),
                   "pred_unfused_ms": ms(plan.predicted_unfused), "reason": plan.reason}
    add("gemm", ours_gemm)
    add("ar", ours_ar, lambda: C.rel_err(torch, ar_ours, c_ref))
    symm_keys = ()
    if symm.reason is None:
        try:
            buf = symm.buffer(M, N, dev)
            holder = {}

            def one_shot():
                torch.matmul(a, w.t(), out=buf)
                holder["c"] = symm.one_shot(buf, "sum", symm.group)

            def two_shot():
                torch.matmul(a, w.t(), out=buf)
                symm.two_shot(buf, "sum", symm.group)

            add("symm1", one_shot, lambda: C.rel_err(torch, holder["c"], c_ref))
            add("symm2", two_shot, lambda: C.rel_err(torch, buf, c_ref))
            symm_keys = ("symm1", "symm2")
        except Exception as exc:  # noqa: BLE001
            rec["symm1_note"] = rec["symm2_note"] = f"{type(exc).__name__}: {exc}"[:200]
    else:
        rec["symm1_note"] = rec["symm2_note"] = symm.reason
    forced = []
    if P > 1:
        for path in PATHS:
            if path == plan.path:
                continue
            opts = mk.GemmArOptions(path=path)
            key = "forced_" + path
            if add(key, lambda opts=opts: mk.gemm_all_reduce(ctx, A, W, CO, b_layout="nk", stream=sh, options=opts),
                   lambda: C.rel_err(torch, c_ours, c_ref)):
                forced.append(key)
    keys = ("nccl", "ours", "gemm", "ar") + symm_keys + tuple("forced_" + p for p in PATHS)
    methods.time(rp, keys)
    if rec["decode"]:  # eager wall time per call
        for key in ("nccl", "ours", "symm1"):
            if rec.get(key + "_ms") is not None:
                try:
                    rec[key + "_wall_us"] = C.max_over_ranks(wall_us(methods.fns[key], comm), comm)[0]
                except Exception as exc:  # noqa: BLE001
                    rec[key + "_wall_note"] = f"{type(exc).__name__}: {exc}"[:200]
    t = {k: rec.get(k + "_ms") for k in keys}
    ok = lambda v: v is not None and v == v and v > 0  # noqa: E731
    if ok(t["gemm"]) and ok(t["ar"]):
        rec["floor_ms"] = max(t["gemm"], t["ar"])
        rec["serial_ms"] = t["gemm"] + t["ar"]
    for k, v in t.items():
        if ok(v) and k != "ar":
            rec[k + "_tflops"] = flops / (v * 1e-3) / 1e12
    symm_best = min((t[k] for k in symm_keys if ok(t.get(k))), default=None)
    rec["symm_ms"] = symm_best
    if ok(t["ours"]):
        if ok(t["nccl"]):
            rec["speedup_vs_nccl"] = t["nccl"] / t["ours"]
        if symm_best:
            rec["speedup_vs_symm"] = symm_best / t["ours"]
        if rec.get("floor_ms"):
            rec["overlap_eff"] = rec["floor_ms"] / t["ours"]
    if rec.get("ours_wall_us") and rec.get("nccl_wall_us"):
        rec["wall_speedup_vs_nccl"] = rec["nccl_wall_us"] / rec["ours_wall_us"]
    del a, w, c_ref, c_ours, part_ours, ar_ours, A, W, CO, PO, RO
    torch.cuda.empty_cache()
    return rec


def _host_us(ms):
    return None if ms is None else ms * 1e3


def report(results, meta, out_dir: Path) -> str:
    headers = ["shape", "M", "N", "K/P", "(a) cuBLAS+NCCL ms", "(b) torch symm ms (1-shot / 2-shot)", "gemm ms",
               "all-reduce ms", "floor ms", "(d) ours ms", "ours TFLOP/s/GPU", "vs (a)", "vs (b)", "overlap eff",
               "path (config)", "pred ms", "(e) other paths ms", "host us/call (a) / (d)",
               "eager wall us/call (a) / (b1) / (d)"]
    rows = []
    for r in results:
        p = r.get("plan", {})
        path = f"{p.get('path', '?')} ({p.get('config', '-')}{', T' if p.get('transposed') else ''})"
        notes = [v for k, v in r.items() if k.endswith("_note") and not k.startswith("symm")]
        others = "; ".join(f"{path_} {_f(r.get('forced_' + path_ + '_ms'), '.3f')}" for path_ in PATHS
                           if ("forced_" + path_ + "_ms") in r and r.get("forced_" + path_ + "_ms") is not None)
        wall = (" / ".join(_f(r.get(k + "_wall_us"), ".1f") for k in ("nccl", "symm1", "ours"))
                if r.get("decode") else "-")
        rows.append([r["name"] + (" [" + "; ".join(notes) + "]" if notes else ""), r["M"], r["N"], r["K_per_rank"],
                     _f(r.get("nccl_ms"), ".3f"),
                     _f(r.get("symm1_ms"), ".3f") + " / " + _f(r.get("symm2_ms"), ".3f"),
                     _f(r.get("gemm_ms"), ".3f"), _f(r.get("ar_ms"), ".3f"), _f(r.get("floor_ms"), ".3f"),
                     _f(r.get("ours_ms"), ".3f"), _f(r.get("ours_tflops"), ".0f"), _f(r.get("speedup_vs_nccl"), ".2f"),
                     _f(r.get("speedup_vs_symm"), ".2f"), _f(r.get("overlap_eff"), ".2f"), path,
                     _f(p.get("pred_ms"), ".3f"), others or "-",
                     _f(_host_us(r.get("nccl_host_ms")), ".0f") + " / " + _f(_host_us(r.get("ours_host_ms")), ".0f"),
                     wall])
    symm_notes = sorted({r[k] for r in results for k in ("symm1_note", "symm2_note") if r.get(k)})
    md = [f"# GEMM + AllReduce benchmark ({meta['P']} x {meta['gpu']})", "",
          f"{meta['date']}, torch {meta['torch']}, NCCL {meta['nccl']}, {'--quick, ' if meta['quick'] else ''}"
          f"{meta['elapsed_s']:.0f} s.  bf16, weights [N, K/P] (b_layout='nk'); every rank gets the whole [M, N] "
          "sum.  Times are the max over ranks of the median per-call GPU time, every method of a shape timed in the "
          "same alternating rounds, each batch started behind a GPU-side delay that outlasts its submission; host "
          "us/call is the host's submission time per eager call; eager wall us/call (decode shapes) is N "
          "back-to-back calls plus one synchronize, divided by N.  (a) torch.matmul + NCCL all_reduce; (b) "
          "torch.matmul into symmetric memory + torch.ops.symm_mem.one_shot_all_reduce / two_shot_all_reduce_ "
          "(vs (b): the faster one); floor = max(our GEMM alone, our all_reduce alone); (d) "
          "mkernel.gemm_all_reduce (automatic plan; T = transposed decode tiles); overlap eff = floor / (d); pred = "
          "the planner's prediction for the path it chose; (e) the other paths, forced.", "",
          C.markdown_table(headers, rows)]
    if symm_notes:
        md += ["", "(b) unavailable: " + " / ".join(symm_notes)]
    return C.write_report(out_dir, "gemm_ar_bench", "\n".join(md) + "\n", meta, results,
                          lambda path: plot(results, path, meta))


def plot(results, path: Path, meta) -> None:
    """Decode shapes: microseconds per call (log y); prefill and sweep: TFLOP/s per GPU."""
    series = [("nccl", "(a) cuBLAS+NCCL", "s--"), ("symm", "(b) torch symm", "^--"), ("ours", "(d) mkernel", "o-")]
    dec = [r for r in results if r.get("decode")]
    big = [r for r in results if not r.get("decode")]
    stem = Path(path)
    if dec and big:
        C.plot_by_m(big, path, f"GEMM + AllReduce (prefill), {meta['P']} x {meta['gpu']}", series, floor_key="floor_ms",
                    value=lambda r, k: r.get(k + "_tflops") if k != "symm" else (
                        r["flops_per_gpu"] / (r["symm_ms"] * 1e-3) / 1e12 if r.get("symm_ms") else None))
        C.plot_by_m(dec, stem.with_name(stem.stem + "_decode.png"),
                    f"GEMM + AllReduce (decode), {meta['P']} x {meta['gpu']}", series, ylabel="us per call (GPU)",
                    value=lambda r, k: None if r.get(k + "_ms") is None else r[k + "_ms"] * 1e3, logy=True)
    else:
        rs = dec or big
        C.plot_by_m(rs, path, f"GEMM + AllReduce, {meta['P']} x {meta['gpu']}", series, ylabel="us per call (GPU)",
                    value=lambda r, k: None if r.get(k + "_ms") is None else r[k + "_ms"] * 1e3, logy=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="6 shapes, fewer batches")
    ap.add_argument("--out", default=str(HERE.parent / "docs"), help="output folder (default docs/)")
    ap.add_argument("--max-m", type=int, default=1 << 30, help="skip shapes with a larger total M")
    ap.add_argument("--min-m", type=int, default=0, help="skip shapes with a smaller total M")
    ap.add_argument("--only", default="", help="comma-separated shapes to run: NAME (every M) or NAME@M")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="no GPU: merge the results of earlier runs (their gemm_ar_bench.json) into one report")
    args = ap.parse_args()
    t_start = time.monotonic()
    if args.merge:
        meta, results = C.merge_results(args.merge)
        print(report(results, meta, Path(args.out)), flush=True)
        return 0

    ctx = C.bootstrap()
    import torch
    import torch.distributed as dist

    import mkernel as mk
    from mkernel.core.compiler import precompile_source

    comm, P = ctx.world, ctx.local_size
    say = lambda *a: C.rank0_print(comm, *a)  # noqa: E731
    if ctx.size != P:
        say("WARNING: run on one node: mkernel's gemm_all_reduce spans the ranks of a node, NCCL the world")
    if ctx.local_rank == 0:  # every fused specialization into the disk cache, in parallel
        precompile_source("ops/gemm_ar.cu")
    comm.Barrier()
    symm = TorchSymmMem(torch, dist)
    todo = [s for s in C.select_shapes(shapes(P, args.quick), args.only) if args.min_m <= s[1] <= args.max_m]
    say(f"{P} ranks, {torch.cuda.get_device_name()}, torch {torch.__version__}, {len(todo)} shapes; torch symm "
        f"mem: {'available' if symm.reason is None else symm.reason}")
    results = []
    for name, M, N, K in todo:
        rec = measure_shape(ctx, torch, dist, mk, symm, name, M, N, K, args.quick)
        results.append(rec)
        p = rec.get("plan", {})
        say(f"{name:18s} M={M:6d} N={N:6d} K/P={K:6d}: cuBLAS+NCCL {_f(rec.get('nccl_ms'), '8.3f')} | symm "
            f"{_f(rec.get('symm1_ms'), '8.3f')}/{_f(rec.get('symm2_ms'), '8.3f')} | gemm {_f(rec.get('gemm_ms'), '8.3f')} "
            f"ar {_f(rec.get('ar_ms'), '7.3f')} | ours {_f(rec.get('ours_ms'), '8.3f')} ms "
            f"x{_f(rec.get('speedup_vs_nccl'), '.2f')} eff {_f(rec.get('overlap_eff'), '.2f')} "
            f"{p.get('path')}({p.get('config')}{',T' if p.get('transposed') else ''}) "
            f"{'wall ' + _f(rec.get('ours_wall_us'), '.1f') + ' vs ' + _f(rec.get('nccl_wall_us'), '.1f') + ' us ' if rec.get('decode') else ''}"
            f"{'; '.join(str(v) for k, v in rec.items() if k.endswith('_note') and not k.startswith('symm'))} "
            f"[{time.monotonic() - t_start:.0f} s]")
    if ctx.rank == 0:
        from dataclasses import asdict

        meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "P": P, "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "quick": args.quick, "elapsed_s": time.monotonic() - t_start,
                "model": asdict(mk.GemmArOptions().model)}
        out_dir = Path(args.out)
        try:
            print("\n" + report(results, meta, out_dir), flush=True)
            print(f"wrote {out_dir}/gemm_ar_bench.md / .png / .json", flush=True)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            C.write_json(out_dir / "gemm_ar_bench.json", {"meta": meta, "results": results})
    comm.Barrier()
    C.shutdown(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
