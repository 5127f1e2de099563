"""Helpers shared by the benches, which run as ``mpirun -np N python bench/<name>.py`` (and by the
probes in ``experiments/`` and the tools in ``tools/``, which put ``bench/`` on ``sys.path``).

* :func:`setup_env`: NCCL / torch environment (no NVLink multicast); call before importing torch.
* :func:`bootstrap`: ``mkernel.init()`` + ``torch.cuda.set_device(ctx.device)`` + ``torch.distributed``
  (NCCL) with rank / world size from MPI, ``MASTER_ADDR=127.0.0.1`` and a free port picked by rank 0;
  :func:`start_ranks`: bootstrap, the imports and a rank-0 print, with the one-node warning.
* :func:`time_stats`: CUDA-event timing of back-to-back calls on torch's current
  stream, median over batches, with an MPI barrier before every batch.
* :func:`max_over_ranks`, :func:`all_ranks_ok`: cross-rank reductions over an mpi4py communicator.
* :class:`Methods`, :func:`reps_for`, :func:`rel_err`: the fused-op benches' per-shape protocol -- every
  method run once and checked against the reference, the ones that ran on every rank timed in alternating
  rounds, GPU and host time per call recorded as the max over ranks.
* :func:`markdown_table`, :func:`write_json`, :func:`plot_panels`, :func:`plot_by_m`, :func:`write_report`,
  :func:`final_report`, :func:`merge_results`, :func:`fmt_bytes`, :func:`fmt_or_na`: output.

torch, mpi4py and matplotlib are imported inside the functions that need them, so this module
imports with the standard library alone.
"""
from __future__ import annotations

import json
import math
import os
import random
import socket
import statistics
import time
from pathlib import Path

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


# ------------------------------------------------------------------------------------ bootstrap
def setup_env() -> None:
    """Environment every bench needs; must run before torch is imported (NCCL reads it at init)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink SHARP / multicast
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_torch_distributed(comm, device: int, timeout_s: float = 300.0) -> None:
    """``torch.distributed.init_process_group("nccl")`` over the ranks of the mpi4py ``comm``.

    Rank and world size come from ``comm``; rank 0 picks a free TCP port (unless ``MASTER_PORT``
    is set) and broadcasts it.  Single host: ``MASTER_ADDR`` defaults to 127.0.0.1.
    """
    import datetime

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    port = os.environ.get("MASTER_PORT") or (str(_free_port()) if comm.Get_rank() == 0 else None)
    os.environ["MASTER_PORT"] = str(comm.bcast(port, root=0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    kw = dict(backend="nccl", rank=comm.Get_rank(), world_size=comm.Get_size(),
              timeout=datetime.timedelta(seconds=timeout_s))
    try:  # eager NCCL communicator creation on our GPU (torch >= 2.3)
        dist.init_process_group(device_id=torch.device("cuda", device), **kw)
    except TypeError:
        dist.init_process_group(**kw)
    comm.Barrier()


def bootstrap(nccl: bool = True):
    """Per-rank setup for a bench: returns the mkernel Context (its GPU is torch's current device)."""
    setup_env()
    import mkernel

    ctx = mkernel.init()
    import torch

    torch.cuda.set_device(ctx.device)
    if nccl:
        init_torch_distributed(ctx.world, ctx.device)
    return ctx


def start_ranks(what: str):
    """:func:`bootstrap` on every rank, then torch, torch.distributed and mkernel imported: ``(ctx, torch, dist,
    mkernel, say)`` (``say``: print on world rank 0), with a warning when the ranks span several nodes
    (``what`` spans the ranks of a node, NCCL the world)."""
    ctx = bootstrap()
    import torch
    import torch.distributed as dist

    import mkernel

    say = lambda *a: rank0_print(ctx.world, *a)  # noqa: E731
    if ctx.size != ctx.local_size:
        say(f"WARNING: run on one node: {what} spans the ranks of a node, NCCL the world")
    return ctx, torch, dist, mkernel, say


def shutdown(ctx) -> None:
    """Tear down torch.distributed and the mkernel context (collective: every rank calls it)."""
    import torch
    import torch.distributed as dist

    try:
        torch.cuda.synchronize()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        ctx.close()


# ------------------------------------------------------------------------------------ timing
def time_stats(fn, warmup: int = 5, reps: int = 10, batch: int = 1, barrier=None, graph: bool = False) -> dict:
    """Time ``fn()`` (which enqueues GPU work on torch's current stream) with CUDA events.

    ``warmup`` untimed calls, then ``reps`` batches of ``batch`` back-to-back calls, each batch
    bracketed by two events (device synchronized and ``barrier()`` called before every batch).
    ``graph``: warm up on a side stream, capture the ``batch`` calls once in a CUDA graph and time
    its replays (no host launch overhead; ``fn`` must launch on ``torch.cuda.current_stream()`` as
    it is at call time).  Returns per-call milliseconds: ``median_ms``, ``min_ms``, ``max_ms``,
    ``samples`` (one per batch) and ``host_ms`` (median host time to *submit* one call; close to
    ``median_ms`` means the measurement is bound by host launch overhead, not by the GPU).
    """
    import torch

    run, g = None, None
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            for _ in range(batch):
                fn()
        torch.cuda.synchronize()
        if barrier is not None:
            barrier()
        g.replay()  # first replay (uploads the graph) untimed
        run = g.replay
    else:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples, host = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        start.record()
        if run is not None:
            run()
        else:
            for _ in range(batch):
                fn()
        end.record()
        host.append((time.perf_counter() - t0) * 1e3 / batch)
        end.synchronize()
        samples.append(start.elapsed_time(end) / batch)
    torch.cuda.synchronize()
    del g
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "max_ms": max(samples),
            "samples": samples, "host_ms": statistics.median(host), "reps": reps, "batch": batch, "graph": graph}


