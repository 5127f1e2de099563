"""mkernel.attention on the CPU: every registered attention_fwd.cu specialization (both schedules, and the
default schedule's ring-attention merge kernels) compiles for sm_90a with no spills, no stack and no ptxas
warnings, with the host's launch geometry (static_asserts); the argument checks raise before any launch; and
the bound launch (tensor maps over both layouts, GQA group, strides, scale, grid, re-pointing) checked
against fakes of the driver-facing pieces."""
from __future__ import annotations

import contextlib
import ctypes
import math
import re

import pytest

import _compile_cache
from mkernel.core import compiler as CP
from mkernel.core import tensormap as TM
from mkernel.core.arrays import DeviceArray
from mkernel.ops import base as BASE
from mkernel.ops.attention import AttentionOptions, attention
from mkernel.ops.attention import kernels as AK, op as AO

ARCH = "sm_90a"
SPECS = [(s, d) for s, d in CP.registered_specializations() if s == AK.SOURCE]


def _schedule(defines: dict) -> str:
    return "pingpong" if defines.get("MK_ATTN_PINGPONG") else "default"


def _with_expectations(defines: dict) -> dict:
    g = AK.geometry(defines["MK_ATTN_D"], _schedule(defines))
    return {**defines, "MK_EXPECT_SMEM": g.smem, "MK_EXPECT_BM": g.bm, "MK_EXPECT_BN": g.bn,
            "MK_EXPECT_THREADS": g.threads}


def test_all_specializations_registered():
    got = {(d["MK_ATTN_DT"], d["MK_ATTN_D"], d["MK_ATTN_CAUSAL"], _schedule(d), d.get("MK_ATTN_MERGE", 0))
           for _, d in SPECS}
    # every schedule's plain kernels; the merge kernels (ring attention) of the default schedule only
    want = {(AK.DTYPE_CODES[t], hd, c, s, m) for t in AK.DTYPES for hd in AK.HEAD_DIMS for c in (0, 1)
            for s in AK.SCHEDULES for m in ((0, 1) if s == "default" else (0,))}
    assert got == want and len(SPECS) == 24
    # the default schedule is the kernel's built-in geometry: its defines are the three it always had (the
    # default forward's cubins and cache keys are unchanged), plus MK_ATTN_MERGE for the merge kernels
    for _, d in SPECS:
        assert _schedule(d) == "pingpong" or set(d) - {"MK_ATTN_MERGE"} == {"MK_ATTN_DT", "MK_ATTN_D", "MK_ATTN_CAUSAL"}
    assert "MK_ATTN_MERGE" not in AK.defines("bfloat16", 128, False)
    with pytest.raises(ValueError, match="default schedule"):
        AK.defines("bfloat16", 128, False, "pingpong", merge=True)


compile_cache = _compile_cache.module_fixture("test_compiles_clean", ARCH, _with_expectations)


@pytest.mark.parametrize("source,defines", SPECS, ids=[
    f"dt{d['MK_ATTN_DT']}-d{d['MK_ATTN_D']}-causal{d['MK_ATTN_CAUSAL']}-{_schedule(d)}"
    f"{'-merge' if d.get('MK_ATTN_MERGE') else ''}" for _, d in SPECS])
def test_compiles_clean(source, defines, compile_cache, monkeypatch):
    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(compile_cache))
    mod = CP.compile_module(source, _with_expectations(defines), arch=ARCH)
    u = mod.resource_usage[AK.KERNEL]
    assert u.get("spill_stores", 0) == 0 and u.get("spill_loads", 0) == 0, f"spills: {u}\n{mod.log}"
    assert u.get("stack", 0) == 0, f"stack frame: {u}"
    assert u["registers"] * AK.geometry(defines["MK_ATTN_D"], _schedule(defines)).threads <= 65536
    warnings = [ln for ln in mod.log.splitlines() if re.search(r"warning|C75\d\d", ln, re.I)]
    assert not warnings, "ptxas warnings:\n" + "\n".join(warnings)


def test_smem_budget():
    for d in AK.HEAD_DIMS:
        for s in AK.SCHEDULES:
            assert AK.smem_bytes(d, s) <= 227 * 1024
    assert AK.smem_bytes(64) == 1024 + 128 * 64 * 2 + 2 * 4 * 128 * 64 * 2 + 256  # (default: as before)
    assert AK.smem_bytes(128) == 1024 + 128 * 128 * 2 + 2 * 2 * 128 * 128 * 2 + 256
    assert max(AK.geometry(d, s).bm for d in AK.HEAD_DIMS for s in AK.SCHEDULES) <= AK.MAX_BM


