"""GPU end to end: a kernel pushes commands through the host-mapped ring, the TCP proxy delivers
them into another rank's device window (2 processes; they may share one GPU).  Skipped without a GPU."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))  # (the proxy scenario runner's helpers)
from test_proxy_tcp import SCRIPT, _env, _mpirun  # noqa: E402


def _have_gpu():
    try:
        from cuda.bindings import driver as cu

        return cu.cuInit(0)[0] == cu.CUresult.CUDA_SUCCESS and cu.cuDeviceGetCount()[1] > 0
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _have_gpu(), reason="no CUDA GPU")
def test_gpu_kernel_pushes_through_proxy():
    res = subprocess.run([_mpirun(), "-np", "2", sys.executable, str(SCRIPT), "--transport", "tcp", "gpu"],
                         capture_output=True, text=True, timeout=300, env=_env())
    out = res.stdout + res.stderr
    assert res.returncode == 0 and out.count("OK gpu ") == 2, out[-4000:]