def gpu_lead_cycles(host_ms_per_batch: float, clock_ghz: float = 2.0) -> int:
    """Cycles of a GPU-side delay that outlasts the host's submission of a batch whose calls take
    ``host_ms_per_batch`` to submit (2x that, at least 50 us, at ``clock_ghz``; a slower clock only
    lengthens the delay)."""
    return int(max(0.05, 2.0 * host_ms_per_batch) * 1e-3 * clock_ghz * 1e9)


def round_order(n: int, r: int, order: str = "rotate") -> list:
    """The order of ``n`` methods in round ``r`` of :func:`time_interleaved`: ``rotate`` starts round r
    at method r (with many methods each keeps nearly its place in every round), ``shuffle`` a permutation
    drawn from round r alone (the same on every rank; a method's place varies from round to round)."""
    if order == "shuffle":
        idx = list(range(n))
        random.Random(r).shuffle(idx)
        return idx
    return [(i + r) % n for i in range(n)]


def time_interleaved(fns: dict, warmup: int = 2, rounds: int = 7, batch: int = 1, barrier=None,
                     host_lead: bool = False, agree=None, order: str = "rotate") -> dict:
    """Time several ways of doing the same work in alternating rounds, so they all see the same clocks:
    a GPU near its power or thermal limit drifts over seconds, and methods timed one after another
    inherit whatever state the previous left (e.g. a fused kernel timed right after a long NCCL run
    can read 10 % slower than the same kernel a second later).

    ``fns``: name -> fn (enqueues GPU work on torch's current stream).  Each gets ``warmup`` untimed
    calls; then ``rounds`` rounds, each timing one batch of ``batch`` calls of every fn (the order
    rotates from round to round, or is shuffled: ``order``, :func:`round_order`; device synchronized and
    ``barrier()`` before every batch).  Returns
    name -> ``time_stats``-style dict (``median_ms``, ``min_ms``, ``max_ms``, ``samples``, ``host_ms``).

    ``host_lead``: enqueue a GPU-side delay (``torch.cuda._sleep``, sized by :func:`gpu_lead_cycles`
    from the method's host submission time in the warm-up) before the start event, so the whole batch
    is queued before the GPU reaches the start event and the interval is the GPU's time alone.
    Without it, a small batch (1 call of a multi-millisecond op) also measures the host's submission
    of its first call -- tens of us for an op that enqueues several launches and copies, which in a
    real pipeline (or a CUDA graph) run ahead of the GPU.  Every method gets the same treatment;
    ``host_ms`` still reports the submission time.  ``agree``: for collective methods, a function every
    rank calls with its delay that returns the one all use (e.g. the max over ranks): with delays of
    their own, the ranks would start a batch apart and the early rank's first call would wait (timed)
    for the late one.
    """
    import torch

    names = list(fns)
    lead = {}  # (host_lead) name -> delay cycles
    for name in names:
        per_call = []
        for _ in range(warmup):
            t0 = time.perf_counter()
            fns[name]()
            per_call.append((time.perf_counter() - t0) * 1e3)
        if host_lead:
            # the fastest warm-up submission (the first may still build something), times the batch; the
            # queue drained before the next method's warm-up, whose submissions must not wait on it
            lead[name] = gpu_lead_cycles(min(per_call, default=0.05) * batch)
            if agree is not None:
                lead[name] = int(agree(lead[name]))
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = {n: [] for n in names}
    host = {n: [] for n in names}
    for r in range(rounds):
        for i in round_order(len(names), r, order):
            name = names[i]
            torch.cuda.synchronize()
            if barrier is not None:
                barrier()
            if host_lead:
                torch.cuda._sleep(lead[name])
            t0 = time.perf_counter()
            start.record()
            for _ in range(batch):
                fns[name]()
            end.record()
            host[name].append((time.perf_counter() - t0) * 1e3 / batch)
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / batch)
    torch.cuda.synchronize()
    return {n: {"median_ms": statistics.median(samples[n]), "min_ms": min(samples[n]), "max_ms": max(samples[n]),
                "samples": samples[n], "host_ms": statistics.median(host[n]), "reps": rounds, "batch": batch,
                "graph": False} for n in names}


