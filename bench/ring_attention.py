#!/usr/bin/env python
"""Ring attention across the ranks of one node -- ``mkernel.ring_attention`` (forward) and
``mkernel.ring_attention_backward`` -- against the schemes torch offers, in the same run (issue 39 item 6;
docs/ring_attention.md).

    mpirun --allow-run-as-root --oversubscribe --bind-to none -np P python bench/ring_attention.py \\
        [--b 1] [--hq 32] [--hkv 8] [--d 128] [--s 8192,32768] [--causal 0,1] [--no-backward] [--quick] \\
        [--out DIR] [--json FILE]
    python bench/ring_attention.py --replot docs/ring_attention_bench.json [--out DIR]     (no GPU)

Shapes: every rank holds q ``[B, S_local, H_q, D]`` and k, v ``[B, S_local, H_kv, D]`` (bf16, bshd, random),
S_local = S / P for each total sequence length S of ``--s``; non-causal: contiguous shards, causal: zigzag
shards (rank r holds chunks r and 2P-1-r of 2P).  The ring runs over the world's ranks (one node: its ranks).

Forward methods:
  ring: ``mkernel.ring_attention`` (step path: one launch per ring step, K/V blocks pulled by the copy engines);
  ring persistent: the same with ``RingAttentionOptions(persistent=True)`` (one persistent kernel per call);
  (a) all-gather: NCCL ``all_gather_into_tensor`` of K and V, then torch SDPA of the local queries against the
      gathered sequence.  Non-causal: one SDPA call, torch's default backend ("(a) SDPA") and pinned to cuDNN
      ("(a) cuDNN").  Causal: the zigzag blocks put back in sequence order, then each local chunk against its
      prefix with a bottom-right causal mask (``torch.nn.attention.bias.causal_lower_right``: flash), no dense
      mask.  GQA through ``enable_gqa``, or K/V repeated over the group where that fails.  "(a)" in the
      speedups is the faster variant;
  (b) host ring: ring-flash-attn's scheme, a host-driven ring of torch's flash op per step (K/V repeated over
      the group), the partial results merged by their LSE in fp32, NCCL ``batch_isend_irecv`` of the next block;
  single: ``mkernel.attention`` on one GPU, the local queries against a local K/V as long as the whole sequence,
      non-causal: the compute bound (what the ring would reach with free transfers).
Backward methods (``--backward``, the default; ``--no-backward`` skips them):
  ring: ``mkernel.ring_attention_backward`` (out and lse from ``mkernel.ring_attention``);
  (a) all-gather: (a)'s forward run once under autograd outside the timed region (K/V kept from it), then timed:
      ``torch.autograd.grad`` with respect to q and the gathered K/V and NCCL ``reduce_scatter_tensor`` of dK, dV
      to their owners;
  single: ``mkernel.attention_backward`` of the single forward.
Every method's result is checked on its first call against (a)'s (relative Frobenius error < 2e-2; a mismatch
is noted in the report; without (a) the persistent kernel is checked against the step path); a method that
cannot run (a missing torch backend, out of memory) is "n/a".

GPU time: CUDA events on torch's current stream, every method of a shape and pass in the same alternating
rounds, each batch behind a GPU-side delay that outlasts its submission (bench/_common.py ``Methods``); a
method's time is the max over ranks of each rank's median per call, and the ranks' medians are kept (their
max / min spread: the zigzag balance).  Host time per eager call (ours): back-to-back calls with a new set of
torch tensors every call (``POOL`` sets in rotation: other pointers each call), the median over rounds, max
over ranks; every method's submission time on the same tensors is in the JSON (``<method>_host_ms``).

TFLOP/s per GPU: forward 4 B H_q S S_local D / t (causal counted at half), backward 2.5x that (five GEMMs);
single: the same without the causal half (it computes every pair).  With ranks sharing a GPU (P > GPUs) the
numbers are harness checks only: "pending (shared GPU)", and (a), (b) do not run (NCCL refuses two ranks on one
GPU: torch.distributed is not set up); with P = 1 the ring's kernels run with no transfers.
Writes ``<out>/ring_attention_bench.{md,json,png}`` from rank 0 (default docs/; the JSON is rewritten after
every shape, so a run cut short leaves what it measured; ``--json FILE``: also that file; ``--replot JSON``:
the report again from a run's JSON, no GPU).  NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are
set before torch is imported.
"""
from __future__ import annotations

import argparse
import importlib.util
import socket
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import _common as C  # noqa: E402

_f = C.fmt_or_na

C.setup_env()  # before torch is imported anywhere

STEM = "ring_attention_bench"
PENDING = "pending (shared GPU)"
REL_TOL = 2e-2
POOL, HOST_ROUNDS = 4, 5  # host time: tensor sets in rotation, rounds of POOL back-to-back calls
# issue 39's targets
TARGET_SINGLE, TARGET_SINGLE_MIN_SL = 0.95, 8192
TARGET_VS_BASE = 1.3
TARGET_SPREAD = 0.05
TARGETS = [f"ring per GPU >= {TARGET_SINGLE}x the single-GPU kernel's TFLOP/s at S_local >= {TARGET_SINGLE_MIN_SL}",
           f"ring >= {TARGET_VS_BASE}x (a) all-gather + SDPA and (b) the host-driven ring",
           f"zigzag (causal) ranks within {TARGET_SPREAD:.0%} of each other (max / min of the ranks' median times)"]

