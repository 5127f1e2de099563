#!/usr/bin/env python
"""mkernel all-gather / reduce-scatter / all-reduce against NCCL, and copy-engine peer bandwidth.

    mpirun --allow-run-as-root -np 2 python bench/collectives.py [--quick] [--out DIR] [--torch-args]
                                                                 [--graph] [--ops ...] [--max-bytes N]

Every rank: ``mkernel.init()``, torch on the same GPU, ``torch.distributed`` (NCCL) over the same
ranks (one node).  Inputs are torch tensors (random normal, bf16; fp32 for all-reduce at 1/16/256
MiB) handed to mkernel zero-copy (DLPack for bf16, CAI for fp32); mkernel runs on torch's current
stream, so the same CUDA events time both libraries.

Sizes follow nccl-tests: all-gather = OUTPUT bytes, reduce-scatter = INPUT bytes, all-reduce =
buffer bytes; bus bandwidth (GB/s = 1e9 B/s) = size/t * (P-1)/P for AG/RS, * 2(P-1)/P for AR.
Per op and size: one verification call of each library on the same inputs (ours must match
NCCL: bit-exact for AG, allclose for RS/AR), then warm-up and batches of back-to-back calls timed
with CUDA events; reported time = max over ranks of each rank's median per-call time.
mkernel all-reduce is out of place (x -> out); torch's NCCL all-reduce is in place.

By default the timed loop passes mkernel the DeviceArray views made once from the torch tensors
(zero-copy, pointer-checked), so the per-call DLPack import is not timed; ``--torch-args`` passes
the torch tensors on every call instead.  Small sizes are bound by host launch overhead on both
sides (marked †); ``--graph`` captures each batch of calls (ours and NCCL alike) in a CUDA graph
and times its replays, which measures GPU time only.

Copy-engine bandwidth: every rank at once copies a buffer to the next rank's GPU with torch
``dst.copy_(src, non_blocking=True)`` (dst allocated on GPU (rank+1)%P from this process; torch
enables peer access and issues cudaMemcpyAsync on the copy engine), timed with events: GB/s per
direction.

Writes ``<out>/collectives_bench.{md,png,json}`` (``collectives_bench_graph.*`` with ``--graph``;
default ``<out>``: ``docs/``).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import _common as C  # noqa: E402
from mkernel.ops.collectives import api as MC  # noqa: E402  (no GPU work at import)

_f = C.fmt_or_na  # a number, or "n/a" for a baseline that did not run

C.setup_env()  # before torch is imported anywhere

KiB, MiB, GiB = C.KiB, C.MiB, C.GiB
OPS = ("all_gather", "reduce_scatter", "all_reduce")
SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
FP32_AR_SIZES = (1 * MiB, 16 * MiB, 256 * MiB)
CE_SIZES = (256 * MiB, 1 * GiB)


def bus_factor(op: str, P: int) -> float:
    return (2.0 if op == "all_reduce" else 1.0) * (P - 1) / P if P > 1 else 1.0


def busbw(op: str, nbytes: int, ms: float, P: int) -> float:
    """GB/s (1e9), nccl-tests convention."""
    if ms is None or not ms == ms or ms <= 0:
        return float("nan")
    return nbytes / (ms * 1e-3) * bus_factor(op, P) / 1e9


def plan(nbytes: int, quick: bool) -> dict:
    """warm-up / reps / batch for one measurement (identical on every rank: depends on size only)."""
    est_ms = 0.02 + nbytes / 200e6  # conservative: 20 us + 200 GB/s
    batch = int(min(100, max(1, round(5.0 / est_ms))))  # ~5 ms per batch
    reps = 25 if nbytes <= 16 * MiB else 15 if nbytes <= 256 * MiB else 10
    if quick:
        reps = min(reps, 12)
    return {"warmup": max(5, min(batch, 20)), "reps": reps, "batch": batch}


def _mk_ops():
    import mkernel

    return {op: getattr(mkernel, op) for op in OPS}


class Case:
    """Tensors and calls for one (op, dtype, size) on this rank.

    AG: ``x [n]`` -> ``[P*n]``; RS: ``x [P*n]`` -> ``[n]``; AR: ``x [n]`` -> ``[n]`` (NCCL in place
    on ``nccl_out``).  ``nbytes``: the nccl-tests size actually used (rounded down to whole
    elements per rank).
    """

    def __init__(self, ctx, mk, op: str, dtype: str, size: int, torch_args: bool, sym: bool = False):
        import torch
        import torch.distributed as dist

        from mkernel.core.interop import as_device_array

        self.ctx, self.op, self.dtype = ctx, op, dtype
        self.torch, self.dist = torch, dist
        P, dev = ctx.local_size, torch.device("cuda", ctx.device)
        td = getattr(torch, dtype)
        isz = torch.empty((), dtype=td).element_size()
        g = torch.Generator(device=dev)
        g.manual_seed(1000 + 7919 * ctx.rank + size.bit_length())
        if op == "all_reduce":
            n_in = n_out = size // isz
        else:
            n = max(1, size // (P * isz))
            n_in, n_out = (n, P * n) if op == "all_gather" else (P * n, n)
        self.nbytes = (n_out if op == "all_gather" else n_in) * isz
        self.x = torch.randn(n_in, dtype=td, device=dev, generator=g)
        self.buf = None
        if sym:  # out in mkernel symmetric memory (collective): the zero-copy all-gather
            self.buf = ctx.alloc_symmetric(n_out * isz)
            self.ours_out = torch.from_dlpack(self.buf.array((n_out,), dtype))
        else:
            self.ours_out = torch.empty(n_out, dtype=td, device=dev)
        self.nccl_out = torch.empty(n_out, dtype=td, device=dev)
        self.stream = torch.cuda.current_stream()
        self.sh = int(self.stream.cuda_stream)
        self.fn = mk[op]
        # zero-copy views for the timed loop (DLPack for bf16, CAI for fp32): same pointers as torch
        xa = as_device_array(self.x, name="x", stream=self.sh)
        oa = as_device_array(self.ours_out, name="out", stream=self.sh)
        if (xa.ptr, oa.ptr) != (self.x.data_ptr(), self.ours_out.data_ptr()):
            raise RuntimeError(f"zero-copy import changed pointers: {xa.ptr:#x}/{self.x.data_ptr():#x}, "
                               f"{oa.ptr:#x}/{self.ours_out.data_ptr():#x}")
        self.args = (self.x, self.ours_out) if torch_args else (xa, oa)

    def ours(self):
        self.fn(self.ctx, *self.args, stream=self.sh)

    def close(self):
        """Free the symmetric out (collective: every rank closes the same cases)."""
        if self.buf is not None:
            self.torch.cuda.synchronize()
            self.args = self.ours_out = None
            self.buf.free()
            self.buf = None

    def ours_current_stream(self):  # for CUDA-graph capture: the capture stream is torch's current one
        self.fn(self.ctx, *self.args, stream=self.torch.cuda.current_stream().cuda_stream)

    def nccl(self):
        if self.op == "all_gather":
            self.dist.all_gather_into_tensor(self.nccl_out, self.x)
        elif self.op == "reduce_scatter":
            self.dist.reduce_scatter_tensor(self.nccl_out, self.x)
        else:
            self.dist.all_reduce(self.nccl_out)

    def verify_start(self) -> None:
        """Verification, step 1: poison both outputs with NaN and launch ours once, given the torch
        tensors and torch's stream object directly (the DLPack / CAI / stream interop check)."""
        self.ours_out.fill_(float("nan"))
        self.nccl_out.fill_(float("nan"))
        if self.op == "all_reduce":
            self.nccl_out.copy_(self.x)
        self.fn(self.ctx, self.x, self.ours_out, stream=self.stream)

    def verify_finish(self) -> tuple[bool, str]:
        """Step 2 (every rank's step 1 succeeded): NCCL on the same inputs, compare; (match, message)."""
        torch = self.torch
        self.nccl()
        torch.cuda.synchronize()
        self.ctx.check()
        a, b = self.ours_out, self.nccl_out
        if self.op == "all_gather":
            bad = int((a != b).sum())  # NaN != NaN: unwritten elements count as bad
            return bad == 0, f"{bad} of {a.numel()} elements differ (exact compare)"
        P = self.ctx.local_size
        eps = 2.0 ** -8 if self.dtype == "bfloat16" else 2.0 ** -23
        rtol, atol = 2 * eps, 8 * P * eps  # inputs ~N(0,1): partial sums are O(sqrt(P))
        bad = nan = 0
        worst = 0.0
        step = 1 << 26
        for i in range(0, a.numel(), step):
            af, bf = a[i:i + step].float(), b[i:i + step].float()
            d = (af - bf).abs()
            bad += int((~(d <= atol + rtol * bf.abs())).sum())
            nan += int(torch.isnan(af).sum())
            worst = max(worst, float(torch.nan_to_num(d, nan=0.0).max()))
        return bad == 0, (f"{bad} of {a.numel()} elements outside |d| <= {atol:.2g} + {rtol:.2g}|nccl| "
                          f"({nan} NaN in ours), max |d| = {worst:.3g}")


