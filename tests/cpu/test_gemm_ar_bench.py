"""bench/gemm_ar.py without a GPU (and without torch): its shape list (the issue's decode and prefill
projections and the sweep), --help, and its report (markdown columns, JSON, the decode wall-time column) from
made-up results."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture()
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):  # (set by the bench at import)
        monkeypatch.setenv(var, os.environ.get(var, ""))
    mod = importlib.import_module("gemm_ar")
    yield mod
    sys.modules.pop("gemm_ar", None)


def test_shapes(bench):
    s = bench.shapes(2, quick=False)
    assert len(s) == 4 * 10 + 4
    assert ("llama3-70b.o", 1, 8192, 4096) in s and ("llama3-405b.down", 32768, 16384, 26624) in s
    assert {m for _, m, _, _ in s if m <= 256} == {1, 8, 32, 128, 256}
    assert ("sweep M=N", 16384, 16384, 1024) in s
    assert all(k % 8 == 0 for _, _, _, k in bench.shapes(8, quick=False))  # (16-byte rows: TMA in place)
    assert len(bench.shapes(2, quick=True)) == 6


def test_help_without_torch():
    r = subprocess.run([sys.executable, str(BENCH / "gemm_ar.py"), "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "one_shot_all_reduce" in r.stdout


def test_report(bench, tmp_path):
    dec = {"name": "llama3-70b.o", "M": 8, "N": 8192, "K_per_rank": 4096, "P": 2, "flops_per_gpu": 5.4e8,
           "decode": True, "nccl_ms": 0.040, "symm1_ms": 0.035, "symm2_ms": None, "symm_ms": 0.035, "gemm_ms": 0.022,
           "ar_ms": 0.014, "floor_ms": 0.022, "ours_ms": 0.025, "ours_tflops": 21.6, "speedup_vs_nccl": 1.6,
           "speedup_vs_symm": 1.4, "overlap_eff": 0.88, "nccl_host_ms": 0.030, "ours_host_ms": 0.009,
           "forced_bandwidth_ms": 0.031, "forced_unfused_ms": 0.041, "nccl_wall_us": 52.0, "symm1_wall_us": 47.5,
           "ours_wall_us": 27.0, "symm2_note": "RuntimeError: multicast",
           "plan": {"path": "latency", "config": 53, "transposed": True, "pred_ms": 0.0254}}
    big = {"name": "llama3-70b.o", "M": 8192, "N": 8192, "K_per_rank": 4096, "P": 2, "flops_per_gpu": 5.5e11,
           "decode": False, "nccl_ms": 1.5, "gemm_ms": 0.80, "ar_ms": 0.55, "floor_ms": 0.80, "ours_ms": 0.84,
           "ours_tflops": 654.0, "nccl_tflops": 366.0, "speedup_vs_nccl": 1.79, "overlap_eff": 0.952,
           "nccl_host_ms": 0.025, "ours_host_ms": 0.012, "forced_latency_ms": 0.95,
           "plan": {"path": "bandwidth", "config": 3, "transposed": False, "pred_ms": 0.90}}
    meta = {"P": 2, "gpu": "GPU", "date": "today", "torch": "t", "nccl": "n", "quick": False, "elapsed_s": 1.0}
    text = bench.report([dec, big], meta, tmp_path)
    rows = [line for line in text.splitlines() if line.startswith("| llama3-70b.o")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert cells[0][-1] == "52.0 / 47.5 / 27.0" and "latency (53, T)" in cells[0] and "1.60" in cells[0]
    assert cells[0][-2] == "30 / 9" and "0.035 / n/a" in cells[0]
    assert "bandwidth 0.031; unfused 0.041" in cells[0]
    assert cells[1][-1] == "-" and "bandwidth (3)" in cells[1] and "0.95" in cells[1] and "latency 0.950" in cells[1]
    assert "(b) unavailable: RuntimeError: multicast" in text
    data = json.loads((tmp_path / "gemm_ar_bench.json").read_text())
    assert data["results"][0]["plan"]["config"] == 53
    assert (tmp_path / "gemm_ar_bench.md").exists()