# (key, label) per pass; "ours": our ring methods, "a": (a)'s variants, "b": (b), "single": the compute bound
METHODS = {
    "fwd": [("mkernel_ring", "ring"), ("mkernel_ring_persistent", "ring persistent"), ("allgather_sdpa", "(a) SDPA"),
            ("allgather_cudnn", "(a) cuDNN"), ("host_ring_flash", "(b) host ring"),
            ("mkernel_single_equiv", "single GPU")],
    "bwd": [("mkernel_ring_bwd", "ring"), ("allgather_sdpa_bwd", "(a) SDPA + RS"),
            ("allgather_cudnn_bwd", "(a) cuDNN + RS"), ("mkernel_single_equiv_bwd", "single GPU")],
}
ROLES = {
    "fwd": dict(ours=("mkernel_ring", "mkernel_ring_persistent"), a=("allgather_sdpa", "allgather_cudnn"),
                b="host_ring_flash", single="mkernel_single_equiv", factor=1.0),
    "bwd": dict(ours=("mkernel_ring_bwd",), a=("allgather_sdpa_bwd", "allgather_cudnn_bwd"), b=None,
                single="mkernel_single_equiv_bwd", factor=2.5),
}
PASS_TITLE = {"fwd": "Forward", "bwd": "Backward"}
CAUSAL_TITLE = {False: "non-causal", True: "causal (zigzag shards)"}


# ------------------------------------------------------------------------------------ numbers
def _ok(v) -> bool:
    return v is not None and v == v and v > 0


def _num(v) -> bool:
    return v is not None and v == v


def attn_flops(B: int, Hq: int, S: int, S_local: int, D: int, causal: bool) -> float:
    """Forward FLOPs of one rank: its S_local queries against the S keys, two GEMMs (causal: half the pairs)."""
    f = 4.0 * B * Hq * S * S_local * D
    return f / 2 if causal else f


def derive(rec: dict) -> dict:
    """TFLOP/s, speedups, ratios to the single-GPU bound and rank spreads of a record with ``<method>_ms`` times
    (in place; returns it).  Per pass: ``<pass>_a_ms`` / ``<pass>_a_key`` (the faster (a) variant) and
    ``<pass>_best_key`` (our faster method)."""
    if rec.get("skipped"):
        return rec
    B, Hq, S, Sl, D, causal = rec["B"], rec["H_q"], rec["S"], rec["S_local"], rec["D"], rec["causal"]
    for pas, role in ROLES.items():
        flops = role["factor"] * attn_flops(B, Hq, S, Sl, D, causal)
        flops_single = role["factor"] * attn_flops(B, Hq, S, Sl, D, False)
        for key, _ in METHODS[pas]:
            if _ok(rec.get(key + "_ms")):
                fl = flops_single if key == role["single"] else flops
                rec[key + "_tflops"] = fl / (rec[key + "_ms"] * 1e-3) / 1e12
        a = [(rec[k + "_ms"], k) for k in role["a"] if _ok(rec.get(k + "_ms"))]
        if a:
            rec[pas + "_a_ms"], rec[pas + "_a_key"] = min(a)
        b_ms = rec.get(role["b"] + "_ms") if role["b"] else None
        single = rec.get(role["single"] + "_tflops")
        ours = []
        for key in role["ours"]:
            ms = rec.get(key + "_ms")
            if not _ok(ms):
                continue
            ours.append((ms, key))
            if a:
                rec[key + "_vs_a"] = rec[pas + "_a_ms"] / ms
            if _ok(b_ms):
                rec[key + "_vs_b"] = b_ms / ms
            if _ok(single):
                rec[key + "_vs_single"] = rec[key + "_tflops"] / single
            ranks = rec.get(key + "_rank_ms") or []
            if ranks and all(_ok(t) for t in ranks):
                rec[key + "_spread"] = max(ranks) / min(ranks) - 1.0
        if ours:
            rec[pas + "_best_key"] = min(ours)[1]
    return rec


def pending(meta: dict) -> str | None:
    """Why the targets cannot be judged on this run (None: they can)."""
    if meta.get("shared_gpu"):
        return PENDING
    if meta.get("P", 1) < 2:
        return "pending (P = 1: no transfers)"
    return None


def targets(rec: dict, meta: dict) -> dict:
    """Issue 39's targets for one record's forward: ``single``, ``vs_a``, ``vs_b``, ``spread`` -> "met" /
    "missed" / "pending" (ranks sharing a GPU, or P = 1) / "n/a" (not measured) / "-" (does not apply).  Ours:
    the faster of the step path and the persistent kernel; the spread: the step path (the default)."""
    best = rec.get("fwd_best_key")
    held = pending(meta)

    def judge(v, good):
        if held:
            return "pending"
        if not _num(v):
            return "n/a"
        return "met" if good(v) else "missed"

    out = {"single": "-", "spread": "-"}
    if rec["S_local"] >= TARGET_SINGLE_MIN_SL:
        out["single"] = judge(rec.get(f"{best}_vs_single"), lambda v: v >= TARGET_SINGLE)
    out["vs_a"] = judge(rec.get(f"{best}_vs_a"), lambda v: v >= TARGET_VS_BASE)
    out["vs_b"] = judge(rec.get(f"{best}_vs_b"), lambda v: v >= TARGET_VS_BASE)
    if rec["causal"]:
        out["spread"] = judge(rec.get("mkernel_ring_spread"), lambda v: v <= TARGET_SPREAD)
    return out


# ------------------------------------------------------------------------------------ report
def _cell(rec: dict, key: str) -> str:
    """``ms (TFLOP/s)`` of a method, or n/a."""
    ms = rec.get(key + "_ms")
    return f"{ms:.3f} ({rec[key + '_tflops']:.0f})" if _ok(ms) and rec.get(key + "_tflops") else "n/a"


