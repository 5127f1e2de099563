#!/usr/bin/env python
"""mkernel.gemm against torch.matmul (cuBLAS) on one GPU, in the same run.

    python bench/gemm.py [--quick] [--sweep] [--config ID] [--only NAME[@M],...] [--out DIR] [--reps N] [--eager]

Shapes: squares 1024..16384 (B "kn": C = A @ B) and the projection GEMMs of Llama-3-70B and
DeepSeek-V3 for M (tokens) in {128, 512, 2048, 8192, 16384} with weights stored [N, K] as
frameworks do (mkernel b_layout="nk", torch ``A @ W.t()``).  bf16 in, bf16 out, fp32 accumulation.
The full run adds decode-shaped rows (``decode:`` names: M in DECODE_MS against six of those
weights, the calls mkernel routes to its decode kernel), summarized apart from the 70 shapes above.

Timing: inputs are torch tensors (random normal), handed to mkernel once as DeviceArrays
(zero-copy); enough input sets to exceed 2x L2 are rotated so every call reads from HBM.  Each
library is captured into a CUDA graph of `batch` back-to-back calls (no Python launch overhead in
the timing; ``--eager`` times plain launches instead), replayed after a warm-up, timed with CUDA
events, mkernel's and cuBLAS's replays alternating (so clock changes under the power cap hit both
alike); the reported time is the median per-call time over the replays.  Each shape is first
checked: mkernel's result must match torch's to a relative Frobenius error < 1e-2.

Reports TFLOP/s (2*M*N*K / t), the ratio to cuBLAS, mkernel's tile config, registers per thread
(ptxas; 2- / 3-consumer configs then rebalance 40/232 / 40/152 with setmaxnreg), dynamic shared memory per block,
and the NVRTC compile time of each module.  Writes ``<out>/gemm_bench.md``, ``gemm_bench.png`` and
``gemm_bench.json`` (default ``docs/``).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import markdown_table, select_shapes, setup_env, time_interleaved, write_json  # noqa: E402

LLAMA3_70B = {  # hidden 8192, ffn 28672, 64 q heads / 8 kv heads, head dim 128
    "llama70b.qkv": (10240, 8192),
    "llama70b.o": (8192, 8192),
    "llama70b.gate_up": (57344, 8192),
    "llama70b.down": (8192, 28672),
}
DEEPSEEK_V3 = {  # hidden 7168, q_lora 1536, kv_lora 512 (+64 rope), 128 heads, moe inter 2048, dense 18432
    "dsv3.q_a": (1536, 7168),
    "dsv3.q_b": (24576, 1536),
    "dsv3.kv_a": (576, 7168),
    "dsv3.kv_b": (32768, 512),
    "dsv3.o": (7168, 16384),
    "dsv3.dense_gate_up": (36864, 7168),
    "dsv3.dense_down": (7168, 18432),
    "dsv3.moe_gate_up": (4096, 7168),
    "dsv3.moe_down": (7168, 2048),
}
WEIGHTS = {**LLAMA3_70B, **DEEPSEEK_V3}  # name -> (N, K)
MS = (128, 512, 2048, 8192, 16384)
DECODE_MS = (1, 4, 8, 16)
DECODE_WEIGHTS = ("llama70b.qkv", "llama70b.o", "llama70b.down", "dsv3.q_a", "dsv3.o", "dsv3.moe_down")
DECODE = "decode:"  # name prefix of the decode-shaped rows


def is_decode(name: str) -> bool:
    return name.startswith(DECODE)


def shapes(quick: bool):
    """[(name, M, N, K, layout)]."""
    out = []
    squares = (2048, 4096, 8192) if quick else (1024, 2048, 4096, 8192, 16384)
    for s in squares:
        out.append((f"square{s}", s, s, s, "kn"))
    if quick:
        picks = [("llama70b.qkv", 2048), ("llama70b.down", 8192), ("dsv3.q_a", 2048), ("dsv3.kv_b", 8192),
                 ("dsv3.moe_down", 512), ("llama70b.gate_up", 128)]
        for name, m in picks:
            n, k = WEIGHTS[name]
            out.append((name, m, n, k, "nk"))
        return out
    for table in (LLAMA3_70B, DEEPSEEK_V3):
        for name, (n, k) in table.items():
            for m in MS:
                out.append((name, m, n, k, "nk"))
    for name in DECODE_WEIGHTS:
        n, k = WEIGHTS[name]
        for m in DECODE_MS:
            out.append((DECODE + name, m, n, k, "nk"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few shapes (~60 s)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs"))
    ap.add_argument("--reps", type=int, default=0, help="graph replays per shape (default: 5 quick, 10 full)")
    ap.add_argument("--eager", action="store_true", help="time plain launches instead of CUDA graphs")
    ap.add_argument("--config", type=int, default=None, help="force an mkernel tile config")
    ap.add_argument("--sweep", action="store_true",
                    help="also time every (non-debug) config per shape (calibrates the heuristic)")
    ap.add_argument("--sweep-configs", type=lambda v: {int(x) for x in v.split(",")}, default=None,
                    help="with --sweep: only these config ids (comma-separated)")
    ap.add_argument("--only", default="", help="comma-separated shapes to run: NAME (every M) or NAME@M")
    ap.add_argument("--replot", metavar="JSON", help="no GPU: rewrite the table and plot from an earlier run's JSON")
    args = ap.parse_args()
    if args.replot:
        import json

        d = json.loads(Path(args.replot).read_text())
        m = d.get("meta", {})
        for r in d["results"]:  # JSON object keys are strings: config ids and split factors back to ints
            sw = r.get("sweep") or {}
            r["sweep"] = {(k if k == "splits" else int(k)): (v if k != "splits" else {int(a): b for a, b in v.items()})
                          for k, v in sw.items()}
        d["compile_seconds"] = {int(k): v for k, v in d["compile_seconds"].items()}
        write_report(Path(args.out), d["results"], d["device"], d["compile_seconds"], m.get("reps", 10),
                     m.get("quick", False), m.get("eager", False))
        return
    setup_env()
    import torch

    import mkernel
    from mkernel.ops import gemm as G
    from mkernel.ops.gemm import configs as GC, heuristic as GH
    from mkernel.core import compiler as CP
    from mkernel.core import driver as DRV
    from mkernel.core.interop import as_device_array

    torch.cuda.init()
    dev = torch.cuda.current_device()
    torch.empty(1, device="cuda")  # make torch's primary context current for mkernel too
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    reps = args.reps or (5 if args.quick else 10)
    print(f"# {props.name}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB, torch {torch.__version__}, "
          f"cuda-python/mkernel {mkernel.__version__}", flush=True)

    # NVRTC compile time of every module we may use (fresh compiles, not the disk cache)
    arch = DRV.current_arch()
    compile_s = {}
    for cid in sorted(G.CONFIGS):
        t0 = time.perf_counter()
        CP.compile_module(GC.SOURCE, G.defines("bfloat16", "bfloat16", cid), arch=arch, use_disk_cache=False)
        compile_s[cid] = time.perf_counter() - t0
    print("# NVRTC compile seconds per module (bf16->bf16):",
          ", ".join(f"config {c}: {s:.1f}" for c, s in compile_s.items()), flush=True)

    results = []
    t_start = time.time()
    for name, M, N, K, layout in select_shapes(shapes(args.quick), args.only):
        flop = 2.0 * M * N * K
        A, B, C, Cr = make_inputs(M, N, K, layout, l2)
        nsets = len(A)
        dA = [as_device_array(x) for x in A]
        dB = [as_device_array(x) for x in B]
        dC = [as_device_array(x) for x in C]

        def ours(i):
            G.gemm(dA[i], dB[i], dC[i], b_layout=layout, stream=torch.cuda.current_stream(), config=args.config)

        def theirs(i):
            if layout == "kn":
                torch.matmul(A[i], B[i], out=Cr[i])
            else:
                torch.matmul(A[i], B[i].t(), out=Cr[i])

        # correctness first
        ours(0)
        theirs(0)
        torch.cuda.synchronize()
        ref = Cr[0].float()
        err = ((C[0].float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        ok = err < 1e-2

        batch = batch_for(flop, nsets)
        t_ours, t_theirs = _time_alternating([_runner(ours, nsets, batch, args.eager),
                                              _runner(theirs, nsets, batch, args.eager)], batch, reps)
        info = G.describe(M, N, K, b_layout=layout, config=args.config)
        sweep = {}
        if args.sweep:
            for cid in (c for c in sorted(G.CONFIGS) if not G.CONFIGS[c].debug
                        and (not args.sweep_configs or c in args.sweep_configs)):
                if layout == "kn" and G.CONFIGS[cid].bn_kn is not None:
                    continue

                def forced(i, cid=cid):
                    G.gemm(dA[i], dB[i], dC[i], b_layout=layout, stream=torch.cuda.current_stream(), config=cid)

                forced(0)
                torch.cuda.synchronize()
                e = ((C[0].float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                t = _time(forced, nsets, batch, reps, args.eager)
                sweep[cid] = dict(tflops=flop / t / 1e12, err=e, ok=e < 1e-2)
            print("    sweep: " + "  ".join(f"cfg {c} {v['tflops']:.0f}{'' if v['ok'] else ' ERR'}"
                                            for c, v in sweep.items()), flush=True)
            # split-K factors of the chosen config, where its tiles leave SMs idle
            cfg0 = G.CONFIGS[info["config"]]
            if info["tiles"] < props.multi_processor_count and GH.max_splits(cfg0, M, N, K, layout) > 1:
                ssweep = {}
                for sp in (1, 2, 3, 4, 6, 8, 12, 16):
                    if sp > GH.max_splits(cfg0, M, N, K, layout):
                        break

                    def split(i, sp=sp):
                        G.gemm(dA[i], dB[i], dC[i], b_layout=layout, stream=torch.cuda.current_stream(),
                               config=cfg0.id, splits=sp)

                    split(0)
                    torch.cuda.synchronize()
                    e = ((C[0].float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                    t = _time(split, nsets, batch, reps, args.eager)
                    ssweep[sp] = dict(tflops=flop / t / 1e12, err=e, ok=e < 1e-2)
                sweep["splits"] = ssweep
                print(f"    splits (cfg {cfg0.id}): " + "  ".join(
                    f"{sp}: {v['tflops']:.0f}{'' if v['ok'] else ' ERR'}" for sp, v in ssweep.items()), flush=True)
        tf_o, tf_t = flop / t_ours / 1e12, flop / t_theirs / 1e12  # _time returns seconds
        r = dict(name=name, M=M, N=N, K=K, layout=layout, ms=t_ours, cublas_ms=t_theirs, tflops=tf_o,
                 cublas_tflops=tf_t, ratio=tf_o / tf_t, err=err, ok=ok, config=info["config"],
                 tile=tile_label(info),
                 splits=info["splits"],
                 registers=info["registers"],
                 smem=info["smem"], grid=info["grid"], tiles=info["tiles"], nsets=nsets, batch=batch,
                 sweep=sweep)
        results.append(r)
        print(f"{name:20s} M={M:6d} N={N:6d} K={K:6d} {layout}  mkernel {tf_o:6.0f} TFLOP/s  cuBLAS {tf_t:6.0f}  "
              f"ratio {r['ratio']:.2f}  cfg {info['config']} {r['tile']}  err {err:.1e}", flush=True)
        del A, B, C, Cr, dA, dB, dC
        torch.cuda.empty_cache()

    out = Path(args.out)
    write_report(out, results, props.name, compile_s, reps, args.quick, args.eager)
    print(f"# wrote {out / 'gemm_bench.md'}, .png, .json in {time.time() - t_start:.0f} s")


def tile_label(info: dict) -> str:
    """The table's tile column from ``mkernel.ops.gemm.describe``: ``BMxBNx64/Sst`` (``pp``: ping-pong,
    ``split S``: split-K, ``T``: computed transposed, the tile over the N x M problem), or for the decode
    kernel its MMA rows and rows of B per block."""
    if info["config"] == "gemv":
        return f"gemv {info['bm']}x{info['bn']}"
    return (f"{'T ' if info.get('swapped') else ''}{info['bm']}x{info['bn']}x64/{info['stages']}st"
            f"{' pp' if info['pingpong'] else ''}" + (f" split {info['splits']}" if info["splits"] > 1 else ""))


def summary(results) -> list[str]:
    """The report's ratio lines: geometric mean and min over the squares and projection shapes (the
    targets), squares >= 4096 apart, then the decode-shaped rows on a line of their own."""
    main = [r["ratio"] for r in results if not is_decode(r["name"])]
    big = [r["ratio"] for r in results if r["name"].startswith("square") and r["M"] >= 4096]
    lines = []
    if main:
        lines.append(f"Ratio to cuBLAS: geometric mean {statistics.geometric_mean(main):.2f}, min {min(main):.2f}"
                     + (f", squares >= 4096: min {min(big):.2f}" if big else "") + ".")
    dec = [r for r in results if is_decode(r["name"])]
    if dec:
        worst = min(dec, key=lambda r: r["ratio"])
        lines.append(f"Decode-shaped rows (M <= {max(r['M'] for r in dec)}, not among the shapes above): "
                     f"geometric mean {statistics.geometric_mean([r['ratio'] for r in dec]):.2f}, "
                     f"min {worst['ratio']:.2f} ({worst['name'][len(DECODE):]} M={worst['M']}).")
    return lines


def write_report(out: Path, results, device: str, compile_s, reps: int, quick: bool, eager: bool):
    """gemm_bench.md (table, config and split sweeps), .json and .png under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [[r["name"], r["M"], r["N"], r["K"], r["layout"], f"{r['ms'] * 1e6:.1f}", f"{r['tflops']:.0f}",
             f"{r['cublas_tflops']:.0f}", f"{r['ratio']:.2f}", r["config"], r["tile"], r["registers"],
             f"{r['smem'] // 1024} KiB",
             "ok" if r["ok"] else f"ERR {r['err']:.1e}"] for r in results]
    headers = ["shape", "M", "N", "K", "B", "us", "mkernel TFLOP/s", "cuBLAS TFLOP/s", "ratio", "cfg", "tile",
               "regs", "smem", "check"]
    md = [f"# mkernel.gemm vs cuBLAS ({device})", "",
          f"bf16 in/out, fp32 accumulation; {'CUDA graphs' if not eager else 'eager launches'}, "
          f"inputs rotated over >= 2x L2; median of {reps} replays.  Generated by `python bench/gemm.py"
          f"{' --quick' if quick else ''}`.", "",
          "NVRTC compile time per module (bf16->bf16): "
          + ", ".join(f"config {c} {s:.1f} s" for c, s in compile_s.items()) + ".", "",
          *[x for line in summary(results) for x in (line, "")],
          "Registers: per thread at launch (ptxas, or the driver where NVRTC gives no report); the 2-consumer "
          "configs rebalance to 40 (producer) / 232 (consumers) with setmaxnreg, the 3-consumer config 40 to "
          "40 / 152.", "",
          markdown_table(headers, rows), ""]
    if any(r["sweep"] for r in results):
        cids = sorted({c for r in results for c in r["sweep"] if c != "splits"})
        md += ["Config sweep (`--sweep`; TFLOP/s of each forced config, * = the heuristic's pick):", "",
               markdown_table(["shape", "M", "N", "K"] + [f"cfg {c}" for c in cids],
                              [[r["name"], r["M"], r["N"], r["K"]]
                               + [(f"{r['sweep'][c]['tflops']:.0f}" + ("*" if c == r["config"] else "")
                                   + ("" if r["sweep"][c]["ok"] else " ERR")) if c in r["sweep"] else "-"
                                  for c in cids] for r in results]), ""]
    split_rows = [r for r in results if r["sweep"].get("splits")]
    if split_rows:
        sps = sorted({sp for r in split_rows for sp in r["sweep"]["splits"]})
        md += ["Split-K sweep of the chosen config (TFLOP/s per forced split factor, * = the heuristic's):", "",
               markdown_table(["shape", "M", "N", "K", "cfg"] + [f"{sp}" for sp in sps],
                              [[r["name"], r["M"], r["N"], r["K"], r["config"]]
                               + [(f"{r['sweep']['splits'][sp]['tflops']:.0f}" + ("*" if sp == r["splits"] else "")
                                   + ("" if r["sweep"]["splits"][sp]["ok"] else " ERR"))
                                  if sp in r["sweep"]["splits"] else "-" for sp in sps] for r in split_rows]), ""]
    (out / "gemm_bench.md").write_text("\n".join(md))
    write_json(out / "gemm_bench.json", dict(device=device, compile_seconds=compile_s, results=results,
                                             meta=dict(reps=reps, quick=quick, eager=eager)))
    _plot(out / "gemm_bench.png", results, device)


