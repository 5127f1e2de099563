"""kill -9 of a rank in the middle of a kernel, on the GPU (docs/reliability.md, "Pending a GPU run").

Each case starts ``mpirun -np N`` (N = ``MK_KILL_RANKS``, default 2; the ranks may share one GPU) on
tests/faults/_gpu_kill_worker.py: the last rank launches a call and is killed (SIGKILL) while its kernel
waits for its peers; every other rank must raise a CommError (CommTimeout on the device-side waits, or
the proxy's error) within the context timeout + 2 s of the kill, and close() must return at once.  As
in test_mpi_faults.py the victim runs under a shell that outlives it, so the launcher does not end the
job: the survivors find out through their own bounded waits.  Not run by the CPU suite (gpu marker);
the lead runs it in one batch:

    PYTHONPATH=$PWD python -m pytest -q -m "gpu and faults" tests/faults/test_gpu_kill.py
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _launch import run as launch  # noqa: E402

pytestmark = [pytest.mark.faults, pytest.mark.gpu]

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_gpu_kill_worker.py"
TIMEOUT = 2.0  # the workers' context timeout (MK_KILL_TIMEOUT)
SLACK = 2.0
OPS = ["all_reduce_sm", "all_gather_ce", "ag_gemm", "gemm_rs", "internode_all_reduce"]


def _mpirun() -> list:
    path = shutil.which("mpirun") or str(Path(sys.executable).with_name("mpirun"))
    if not Path(path).exists():
        pytest.skip("no mpirun")
    ver = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    if "HYDRA" in ver:
        return [path, "-disable-auto-cleanup"]
    if "Open MPI" in ver or "OpenRTE" in ver:
        return [path, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
    return [path]


def _run(op: str, n: int, tmp_path: Path):
    extra = {"MK_KILL_TIMEOUT": str(TIMEOUT),
             # the proxy case: every peer across the proxy (TCP); the others: one node
             "MKERNEL_RANKS_PER_NODE": "1" if op.startswith("internode") else None}
    return launch(WORKER, op, n, tmp_path, _mpirun(), kill=True, timeout=180.0, env_extra=extra, ready_within=180.0)


@pytest.mark.parametrize("op", OPS)
def test_kill_9_mid_kernel_every_other_rank_raises_in_bound(tmp_path, op):
    n = int(os.environ.get("MK_KILL_RANKS", "2"))
    ranks, t_kill, out = _run(op, n, tmp_path)
    assert sorted(ranks) == list(range(n - 1)), out[-3000:]
    for r, ev in ranks.items():
        errs = [ev[k] for k in ("call0", "call1", "call2") if k in ev and "type" in ev[k]]
        assert errs, (r, ev, out[-2000:])  # three calls with a dead peer: one must fail
        e = errs[0]
        assert e["type"] in ("CommTimeout", "CommError"), (r, e)  # never a CUDA fault, never a hang
        assert e["t"] - t_kill <= TIMEOUT + SLACK, (r, e["t"] - t_kill, e)
        if n == 2:  # the only peer: the error names it
            assert (e.get("record") or {}).get("peer") == 1, (r, e)
        assert "type" not in ev["close"] and ev["close"]["dt"] < 1.0, (r, ev["close"])
