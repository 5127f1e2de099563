"""bench/moe.py without a GPU: its configuration list (issue 38's), the unique-bytes and FLOP formulas on a
hand-computed case, the derived numbers and targets, and its report (markdown columns, JSON) from made-up
results."""
from __future__ import annotations

import json

import pytest
from _bench_module import import_bench


@pytest.fixture()
def bench(monkeypatch):
    yield from import_bench(monkeypatch, "moe")


def test_configs(bench):
    c = bench.configs(2)
    assert len(c) == 3 * 4
    assert {r["T"] for r in c} == {128, 512, 4096, 16384}
    assert dict(name="deepseek8", H=7168, F=2048, El=8, E=16, k=8, T=128) in c
    assert dict(name="deepseek32", H=7168, F=2048, El=32, E=64, k=8, T=16384) in c
    assert dict(name="mixtral", H=4096, F=14336, El=4, E=8, k=2, T=4096) in c  # 8 experts in all
    assert {r["E"] for r in bench.configs(8, ["mixtral"], [512])} == {8}
    assert bench.configs(2, ["deepseek8"], [64])[0]["T"] == 64


def test_formulas(bench):
    # 2 ranks of 2 experts each (rank = expert // 2); rank 0's 3 tokens, top-2:
    ids = [[0, 1],   # both on rank 0: nothing leaves
           [1, 2],   # rank 0 and rank 1: one row to rank 1
           [2, 3]]   # both on rank 1: one row (once per destination rank, not per expert)
    assert bench.unique_remote_rows(ids, 2, 0) == 2
    assert bench.unique_remote_rows(ids, 2, 1) == 2  # (the same tokens seen from rank 1: rows to rank 0)
    assert bench.unique_remote_rows([[0, 2, 4, 6]], 2, 0) == 3  # 4 ranks: three others
    assert bench.unique_bytes(2, 8) == 32  # 2 rows x 8 x 2 bytes
    assert bench.layer_flops(6, 8, 4) == 2 * 6 * 8 * 12  # = 1152
    rec = bench.derive({"T": 3, "H": 8, "unique_bytes": 32, "flops": 1152.0, "dispatch_ms": 1e-3, "combine_ms": 2e-3,
                        "torch_ms": 3e-3, "pieces_ms": 1.5e-3, "layer_ms": 1.2e-3, "fused_ms": 1e-3})
    assert rec["dispatch_gbs"] == pytest.approx(32e-9 / 1e-6)
    assert rec["combine_gbs"] == pytest.approx(16e-9 / 1e-6)
    assert rec["fused_tflops"] == pytest.approx(1152 / 1e-6 / 1e12)
    assert rec["layer_vs_torch"] == pytest.approx(2.5) and rec["fused_vs_pieces"] == pytest.approx(1.5)
    assert rec["best_ms"] == 1e-3 and rec["best_vs_torch"] == pytest.approx(3.0)
    assert bench.recv_rows(dict(T=100, k=8, El=32), 2) == 1600
    assert bench.mem_estimate(dict(H=7168, F=2048, El=32, k=8, T=16384), 2) > 32 * bench.C.GiB


def _rec(bench, **kw):
    r = dict(name="deepseek8", H=7168, F=2048, El=8, E=16, k=8, T=4096, P=2, shared_gpu=False,
             unique_bytes=4096 * 0.9 * 7168 * 2, flops=bench.layer_flops(4096 * 8, 7168, 2048),
             torch_ms=3.0, pieces_ms=1.5, route_ms=0.02, dispatch_ms=0.15, combine_ms=0.15, layer_ms=1.2,
             dispatch_gemm_ms=0.6, fused_ms=1.0, torch_host_ms=0.4, layer_host_ms=0.03)
    r.update(kw)
    return bench.derive(r)


