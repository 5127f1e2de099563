"""bench/gemm_rs.py without a GPU: its shape list (the issue's projections and sweep) and its report
(markdown columns, JSON), from a made-up result."""
from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture()
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):  # (set by the bench at import)
        monkeypatch.setenv(var, os.environ.get(var, ""))
    mod = importlib.import_module("gemm_rs")
    yield mod
    sys.modules.pop("gemm_rs", None)


def test_shapes(bench):
    s = bench.shapes(2, quick=False)
    assert len(s) == 4 * 5 + 4
    assert ("llama3-70b.o", 4096, 8192, 4096) in s and ("llama3-405b.down", 32768, 16384, 26624) in s
    assert ("sweep M=N", 16384, 16384, 1024) in s
    assert all(k % 8 == 0 for _, _, _, k in bench.shapes(8, quick=False))  # (16-byte rows: TMA in place)
    assert len(bench.shapes(2, quick=True)) == 5


def test_report(bench, tmp_path):
    rec = {"name": "llama3-70b.o", "M": 8192, "N": 8192, "K_per_rank": 4096, "P": 2, "flops_per_gpu": 5.5e11,
           "nccl_ms": 1.2, "symm_ms": 1.1, "gemm_ms": 0.80, "rs_ms": 0.35, "floor_ms": 0.80, "ours_ms": 0.85,
           "ours_tflops": 647.0, "speedup_vs_nccl": 1.41, "speedup_vs_symm": 1.29, "overlap_eff": 0.941,
           "nccl_host_ms": 0.025, "ours_host_ms": 0.012, "forced_ms": 1.15, "forced_path": "unfused",
           "plan": {"path": "fused", "config": 3, "pred_fused_ms": 0.86, "pred_unfused_ms": 1.1}}
    meta = {"P": 2, "gpu": "GPU", "date": "today", "torch": "t", "nccl": "n", "quick": False, "elapsed_s": 1.0}
    text = bench.report([rec], meta, tmp_path)
    row = next(line for line in text.splitlines() if line.startswith("| llama3-70b.o"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-1] == "25 / 12" and "fused (3)" in cells and "0.94" in cells and "1.41" in cells
    assert "1.150 (unfused)" in cells and "0.860" in cells
    data = json.loads((tmp_path / "gemm_rs_bench.json").read_text())
    assert data["results"][0]["plan"]["config"] == 3