def make_inputs(M: int, N: int, K: int, layout: str, l2: int, seed: int = 1234, pad: int = 0):
    """(A, B, C, C_ref): lists of as many bf16 input sets (random normal; B [K, N] "kn" or [N, K] "nk")
    and outputs as it takes to exceed 2x L2 (at most 8; one where that would pass 40 GiB), so that
    rotating over them makes every call read its inputs from HBM.  ``pad``: A and B are views of
    buffers with rows ``pad`` elements longer."""
    import torch

    b_rows, b_cols = (K, N) if layout == "kn" else (N, K)
    bytes_per_set = 2 * (M * (K + pad) + b_rows * (b_cols + pad) + M * N)
    nsets = max(1, min(8, math.ceil(2 * l2 / bytes_per_set)))
    if bytes_per_set * nsets > 40 << 30:
        nsets = 1
    gen = torch.Generator(device="cuda").manual_seed(seed)
    A = [torch.randn(M, K + pad, device="cuda", dtype=torch.bfloat16, generator=gen)[:, :K] for _ in range(nsets)]
    B = [torch.randn(b_rows, b_cols + pad, device="cuda", dtype=torch.bfloat16, generator=gen)[:, :b_cols]
         for _ in range(nsets)]
    C = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(nsets)]
    Cr = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(nsets)]
    return A, B, C, Cr


