"""Attention backward on the CPU: every registered attention_bwd.cu specialization compiles for sm_90a with
no spills (shared-memory sizes checked against the host's by static_asserts), and the host side of
mkernel.attention_backward (validation before any launch, launches and their arguments, key reuse)
against fakes of the driver-facing pieces."""
from __future__ import annotations

import contextlib
import ctypes
import math
import re

import pytest

import _compile_cache
from mkernel.core import compiler as CP
from mkernel.core.arrays import DeviceArray
from mkernel.ops import base as BASE
from mkernel.ops.attention_bwd import AttentionBwdOptions, BwdArgs, attention_backward
from mkernel.core import tensormap as TM
from mkernel.ops.attention_bwd import kernels as K, op as OP

ARCH = "sm_90a"
SPECS = [(s, d) for s, d in CP.registered_specializations() if s == K.SOURCE]
KERNELS = ("mk_attn_bwd_pre", "mk_attn_bwd_main", "mk_attn_bwd_dq", "mk_attn_bwd_convert")


def _with_expectations(d: dict) -> dict:
    if d.get("MKATT_WGMMA"):
        return {**d, "MKATT_EXPECT_WGMMA_SMEM": K.wgmma_smem(d["MKATT_D"])}
    return {**d, "MKATT_EXPECT_MAIN_SMEM": K.main_smem(d["MKATT_D"], d["MKATT_BR"]),
            "MKATT_EXPECT_DQ_SMEM": K.dq_smem(d["MKATT_D"])}


def test_all_combinations_registered():
    got = {(d["MKATT_DTYPE"], d["MKATT_D"], d["MKATT_BR"]) for _, d in SPECS
           if not d.get("MKATT_WGMMA") and not d.get("MKATT_PARTIAL")}
    assert got == {(c, dd, br) for c in K.DTYPES.values() for dd in K.HEAD_DIMS for br in K.BLOCK_Q}
    for partial in (0, 1):  # the wgmma kernel, and its ring-backward form
        got = {(d["MKATT_DTYPE"], d["MKATT_D"]) for _, d in SPECS
               if d.get("MKATT_WGMMA") and d.get("MKATT_PARTIAL", 0) == partial}
        assert got == {(c, dd) for c in K.DTYPES.values() for dd in K.HEAD_DIMS}
    got = {(d["MKATT_DTYPE"], d["MKATT_D"], d["MKATT_BR"]) for _, d in SPECS
           if d.get("MKATT_PARTIAL") and not d.get("MKATT_WGMMA")}
    assert got == {(c, dd, K.DEFAULT_BLOCK_Q[dd]) for c in K.DTYPES.values() for dd in K.HEAD_DIMS}
    assert len(SPECS) == len(K.specializations())


compile_cache = _compile_cache.module_fixture("test_compiles_clean", ARCH, _with_expectations)


@pytest.mark.parametrize("source,defines", SPECS, ids=[
    f"wgmma{'-partial' * bool(d.get('MKATT_PARTIAL'))}-dt{d['MKATT_DTYPE']}-d{d['MKATT_D']}"
    if d.get("MKATT_WGMMA") else
    f"partial-dt{d['MKATT_DTYPE']}-d{d['MKATT_D']}" if d.get("MKATT_PARTIAL") else
    f"dt{d['MKATT_DTYPE']}-d{d['MKATT_D']}-br{d['MKATT_BR']}" for _, d in SPECS])
