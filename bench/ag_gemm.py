#!/usr/bin/env python
"""AllGather + GEMM (column-parallel projections): mkernel's fused kernel against NCCL + cuBLAS,
torch's symmetric-memory fused op, and the no-overlap floor, in the same run.

    mpirun --allow-run-as-root --bind-to none -np 2 python bench/ag_gemm.py [--quick] [--out DIR]

Every rank holds ``A_r [M/P, K]`` (bf16) and its weight shard ``W_r [N/P, K]`` (stored [N, K] as
frameworks do; mkernel ``b_layout="nk"``, torch ``A @ W_r.t()``) and computes
``C_r = AllGather(A) @ W_r.T`` ``[M, N/P]``.  Written for any P (one node); run with 2 GPUs.

Per shape, in the same run:
  (a) NCCL ``all_gather_into_tensor`` then ``torch.matmul``, sequential on one stream;
  (b) ``torch.ops.symm_mem.fused_all_gather_matmul`` (torch's async-TP op) if it runs here, else n/a;
  (c) mkernel's GEMM alone on the gathered A, and mkernel's all_gather alone: floor = max of the two
      (perfect overlap, no SMs lost to communication);
  (d) ``mkernel.ag_gemm`` with the automatic plan (fused or unfused: reported);
  (e) the other side of the planner's decision, forced: "unfused" when (d) fused, else "fused_ce".
Shapes: Llama-3-70B (hidden 8192; QKV 10240, MLP up/gate 28672) and Llama-3-405B (hidden 16384; QKV
18432, MLP 53248) with N = out/P per rank and total M in {1024, 4096, 8192, 16384, 32768}; and the
square sweep M = K in {4096, 8192, 16384, 32768} with N/P = M/16 per rank.  ``--quick``: 5 shapes.

Every method's output is checked against (a) (relative Frobenius error < 1e-2) on the first call.
Timing: CUDA events around batches of back-to-back calls on torch's current stream, an MPI barrier
before every batch, every method of a shape in the same alternating rounds; each batch starts behind a
GPU-side delay longer than the host's submission of its calls (``host_lead``), so the events time the
GPU alone (the host's submission time per call is reported beside); the reported time is the max over
ranks of each rank's median per-call time.
Reports time, TFLOP/s per GPU (2*M*(N/P)*K / t), speedups of (d) over (a) and (b), overlap efficiency
max(T_gemm, T_allgather) / T_(d), the plan (path, comm SMs) and the model's predictions.  Writes
``<out>/ag_gemm_bench.{md,png,json}`` (default docs/).

NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set before torch is imported.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import _common as C  # noqa: E402

_f = C.fmt_or_na  # a number, or "n/a" for a baseline that did not run


def _us(ms):
    return None if ms is None else ms * 1e3


def path_kwargs(name: str, paths=()) -> dict:
    """ag_gemm's keyword arguments for a --paths entry: one of ``paths`` (a forced path) or ``fused@N``
    (the SM path with N communication SMs); ValueError otherwise."""
    if name.startswith("fused@") and name[6:].isdigit():
        return dict(comm_sms=int(name[6:]))
    if name in paths:
        return dict(path=name)
    raise ValueError(f"--paths: each of {list(paths)} or fused@N (N communication SMs), got {name!r}")

C.setup_env()  # before torch is imported anywhere

MS = (1024, 4096, 8192, 16384, 32768)
MODELS = {  # name: (K = hidden, N = projection output width over all ranks)
    "llama3-70b.qkv": (8192, 10240),
    "llama3-70b.mlp_up": (8192, 28672),
    "llama3-405b.qkv": (16384, 18432),
    "llama3-405b.mlp_up": (16384, 53248),
}
SWEEP = (4096, 8192, 16384, 32768)
REL_TOL = 1e-2


def shapes(P: int, quick: bool):
    """[(name, M_total, N_per_rank, K)]."""
    out = []
    if quick:
        picks = [("llama3-70b.qkv", 4096), ("llama3-70b.mlp_up", 8192), ("llama3-405b.qkv", 16384),
                 ("llama3-405b.mlp_up", 1024)]
        for name, m in picks:
            K, N = MODELS[name]
            out.append((name, m, N // P, K))
        out.append(("sweep M=K", 8192, 8192 // 16, 8192))
        return out
    for name, (K, N) in MODELS.items():
        for m in MS:
            out.append((name, m, N // P, K))
    for m in SWEEP:
        out.append(("sweep M=K", m, m // 16, m))
    return out


def reps_for(est_ms: float, quick: bool) -> dict:
    batch = int(min(20, max(1, round(4.0 / max(est_ms, 1e-3)))))
    return {"warmup": 2 if est_ms > 5 else 5, "reps": 3 if quick else 7, "batch": batch}


def rel_err(torch, got, ref) -> float:
    g, r = got.float(), ref.float()
    if torch.isnan(g).any():
        return float("inf")
    return float(torch.linalg.norm(g - r) / torch.linalg.norm(r).clamp_min(1e-30))


class TorchSymmMem:
    """torch's fused all-gather matmul, or the reason it is unavailable."""

    def __init__(self, torch, dist):
        self.torch, self.dist, self.fn, self.group, self.reason = torch, dist, None, None, None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            group = dist.group.WORLD.group_name
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:
                enable(group)
            self.fn = torch.ops.symm_mem.fused_all_gather_matmul
            self.group = group
        except Exception as exc:  # noqa: BLE001
            self.reason = f"{type(exc).__name__}: {exc}"[:200]

    def __call__(self, a_shard, bt):
        try:
            _, outs = self.fn(a_shard, [bt], 0, self.group, return_A=False)
        except TypeError:
            _, outs = self.fn(a_shard, [bt], 0, self.group)
        return outs[0]