def copy_engine_bw(ctx, quick: bool) -> dict:
    """Per-direction copy-engine GB/s, every rank copying to GPU of local rank (r+1)%P at once."""
    import torch

    comm, P = ctx.node_comm, ctx.local_size
    devs = comm.allgather(ctx.device)
    peer = devs[(ctx.local_rank + 1) % P]
    if P < 2 or peer == ctx.device:
        return {}
    out = {}
    peer_access = bool(torch.cuda.can_device_access_peer(ctx.device, peer))
    for n in CE_SIZES:
        try:
            src = torch.ones(n, dtype=torch.uint8, device=torch.device("cuda", ctx.device))
            dst = torch.empty(n, dtype=torch.uint8, device=torch.device("cuda", peer))
            st = C.time_stats(lambda: dst.copy_(src, non_blocking=True), warmup=3, reps=10 if quick else 20,
                              batch=1, barrier=comm.Barrier)
            gbps = n / (st["median_ms"] * 1e-3) / 1e9
            ok = bool(dst[-1].item() == 1)
            err = None
        except Exception as exc:  # noqa: BLE001
            gbps, ok, err = float("nan"), False, f"{type(exc).__name__}: {exc}"
            print(f"[rank {ctx.rank}] copy-engine {C.fmt_bytes(n)} failed: {err}", flush=True)
        src = dst = None
        per_rank = [C.to_float(v) for v in comm.allgather(gbps)]
        out[n] = {"per_rank_GBps": per_rank, "min_GBps": min(per_rank) if not any(map(math.isnan, per_rank))
                  else float("nan"), "copied_ok": C.all_ranks_ok(ok, comm), "error": err, "peer_access": peer_access}
    torch.cuda.empty_cache()
    return out


