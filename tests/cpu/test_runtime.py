"""NVRTC runtime on the CPU: every registered kernel specialization compiles for sm_90a without
register spills; the disk cache; compile errors carry the NVRTC log."""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

import _compile_cache
import mkernel
from mkernel.core import compiler as CP
from mkernel.core import driver as DRV
from mkernel.core import streams as STR
from mkernel.ops import base as BASE
from mkernel.errors import CompileError

ARCH = "sm_90a"


def _import_all_ops():
    for m in pkgutil.walk_packages(mkernel.__path__, "mkernel."):
        if not m.name.rsplit(".", 1)[-1].startswith("_"):
            try:
                importlib.import_module(m.name)
            except ImportError as exc:  # optional deps (pyverbs) only
                if "pyverbs" not in str(exc):
                    raise


_import_all_ops()
SPECS = CP.registered_specializations()
# Sources whose op has a compile test of its own (stricter: no stack at all, no ptxas warnings) are compiled
# there, once: CI's time goes to compiling.
OWN_COMPILE_TESTS = {
    "gemm/gemm.cu": "test_gemm_compile.py", "gemm/gemv.cu": "test_gemm_compile.py",
    "ops/attention_fwd.cu": "test_attention_host.py", "ops/attention_bwd.cu": "test_attention_bwd_host.py",
    "ops/moe.cu": "test_moe_host.py", "ops/moe_gemm.cu": "test_moe_host.py", "gemm/gemm_swiglu.cu": "test_moe_swiglu.py",
    "ops/moe_internode.cu": "test_moe_internode.py", "ops/ring_attention.cu": "test_ring_attention_host.py",
    "ops/ring_attention_fused.cu": "test_ring_attention_fused.py",
}
COMPILE_SPECS = [(s, d) for s, d in SPECS if s not in OWN_COMPILE_TESTS]


def test_sources_left_to_their_own_compile_tests_are_compiled_there():
    here = Path(__file__).resolve().parent
    for source, module in OWN_COMPILE_TESTS.items():
        text = (here / module).read_text()
        assert "compile_module(" in text and "spill" in text, f"{module} does not compile-check {source}"


def test_every_kernel_source_is_registered():
    registered = {s for s, _ in SPECS}
    root = CP.cuda_src_dir()
    sources = {p.relative_to(root).as_posix() for p in root.rglob("*.cu") if p.parent.name != "testing"}
    missing = sources - registered
    assert not missing, f"kernel sources with no registered specialization: {missing}"


compile_cache = _compile_cache.module_fixture("test_compiles_without_spills", ARCH)


@pytest.mark.parametrize("source,defines", COMPILE_SPECS, ids=[f"{s}:{d}" for s, d in COMPILE_SPECS])
def test_compiles_without_spills(source, defines, compile_cache, monkeypatch):
    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(compile_cache))
    mod = CP.compile_module(source, defines, arch=ARCH)
    usage = mod.resource_usage
    assert usage, f"no ptxas report for {source} {defines}:\n{mod.log}"
    for fn, u in usage.items():
        assert u.get("spill_stores", 0) == 0 and u.get("spill_loads", 0) == 0, f"{fn} spills: {u}"
        assert u.get("stack", 0) == 0 or "printf" in mod.log, f"{fn} uses a stack frame: {u}"
    assert "C7508" not in mod.log, f"setmaxnreg ignored in {source}:\n{mod.log}"


def test_a_second_fresh_compile_still_reports_ptxas(tmp_path, monkeypatch):
    """NVRTC >= 12.9 caches compiles itself and a hit carries no ptxas report; mkernel turns that cache
    off (``--no-cache``), so a fresh compile of a module compiled before still reports registers and
    spills (the compile tests and bench/gemm.py's compile times rely on it)."""
    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(tmp_path))
    for _ in range(2):
        CP._module_cache.clear()
        m = CP.compile_module("ops/collectives.cu", {"MK_DTYPE": 2}, arch=ARCH, use_disk_cache=False)
        assert not m.cached and m.resource_usage, m.log


def test_disk_cache_hits_in_a_new_process(tmp_path, monkeypatch):
    import subprocess
    import sys

    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(tmp_path))
    code = ("import sys; from mkernel.core import compiler as CP; "
            "m = CP.compile_module('ops/collectives.cu', {'MK_DTYPE': 2}, arch='sm_90a'); "
            "print('cached' if m.cached else 'compiled')")
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert (first, second) == ("compiled", "cached")
    # a different define is a different cubin
    m = CP.compile_module("ops/collectives.cu", {"MK_DTYPE": 1}, arch=ARCH)
    assert not m.cached