def plan_label(plan) -> str:
    """c<config>x<splits>[f<split_from>][p] of a plain GEMM plan (p: a programmatic dependent launch; s
    instead of c: computed transposed); a decode plan's name."""
    if plan.kind != "tiles":
        return plan.kind
    sf = f"f{plan.split_from}" if plan.splits != 1 and plan.split_from else ""
    return f"{'s' if plan.swapped else 'c'}{plan.config}x{plan.splits}{sf}" + ("p" if plan.dependent else "")


class GemmProblem:
    """One M x N x K call (B "nk" = [N, K] or "kn" = [K, N]; operand rows ``pad`` elements longer than
    their data) for the probes and the plan / random-shape benches: make_inputs' torch tensors (A, B, C,
    Cr; C NaN-poisoned) and mkernel's views of them (dA, dB, dC), the input sets and calls per timed
    replay (~batch_ms of work), cuBLAS's CUDA-graph runner, and ``runner(fn)`` for ours."""

    def __init__(self, M: int, N: int, K: int, l2: int, layout: str = "nk", pad: int = 0, batch_ms: float = 50.0):
        import torch

        from mkernel.core.interop import as_device_array

        self.layout = layout
        self.A, self.B, self.C, self.Cr = make_inputs(M, N, K, layout, l2, pad=pad)
        self.poison()
        self.dA, self.dB, self.dC = ([as_device_array(x) for x in xs] for xs in (self.A, self.B, self.C))
        self.nsets = len(self.A)
        self.batch = batch_for(2.0 * M * N * K, self.nsets, batch_ms)
        Bt = [b if layout == "kn" else b.t() for b in self.B]
        self.cublas = self.runner(lambda i: torch.matmul(self.A[i], Bt[i], out=self.Cr[i]))

    def runner(self, fn):
        return _runner(fn, self.nsets, self.batch, False)

    def poison(self):
        """NaN in every output buffer of ours (so error() fails a call that left any element unwritten)."""
        for c in self.C:
            c.fill_(float("nan"))

    def ours(self, i: int, stream, **kw):
        """mkernel.gemm on input set i (kw: config, splits, swap)."""
        from mkernel.ops import gemm as G

        G.gemm(self.dA[i], self.dB[i], self.dC[i], b_layout=self.layout, stream=stream, **kw)

    def error(self) -> float:
        """Relative Frobenius distance (float64) of ours from cuBLAS on input set 0 (both must have run)."""
        c, r = self.C[0].double(), self.Cr[0].double()
        return ((c - r).norm() / r.norm()).item()


