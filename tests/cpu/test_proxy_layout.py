"""The Python mirror of the command ring (mkernel/proxy.py) must match cuda_src/mk_proxy.cuh.

NVRTC compiles (no GPU needed) a translation unit of static_asserts generated from the Python
layout table, so any drift between the two fails to compile; the op codes and the NO_FLAG constant
are checked the same way.  proxy_test.cu is compiled for sm_90a too (no spills).
"""
from __future__ import annotations

import ctypes

import pytest

from mkernel import proxy

nvrtc = pytest.importorskip("cuda.bindings.nvrtc")

from _nvrtc import nvrtc_compile  # noqa: E402


def _compile(src: str, name: str = "layout_check.cu"):
    ok, log, _ = nvrtc_compile(src, name)
    return ok, log


def test_cmd_and_proxy_struct_layout_match_header():
    lines = ['#include "core/mk_proxy.cuh"', "#define OFF(T, f) __builtin_offsetof(T, f)"]
    lines.append(f"static_assert(sizeof(MkProxyCmd) == {proxy.CMD_DTYPE.itemsize}, \"cmd size\");")
    for name, (off, typ) in proxy.LAYOUT.items():
        lines.append(f"static_assert(OFF(MkProxyCmd, {name}) == {off}, \"{name}\");")
        lines.append(f"static_assert(sizeof(((MkProxyCmd*)0)->{name}) == {ctypes.sizeof(ctypes.c_uint8) * __import__('numpy').dtype(typ).itemsize}, \"{name} size\");")
    lines.append(f"static_assert(sizeof(MkProxy) == {ctypes.sizeof(proxy.MkProxyStruct)}, \"MkProxy size\");")
    for fname, _ in proxy.MkProxyStruct._fields_:
        off = getattr(proxy.MkProxyStruct, fname).offset
        lines.append(f"static_assert(OFF(MkProxy, {fname}) == {off}, \"MkProxy.{fname}\");")
    for op in ("NOP", "WRITE", "FLAG", "BARRIER"):
        lines.append(f"static_assert(MK_PROXY_OP_{op} == {getattr(proxy, 'OP_' + op)}, \"op {op}\");")
    lines.append(f"static_assert(MK_PROXY_NO_FLAG == {proxy.NO_FLAG}ull, \"NO_FLAG\");")
    ok, log = _compile("\n".join(lines) + "\n")
    assert ok, log


def test_proxy_test_kernel_compiles_without_spills():
    from mkernel.core.compiler import compile_module

    mod = compile_module("testing/proxy_test.cu", arch="sm_90a", use_disk_cache=False)
    usage = mod.resource_usage
    assert set(usage) >= {"mk_proxy_test_push", "mk_proxy_layout"}
    for k, u in usage.items():
        assert u.get("spill_stores", 0) == 0, (k, u)


_PTX_SIZES = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "b32": 4, "u32": 4, "s32": 4, "f32": 4,
              "b64": 8, "u64": 8, "s64": 8, "f64": 8}


def _ptx_param_sizes(ptx: str, kernel: str) -> list[int]:
    """Byte size of each parameter of ``.entry kernel(...)`` in PTX."""
    import re

    m = re.search(r"\.entry\s+" + kernel + r"\s*\((.*?)\)", ptx, re.S)
    assert m, f"no .entry {kernel} in the PTX"
    sizes = []
    for decl in m.group(1).split(","):
        d = re.search(r"\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)\s+\w+(?:\[(\d+)\])?", decl)
        assert d, decl
        sizes.append(_PTX_SIZES[d.group(1)] * int(d.group(2) or 1))
    return sizes


def test_gpu_scenario_launch_args_match_proxy_test_kernel():
    """tests/cpu/test_proxy_scenarios.py gpu_kernel_args (sc_gpu's launch) against mk_proxy_test_push's
    parameter list in the PTX: same count, same sizes (the GPU test once waited past its budget on a
    kernel/scenario disagreement: flags pushed to window 0, waited for in window 1)."""
    from mkernel.core.compiler import cuda_src_dir
    from mkernel.dist.signals import MkComm
    from test_proxy_scenarios import gpu_kernel_args

    src = (cuda_src_dir() / "testing" / "proxy_test.cu").read_text()
    ok, log, ptx = nvrtc_compile(src, "proxy_test.cu", "compute_90a")
    assert ok, log
    want = _ptx_param_sizes(ptx, "mk_proxy_test_push")
    got = [ctypes.sizeof(a) for a in gpu_kernel_args(MkComm(), proxy.MkProxyStruct(), 0)]
    assert got == want, f"launch argument sizes {got}, kernel parameters {want}"