_SPEC = ("ops/collectives.cu", {"MK_DTYPE": 2})


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty private cache directory, an empty in-process module cache, the warning re-armed."""
    d = tmp_path / "cache"
    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(d))
    monkeypatch.setattr(CP, "_module_cache", {})
    monkeypatch.setattr(CP, "_cache_warned", False)
    return d


def test_cache_dir_is_created_private_and_never_loosened(fresh_cache, tmp_path, monkeypatch):
    import os
    import stat

    assert CP.cache_dir() == fresh_cache
    assert stat.S_IMODE(fresh_cache.stat().st_mode) == 0o700
    m = CP.compile_module(*_SPEC, arch=ARCH)
    for f in fresh_cache.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    # an existing directory keeps its mode (0755: not writable by others, so it is used)
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o755)
    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(d))
    assert CP.cache_dir() == d and stat.S_IMODE(d.stat().st_mode) == 0o755
    # one that others can write is not used: compiles in memory, one warning
    os.chmod(d, 0o777)
    CP._module_cache.clear()
    with pytest.warns(RuntimeWarning, match="writable by group or others"):
        m2 = CP.compile_module(*_SPEC, arch=ARCH)
    assert not m2.cached and m2.cubin and not list(d.iterdir())
    assert m.cubin


@pytest.mark.parametrize("damage", ["flip", "truncate", "no digest"])
def test_tampered_cubin_is_recompiled_not_loaded(fresh_cache, damage):
    import hashlib

    first = CP.compile_module(*_SPEC, arch=ARCH)
    (cubin_path,) = fresh_cache.glob("*.cubin")
    (log_path,) = fresh_cache.glob("*.log")
    good = cubin_path.read_bytes()
    assert log_path.read_text().splitlines()[0] == "mkernel-cubin-sha256 " + hashlib.sha256(good).hexdigest()
    CP._module_cache.clear()
    assert CP.compile_module(*_SPEC, arch=ARCH).cached  # intact: loaded
    if damage == "flip":
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0xFF
        cubin_path.write_bytes(bytes(bad))
    elif damage == "truncate":
        cubin_path.write_bytes(good[:len(good) // 3])
    else:  # a log without the digest line (as an older mkernel wrote it)
        log_path.write_text(first.log)
    CP._module_cache.clear()
    m = CP.compile_module(*_SPEC, arch=ARCH)
    assert not m.cached
    assert cubin_path.read_bytes() == m.cubin  # rewritten
    assert log_path.read_text().splitlines()[0] == "mkernel-cubin-sha256 " + hashlib.sha256(m.cubin).hexdigest()
    CP._module_cache.clear()
    assert CP.compile_module(*_SPEC, arch=ARCH).cached


def test_uncreatable_cache_dir_compiles_in_memory_and_warns_once(tmp_path, monkeypatch):
    import warnings

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(CP, "_module_cache", {})
    monkeypatch.setattr(CP, "_cache_warned", False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a = CP.compile_module(*_SPEC, arch=ARCH)
        b = CP.compile_module("ops/collectives.cu", {"MK_DTYPE": 1}, arch=ARCH)
    assert not a.cached and not b.cached and a.cubin and b.cubin
    msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning) and "mkernel" in str(x.message)]
    assert len(msgs) == 1 and "cannot create the kernel cache directory" in msgs[0], msgs


def test_read_only_cache_dir_compiles_and_warns(fresh_cache, monkeypatch):
    import os

    fresh_cache.mkdir(mode=0o700)
    os.chmod(fresh_cache, 0o500)
    try:
        if os.geteuid() == 0:  # root writes through file modes: make the writes fail as they would
            def denied(path, data):
                raise PermissionError(13, "Permission denied", str(path))

            monkeypatch.setattr(CP, "_write_atomic", denied)
        with pytest.warns(RuntimeWarning, match="cannot write to the kernel cache directory"):
            m = CP.compile_module(*_SPEC, arch=ARCH)
        assert not m.cached and m.cubin and not list(fresh_cache.iterdir())
    finally:
        os.chmod(fresh_cache, 0o700)


def test_cache_key_covers_the_cuda_headers(tmp_path, monkeypatch):
    """The key hashes the CUDA headers a compile reads, transitively: a change in any of them is a
    new key (a headers upgrade never loads cubins built against the old ones)."""
    inc = tmp_path / "inc"
    (inc / "sub").mkdir(parents=True)
    (inc / "top.h").write_text('#pragma once\n#include "sub/mid.h"\n#include <cstring>\n')
    (inc / "sub" / "mid.h").write_text('#include "leaf.hpp"\n')  # relative to sub/
    (inc / "sub" / "leaf.hpp").write_text("int leaf;\n")
    monkeypatch.setattr(CP, "include_dirs", lambda: [str(inc)])
    monkeypatch.setattr(CP, "_header_digests", {})
    d0 = CP._cuda_headers_digest({"top.h"})
    assert CP._cuda_headers_digest({"top.h"}) == d0
    (inc / "sub" / "leaf.hpp").write_text("int leaf2;\n")
    CP._header_digests.clear()
    assert CP._cuda_headers_digest({"top.h"}) != d0
    # and the digest is part of compile_module's key
    monkeypatch.undo()
    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(CP, "_module_cache", {})
    assert not CP.compile_module(*_SPEC, arch=ARCH).cached
    CP._module_cache.clear()
    assert CP.compile_module(*_SPEC, arch=ARCH).cached
    CP._module_cache.clear()
    real = CP._cuda_headers_digest
    monkeypatch.setattr(CP, "_cuda_headers_digest", lambda roots: "upgraded" + real(roots))
    assert not CP.compile_module(*_SPEC, arch=ARCH).cached
    assert len(list((tmp_path / "cache").glob("*.cubin"))) == 2


def test_compile_error_has_log(tmp_path, monkeypatch):
    src = CP.cuda_src_dir()
    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(tmp_path))
    with pytest.raises(CompileError) as ei:
        CP.compile_module("ops/collectives.cu", {"MK_DTYPE": "this_is_not_a_type"}, arch=ARCH)
    assert "error" in ei.value.log.lower()
    assert src.is_dir()


def test_stream_handle_forms():
    class S:
        def __cuda_stream__(self):
            return (0, 1234)

    class T:
        cuda_stream = 99

    assert STR.stream_handle(None) == 0
    assert STR.stream_handle(7) == 7
    assert STR.stream_handle(S()) == 1234
    assert STR.stream_handle(T()) == 99
    with pytest.raises(TypeError):
        STR.stream_handle(object())


def test_ptxas_log_parse():
    log = """ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
