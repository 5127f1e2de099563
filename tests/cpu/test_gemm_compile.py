"""GEMM on the CPU: every registered gemm.cu specialization compiles for sm_90a with no spills and
no ptxas warnings (setmaxnreg C7508, wgmma serialization); and the host-side planning of
mkernel.gemm / grouped_gemm (tile config, staging decisions, tensor-map geometry, kernel arguments,
grid) checked against fakes of the driver-facing pieces."""
from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import _compile_cache
from mkernel.core import compiler as CP
from mkernel.core import launch as LCH
from mkernel.core import tensormap as TM
from mkernel.ops import base as BASE
from mkernel.ops import gemm as G
from mkernel.ops.gemm import api as GA, configs as GC, heuristic as GH, kernels as GK, operands as GO, plan as GP
from mkernel.core.arrays import DeviceArray

ARCH = "sm_90a"
SPECS = [(s, d) for s, d in CP.registered_specializations() if s == GC.SOURCE]
GEMM_KERNELS = ("mk_gemm_kn", "mk_gemm_nk", "mk_grouped_gemm_kn", "mk_grouped_gemm_nk")


def test_all_combinations_registered():
    got = {(d["MK_GEMM_IN"], d["MK_GEMM_OUT"], d["MK_GEMM_CONFIG"]) for _, d in SPECS}
    want = {(G.DTYPE_CODES[i], G.DTYPE_CODES[o], c) for i in G.IN_DTYPES for o in G.OUT_DTYPES for c in G.CONFIGS}
    assert got == want


def _with_expectations(defines: dict) -> dict:
    """The specialization's defines plus the host's launch geometry and tile, which static_asserts in
    mk_gemm_configs.cuh check against the kernel's."""
    cfg = G.CONFIGS[defines["MK_GEMM_CONFIG"]]
    return {**defines, "MK_EXPECT_SMEM": cfg.smem, "MK_EXPECT_THREADS": cfg.threads, "MK_EXPECT_BM": cfg.bm,
            "MK_EXPECT_BN_NK": cfg.tile_n("nk"), "MK_EXPECT_BN_KN": cfg.tile_n("kn")}


@pytest.fixture(scope="module")
def compile_cache(request, tmp_path_factory):
    """The selected gemm.cu (with the host's expectations) and gemv.cu specializations, compiled in parallel."""
    specs = [(s, _with_expectations(d)) for s, d in _compile_cache.selected(request, "test_compiles_clean")]
    specs += _compile_cache.selected(request, "test_gemv_compiles_clean")
    return _compile_cache.fill(tmp_path_factory, specs, ARCH)


@pytest.mark.parametrize("source,defines", SPECS, ids=[
    f"in{d['MK_GEMM_IN']}-out{d['MK_GEMM_OUT']}-cfg{d['MK_GEMM_CONFIG']}{'-swap' if d.get('MK_GEMM_SWAP') else ''}"
    for _, d in SPECS])
def test_compiles_clean(source, defines, compile_cache, monkeypatch):
    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(compile_cache))
    cfg = G.CONFIGS[defines["MK_GEMM_CONFIG"]]
    mod = CP.compile_module(source, _with_expectations(defines), arch=ARCH)
    usage = mod.resource_usage
    for name in GEMM_KERNELS + ("mk_pad_copy_u16", "mk_pad_copy_u32"):
        assert name in usage, f"{name} missing from the ptxas report:\n{mod.log}"
    for fn, u in usage.items():
        assert u.get("spill_stores", 0) == 0 and u.get("spill_loads", 0) == 0, f"{fn} spills: {u}"
        assert u.get("stack", 0) == 0, f"{fn} uses a stack frame: {u}"
    for name in GEMM_KERNELS:
        regs = usage[name]["registers"]
        assert regs * cfg.threads <= 65536, f"{name}: {regs} registers x {cfg.threads} threads"
    warnings = [ln for ln in mod.log.splitlines() if re.search(r"warning|C75\d\d", ln, re.I)]
    assert not warnings, "ptxas warnings:\n" + "\n".join(warnings)


def test_smem_budget():
    for cfg in G.CONFIGS.values():
        assert cfg.smem <= 227 * 1024, cfg
        assert cfg.threads in (256, 384, 512)


# ---------------------------------------------------------------------------------------------
# planning, against fakes
# ---------------------------------------------------------------------------------------------
class FakeLaunch:
    """A prepared launch: each submission is logged with its arguments' values at that moment (the bound
    call re-points the same argument objects call after call, as the driver copies them at launch)."""

    def __init__(self, log, key, grid, block, args, smem, cluster, dependent):
        self.log, self.key, self.grid, self.block, self.args = log, key, grid, block, args
        self.smem, self.cluster, self.dependent = smem, cluster, dependent

    def submit(self):
        args = [a.raw if hasattr(a, "raw") else type(a).from_buffer_copy(a)
                if isinstance(a, (ctypes.Structure, ctypes._SimpleCData)) else a for a in self.args]
        self.log.append(dict(kernel=self.key[3], config=self.key[2], grid=self.grid, block=self.block, args=args,
                             smem=self.smem, cluster=self.cluster, dependent=self.dependent,
                             swap="swap" in self.key[4:]))


class FakeKernel:
    def __init__(self, log, key):
        self.log, self.key = log, key

    def prepare(self, grid, block, args, *, stream=None, smem=0, cluster=None, dependent=False, **kw):
        return FakeLaunch(self.log, self.key, grid, block, list(args), smem, cluster, dependent)

    def launch(self, grid, block, args, **kw):
        self.prepare(grid, block, args, **kw).submit()

    def max_active_clusters(self, grid, block, smem, cluster):
        return 60  # (a GPU on which not every SM pairs up)


CLEARS: list = []  # (ptr, count) of every split-K counter clear the fake plans ran


@pytest.fixture
def fake(monkeypatch, mkenv):
    launches, maps = [], []
    ptrs = iter(range(1 << 40, 1 << 41, 1 << 28))

    def empty(shape, dtype, device=None):
        return DeviceArray(next(ptrs), shape, dtype, None, 0)

    def from_numpy(x, dtype=None, device=None, stream=None):
        return DeviceArray(next(ptrs), np.shape(x), dtype or np.asarray(x).dtype, None, 0)

    def encode(ptr, dtype, dims, strides, box, **kw):
        maps.append(dict(ptr=ptr, dtype=dtype, dims=tuple(dims), strides=tuple(strides), box=tuple(box)))
        return int(ptr).to_bytes(8, "little") + bytes(120)  # (a launch's map names its address: map_ptr)

    monkeypatch.setattr(GK, "get", lambda i, o, c, name, swap=False: FakeKernel(
        launches, (i, o, c, name) + (("swap",) if swap else ())))
    monkeypatch.setattr(GK, "num_sms", lambda dev: 132)
    monkeypatch.setattr(GK, "context", lambda: (1, 0))
    monkeypatch.setattr(GK, "context_handle", lambda: 1)
    monkeypatch.setattr(GO, "encode_tiled", encode)
    monkeypatch.setattr(TM, "encode_tiled", encode)
    monkeypatch.setattr(TM, "_codec", False)  # (no driver: re-pointed maps are encoded again)
    _no_device(monkeypatch)
    monkeypatch.setattr(DeviceArray, "empty", staticmethod(empty))
    monkeypatch.setattr(DeviceArray, "from_numpy", staticmethod(from_numpy))
    mkenv("MKERNEL_GEMM_CONFIG", None)
    _capturing(monkeypatch, False)
    CLEARS.clear()
    monkeypatch.setattr(GO, "_clear_i32", lambda ptr, n, stream: CLEARS.append((ptr, n)))
    BASE._device_states.clear()
    return launches, maps, empty


def _no_device(monkeypatch):
    """The ops' device scopes (gemm / grouped_gemm, describe) as no-ops on device 0, a Hopper."""
    monkeypatch.setattr(GA, "on_device", lambda dev=None: contextlib.nullcontext((None, 0)))
    monkeypatch.setattr(GA, "require_gemm_device", lambda what, device: None)
    monkeypatch.setattr(GP, "_on_device", lambda dev=None: contextlib.nullcontext((None, 0)))