def test_compiles_clean(source, defines, compile_cache, monkeypatch):
    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(compile_cache))
    mod = CP.compile_module(source, _with_expectations(defines), arch=ARCH)
    usage = mod.resource_usage
    threads = {"mk_attn_bwd_pre": 256, "mk_attn_bwd_convert": 256, "mk_attn_bwd_main": 32 * K.WARPS,
               "mk_attn_bwd_dq": 32 * K.DQ_WARPS, K.WGMMA_KERNEL: K.WGMMA_THREADS, "mk_attn_bwd_part_sum": 256}
    names = ((K.WGMMA_KERNEL,) if defines.get("MKATT_WGMMA") else K.PARTIAL_KERNELS if defines.get("MKATT_PARTIAL")
             else KERNELS)
    assert set(usage) == set(names), f"kernels of the specialization: {sorted(usage)}"
    for name in names:
        assert name in usage, f"{name} missing from the ptxas report:\n{mod.log}"
        u = usage[name]
        assert u.get("spill_stores", 0) == 0 and u.get("spill_loads", 0) == 0, f"{name} spills: {u}"
        assert u.get("stack", 0) == 0, f"{name} uses a stack frame: {u}"
        assert u["registers"] * threads[name] <= 65536, f"{name}: {u['registers']} registers x {threads[name]}"
    warnings = [ln for ln in mod.log.splitlines() if re.search(r"warning|C75\d\d", ln, re.I)]
    assert not warnings, "ptxas warnings:\n" + "\n".join(warnings)


def test_smem_budget():
    for d in K.HEAD_DIMS:
        assert K.dq_smem(d) <= 227 * 1024 and K.wgmma_smem(d) <= 227 * 1024
        for br in K.BLOCK_Q:
            assert K.main_smem(d, br) <= 227 * 1024


def test_args_struct_layout():
    assert ctypes.sizeof(BwdArgs) == 360  # static_assert in attention_bwd.cu
    assert ctypes.sizeof(OP.PartSumArgs) == 240  # static_assert in attention_bwd.cu (MKATT_PARTIAL)
    assert BwdArgs.q_s.offset == 11 * 8 and BwdArgs.B.offset == 11 * 8 + 27 * 8


# ---------------------------------------------------------------------------------------------
# host side, against fakes


PREPARED: list = []  # kernel names of every prepared launch (one set per bound call)
MAPS: list = []  # every encoded tensor map


class FakeLaunch:
    def __init__(self, log, name, grid, block, args, smem):
        self.log, self.name, self.grid, self.block, self.args, self.smem = log, name, grid, block, args, smem

    def submit(self):
        a = self.args[-1]  # (the wgmma kernel's tensor maps come first)
        self.log.append((self.name, self.grid, self.block, self.smem, a.q, a.dq, a.dq_acc))


class FakeKernel:
    def __init__(self, log, key):
        self.log, self.key = log, key

    def prepare(self, grid, block, args, *, stream=None, smem=0, **kw):
        PREPARED.append(self.key[-1])
        return FakeLaunch(self.log, self.key[-1], grid, block, args, smem)


MMA = AttentionBwdOptions(kernel="mma")  # the cases below check the mma kernel's launches


@pytest.fixture
def fake(monkeypatch):
    log = []
    ptrs = iter(range(1 << 40, 1 << 41, 1 << 28))
    monkeypatch.setattr(K, "get", lambda dt, d, br, name: FakeKernel(log, (dt, d, br, name)))
    monkeypatch.setattr(OP, "on_device", lambda dev=None: contextlib.nullcontext((1, 0)))
    monkeypatch.setattr(OP, "require_gemm_device", lambda what, device: None)
    monkeypatch.setattr(OP, "current_context", lambda: 1)
    monkeypatch.setattr(BASE, "is_capturing", lambda stream: False)
    monkeypatch.setattr(TM, "encode_tiled", lambda ptr, dtype, dims, strides, box, **kw: (
        MAPS.append(dict(ptr=ptr, dims=tuple(dims), strides=tuple(strides), box=tuple(box)))
        or int(ptr).to_bytes(8, "little") + bytes(120)))
    monkeypatch.setattr(TM, "_codec", False)
    MAPS.clear()
    monkeypatch.setattr(DeviceArray, "empty",
                        staticmethod(lambda shape, dtype, device=None: DeviceArray(next(ptrs), shape, dtype, None, 0)))
    BASE._device_states.clear()
    PREPARED.clear()
    return log, ptrs