ptxas         .     0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 232 registers, used 1 barriers"""
    assert CP.parse_ptxas_log(log) == {"k": {"stack": 0, "spill_stores": 8, "spill_loads": 4, "registers": 232}}


def test_kernel_lookup_is_memoized(monkeypatch):
    """Ops look their kernel up on every launch: only the first lookup compiles (or loads) the module."""
    monkeypatch.setattr(CP, "_kernels", {})
    calls = []
    real = CP.compile_module
    monkeypatch.setattr(CP, "compile_module", lambda *a, **k: calls.append(a) or real(*a, arch="sm_90a", **k))
    k1 = CP.kernel("ops/collectives.cu", {"MK_DTYPE": 0}, "mk_all_gather")
    k2 = CP.kernel("ops/collectives.cu", {"MK_DTYPE": 0}, "mk_all_gather")
    k3 = CP.kernel("ops/collectives.cu", {"MK_DTYPE": 2}, "mk_all_gather")
    assert k1 is k2 and k3 is not k1 and k1.name == "mk_all_gather" and len(calls) == 2


def test_capture_relaxed_restores_and_tolerates_no_driver():
    """capture_relaxed swaps the thread's capture mode to relaxed and back; without a usable driver
    (CI) the swap fails quietly and the body still runs."""
    ran = []
    with DRV.capture_relaxed():
        ran.append(1)
    assert ran == [1]
    with pytest.raises(KeyError):
        with DRV.capture_relaxed():
            raise KeyError("the body's error propagates")


def test_precompile_falls_back_when_the_workers_die(monkeypatch):
    """A script that calls precompile at import time kills its spawned workers (they import the main
    module again): precompile warns and compiles in the calling process instead of raising."""
    import concurrent.futures as cf

    class DyingPool:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def map(self, fn, items):
            raise cf.process.BrokenProcessPool("a worker died")

    done = []
    monkeypatch.setattr(cf, "ProcessPoolExecutor", DyingPool)
    monkeypatch.setattr(CP, "_compile_one", lambda item: done.append(item[1]["X"]) or 1.5)
    with pytest.warns(RuntimeWarning, match="__main__"):
        total = CP.precompile([("a.cu", {"X": 1}), ("b.cu", {"X": 2})], arch="sm_90a", workers=2)
    assert total == 3.0 and done == [1, 2]