# ---------------------------------------------------------------------------------------------
# the host side, against fakes
# ---------------------------------------------------------------------------------------------
class FakeLaunch:
    def __init__(self, log, key, grid, block, args, smem):
        self.log, self.key, self.grid, self.block, self.args, self.smem = log, key, grid, block, args, smem

    def __call__(self):
        args = [a.raw if hasattr(a, "raw") else AK.AttnFwdArgs.from_buffer_copy(a) for a in self.args]
        self.log.append(dict(key=self.key, grid=self.grid, block=self.block, args=args, smem=self.smem))


class FakeKernel:
    def __init__(self, log, key):
        self.log, self.key = log, key

    def prepare(self, grid, block, args, *, stream=None, smem=0, **kw):
        return FakeLaunch(self.log, self.key, grid, block, list(args), smem)


@pytest.fixture
def fake(monkeypatch):
    launches, maps = [], []
    ptrs = iter(range(1 << 40, 1 << 41, 1 << 28))

    def empty(shape, dtype, device=None):
        return DeviceArray(next(ptrs), shape, dtype, None, 0)

    def encode(ptr, dtype, dims, strides, box, **kw):
        maps.append(dict(ptr=ptr, dtype=dtype, dims=tuple(dims), strides=tuple(strides), box=tuple(box)))
        return int(ptr).to_bytes(8, "little") + bytes(120)

    monkeypatch.setattr(AK, "get", lambda dt, d, c, s="default": FakeKernel(launches, (dt, d, c) if s == "default"
                                                                           else (dt, d, c, s)))
    monkeypatch.setattr(AO, "on_device", lambda dev=None: contextlib.nullcontext((None, 0)))
    monkeypatch.setattr(AO, "require_gemm_device", lambda what, device: None)
    monkeypatch.setattr(AO, "_current_context", lambda: (1, 0))
    monkeypatch.setattr(AO, "_context_handle", lambda: 1)
    monkeypatch.setattr(TM, "encode_tiled", encode)
    monkeypatch.setattr(TM, "_codec", False)
    monkeypatch.setattr(DeviceArray, "empty", staticmethod(empty))
    BASE._device_states.clear()
    return launches, maps, empty


def _qkv(empty, B, Sq, Sk, Hq, Hkv, D, layout="bshd", dtype="bfloat16"):
    sh = (lambda s, h: (B, s, h, D)) if layout == "bshd" else (lambda s, h: (B, h, s, D))
    return empty(sh(Sq, Hq), dtype), empty(sh(Sk, Hkv), dtype), empty(sh(Sk, Hkv), dtype)


DEFAULT = AttentionOptions(schedule="default")  # the cases below check the default schedule's launches


def test_bshd_gqa_launch(fake):
    launches, maps, empty = fake
    q, k, v = _qkv(empty, 2, 1000, 777, 32, 8, 128)
    out, lse = attention(q, k, v, causal=True, options=DEFAULT)
    assert out.shape == q.shape and out.dtype.name == "bfloat16" and lse.shape == (2, 32, 1000)
    assert lse.dtype.name == "float32"
    (l,) = launches
    assert l["key"] == ("bfloat16", 128, True) and l["grid"] == (8, 32, 2) and l["block"] == 384
    assert l["smem"] == AK.smem_bytes(128)
    mq, mk, mv = maps
    # {D, S, H, B} over the real layout, [128 x 64] boxes
    assert mq == dict(ptr=q.ptr, dtype="bfloat16", dims=(128, 1000, 32, 2), strides=(32 * 256, 256, 1000 * 32 * 256),
                      box=(64, 128, 1, 1))
    assert mk["dims"] == (128, 777, 8, 2) and mk["strides"] == (8 * 256, 256, 777 * 8 * 256) and mv["ptr"] == v.ptr
    a = l["args"][3]
    assert (a.s_q, a.s_k, a.h_q, a.group, a.heavy_first) == (1000, 777, 32, 4, 1)
    assert (a.out, a.lse, a.out_sb, a.out_ss, a.out_sh) == (out.ptr, lse.ptr, 1000 * 32 * 128, 32 * 128, 128)
    assert a.scale_log2 == pytest.approx(math.log2(math.e) / math.sqrt(128), rel=1e-6)
    # new arrays of the same layout and another scale: re-pointed, not bound again
    q2, k2, v2 = _qkv(empty, 2, 1000, 777, 32, 8, 128)
    out2, lse2 = attention(q2, k2, v2, causal=True, softmax_scale=0.5, options=DEFAULT)
    assert len(launches) == 2 and len(BASE.device_state("attention", 0).calls) == 1
    l2 = launches[-1]
    assert [int.from_bytes(m[:8], "little") for m in l2["args"][:3]] == [q2.ptr, k2.ptr, v2.ptr]
    assert l2["args"][3].out == out2.ptr and l2["args"][3].lse == lse2.ptr
    assert l2["args"][3].scale_log2 == pytest.approx(0.5 * math.log2(math.e), rel=1e-6)
    assert AO.last_plan(0).grid == (8, 32, 2)


