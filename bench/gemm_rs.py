#!/usr/bin/env python
"""GEMM + ReduceScatter (row-parallel projections): mkernel's fused kernel against cuBLAS + NCCL, torch's
symmetric-memory fused op, and the no-overlap floor, in the same run.

    mpirun --allow-run-as-root --bind-to none -np 2 python bench/gemm_rs.py [--quick] [--out DIR]

Every rank holds ``A_r [M, K/P]`` (bf16, its share of the reduction) and its weight shard ``W_r [N, K/P]``
(stored [N, K] as frameworks do; mkernel ``b_layout="nk"``, torch ``A_r @ W_r.t()``) and keeps its
``M/P`` rows of ``S = sum_r A_r @ W_r.T`` ``[M, N]``.  Written for any P (one node).

Per shape, in the same run:
  (a) ``torch.matmul`` (cuBLAS) into the full ``[M, N]`` partial, then NCCL ``reduce_scatter_tensor``;
  (b) ``torch.ops.symm_mem.fused_matmul_reduce_scatter`` (torch's async-TP op) if it runs here, else n/a;
  (c) mkernel's GEMM alone (the full partial) and mkernel's reduce_scatter alone: floor = max of the two
      (perfect overlap);
  (d) ``mkernel.gemm_reduce_scatter`` with the automatic plan (fused or unfused: reported);
  (e) the other side of the planner's decision, forced.
Shapes: Llama-3-70B / 405B row-parallel projections -- attention output ``o`` (K = hidden 8192 / 16384)
and MLP ``down`` (K = 28672 / 53248), N = hidden -- with the full K split over the ranks and total M in
{1024, 4096, 8192, 16384, 32768}; and the square sweep M = N in {4096, ..., 32768} with K = M/16 per rank.
``--quick``: 5 shapes.

Every method's output is checked against (a) (relative Frobenius error < 1e-2) on the first call.
Timing: CUDA events around batches of back-to-back calls on torch's current stream, an MPI barrier before
every batch, every method of a shape in the same alternating rounds, each batch behind a GPU-side delay
longer than its submission (GPU time alone; the host's submission time per eager call is reported beside);
the reported time is the max over ranks of each rank's median per-call time.
Reports time, TFLOP/s per GPU (2 M N K_r / t), speedups of (d) over (a) and (b), overlap efficiency
max(T_gemm, T_reduce_scatter) / T_(d), the plan and the model's predictions.  Writes
``<out>/gemm_rs_bench.{md,png,json}`` (default docs/).

NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set before torch is imported.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import _common as C  # noqa: E402

_f = C.fmt_or_na

C.setup_env()  # before torch is imported anywhere

MS = (1024, 4096, 8192, 16384, 32768)
MODELS = {  # name: (K = the full reduction, split over the ranks; N = hidden)
    "llama3-70b.o": (8192, 8192),
    "llama3-70b.down": (28672, 8192),
    "llama3-405b.o": (16384, 16384),
    "llama3-405b.down": (53248, 16384),
}
SWEEP = (4096, 8192, 16384, 32768)
REL_TOL = 1e-2


def shapes(P: int, quick: bool):
    """[(name, M_total, N, K_r)]."""
    if quick:
        picks = [("llama3-70b.o", 4096), ("llama3-70b.down", 8192), ("llama3-405b.o", 16384),
                 ("llama3-405b.down", 1024)]
        out = [(name, m, MODELS[name][1], MODELS[name][0] // P) for name, m in picks]
        return out + [("sweep M=N", 8192, 8192, 8192 // 16)]
    out = [(name, m, N, K // P) for name, (K, N) in MODELS.items() for m in MS]
    return out + [("sweep M=N", m, m, m // 16) for m in SWEEP]


reps_for, rel_err = C.reps_for, C.rel_err


class TorchSymmMem:
    """torch's fused matmul reduce-scatter, or the reason it is unavailable."""

    def __init__(self, torch, dist):
        self.torch, self.dist, self.fn, self.group, self.reason = torch, dist, None, None, None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            group = dist.group.WORLD.group_name
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:
                enable(group)
            self.fn = torch.ops.symm_mem.fused_matmul_reduce_scatter
            self.group = group
        except Exception as exc:  # noqa: BLE001
            self.reason = f"{type(exc).__name__}: {exc}"[:200]

    def __call__(self, a, bt):
        return self.fn(a, bt, "sum", 0, self.group)