# ------------------------------------------------------------------------------------ cross-rank
def to_float(v) -> float:
    """float(v), None -> NaN."""
    return float("nan") if v is None else float(v)


def max_over_ranks(value, comm) -> tuple[float, list]:
    """(max over the ranks of ``comm``, per-rank list); NaN if any rank has None/NaN."""
    vals = [to_float(v) for v in comm.allgather(value)]
    return (float("nan") if any(math.isnan(v) for v in vals) else max(vals)), vals


def all_ranks_ok(ok: bool, comm) -> bool:
    """True when ``ok`` holds on every rank of ``comm`` (collective)."""
    return all(comm.allgather(bool(ok)))


def rank0_print(comm, *args, **kw) -> None:
    if comm.Get_rank() == 0:
        print(*args, **kw, flush=True)


# ------------------------------------------------------------------------------------ output
def fmt_bytes(n: int) -> str:
    """64 KiB, 1 MiB, 1.5 GiB, 1000 B."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.3g} {unit}"
    return f"{n} B"


def select_shapes(shapes, only: str):
    """The shapes (tuples starting with name, M) an ``--only NAME,NAME@M,...`` option keeps (all if empty)."""
    keep = {x.strip() for x in only.split(",") if x.strip()}
    return [s for s in shapes if not keep or s[0] in keep or f"{s[0]}@{s[1]}" in keep]


def markdown_table(headers, rows) -> str:
    """A GitHub markdown table; cells are str()-ed, first column left-aligned, the rest right."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(  # noqa: E731
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    sep = "|" + "|".join(("-" * (w + 1) + ("-" if i == 0 else ":")) for i, w in enumerate(widths)) + "|"
    return "\n".join([line([str(h) for h in headers]), sep] + [line(r) for r in rows])


def _jsonable(o):
    if isinstance(o, float):
        return o if math.isfinite(o) else None  # strict JSON: NaN / inf -> null
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if o is None or isinstance(o, (bool, int, str)):
        return o
    return str(o)