def _arrays(ptrs, B=2, Sq=77, Sk=100, Hq=8, Hkv=2, D=64, dt="bfloat16", layout="bshd"):
    def arr(S, H, d=D, dtype=dt):
        shape = (B, S, H, d) if layout == "bshd" else (B, H, S, d)
        return DeviceArray(next(ptrs), shape, dtype, None, 0)
    q, k, v, o, do = arr(Sq, Hq), arr(Sk, Hkv), arr(Sk, Hkv), arr(Sq, Hq), arr(Sq, Hq)
    lse = DeviceArray(next(ptrs), (B, Hq, Sq), "float32", None, 0)
    return q, k, v, o, lse, do


def test_launches_and_args(fake):
    log, ptrs = fake
    q, k, v, o, lse, do = _arrays(ptrs)
    dq, dk, dv = attention_backward(q, k, v, o, lse, do, causal=True, options=MMA)
    assert [n for n, *_ in log] == ["mk_attn_bwd_pre", "mk_attn_bwd_main", "mk_attn_bwd_convert"]
    _, grid, block, smem, qp, dqp, acc = log[1]
    assert grid == (1, 2, 2) and block == 256 and smem == K.main_smem(64, 64)
    assert qp == q.ptr and dqp == dq.ptr and acc
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    plan = OP.last_plan(0)
    assert plan.kernels[-1] == "mk_attn_bwd_convert" and not plan.deterministic
    assert log[0][1] == math.ceil(2 * 8 * 77 / 8)


def test_bhsd_strides_and_scale(fake):
    log, ptrs = fake
    q, k, v, o, lse, do = _arrays(ptrs, layout="bhsd", D=128, Sq=5, Sk=5, Hq=4, Hkv=4)
    captured = {}
    orig = FakeKernel.prepare

    def prep(self, grid, block, args, **kw):
        captured[self.key[-1]] = args[0]
        return orig(self, grid, block, args, **kw)
    FakeKernel.prepare = prep
    try:
        attention_backward(q, k, v, o, lse, do, layout="bhsd", softmax_scale=0.5, deterministic=True, options=MMA)
    finally:
        FakeKernel.prepare = orig
    a = captured["mk_attn_bwd_main"]
    assert tuple(a.q_s) == (4 * 5 * 128, 128, 5 * 128)  # (batch, seq, head) of [B, H, S, D]
    assert a.scale == 0.5 and abs(a.scale_log2 - 0.5 / math.log(2)) < 1e-6 and a.dq_acc is None
    assert [n for n, *_ in log] == ["mk_attn_bwd_pre", "mk_attn_bwd_main", "mk_attn_bwd_dq"]
    assert log[2][1] == (1, 4, 2) and log[2][3] == K.dq_smem(128)