def measure_shape(ctx, torch, dist, mk, symm, name, M, N, K, quick):
    from mkernel.core.interop import as_device_array

    P = ctx.local_size
    dev = torch.device("cuda", ctx.device)
    Mr = M // P
    g = torch.Generator(device=dev)
    g.manual_seed(17 + 7919 * ctx.rank + M + N + K)
    a = torch.randn(M, K, dtype=torch.bfloat16, device=dev, generator=g)
    w = torch.randn(N, K, dtype=torch.bfloat16, device=dev, generator=g) / (K * P) ** 0.5
    partial = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    c_ref = torch.empty(Mr, N, dtype=torch.bfloat16, device=dev)
    c_ours = torch.empty(Mr, N, dtype=torch.bfloat16, device=dev)
    part_ours = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    rs_ours = torch.empty(Mr, N, dtype=torch.bfloat16, device=dev)
    stream = torch.cuda.current_stream()
    sh = int(stream.cuda_stream)
    A, W, CO, PO, RO = (as_device_array(t, stream=sh) for t in (a, w, c_ours, part_ours, rs_ours))
    flops = 2.0 * M * N * K
    est_ms = flops / 550e12 * 1e3 + (M * N * 2) / 250e9 * 1e3
    rp = reps_for(est_ms, quick)
    rec = {"name": name, "M": M, "N": N, "K_per_rank": K, "P": P, "flops_per_gpu": flops, **rp}

    def cublas_nccl():
        torch.matmul(a, w.t(), out=partial)
        dist.reduce_scatter_tensor(c_ref, partial)

    def ours_auto():
        mk.gemm_reduce_scatter(ctx, A, W, CO, b_layout="nk", stream=sh)

    def ours_gemm():
        mk.gemm(A, W, PO, b_layout="nk", stream=sh)

    def ours_rs():
        mk.reduce_scatter(ctx, PO, RO, stream=sh)

    methods = C.Methods(ctx, rec, REL_TOL)
    prepare = methods.add
    prepare("nccl", cublas_nccl)  # also the reference c_ref
    prepare("ours", ours_auto, lambda: rel_err(torch, c_ours, c_ref))
    plan = ctx.last_plan("gemm_rs")
    rec["plan"] = {"path": plan.path, "config": plan.config, "grid": plan.grid, "partial_dtype": plan.partial_dtype,
                   "pred_fused_ms": None if plan.predicted_fused is None else plan.predicted_fused * 1e3,
                   "pred_unfused_ms": None if plan.predicted_unfused is None else plan.predicted_unfused * 1e3,
                   "reason": plan.reason}
    prepare("gemm", ours_gemm)
    prepare("rs", ours_rs, lambda: rel_err(torch, rs_ours, c_ref))
    if symm.fn is not None:
        holder = {}

        def symm_call():
            holder["c"] = symm(a, w.t())

        prepare("symm", symm_call, lambda: rel_err(torch, holder["c"], c_ref))
    else:
        rec["symm_note"] = symm.reason
    if P > 1:
        alt = "unfused" if plan.path == "fused" else "fused"
        opts = mk.GemmRsOptions(path=alt)
        prepare("forced", lambda: mk.gemm_reduce_scatter(ctx, A, W, CO, b_layout="nk", stream=sh, options=opts),
                lambda: rel_err(torch, c_ours, c_ref))
        rec["forced_path"] = alt
    methods.time(rp, ("nccl", "ours", "gemm", "rs", "symm", "forced"))
    t = {k: rec.get(k + "_ms") for k in ("nccl", "symm", "gemm", "rs", "ours", "forced")}
    ok = lambda v: v is not None and v == v and v > 0  # noqa: E731
    if ok(t["gemm"]) and ok(t["rs"]):
        rec["floor_ms"] = max(t["gemm"], t["rs"])
    for k, v in t.items():
        if ok(v) and k not in ("rs",):
            rec[k + "_tflops"] = flops / (v * 1e-3) / 1e12
    if ok(t["ours"]):
        if ok(t["nccl"]):
            rec["speedup_vs_nccl"] = t["nccl"] / t["ours"]
        if ok(t["symm"]):
            rec["speedup_vs_symm"] = t["symm"] / t["ours"]
        if rec.get("floor_ms"):
            rec["overlap_eff"] = rec["floor_ms"] / t["ours"]
    del a, w, partial, c_ref, c_ours, part_ours, rs_ours, A, W, CO, PO, RO
    torch.cuda.empty_cache()
    return rec


