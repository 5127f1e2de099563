"""SwiGLU in the gate/up grouped GEMM's epilogue on the CPU (docs/moe.md, "SwiGLU epilogue"): every
gemm_swiglu.cu specialization compiles for sm_90a clean; the paired weight view and the accumulator
pairing, emulated in numpy, give silu(gate) * up of the right columns; grouped_gemm_swiglu's plan against
the GEMM tests' driver fakes; the layer's choice of path."""
from __future__ import annotations

import numpy as np
import pytest

import _compile_cache
from mkernel.core import compiler as CP
from mkernel.ops import gemm as G
from mkernel.ops.gemm import swiglu as SW
from mkernel.ops.moe import MoeOptions
from mkernel.ops.moe.layer import swiglu_path

from test_gemm_compile import _args, fake, map_ptr  # noqa: F401 (the driver fakes of the GEMM plans)

ARCH = "sm_90a"
SPECS = [(s, d) for s, d in CP.registered_specializations() if s == SW.SOURCE]


def test_specializations_registered():
    want = {(G.DTYPE_CODES[dt], G.DTYPE_CODES[dt], c) for dt in G.IN_DTYPES for c in SW.SWIGLU_CONFIGS}
    assert {(d["MK_GEMM_IN"], d["MK_GEMM_OUT"], d["MK_GEMM_CONFIG"]) for _, d in SPECS} == want


compile_cache = _compile_cache.module_fixture("test_compiles_clean", ARCH)


@pytest.mark.parametrize("source,defines", SPECS, ids=[f"in{d['MK_GEMM_IN']}-cfg{d['MK_GEMM_CONFIG']}" for _, d in SPECS])
def test_compiles_clean(source, defines, compile_cache, monkeypatch):
    """mk_grouped_gemm_swiglu: no spills, no stack, no ptxas warnings, registers within the block."""
    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(compile_cache))
    mod = CP.compile_module(source, defines, arch=ARCH)
    threads = G.CONFIGS[defines["MK_GEMM_CONFIG"]].threads
    _compile_cache.assert_clean(mod, (SW.KERNEL,), lambda fn: threads)