def test_bhsd_strided_views(fake):
    launches, maps, empty = fake
    # q a [B, H, S, D] view of a wider buffer (row stride 192 elements), k/v MQA; out given with padding
    base = empty((1, 4, 300, 192), "float16")
    q = DeviceArray(base.ptr, (1, 4, 300, 64), "float16", (4 * 300 * 192, 300 * 192, 192, 1), 0)
    k = empty((1, 1, 50, 64), "float16")
    v = empty((1, 1, 50, 64), "float16")
    obuf = empty((1, 4, 300, 80), "float16")
    o = DeviceArray(obuf.ptr, (1, 4, 300, 64), "float16", (4 * 300 * 80, 300 * 80, 80, 1), 0)
    out, lse = attention(q, k, v, o, layout="bhsd", options=AttentionOptions(heavy_first=False, schedule="default"))
    assert out is o
    (l,) = launches
    assert l["key"] == ("float16", 64, False) and l["grid"] == (3, 4, 1)
    mq, mk, _ = maps
    assert mq["dims"] == (64, 300, 4, 1) and mq["strides"] == (384, 300 * 384, 128)  # (B = 1: placeholder)
    assert mk["dims"] == (64, 50, 1, 1) and mk["strides"] == (128, 128, 128)
    a = l["args"][3]
    assert (a.group, a.heavy_first, a.out_ss, a.out_sh, a.out_sb) == (4, 0, 80, 300 * 80, 4 * 300 * 80)


def test_no_keys_and_empty(fake):
    launches, maps, empty = fake
    q, k, v = _qkv(empty, 1, 5, 0, 2, 2, 64)
    attention(q, k, v)
    assert launches[-1]["args"][3].s_k == 0 and maps[1]["ptr"] == q.ptr  # (K/V maps never read: over q)
    q, k, v = _qkv(empty, 1, 0, 5, 2, 2, 64)
    n = len(launches)
    out, lse = attention(q, k, v)
    assert len(launches) == n and lse.shape == (1, 2, 0)


@pytest.mark.parametrize("case,exc,match", [
    (dict(layout="sbhd"), ValueError, "layout"),
    (dict(D=96), ValueError, "head dim 96"),
    (dict(Hkv=3), ValueError, "multiple of the K/V heads"),
    (dict(dtype="float32"), TypeError, "bfloat16 or float16"),
    (dict(scale=0.0), ValueError, "softmax_scale"),
    (dict(scale=float("nan")), ValueError, "softmax_scale"),
    (dict(options="fast"), TypeError, "AttentionOptions"),
    (dict(options=AttentionOptions(schedule="fast")), ValueError, "schedule"),
])
def test_bad_arguments(fake, case, exc, match):
    launches, _, empty = fake
    layout = case.get("layout", "bshd")
    q, k, v = _qkv(empty, 1, 10, 10, 4, case.get("Hkv", 2), case.get("D", 64), "bshd", case.get("dtype", "bfloat16"))
    with pytest.raises(exc, match=match):
        attention(q, k, v, layout=layout, softmax_scale=case.get("scale"), options=case.get("options"))
    assert not launches