def write_json(path, obj) -> None:
    """``obj`` as strict JSON (NaN -> null, unknown types -> str)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(obj), indent=1) + "\n")


def plot_panels(path, panels, hlines=(), title: str = "", xlabel: str = "size",
                ylabel: str = "bus bandwidth (GB/s)") -> None:
    """One PNG, one panel per entry of ``panels`` (log2 x axis labelled in bytes).

    ``panels``: ``[{"title": str, "series": [{"x": [bytes], "y": [...], "label": str,
    "style": matplotlib fmt (optional)}]}]``; ``hlines``: ``[(y, label)]`` drawn on every panel.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        xs_all = set()
        for s in panel["series"]:
            pts = [(x, y) for x, y in zip(s["x"], s["y"]) if y is not None and y == y]
            if not pts:
                continue
            xs_all.update(x for x, _ in pts)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], s.get("style", "o-"), label=s["label"], ms=4)
        for i, (y, label) in enumerate(hlines):
            if y is not None and y == y:
                ax.axhline(y, color=f"C{7 + i}", ls=":", lw=1.5, label=label)
        ax.set_xscale("log", base=2)
        if xs_all:
            ticks = sorted(xs_all)
            if len(ticks) > 8:
                ticks = ticks[::2]
            ax.set_xticks(ticks)
            ax.set_xticklabels([fmt_bytes(int(t)).replace(" ", "") for t in ticks], rotation=45)
        ax.set_title(panel["title"])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fmt_or_na(v, fmt: str) -> str:
    """``format(v, fmt)``, or "n/a" for None / NaN (a baseline that did not run)."""
    return "n/a" if v is None or v != v else format(v, fmt)


# ------------------------------------------------------------------------------------ fused-op benches
def reps_for(est_ms: float, quick: bool) -> dict:
    """Warm-up calls, timed rounds and calls per batch for a method of about ``est_ms`` per call (a batch of
    about 4 ms, at most 20 calls)."""
    batch = int(min(20, max(1, round(4.0 / max(est_ms, 1e-3)))))
    return {"warmup": 2 if est_ms > 5 else 5, "reps": 3 if quick else 7, "batch": batch}


def rel_err(torch, got, ref) -> float:
    """Relative Frobenius error of torch tensor ``got`` against ``ref``; inf for a NaN (unwritten) output."""
    g, r = got.float(), ref.float()
    if torch.isnan(g).any():
        return float("inf")
    return float(torch.linalg.norm(g - r) / torch.linalg.norm(r).clamp_min(1e-30))


class Methods:
    """The methods of one shape: :meth:`add` runs a method once (errors and a mismatch against the reference
    are noted in ``rec``: ``<key>_note``, ``<key>_err``), :meth:`time` times every method that ran on every
    rank in alternating rounds (:func:`time_interleaved`, GPU time behind a host lead) and stores
    ``<key>_ms`` / ``<key>_host_ms`` (max over ranks; None where a method did not run)."""

    def __init__(self, ctx, rec: dict, rel_tol: float = 1e-2):
        self.ctx, self.rec, self.rel_tol, self.fns = ctx, rec, rel_tol, {}

    def add(self, key: str, fn, check=None) -> bool:
        import torch

        try:
            fn()
            torch.cuda.synchronize()
            self.ctx.check()
            if check is not None:
                err = check()
                self.rec[key + "_err"] = err
                if not err < self.rel_tol:
                    self.rec[key + "_note"] = f"MISMATCH rel err {err:.2e}"
            self.fns[key] = fn
            return True
        except Exception as exc:  # noqa: BLE001
            self.rec[key + "_note"] = f"{type(exc).__name__}: {exc}"[:300]
            return False

    def time(self, rp: dict, keys) -> dict:
        comm = self.ctx.world
        common = set.intersection(*[set(m) for m in comm.allgather(list(self.fns))])
        stats = {}
        try:
            stats = time_interleaved({k: f for k, f in self.fns.items() if k in common}, rp["warmup"], rp["reps"],
                                     rp["batch"], barrier=comm.Barrier, host_lead=True,
                                     agree=lambda v: max(comm.allgather(v)))
            self.ctx.check()
        except Exception as exc:  # noqa: BLE001
            self.rec["timing_note"] = f"{type(exc).__name__}: {exc}"[:300]
            stats = {}
        for key in keys:
            self.rec[key + "_ms"] = max_over_ranks(stats[key]["median_ms"], comm)[0] if key in stats else None
            self.rec[key + "_host_ms"] = max_over_ranks(stats[key]["host_ms"], comm)[0] if key in stats else None
        return stats


