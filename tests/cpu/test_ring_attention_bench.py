"""bench/ring_attention.py without a GPU: the derived numbers (TFLOP/s, speedups against the faster (a) variant,
ratio to the single-GPU bound, rank spread), issue 39's targets, and the report (markdown tables, the pending
marker when ranks share a GPU, JSON, --replot) from made-up results."""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from _bench_module import import_bench


@pytest.fixture()
def bench(monkeypatch):
    monkeypatch.delitem(sys.modules, "ring_attention", raising=False)  # (examples/ holds one of that name too)
    yield from import_bench(monkeypatch, "ring_attention")


def _rec(bench, S, causal, P=2, sharers=1, **kw):
    """A made-up record: ring at 500 TFLOP/s, persistent 3 % faster, (a) SDPA 1.4x and cuDNN 1.2x slower (non-causal
    only), (b) 1.5x slower, the single bound at 520; backward 10 % below the forward's rate."""
    Sl = S // P
    fwd = bench.attn_flops(1, 32, S, Sl, 128, causal) / 500e12 * 1e3
    full = bench.attn_flops(1, 32, S, Sl, 128, False) / 520e12 * 1e3
    r = dict(S=S, S_local=Sl, causal=causal, P=P, B=1, H_q=32, H_kv=8, D=128, sharers=sharers,
             shared_gpu=sharers > 1, backward=True,
             mkernel_ring_ms=fwd, mkernel_ring_persistent_ms=fwd * 0.97, allgather_sdpa_ms=fwd * 1.4,
             host_ring_flash_ms=fwd * 1.5, mkernel_single_equiv_ms=full,
             mkernel_ring_rank_ms=[fwd, fwd * 1.02][:P], mkernel_ring_persistent_rank_ms=[fwd * 0.97] * P,
             mkernel_ring_host_fresh_ms=0.12, mkernel_ring_persistent_host_fresh_ms=0.09,
             mkernel_ring_bwd_ms=2.5 * fwd * 1.1, allgather_sdpa_bwd_ms=2.5 * fwd * 1.6,
             mkernel_single_equiv_bwd_ms=2.5 * full, mkernel_ring_bwd_rank_ms=[2.75 * fwd] * P,
             mkernel_ring_bwd_host_fresh_ms=0.2)
    if not causal:
        r.update(allgather_cudnn_ms=fwd * 1.2, allgather_cudnn_bwd_ms=2.5 * fwd * 1.3)
    r.update(kw)
    return bench.derive(r)


def _meta(P=2, gpus=2):
    return dict(date="today", P=P, gpus=gpus, gpu="GPU", torch="t", nccl="n", B=1, H_q=32, H_kv=8, D=128,
                quick=False, backward=True, shared_gpu=P > gpus, nccl_baselines=P <= gpus, elapsed_s=12.0,
                partial=False)


def test_derive(bench):
    r = _rec(bench, 16384, False)
    assert r["mkernel_ring_tflops"] == pytest.approx(500.0)
    assert r["mkernel_single_equiv_tflops"] == pytest.approx(520.0)  # (every pair: no causal half)
    assert r["fwd_a_key"] == "allgather_cudnn"  # the faster (a) variant
    assert r["mkernel_ring_vs_a"] == pytest.approx(1.2) and r["mkernel_ring_vs_b"] == pytest.approx(1.5)
    assert r["mkernel_ring_vs_single"] == pytest.approx(500 / 520)
    assert r["mkernel_ring_spread"] == pytest.approx(0.02) and r["mkernel_ring_persistent_spread"] == 0.0
    assert r["fwd_best_key"] == "mkernel_ring_persistent"
    assert r["mkernel_ring_bwd_tflops"] == pytest.approx(500 / 1.1)  # 2.5x the forward's FLOPs
    assert r["bwd_a_key"] == "allgather_cudnn_bwd" and r["mkernel_ring_bwd_vs_a"] == pytest.approx(1.3 / 1.1)
    c = _rec(bench, 16384, True)
    assert c["fwd_a_key"] == "allgather_sdpa" and c["mkernel_ring_vs_a"] == pytest.approx(1.4)
    assert c["mkernel_ring_tflops"] == pytest.approx(500.0)  # causal counted at half
    assert c["mkernel_ring_vs_single"] == pytest.approx(500 / 520)
    missing = _rec(bench, 4096, False, allgather_sdpa_ms=None, allgather_cudnn_ms=None, host_ring_flash_ms=None)
    assert "mkernel_ring_vs_a" not in missing and "mkernel_ring_vs_b" not in missing
    assert bench.derive(dict(S=4096, causal=True, skipped="why")) == dict(S=4096, causal=True, skipped="why")


def test_targets(bench):
    meta = _meta()
    assert bench.targets(_rec(bench, 16384, False), meta) == {"single": "met", "vs_a": "missed", "vs_b": "met",
                                                              "spread": "-"}
    t = bench.targets(_rec(bench, 16384, True), meta)  # (a) 1.4x / 0.97 of the persistent kernel's time
    assert t == {"single": "met", "vs_a": "met", "vs_b": "met", "spread": "met"}
    assert bench.targets(_rec(bench, 16384, True, mkernel_ring_rank_ms=[1.0, 1.06]), meta)["spread"] == "missed"
    assert bench.targets(_rec(bench, 8192, True), meta)["single"] == "-"  # S_local 4096 < 8K
    assert bench.targets(_rec(bench, 16384, True, host_ring_flash_ms=None), meta)["vs_b"] == "n/a"
    for pend in (_meta(P=2, gpus=1), _meta(P=1, gpus=1)):
        assert set(bench.targets(_rec(bench, 16384, True, P=pend["P"]), pend).values()) == {"pending"}
    assert bench.pending(_meta(P=2, gpus=1)) == "pending (shared GPU)"