def report(results, meta, out_dir: Path) -> str:
    headers = ["shape", "M", "N", "K/P", "(a) cuBLAS+NCCL ms", "(b) torch symm ms", "gemm ms", "reduce-scatter ms",
               "floor ms", "(d) ours ms", "ours TFLOP/s/GPU", "vs (a)", "vs (b)", "overlap eff", "path (config)",
               "pred ms", "(e) other path ms", "host us/call (a) / (d)"]
    rows = []
    for r in results:
        p = r.get("plan", {})
        path = f"{p.get('path', '?')} ({p.get('config', '-')})"
        pred = p.get("pred_fused_ms") if p.get("path") == "fused" else p.get("pred_unfused_ms")
        notes = [r[k] for k in r if k.endswith("_note") and k != "symm_note"]
        rows.append([r["name"] + (" [" + "; ".join(notes) + "]" if notes else ""), r["M"], r["N"], r["K_per_rank"],
                     _f(r.get("nccl_ms"), ".3f"), _f(r.get("symm_ms"), ".3f"), _f(r.get("gemm_ms"), ".3f"),
                     _f(r.get("rs_ms"), ".3f"), _f(r.get("floor_ms"), ".3f"), _f(r.get("ours_ms"), ".3f"),
                     _f(r.get("ours_tflops"), ".0f"), _f(r.get("speedup_vs_nccl"), ".2f"),
                     _f(r.get("speedup_vs_symm"), ".2f"), _f(r.get("overlap_eff"), ".2f"), path, _f(pred, ".3f"),
                     _f(r.get("forced_ms"), ".3f") + (f" ({r['forced_path']})" if "forced_path" in r else ""),
                     _f(None if r.get("nccl_host_ms") is None else r["nccl_host_ms"] * 1e3, ".0f") + " / "
                     + _f(None if r.get("ours_host_ms") is None else r["ours_host_ms"] * 1e3, ".0f")])
    symm_notes = sorted({r["symm_note"] for r in results if r.get("symm_note")})
    md = [f"# GEMM + ReduceScatter benchmark ({meta['P']} x {meta['gpu']})", "",
          f"{meta['date']}, torch {meta['torch']}, NCCL {meta['nccl']}, {'--quick, ' if meta['quick'] else ''}"
          f"{meta['elapsed_s']:.0f} s.  bf16, weights [N, K/P] (b_layout='nk'); times are the max over ranks of "
          "the median per-call time, every method of a shape timed in the same alternating rounds, each batch "
          "started behind a GPU-side delay that outlasts its submission (GPU time only; the host's submission per "
          "eager call is the last column).  (a) torch.matmul + NCCL reduce_scatter_tensor; (b) "
          "torch.ops.symm_mem.fused_matmul_reduce_scatter; floor = max(our GEMM alone, our reduce_scatter alone); "
          "(d) mkernel.gemm_reduce_scatter (automatic plan); overlap eff = floor / (d); pred = the planner's "
          "prediction for the path it chose; (e) the other side of the planner's decision, forced.", "",
          C.markdown_table(headers, rows)]
    if symm_notes:
        md += ["", "(b) unavailable: " + " / ".join(symm_notes)]
    return C.write_report(out_dir, "gemm_rs_bench", "\n".join(md) + "\n", meta, results,
                          lambda path: plot(results, path, meta))


def plot(results, path: Path, meta) -> None:
    C.plot_by_m(results, path, f"GEMM + ReduceScatter, {meta['P']} x {meta['gpu']}",
                [("nccl", "(a) cuBLAS+NCCL", "s--"), ("symm", "(b) torch symm", "^--"), ("ours", "(d) mkernel", "o-")],
                floor_key="floor_ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 shapes, fewer batches")
    ap.add_argument("--out", default=str(HERE.parent / "docs"), help="output folder (default docs/)")
    ap.add_argument("--max-m", type=int, default=1 << 30, help="skip shapes with a larger total M")
    ap.add_argument("--min-m", type=int, default=0, help="skip shapes with a smaller total M")
    ap.add_argument("--only", default="", help="comma-separated shapes to run: NAME (every M) or NAME@M")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="no GPU: merge the results of earlier runs (their gemm_rs_bench.json) into one report")
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
        say("WARNING: run on one node: mkernel's gemm_reduce_scatter spans the ranks of a node, NCCL the world")
    if ctx.local_rank == 0:  # every fused specialization into the disk cache, in parallel
        precompile_source("ops/gemm_rs.cu")
    comm.Barrier()
    symm = TorchSymmMem(torch, dist)
    todo = [s for s in C.select_shapes(shapes(P, args.quick), args.only) if args.min_m <= s[1] <= args.max_m]
    say(f"{P} ranks, {torch.cuda.get_device_name()}, torch {torch.__version__}, {len(todo)} shapes; torch symm "
        f"mem: {'available' if symm.fn is not None else symm.reason}")
    results = []
    for name, M, N, K in todo:
        rec = measure_shape(ctx, torch, dist, mk, symm, name, M, N, K, args.quick)
        results.append(rec)
        p = rec.get("plan", {})
        say(f"{name:18s} M={M:6d} N={N:6d} K/P={K:6d}: cuBLAS+NCCL {_f(rec.get('nccl_ms'), '8.3f')} | symm "
            f"{_f(rec.get('symm_ms'), '8.3f')} | gemm {_f(rec.get('gemm_ms'), '8.3f')} rs "
            f"{_f(rec.get('rs_ms'), '7.3f')} | ours {_f(rec.get('ours_ms'), '8.3f')} ms "
            f"{_f(rec.get('ours_tflops'), '4.0f')} TF/s x{_f(rec.get('speedup_vs_nccl'), '.2f')} "
            f"eff {_f(rec.get('overlap_eff'), '.2f')} {p.get('path')}({p.get('config')}) "
            f"{'; '.join(str(v) for k, v in rec.items() if k.endswith('_note') and k != 'symm_note')} "
            f"[{time.monotonic() - t_start:.0f} s]")
    if ctx.rank == 0:
        from dataclasses import asdict

        meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "P": P, "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "quick": args.quick, "elapsed_s": time.monotonic() - t_start,
                "model": asdict(mk.GemmRsOptions().model)}
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            print("\n" + report(results, meta, out_dir), flush=True)
            print(f"wrote {out_dir}/gemm_rs_bench.md / .png / .json", flush=True)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            C.write_json(out_dir / "gemm_rs_bench.json", {"meta": meta, "results": results})
    comm.Barrier()
    C.shutdown(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
