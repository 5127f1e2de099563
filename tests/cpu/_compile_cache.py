"""A disk cache of NVRTC compiles shared by one test module's compile tests, filled first by parallel
worker processes (``CP.precompile``: one NVRTC compile per core -- NVRTC is single-threaded per
program), so that each test then reads its cubin and ptxas log from the cache instead of compiling
serially.  A specialization that fails to compile in the workers is compiled, and reported, by its
own test."""
from __future__ import annotations

import pytest

from mkernel.core import compiler as CP
def selected(request, test_name: str) -> list:
    """The ``(source, defines)`` parameters of the collected (selected) items of ``test_name`` in the
    requesting test module (other modules' specializations carry other defines)."""
    return [(it.callspec.params["source"], it.callspec.params["defines"]) for it in request.session.items
            if getattr(it, "originalname", None) == test_name and hasattr(it, "callspec")
            and it.module is request.module]


def fill(tmp_path_factory, specs, arch: str):
    """A fresh cache directory holding every ``(source, defines)`` of ``specs`` compiled for ``arch``."""
    d = tmp_path_factory.mktemp("nvrtc-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MKERNEL_CACHE_DIR", str(d))  # (the spawned workers inherit it)
        try:
            CP.precompile(specs, arch=arch)
        except Exception:  # noqa: BLE001 -- the failing spec's own test compiles it and reports why
            pass
    return d


def assert_clean(mod, kernels, threads) -> None:
    """``mod`` (a compiled module) has every kernel of ``kernels`` in its ptxas report, none spills or uses a
    stack frame, each fits its block (``threads(name)`` threads) in the register file, and ptxas warned of
    nothing."""
    import re

    usage = mod.resource_usage
    for name in kernels:
        assert name in usage, f"{name} missing from the ptxas report:\n{mod.log}"
    for fn, u in usage.items():
        assert u.get("spill_stores", 0) == 0 and u.get("spill_loads", 0) == 0, f"{fn} spills: {u}"
        assert u.get("stack", 0) == 0, f"{fn} uses a stack frame: {u}"
        assert u["registers"] * threads(fn) <= 65536, f"{fn}: {u['registers']} registers"
    warnings = [ln for ln in mod.log.splitlines() if re.search(r"warning|C75\d\d", ln, re.I)]
    assert not warnings, "ptxas warnings:\n" + "\n".join(warnings)


def module_fixture(test_name: str, arch: str, expect=None):
    """A module-scoped ``compile_cache`` fixture: the module's selected ``test_name`` specializations
    (``expect(defines)`` adds the host's expectations) compiled in parallel into a fresh cache."""
    @pytest.fixture(scope="module")
    def compile_cache(request, tmp_path_factory):
        specs = selected(request, test_name)
        if expect is not None:
            specs = [(s, expect(d)) for s, d in specs]
        return fill(tmp_path_factory, specs, arch)
    return compile_cache


def assert_gemm_spec_clean(source: str, defines: dict, cache_dir, monkeypatch, kernel: str, arch: str) -> None:
    """One specialization of a kernel built on the GEMM component (``defines`` from
    ``mkernel.ops.gemm.defines``: its config's block size), read from ``cache_dir``: :func:`assert_clean`."""
    from mkernel.ops import gemm as G

    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(cache_dir))
    mod = CP.compile_module(source, defines, arch=arch)
    threads = G.CONFIGS[defines["MK_GEMM_CONFIG"]].threads
    assert_clean(mod, (kernel,), lambda fn: threads)


def struct_figures(*structs) -> str:
    """``{sizeof, alignment, offset of each field (declaration order)}`` of ctypes structs: the initializer a
    kernel's ``MK_EXPECT_*_STRUCTS`` define takes, compared with the device's layout by static_assert."""
    import ctypes

    v = []
    for S in structs:
        v += [ctypes.sizeof(S), ctypes.alignment(S)] + [getattr(S, f[0]).offset for f in S._fields_]
    return "{" + ",".join(map(str, v)) + "}"