def test_targets(bench):
    t = bench.targets(_rec(bench))
    assert t == {"bw": "met", "ll": "-", "vs_a": "met", "vs_b": "met"}  # 352 GB/s each; best 3.0x, 1.5x
    t = bench.targets(_rec(bench, combine_ms=0.5, pieces_ms=1.1))
    assert t["bw"] == "missed" and t["vs_b"] == "missed"
    t = bench.targets(_rec(bench, T=128, ll_dispatch_ms=0.02))
    assert t["bw"] == "-" and t["ll"] == "met"
    assert bench.targets(_rec(bench, T=128, ll_dispatch_ms=0.03))["ll"] == "missed"
    assert bench.targets(_rec(bench, T=128))["ll"] == "pending"  # not measured
    t = bench.targets(_rec(bench, shared_gpu=True))
    assert t == {"bw": "pending", "ll": "-", "vs_a": "pending", "vs_b": "pending"}


def test_report(bench, tmp_path):
    recs = [_rec(bench), _rec(bench, T=128, ll_dispatch_ms=0.02, ll_layer_ms=0.5),
            dict(name="deepseek32", H=7168, F=2048, El=32, E=64, k=8, T=16384, P=2, shared_gpu=False,
                 skipped="needs ~150 GiB per GPU, 139 GiB free")]
    meta = {"P": 2, "gpu": "GPU", "date": "today", "torch": "t", "nccl": "n", "quick": False, "elapsed_s": 1.0,
            "shared_gpu": False, "grouped_mm": "torch._grouped_mm"}
    text = bench.report(recs, meta, tmp_path)
    lines = text.splitlines()
    assert lines[0] == "# MoE expert-parallel benchmark (2 ranks, GPU)"
    assert ">= 300 GB/s" in text and "<= 25 us" in text and ">= 1.5x (a)" in text and ">= 1.15x (b)" in text
    assert "x H x 2 bytes" in text and "2 x (T x k) x H x 3F" in text
    header = [c.strip() for c in next(line for line in lines if line.startswith("| config")).strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| deepseek")]
    assert all(len(r) == len(header) for r in rows)
    big = dict(zip(header, rows[0]))
    assert big["T/rank"] == "4096" and big["(a) torch us"] == "3000" and big["fused layer us"] == "1000"
    assert big["dispatch GB/s"] == "352" and big["combine GB/s"] == "352"  # 4096*0.9*7168*2 B / 150 us
    assert big["layer vs (a) / (b)"] == "2.50 / 1.25" and big["fused vs (a) / (b)"] == "3.00 / 1.50"
    assert big["layer TFLOP/s (best)"] == f"{recs[0]['flops'] / 1e-3 / 1e12:.1f}"
    assert big["host us/call (a) / layer"] == "400 / 30"
    assert (big["BW target"], big["LL target"], big[">=1.5x (a)"], big[">=1.15x (b)"]) == ("met", "-", "met", "met")
    small = dict(zip(header, rows[1]))
    assert small["LL dispatch us"] == "20" and small["LL target"] == "met" and small["BW target"] == "-"
    assert small["LL layer vs (a) / (b)"] == "6.00 / 3.00"
    assert "skipped: needs ~150 GiB" in rows[2][0] and rows[2][5] == "n/a"
    data = json.loads((tmp_path / "moe_bench.json").read_text())
    assert data["results"][0]["dispatch_gbs"] == pytest.approx(352.3, abs=0.1) and data["meta"]["P"] == 2
    assert (tmp_path / "moe_bench.md").read_text() == text


def test_report_shared_gpu(bench, tmp_path):
    meta = {"P": 2, "gpu": "GPU", "date": "today", "torch": "t", "nccl": "n", "quick": True, "elapsed_s": 1.0,
            "shared_gpu": True}
    text = bench.report([_rec(bench, shared_gpu=True), _rec(bench, shared_gpu=True, T=512)], meta, tmp_path)
    assert "shared GPU: not a speed" in text.splitlines()[0]
    rows = [line for line in text.splitlines() if line.startswith("| deepseek")]
    assert len(rows) == 2 and all("shared GPU: not a speed" in r and "met" not in r for r in rows)