def batch_for(flop: float, nsets: int, target_ms: float = 50.0) -> int:
    """Calls per timed replay: ~target_ms of work at a guessed 600 TFLOP/s, a multiple of nsets, <= 200."""
    est_ms = flop / 600e12 * 1e3
    return max(nsets, min(200, int(math.ceil(target_ms / max(est_ms, 1e-3) / nsets)) * nsets))


def _runner(fn, nsets, batch, eager):
    """A callable that runs `batch` calls of fn (rotating over nsets inputs): a CUDA graph replay, or
    eager launches where capture fails (or with --eager)."""
    import torch

    for i in range(nsets):  # warm-up / plan building outside any capture
        fn(i)
    torch.cuda.synchronize()
    graph = None
    if not eager:
        try:
            graph = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for i in range(nsets):  # plans for this stream handle
                    fn(i)
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, stream=s):
                    for j in range(batch):
                        fn(j % nsets)
            torch.cuda.current_stream().wait_stream(s)
        except Exception as exc:  # fall back to eager timing
            print(f"#   (graph capture failed: {exc!s:.100}; timing eager launches)", flush=True)
            graph = None
            torch.cuda.synchronize()
    run = graph.replay if graph is not None else (lambda: [fn(j % nsets) for j in range(batch)])
    run()
    torch.cuda.synchronize()
    return run