def measure_shape(ctx, torch, dist, mk, agm, symm, name, M, N, K, quick, paths=()):
    from mkernel.core.interop import as_device_array

    P, comm = ctx.local_size, ctx.world
    dev = torch.device("cuda", ctx.device)
    Mr = M // P
    g = torch.Generator(device=dev)
    g.manual_seed(17 + 7919 * ctx.rank + M + N + K)
    a = torch.randn(Mr, K, dtype=torch.bfloat16, device=dev, generator=g)
    w = torch.randn(N, K, dtype=torch.bfloat16, device=dev, generator=g) / math.sqrt(K)
    a_full = torch.empty(M, K, dtype=torch.bfloat16, device=dev)
    c_ref = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    c_ours = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    a_full_ours = torch.empty(M, K, dtype=torch.bfloat16, device=dev)
    c_gemm = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    stream = torch.cuda.current_stream()
    sh = int(stream.cuda_stream)
    A, W, CO = (as_device_array(t, stream=sh) for t in (a, w, c_ours))
    AF, CG = as_device_array(a_full_ours, stream=sh), as_device_array(c_gemm, stream=sh)
    flops = 2.0 * M * N * K
    est_ms = flops / 550e12 * 1e3 + (M * K * 2) / 250e9 * 1e3
    rp = reps_for(est_ms, quick)
    rec = {"name": name, "M": M, "N_per_rank": N, "K": K, "P": P, "flops_per_gpu": flops, **rp}

    def nccl_mm():
        dist.all_gather_into_tensor(a_full, a)
        torch.matmul(a_full, w.t(), out=c_ref)

    def ours_auto():
        mk.ag_gemm(ctx, A, W, CO, b_layout="nk", stream=sh)

    def ours_gemm():
        mk.gemm(AF, W, CG, b_layout="nk", stream=sh)

    def ours_ag():
        mk.all_gather(ctx, A, AF, stream=sh)

    # Correctness first (one call each, checked), then every method timed in alternating rounds
    # (C.time_interleaved: they all see the same clocks; timed one after another, a method inherits
    # the power/thermal state the previous one left).
    methods = {}  # key -> fn, in the table's order

    def prepare(key, fn, check=None):
        try:
            fn()
            torch.cuda.synchronize()
            ctx.check()
            if check is not None:
                err = check()
                rec[key + "_err"] = err
                if not err < REL_TOL:
                    rec[key + "_note"] = f"MISMATCH rel err {err:.2e}"
            methods[key] = fn
        except Exception as exc:  # noqa: BLE001
            rec[key + "_note"] = f"{type(exc).__name__}: {exc}"[:300]

    prepare("nccl", nccl_mm)  # also produces the reference c_ref
    prepare("ours", ours_auto, lambda: rel_err(torch, c_ours, c_ref))
    plan = ctx.last_plan("ag_gemm")
    rec["plan"] = {"path": plan.path, "comm_sms": plan.comm_sms, "workers": plan.workers, "config": plan.config,
                   "chunk_rows": plan.chunk_rows, "pred_fused_ms": plan.predicted_fused * 1e3,
                   "pred_unfused_ms": plan.predicted_unfused * 1e3, "pred_comm_ms": plan.predicted_comm * 1e3,
                   "pred_gemm_ms": plan.predicted_gemm * 1e3, "reason": plan.reason}
    prepare("allgather", ours_ag, lambda: rel_err(torch, a_full_ours, a_full))
    prepare("gemm", ours_gemm)
    if symm.fn is not None:
        holder = {}

        def symm_call():
            holder["c"] = symm(a, w.t())

        prepare("symm", symm_call, lambda: rel_err(torch, holder["c"], c_ref))
    else:
        rec["symm_note"] = symm.reason
    if P > 1:  # the other side of the planner's decision: copy-engine fusion vs unfused
        alt = "unfused" if plan.path != "unfused" else "fused_ce"
        prepare("forced", lambda: mk.ag_gemm(ctx, A, W, CO, b_layout="nk", stream=sh, path=alt),
                lambda: rel_err(torch, c_ours, c_ref))
        rec["forced_path"] = alt
    for pth in paths:  # --paths: more forced paths, in the same rounds (JSON and stdout only)
        kw = path_kwargs(pth, agm.PATHS)
        prepare("path_" + pth, lambda kw=kw: mk.ag_gemm(ctx, A, W, CO, b_layout="nk", stream=sh, **kw),
                lambda: rel_err(torch, c_ours, c_ref))
    # every rank times the same methods (their calls are collective)
    common = set.intersection(*[set(m) for m in comm.allgather(list(methods))])
    stats = {}
    try:
        stats = C.time_interleaved({k: f for k, f in methods.items() if k in common}, rp["warmup"], rp["reps"],
                                   rp["batch"], barrier=comm.Barrier, host_lead=True,
                                   agree=lambda v: max(comm.allgather(v)))
        ctx.check()
    except Exception as exc:  # noqa: BLE001
        rec["timing_note"] = f"{type(exc).__name__}: {exc}"[:300]
        stats = {}
    for key in ("nccl", "ours", "allgather", "gemm", "symm", "forced", *("path_" + q for q in paths)):
        # (``common`` and a timing failure are the same on every rank: collective either way)
        rec[key + "_ms"] = C.max_over_ranks(stats[key]["median_ms"], comm)[0] if key in stats else None
        rec[key + "_host_ms"] = C.max_over_ranks(stats[key]["host_ms"], comm)[0] if key in stats else None
    # derived numbers
    t = {k: rec.get(k + "_ms") for k in ("nccl", "symm", "gemm", "allgather", "ours", "forced")}
    ok = lambda v: v is not None and v == v and v > 0  # noqa: E731
    if ok(t["gemm"]) and ok(t["allgather"]):
        rec["floor_ms"] = max(t["gemm"], t["allgather"])
    for k, v in t.items():
        if ok(v):
            rec[k + "_tflops"] = flops / (v * 1e-3) / 1e12
    if ok(t["ours"]):
        if ok(t["nccl"]):
            rec["speedup_vs_nccl"] = t["nccl"] / t["ours"]
        if ok(t["symm"]):
            rec["speedup_vs_symm"] = t["symm"] / t["ours"]
        if rec.get("floor_ms"):
            rec["overlap_eff"] = rec["floor_ms"] / t["ours"]
    del a, w, a_full, c_ref, c_ours, a_full_ours, c_gemm, A, W, CO, AF, CG
    torch.cuda.empty_cache()
    return rec


