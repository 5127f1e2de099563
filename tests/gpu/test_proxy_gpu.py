"""GPU end to end: a kernel pushes commands through the host-mapped ring, the TCP proxy delivers
them into another rank's device window (2 processes; they may share one GPU).  Skipped without a GPU.

Bounded: the ranks' own waits (the kernel's 10 s, rank 1's MK_TEST_GPU_WAIT) end well before the run's
timeout (MK_TEST_PROXY_GPU_TIMEOUT, default 30 s); if it still runs out, mpirun and its ranks are
killed and the failure shows the ranks' output with their faulthandler stack dumps (MK_TEST_DUMP_AFTER,
5 s before the timeout).  The scenario's CPU model runs in tests/cpu/test_proxy_tcp.py."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))  # (the proxy scenario runner's helpers)
from test_proxy_tcp import _mpirun, run_mpirun  # noqa: E402


def _have_gpu():
    try:
        from cuda.bindings import driver as cu

        return cu.cuInit(0)[0] == cu.CUresult.CUDA_SUCCESS and cu.cuDeviceGetCount()[1] > 0
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _have_gpu(), reason="no CUDA GPU")
def test_gpu_kernel_pushes_through_proxy():
    if _mpirun() is None:
        pytest.skip("no mpirun")
    timeout = float(os.environ.get("MK_TEST_PROXY_GPU_TIMEOUT", "30"))
    env = {"MK_TEST_DUMP_AFTER": str(max(1.0, timeout - 5)), "MK_TEST_GPU_WAIT": str(max(1.0, timeout - 12))}
    rc, out = run_mpirun(2, ["--transport", "tcp", "gpu"], timeout, env)
    assert rc == 0 and out.count("OK gpu ") == 2, f"rc {rc}:\n{out[-8000:]}"