def plot_by_m(results, path, title: str, series, floor_key: str | None = None, ylabel: str = "TFLOP/s per GPU",
              value=None, xlabel: str = "total M (tokens)", logy: bool = False) -> None:
    """One PNG, one panel per shape name (in order of appearance), x = M (log2 axis): ``series`` is
    ``[(key, label, matplotlib fmt)]`` plotted as ``value(rec, key)`` (default ``rec[key + "_tflops"]``);
    ``floor_key``: also ``flops_per_gpu / rec[floor_key]`` as a dotted grey line (no overlap loss)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    value = value or (lambda r, k: r.get(k + "_tflops"))
    groups = []
    for r in results:
        if r["name"] not in groups:
            groups.append(r["name"])
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 4.0), squeeze=False)
    for ax, name in zip(axes[0], groups):
        rs = [r for r in results if r["name"] == name]
        xs = [r["M"] for r in rs]
        for key, label, style in series:
            pts = [(x, value(r, key)) for x, r in zip(xs, rs) if value(r, key)]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label, ms=4)
        if floor_key is not None:
            fl = [(r["M"], r["flops_per_gpu"] / (r[floor_key] * 1e-3) / 1e12) for r in rs if r.get(floor_key)]
            if fl:
                ax.plot([p[0] for p in fl], [p[1] for p in fl], ":", color="gray", label="floor (no overlap loss)")
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs], rotation=45)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if not logy:
            ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out_dir, stem: str, text: str, meta: dict, results: list, plot=None) -> str:
    """``<out_dir>/<stem>.md`` (``text``), ``.json`` (meta and results) and, with ``plot(path)``, ``.png`` (a
    plot that fails is reported, not raised); returns ``text``."""
    import traceback

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.md").write_text(text)
    write_json(out_dir / f"{stem}.json", {"meta": meta, "results": results})
    if plot is not None:
        try:
            plot(out_dir / f"{stem}.png")
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    return text


def final_report(report, out_dir, stem: str, meta: dict, results: list) -> None:
    """Rank 0 at the end of a run: print ``report(results, meta, out_dir)`` (which writes ``<stem>.md/.png/.json``);
    if it fails, the traceback and the JSON alone (the measurements are kept)."""
    import traceback

    out_dir = Path(out_dir)
    try:
        print("\n" + report(results, meta, out_dir), flush=True)
        print(f"wrote {out_dir}/{stem}.md / .png / .json", flush=True)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        write_json(out_dir / f"{stem}.json", {"meta": meta, "results": results})


def merge_results(files) -> tuple[dict, list]:
    """(meta, results) of several runs' JSON reports merged (the first run's meta, elapsed times summed)."""
    parts = [json.loads(Path(f).read_text()) for f in files]
    meta = dict(parts[0]["meta"], elapsed_s=sum(p["meta"]["elapsed_s"] for p in parts))
    return meta, [r for p in parts for r in p["results"]]


def add_report_args(ap, default_out, json_name: str) -> None:
    """The report options of a benchmark writing ``<out>/<stem>.{md,json,png}``: --quick, --out, --json and
    --replot (the report again from a run's ``json_name``, no GPU; :func:`replot`)."""
    ap.add_argument("--quick", action="store_true", help="fewer timed rounds")
    ap.add_argument("--out", default=str(default_out), help="output folder (default docs/)")
    ap.add_argument("--json", default=None, help="also write the JSON report to this file")
    ap.add_argument("--replot", metavar="JSON", help=f"no GPU: rebuild the report from an earlier run's {json_name}")


def replot(args, report) -> bool:
    """With --replot: print ``report(results, meta, out_dir)`` of that JSON and return True (nothing to run)."""
    if not args.replot:
        return False
    meta, results = merge_results([args.replot])
    print(report(results, meta, Path(args.out)), flush=True)
    return True