def test_key_reuse_and_repoint(fake):
    log, ptrs = fake
    q, k, v, o, lse, do = _arrays(ptrs)
    attention_backward(q, k, v, o, lse, do, options=MMA)
    q2, k2, v2, o2, lse2, do2 = _arrays(ptrs)
    dq = DeviceArray(next(ptrs), q.shape, "bfloat16", None, 0)
    attention_backward(q2, k2, v2, o2, lse2, do2, dq=dq, options=MMA)
    assert PREPARED.count("mk_attn_bwd_main") == 1  # one layout: bound once, re-pointed
    main = [e for e in log if e[0] == "mk_attn_bwd_main"]
    assert main[1][4] == q2.ptr and main[1][5] == dq.ptr


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_wgmma_launches_maps_and_repoint(fake, layout):
    log, ptrs = fake
    opts = AttentionBwdOptions(kernel="wgmma")
    q, k, v, o, lse, do = _arrays(ptrs, Sq=77, Sk=300, Hq=8, Hkv=2, D=128, layout=layout)
    dq, dk, dv = attention_backward(q, k, v, o, lse, do, causal=True, layout=layout, options=opts)
    assert [n for n, *_ in log] == ["mk_attn_bwd_pre", K.WGMMA_KERNEL, "mk_attn_bwd_convert"]
    _, grid, block, smem, qp, dqp, acc = log[1]
    assert grid == (3, 2, 2) and block == K.WGMMA_THREADS and smem == K.wgmma_smem(128) and acc
    assert [(m["ptr"], m["box"]) for m in MAPS] == [(q.ptr, (64, 64, 1, 1)), (do.ptr, (64, 64, 1, 1)),
                                                    (k.ptr, (64, 128, 1, 1)), (v.ptr, (64, 128, 1, 1))]
    # dims {D, S, H, B}, byte strides of S, H, B in the layout
    sq = (8 * 128, 128, 77 * 8 * 128) if layout == "bshd" else (128, 77 * 128, 8 * 77 * 128)
    assert MAPS[0]["dims"] == (128, 77, 8, 2) and MAPS[0]["strides"] == tuple(2 * x for x in sq)
    assert MAPS[2]["dims"] == (128, 300, 2, 2)
    plan = OP.last_plan(0)
    assert plan.block_q == K.WGMMA_BLOCK_Q and not plan.deterministic
    # same layout: bound once, the maps re-pointed at the new arrays
    q2, k2, v2, o2, lse2, do2 = _arrays(ptrs, Sq=77, Sk=300, Hq=8, Hkv=2, D=128, layout=layout)
    attention_backward(q2, k2, v2, o2, lse2, do2, causal=True, layout=layout, options=opts)
    assert PREPARED.count(K.WGMMA_KERNEL) == 1 and len(MAPS) == 8  # (no codec: re-encoded at the new address)
    assert [m["ptr"] for m in MAPS[4:]] == [q2.ptr, k2.ptr, v2.ptr, do2.ptr]
    assert log[-2][4] == q2.ptr


def test_wgmma_deterministic_and_options(fake):
    log, ptrs = fake
    q, k, v, o, lse, do = _arrays(ptrs, D=64)
    attention_backward(q, k, v, o, lse, do, deterministic=True, options=AttentionBwdOptions(kernel="wgmma"))
    assert [n for n, *_ in log] == ["mk_attn_bwd_pre", K.WGMMA_KERNEL, "mk_attn_bwd_dq"]
    assert log[1][6] is None  # no accumulator: the wgmma kernel skips dQ
    plan = OP.last_plan(0)
    assert plan.deterministic and plan.grid == (1, 2, 2)
    with pytest.raises(ValueError, match="kernel"):
        AttentionBwdOptions(kernel="tma").checked()
    with pytest.raises(ValueError, match="block_q"):
        AttentionBwdOptions(kernel="wgmma", block_q=32).checked()


def test_empty_sequences(fake):
    log, ptrs = fake
    q, k, v, o, lse, do = _arrays(ptrs, Sk=0)
    attention_backward(q, k, v, o, lse, do, options=MMA)
    assert [n for n, *_ in log] == ["mk_attn_bwd_pre", "mk_attn_bwd_convert"]  # dq = 0, no main kernel
    log.clear()
    q, k, v, o, lse, do = _arrays(ptrs, Sq=0)
    attention_backward(q, k, v, o, lse, do, options=MMA)
    assert [n for n, *_ in log] == ["mk_attn_bwd_main"]  # writes dk = dv = 0