def _x(v) -> str:
    return _f(v, ".2f") + ("x" if _num(v) else "")


def _pct(v) -> str:
    return _f(None if v is None else 100.0 * v, ".1f") + ("%" if _num(v) else "")


def _us(v) -> str:
    return _f(None if v is None else v * 1e3, ".0f")


def forward_table(results: list, meta: dict, causal: bool) -> str:
    headers = ["S", "S_local"] + [f"{label} ms (TFLOP/s)" for _, label in METHODS["fwd"]] + [
        "ring vs (a) / (b)", "persistent vs (a) / (b)", "ring / single", "persistent / single",
        "rank spread ring / persistent", "host us/call ring / persistent",
        f">={TARGET_SINGLE}x single", f">={TARGET_VS_BASE}x (a)", f">={TARGET_VS_BASE}x (b)",
        f"ranks within {TARGET_SPREAD:.0%}"]
    rows = []
    for r in results:
        if r["causal"] != causal:
            continue
        if r.get("skipped"):
            rows.append([r["S"], f"skipped: {r['skipped']}"] + ["n/a"] * (len(headers) - 2))
            continue
        t = targets(r, meta)
        ring, pers = "mkernel_ring", "mkernel_ring_persistent"
        rows.append([r["S"], r["S_local"], *(_cell(r, k) for k, _ in METHODS["fwd"]),
                     f"{_x(r.get(ring + '_vs_a'))} / {_x(r.get(ring + '_vs_b'))}",
                     f"{_x(r.get(pers + '_vs_a'))} / {_x(r.get(pers + '_vs_b'))}",
                     _f(r.get(ring + "_vs_single"), ".2f"), _f(r.get(pers + "_vs_single"), ".2f"),
                     f"{_pct(r.get(ring + '_spread'))} / {_pct(r.get(pers + '_spread'))}",
                     f"{_us(r.get(ring + '_host_fresh_ms'))} / {_us(r.get(pers + '_host_fresh_ms'))}",
                     t["single"], t["vs_a"], t["vs_b"], t["spread"]])
    return C.markdown_table(headers, rows)


def backward_table(results: list, causal: bool) -> str:
    headers = ["S", "S_local"] + [f"{label} ms (TFLOP/s)" for _, label in METHODS["bwd"]] + [
        "ring vs (a)", "ring / single", "rank spread ring", "host us/call ring"]
    rows = []
    for r in results:
        if r["causal"] != causal or not r.get("backward"):
            continue
        if r.get("skipped"):
            rows.append([r["S"], f"skipped: {r['skipped']}"] + ["n/a"] * (len(headers) - 2))
            continue
        k = "mkernel_ring_bwd"
        rows.append([r["S"], r["S_local"], *(_cell(r, m) for m, _ in METHODS["bwd"]), _x(r.get(k + "_vs_a")),
                     _f(r.get(k + "_vs_single"), ".2f"), _pct(r.get(k + "_spread")),
                     _us(r.get(k + "_host_fresh_ms"))])
    return C.markdown_table(headers, rows)


def notes(results: list) -> list:
    """One line per noted problem: a method that did not run or did not match (a), a variant used instead."""
    out = []
    for r in results:
        where = f"S={r['S']} {'causal' if r['causal'] else 'non-causal'}"
        for k, v in r.items():
            if k.endswith("_note"):
                out.append(f"* {where}: {k[:-5]}: {v}")
            elif k.endswith("_variant"):
                out.append(f"* {where}: {k[:-8]} ran as: {v}")
        if r.get("persistent_path") is False:
            out.append(f"* {where}: RingAttentionOptions(persistent=True) ran the step path (plan.persistent False)")
        if r.get("ring_bwd_kernel") == "mma":
            out.append(f"* {where}: the ring backward ran its mma main kernel (plan.backward_fallback)")
    return out


def run_status(meta: dict) -> str:
    """The paragraph that says what this run's numbers can tell."""
    P, gpus = meta["P"], meta.get("gpus", meta["P"])
    if meta.get("shared_gpu"):
        return (f"**{PENDING}**: this run's {P} ranks share {gpus} GPU(s), so its numbers are harness checks "
                "only (the ranks' kernels time-slice, no block crosses NVLink) and every target stays pending "
                "until a run with one GPU per rank."
                + ("" if meta.get("nccl_baselines", True) else
                   " (a) and (b) did not run: they need NCCL, which refuses ranks sharing a GPU."))
    if P == 1:
        return ("**P = 1**: the ring's kernels run with no transfers (no peers: the step path is one launch, the "
                "persistent kernel reads only its own block), and (a) / (b) reduce to torch's attention on one "
                "GPU: kernel comparisons, not the ring's. The targets need P >= 2 GPUs: pending.")
    return f"{P} ranks on {gpus} GPUs: one GPU per rank."