def report(results, meta, out_dir: Path) -> str:
    headers = ["shape", "M", "N/P", "K", "(a) NCCL+mm ms", "(b) torch symm ms", "gemm ms", "allgather ms",
               "floor ms", "(d) ours ms", "ours TFLOP/s/GPU", "vs (a)", "vs (b)", "overlap eff", "path (comm SMs)",
               "pred ms", "(e) other path ms", "host us/call (a) / (d)"]
    rows = []
    for r in results:
        p = r.get("plan", {})
        path = f"{p.get('path', '?')} ({p.get('comm_sms', '-')})"
        pred = p.get("pred_unfused_ms") if p.get("path") == "unfused" else p.get("pred_fused_ms")
        notes = [r[k] for k in r if k.endswith("_note") and k != "symm_note"]
        rows.append([r["name"] + (" [" + "; ".join(notes) + "]" if notes else ""), r["M"], r["N_per_rank"], r["K"],
                     _f(r.get("nccl_ms"), ".3f"), _f(r.get("symm_ms"), ".3f"), _f(r.get("gemm_ms"), ".3f"),
                     _f(r.get("allgather_ms"), ".3f"), _f(r.get("floor_ms"), ".3f"), _f(r.get("ours_ms"), ".3f"),
                     _f(r.get("ours_tflops"), ".0f"), _f(r.get("speedup_vs_nccl"), ".2f"),
                     _f(r.get("speedup_vs_symm"), ".2f"), _f(r.get("overlap_eff"), ".2f"), path, _f(pred, ".3f"),
                     _f(r.get("forced_ms"), ".3f") + (f" ({r['forced_path']})" if "forced_path" in r else ""),
                     _f(_us(r.get("nccl_host_ms")), ".0f") + " / " + _f(_us(r.get("ours_host_ms")), ".0f")])
    symm_notes = sorted({r["symm_note"] for r in results if r.get("symm_note")})
    md = [f"# AllGather + GEMM benchmark ({meta['P']} x {meta['gpu']})", "",
          f"{meta['date']}, torch {meta['torch']}, NCCL {meta['nccl']}, {'--quick, ' if meta['quick'] else ''}"
          f"{meta['elapsed_s']:.0f} s.  bf16, weights [N, K] (b_layout='nk'); times are the max over ranks of "
          "the median per-call time, every method of a shape timed in the same alternating rounds, each batch "
          "started behind a GPU-side delay that outlasts its submission, the same on every rank (GPU time only: the host's submission "
          "of the calls, shown in the last column, runs ahead of the GPU in a real pipeline).  (a) NCCL all_gather_into_tensor + torch.matmul; (b) "
          "torch.ops.symm_mem.fused_all_gather_matmul; floor = max(our GEMM alone, our all_gather alone); "
          "(d) mkernel.ag_gemm (automatic plan); overlap eff = floor / (d); pred = the planner's prediction for "
          "the path it chose (fused_ce: GEMM on every SM, copy engines move the shards; unfused: our "
          "all-gather then our GEMM); (e) the other side of the planner's decision, forced.", "",
          C.markdown_table(headers, rows)]
    if symm_notes:
        md += ["", "(b) unavailable: " + " / ".join(symm_notes)]
    text = "\n".join(md) + "\n"
    (out_dir / "ag_gemm_bench.md").write_text(text)
    C.write_json(out_dir / "ag_gemm_bench.json", {"meta": meta, "results": results})
    try:
        plot(results, out_dir / "ag_gemm_bench.png", meta)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    return text