def _tables(text):
    """{section title: (header cells, [row cells])} of the markdown's tables."""
    out, title = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            title = line[3:]
        elif line.startswith("| ") and title is not None:
            cells = [c.strip() for c in line.strip("|").split("|")]
            if title not in out:
                out[title] = (cells, [])
            else:
                out[title][1].append(cells)
    return out


def test_report_shared_gpu(bench, tmp_path):
    recs = [_rec(bench, S, c, sharers=2) for S in (4096, 16384) for c in (False, True)]
    recs[-1] = _rec(bench, 16384, True, sharers=2, allgather_sdpa_bwd_ms=None,
                    allgather_sdpa_bwd_note="RuntimeError: no backend")
    text = bench.report(recs, _meta(P=2, gpus=1), tmp_path)
    assert text.splitlines()[0] == "# Ring attention benchmark (2 ranks, GPU; pending (shared GPU))"
    assert "**pending (shared GPU)**" in text and "harness checks only" in text
    assert "(a) and (b) did not run: they need NCCL, which refuses ranks sharing a GPU" in text
    assert "With P = 1 the ring kernels run with no transfers" in text
    assert "B=1, H_q=32, H_kv=8, D=128" in text and "total S: 4096, 16384" in text
    assert ">= 0.95x" in text and ">= 1.3x" in text and "within 5%" in text
    tables = _tables(text)
    assert list(tables) == ["Forward, non-causal", "Forward, causal (zigzag shards)", "Backward, non-causal",
                            "Backward, causal (zigzag shards)"]
    for head, rows in tables.values():
        assert len(rows) == 2 and all(len(r) == len(head) for r in rows)
    head, rows = tables["Forward, non-causal"]
    big = dict(zip(head, rows[1]))
    assert big["S"] == "16384" and big["S_local"] == "8192"
    assert big["ring ms (TFLOP/s)"].endswith("(500)") and big["single GPU ms (TFLOP/s)"].endswith("(520)")
    assert big["ring vs (a) / (b)"] == "1.20x / 1.50x" and big["ring / single"] == "0.96"
    assert big["host us/call ring / persistent"] == "120 / 90"
    assert {big[">=0.95x single"], big[">=1.3x (a)"], big[">=1.3x (b)"]} == {"pending"}
    head, rows = tables["Forward, causal (zigzag shards)"]
    big = dict(zip(head, rows[1]))
    assert big["(a) cuDNN ms (TFLOP/s)"] == "n/a" and big["rank spread ring / persistent"] == "2.0% / 0.0%"
    assert big["ranks within 5%"] == "pending"
    head, rows = tables["Backward, causal (zigzag shards)"]
    assert dict(zip(head, rows[1]))["ring vs (a)"] == "n/a"  # (its (a) did not run)
    assert "* S=16384 causal: allgather_sdpa_bwd: RuntimeError: no backend" in text
    data = json.loads((tmp_path / "ring_attention_bench.json").read_text())
    assert data["meta"]["shared_gpu"] is True and len(data["results"]) == 4
    assert (tmp_path / "ring_attention_bench.md").read_text() == text


def test_report_one_gpu_per_rank_and_p1(bench, tmp_path):
    text = bench.report([_rec(bench, 32768, True)], _meta(), tmp_path)
    assert "pending" not in text.splitlines()[0] and "2 ranks on 2 GPUs: one GPU per rank." in text
    head, rows = _tables(text)["Forward, causal (zigzag shards)"]
    row = dict(zip(head, rows[0]))
    assert (row[">=0.95x single"], row[">=1.3x (a)"], row[">=1.3x (b)"], row["ranks within 5%"]) == (
        "met", "met", "met", "met")
    one = bench.report([_rec(bench, 16384, False, P=1)], _meta(P=1, gpus=1), tmp_path / "p1")
    assert "**P = 1**: the ring's kernels run with no transfers" in one
    assert "Backward, non-causal" in one and "mma main kernel" not in one
    mma = bench.report([_rec(bench, 16384, False, P=1, ring_bwd_kernel="mma")], _meta(P=1, gpus=1), tmp_path / "m")
    assert "* S=16384 non-causal: the ring backward ran its mma main kernel (plan.backward_fallback)" in mma


def test_replot(bench, tmp_path, monkeypatch, capsys):
    recs = [_rec(bench, 8192, False, sharers=2), dict(S=8193, S_local=4096, causal=True, P=2, skipped="S odd")]
    src = tmp_path / "run.json"
    src.write_text(json.dumps({"meta": _meta(P=2, gpus=1), "results": recs}))
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["ring_attention.py", "--replot", str(src), "--out", str(out)])
    assert bench.main() == 0
    text = (out / "ring_attention_bench.md").read_text()
    assert "pending (shared GPU)" in text and "| 8193 | skipped: S odd" in text
    assert text in capsys.readouterr().out
    assert (out / "ring_attention_bench.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