def report(results: list, meta: dict, out_dir: Path) -> str:
    shared = meta.get("shared_gpu")
    title = (f"# Ring attention benchmark ({meta['P']} rank{'s' if meta['P'] != 1 else ''}, {meta['gpu']}"
             f"{'; ' + PENDING if shared else ''})")
    sizes = sorted({r["S"] for r in results})
    nodes = "one node" if meta.get("nodes", 1) == 1 else f"{meta['nodes']} nodes"
    md = [title, "",
          f"{meta['date']}, torch {meta['torch']}, NCCL {meta['nccl']}; {meta['P']} rank(s) on {meta.get('gpus', '?')} "
          f"GPU(s) of {nodes}; B={meta['B']}, H_q={meta['H_q']}, H_kv={meta['H_kv']}, D={meta['D']}, bf16, "
          f"bshd; total S: {', '.join(map(str, sizes))} (S_local = S / P); "
          f"{'--quick, ' if meta.get('quick') else ''}{meta['elapsed_s']:.0f} s"
          f"{' (cut short)' if meta.get('partial') else ''}.  Produced by bench/ring_attention.py.", "",
          run_status(meta), "",
          "Ranks sharing a GPU (P > number of GPUs): the numbers are harness checks only, "
          f"\"{PENDING}\". With P = 1 the ring kernels run with no transfers.", "",
          "Targets (issue 39; met / missed / pending per row of the forward, '-' where one does not apply; ours = "
          "the faster of ring and ring persistent):", ""]
    md += [f"* {t}" for t in TARGETS]
    md += ["",
           "Methods: ring = mkernel.ring_attention (step path), ring persistent = RingAttentionOptions(persistent="
           "True); (a) = NCCL all-gather of K/V + torch SDPA of the local queries (causal: the gathered blocks in "
           "sequence order, each local zigzag chunk against its prefix with a bottom-right causal mask), the "
           "default backend (SDPA) and cuDNN (non-causal), \"(a)\" in the speedups the faster; (b) = host-driven "
           "ring of torch's flash op with an LSE merge and NCCL send/recv (ring-flash-attn's scheme); single = "
           "mkernel.attention on one GPU, the local queries against a local K/V as long as the whole sequence, "
           "non-causal (the compute bound). Backward: ring = mkernel.ring_attention_backward; (a) = "
           "torch.autograd.grad of (a)'s forward (run outside the timed region) + NCCL reduce-scatter of dK, dV "
           "(RS); single = mkernel.attention_backward.", "",
           "Times: CUDA events, every method of a shape and pass in the same alternating rounds, each batch behind "
           "a GPU-side delay that outlasts its submission (GPU time); the max over ranks of each rank's median "
           "per call, ms. TFLOP/s per GPU: forward 4 B H_q S S_local D / t (causal at half), backward 2.5x that; "
           "single without the causal half. Speedup = (a) or (b)'s time / ours; ring / single = the ratio of "
           "TFLOP/s. Rank spread = max / min - 1 of the ranks' median times. Host us/call: the host's time to "
           "submit one eager call with new torch tensors every call (4 sets in rotation), the max over ranks.", ""]
    for causal in (False, True):
        if any(r["causal"] == causal for r in results):
            md += [f"## Forward, {CAUSAL_TITLE[causal]}", "", forward_table(results, meta, causal), ""]
    for causal in (False, True):
        if any(r["causal"] == causal and r.get("backward") for r in results):
            md += [f"## Backward, {CAUSAL_TITLE[causal]}", "", backward_table(results, causal), ""]
    extra = notes(results)
    if extra:
        md += ["Notes:", ""] + extra + [""]
    plot_fn = None
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: no PNG (install it, then rebuild with --replot JSON)", flush=True)
    else:
        plot_fn = lambda path: plot(results, path, meta)  # noqa: E731
    return C.write_report(out_dir, STEM, "\n".join(md).rstrip() + "\n", meta, results, plot_fn)


# plot series: (role, label, matplotlib fmt with a fixed color: a method keeps its color in every panel); a
# role names one method per pass (absent: none in that pass)
SERIES = [("ring", "ring (mkernel)", "o-C0"), ("persistent", "ring persistent", "D-C1"),
          ("a_sdpa", "(a) all-gather + SDPA", "s--C2"), ("a_cudnn", "(a) all-gather + cuDNN", "v--C3"),
          ("b", "(b) host ring", "^--C4"), ("single", "single GPU (bound)", "x:C7")]
SERIES_KEYS = {"fwd": dict(zip([s[0] for s in SERIES], [k for k, _ in METHODS["fwd"]])),
               "bwd": dict(ring="mkernel_ring_bwd", a_sdpa="allgather_sdpa_bwd", a_cudnn="allgather_cudnn_bwd",
                           single="mkernel_single_equiv_bwd")}


def plot(results: list, path: Path, meta: dict) -> None:
    """TFLOP/s per GPU against total S, one panel per (pass, causal), one line per method."""
    rows = []
    for pas in ("fwd", "bwd"):
        for causal in (False, True):
            name = f"{PASS_TITLE[pas].lower()}, {'causal' if causal else 'non-causal'}"
            for r in sorted(results, key=lambda r: r["S"]):
                if r["causal"] != causal or r.get("skipped"):
                    continue
                vals = {role + "_tflops": r.get(key + "_tflops") for role, key in SERIES_KEYS[pas].items()}
                if any(vals.values()):
                    rows.append(dict(name=name, M=r["S"], **vals))
    if not rows:
        print("no timings to plot", flush=True)
        return
    title = (f"Ring attention, {meta['P']} rank(s), {meta['gpu']}, B={meta['B']} H={meta['H_q']}/{meta['H_kv']} "
             f"D={meta['D']}" + (f" ({PENDING})" if meta.get("shared_gpu") else ""))
    C.plot_by_m(rows, path, title, SERIES, xlabel="total sequence length S")


