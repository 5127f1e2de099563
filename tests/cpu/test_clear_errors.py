"""One clear mkernel error for each way a machine cannot run what was asked: no driver, a GPU the GEMM ops do
not run on, an architecture NVRTC cannot target; a warning for ranks that share a GPU."""
from __future__ import annotations

import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest

import mkernel
from mkernel.core import archs, driver
from mkernel.errors import DeviceError


def _has_driver() -> bool:
    return driver.driver_version() is not None


@pytest.mark.skipif(_has_driver(), reason="this machine has an NVIDIA driver")
@pytest.mark.parametrize("code", [
    "import mkernel; mkernel.init()",
    "import mkernel; mkernel.gemm((0x1000, (16, 16), 'bfloat16'), (0x1000, (16, 16), 'bfloat16'))",
    "import mkernel; mkernel.DeviceArray.empty((4,), 'float32')",
])
def test_no_driver_is_one_clear_error(code):
    """Without libcuda.so the first call that needs the driver raises DeviceError, its traceback ending in
    mkernel's one-line message (not cuda.pathfinder's chain)."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == ("mkernel.errors.DeviceError: no NVIDIA driver found (libcuda.so): "
                                                 "mkernel needs a CUDA GPU")
    assert "pathfinder" not in r.stderr and "During handling" not in r.stderr


def test_init_driver_errors(monkeypatch):
    """cuInit failing to load the library, seeing no GPU, or finding an old driver: one DeviceError each."""
    cu = driver.cu

    def no_lib(flags):
        raise RuntimeError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(cu, "cuInit", no_lib)
    with pytest.raises(DeviceError, match=r"no NVIDIA driver found \(libcuda.so\)"):
        driver.init_driver()
    monkeypatch.setattr(cu, "cuInit", lambda flags: (cu.CUresult.CUDA_ERROR_NO_DEVICE,))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(DeviceError, match=r"sees no CUDA GPU \(CUDA_VISIBLE_DEVICES=''\)"):
        driver.init_driver()
    monkeypatch.setattr(cu, "cuInit", lambda flags: (cu.CUresult.CUDA_ERROR_SYSTEM_DRIVER_MISMATCH,))
    with pytest.raises(DeviceError, match="too old for CUDA 13"):
        driver.init_driver()


@pytest.fixture
def fake_gpu(monkeypatch):
    """``fake_gpu(major, minor)``: every device reports that compute capability (and the name "Fake GPU")."""
    def set_(major, minor):
        A = driver.cu.CUdevice_attribute
        cc = {A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: major, A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: minor}
        monkeypatch.setattr(archs, "device_attribute", lambda attr, device=None: cc[attr])
        monkeypatch.setattr(archs, "device_name", lambda device: "Fake GPU")
        monkeypatch.setattr(archs, "_checked", set())
    return set_


@pytest.mark.parametrize("cc", [(8, 0), (8, 9), (10, 0), (12, 0)])
def test_gemm_ops_refuse_other_architectures(fake_gpu, cc):
    """Every GEMM-based op raises DeviceError naming the op, the device's compute capability and what is
    supported, first thing in its validate stage (before any compile)."""
    from mkernel.ops.ag_gemm.op import _OP as AG
    from mkernel.ops.gemm.api import _GEMM, _GROUPED
    from mkernel.ops.gemm_ar.op import _OP as AR
    from mkernel.ops.gemm_rs.op import _OP as RS

    fake_gpu(*cc)
    call = SimpleNamespace(A=SimpleNamespace(device=0))  # validate must stop before reading anything else
    ctx = SimpleNamespace(device=0, num_nodes=1)
    for op, c, what in ((_GEMM, None, "mkernel.gemm"), (_GROUPED, None, "mkernel.grouped_gemm"),
                        (AG, ctx, "mkernel.ag_gemm"), (RS, ctx, "mkernel.gemm_reduce_scatter"),
                        (AR, ctx, "mkernel.gemm_all_reduce")):
        with pytest.raises(DeviceError) as ei:
            op.validate(c, call)
        msg = str(ei.value)
        assert msg.startswith(what + " needs a GPU of compute capability 9.0"), msg
        assert f"cuda:0 (Fake GPU) has compute capability {cc[0]}.{cc[1]}" in msg and "sm_90a" in msg


def test_hopper_passes_the_check(fake_gpu):
    fake_gpu(9, 0)
    archs.require_gemm_device("mkernel.gemm", 0)
    assert 0 in archs._checked
    assert archs.arch_runs_gemm("sm_90a") and archs.arch_runs_gemm("sm_90")
    assert not archs.arch_runs_gemm("sm_100a") and not archs.arch_runs_gemm("sm_80")


def test_unknown_nvrtc_arch_fails_before_nvrtc(monkeypatch):
    """compile_module for an architecture NVRTC does not target: DeviceError listing what it targets."""
    from mkernel.core import compiler

    monkeypatch.setattr(compiler.nvrtc, "nvrtcCreateProgram", None)  # NVRTC must not run
    with pytest.raises(DeviceError, match=r"NVRTC cannot compile for sm_70: it targets sm_75"):
        compiler.compile_module("ops/collectives.cu", {"MK_DTYPE": 0}, arch="sm_70")


def test_shared_gpus_are_named():
    from mkernel.dist.sharing import shared_gpus

    assert shared_gpus([(0, "a"), (1, "b")]) == {}
    assert shared_gpus([(3, "a"), (1, "b"), (0, "a"), (2, "b"), (4, "c")]) == {"a": [0, 3], "b": [1, 2]}


def test_shared_gpu_warning_is_logged_once_by_the_lowest_rank(caplog):
    from mkernel.dist.sharing import warn_shared_gpus

    entries = [(0, "0000:19:00.0"), (1, "0000:19:00.0"), (2, "0000:3b:00.0")]
    with caplog.at_level(logging.WARNING, logger="mkernel"):
        warn_shared_gpus(1, entries, 3, 2)
        warn_shared_gpus(2, entries, 3, 2)
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="mkernel"):
        warn_shared_gpus(0, entries, 3, 2)
    [rec] = caplog.records
    assert rec.name == "mkernel" and rec.levelno == logging.WARNING
    assert "ranks [0, 1] share the GPU 0000:19:00.0 (3 ranks on this host, 2 GPUs visible)" in rec.getMessage()


def test_device_error_is_public():
    assert mkernel.DeviceError is DeviceError and issubclass(DeviceError, mkernel.MkernelError)
