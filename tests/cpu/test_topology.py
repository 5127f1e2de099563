"""Bootstrap and topology with real MPI ranks on the CPU (no GPU needed), emulated nodes included."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_topology_worker.py")


def _mpirun() -> str:
    cand = Path(sys.executable).with_name("mpirun")
    if cand.exists():
        return str(cand)
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    if not found:
        pytest.skip("no mpirun on PATH")
    return found


def _run(np_: int, rpn: str = "none", env_rpn: str | None = None):
    env = dict(os.environ)
    env.pop("MKERNEL_RANKS_PER_NODE", None)
    if env_rpn is not None:
        env["MKERNEL_RANKS_PER_NODE"] = env_rpn
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [_mpirun(), "-n", str(np_)]
    if "Open MPI" in subprocess.run([_mpirun(), "--version"], capture_output=True, text=True).stdout:
        cmd += ["--allow-run-as-root", "--oversubscribe"]
    out = subprocess.run(cmd + [sys.executable, str(WORKER), rpn], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    line = [l for l in out.stdout.splitlines() if l.startswith("TOPOLOGY ")][0]
    return json.loads(line[len("TOPOLOGY "):])


def test_one_node_two_ranks():
    rows = _run(2)
    assert [r["num_nodes"] for r in rows] == [1, 1]
    assert [r["local_rank"] for r in rows] == [0, 1]
    assert all(r["local_size"] == 2 and not r["emulated"] for r in rows)
    assert rows[0]["local_world_ranks"] == [0, 1]


def test_emulated_one_rank_per_node():
    rows = _run(2, "1")
    assert [r["node"] for r in rows] == [0, 1]
    assert all(r["num_nodes"] == 2 and r["local_size"] == 1 and r["local_rank"] == 0 for r in rows)
    assert all(r["emulated"] for r in rows)
    assert [r["host_rank"] for r in rows] == [0, 1]  # GPUs still chosen by host rank
    assert rows[0]["node_of_rank"] == [0, 1]


def test_emulated_by_environment_variable():
    rows = _run(4, "none", env_rpn="2")
    assert [r["node"] for r in rows] == [0, 0, 1, 1]
    assert [r["local_rank"] for r in rows] == [0, 1, 0, 1]
    assert rows[2]["local_world_ranks"] == [2, 3]
    assert all(r["num_nodes"] == 2 for r in rows)


def test_uneven_emulated_nodes():
    rows = _run(3, "2")
    assert [r["node"] for r in rows] == [0, 0, 1]
    assert [r["local_size"] for r in rows] == [2, 2, 1]