def _time_alternating(runs, batch, reps):
    """Median seconds per call of each runner (`batch` calls a run), timed in alternating rounds
    (_common.time_interleaved: one replay each per round), so clocks drifting under the power cap
    affect them alike."""
    stats = time_interleaved({j: run for j, run in enumerate(runs)}, warmup=0, rounds=reps)
    return [stats[j]["median_ms"] / 1e3 / batch for j in range(len(runs))]


def _time(fn, nsets, batch, reps, eager):
    """Median seconds per call over `reps` replays of `batch` calls (rotating over nsets inputs)."""
    return _time_alternating([_runner(fn, nsets, batch, eager)], batch, reps)[0]


def _plot(path, results, device):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(20, 7), gridspec_kw=dict(width_ratios=[1, 4]))
    sq = [r for r in results if r["name"].startswith("square")]
    ax = axes[0]
    if sq:
        xs = [r["M"] for r in sq]
        ax.plot(xs, [r["tflops"] for r in sq], "o-", label="mkernel")
        ax.plot(xs, [r["cublas_tflops"] for r in sq], "s--", label="cuBLAS")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M = N = K")
        ax.set_ylabel("TFLOP/s")
        ax.set_title("square GEMM (bf16)")
        ax.legend()
        ax.grid(alpha=0.3)
    ax = axes[1]
    pr = [r for r in results if not r["name"].startswith("square")]
    if pr:
        labels = [f"{r['name']} M={r['M']}" for r in pr]
        ax.bar(range(len(pr)), [r["ratio"] for r in pr],
               color=["tab:green" if r["ratio"] >= 1.0 else "tab:orange" if r["ratio"] >= 0.9 else "tab:red"
                      for r in pr])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(0.9, color="k", lw=0.8, ls=":")
        first_decode = next((i for i, r in enumerate(pr) if is_decode(r["name"])), None)
        if first_decode:
            ax.axvline(first_decode - 0.5, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(pr)))
        ax.set_xticklabels(labels, rotation=90, fontsize=5.5)
        ax.set_xlim(-0.6, len(pr) - 0.4)
        ax.set_ylabel("mkernel / cuBLAS throughput")
        ax.set_title("projection GEMMs (weights [N, K])" + ("; right of the dashed line: decode-shaped rows"
                                                             if first_decode else ""))
    fig.suptitle(f"mkernel.gemm vs cuBLAS on {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
