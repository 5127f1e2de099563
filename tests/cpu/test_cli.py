"""``python -m mkernel precompile`` and ``python -m mkernel info`` on a machine without a GPU."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from mkernel.cli.precompile import sources_for
from mkernel.core import driver


def _mk(*args, env=None, cache=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith("MKERNEL_")}
    if cache is not None:
        e["MKERNEL_CACHE_DIR"] = str(cache)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "mkernel", *args], capture_output=True, text=True, env=e,
                          timeout=600)


def test_precompile_fills_the_cache_with_progress(tmp_path):
    """--arch needs no GPU; one progress line per finished specialization; a second run finds them cached."""
    r = _mk("precompile", "--ops", "collectives", "--arch", "sm_90a", "--workers", "2", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == (f"mkernel precompile: 6 specializations of ops/collectives.cu, ops/internode.cu for sm_90a "
                        f"into {tmp_path}")
    progress = lines[1:-1]
    assert [ln.split("]")[0] for ln in progress] == [f"[{i}/6" for i in range(1, 7)]
    assert all(re.fullmatch(r"\[\d/6\] ops/(collectives|internode)\.cu dtype=\d: \d+\.\d s", ln) for ln in progress)
    assert lines[-1].startswith("mkernel precompile: done in ")
    assert len(list(tmp_path.glob("collectives-sm_90a-*.cubin"))) == 3
    assert len(list(tmp_path.glob("internode-sm_90a-*.cubin"))) == 3
    again = _mk("precompile", "--ops", "all_reduce", "--arch", "sm_90a", "--workers", "1", cache=tmp_path)
    assert again.returncode == 0, again.stderr
    assert [ln.rsplit(": ", 1)[1] for ln in again.stdout.splitlines()[1:-1]] == ["cached"] * 6


@pytest.mark.skipif(driver.driver_version() is not None, reason="this machine has an NVIDIA driver")
def test_precompile_without_gpu_or_arch_says_what_to_pass(tmp_path):
    r = _mk("precompile", "--ops", "collectives", cache=tmp_path)
    assert r.returncode == 2 and "no NVIDIA driver" in r.stderr and "pass --arch sm_90a" in r.stderr
    assert "Traceback" not in r.stderr


def test_precompile_refuses_what_cannot_be_built(tmp_path):
    r = _mk("precompile", "--ops", "gemm", "--arch", "sm_80", cache=tmp_path)
    assert r.returncode == 2 and "gemm/gemm.cu, gemm/gemv.cu run on Hopper only (sm_90a), not sm_80" in r.stderr
    r = _mk("precompile", "--ops", "gemm,fft", "--arch", "sm_90a", cache=tmp_path)
    assert r.returncode == 2 and "unknown op 'fft'" in r.stderr
    r = _mk("precompile", "--ops", "collectives", "--arch", "sm_70", cache=tmp_path)
    assert r.returncode == 1 and "NVRTC cannot compile for sm_70" in r.stderr
    assert not list(tmp_path.glob("*.cubin"))


def test_op_sources():
    assert sources_for(["gemm"]) == ["gemm/gemm.cu", "gemm/gemv.cu"]
    assert sources_for(["gemm_reduce_scatter"]) == ["ops/gemm_rs.cu", "gemm/gemm.cu", "gemm/gemv.cu",
                                                     "ops/collectives.cu", "ops/internode.cu"]
    assert sources_for(["all_gather", "reduce_scatter"]) == ["ops/collectives.cu", "ops/internode.cu"]
    with pytest.raises(ValueError, match="unknown op 'x'"):
        sources_for(["x"])


def test_every_kernel_source_belongs_to_an_op():
    """precompile's default (every op) covers every kernel source an op registers specializations of."""
    import mkernel  # noqa: F401 -- the ops register their specializations at import
    from mkernel.cli.precompile import OPS
    from mkernel.core.compiler import registered_specializations

    registered = {src for src, _ in registered_specializations()} - {"testing/proxy_test.cu"}
    assert registered <= set(sources_for(OPS)), registered - set(sources_for(OPS))
    assert sources_for(["moe_layer"])[:3] == ["ops/moe.cu", "ops/moe_gemm.cu", "ops/moe_internode.cu"]


def test_info_exits_0_and_reports_each_item(tmp_path):
    r = _mk("info", env={"MKERNEL_TIMEOUT": "7", "MKERNEL_LOG": "0"}, cache=tmp_path / "none")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("mkernel 0.1.0 (")
    if driver.driver_version() is None:
        assert "driver: no NVIDIA driver found (libcuda.so)" in out and "GPUs:" not in out
    assert re.search(r"^NVRTC 13\.\d+: sm_75 to sm_\d+$", out, re.M)
    assert f"kernel cache: {tmp_path / 'none'} (not created yet)" in out
    assert re.search(r"^MPI \(mpi4py [\d.]+\): ", out, re.M)
    assert "transports: tcp (always)" in out and "verbs: pyverbs " in out
    assert "  MKERNEL_TIMEOUT=7.0" in out and "  MKERNEL_LOG='0'" in out
    assert "Traceback" not in r.stderr


def test_info_counts_the_cache(tmp_path):
    (tmp_path / "a-sm_90a-0.cubin").write_bytes(b"\0" * (1 << 20))
    (tmp_path / "a-sm_90a-0.log").write_text("x")
    os.chmod(tmp_path, 0o700)
    r = _mk("info", cache=tmp_path)
    assert f"kernel cache: {tmp_path}: 1 cubins, 1.0 MiB" in r.stdout