def _bad_cases():
    def replace(i, fn):
        def make(ptrs):
            arrs = list(_arrays(ptrs))
            arrs[i] = fn(arrs[i], ptrs)
            return arrs, {}
        return make

    def kw(**kws):
        return lambda ptrs: (list(_arrays(ptrs)), kws)

    def shape(*s, dt=None):
        return lambda x, ptrs: DeviceArray(next(ptrs), s, dt or x.dtype.name, None, 0)

    return {
        "d96": (lambda ptrs: (list(_arrays(ptrs, D=96)), {}), ValueError, "head dim 96"),
        "fp32": (lambda ptrs: (list(_arrays(ptrs, dt="float32")), {}), TypeError, "bfloat16 or float16"),
        "mixed": (replace(1, lambda x, p: DeviceArray(next(p), x.shape, "float16", None, 0)), TypeError, "k is"),
        "gqa": (lambda ptrs: (list(_arrays(ptrs, Hq=6, Hkv=4)), {}), ValueError, "multiple"),
        "lse_dtype": (replace(4, shape(2, 8, 77, dt="bfloat16")), TypeError, "lse must be float32"),
        "lse_shape": (replace(4, shape(2, 8, 78)), ValueError, "lse has shape"),
        "v_shape": (replace(2, shape(2, 99, 2, 64)), ValueError, "v has shape"),
        "out_shape": (replace(3, shape(2, 77, 8, 128)), ValueError, "out has shape"),
        "3d": (replace(0, shape(2, 77, 512)), ValueError, "4-D"),
        "misaligned": (replace(0, lambda x, p: DeviceArray(next(p) + 2, x.shape, x.dtype.name, None, 0)),
                       ValueError, "16-byte"),
        "inner_stride": (replace(0, lambda x, p: DeviceArray(next(p), x.shape, x.dtype.name,
                                                             (77 * 8 * 128, 8 * 128, 128, 2), 0)),
                         ValueError, "contiguous head dim"),
        "odd_stride": (replace(1, lambda x, p: DeviceArray(next(p), x.shape, x.dtype.name,
                                                           (100 * 2 * 68, 2 * 68, 68, 1), 0)),
                       ValueError, "multiples of 8"),
        "layout": (kw(layout="sbhd"), ValueError, "layout"),
        "scale": (kw(softmax_scale=float("nan")), ValueError, "finite"),
        "options": (kw(options="fast"), TypeError, "AttentionBwdOptions"),
        "block_q": (kw(options=AttentionBwdOptions(block_q=48)), ValueError, "block_q"),
        "overlap": (lambda ptrs: (lambda a: (a, {"dq": a[0]}))(list(_arrays(ptrs))), ValueError, "overlaps"),
        "readonly": (lambda ptrs: (lambda a: (a, {"dk": DeviceArray(next(ptrs), a[1].shape, "bfloat16", None, 0,
                                                                    readonly=True)}))(list(_arrays(ptrs))),
                     ValueError, "read-only"),
        "device": (replace(2, lambda x, p: DeviceArray(next(p), x.shape, x.dtype.name, None, 1)), ValueError,
                   "cuda:1"),
    }


BAD = _bad_cases()


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_raises_before_launch(fake, case):
    log, ptrs = fake
    make, exc, msg = BAD[case]
    arrs, kws = make(ptrs)
    with pytest.raises(exc, match=msg):
        attention_backward(*arrs, **kws)
    assert log == []


def test_options_checked():
    assert AttentionBwdOptions().checked().deterministic is False
    with pytest.raises(TypeError, match="deterministic"):
        AttentionBwdOptions(deterministic=1).checked()
    assert hash(AttentionBwdOptions(True, 32)) == hash(AttentionBwdOptions(True, 32))


def test_auto_kernel_is_wgmma_unless_block_q(fake):
    """kernel="auto" (the default): the wgmma main kernel; with block_q (an mma specialization) the mma one."""
    log, ptrs = fake
    assert AttentionBwdOptions().main_kernel() == "wgmma"
    assert AttentionBwdOptions(block_q=32).checked().main_kernel() == "mma"
    assert AttentionBwdOptions(kernel="mma").main_kernel() == "mma"
    q, k, v, o, lse, do = _arrays(ptrs)
    attention_backward(q, k, v, o, lse, do)
    assert K.WGMMA_KERNEL in PREPARED and "mk_attn_bwd_main" not in PREPARED
    PREPARED.clear()
    attention_backward(q, k, v, o, lse, do, options=AttentionBwdOptions(block_q=32))
    assert "mk_attn_bwd_main" in PREPARED and K.WGMMA_KERNEL not in PREPARED
