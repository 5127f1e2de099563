#!/usr/bin/env python
"""MoE expert parallelism on N ranks of one node: our MoE ops against torch + NCCL, in the same run (issue 38
item 8; docs/moe.md).

    mpirun --allow-run-as-root --oversubscribe --bind-to none -np N python bench/moe.py [--quick] [--out DIR]
        [--configs deepseek8,deepseek32,mixtral] [--tokens 128,512,4096,16384]

Configurations: DeepSeek-V3-like (hidden 7168, expert ffn 2048, top-8, experts per rank 8 and 32: 256 experts
scaled to the rank count) and Mixtral-like (hidden 4096, ffn 14336, 8 experts in all, top-2); tokens per rank
in {128 (decode), 512, 4096, 16384}.  A configuration that would not fit in the GPU's free memory is skipped
with a row saying why.  bf16 activations and weights ``w_gate_up [E_local, 2F, H]``, ``w_down [E_local, H, F]``
shared by every method; router logits fp32 (top-k, weights = softmax over the k chosen).

Methods of a configuration, in the same run:
  (a) torch: NCCL ``all_to_all_single`` dispatch (one row per (token, expert), the usual recipe; the split
      sizes go through the host) + ``torch._grouped_mm`` (or a per-expert loop of matmuls where it is missing
      or fails) + SwiGLU + ``all_to_all_single`` combine + weighted sum in fp32;
  (b) ours, unfused pieces: ``moe_route``, ``moe_dispatch``, ``moe_combine`` each timed alone, and the
      pieces called one after another (route, dispatch, ``grouped_gemm`` gate/up, SwiGLU (torch),
      ``grouped_gemm`` down, combine) as "(b) pieces"; the whole ``mkernel.moe_layer`` (default options, and
      with ``MoeOptions(swiglu_epilogue=False)``: the separate SwiGLU kernel, and with
      ``MoeOptions(fused_combine=True)``: the down GEMM fused with the combine, and with
      ``MoeOptions(one_kernel=True)``: everything after the routing in one kernel);
  (c) ours fused: ``moe_dispatch_gemm`` alone and ``moe_layer`` with ``MoeOptions(fused=True)``;
  at <= 256 tokens per rank also low-latency mode (``MoeOptions(mode="low_latency")``: routing + dispatch
  in one kernel, combine, and the layer).
The layers' outputs are checked against (a) (relative Frobenius error < 2e-2) on the first call.

Timing: CUDA events on torch's current stream (our ops get ``stream=`` it), every method of a configuration in
the same alternating rounds, each batch behind a GPU-side delay that outlasts its submission (bench/_common.py
``Methods`` / ``time_interleaved``); the reported time is the max over ranks of each rank's median per call;
the host's submission time per eager call is reported beside.  Bandwidth = unique bytes / time, unique bytes
= (rows sent to other ranks, once per destination rank) x H x 2 bytes, the mean over ranks (combine returns
the same rows); layer TFLOP/s per rank = 2 x (T x k) x H x 3F / t (gate/up 2F plus down F per routed row).
With ranks sharing one GPU the numbers say nothing about NVLink: every row and the title say so and the
targets stay pending.  Writes ``<out>/moe_bench.{md,json,png}`` (default docs/; ``--json FILE``: also that
file; ``--replot JSON``: the report again from a run's JSON, no GPU; the JSON is rewritten after every
configuration, so a run cut short leaves what it measured).  NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set before torch is imported.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import _common as C  # noqa: E402

_f = C.fmt_or_na

C.setup_env()  # before torch is imported anywhere

TOKENS = (128, 512, 4096, 16384)
CONFIGS = {  # name: (hidden H, expert ffn F, experts per rank (None: 8 in all), top-k)
    "deepseek8": (7168, 2048, 8, 8),
    "deepseek32": (7168, 2048, 32, 8),
    "mixtral": (4096, 14336, None, 2),
}
LOW_LATENCY_MAX = 256
REL_TOL = 2e-2
SHARED = "shared GPU: not a speed"
# issue 38's targets (2x H200)
TARGET_BW_GBS, TARGET_BW_MIN_T = 300.0, 4096
TARGET_LL_US, TARGET_LL_T, TARGET_LL_H = 25.0, 128, 7168
TARGET_VS_A, TARGET_VS_B = 1.5, 1.15
TARGETS = [f"dispatch and combine >= {TARGET_BW_GBS:.0f} GB/s per rank at >= {TARGET_BW_MIN_T} tokens per rank",
           f"low-latency dispatch of {TARGET_LL_T} tokens x {TARGET_LL_H} <= {TARGET_LL_US:.0f} us",
           f"the whole layer (our best of layer / fused / low-latency) >= {TARGET_VS_A}x (a) at every configuration",
           f"the whole layer (our best) >= {TARGET_VS_B}x (b) pieces"]


def configs(P: int, names=tuple(CONFIGS), tokens=TOKENS) -> list:
    """[{name, H, F, El, E, k, T}] for P ranks (Mixtral: 8 experts spread over the ranks, at least 1 each)."""
    out = []
    for name in names:
        H, F, el, k = CONFIGS[name]
        El = el if el is not None else max(1, 8 // P)
        for T in tokens:
            out.append(dict(name=name, H=H, F=F, El=El, E=El * P, k=k, T=int(T)))
    return out


def unique_remote_rows(ids, El: int, me: int) -> int:
    """Rows rank ``me`` sends to other ranks, each token once per destination rank: ``ids [T, k]`` global
    experts, rank of expert e = e // El."""
    n = 0
    for row in ids:
        n += len({int(e) // El for e in row} - {me})
    return n


def unique_bytes(rows: int, H: int, itemsize: int = 2) -> int:
    """Bytes of ``rows`` rows of H elements (bf16: 2 bytes)."""
    return rows * H * itemsize


def layer_flops(rows: int, H: int, F: int) -> float:
    """FLOPs of the expert FFN over ``rows`` routed rows: gate/up [H -> 2F] and down [F -> H] = 2 rows H 3F."""
    return 2.0 * rows * H * 3 * F


def recv_rows(cfg, P: int) -> int:
    """Rows of a rank's receive buffer (dropless worst case, as MoeRouting sizes it)."""
    return P * cfg["T"] * min(cfg["k"], cfg["El"])


def mem_estimate(cfg, P: int) -> int:
    """Bytes one rank needs, roughly: three sets of our buffers (pieces, layer, fused layer: x_recv, h, act, y
    per received row), torch's (one row per (token, expert): sent, received, h, act, y, returned) and the
    weights, plus 1 GiB."""
    H, F, T, k = cfg["H"], cfg["F"], cfg["T"], cfg["k"]
    ours = 3 * recv_rows(cfg, P) * (2 * H + 3 * F) * 2
    torch_rows = P * T * k
    theirs = torch_rows * (4 * H + 3 * F) * 2 + T * H * 4
    return ours + theirs + cfg["El"] * 3 * F * H * 2 + C.GiB


def _ok(v) -> bool:
    return v is not None and v == v and v > 0


# the whole-layer methods (each a moe_layer path): their speedups, TFLOP/s and the best of them
LAYERS = ("layer", "layer_sw", "layer_fc", "layer_one", "fused", "ll_layer")


def derive(rec: dict) -> dict:
    """Bandwidths, TFLOP/s and speedups of a record with ``<method>_ms`` times (in place; returns it)."""
    b = rec.get("unique_bytes")
    for key in ("dispatch", "combine", "ll_dispatch", "ll_combine"):
        if _ok(rec.get(key + "_ms")) and b is not None:
            rec[key + "_gbs"] = b / (rec[key + "_ms"] * 1e-3) / 1e9
    fl = rec.get("flops")
    for key in ("torch", "pieces") + LAYERS:
        if _ok(rec.get(key + "_ms")) and fl:
            rec[key + "_tflops"] = fl / (rec[key + "_ms"] * 1e-3) / 1e12
    for key in LAYERS:
        for base in ("torch", "pieces"):
            if _ok(rec.get(key + "_ms")) and _ok(rec.get(base + "_ms")):
                rec[f"{key}_vs_{base}"] = rec[base + "_ms"] / rec[key + "_ms"]
    best = [rec[k + "_ms"] for k in LAYERS if _ok(rec.get(k + "_ms"))]
    if best:
        rec["best_ms"] = min(best)
        for base in ("torch", "pieces"):
            if _ok(rec.get(base + "_ms")):
                rec[f"best_vs_{base}"] = rec[base + "_ms"] / rec["best_ms"]
    return rec


def targets(rec: dict) -> dict:
    """Issue 38's targets for one record: ``bw``, ``ll``, ``vs_a``, ``vs_b`` -> "met" / "missed" / "pending"
    (not measured, or ranks sharing a GPU) / "-" (does not apply)."""
    shared = rec.get("shared_gpu")

    def judge(vals, good):
        if shared or any(not _ok(v) for v in vals):
            return "pending"
        return "met" if all(good(v) for v in vals) else "missed"

    out = {"bw": "-", "ll": "-"}
    if rec["T"] >= TARGET_BW_MIN_T:
        out["bw"] = judge([rec.get("dispatch_gbs"), rec.get("combine_gbs")], lambda v: v >= TARGET_BW_GBS)
    if rec["T"] == TARGET_LL_T and rec["H"] == TARGET_LL_H:
        out["ll"] = judge([None if rec.get("ll_dispatch_ms") is None else rec["ll_dispatch_ms"] * 1e3],
                          lambda v: v <= TARGET_LL_US)
    out["vs_a"] = judge([rec.get("best_vs_torch")], lambda v: v >= TARGET_VS_A)
    out["vs_b"] = judge([rec.get("best_vs_pieces")], lambda v: v >= TARGET_VS_B)
    return out


def _us(v) -> str:
    return _f(None if v is None else v * 1e3, ".0f")


def report(results, meta, out_dir: Path) -> str:
    shared = meta.get("shared_gpu")
    headers = ["config", "T/rank", "H", "F", "E (k)", "(a) torch us", "(b) pieces us", "route us", "dispatch us",
               "combine us", "layer us", "layer SwiGLU-kernel us", "layer fused-combine us", "layer one-kernel us", "dispatch+gemm us", "fused layer us", "LL dispatch us", "LL combine us",
               "LL layer us", "dispatch GB/s", "combine GB/s", "LL dispatch GB/s", "layer TFLOP/s (best)",
               "layer vs (a) / (b)", "fused vs (a) / (b)", "LL layer vs (a) / (b)", "host us/call (a) / layer",
               "BW target", "LL target", ">=1.5x (a)", ">=1.15x (b)"]
    rows = []
    for r in results:
        r = dict(r, shared_gpu=True) if shared else r
        label = r["name"] + (f" [{SHARED}]" if r.get("shared_gpu") else "")
        if r.get("skipped"):
            rows.append([f"{label} [skipped: {r['skipped']}]", r["T"], r["H"], r["F"], f"{r['E']} ({r['k']})"]
                        + ["n/a"] * (len(headers) - 5))
            continue
        notes = [f"{k[:-5]}: {v}" for k, v in r.items() if k.endswith("_note")]
        if notes:
            label += " [" + "; ".join(notes) + "]"
        t = targets(r)
        best_tf = max([r[k + "_tflops"] for k in LAYERS
                      if r.get(k + "_tflops")],
                      default=None)
        pair = lambda k: _f(r.get(k + "_vs_torch"), ".2f") + " / " + _f(r.get(k + "_vs_pieces"), ".2f")  # noqa: E731
        rows.append([label, r["T"], r["H"], r["F"], f"{r['E']} ({r['k']})", _us(r.get("torch_ms")),
                     _us(r.get("pieces_ms")), _us(r.get("route_ms")), _us(r.get("dispatch_ms")),
                     _us(r.get("combine_ms")), _us(r.get("layer_ms")), _us(r.get("layer_sw_ms")), _us(r.get("layer_fc_ms")),
                     _us(r.get("layer_one_ms")),
                     _us(r.get("dispatch_gemm_ms")),
                     _us(r.get("fused_ms")), _us(r.get("ll_dispatch_ms")), _us(r.get("ll_combine_ms")),
                     _us(r.get("ll_layer_ms")), _f(r.get("dispatch_gbs"), ".0f"), _f(r.get("combine_gbs"), ".0f"),
                     _f(r.get("ll_dispatch_gbs"), ".0f"), _f(best_tf, ".1f"), pair("layer"), pair("fused"),
                     pair("ll_layer"), _us(r.get("torch_host_ms")) + " / " + _us(r.get("layer_host_ms")),
                     t["bw"], t["ll"], t["vs_a"], t["vs_b"]])
    title = f"# MoE expert-parallel benchmark ({meta['P']} ranks, {meta['gpu']}{'; ' + SHARED if shared else ''})"
    md = [title, "",
          f"{meta['date']}, torch {meta['torch']}, NCCL {meta['nccl']}, {'--quick, ' if meta.get('quick') else ''}"
          f"{meta['elapsed_s']:.0f} s{' (cut short)' if meta.get('partial') else ''}; torch grouped GEMM: "
          f"{meta.get('grouped_mm', '?')}.", "",
          "Targets (issue 38, on 2x H200; met / missed / pending per row, '-' where one does not apply):", ""]
    md += [f"* {t}" for t in TARGETS]
    md += ["",
           "Times: CUDA events on the current stream, every method of a configuration in the same alternating "
           "rounds, each batch behind a GPU-side delay that outlasts its submission (GPU time); the max over ranks "
           "of each rank's median per call, in us; the host's submission time per eager call in its own column.  "
           "(a) torch: NCCL all_to_all_single dispatch (one row per (token, expert)) + grouped GEMM + SwiGLU + "
           "all_to_all_single combine; (b) pieces: our moe_route, moe_dispatch, grouped_gemm, SwiGLU (torch), "
           "grouped_gemm, moe_combine called one after another; layer: mkernel.moe_layer; layer SwiGLU-kernel: "
           "moe_layer with MoeOptions(swiglu_epilogue=False); layer fused-combine: MoeOptions(fused_combine=True); "
           "layer one-kernel: MoeOptions(one_kernel=True) (route, then one kernel); "
           "dispatch+gemm: moe_dispatch_gemm alone; fused layer: moe_layer with MoeOptions(fused=True); LL: low-latency mode "
           "(<= 256 tokens per rank).",
           "",
           "Formulas: unique bytes per rank = (rows sent to other ranks, each token once per destination rank) x H "
           "x 2 bytes (bf16), the mean over ranks; dispatch / combine GB/s = unique bytes / time (combine returns "
           "the same rows).  Layer TFLOP/s per rank = 2 x (T x k) x H x 3F / t (gate/up 2F and down F per routed "
           "row), the best of the layer columns.  Speedup = time of (a) or (b) / ours.  The target columns "
           "use our best layer time.", "",
           C.markdown_table(headers, rows)]
    if shared:
        md += ["", f"Ranks share a GPU ({SHARED}): the targets stay pending until a run on one GPU per rank."]
    return C.write_report(out_dir, "moe_bench", "\n".join(md) + "\n", meta, results,
                          lambda path: plot(results, path, meta))


def plot(results, path: Path, meta) -> None:
    """Per configuration: layer latency (us, log y) of (a), (b) pieces and ours against tokens per rank."""
    rs = [dict(r, M=r["T"]) for r in results if not r.get("skipped")]
    title = f"MoE layer, {meta['P']} ranks, {meta['gpu']}" + (f" ({SHARED})" if meta.get("shared_gpu") else "")
    C.plot_by_m(rs, path, title, [("torch", "(a) torch+NCCL", "s--"), ("pieces", "(b) our pieces", "^--"),
                                  ("layer", "moe_layer", "o-"), ("fused", "moe_layer fused", "D-"),
                                  ("ll_layer", "moe_layer low-latency", "v-")],
                ylabel="layer latency (us)", xlabel="tokens per rank", logy=True,
                value=lambda r, k: r[k + "_ms"] * 1e3 if _ok(r.get(k + "_ms")) else None)


# ------------------------------------------------------------------------------------ GPU side
def torch_layer(torch, dist, x, ids, w, wg, wd, P, El, grouped_mm: bool):
    """all_to_all dispatch (one row per (token, expert)), grouped GEMM, SwiGLU, all_to_all combine, fp32 sum."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    dest = flat[order] // El
    send_counts = torch.bincount(dest, minlength=P)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    sc, rc = send_counts.tolist(), recv_counts.tolist()  # (the host sync every torch recipe pays)
    xs = x[order // k]
    xr = x.new_empty((sum(rc), x.shape[1]))
    dist.all_to_all_single(xr, xs, rc, sc)
    er = flat.new_empty(sum(rc))
    dist.all_to_all_single(er, flat[order].contiguous(), rc, sc)
    F = wd.shape[2]
    loc = er % El
    if grouped_mm:
        perm = torch.argsort(loc, stable=True)
        offs = torch.cumsum(torch.bincount(loc, minlength=El), 0).to(torch.int32)
        h = torch._grouped_mm(xr[perm], wg.transpose(1, 2), offs=offs)
        a = torch.nn.functional.silu(h[:, :F]) * h[:, F:]
        y = torch.empty_like(xr)
        y[perm] = torch._grouped_mm(a, wd.transpose(1, 2), offs=offs)
    else:
        y = torch.empty_like(xr)
        for l in range(El):
            m = loc == l
            h = xr[m] @ wg[l].T
            y[m] = (torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ wd[l].T
    yb = x.new_empty((T * k, x.shape[1]))
    dist.all_to_all_single(yb, y, sc, rc)
    out = torch.zeros((T, x.shape[1]), dtype=torch.float32, device=x.device)
    out.index_add_(0, order // k, yb.float() * w.reshape(-1)[order, None])
    return out


def measure(ctx, torch, dist, mk, cfg, quick: bool, shared: bool) -> dict:
    P, me, comm = ctx.local_size, ctx.local_rank, ctx.world
    H, F, El, E, k, T = cfg["H"], cfg["F"], cfg["El"], cfg["E"], cfg["k"], cfg["T"]
    rec = dict(cfg, P=P, shared_gpu=shared)
    torch.cuda.empty_cache()
    need = mem_estimate(cfg, P) * ctx.gpu_sharers
    free = torch.cuda.mem_get_info()[0]
    fits = C.all_ranks_ok(need < 0.9 * free, comm)
    if not fits:
        rec["skipped"] = f"needs ~{need / C.GiB:.0f} GiB per GPU, {free / C.GiB:.0f} GiB free"
        return rec
    dev = torch.device("cuda", ctx.device)
    stream = torch.cuda.current_stream()
    sh = int(stream.cuda_stream)
    g = torch.Generator(device=dev)
    g.manual_seed(1000 + me)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
    lg = torch.randn(T, E, device=dev, generator=g)
    wg = torch.randn(El, 2 * F, H, device=dev, dtype=torch.bfloat16, generator=g) / H ** 0.5
    wd = torch.randn(El, H, F, device=dev, dtype=torch.bfloat16, generator=g) / F ** 0.5
    tv, ti = torch.topk(lg, k)
    tw = torch.softmax(tv, -1)  # = MoeOptions(softmax="topk")
    rows = unique_remote_rows(ti.cpu().tolist(), El, me)
    rec["unique_rows"] = sum(comm.allgather(rows)) / P
    rec["unique_bytes"] = unique_bytes(rec["unique_rows"], H)
    rec["flops"] = layer_flops(T * k, H, F)
    grouped = hasattr(torch, "_grouped_mm")
    ref = {}

    def baseline():
        ref["out"] = torch_layer(torch, dist, x, ti, tw, wg, wd, P, El, grouped)

    est_ms = 4 * rec["flops"] / 400e12 * 1e3 + 8 * P * T * k * H * 2 / 100e9 * 1e3
    rp = C.reps_for(est_ms, quick)
    rec.update(rp)
    methods = C.Methods(ctx, rec, REL_TOL)
    if not methods.add("torch", baseline) and grouped:  # torch._grouped_mm refused: the per-expert loop
        rec["torch_grouped_mm_note"] = rec.pop("torch_note")
        grouped = False
        methods.add("torch", baseline)
    rec["torch_grouped"] = "torch._grouped_mm" if grouped else "per-expert matmul loop"
    check = (lambda o: lambda: C.rel_err(torch, o, ref["out"])) if "out" in ref else (lambda o: None)

    R = mk.MoeRouting.empty(ctx, T, k, E)
    rr = R.recv_rows
    xr = torch.empty(rr, H, device=dev, dtype=torch.bfloat16)
    h = torch.empty(rr, 2 * F, device=dev, dtype=torch.bfloat16)
    act = torch.empty(rr, F, device=dev, dtype=torch.bfloat16)
    y = torch.empty(rr, H, device=dev, dtype=torch.bfloat16)
    out_p = torch.empty(T, H, device=dev, dtype=torch.bfloat16)
    out_c = torch.empty(T, H, device=dev, dtype=torch.bfloat16)
    out_l = torch.empty(T, H, device=dev, dtype=torch.bfloat16)
    out_f = torch.empty(T, H, device=dev, dtype=torch.bfloat16)

    def pieces():
        mk.moe_route(ctx, lg, k=k, out=R, stream=sh)
        mk.moe_dispatch(ctx, x, R, xr, stream=sh)
        mk.grouped_gemm(xr, wg, R.expert_offsets, out=h, b_layout="nk", stream=sh)
        torch.mul(torch.nn.functional.silu(h[:, :F]), h[:, F:], out=act)
        mk.grouped_gemm(act, wd, R.expert_offsets, out=y, b_layout="nk", stream=sh)
        mk.moe_combine(ctx, y, R, out_p, stream=sh)

    methods.add("pieces", pieces, check(out_p))
    methods.add("route", lambda: mk.moe_route(ctx, lg, k=k, out=R, stream=sh))
    methods.add("dispatch", lambda: mk.moe_dispatch(ctx, x, R, xr, stream=sh))
    methods.add("combine", lambda: mk.moe_combine(ctx, y, R, out_c, stream=sh))
    methods.add("layer", lambda: mk.moe_layer(ctx, x, wg, wd, lg, k=k, out=out_l, stream=sh), check(out_l))
    out_s = torch.empty(T, H, device=dev, dtype=torch.bfloat16)
    sw = mk.MoeOptions(swiglu_epilogue=False)
    methods.add("layer_sw", lambda: mk.moe_layer(ctx, x, wg, wd, lg, k=k, out=out_s, stream=sh, options=sw),
                check(out_s))
    out_fc = torch.empty(T, H, device=dev, dtype=torch.bfloat16)
    fc = mk.MoeOptions(fused_combine=True)
    methods.add("layer_fc", lambda: mk.moe_layer(ctx, x, wg, wd, lg, k=k, out=out_fc, stream=sh, options=fc),
                check(out_fc))
    out_one = torch.empty(T, H, device=dev, dtype=torch.bfloat16)
    one = mk.MoeOptions(one_kernel=True)
    methods.add("layer_one", lambda: mk.moe_layer(ctx, x, wg, wd, lg, k=k, out=out_one, stream=sh, options=one),
                check(out_one))
    fused = mk.MoeOptions(fused=True)
    methods.add("dispatch_gemm", lambda: mk.moe_dispatch_gemm(ctx, x, R, wg, h, x_recv=xr, stream=sh, options=fused))
    methods.add("fused", lambda: mk.moe_layer(ctx, x, wg, wd, lg, k=k, out=out_f, stream=sh, options=fused),
                check(out_f))
    keys = ["torch", "pieces", "route", "dispatch", "combine", "layer", "layer_sw", "layer_fc", "layer_one",
            "dispatch_gemm", "fused"]
    if T <= LOW_LATENCY_MAX:
        ll = mk.MoeOptions(mode="low_latency")
        Rl = mk.MoeRouting.empty(ctx, T, k, E, ll)
        xl = torch.empty(Rl.recv_rows, H, device=dev, dtype=torch.bfloat16)
        out_ll = torch.empty(T, H, device=dev, dtype=torch.bfloat16)
        out_lc = torch.empty(T, H, device=dev, dtype=torch.bfloat16)
        methods.add("ll_dispatch", lambda: mk.moe_dispatch(ctx, x, Rl, xl, logits=lg, stream=sh, options=ll))
        methods.add("ll_combine", lambda: mk.moe_combine(ctx, xl, Rl, out_lc, stream=sh, options=ll))
        methods.add("ll_layer", lambda: mk.moe_layer(ctx, x, wg, wd, lg, k=k, out=out_ll, stream=sh, options=ll),
                    check(out_ll))
        keys += ["ll_dispatch", "ll_combine", "ll_layer"]
    methods.time(rp, keys)
    derive(rec)
    del methods, ref
    torch.cuda.empty_cache()
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", "--shapes", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="tokens per rank")
    C.add_report_args(ap, HERE.parent / "docs", "moe_bench.json")
    args = ap.parse_args()
    t_start = time.monotonic()
    if C.replot(args, report):
        return 0
    ctx, torch, dist, mk, say = C.start_ranks("mkernel's MoE ops")
    comm, P = ctx.world, ctx.local_size
    shared = ctx.gpu_sharers > 1
    todo = configs(P, [n.strip() for n in args.configs.split(",") if n.strip()],
                   [int(t) for t in args.tokens.split(",") if t.strip()])
    say(f"{P} ranks, {torch.cuda.get_device_name()}{' (' + SHARED + ')' if shared else ''}, torch {torch.__version__}, "
        f"{len(todo)} configurations")
    results = []

    def meta_now(partial: bool) -> dict:
        grouped = sorted({r["torch_grouped"] for r in results if r.get("torch_grouped")})
        return {"date": time.strftime("%Y-%m-%d %H:%M"), "P": P, "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "quick": args.quick, "shared_gpu": shared, "elapsed_s": time.monotonic() - t_start,
                "grouped_mm": " / ".join(grouped) or "n/a", "targets": TARGETS, "partial": partial}

    for cfg in todo:
        try:
            rec = measure(ctx, torch, dist, mk, cfg, args.quick, shared)
        except Exception as exc:  # noqa: BLE001 -- e.g. out of memory at the largest sizes
            rec = dict(cfg, P=P, shared_gpu=shared, error_note=f"{type(exc).__name__}: {exc}"[:300])
            torch.cuda.empty_cache()
        results.append(rec)
        say(f"{cfg['name']:10s} T={cfg['T']:6d}: torch {_us(rec.get('torch_ms'))} | pieces {_us(rec.get('pieces_ms'))} "
            f"| dispatch {_us(rec.get('dispatch_ms'))} ({_f(rec.get('dispatch_gbs'), '.0f')} GB/s) combine "
            f"{_us(rec.get('combine_ms'))} ({_f(rec.get('combine_gbs'), '.0f')} GB/s) | layer "
            f"{_us(rec.get('layer_ms'))} fused {_us(rec.get('fused_ms'))} LL {_us(rec.get('ll_layer_ms'))} us "
            f"{rec.get('skipped', '')} {'; '.join(str(v) for k, v in rec.items() if k.endswith('_note'))} "
            f"[{time.monotonic() - t_start:.0f} s]")
        if ctx.rank == 0:  # (what a run cut short by a timeout leaves: --replot rebuilds the report)
            C.write_json(Path(args.out) / "moe_bench.json", {"meta": meta_now(True), "results": results})
    if ctx.rank == 0:
        meta = meta_now(False)
        C.final_report(report, args.out, "moe_bench", meta, results)
        if args.json:
            C.write_json(args.json, {"meta": meta, "results": results})
    comm.Barrier()
    C.shutdown(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