def measure(ctx, mk, op, dtype, size, args, state, sym: bool = False) -> dict:
    """Verify + time ours and NCCL for one point; never raises (failures become NaN + a printed line).
    ``sym``: ours writes into an ``out`` in mkernel symmetric memory (all-gather: zero-copy)."""
    comm, P = ctx.world, ctx.local_size
    p = plan(size, args.quick)
    rec = {"op": op, "dtype": dtype, "size": size, "bytes": size, "plan": p, "match": None, "match_msg": "", "sym": sym,
           "ours_ms": float("nan"), "nccl_ms": float("nan"), "ours_ms_per_rank": [], "nccl_ms_per_rank": [],
           "ours_host_ms": float("nan"), "nccl_host_ms": float("nan"), "ours_busbw": float("nan"),
           "nccl_busbw": float("nan"), "ratio": float("nan"), "errors": [],
           # mkernel's path: copy engines + SM receivers ("ce") or SM pushes over NVLink ("sm")
           # (x: AG one rank's part of the output; RS, AR the whole buffer)
           "path": "ce" if MC.copy_engine_path(op, size // P if op == "all_gather" else size,
                                               2 if dtype != "float32" else 4, P) else "sm"}
    case = None
    try:
        case = Case(ctx, mk, op, dtype, size, args.torch_args, sym)
        rec["bytes"] = case.nbytes
        err = None
    except Exception as exc:  # noqa: BLE001
        err = exc
        print(f"[rank {ctx.rank}] {op} {dtype} {C.fmt_bytes(size)}: setup failed: {type(exc).__name__}: {exc}",
              flush=True)
    if not C.all_ranks_ok(err is None, comm):
        _note_failure(ctx, err, state, rec, "setup")
        return rec

    # verification (also the first call: plan, agreement, workspace)
    if not state["ours_dead"] and not state["nccl_dead"]:
        rec["match"], rec["match_msg"], skip = _verify(ctx, case, state, rec)
    else:
        skip = set()

    for who, fn in (("ours", case.ours_current_stream if args.graph else case.ours), ("nccl", case.nccl)):
        if state[who + "_dead"] or who in skip:
            continue
        try:
            st = C.time_stats(fn, p["warmup"], p["reps"], p["batch"], barrier=comm.Barrier, graph=args.graph)
            if who == "ours":
                ctx.check()
            med, host, samples, err = st["median_ms"], st["host_ms"], st["samples"], None
        except Exception as exc:  # noqa: BLE001
            med, host, samples, err = None, None, None, exc
            print(f"[rank {ctx.rank}] {who} {op} {dtype} {C.fmt_bytes(case.nbytes)} failed: "
                  f"{type(exc).__name__}: {exc}", flush=True)
        rec[who + "_ms"], rec[who + "_ms_per_rank"] = C.max_over_ranks(med, comm)
        rec[who + "_host_ms"], _ = C.max_over_ranks(host, comm)
        rec[who + "_samples_ms"] = comm.allgather(samples)  # per rank, per batch
        _note_failure(ctx, err, state, rec, who)
    if sym:
        try:
            case.close()
        except Exception as exc:  # noqa: BLE001
            print(f"[rank {ctx.rank}] freeing the symmetric out failed: {type(exc).__name__}: {exc}", flush=True)
    for who in ("ours", "nccl"):
        rec[who + "_busbw"] = busbw(op, rec["bytes"], rec[who + "_ms"], P)
    rec["ratio"] = rec["ours_busbw"] / rec["nccl_busbw"] if rec["nccl_busbw"] > 0 else float("nan")
    return rec