def _capturing(monkeypatch, value: bool):
    """Whether the fake stream is being captured into a CUDA graph (bound calls, split-K clears)."""
    for mod in (BASE, GO):
        monkeypatch.setattr(mod, "is_capturing", lambda stream: value)


def last_bound():
    """The most recently used bound GEMM call (its .plan: GemmPlan; .buffers, .clears, .pinned)."""
    return next(reversed(BASE.device_state("gemm", 0).calls.values()))


def nplans() -> int:
    """Bound GEMM calls held by every device state (one per key)."""
    return sum(len(s.calls) for s in BASE._device_states.values())


def map_ptr(raw: bytes) -> int:
    """The address a (fake-encoded) tensor map of a launch's arguments points at."""
    return int.from_bytes(raw[:8], "little")


def _args(launch) -> GP.GemmArgs:
    a = launch["args"][3]
    assert isinstance(a, GP.GemmArgs) and all(len(m) == 128 for m in launch["args"][:3])
    return a


def test_big_square_kn(fake):
    launches, maps, empty = fake
    a, b = empty((4096, 4096), "bfloat16"), empty((4096, 4096), "bfloat16")
    out = G.gemm(a, b)
    assert out.shape == (4096, 4096) and out.dtype.name == "bfloat16"
    (l,) = launches
    assert l["kernel"] == "mk_gemm_kn" and l["config"] == 3 and l["grid"] == 132 and l["block"] == 384
    assert l["smem"] == G.CONFIGS[3].smem
    ma, mb, mc = maps
    assert ma == dict(ptr=a.ptr, dtype="bfloat16", dims=(4096, 4096), strides=(8192,), box=(64, 128))
    assert mb == dict(ptr=b.ptr, dtype="bfloat16", dims=(4096, 4096, 1), strides=(8192, 8192 * 4096), box=(64, 64, 1))
    assert mc == dict(ptr=out.ptr, dtype="bfloat16", dims=(4096, 4096), strides=(8192,), box=(64, 64))
    x = _args(l)
    assert (x.M, x.N, x.K, x.ldc, x.num_groups, x.c_vec_ok, x.c, x.c_tma) == (4096, 4096, 4096, 4096, 1, 1, out.ptr, 1)
    # the same call again (a fresh output): the bound call is reused, C's map re-pointed
    out2 = G.gemm(a, b)
    assert len(launches) == 2 and map_ptr(launches[-1]["args"][2]) == out2.ptr and _args(launches[-1]).c == out2.ptr
    # the first output again, and new operands of the same layout: re-pointed, not planned again
    a2 = empty((4096, 4096), "bfloat16")
    G.gemm(a2, b, out)
    l3 = launches[-1]
    assert len(launches) == 3 and _args(l3).c == out.ptr and map_ptr(l3["args"][2]) == out.ptr
    assert map_ptr(l3["args"][0]) == a2.ptr and map_ptr(l3["args"][1]) == b.ptr
    assert len(BASE.device_state("gemm", 0).calls) == 1


def test_nk_small_m_picks_small_tiles(fake):
    """M = 128: 64 x 128 tiles in clusters of 2 along M, each block loading half of B, two consumer
    warpgroups side by side along N (config 30: 384 threads)."""
    launches, maps, empty = fake
    a, b = empty((128, 8192), "float16"), empty((1024, 8192), "float16")
    G.gemm(a, b, b_layout="nk", out_dtype="float32")
    (l,) = launches
    assert l["kernel"] == "mk_gemm_nk" and l["config"] == 30 and l["block"] == 384 and l["cluster"] == (2, 1, 1)
    assert l["grid"] % 2 == 0 and l["grid"] <= 120  # whole pairs, at most the clusters that fit (60 here)
    assert maps[1]["dims"] == (8192, 1024, 1) and maps[1]["box"] == (64, 64, 1)
    # M = 64: one row of tiles, no pair to share B with -- config 1, the whole B tile per block
    G.gemm(empty((64, 8192), "float16"), b, b_layout="nk", out_dtype="float32")
    assert launches[-1]["config"] == 1 and launches[-1]["cluster"] is None and maps[-2]["box"] == (64, 128, 1)


def test_unaligned_k_is_staged(fake):
    launches, maps, empty = fake
    a, b = empty((100, 7), "bfloat16"), empty((33, 7), "bfloat16")
    G.gemm(a, b, b_layout="nk")
    pads = [l for l in launches if l["kernel"] == "mk_pad_copy_u16"]
    assert len(pads) == 2 and launches[-1]["kernel"] == "mk_gemm_nk"
    # pad copy args: dst, src, batch, rows, cols, cols_p, dst_ld, sb, sr, sc
    vals = [v.value for v in pads[0]["args"]]
    assert vals[1] == a.ptr and vals[2:] == [1, 100, 7, 16, 16, 0, 7, 1]  # rows padded to 32 bytes
    assert maps[0]["dims"] == (7, 100) and maps[0]["strides"] == (32,) and maps[0]["ptr"] == vals[0]
    assert maps[1]["dims"] == (7, 33, 1) and maps[1]["strides"] == (32, 32 * 33)


def test_kn_odd_n_stages_b_only(fake):
    launches, maps, empty = fake
    a, b = empty((64, 64), "bfloat16"), empty((64, 129), "bfloat16")
    G.gemm(a, b)
    assert [l["kernel"] for l in launches] == ["mk_pad_copy_u16", "mk_gemm_kn"]
    assert maps[0]["ptr"] == a.ptr and maps[1]["dims"] == (129, 64, 1) and maps[1]["strides"] == (288, 288 * 64)
    x = _args(launches[-1])
    assert x.N == 129 and x.ldc == 129 and x.c_vec_ok == 0


def test_m1_any_row_stride(fake):
    launches, maps, empty = fake
    a, b = empty((1, 64), "bfloat16"), empty((64, 8), "bfloat16")
    G.gemm(a, b)
    assert [l["kernel"] for l in launches] == ["mk_gemm_kn"]


def test_k0_zero_fills(fake):
    launches, maps, empty = fake
    a, b = empty((5, 0), "bfloat16"), empty((0, 3), "bfloat16")
    G.gemm(a, b, out_dtype="float32")
    (l,) = launches
    assert l["kernel"] == "mk_pad_copy_u32" and [v.value for v in l["args"]][1:] == [None, 1, 5, 3, 3, 3, 0, 0, 0]