def test_bad_layouts_and_outputs(fake):
    launches, _, empty = fake
    q, k, v = _qkv(empty, 1, 10, 12, 4, 2, 64)
    with pytest.raises(ValueError, match="4-D"):
        attention(DeviceArray(q.ptr, (10, 4, 64), "bfloat16", None, 0), k, v)
    with pytest.raises(TypeError, match="share one dtype"):
        attention(q, empty(k.shape, "float16"), empty(v.shape, "float16"))
    with pytest.raises(ValueError, match="same shape"):
        attention(q, k, empty((1, 13, 2, 64), "bfloat16"))
    with pytest.raises(ValueError, match="batch or head dim"):
        attention(q, empty((2, 12, 2, 64), "bfloat16"), empty((2, 12, 2, 64), "bfloat16"))
    # an odd sequence stride (not a multiple of 16 bytes) and a misaligned base
    buf = empty((1, 10, 4, 72), "bfloat16")
    with pytest.raises(ValueError, match="16 bytes"):
        attention(DeviceArray(buf.ptr, (1, 10, 4, 64), "bfloat16", (10 * 4 * 68, 4 * 68, 68, 1), 0), k, v)
    with pytest.raises(ValueError, match="16-byte aligned"):
        attention(DeviceArray(q.ptr + 2, q.shape, "bfloat16", None, 0), k, v)
    with pytest.raises(ValueError, match="unit head-dim stride"):
        attention(DeviceArray(q.ptr, q.shape, "bfloat16", (10 * 4 * 128, 4 * 128, 128, 2), 0), k, v)
    with pytest.raises(ValueError, match="out must have"):
        attention(q, k, v, empty((1, 10, 4, 64), "float16"))
    with pytest.raises(ValueError, match="lse must be"):
        attention(q, k, v, lse=empty((1, 10, 4), "float32"))
    with pytest.raises(ValueError, match="overlaps"):
        attention(q, k, v, DeviceArray(k.ptr, q.shape, "bfloat16", None, 0))
    ro = DeviceArray(empty(q.shape, "bfloat16").ptr, q.shape, "bfloat16", None, 0, readonly=True)
    with pytest.raises(ValueError, match="read-only"):
        attention(q, k, v, ro)
    assert not launches


def test_args_struct_matches_kernel():
    # offsets of MkAttnFwdArgs (natural alignment, 64 bytes)
    f = {n: getattr(AK.AttnFwdArgs, n).offset for n, _ in AK.AttnFwdArgs._fields_}
    assert f == dict(out=0, lse=8, out_sb=16, out_ss=24, out_sh=32, s_q=40, s_k=44, h_q=48, group=52,
                     scale_log2=56, heavy_first=60)
    assert ctypes.sizeof(AK.AttnFwdArgs) == 64


@pytest.mark.parametrize("D,bm,threads", [(64, 192, 512), (128, 128, 384)])
def test_pingpong_launch(fake, D, bm, threads):
    """schedule="pingpong": its own kernel, grid over its query blocks, Q box of its rows; the default
    schedule's bound call of the same arrays coexists (the options are part of the key)."""
    launches, maps, empty = fake
    q, k, v = _qkv(empty, 2, 1000, 700, 16, 4, D)
    pp = AttentionOptions(schedule="pingpong")
    attention(q, k, v, causal=True, options=pp)
    (l,) = launches
    g = AK.geometry(D, "pingpong")
    assert l["key"] == ("bfloat16", D, True, "pingpong") and l["block"] == threads == g.threads
    assert l["grid"] == (-(-1000 // bm), 16, 2) and l["smem"] == g.smem and g.bm == bm
    mq, mk, mv = maps
    assert mq["box"] == (64, bm, 1, 1) and mk["box"] == mv["box"] == (64, g.bn, 1, 1)
    a = l["args"][3]
    assert (a.s_q, a.s_k, a.group, a.heavy_first) == (1000, 700, 4, 1)
    p = AO.last_plan(0)
    assert (p.schedule, p.block_m, p.block_n, p.threads) == ("pingpong", bm, g.bn, threads)
    attention(q, k, v, causal=True, options=DEFAULT)
    assert launches[-1]["key"] == ("bfloat16", D, True) and launches[-1]["grid"] == (8, 16, 2)
    assert launches[-1]["block"] == 384 and maps[-3]["box"] == (64, 128, 1, 1)
    assert len(BASE.device_state("attention", 0).calls) == 2
    attention(q, k, v, causal=True, options=pp)
    assert launches[-1]["key"][-1] == "pingpong" and len(BASE.device_state("attention", 0).calls) == 2


@pytest.mark.parametrize("D,Sk,want", [(64, 700, "pingpong"), (64, 20000, "pingpong"), (128, 8191, "pingpong"),
                                       (128, 8192, "default"), (128, 30000, "default")])
def test_auto_schedule(fake, D, Sk, want):
    """schedule="auto" (the default) picks by head dim and key count; the plan names the schedule that ran."""
    launches, maps, empty = fake
    q, k, v = _qkv(empty, 1, 256, Sk, 4, 4, D)
    attention(q, k, v)
    assert AO.last_plan(0).schedule == want
    assert (launches[-1]["key"][-1] == "pingpong") is (want == "pingpong")
    assert AK.pick_schedule("default", D, Sk) == "default" and AK.pick_schedule("pingpong", D, Sk) == "pingpong"
