"""The examples byte-compile (they run on GPUs only: tests/run_gpu.sh runs hpc_cupy.py under mpirun), and the
HPC example imports no torch."""
from __future__ import annotations

import ast
import py_compile
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_byte_compiles(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / "x.pyc"), doraise=True)


def test_hpc_example_imports_no_torch():
    path = next(p for p in EXAMPLES if p.name == "hpc_cupy.py")
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module.split(".")[0])
    assert "torch" not in mods and {"mkernel", "numpy", "mpi4py"} <= mods


def test_the_gpu_suite_runs_the_hpc_example():
    script = (Path(__file__).resolve().parents[2] / "tests" / "run_gpu.sh").read_text()
    assert "python examples/hpc_cupy.py" in script