def test_grouped_host_offsets(fake):
    launches, maps, empty = fake
    offs = [0, 0, 300, 301, 301, 1000]
    a, b = empty((1000, 256), "bfloat16"), empty((5, 256, 512), "bfloat16")
    G.grouped_gemm(a, b, offs, config=2)
    (l,) = launches
    assert l["kernel"] == "mk_grouped_gemm_kn" and l["config"] == 2
    tiles = sum((m + 127) // 128 for m in np.diff(offs)) * 4
    assert l["grid"] == min(tiles, 132)
    x = _args(l)
    assert (x.M, x.N, x.K, x.num_groups, x.offsets_i32) == (1000, 512, 256, 5, 0) and x.group_offsets
    assert maps[1]["dims"] == (512, 256, 5) and maps[1]["strides"] == (1024, 1024 * 256)


def test_grouped_device_offsets_nk(fake):
    launches, maps, empty = fake
    a, b = empty((70, 64), "float16"), empty((3, 100, 64), "float16")
    offs = empty((4,), "int32")
    G.grouped_gemm(a, b, offs, b_layout="nk")
    x = _args(launches[-1])
    assert x.offsets_i32 == 1 and x.group_offsets == offs.ptr and x.num_groups == 3


@pytest.mark.parametrize("bad", [
    lambda e: G.gemm(e((4, 8), "bfloat16"), e((8, 4), "float16")),
    lambda e: G.gemm(e((4, 8), "float32"), e((8, 4), "float32")),
    lambda e: G.gemm(e((4, 8), "bfloat16"), e((9, 4), "bfloat16")),
    lambda e: G.gemm(e((4, 8), "bfloat16"), e((8, 4), "bfloat16"), b_layout="kk"),
    lambda e: G.gemm(e((4, 8), "bfloat16"), e((8, 4), "bfloat16"), e((4, 5), "bfloat16")),
    lambda e: G.gemm(e((4, 8), "bfloat16"), e((8, 4), "bfloat16"), e((4, 4), "int32")),
    lambda e: G.grouped_gemm(e((4, 8), "bfloat16"), e((2, 8, 4), "bfloat16"), [0, 5, 4]),
    lambda e: G.grouped_gemm(e((4, 8), "bfloat16"), e((2, 8, 4), "bfloat16"), [0, 4]),
])
def test_bad_input_raises_before_launch(fake, bad):
    launches, maps, empty = fake
    with pytest.raises((TypeError, ValueError)):
        bad(empty)
    assert launches == []


def test_args_struct_layout():
    offs = {f[0]: getattr(GP.GemmArgs, f[0]).offset for f in GP.GemmArgs._fields_}
    assert offs == dict(c=0, group_offsets=8, ldc=16, M=24, N=28, K=32, num_groups=36, group_m=40, c_vec_ok=44,
                        offsets_i32=48, c_tma=52, partials=56, counters=64, splits=72, split_from=76)
    assert ctypes.sizeof(GP.GemmArgs) == 80


def test_fresh_outputs_reuse_one_plan(fake):
    """out=None: every call returns a new array, but the plan (tensor maps, split-K workspace) is built
    once per stream and each launch is pointed at that call's output."""
    launches, maps, empty = fake
    a, b = empty((128, 7168), "bfloat16"), empty((1536, 7168), "bfloat16")
    outs = [G.gemm(a, b, b_layout="nk") for _ in range(3)]
    assert len({o.ptr for o in outs}) == 3 and nplans() == 1
    args = [_args(launch) for launch in launches]
    assert [x.c for x in args] == [o.ptr for o in outs]
    assert args[0].splits > 1 and len({x.partials for x in args}) == 1  # one split-K workspace
    c_maps = [m for m in maps if m["dims"] == (1536, 128)]
    assert [m["ptr"] for m in c_maps] == [o.ptr for o in outs]  # the plan's own, then one per new output
    G.gemm(a, b, b_layout="nk", stream=7)  # another stream: its own plan
    assert nplans() == 2
    o = empty((128, 1536), "bfloat16")
    G.gemm(a, b, o, b_layout="nk")  # a given output of the same layout: the same plan, re-pointed
    assert nplans() == 2 and _args(launches[-1]).c == o.ptr
    o32 = empty((128, 1536), "float32")
    G.gemm(a, b, o32, b_layout="nk")  # another output dtype: another plan
    assert nplans() == 3 and _args(launches[-1]).c == o32.ptr


def test_k0_fills_each_output(fake):
    """K = 0: out = 0, and the fill's plan is per output (it is a fill of that very buffer)."""
    launches, maps, empty = fake
    a, b = empty((64, 0), "bfloat16"), empty((0, 96), "bfloat16")
    o1, o2 = empty((64, 96), "bfloat16"), empty((64, 96), "bfloat16")
    G.gemm(a, b, o1)
    G.gemm(a, b, o2)
    fills = [launch["args"][0].value for launch in launches if launch["kernel"].startswith("mk_pad_copy")]
    assert fills == [o1.ptr, o2.ptr]


def test_cluster_config_launch(fake):
    """Config 8 (clusters of 2 along N sharing A): launched with cluster dims (2, 1, 1) on an even
    grid, A's map boxes one 64-row slab, N's tiles rounded up to whole clusters; grouped GEMMs refuse it."""
    launches, maps, empty = fake
    a, b = empty((512, 7168), "bfloat16"), empty((1000, 7168), "bfloat16")  # 8 tiles of 128 along N
    G.gemm(a, b, b_layout="nk", config=8, splits=1)
    l = launches[-1]
    assert l["cluster"] == (2, 1, 1) and l["grid"] % 2 == 0 and l["grid"] == 32  # 4 x 8 tiles
    assert maps[0]["box"] == (64, 64)
    G.gemm(a, empty((800, 7168), "bfloat16"), b_layout="nk", config=8, splits=1)  # 7 tiles -> 4 pairs (a phantom)
    assert launches[-1]["grid"] == 32
    G.gemm(empty((4096, 7168), "bfloat16"), b, b_layout="nk", config=8, splits=1)
    assert launches[-1]["grid"] == 120  # 32 x 8 tiles, but only 60 clusters fit at once
    G.gemm(a, b, b_layout="nk", config=3)
    assert launches[-1]["cluster"] is None
    with pytest.raises(ValueError, match="clusters"):
        G.grouped_gemm(a, empty((2, 1000, 7168), "bfloat16"), [0, 256, 512], b_layout="nk", config=8)


def test_cluster_k_config_launch(fake):
    """Configs 9 / 10 (split-K inside clusters of 2 / 4): launched with cluster dims (CK, 1, 1) on a grid
    of whole clusters (CK blocks per tile, capped by the SMs and the clusters that fit), no running-sum
    split-K workspace, the A box a whole 128-row tile; the smem mirror counts the receive buffers."""
    launches, maps, empty = fake
    a, b = empty((512, 7168), "bfloat16"), empty((1536, 7168), "bfloat16")  # 4 x 8 tiles of 128x192
    for cid, ck in ((9, 2), (10, 4)):
        G.gemm(a, b, b_layout="nk", config=cid)
        l = launches[-1]
        assert l["cluster"] == (ck, 1, 1) and l["grid"] == min(32 * ck, 132 // ck * ck, 60 * ck), l["grid"]
        assert l["args"][3].splits == 1 and l["args"][3].partials is None
        assert maps[-2]["box"] == (64, 128)  # (A, B; C stores from registers: no map)
        cfg = G.CONFIGS[cid]
        ring = cfg.stages * (128 * 64 * 2 + 3 * 8192)
        assert cfg.smem == -(-(ring + 256) // 1024) * 1024 + (ck - 1) * (8 // ck) * 32 * 96 * 4 + 1024
    G.gemm(empty((128, 256), "bfloat16"), empty((192, 256), "bfloat16"), b_layout="nk", config=10)
    assert launches[-1]["grid"] == 4  # one tile: one cluster
    with pytest.raises(ValueError, match="clusters"):
        G.grouped_gemm(a, empty((2, 1536, 7168), "bfloat16"), [0, 256, 512], b_layout="nk", config=9)


def test_programmatic_dependent_launch(fake, monkeypatch, mkenv):
    """Plain GEMM kernels are programmatic dependent launches -- cluster split-K plans (and grouped
    GEMMs) only where the plan's arithmetic intensity reaches PDL_MIN_INTENSITY and, for the former,
    their blocks fill the SMs or their K ranges are short -- (MKERNEL_GEMM_PDL=1 / 0: always /
    never); the launch configuration, with the
    attribute, is built by LCH._launch_config."""
    launches, maps, empty = fake
    mkenv("MKERNEL_GEMM_PDL", None)
    mkenv("MKERNEL_GEMM_GEMV", "0")  # (the M = 1 calls below: the GEMM tiles, not mkernel/gemv.py)
    a, b = empty((512, 1024), "bfloat16"), empty((1024, 768), "bfloat16")
    G.gemm(a, b)  # intensity 2*512*1024*768 / (2*(512*1024 + 1024*768 + 512*768)) = 237
    assert launches[-1]["dependent"] is True
    a128, w = empty((128, 8192), "bfloat16"), empty((8192, 8192), "bfloat16")
    G.gemm(a128, w, b_layout="nk")  # ~124: an HBM-bound B stream (on since docs/journal/gemm.md entry 35)
    assert launches[-1]["dependent"] is True
    G.gemm(a128, empty((10240, 8192), "bfloat16"), b_layout="nk")  # llama qkv M=128: cluster split-K (config 9),
    assert launches[-1]["config"] == 9 and launches[-1]["dependent"] is False  # 108 blocks, K ranges of 4096
    # cluster split-K: on where the blocks fill the SMs or K ranges are short (docs/journal/gemm.md entry 45)
    G.gemm(empty((512, 7168), "bfloat16"), empty((1536, 7168), "bfloat16"), b_layout="nk")  # dsv3.q_a M=512
    # (the fake GPU fits 60 clusters: 120 blocks, still 0.9 of its 132 SMs; an H200 fits all 64)
    assert launches[-1]["config"] == 36 and launches[-1]["grid"] == 120 and launches[-1]["dependent"] is True
    G.gemm(empty((640, 4096), "bfloat16"), empty((1024, 4096), "bfloat16"), b_layout="nk", config=36)
    assert launches[-1]["grid"] == 110 and launches[-1]["dependent"] is True  # K ranges of 2048
    G.gemm(empty((512, 8192), "bfloat16"), empty((1024, 8192), "bfloat16"), b_layout="nk", config=36)
    assert launches[-1]["grid"] == 88 and launches[-1]["dependent"] is False  # 88 blocks, K ranges of 4096
    a1 = empty((1, 8192), "bfloat16")
    G.gemm(a1, w, b_layout="nk")  # ~1: a GEMV on the tiles, still a plain GEMM (entry 62)
    assert launches[-1]["dependent"] is True
    mkenv("MKERNEL_GEMM_PDL", "0")
    G.gemm(a1, w, b_layout="nk")
    assert launches[-1]["dependent"] is False
    G.gemm(a, b)
    assert launches[-1]["dependent"] is False
    mkenv("MKERNEL_GEMM_PDL", "1")
    G.gemm(empty((512, 8192), "bfloat16"), empty((1024, 8192), "bfloat16"), b_layout="nk", config=36)
    assert launches[-1]["dependent"] is True  # (off automatically: above)
    assert GH.pdl_auto(1024, 1024, 1024) and GH.pdl_auto(128, 4096, 7168) and GH.pdl_auto(64, 4096, 7168)
    assert GH.pdl_auto(16, 16, 16) and not GH.pdl_auto(16, 16, 16, groups=2)
    assert GH.pdl_auto(4096, 1024, 1024, groups=1) and not GH.pdl_auto(4096, 1024, 1024, groups=64)
    assert GH.pdl_auto(128, 10240, 8192, cfg=G.CONFIGS[3]) and not GH.pdl_auto(128, 10240, 8192, cfg=G.CONFIGS[9])
    c36 = G.CONFIGS[36]
    assert GH.pdl_auto(512, 1536, 7168, cfg=c36, blocks=119, sms=132)  # 0.9 of the SMs
    assert not GH.pdl_auto(512, 1536, 7168, cfg=c36, blocks=118, sms=132)
    assert GH.pdl_auto(512, 1024, 4096, cfg=c36, blocks=88, sms=132)  # K ranges of 2048
    assert not GH.pdl_auto(512, 1024, 4097, cfg=c36, blocks=88, sms=132)  # of 2112
    assert not GH.pdl_auto(64, 64, 64, cfg=c36, blocks=132, sms=132)  # intensity first
    from cuda.bindings import driver as cu

    cfg = LCH._launch_config(132, 384, 1024, 0, False, None, True)
    assert cfg.numAttrs == 1 and cfg.attrs[0].id == cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert LCH._launch_config(132, 384, 1024, 0, False, None).numAttrs == 0


def test_split_k_plans(fake):
    """Few tiles and a long K: split-K with an fp32 partial workspace and zeroed counters; enough
    tiles: no split; forced splits are clamped to what the config allows."""
    launches, maps, empty = fake
    a, b = empty((128, 7168), "bfloat16"), empty((1536, 7168), "bfloat16")
    G.gemm(a, b, b_layout="nk")
    l = launches[-1]
    x = _args(l)
    plan = last_bound().plan
    cfg = G.CONFIGS[plan.config]
    tiles = -(-128 // cfg.bm) * -(-1536 // cfg.tile_n("nk"))
    assert x.splits == plan.splits > 1 and x.partials and x.counters and x.split_from == 0
    assert l["grid"] == min(132, tiles * x.splits)
    assert x.splits * tiles <= 132 * 2 and 7168 // 64 // x.splits >= GH.MIN_SPLIT_KBLOCKS
    big = G.gemm(empty((4096, 4096), "bfloat16"), empty((4096, 4096), "bfloat16"))
    assert _args(launches[-1]).splits == 1 and big.shape == (4096, 4096)
    G.gemm(a, b, b_layout="nk", config=3, splits=1000)
    assert _args(launches[-1]).splits == GH.max_splits(G.CONFIGS[3], 128, 1536, 7168, "nk") == 16
    G.gemm(empty((128, 256), "bfloat16"), empty((256, 512), "bfloat16"), splits=8)  # 4 K blocks: cannot split
    assert _args(launches[-1]).splits == 1
    G.gemm(a, b, b_layout="nk", config=6, splits=4)  # ping-pong never splits
    assert _args(launches[-1]).splits == 1
    # the running sums and counters (one buffer: sums, then counters) are cleared (stream-ordered, no
    # host sync) by the plan's first call only
    CLEARS.clear()
    o = empty((128, 1536), "bfloat16")
    G.gemm(a, b, o, b_layout="nk", config=3, splits=16)
    G.gemm(a, b, o, b_layout="nk", config=3, splits=16)
    x = _args(launches[-1])
    assert CLEARS == [(x.partials, 6 * 128 * 256 + 6)] and x.counters == x.partials + 4 * 6 * 128 * 256
    assert not last_bound().clears[0].pending
    # a partial last wave: 156 tiles of 128x192 on 132 SMs -> one wave of whole tiles, 24 tiles split
    G.gemm(empty((6656, 7168), "bfloat16"), empty((576, 7168), "bfloat16"), b_layout="nk")
    x = _args(launches[-1])
    assert (x.splits, x.split_from) == (5, 132) and launches[-1]["grid"] == 132
    bound = last_bound()
    assert bound.plan.config == 4 and bound.buffers[-1].shape == (24 * 128 * 192 + 24,)  # one sum per split tile


# ---------------------------------------------------------------------------------------------
# heuristic: configs 4..6 where they pay, the original choice everywhere else
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("M,N,K,layout,want", [
    (2048, 2048, 2048, "kn", 3), (4096, 4096, 4096, "kn", 3), (8192, 8192, 8192, "kn", 3),
    (2048, 10240, 8192, "nk", 3), (8192, 8192, 28672, "nk", 3),
    (2048, 1536, 7168, "nk", 4),     # dsv3.q_a: 128 tiles of 128x192 (was 384 of 64x128)
    (512, 7168, 2048, "nk", 5),      # dsv3.moe_down: 128 tiles of 128x224 (was 112 of 128x256)
    (8192, 32768, 512, "nk", 3),     # dsv3.kv_b: K = 512 (ping-pong config 6 disabled)
    (128, 57344, 8192, "nk", 5),     # llama gate_up: 256 tiles (2 full waves) instead of 224
    (128, 1024, 8192, "nk", 30),     # config 1's tile, B shared by the two row tiles (docs/journal/gemm.md entries
                                     # 34, 37), two warpgroups side by side along N
    (128, 4096, 7168, "nk", 30),     # dsv3.moe_gate_up M=128: 64 tiles split 2 (measured 337 vs 306 TFLOP/s
                                     # for 32 tiles of 128x128 split 4): SMALL_M efficiency; config 1 -> 30
    (64, 8192, 8192, "nk", 1),       # one row of tiles: no pair along M
    (128, 8192, 8192, "kn", 30),     # llama o M=128 (40.6-41.2 vs 43.8-44.5 us on config 19, 43.5-46.2 on 1)
    (512, 4096, 7168, "nk", 2),      # ... but not from M = 256 up: dsv3.moe_gate_up M=512, 128 tiles of 128 x
                                     # 128 (config 18's 64 x 256 measured 44.3 vs 48.1 us in entry 28, 43.1 vs
                                     # 43.9 in entry 64: a tie since; 18 loses elsewhere, e.g. 713x2576x10896
                                     # 108.7 vs 72.3)
    (128, 10240, 8192, "nk", 9),     # llama qkv M=128: 54 tiles x 2 blocks in clusters (measured 422 vs 384
                                     # TFLOP/s for config 3 split 3)
    (8192, 576, 7168, "nk", 40),     # dsv3.kv_a M=8192: 129 tiles of 192x192 in one wave (cuBLAS's tile;
                                     # 95.9-100.2 vs 108.6 us for config 4 with its last wave split 2)
    (3072, 1536, 4096, "nk", 40),    # (51.2 vs 59.2 us for config 3 with its last wave split 11)
    (4096, 576, 4096, "nk", 4),      # ... not where 192-row tiles would be split (39.8 vs 31.9 us)
    (128, 36864, 7168, "nk", 24),    # dsv3.dense_gate_up M=128: 256 unsplit tiles of 128x144, 1.94 waves
                                     # (measured 137.6 vs 150.8 us for config 3 with its last wave split 11)
    (512, 36864, 7168, "nk", 5),     # ... but not from M = 256 up (config 24: 465 vs 413 us)
    (16384, 576, 7168, "nk", 40),    # dsv3.kv_a (N = 576 = 4 x 144): config 24 measured slower (225 vs 197 us);
                                     # 258 tiles of 192x192 (1.95 waves): 201.2 vs 203.4 for config 4
    (8192, 1536, 7168, "nk", 3),     # dsv3.q_a M=8192: 344 tiles of 192x192 would be 2.6 waves (284-288 vs 258.5)
    (512, 10240, 8192, "nk", 42),    # llama qkv M=512: 128 tiles of 128x320, one wave (129.8 vs 134.3 us for
                                     # config 3 split 4)
    (2048, 7168, 16384, "nk", 5),    # ... not on N = 7168 (dsv3.o M=2048: 733 vs 692 for config 5)
    (512, 10240, 8192, "kn", 3),     # "kn": no 320-wide tile (config 42 is config 3's tile there)
    (512, 1536, 7168, "nk", 36),     # dsv3.q_a M=512: 64 tiles of 128x96 x 2 in clusters (24.7 vs 25.7 us
                                     # steady for config 4 split 4; docs/journal/gemm.md entry 40)
    (384, 1536, 4096, "nk", 36),     # (14.0 vs 16.6 us for config 18 split 3)
    (512, 1536, 2048, "nk", 1),      # ... not where whole tiles fill the SMs (config 1 unsplit 9.9 vs 11.0)
    (512, 512, 512, "nk", 1),        # (square512: 3.5 vs 6.0)
    (256, 4096, 8192, "nk", 30),     # one whole wave of 64x128 tiles up to M = 512 (entry 44: 30.9 vs 38.2 us
    (512, 2048, 2048, "nk", 30),     # for config 18 x 2; 9.3 vs 10.1 for config 1)
    (1024, 1024, 8192, "nk", 18),    # ... not at M = 1024 (33.3 vs 32.0)
    (256, 2048, 8192, "nk", 18),     # ... nor half a wave (27.3 vs 24.1)
])
def test_heuristic_choices(monkeypatch, M, N, K, layout, want, mkenv):
    mkenv("MKERNEL_GEMM_CONFIG", None)
    mkenv("MKERNEL_GEMM_CANDIDATES", None)
    assert G.auto_plan(M, N, K, layout, 132)[0].id == want


@pytest.mark.parametrize("M,N,K,layout,aligned,misaligned", [
    # measured (docs/journal/gemm.md entries 62, 64), us on misaligned rows: 1778x408x5544 config 18 x 2 42.0, 5 x 4
    # 29.8, 8 x 2 30.4; 325x4584x4184 18: 49.5, 2: 41.7, 8: 34.5; 7950x1744x952 18: 57.4, 4: 47.9, 50: 44.9.
    # (The aligned picks were config 18 until entry 64 lowered its efficiency above M = 128; unmeasured.)
    (1778, 408, 5544, "nk", 5, 8),
    (325, 4584, 4184, "nk", 2, 8),
    (7950, 1744, 952, "kn", 4, 50),
    (696, 3712, 8360, "kn", 4, 50),     # 4: 99.2, 50: 84.7 (aligned 696x3712x8368: 4 67.2, 50 67.3)
])
def test_misaligned_rows_move_off_load_heavy_configs(monkeypatch, M, N, K, layout, aligned, misaligned, mkenv):
    """Operand rows an odd multiple of 16 bytes apart make the configs that load the most rows per
    multiply-add load-bound (load_bound), the cluster pairs that multicast one operand less so; with
    aligned rows the plan is unchanged."""
    mkenv("MKERNEL_GEMM_CONFIG", None)
    mkenv("MKERNEL_GEMM_CANDIDATES", None)
    assert G.auto_plan(M, N, K, layout, 132)[0].id == aligned
    assert G.auto_plan(M, N, K, layout, 132, None, (True, True))[0].id == misaligned
    for cid in GC.AUTO_CANDIDATES:  # aligned: untouched; misaligned: never raised
        cfg = G.CONFIGS[cid]
        assert G.load_bound(cfg, (False, False), layout) is cfg
        assert G.load_bound(cfg, (True, True), layout).efficiency <= cfg.efficiency
    mis = {c: G.load_bound(G.CONFIGS[c], (True, True), "nk").efficiency for c in (2, 3, 4, 8, 11, 18, 48, 49, 50)}
    assert mis[18] < 0.8 and mis[8] > mis[2] and mis[50] > mis[4] and mis[48] > mis[4] and mis[49] > mis[3]
    assert mis[49] == mis[11] == G.CONFIGS[3].efficiency  # the 128 x 256 pairs: not load-bound


def test_misaligned_rows_reach_the_planner(fake):
    """mkernel.gemm passes in-place operands' row alignment to the heuristic; staged copies are aligned."""
    launches, maps, empty = fake
    G.gemm(empty((1778, 5544), "bfloat16"), empty((408, 5544), "bfloat16"), b_layout="nk")
    assert launches[-1]["config"] == 8  # (a pair sharing A: docs/journal/gemm.md entry 64)
    G.gemm(empty((1778, 5536), "bfloat16"), empty((408, 5536), "bfloat16"), b_layout="nk")
    assert launches[-1]["config"] == 5
    assert not GO.row_misaligned(empty((1, 5544), "bfloat16"), 1, 5544)


def test_heuristic_overrides(monkeypatch, mkenv):
    """GemmOptions.candidates restricts the heuristic (the environment's MKERNEL_GEMM_CANDIDATES /
    MKERNEL_GEMM_CONFIG reach the default options only)."""
    allowed = (1, 2, 3)  # the original heuristic
    assert G.auto_plan(2048, 1536, 7168, "nk", 132, allowed=allowed)[0].id == 3  # measured: 3: 571, 2: 515, 1: 456
    assert G.auto_plan(8192, 32768, 512, "nk", 132, allowed=allowed)[0].id == 3
    assert G.auto_plan(8192, 32768, 512, "nk", 132, config=3)[0].id == 3
    assert G.choose_config(lambda c: 100, 132, allowed=(6,)).id in GC.LEGACY_CANDIDATES  # (none applies: ignored)
    mkenv("MKERNEL_GEMM_CANDIDATES", "1,2,3")
    mkenv("MKERNEL_GEMM_CONFIG", "3")
    assert G.GemmOptions.default() == G.GemmOptions(config=3, candidates=(1, 2, 3))
    assert 6 not in GC.AUTO_CANDIDATES  # ping-pong: forced only until measured (docs/gemm.md)
    assert 9 in GC.AUTO_CANDIDATES and all(G.CONFIGS[c].cluster == 1 for c in GC.GROUPED_CANDIDATES)
    assert 18 in GC.AUTO_CANDIDATES and 18 in GC.GROUPED_CANDIDATES
    assert 24 in GC.AUTO_CANDIDATES and 24 in GC.GROUPED_CANDIDATES
    assert 36 in GC.AUTO_CANDIDATES and 36 not in GC.GROUPED_CANDIDATES
    assert 40 in GC.AUTO_CANDIDATES and 40 in GC.GROUPED_CANDIDATES
    assert 42 in GC.AUTO_CANDIDATES and G.CONFIGS[42].b_box_rows == 160  # TMA boxes are at most 256 rows


def test_cluster_split_k_only_replaces_split_plans(monkeypatch, bench_nk, mkenv):
    """A cluster split-K plan (configs 9, 36) is picked only where the best plan without them splits K
    (running-sum split-K); where whole tiles fill the SMs the unsplit plan stays."""
    others = tuple(c for c in GC.AUTO_CANDIDATES if G.CONFIGS[c].cluster_k == 1)
    picked = 0
    for M in (64, 128, 256, 384, 512, 640, 1024, 2048):
        for N, K in bench_nk + [(512, 512), (1024, 2048), (1536, 2048), (2048, 2048), (3072, 7168)]:
            for layout in ("nk", "kn"):
                cfg, sp, sf = G.auto_plan(M, N, K, layout, 132)
                if cfg.cluster_k == 1:
                    continue
                picked += 1
                assert G.auto_plan(M, N, K, layout, 132, allowed=others)[1] > 1, (M, N, K, layout, cfg.id)
    assert picked > 0


@pytest.fixture
def bench_nk(monkeypatch):
    """The (N, K) of bench/gemm.py's Llama-3-70B and DeepSeek-V3 projections (its tables, imported)."""
    bench = Path(__file__).resolve().parents[2] / "bench"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("_bench_gemm_tables", bench / "gemm.py")
    mod = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    spec.loader.exec_module(mod)  # (standard library imports only; it prepends bench/ and the repo to sys.path)
    sys.path[:] = saved
    return list({**mod.LLAMA3_70B, **mod.DEEPSEEK_V3}.values())


def test_config24_only_at_small_m(monkeypatch, bench_nk, mkenv):
    """Config 24 (128 x 144) is a candidate at M <= SMALL_M only: over every bench shape from M = 256 up
    (and every M of the kv_a / dense_gate_up shapes it was measured on) the heuristic never picks it."""
    mkenv("MKERNEL_GEMM_CONFIG", None)
    mkenv("MKERNEL_GEMM_CANDIDATES", None)
    for M in (256, 512, 1000, 2048, 8192, 16384):
        for N, K in bench_nk:
            assert G.auto_plan(M, N, K, "nk", 132)[0].id != 24, (M, N, K)


def test_config30_replaces_config1_at_small_m_only(monkeypatch, bench_nk, mkenv):
    """Config 30 (config 1's tile in clusters of 2 along M, two warpgroups side by side along N) is
    picked exactly where config 1 would be at M <= SMALL_M with the rows in whole pairs of 64-row
    tiles, and above that only up to M = 512 where its tiles make one whole wave."""
    no30 = tuple(c for c in GC.AUTO_CANDIDATES if c != 30)
    for M in (1, 7, 64, 65, 100, 128, 129, 256, 512, 2048, 8192):
        for N, K in bench_nk + [(1000, 4097), (7, 4000)]:
            for layout in ("nk", "kn"):
                without = G.auto_plan(M, N, K, layout, 132, allowed=no30)
                cfg, sp, sf = G.auto_plan(M, N, K, layout, 132)
                tiles = G.tile_count(G.CONFIGS[30], M, N, layout)
                if 64 < M <= GH.SMALL_M and without[0].id == 1:
                    assert (cfg.id, sp) == (30, without[1]), (M, N, K, layout)
                elif cfg.id == 30:
                    assert GH.SMALL_M < M <= 512 and GH.FULL_WAVE_FILL * 132 <= tiles <= 132 and sp == 1, (M, N, K, layout)
                else:
                    assert (cfg.id, sp, sf) == (without[0].id, without[1], without[2]), (M, N, K, layout)


def test_config5_kn_is_config3_tile_and_never_auto(monkeypatch, mkenv):
    mkenv("MKERNEL_GEMM_CONFIG", None)
    c5 = G.CONFIGS[5]
    assert c5.tile_n("nk") == 224 and c5.tile_n("kn") == 256 and c5.smem == G.CONFIGS[3].smem
    for m, n, k in [(512, 7168, 2048), (128, 57344, 8192), (4096, 4096, 4096)]:
        assert G.auto_plan(m, n, k, "kn", 132)[0].id != 5


def test_224_plans(fake):
    launches, maps, empty = fake
    G.gemm(empty((512, 2048), "bfloat16"), empty((7168, 2048), "bfloat16"), b_layout="nk")
    assert launches[0]["config"] == 5 and maps[1]["box"] == (64, 224, 1) and launches[0]["grid"] == 128
    launches.clear(), maps.clear()
    G.gemm(empty((512, 2048), "bfloat16"), empty((2048, 7168), "bfloat16"), config=5)  # kn: 256-wide tiles
    assert maps[1]["box"] == (64, 64, 1) and launches[0]["grid"] == 4 * 28


def test_tma_store_epilogue_plans(fake, monkeypatch, mkenv):
    """Every config with staging boxes gets a tensor map over C ({N, M}, box of 128 bytes x 64 rows)
    and c_tma = 1 when C's base and row stride are 16-byte multiples (any output dtype, grouped too);
    otherwise, for configs without staging, or with MKERNEL_GEMM_EPILOGUE=registers, c_tma = 0 and a
    stand-in map (the register epilogue)."""
    launches, maps, empty = fake
    a, b = empty((1000, 512), "bfloat16"), empty((512, 520), "bfloat16")
    for cid in (1, 2, 3, 4, 5):
        assert G.CONFIGS[cid].tma_store and G.CONFIGS[cid].smem <= 227 * 1024
    out = G.gemm(a, b, config=3)
    (l,) = launches
    assert l["config"] == 3 and len(l["args"]) == 4 and l["args"][3].c_tma == 1
    assert maps[2] == dict(ptr=out.ptr, dtype="bfloat16", dims=(520, 1000), strides=(1040,), box=(64, 64))
    launches.clear(), maps.clear()
    o32 = empty((1000, 520), "float32")
    G.gemm(a, b, o32, config=1)
    assert launches[0]["args"][3].c_tma == 1
    assert maps[2] == dict(ptr=o32.ptr, dtype="float32", dims=(520, 1000), strides=(2080,), box=(32, 64))
    launches.clear(), maps.clear()
    G.grouped_gemm(a, empty((2, 512, 520), "bfloat16"), [0, 400, 1000], config=4)
    assert launches[-1]["kernel"] == "mk_grouped_gemm_kn" and launches[-1]["args"][3].c_tma == 1
    launches.clear(), maps.clear()
    for cfg in (0, 6):  # no staging: register epilogue, stand-in map
        G.gemm(a, b, config=cfg)
        assert launches[-1]["args"][3].c_tma == 0 and len(launches[-1]["args"]) == 4
    odd = DeviceArray(empty((1, 1), "bfloat16").ptr + 2, (1000, 520), "bfloat16", None, 0)  # misaligned base
    G.gemm(a, b, odd, config=3)
    assert launches[-1]["args"][3].c_tma == 0
    mkenv("MKERNEL_GEMM_EPILOGUE", "registers")
    G.gemm(a, b, config=3)
    assert launches[-1]["args"][3].c_tma == 0


def test_captured_plans_outlive_the_lru(fake, monkeypatch):
    """A bound call whose buffers (split-K partials here) were captured into a CUDA graph must survive LRU
    eviction: the graph replays them.  Bound calls run outside a capture are evicted as usual."""
    launches, maps, empty = fake
    monkeypatch.setattr(BASE, "_pinned", [])
    b = empty((1536, 7168), "bfloat16")
    G.gemm(empty((128, 7168), "bfloat16"), b, b_layout="nk")  # not captured
    free = last_bound()
    _capturing(monkeypatch, True)
    G.gemm(empty((96, 7168), "bfloat16"), b, b_layout="nk")  # captured (another layout: its own bound call)
    kept = last_bound()
    assert kept is not free and kept.plan.splits > 1 and kept.pinned and BASE._pinned == [kept] and not free.pinned
    # its counter clear was captured (it happens when the graph runs): the next eager call clears again
    assert kept.clears[0].pending and not free.clears[0].pending
    _capturing(monkeypatch, False)
    for i in range(BASE.STATE_CAPACITY + 1):  # evict both from the LRU
        G.gemm(empty((256, 256 + 8 * i), "bfloat16"), empty((256 + 8 * i, 256), "bfloat16"))
    calls = BASE.device_state("gemm", 0).calls.values()
    assert kept not in calls and free not in calls
    assert BASE._pinned == [kept] and kept.buffers  # its partials and counters are still referenced
    _capturing(monkeypatch, True)
    G.gemm(empty((8, 8), "bfloat16"), empty((8, 8), "bfloat16"))  # captured, but no buffers: not pinned
    assert BASE._pinned == [kept] and not last_bound().pinned


# ---------------------------------------------------------------------------------------------
# decode-shaped GEMMs (mkernel/gemv.py, cuda_src/gemv.cu)
# ---------------------------------------------------------------------------------------------
from mkernel.ops.gemm import gemv as GV  # noqa: E402

GEMV_SPECS = [(s, d) for s, d in CP.registered_specializations() if s == GV.SOURCE]


def test_gemv_all_combinations_registered():
    """Every dtype pair x both column-tile counts, each with its VARIANTS entry (K chunks in flight,
    blocks per SM)."""
    got = {(d["MK_GEMM_IN"], d["MK_GEMM_OUT"], d["MK_GEMV_NT"], d["MK_GEMV_UNROLL"], d["MK_GEMV_MINB"])
           for _, d in GEMV_SPECS}
    assert got == {(GV.DTYPE_CODES[i], GV.DTYPE_CODES[o], nt, *GV.VARIANTS[nt])
                   for i in GV.IN_DTYPES for o in GV.OUT_DTYPES for nt in (1, 2)}
    assert GV.VARIANTS == {1: (8, 2), 2: (4, 2)}


@pytest.mark.parametrize("source,defines", GEMV_SPECS, ids=[
    f"in{d['MK_GEMM_IN']}-out{d['MK_GEMM_OUT']}-nt{d['MK_GEMV_NT']}" for _, d in GEMV_SPECS])
def test_gemv_compiles_clean(source, defines, compile_cache, monkeypatch):
    """No spills, no stack, registers within the budget of MK_GEMV_MINB blocks of 256 threads per SM
    (64 K registers an SM: <= 128 a thread for two blocks), no warnings."""
    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(compile_cache))
    mod = CP.compile_module(source, defines, arch=ARCH)
    u = mod.resource_usage["mk_gemv_nk"]
    assert u.get("spill_stores", 0) == 0 and u.get("spill_loads", 0) == 0 and u.get("stack", 0) == 0, u
    assert u["registers"] * GV.THREADS * defines["MK_GEMV_MINB"] <= 65536, u
    assert not [ln for ln in mod.log.splitlines() if re.search(r"warning|C75\d\d", ln, re.I)], mod.log


@pytest.fixture
def fake_gemv(fake, monkeypatch, mkenv):
    launches, maps, empty = fake
    monkeypatch.setattr(GV, "_kernel", lambda i, o, nt: FakeKernel(launches, (i, o, nt, "mk_gemv_nk")))
    mkenv("MKERNEL_GEMM_GEMV", None)
    return launches, empty


def test_gemv_routes_decode_shapes(fake_gemv, monkeypatch, mkenv):
    """M <= 16 with B "nk", K % 8 == 0, 16-byte aligned operands, >= 66 blocks of 16 B rows (half of 132
    SMs) and < 99 tiles of 256 columns (0.75 of them) go to mk_gemv_nk: one block of 256 threads per 16
    rows of B, one MMA column tile up to 8 rows, two up to 16; arguments A, lda, B, ldb, C, ldc, M, N, K;
    a programmatic dependent launch (the kernel waits for its predecessor before its first load)."""
    launches, empty = fake_gemv
    for M, nt in ((1, 1), (5, 1), (8, 1), (9, 2), (16, 2)):  # (N = 6144: 96 tiles of 64 rows, not swapped)
        a, b = empty((M, 8192), "bfloat16"), empty((6144, 8192), "bfloat16")
        out = G.gemm(a, b, b_layout="nk", out_dtype="float32")
        l = launches[-1]
        assert l["kernel"] == "mk_gemv_nk" and l["config"] == nt and l["grid"] == 384 and l["block"] == 256
        assert l["dependent"] is True and l["smem"] == 0
        args = [x.value for x in l["args"]]
        assert args == [a.ptr, 8192, b.ptr, 8192, out.ptr, 6144, M, 6144, 8192]
    # the smallest N that still fills half of the SMs: ceil(N / 16) >= 66; the largest below 99 tiles
    # (which swap_candidates would compute transposed: 392 tiles of 64 rows)
    G.gemm(empty((4, 1056), "float16"), empty((1041, 1056), "float16"), b_layout="nk")
    mkenv("MKERNEL_GEMM_SWAP", "0")
    assert launches[-1]["kernel"] == "mk_gemv_nk" and launches[-1]["grid"] == 66
    G.gemm(empty((2, 1024), "bfloat16"), empty((25088, 1024), "bfloat16"), b_layout="nk")
    assert launches[-1]["kernel"] == "mk_gemv_nk" and launches[-1]["grid"] == 1568
    # a re-pointed output: the same plan, the new C pointer
    a, b = empty((3, 4096), "bfloat16"), empty((4096, 4096), "bfloat16")
    o1, o2 = empty((3, 4096), "bfloat16"), empty((3, 4096), "bfloat16")
    G.gemm(a, b, o1, b_layout="nk")
    n_plans = nplans()
    G.gemm(a, b, o2, b_layout="nk")
    assert nplans() == n_plans and launches[-1]["args"][4].value == o2.ptr
    assert launches[-2]["args"][4].value == o1.ptr


def test_swapped_routes(fake_gemv, monkeypatch, mkenv):
    """B "nk" calls computed transposed (swap_candidates): decode-shaped M <= 32 (config 53 up to 16 rows, 54
    up to 32) but the small ones the decode kernel takes (ceil(N / 64) < 0.75 of the SMs); tall-skinny
    calls with a long K where the model gains SWAP_GAIN.  The launch: the kernel's M x N = the caller's
    N x M, tmA over B and tmB over A, register stores (c_tma = 0), C and ldc the caller's."""
    launches, empty = fake_gemv
    for M, N, K, cfg in [(1, 8192, 8192, 53), (16, 8192, 8192, 53), (16, 8192, 28672, 53), (8, 7168, 2048, 53),
                         (4, 57344, 8192, 53), (1, 576, 7168, 53), (17, 8192, 8192, 54), (32, 7168, 2048, 54),
                         (1, 10240, 8192, 53), (16, 14336, 4096, 53), (24, 10240, 8192, 54),  # 1.x waves
                         (9008, 248, 5752, 48), (10755, 104, 5184, 9)]:
        a, b = empty((M, K), "bfloat16"), empty((N, K), "bfloat16")
        out = G.gemm(a, b, b_layout="nk")
        l = launches[-1]
        assert l["kernel"] == "mk_gemm_nk" and l["swap"] and l["config"] == cfg, (M, N, K, l["config"])
        args = l["args"][3]
        assert (args.c, args.ldc, args.M, args.N, args.K, args.c_tma) == (out.ptr, N, N, M, K, 0)
        assert last_bound().plan.swapped
    # one whole wave of decode tiles: unsplit; a swapped plan in clusters: no programmatic dependent launch
    G.gemm(empty((16, 16384), "bfloat16"), empty((7168, 16384), "bfloat16"), b_layout="nk")
    assert launches[-1]["swap"] and launches[-1]["args"][3].splits == 1 and launches[-1]["dependent"]
    G.gemm(empty((9008, 5752), "bfloat16"), empty((248, 5752), "bfloat16"), b_layout="nk")
    assert launches[-1]["swap"] and launches[-1]["cluster"] == (2, 1, 1) and not launches[-1]["dependent"]
    # ... only the partial last wave split (160 tiles on 132 SMs: 28 tiles of 4 units after 132 whole ones)
    G.gemm(empty((16, 8192), "bfloat16"), empty((10240, 8192), "bfloat16"), b_layout="nk")
    assert launches[-1]["swap"] and launches[-1]["args"][3].splits == 4
    assert launches[-1]["args"][3].split_from == 132
    for M, N, K, layout in [(4, 2048, 2048, "nk"), (3750, 80, 3024, "nk"),
                            (8192, 128, 8192, "nk"), (6000, 64, 7000, "nk"),  # (64-row tiles / half-empty ones)
                            (16, 8192, 8192, "kn"), (9008, 248, 5752, "kn"), (64, 8192, 8192, "nk")]:
        G.gemm(empty((M, K), "bfloat16"), empty((K, N) if layout == "kn" else (N, K), "bfloat16"), b_layout=layout)
        assert not launches[-1]["swap"], (M, N, K, layout)
    w = empty((8192, 8192), "bfloat16")
    G.gemm(empty((16, 8192), "bfloat16"), w, b_layout="nk", config=1)  # a forced config: plain unless swap=True
    assert not launches[-1]["swap"] and launches[-1]["config"] == 1
    G.gemm(empty((16, 8192), "bfloat16"), w, b_layout="nk", config=2, swap=True)
    assert launches[-1]["swap"] and launches[-1]["config"] == 2
    mkenv("MKERNEL_GEMM_CONFIG", "3")  # a config forced by the environment: plain
    G.gemm(empty((9008, 5752), "bfloat16"), empty((248, 5752), "bfloat16"), b_layout="nk")
    assert not launches[-1]["swap"] and launches[-1]["config"] == 3
    mkenv("MKERNEL_GEMM_CONFIG", None)
    mkenv("MKERNEL_GEMM_SWAP", "0")
    G.gemm(empty((16, 8192), "bfloat16"), w, b_layout="nk")
    assert launches[-1]["kernel"] == "mk_gemv_nk"
    with pytest.raises(ValueError, match="swap"):
        G.gemm(empty((16, 8192), "bfloat16"), w, b_layout="kn", swap=True)


def test_describe_transposed(monkeypatch, mkenv):
    """describe() reports the plan gemm builds: transposed (the N x M problem's tile, tiles and grid) where
    swap_candidates says so, the decode kernel or a plain plan elsewhere."""
    compile_module = CP.compile_module
    for mod in (GP, GV):
        monkeypatch.setattr(mod, "compile_module", lambda s, d, **kw: compile_module(s, d, **{"arch": ARCH, **kw}))
    monkeypatch.setattr(GK, "num_sms", lambda dev: 132)
    _no_device(monkeypatch)
    mkenv("MKERNEL_GEMM_SWAP", None)
    d = G.describe(16, 8192, 8192, b_layout="nk")
    assert (d["swapped"], d["config"], d["bm"], d["bn"], d["splits"], d["tiles"]) == (True, 53, 64, 16, 1, 128)
    assert d["spills"] in (0, None)
    d = G.describe(9008, 248, 5752, b_layout="nk")
    assert d["swapped"] and d["config"] == 48
    assert G.describe(1, 10240, 8192, b_layout="nk")["config"] == 53
    assert G.describe(4, 2048, 2048, b_layout="nk")["config"] == "gemv"
    assert not G.describe(16, 8192, 8192, b_layout="nk", config=1)["swapped"]


def test_gemv_not_routed(fake_gemv, monkeypatch, mkenv):
    """Everything else stays on the GEMM tiles."""
    launches, empty = fake_gemv
    mkenv("MKERNEL_GEMM_SWAP", "0")  # (swapped plans: test_swapped_routes)
    w = empty((8192, 8192), "bfloat16")
    cases = [
        dict(a=empty((17, 8192), "bfloat16"), b=w),  # M > 16
        dict(a=empty((1, 1024), "bfloat16"), b=empty((25089, 1024), "bfloat16")),  # 99 tiles of 256
        dict(a=empty((1, 8192), "bfloat16"), b=empty((28672, 8192), "bfloat16")),
        dict(a=empty((1, 8192), "bfloat16"), b=empty((8192, 8192), "bfloat16"), b_layout="kn"),
        dict(a=empty((1, 8184 + 4), "bfloat16"), b=empty((8192, 8188), "bfloat16")),  # K % 8 != 0
        dict(a=empty((4, 8192), "bfloat16"), b=empty((1040, 8192), "bfloat16")),  # 65 blocks < 66
        dict(a=empty((4, 8192), "bfloat16"), b=w, config=1),  # a forced tile config
        dict(a=empty((4, 8192), "bfloat16"), b=w, splits=2),  # a forced split
    ]
    for c in cases:
        G.gemm(c.pop("a"), c.pop("b"), b_layout=c.pop("b_layout", "nk"), **c)
        assert launches[-1]["kernel"].startswith("mk_gemm_"), c
    # an operand view whose rows are not 16-byte aligned: (8200 - 4) elements apart
    big = empty((2, 8200), "bfloat16")
    a = DeviceArray(big.ptr + 8, (2, 8192), "bfloat16", (8200, 1), 0)
    G.gemm(a, w, b_layout="nk")
    assert launches[-1]["kernel"] != "mk_gemv_nk"
    big = empty((2, 8196), "bfloat16")  # an aligned base, rows 16392 bytes apart
    G.gemm(DeviceArray(big.ptr, (2, 8192), "bfloat16", (8196, 1), 0), w, b_layout="nk")
    assert launches[-1]["kernel"] != "mk_gemv_nk"
    mkenv("MKERNEL_GEMM_GEMV", "0")
    G.gemm(empty((4, 8192), "bfloat16"), w, b_layout="nk")
    assert launches[-1]["kernel"].startswith("mk_gemm_")


def test_gemv_describe(monkeypatch):
    """describe() of a routed call (mkernel.ops.gemm.describe hands it to gemv.describe): config "gemv",
    8 or 16 MMA rows, one block of 256 threads per 16 rows of B, registers from ptxas, no spills."""
    compile_module = CP.compile_module
    monkeypatch.setattr(GV, "compile_module", lambda s, d, **kw: compile_module(s, d, **{"arch": ARCH, **kw}))
    d = GV.describe(4, 8192, 8192, "bfloat16", "float32")
    assert (d["config"], d["bm"], d["bn"], d["threads"], d["grid"], d["tiles"], d["splits"]) == ("gemv", 8, 16, 256, 512, 512, 1)
    assert 0 < d["registers"] <= 255 and d["spills"] == 0
    d = GV.describe(12, 1000, 64, "float16", "float16")
    assert (d["bm"], d["grid"]) == (16, 63) and d["spills"] == 0


def test_gemv_dependent_launch_env(fake_gemv, monkeypatch, mkenv):
    """MKERNEL_GEMM_PDL=0 makes the decode launch a plain one (=1 and unset: dependent); the variable
    is part of the plan key, so a changed setting builds a new plan."""
    launches, empty = fake_gemv
    a, b = empty((4, 4096), "bfloat16"), empty((4096, 4096), "bfloat16")
    for env, want in (("0", False), ("1", True), (None, True)):
        if env is None:
            mkenv("MKERNEL_GEMM_PDL", None)
        else:
            mkenv("MKERNEL_GEMM_PDL", env)
        G.gemm(a, b, b_layout="nk")
        assert launches[-1]["kernel"] == "mk_gemv_nk" and launches[-1]["dependent"] is want, env


def test_deterministic_plans_never_split(fake):
    """A shape the heuristic splits along K (few tiles, long K) is planned unsplit with
    GemmOptions(deterministic=True) (split-K adds its partials in arrival order); splits > 1 with it is refused."""
    launches, maps, empty = fake
    a, b = empty((128, 16384), "bfloat16"), empty((16384, 512), "bfloat16")
    G.gemm(a, b)
    assert _args(launches[-1]).splits > 1  # the default plan splits (else this test shows nothing)
    G.gemm(a, b, options=G.GemmOptions(deterministic=True))
    assert _args(launches[-1]).splits == 1
    with pytest.raises(ValueError, match="deterministic"):
        G.gemm(a, b, options=G.GemmOptions(deterministic=True, splits=2))


def test_a_bound_layout_skips_the_checks_but_not_the_overlap_check(fake, monkeypatch):
    """A call whose layout (shapes, strides, dtypes, options, stream, out) is bound already runs its bound call
    without the shape checks (they ran when it was bound); the overlap of out with a or b is checked every call."""
    launches, maps, empty = fake
    a, b, o = empty((64, 256), "bfloat16"), empty((256, 128), "bfloat16"), empty((64, 128), "bfloat16")
    G.gemm(a, b, o)
    monkeypatch.setattr(GA, "check_arrays", lambda *x, **k: pytest.fail("checked again"))
    G.gemm(empty((64, 256), "bfloat16"), b, empty((64, 128), "bfloat16"))
    assert len(launches) == 2
    base = empty((64 * 256 + 64 * 128,), "bfloat16")
    a2 = DeviceArray(base.ptr, (64, 256), "bfloat16", None, 0)
    o2 = DeviceArray(base.ptr + 2 * 64 * 256 - 2 * 128, (64, 128), "bfloat16", None, 0)  # (its first row is a's last)
    with pytest.raises(ValueError, match="overlaps"):
        G.gemm(a2, b, o2)
    assert len(launches) == 2
