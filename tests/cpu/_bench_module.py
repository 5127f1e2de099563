"""Importing a bench script (bench/<name>.py) in a CPU test: bench/ on sys.path, the environment variables the
bench sets at import restored afterwards, the module dropped from sys.modules at the end."""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def import_bench(monkeypatch, name: str):
    """Yield bench/<name>.py imported (use from a pytest fixture: ``yield from import_bench(monkeypatch, ...)``)."""
    monkeypatch.syspath_prepend(str(BENCH))
    for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):  # (set by the bench at import)
        monkeypatch.setenv(var, os.environ.get(var, ""))
    yield importlib.import_module(name)
    sys.modules.pop(name, None)