def _verify(ctx, case, state, rec):
    """(match on every rank, this rank's message, libraries not to time at this point).

    match is None when a call failed on some rank (see rec["errors"]); then the failing library (or
    both, if the failure came after both were called) is not timed, so no rank waits alone in a
    collective the others skipped."""
    import torch

    comm, what = ctx.world, f"{case.op} {case.dtype} {C.fmt_bytes(case.nbytes)}"
    err = None
    try:
        case.verify_start()
    except Exception as exc:  # noqa: BLE001
        err = exc
        traceback.print_exc()
    if not C.all_ranks_ok(err is None, comm):  # don't start NCCL on some ranks only
        try:  # ranks whose kernel did launch: let it finish or time out
            torch.cuda.synchronize()
            ctx.check()
        except Exception as exc:  # noqa: BLE001
            err = err or exc
        _note_failure(ctx, err, state, rec, "verify (ours)")
        return None, f"ours raised {type(err).__name__}: {err}" if err else "ours failed on another rank", {"ours"}
    try:
        ok, msg = case.verify_finish()
    except Exception as exc:  # noqa: BLE001
        ok, msg, err = False, f"verification raised {type(exc).__name__}: {exc}", exc
        traceback.print_exc()
    if err is None and not ok:
        print(f"[rank {ctx.rank}] MISMATCH ours vs NCCL: {what}: {msg}", flush=True)
    errs = comm.allgather(err is not None)
    match = None if any(errs) else C.all_ranks_ok(ok, comm)
    _note_failure(ctx, err, state, rec, "verify")
    return match, msg, ({"ours", "nccl"} if any(errs) else set())


def _note_failure(ctx, err, state, rec, what) -> None:
    """Agree across ranks on whether ``what`` failed; a communication error retires that library."""
    import mkernel

    comm = ctx.world
    failed = comm.allgather(None if err is None else f"{type(err).__name__}: {err}")
    msgs = [f"rank {r}: {m}" for r, m in enumerate(failed) if m]
    if not msgs:
        return
    rec["errors"].append(f"{what}: " + "; ".join(msgs))
    fatal_ours = isinstance(err, (mkernel.CommError, mkernel.CommTimeout))
    fatal_nccl = what == "nccl" and "NCCL" in str(err)
    if any(comm.allgather(fatal_ours)):
        state["ours_dead"] = True
        C.rank0_print(comm, "mkernel reported a communication error: skipping ours from here on")
    if any(comm.allgather(fatal_nccl)):
        state["nccl_dead"] = True
        C.rank0_print(comm, "NCCL failed: skipping NCCL from here on")