# ------------------------------------------------------------------------------------ GPU side
def sequence_order(torch, P: int, S: int, causal: bool, device):
    """Row index that puts the gathered rows (the P shards in rank order) in sequence order: ``natural =
    gathered[:, idx]``; None for contiguous shards (already in order)."""
    if not causal:
        return None
    import numpy as np

    from mkernel.ops.ring_attention import zigzag_indices

    pos = np.concatenate([zigzag_indices(S, P, j) for j in range(P)])
    return torch.from_numpy(np.argsort(pos)).to(device)


def stacked(x):
    """``[P, B, ...]`` viewed as ``[P * B, ...]``: the concatenated form of all_gather_into_tensor's output and
    reduce_scatter_tensor's input, which every backend takes (NCCL also takes the stack, gloo does not)."""
    return x.contiguous().view(-1, *x.shape[2:])


def gathered_sequence(g, order):
    """``[P, B, S_local, H, D]`` (all_gather_into_tensor's stack) -> ``[B, H, S, D]`` in sequence order."""
    P, B, Sl, H, D = g.shape
    x = g.permute(1, 0, 2, 3, 4).reshape(B, P * Sl, H, D)
    if order is not None:
        x = x.index_select(1, order)
    return x.transpose(1, 2)


def local_attention(torch, F, qt, K, V, causal: bool, chunks, backend: str, gqa: str):
    """(a)'s attention of this rank's queries ``qt [B, H_q, S_local, D]`` against the whole sequence ``K, V [B,
    H_kv, S, D]`` (sequence order), ``[B, H_q, S_local, D]``.  Non-causal: one SDPA call.  Causal (zigzag): each
    local chunk c of ``chunks`` (rows [i C, (i+1) C)) against keys [0, (c+1) C) with a bottom-right causal mask.
    ``backend``: "default" (torch's choice) or "cudnn" (pinned); ``gqa``: "native" (``enable_gqa``) or "repeat"
    (K/V repeated over the group)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    grp = qt.shape[1] // K.shape[1]
    kw = {}
    if grp > 1 and gqa == "native":
        kw["enable_gqa"] = True
    elif grp > 1:
        K, V = K.repeat_interleave(grp, 1), V.repeat_interleave(grp, 1)
    pin = sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) if backend == "cudnn" else contextlib.nullcontext()
    with pin:
        if not causal:
            return F.scaled_dot_product_attention(qt, K, V, **kw)
        C_ = qt.shape[2] // 2
        outs = []
        for i, c in enumerate(chunks):
            n = (c + 1) * C_
            outs.append(F.scaled_dot_product_attention(qt[:, :, i * C_:(i + 1) * C_], K[:, :, :n], V[:, :, :n],
                                                       attn_mask=causal_lower_right(C_, n), **kw))
        return torch.cat(outs, 2)


def host_ring(torch, dist, q, k, v, P: int, r: int, causal: bool):
    """(b): a zero-argument call of the host-driven ring (torch's flash op per step, LSE merge in fp32, NCCL
    send/recv of the next block); returns the fp32 output ``[B, H_q, S_local, D]``."""
    Sl, Hq, Hkv = q.shape[1], q.shape[2], k.shape[2]

    def run():
        kc, vc = k, v
        o_acc = l_acc = None
        for step in range(P):
            if step < P - 1:
                kn, vn = torch.empty_like(kc), torch.empty_like(vc)
                ops = [dist.P2POp(dist.isend, kc, (r + 1) % P), dist.P2POp(dist.isend, vc, (r + 1) % P),
                       dist.P2POp(dist.irecv, kn, (r - 1) % P), dist.P2POp(dist.irecv, vn, (r - 1) % P)]
                reqs = dist.batch_isend_irecv(ops)
            j = (r - step) % P
            # causal zigzag: step 0 is causal over the local rows; later, j < r: both local chunks see j's first
            # chunk; j > r: only the high local chunk sees anything, and it sees both of j's chunks
            c = causal and step == 0
            if causal and step > 0:
                qq, kk, vv = (q, kc[:, :Sl // 2], vc[:, :Sl // 2]) if j < r else (q[:, Sl // 2:], kc, vc)
            else:
                qq, kk, vv = q, kc, vc
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention(
                qq.transpose(1, 2), kk.transpose(1, 2).repeat_interleave(Hq // Hkv, 1),
                vv.transpose(1, 2).repeat_interleave(Hq // Hkv, 1), is_causal=c)[:2]
            o = o.float()
            lo = Sl - qq.shape[1]
            if o_acc is None:
                o_acc, l_acc = o, lse
            else:
                la = l_acc[:, :, lo:]
                m = torch.maximum(la, lse)
                wa, wn = torch.exp(la - m), torch.exp(lse - m)
                tot = wa + wn
                o_acc[:, :, lo:] = o_acc[:, :, lo:] * (wa / tot)[..., None] + o * (wn / tot)[..., None]
                l_acc[:, :, lo:] = m + torch.log(tot)
            if step < P - 1:
                for req in reqs:
                    req.wait()
                kc, vc = kn, vn
        return o_acc
    return run


def add_first(methods, rec: dict, key: str, builders, check=None) -> bool:
    """Add method ``key`` from the first of ``builders`` (``[(label, build)]``, ``build()`` returns the method's
    zero-argument call) that builds and runs; the label of a later one that runs goes to ``<key>_variant``, the
    failures' reasons to ``<key>_<label>_note`` (the last one's to ``<key>_note``)."""
    for i, (label, build) in enumerate(builders):
        try:
            fn = build()
        except Exception as exc:  # noqa: BLE001 -- a torch backend that does not take this shape
            rec[key + "_note"] = f"{type(exc).__name__}: {exc}"[:300]
            ok = False
        else:
            ok = methods.add(key, fn, check)
        if ok:
            if i:
                rec[key + "_variant"] = label
            return True
        if i + 1 < len(builders):
            rec[f"{key}_{label}_note"] = rec.pop(key + "_note", "failed")
    return False


def first_result(fn, store: dict, name: str, keep=lambda res: res):
    """``fn`` that keeps its first call's result, through ``keep`` (a copy where ``fn`` reuses its buffers), in
    ``store[name]`` (the reference the other methods check against)."""
    def run():
        res = fn()
        if name not in store:
            store[name] = keep(res)
        return res
    return run


def add_allgather_baselines(methods, rec: dict, ref: dict, allgather, against_a, suffix: str = "") -> None:
    """(a) where NCCL runs: ``allgather_sdpa<suffix>`` on torch's default backend and, non-causal,
    ``allgather_cudnn<suffix>`` on cuDNN, each built by ``allgather(backend, gqa, name)`` with GQA native, else
    K/V repeated over the group; ``ref["a"]`` is the result of whichever of the two ran."""
    if not rec["nccl_baselines"]:
        return

    def variants(backend, name):
        return [("enable_gqa", allgather(backend, "native", name)),
                ("K/V repeated over the group", allgather(backend, "repeat", name))]

    add_first(methods, rec, "allgather_sdpa" + suffix, variants("default", "a"))
    if not rec["causal"]:  # (causal: a bottom-right mask, which torch offers with flash only)
        add_first(methods, rec, "allgather_cudnn" + suffix, variants("cudnn", "cudnn"), against_a(lambda: ref["cudnn"]))
        if "a" not in ref and "cudnn" in ref:
            ref["a"] = ref["cudnn"]


def host_fresh_ms(torch, comm, call, sets, rounds: int) -> float:
    """Median over ``rounds`` of the host time to submit one eager ``call(*args)``, back to back, each call on
    the next tensor set of ``sets`` (other pointers every call, as with fresh tensors); the device synchronized
    and the ranks at a barrier between rounds."""
    for args in sets:
        call(*args)
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        comm.Barrier()
        t0 = time.perf_counter()
        for args in sets:
            call(*args)
        out.append((time.perf_counter() - t0) * 1e3 / len(sets))
    torch.cuda.synchronize()
    return statistics.median(out)


def host_fresh(ctx, torch, rec: dict, key: str, methods, call, sets, quick: bool) -> None:
    """``<key>_host_fresh_ms``: :func:`host_fresh_ms` of ``call``, the max over ranks, where the method ran on
    every rank (a collective: all ranks or none); a failure is noted, not raised."""
    if not C.all_ranks_ok(key in methods.fns, ctx.world):
        return
    try:
        t = host_fresh_ms(torch, ctx.world, call, sets, 3 if quick else HOST_ROUNDS)
    except Exception as exc:  # noqa: BLE001
        rec[key + "_host_fresh_note"] = f"{type(exc).__name__}: {exc}"[:300]
        t = None
    rec[key + "_host_fresh_ms"] = C.max_over_ranks(t, ctx.world)[0]


def fresh_sets(tensors, n: int) -> list:
    """``n`` copies of the tuple ``tensors`` (new storage each)."""
    return [tuple(t.clone() for t in tensors) for _ in range(n)]


def finish_timing(ctx, methods, rec: dict, rp: dict, keys) -> None:
    """Time the methods (max over ranks into ``<key>_ms`` / ``<key>_host_ms``) and keep every rank's median
    (``<key>_rank_ms``)."""
    stats = methods.time(rp, keys)
    for key in keys:
        rec[key + "_rank_ms"] = ctx.world.allgather(stats[key]["median_ms"] if key in stats else None)


def measure_forward(ctx, torch, dist, mk, rec: dict, q, k, v, rp: dict, quick: bool) -> None:
    F = torch.nn.functional
    P, r, S, causal = rec["P"], ctx.rank, rec["S"], rec["causal"]
    B, Sl, Hq, D = q.shape
    s = torch.cuda.current_stream().cuda_stream
    out, out_p = torch.empty_like(q), torch.empty_like(q)
    lse = torch.empty(B, Hq, Sl, device=q.device, dtype=torch.float32)
    lse_p = torch.empty_like(lse)
    persistent = mk.RingAttentionOptions(persistent=True)
    order = sequence_order(torch, P, S, causal, q.device)
    chunks = (r, 2 * P - 1 - r)
    kg = torch.empty((P, *k.shape), device=k.device, dtype=k.dtype)
    vg = torch.empty_like(kg)
    ref = {}
    methods = C.Methods(ctx, rec, REL_TOL)

    def allgather(backend, gqa, name):
        def build():
            def run():
                dist.all_gather_into_tensor(stacked(kg), k)
                dist.all_gather_into_tensor(stacked(vg), v)
                return local_attention(torch, F, q.transpose(1, 2), gathered_sequence(kg, order),
                                       gathered_sequence(vg, order), causal, chunks, backend, gqa)
            return first_result(run, ref, name)
        return build

    def against_a(get):
        return (lambda: C.rel_err(torch, get(), ref["a"])) if "a" in ref else None

    add_allgather_baselines(methods, rec, ref, allgather, against_a)

    def ring():
        mk.ring_attention(ctx, q, k, v, out, lse=lse, causal=causal, stream=s)

    def ring_persistent():
        mk.ring_attention(ctx, q, k, v, out_p, lse=lse_p, causal=causal, stream=s, options=persistent)

    methods.add("mkernel_ring", ring, against_a(lambda: out.transpose(1, 2)))
    # the persistent kernel against (a), or (no NCCL: ranks sharing a GPU) against the step path's result
    check_p = against_a(lambda: out_p.transpose(1, 2))
    if check_p is None and "mkernel_ring" in methods.fns:
        check_p = lambda: C.rel_err(torch, out_p, out)  # noqa: E731
    if methods.add("mkernel_ring_persistent", ring_persistent, check_p):
        rec["persistent_path"] = bool(getattr(ctx.last_plan("ring_attention"), "persistent", False))
    if rec["nccl_baselines"]:
        methods.add("host_ring_flash", first_result(host_ring(torch, dist, q, k, v, P, r, causal), ref, "b"),
                    against_a(lambda: ref["b"]))
    ks, vs = k.repeat(1, P, 1, 1), v.repeat(1, P, 1, 1)
    out_s, lse_s = torch.empty_like(q), torch.empty(B, Hq, Sl, device=q.device, dtype=torch.float32)
    methods.add("mkernel_single_equiv",
                lambda: mk.attention(q, ks, vs, out_s, lse=lse_s, causal=False, stream=s))
    finish_timing(ctx, methods, rec, rp, [k_ for k_, _ in METHODS["fwd"]])
    ref.clear()
    sets = fresh_sets((q, k, v, out, lse), POOL)
    for key, opts in (("mkernel_ring", None), ("mkernel_ring_persistent", persistent)):
        host_fresh(ctx, torch, rec, key, methods, lambda q_, k_, v_, o_, l_, opts=opts: mk.ring_attention(
            ctx, q_, k_, v_, o_, lse=l_, causal=causal, stream=s, options=opts), sets, quick)


def measure_backward(ctx, torch, dist, mk, rec: dict, q, k, v, rp: dict, quick: bool) -> None:
    F = torch.nn.functional
    P, r, S, causal = rec["P"], ctx.rank, rec["S"], rec["causal"]
    B, Sl, Hq, D = q.shape
    s = torch.cuda.current_stream().cuda_stream
    dout = torch.randn_like(q)
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, Sl, device=q.device, dtype=torch.float32)
    mk.ring_attention(ctx, q, k, v, out, lse=lse, causal=causal, stream=s)  # (the backward's out and lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    order = sequence_order(torch, P, S, causal, q.device)
    chunks = (r, 2 * P - 1 - r)
    ref = {}
    methods = C.Methods(ctx, rec, REL_TOL)

    def allgather(backend, gqa, name):
        def build():
            # (a)'s forward under autograd, once, outside the timed region; the gathered K/V are its leaves
            kg = torch.empty((P, *k.shape), device=k.device, dtype=k.dtype)
            vg = torch.empty_like(kg)
            dist.all_gather_into_tensor(stacked(kg), k)
            dist.all_gather_into_tensor(stacked(vg), v)
            ql, kl, vl = q.detach().requires_grad_(), kg.requires_grad_(), vg.requires_grad_()
            o = local_attention(torch, F, ql.transpose(1, 2), gathered_sequence(kl, order),
                                gathered_sequence(vl, order), causal, chunks, backend, gqa)
            do_t = dout.transpose(1, 2)
            dk_a, dv_a = torch.empty_like(k), torch.empty_like(v)

            def run():  # timed: the gradients, then dK / dV reduce-scattered to their owners
                gq, gk, gv = torch.autograd.grad(o, (ql, kl, vl), do_t, retain_graph=True)
                dist.reduce_scatter_tensor(dk_a, stacked(gk))
                dist.reduce_scatter_tensor(dv_a, stacked(gv))
                return gq, dk_a, dv_a

            return first_result(run, ref, name, keep=lambda res: tuple(x.clone() for x in res))
        return build

    def against_a(get):
        if "a" not in ref:
            return None
        return lambda: max(C.rel_err(torch, g, want) for g, want in zip(get(), ref["a"]))

    add_allgather_baselines(methods, rec, ref, allgather, against_a, "_bwd")

    def ring():
        mk.ring_attention_backward(ctx, q, k, v, out, lse, dout, dq, dk, dv, causal=causal, stream=s)

    if methods.add("mkernel_ring_bwd", ring, against_a(lambda: (dq, dk, dv))):
        rec["ring_bwd_kernel"] = ctx.last_plan("ring_attention_backward").backward_kernel  # (wgmma, or mma)
    ks, vs = k.repeat(1, P, 1, 1), v.repeat(1, P, 1, 1)
    out_s, lse_s = torch.empty_like(q), torch.empty(B, Hq, Sl, device=q.device, dtype=torch.float32)
    dq_s, dk_s, dv_s = torch.empty_like(q), torch.empty_like(ks), torch.empty_like(vs)
    try:
        mk.attention(q, ks, vs, out_s, lse=lse_s, causal=False, stream=s)
    except Exception as exc:  # noqa: BLE001
        rec["mkernel_single_equiv_bwd_note"] = f"forward: {type(exc).__name__}: {exc}"[:300]
    else:
        methods.add("mkernel_single_equiv_bwd", lambda: mk.attention_backward(
            q, ks, vs, out_s, lse_s, dout, dq_s, dk_s, dv_s, causal=False, stream=s))
    finish_timing(ctx, methods, rec, rp, [k_ for k_, _ in METHODS["bwd"]])
    ref.clear()
    sets = fresh_sets((q, k, v, out, lse, dout, dq, dk, dv), POOL)
    host_fresh(ctx, torch, rec, "mkernel_ring_bwd", methods, lambda *a: mk.ring_attention_backward(
        ctx, *a, causal=causal, stream=s), sets, quick)


def measure(ctx, torch, dist, mk, rec: dict, backward: bool, quick: bool) -> dict:
    """One shape: the forward methods, then (``backward``) the backward ones, into ``rec``."""
    B, Sl, Hq, Hkv, D = rec["B"], rec["S_local"], rec["H_q"], rec["H_kv"], rec["D"]
    torch.manual_seed(1000 + ctx.rank)
    q = torch.randn(B, Sl, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Sl, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    # calls per batch from the single-GPU bound's time at ~400 TFLOP/s (shared: the GPU's share)
    est_ms = attn_flops(B, Hq, rec["S"], Sl, D, False) / 400e12 * 1e3 * rec["sharers"]
    rp = C.reps_for(est_ms, quick)
    rec.update(warmup=rp["warmup"], reps=rp["reps"], batch=rp["batch"])
    measure_forward(ctx, torch, dist, mk, rec, q, k, v, rp, quick)
    torch.cuda.empty_cache()
    if backward:
        rec["backward"] = True
        rpb = C.reps_for(3 * est_ms, quick)
        rec["batch_bwd"] = rpb["batch"]
        measure_backward(ctx, torch, dist, mk, rec, q, k, v, rpb, quick)
        torch.cuda.empty_cache()
    return rec


def summary(rec: dict) -> str:
    """One progress line of a measured shape."""
    if rec.get("skipped"):
        return f"S={rec['S']} causal={int(rec['causal'])}: skipped ({rec['skipped']})"
    fwd = " ".join(f"{label} {_f(rec.get(k + '_ms'), '.3f')}" for k, label in METHODS["fwd"])
    bwd = " ".join(f"{label} {_f(rec.get(k + '_ms'), '.3f')}" for k, label in METHODS["bwd"])
    return (f"S={rec['S']} S_local={rec['S_local']} causal={int(rec['causal'])} | fwd ms: {fwd}"
            + (f" | bwd ms: {bwd}" if rec.get("backward") else "")
            + "".join(f" | {k}: {v}" for k, v in rec.items() if k.endswith("_note")))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--s", default="8192,32768", help="total sequence lengths")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the backward methods (default: on)")
    C.add_report_args(ap, HERE.parent / "docs", "ring_attention_bench.json")
    args = ap.parse_args()
    t_start = time.monotonic()
    if C.replot(args, report):
        return 0
    ctx = C.bootstrap(nccl=False)
    # NCCL refuses two ranks on one GPU: the torch baselines need it, so they run only with a GPU per rank (the
    # ring and NCCL's group both span the world's ranks)
    nccl = ctx.gpu_sharers == 1
    if nccl:
        C.init_torch_distributed(ctx.world, ctx.device)
    import torch
    import torch.distributed as dist

    import mkernel as mk
    from mkernel.dist.sharing import gpu_identity

    say = lambda *a: C.rank0_print(ctx.world, *a)  # noqa: E731

    comm, P = ctx.world, ctx.size
    gpus = len(set(comm.allgather((socket.gethostname(), gpu_identity(ctx.device)))))
    shared = P > gpus or not nccl
    sizes = [int(x) for x in args.s.split(",") if x.strip()]
    causals = [bool(int(c)) for c in args.causal.split(",") if c.strip()]
    tag = f" ({PENDING})" if shared else ""
    say(f"{P} rank(s) on {gpus} GPU(s) of {ctx.num_nodes} node(s), {torch.cuda.get_device_name()}{tag}, "
        f"torch {torch.__version__}, S {sizes}, causal {causals}, backward {args.backward}")
    results = []

    def meta_now(partial: bool) -> dict:
        return {"date": time.strftime("%Y-%m-%d %H:%M"), "P": P, "gpus": gpus, "nodes": ctx.num_nodes,
                "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "B": args.b, "H_q": args.hq, "H_kv": args.hkv, "D": args.d, "dtype": "bfloat16", "sizes": sizes,
                "quick": args.quick, "backward": args.backward, "shared_gpu": shared, "nccl_baselines": nccl,
                "pool": POOL,
                "elapsed_s": time.monotonic() - t_start, "targets": TARGETS, "partial": partial}

    for S in sizes:
        for causal in causals:
            rec = {"S": S, "S_local": S // P, "causal": causal, "P": P, "B": args.b, "H_q": args.hq,
                   "H_kv": args.hkv, "D": args.d, "sharers": ctx.gpu_sharers, "shared_gpu": shared,
                   "nccl_baselines": nccl}
            if S % (2 * P if causal else P):
                rec["skipped"] = f"S must be a multiple of {'2P' if causal else 'P'} = {2 * P if causal else P}"
            else:
                try:
                    measure(ctx, torch, dist, mk, rec, args.backward, args.quick)
                except Exception as exc:  # noqa: BLE001 -- e.g. out of memory: reported, the next shape runs
                    rec["error_note"] = f"{type(exc).__name__}: {exc}"[:300]
                    torch.cuda.empty_cache()
            results.append(derive(rec))
            say(f"{summary(rec)} [{time.monotonic() - t_start:.0f} s]")
            if ctx.rank == 0:  # (what a run cut short leaves: --replot rebuilds the report)
                C.write_json(Path(args.out) / f"{STEM}.json", {"meta": meta_now(True), "results": results})
    if ctx.rank == 0:
        meta = meta_now(False)
        C.final_report(report, args.out, STEM, meta, results)
        if args.json:
            C.write_json(args.json, {"meta": meta, "results": results})
    comm.Barrier()
    C.shutdown(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