def _fragment_columns(n: int) -> np.ndarray:
    """[thread, register] -> accumulator column of an m64nNk16 fragment (mk_wgmma.cuh): register i of lane l
    is column 8 * (i // 4) + 2 * (l % 4) + i % 2."""
    lane = np.arange(128)[:, None] % 32
    i = np.arange(n // 2)[None, :]
    return 8 * (i // 4) + 2 * (lane % 4) + i % 2


@pytest.mark.parametrize("cfg", sorted(set(SW.SWIGLU_CONFIGS) | {29, 32, 53}))
def test_view_and_fragment_pair_gate_with_up(cfg):
    """The 5-D view's box lands chunk n's gate rows then its up rows in shared memory (rows = accumulator
    columns); the epilogue's registers 4j + i and 4(j + P/8) + i of one thread then hold gate f and up F + f,
    and its act register 4j + i is act column col0 / 2 + (the PAIR-wide fragment's column) = f."""
    c = G.CONFIGS[cfg]
    P, WN, BN = SW.pair_width(c), c.tile_n("nk") // c.wg_n, c.tile_n("nk")
    F = 3 * P * c.wg_n
    rng = np.random.default_rng(cfg)
    W = rng.standard_normal((2 * F, 5))  # one expert, K = 5
    x = rng.standard_normal(5)
    h = W @ x
    act = np.zeros(F)
    for tile_n in range(2 * F // BN):
        col0 = tile_n * BN
        for q in range(c.wg_n):  # the warpgroup part: mk_gemm_load_b's load q, MkGateUpB
            chunk = col0 // WN + q
            # box {64, P, 1, 2, 1} at (k0, 0, chunk, 0, g) of dims {K, P, F/P, 2, G}: smem row = half * P + r
            rows = np.array([half * F + chunk * P + r for half in range(2) for r in range(P)])
            acc_cols = h[rows]  # accumulator column j of part q = W row rows[j]
            frag = acc_cols[_fragment_columns(WN)]  # [thread, register]
            J = P // 8
            gate = frag[:, [4 * j + i for j in range(J) for i in range(4)]]
            up = frag[:, [4 * (j + J) + i for j in range(J) for i in range(4)]]
            out = gate / (1 + np.exp(-gate)) * up
            a_col0 = (col0 + WN * q) // 2  # MkEpilogueSwiGLU::act_tile of the part's tile
            cols = a_col0 + _fragment_columns(P)
            act[cols.ravel()] = out.ravel()
    want = h[:F] / (1 + np.exp(-h[:F])) * h[F:]
    np.testing.assert_allclose(act, want, rtol=1e-12)


def test_pair_widths_and_candidates():
    assert {c: SW.pair_width(c) for c in (1, 2, 3, 4, 5, 24, 42, 29, 32)} == {
        1: 64, 2: 64, 3: 128, 4: 96, 5: 112, 24: 72, 42: 160, 29: 32, 32: 24}
    assert SW.swiglu_candidates(14336) == (1, 2, 3, 5, 18)  # 14336 = 64 * 224 = 112 * 128
    assert SW.swiglu_candidates(96) == (4, 40) and SW.swiglu_candidates(100) == () and SW.swiglu_candidates(0) == ()


def test_grouped_gemm_swiglu_plan(fake):
    """The kernel, its 5-D gate/up map, args N = 2F with act's ldc, act's C map, a config whose pair width
    divides F; host and device offsets."""
    launches, maps, empty = fake
    T, H, F, E = 1000, 256, 192, 3
    a, w = empty((T, H), "bfloat16"), empty((E, 2 * F, H), "bfloat16")
    out = G.grouped_gemm_swiglu(a, w, [0, 300, 300, 1000])
    assert out.shape == (T, F) and out.dtype.name == "bfloat16"
    (l,) = launches
    cfg = G.CONFIGS[l["config"]]
    assert l["kernel"] == SW.KERNEL and l["config"] in SW.swiglu_candidates(F) and l["block"] == cfg.threads
    P = SW.pair_width(cfg)
    ma, mb, mc = maps
    row = H * 2
    assert mb == dict(ptr=w.ptr, dtype="bfloat16", dims=(H, P, F // P, 2, E),
                      strides=(row, P * row, F * row, 2 * F * row), box=(64, P, 1, 2, 1))
    assert mc["ptr"] == out.ptr and mc["dims"] == (F, T) and mc["strides"] == (F * 2,)
    x = _args(l)
    assert (x.M, x.N, x.K, x.ldc, x.num_groups, x.c) == (T, 2 * F, H, F, E, out.ptr)
    assert G.last_plan("grouped_gemm_swiglu").config == l["config"]
    # device offsets, a given output, a forced config
    offs = empty((E + 1,), "int32")
    act = empty((T, F), "bfloat16")
    G.grouped_gemm_swiglu(a, w, offs, act, config=4)
    l2 = launches[-1]
    assert l2["config"] == 4 and _args(l2).group_offsets == offs.ptr and _args(l2).offsets_i32 == 1
    assert maps[-2]["box"] == (64, 96, 1, 2, 1) and map_ptr(l2["args"][2]) == act.ptr


@pytest.mark.parametrize("bad", [
    lambda e: G.grouped_gemm_swiglu(e((8, 64), "bfloat16"), e((2, 200, 64), "bfloat16"), [0, 4, 8]),  # F = 100
    lambda e: G.grouped_gemm_swiglu(e((8, 64), "bfloat16"), e((2, 256, 64), "bfloat16"), [0, 4, 8], config=4),
    lambda e: G.grouped_gemm_swiglu(e((8, 64), "bfloat16"), e((2, 256, 64), "bfloat16"), [0, 4, 8],
                                    e((8, 128), "float32")),
    lambda e: G.grouped_gemm_swiglu(e((8, 64), "bfloat16"), e((2, 256, 64), "bfloat16"), [0, 4, 8],
                                    e((8, 256), "bfloat16")),
])
def test_bad_input_raises_before_launch(fake, bad):
    launches, maps, empty = fake
    with pytest.raises((TypeError, ValueError)):
        bad(empty)
    assert launches == []


def test_unaligned_weight_is_staged(fake):
    """H = 36 (72-byte rows): W staged into a dense copy; the view's strides are the copy's."""
    launches, maps, empty = fake
    F, H = 128, 36
    a, w = empty((50, H), "float16"), empty((2, 2 * F, H), "float16")
    G.grouped_gemm_swiglu(a, w, [0, 20, 50])
    assert [l["kernel"] for l in launches] == ["mk_pad_copy_u16", "mk_pad_copy_u16", SW.KERNEL]
    mb = maps[1]
    row = 48 * 2  # cols padded to 48 elements
    P = mb["box"][1]
    assert mb["dims"] == (H, P, F // P, 2, 2) and mb["strides"] == (row, P * row, F * row, 2 * F * row)


def test_layer_path_choice():
    on = MoeOptions(swiglu_epilogue=True)
    assert swiglu_path(2048, on) == "epilogue" and swiglu_path(100, on) == "kernel"
    assert swiglu_path(2048, MoeOptions()) == "epilogue" and swiglu_path(2048, MoeOptions(swiglu_epilogue=False)) == "kernel"
    assert swiglu_path(2048, MoeOptions(swiglu_epilogue=True, fused=True)) == "kernel"  # (fused: h from its kernel)
    with pytest.raises(ValueError):
        MoeOptions(swiglu_epilogue=1).checked()
    assert on.checked() is on