# ------------------------------------------------------------------------------------ reporting
def _label(r) -> str:
    return (f"{SHORT[r['op']]} {r['dtype'].replace('bfloat16', 'bf16').replace('float32', 'fp32')}"
            + (" sym" if r.get("sym") else ""))


def _pct(v) -> str:
    return "n/a" if v != v else f"{v:.0f}%"


def report(results, ce, meta, out_dir: Path) -> str:
    """Write the markdown / JSON / PNG (rank 0) and return the markdown + the 2-line verdict."""
    P, stem = meta["P"], meta["stem"]
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for r in results:
        host_bound = r["ours_host_ms"] == r["ours_host_ms"] and r["ours_host_ms"] >= 0.9 * r["ours_ms"]
        mark = "" if r["match"] in (True, None) else " ✗"
        rows.append([_label(r) + mark,
                     C.fmt_bytes(r["size"]), r.get("path", "sm"),
                     _f(r["ours_ms"] * 1e3, ".1f") + (" †" if host_bound else ""), _f(r["ours_busbw"], ".1f"),
                     _f(r["nccl_ms"] * 1e3, ".1f"), _f(r["nccl_busbw"], ".1f"), _f(r["ratio"], ".2f")])
    table = C.markdown_table(["op", "size", "path", "ours (us)", "ours busbw (GB/s)", "NCCL (us)", "NCCL busbw (GB/s)",
                              "busbw ours/NCCL"], rows)
    ce_line = ", ".join(f"{C.fmt_bytes(n)}: {_f(v['min_GBps'], '.1f')} GB/s (per rank "
                        f"{', '.join(_f(x, '.1f') for x in v['per_rank_GBps'])})" for n, v in ce.items()) or "n/a"
    # verdict
    fails = [f"{_label(r)} {C.fmt_bytes(r['size'])} ({_f(r['ratio'], '.2f')})"
             for r in results if r["size"] >= 1 * MiB and not (r["ratio"] >= 1.0)]
    v1 = "at or above NCCL from 1 MiB up: " + ("yes" if not fails else f"no ({', '.join(fails)})")
    ce_big = ce.get(max(ce), {}).get("min_GBps", float("nan")) if ce else float("nan")
    parts = []
    for op in OPS:
        pts = [r for r in results if r["op"] == op and r["dtype"] == "bfloat16" and not r.get("sym")]
        if pts and ce_big == ce_big:
            big = max(pts, key=lambda r: r["size"])
            pct = 100 * big["ours_busbw"] / ce_big
            parts.append((pct, f"{SHORT[op]} {_pct(pct)} at {C.fmt_bytes(big['size'])}"))
    worst = min(p[0] for p in parts) if parts and all(p[0] == p[0] for p in parts) else float("nan")
    v2 = "large-size busbw vs copy-engine: " + (
        f"{_pct(worst)} (min over ops; " + ", ".join(p[1] for p in parts)
        + f"; copy engine {ce_big:.1f} GB/s per direction)" if parts else "n/a")
    sym = [r for r in results if r.get("sym")]
    v3 = ("all-gather into a symmetric out (zero-copy) vs copy-engine: "
          + ", ".join(f"{_pct(100 * r['ours_busbw'] / ce_big)} at {C.fmt_bytes(r['size'])}" for r in sym)
          if sym and ce_big == ce_big else "")
    mism = [f"{_label(r)} {C.fmt_bytes(r['size'])}: {r['match_msg']}"
            for r in results if r["match"] is False]
    errs = [f"{_label(r)} {C.fmt_bytes(r['size'])}: {e}" for r in results for e in r["errors"]]
    md = "\n".join([
        "# mkernel collectives vs NCCL", "",
        f"{meta['date']}; {P} x {meta['gpu']}; torch {meta['torch']}, NCCL {meta['nccl']}; "
        f"{'quick' if meta['quick'] else 'full'} run; "
        f"{'CUDA-graph replays of each batch' if meta.get('graph') else 'eager launches'}; "
        f"ours given {meta['ours_args']}.", "",
        "Sizes per nccl-tests (AG: output bytes, RS: input bytes, AR: buffer bytes); busbw = size/t x (P-1)/P "
        "(AG, RS) or x 2(P-1)/P (AR), GB = 1e9 B. Time = max over ranks of each rank's median per-call time "
        "(CUDA events around batches of back-to-back calls on torch's current stream); busbw uses the exact bytes "
        "(sizes rounded down to whole elements per rank). Ratio > 1: ours faster. "
        "sym: ours writes into an `out` in mkernel symmetric memory (`ctx.alloc_symmetric(...).array(...)`), "
        "which the copy-engine all-gather fills zero-copy (the peers write straight into it); NCCL as always. "
        "† = host-bound (submitting a call took >= 90% of its GPU time). ✗ = ours did not match NCCL. "
        "path: how mkernel moved the data -- `sm`: one persistent kernel pushing over NVLink, `ce`: copy "
        "engines + SM receivers (per-peer message from "
        + ", ".join(f"{SHORT[k]} {C.fmt_bytes(v)}" for k, v in meta.get("ce_min_bytes", {}).items()) + "; "
        f"MKERNEL_COLL_CE={meta.get('coll_ce_env', 'auto')}).", "",
        f"Copy-engine peer bandwidth (torch `copy_` to the next rank's GPU, all ranks at once, per direction): "
        f"{ce_line}.", "",
        table, "",
        "**" + v1 + "**  ", "**" + v2 + "**" + ("  " if v3 else ""), *(["**" + v3 + "**"] if v3 else []), ""]
        + (["## Mismatches", ""] + [f"- {m}" for m in mism] + [""] if mism else [])
        + (["## Errors", ""] + [f"- {e}" for e in errs] + [""] if errs else []))
    (out_dir / f"{stem}.md").write_text(md)
    C.write_json(out_dir / f"{stem}.json", {"meta": meta, "copy_engine": {str(k): v for k, v in ce.items()},
                                                      "results": results, "verdict": [v1, v2]})
    try:
        panels = []
        for op in OPS:
            series = []
            for dt, tag in (("bfloat16", "bf16"), ("float32", "fp32")):
                pts = [r for r in results if r["op"] == op and r["dtype"] == dt and not r.get("sym")]
                if not pts:
                    continue
                x = [r["size"] for r in pts]
                solid, dashed = ("o-", "s--") if dt == "bfloat16" else ("^-", "v--")
                series += [{"x": x, "y": [r["ours_busbw"] for r in pts], "label": f"mkernel {tag}", "style": solid},
                           {"x": x, "y": [r["nccl_busbw"] for r in pts], "label": f"NCCL {tag}", "style": dashed}]
            sp = [r for r in results if r["op"] == op and r.get("sym")]
            if sp:
                series.append({"x": [r["size"] for r in sp], "y": [r["ours_busbw"] for r in sp],
                               "label": "mkernel bf16, symmetric out", "style": "D-"})
            panels.append({"title": op.replace("_", "-"), "series": series})
        C.plot_panels(out_dir / f"{stem}.png", panels,
                      hlines=[(ce_big, f"copy engine {C.fmt_bytes(max(ce))}" if ce else "copy engine")],
                      title=f"mkernel vs NCCL, {P} x {meta['gpu']}")
    except Exception as exc:  # noqa: BLE001
        print(f"plot failed: {type(exc).__name__}: {exc}", flush=True)
    return md + "\n" + v1 + "\n" + v2 + ("\n" + v3 if v3 else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 sizes, fewer batches (< ~90 s)")
    ap.add_argument("--out", default=str(HERE.parent / "docs"), help="output folder (default docs/)")
    ap.add_argument("--torch-args", action="store_true", help="pass torch tensors to mkernel on every timed call")
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ",".join(OPS))
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays of each batch (both libraries): "
                    "GPU time without host launch overhead")
    ap.add_argument("--max-bytes", type=int, default=GiB, help="largest size (default 1 GiB)")
    ap.add_argument("--min-bytes", type=int, default=0, help="smallest size (default: all)")
    ap.add_argument("--replot", metavar="JSON", help="no GPU: rewrite the report (md, png) from a run's JSON")
    args = ap.parse_args()
    t_start = time.monotonic()
    if args.replot:
        import json

        d = json.loads(Path(args.replot).read_text())
        ce = {int(k): v for k, v in d["copy_engine"].items()}
        print(report(d["results"], ce, d["meta"], Path(args.out)))
        return 0

    ctx = C.bootstrap()
    import torch

    comm, P = ctx.world, ctx.local_size
    say = lambda *a: C.rank0_print(comm, *a)  # noqa: E731
    if ctx.size != ctx.local_size:
        say(f"WARNING: NCCL spans all {ctx.size} ranks but mkernel's collectives span the {P} ranks of a node: "
            "run on one node (and without MKERNEL_RANKS_PER_NODE) for a meaningful comparison")
    mk = _mk_ops()
    sizes = ([64 * KiB, 1 * MiB, 16 * MiB, 256 * MiB, 1 * GiB] if args.quick
             else [1 << k for k in range(16, 31)])
    sizes = [s for s in sizes if args.min_bytes <= s <= args.max_bytes]
    ops = [o for o in args.ops.split(",") if o]
    cases = [(op, "bfloat16", s, False) for s in sizes for op in OPS if op in ops]
    cases += [("all_reduce", "float32", s, False) for s in sizes if s in FP32_AR_SIZES and "all_reduce" in ops]
    # the zero-copy all-gather (symmetric out) where the copy-engine path runs
    cases += [("all_gather", "bfloat16", s, True) for s in sizes if "all_gather" in ops and P > 1
              and ctx.num_nodes == 1 and MC.copy_engine_path("all_gather", s // P, 2, P)]
    cases.sort(key=lambda c: (c[2], OPS.index(c[0]), c[3], c[1]))
    out_dir = Path(args.out)
    if ctx.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    say(f"{P} ranks, GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, {len(cases)} points")

    ce = copy_engine_bw(ctx, args.quick)
    for n, v in ce.items():
        say(f"copy engine {C.fmt_bytes(n)}: per-direction GB/s per rank {[round(x, 1) for x in v['per_rank_GBps']]}")

    state = {"ours_dead": False, "nccl_dead": False}
    results = []
    for op, dtype, size, sym in cases:
        rec = measure(ctx, mk, op, dtype, size, args, state, sym)
        results.append(rec)
        say(f"{_label(rec)} {C.fmt_bytes(rec['size']):>8s}: ours {_f(rec['ours_ms'] * 1e3, '9.1f')} us "
            f"{_f(rec['ours_busbw'], '6.1f')} GB/s | NCCL {_f(rec['nccl_ms'] * 1e3, '9.1f')} us "
            f"{_f(rec['nccl_busbw'], '6.1f')} GB/s | x{_f(rec['ratio'], '.2f')}"
            f"{'' if rec['match'] in (True, None) else '  MISMATCH'}  [{time.monotonic() - t_start:.0f} s]")
        if size >= 256 * MiB:
            torch.cuda.empty_cache()

    if ctx.rank == 0:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "P": P, "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "quick": args.quick, "graph": args.graph, "ours_args": "torch tensors every call" if args.torch_args
                else "zero-copy DeviceArray views of the torch tensors (made once)",
                "elapsed_s": time.monotonic() - t_start,
                "ce_min_bytes": MC.CE_MIN_BYTES,
                "coll_ce_env": os.environ.get("MKERNEL_COLL_CE", "auto"),
                "stem": "collectives_bench_graph" if args.graph else "collectives_bench"}
        try:
            text = report(results, ce, meta, out_dir)
            print("\n" + text, flush=True)
            print(f"\nwrote {out_dir}/{meta['stem']}.md / .png / .json", flush=True)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            C.write_json(out_dir / f"{meta['stem']}.json", {"meta": meta, "results": results})
    comm.Barrier()
    C.shutdown(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