def plot(results, path: Path, meta) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = []
    for r in results:
        if r["name"] not in groups:
            groups.append(r["name"])
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 4.0), squeeze=False)
    series = [("nccl", "(a) NCCL+mm", "s--"), ("symm", "(b) torch symm", "^--"), ("ours", "(d) mkernel", "o-")]
    for ax, name in zip(axes[0], groups):
        rs = [r for r in results if r["name"] == name]
        xs = [r["M"] for r in rs]
        for key, label, style in series:
            ys = [r.get(key + "_tflops") for r in rs]
            pts = [(x, y) for x, y in zip(xs, ys) if y]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label, ms=4)
        fl = [(r["M"], r["flops_per_gpu"] / (r["floor_ms"] * 1e-3) / 1e12) for r in rs if r.get("floor_ms")]
        if fl:
            ax.plot([p[0] for p in fl], [p[1] for p in fl], ":", color="gray", label="floor (no overlap loss)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs], rotation=45)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("total M (tokens)")
        ax.set_ylabel("TFLOP/s per GPU")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"AllGather + GEMM, {meta['P']} x {meta['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 shapes, fewer batches (< 2 min)")
    ap.add_argument("--out", default=str(HERE.parent / "docs"), help="output folder (default docs/)")
    ap.add_argument("--max-m", type=int, default=1 << 30, help="skip shapes with a larger total M")
    ap.add_argument("--min-m", type=int, default=0, help="skip shapes with a smaller total M")
    ap.add_argument("--only", default="", help="comma-separated shapes to run: NAME (every M) or NAME@M")
    ap.add_argument("--paths", default="", help="comma-separated ag_gemm paths (fused, fused_ce, unfused, "
                    "fused@N: the SM path with N communication SMs) to time too, forced, in the same rounds: JSON (path_<name>_ms) and stdout only")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="no GPU: merge the results of earlier runs (their ag_gemm_bench.json) into one report")
    args = ap.parse_args()
    t_start = time.monotonic()
    if args.merge:
        import json

        parts = [json.loads(Path(f).read_text()) for f in args.merge]
        meta = dict(parts[0]["meta"], elapsed_s=sum(p["meta"]["elapsed_s"] for p in parts))
        results = [r for p in parts for r in p["results"]]
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        print(report(results, meta, out_dir), flush=True)
        return 0

    ctx = C.bootstrap()
    import torch
    import torch.distributed as dist

    import mkernel as mk

    from mkernel.ops import ag_gemm as agm
    from mkernel.ops import gemm as G
    comm, P = ctx.world, ctx.local_size
    say = lambda *a: C.rank0_print(comm, *a)  # noqa: E731
    if ctx.size != P:
        say("WARNING: run on one node: mkernel's ops span the ranks of a node, NCCL spans the world")
    if ctx.local_rank == 0:  # every specialization into the disk cache, in parallel
        agm.precompile()
        G.precompile([G.defines("bfloat16", "bfloat16", c) for c in (1, 2, 3)])
    comm.Barrier()
    symm = TorchSymmMem(torch, dist)
    todo = [s for s in C.select_shapes(shapes(P, args.quick), args.only) if args.min_m <= s[1] <= args.max_m]
    paths = tuple(q.strip() for q in args.paths.split(",") if q.strip())
    try:
        for q in paths:
            path_kwargs(q, agm.PATHS)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    say(f"{P} ranks, {torch.cuda.get_device_name()}, torch {torch.__version__}, {len(todo)} shapes; torch symm "
        f"mem: {'available' if symm.fn is not None else symm.reason}")
    results = []
    for name, M, N, K in todo:
        rec = measure_shape(ctx, torch, dist, mk, agm, symm, name, M, N, K, args.quick, paths)
        results.append(rec)
        p = rec.get("plan", {})
        say(f"{name:20s} M={M:6d} N/P={N:6d} K={K:6d}: NCCL+mm {_f(rec.get('nccl_ms'), '8.3f')} | symm "
            f"{_f(rec.get('symm_ms'), '8.3f')} | gemm {_f(rec.get('gemm_ms'), '8.3f')} ag "
            f"{_f(rec.get('allgather_ms'), '7.3f')} | ours {_f(rec.get('ours_ms'), '8.3f')} ms "
            f"{_f(rec.get('ours_tflops'), '4.0f')} TF/s x{_f(rec.get('speedup_vs_nccl'), '.2f')} "
            f"eff {_f(rec.get('overlap_eff'), '.2f')} {p.get('path')}({p.get('comm_sms')}) "
            f"{'; '.join(str(v) for k, v in rec.items() if k.endswith('_note') and k != 'symm_note')} "
            + "".join(f"| {q} {_f(rec.get('path_' + q + '_ms'), '8.3f')} " for q in paths)
            + f"[{time.monotonic() - t_start:.0f} s]")
    if ctx.rank == 0:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "P": P, "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "quick": args.quick, "elapsed_s": time.monotonic() - t_start,
                "model": dataclasses.asdict(agm.AgGemmOptions.default().model)}
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            print("\n" + report(results, meta, out_dir), flush=True)
            print(f"wrote {out_dir}/ag_gemm_bench.md / .png / .json", flush=True)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            C.write_json(out_dir / "ag_gemm_bench.json", {"meta": meta, "results": results})
    comm.Barrier()
    C.shutdown(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
