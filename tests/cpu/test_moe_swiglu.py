"""SwiGLU in the gate/up grouped GEMM's epilogue on the CPU (docs/moe.md, "SwiGLU epilogue"): every
gemm_swiglu.cu specialization compiles for sm_90a clean; the paired weight view and the accumulator
pairing, emulated in numpy, give silu(gate) * up of the right columns (also over the fused dispatch + GEMM
kernel's grouped tiles into act); grouped_gemm_swiglu's and moe_dispatch_gemm(swiglu=True)'s plans against
the GEMM tests' driver fakes; the layer's choice of path.  (The fused SwiGLU variant's compile check is
test_moe_host.py's test_fused_compiles_clean.)"""
from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest

import _compile_cache
from mkernel.core import compiler as CP
from mkernel.dist.opstate import OpState
from mkernel.ops import gemm as G
from mkernel.ops.gemm import swiglu as SW
from mkernel.ops.moe import MoeOptions, fused as FU
from mkernel.ops.moe import gemm_bound as GB
from mkernel.ops.moe import layout as ML
from mkernel.ops.moe.layer import swiglu_path
from mkernel.ops.moe.op import MoeRouting

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
    _compile_cache.assert_gemm_spec_clean(source, defines, compile_cache, monkeypatch, SW.KERNEL, ARCH)


def _fragment_columns(n: int) -> np.ndarray:
    """[thread, register] -> accumulator column of an m64nNk16 fragment (mk_wgmma.cuh): register i of lane l
    is column 8 * (i // 4) + 2 * (l % 4) + i % 2."""
    lane = np.arange(128)[:, None] % 32
    i = np.arange(n // 2)[None, :]
    return 8 * (i // 4) + 2 * (lane % 4) + i % 2


def _paired_tile(c, F: int, col0: int):
    """Of N tile ``col0`` of config ``c`` (B the paired gate/up view of a [2F, K] weight), per warpgroup part:
    ``(gate, up, cols)``, each [thread, act register] -- the W rows whose products the register's gate and up
    accumulators hold, and the act column MkEpilogueSwiGLU's store writes it to."""
    P, WN = SW.pair_width(c), c.tile_n("nk") // c.wg_n
    J = P // 8
    parts = []
    for q in range(c.wg_n):  # the warpgroup part: mk_gemm_load_b's load q, MkGateUpB
        chunk = col0 // WN + q
        # box {64, P, 1, 2, 1} at (k0, 0, chunk, 0, g) of dims {K, P, F/P, 2, G}: smem row = half * P + r
        rows = np.array([half * F + chunk * P + r for half in range(2) for r in range(P)])
        frag = rows[_fragment_columns(WN)]  # [thread, register] -> W row (accumulator column j = rows[j])
        gate = frag[:, [4 * j + i for j in range(J) for i in range(4)]]
        up = frag[:, [4 * (j + J) + i for j in range(J) for i in range(4)]]
        a_col0 = (col0 + WN * q) // 2  # MkEpilogueSwiGLU::act_tile of the part's tile
        parts.append((gate, up, a_col0 + _fragment_columns(P)))
    return parts


def _silu_mul(g, u):
    return g / (1 + np.exp(-g)) * u


@pytest.mark.parametrize("cfg", sorted(set(SW.SWIGLU_CONFIGS) | {29, 32, 53}))
def test_view_and_fragment_pair_gate_with_up(cfg):
    """The 5-D view's box lands chunk n's gate rows then its up rows in shared memory (rows = accumulator
    columns); the epilogue's registers 4j + i and 4(j + P/8) + i of one thread then hold gate f and up F + f,
    and its act register 4j + i is act column col0 / 2 + (the PAIR-wide fragment's column) = f."""
    c = G.CONFIGS[cfg]
    P, BN = SW.pair_width(c), c.tile_n("nk")
    F = 3 * P * c.wg_n
    rng = np.random.default_rng(cfg)
    W = rng.standard_normal((2 * F, 5))  # one expert, K = 5
    h = W @ rng.standard_normal(5)
    act = np.zeros(F)
    for tile_n in range(2 * F // BN):
        for gate, up, cols in _paired_tile(c, F, tile_n * BN):
            act[cols.ravel()] = _silu_mul(h[gate], h[up]).ravel()
    np.testing.assert_allclose(act, _silu_mul(h[:F], h[F:]), rtol=1e-12)


@pytest.mark.parametrize("F", [64, 96, 112, 192, 256, 320])
def test_fused_swiglu_tiles_write_act_once(F):
    """The fused kernel's SwiGLU variant (moe_gemm.cu MK_MOE_SWIGLU, the config fused_swiglu_config picks):
    MkGroupedScheduler's tiles over (expert, row block, N = 2F tile), rows clamped to r_cap, each stored
    through the paired view and act_tile at act + row * ldc (ldc = F: MoeGemmArgs), write every act element
    of rows [0, o[El]) exactly once with silu(gate) * up of its expert, and nothing past o[El]."""
    cfg = ML.fused_swiglu_config(F, MoeOptions())
    c = G.CONFIGS[cfg]
    BM, BN, N, K = c.bm, c.tile_n("nk"), 2 * F, 3
    assert N % BN == 0  # (F a multiple of PAIR = BN / 2: no tile is clipped along N)
    rng = np.random.default_rng(F)
    El, r_cap = 3, 700
    sizes = [int(BM * 1.5), 0, 2 * BM + 5]
    o = np.minimum(np.concatenate([[0], np.cumsum(sizes)]), r_cap)
    xr = rng.standard_normal((r_cap, K))
    W = rng.standard_normal((El, N, K))
    act = np.full(r_cap * F, np.nan)  # flat, as the kernel addresses it
    writes = np.zeros(r_cap * F, int)
    for g in range(El):
        for tm in range(-(-int(o[g + 1] - o[g]) // BM)):
            row0 = int(o[g]) + tm * BM
            rows = min(BM, int(o[g + 1]) - row0)
            h = xr[row0:row0 + rows] @ W[g].T  # [rows, 2F]
            for tn in range(N // BN):
                for gate, up, cols in _paired_tile(c, F, tn * BN):
                    assert cols.max() < F
                    for r in range(rows):  # (MkEpilogueStore: rows < t.rows, every thread's two rows alike)
                        idx = (row0 + r) * F + cols.ravel()
                        act[idx] = _silu_mul(h[r, gate], h[r, up]).ravel()
                        writes[idx] += 1
    R = int(o[El])
    assert (writes[:R * F] == 1).all() and (writes[R * F:] == 0).all()
    act = act.reshape(r_cap, F)
    for g in range(El):
        h = xr[o[g]:o[g + 1]] @ W[g].T
        np.testing.assert_allclose(act[o[g]:o[g + 1]], _silu_mul(h[:, :F], h[:, F:]), rtol=1e-12)


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
    with pytest.raises(ValueError):
        MoeOptions(swiglu_epilogue=1).checked()
    assert on.checked() is on


def test_fused_layer_path_choice():
    """fused=True: the fused kernel's SwiGLU variant where one of its configs pairs F (the pair widths of
    FUSED_CONFIGS: 64, 96, 112, 128), else the separate kernel -- also where only grouped_gemm_swiglu's
    configs would (72: config 24, 160: config 42) or a forced gemm_config does not pair F."""
    fused = MoeOptions(fused=True)
    for F in (2048, 1408, 96, 112, 64, 320):
        assert swiglu_path(F, fused) == "epilogue", F
    for F in (100, 72, 160, 32):
        assert swiglu_path(F, fused) == "kernel", F
    assert swiglu_path(72, MoeOptions()) == "epilogue"  # (unfused: config 24)
    assert swiglu_path(2048, MoeOptions(fused=True, swiglu_epilogue=False)) == "kernel"
    assert swiglu_path(96, MoeOptions(fused=True, gemm_config=2)) == "kernel"
    assert swiglu_path(96, MoeOptions(fused=True, gemm_config=4)) == "epilogue"


def test_fused_swiglu_config():
    """The h kernel's choice where its pair width divides F, else the largest tile that pairs F; a forced
    gemm_config only where it pairs F; None where no fused config does."""
    o = MoeOptions()
    assert [ML.fused_swiglu_config(F, o) for F in (2048, 256, 128, 64, 96, 192, 112, 224, 320)] == \
        [3, 3, 2, 2, 4, 4, 5, 5, 2]
    assert [ML.fused_swiglu_config(F, o) for F in (0, 32, 72, 100, 160)] == [None] * 5
    assert ML.fused_swiglu_config(2048, MoeOptions(gemm_config=1)) == 1
    assert ML.fused_swiglu_config(2048, MoeOptions(gemm_config=4)) is None
    for F in range(8, 4096, 8):
        c = ML.fused_swiglu_config(F, o)
        assert c is None or (c in ML.FUSED_CONFIGS and F % G.pair_width(c) == 0)


def test_fused_swiglu_define_selects_the_variant():
    """MK_MOE_SWIGLU=1 compiles another kernel (the define is read); the h kernel's defines lack it."""
    h, sw = FU.fused_defines("bfloat16", 2), FU.fused_defines("bfloat16", 2, swiglu=True)
    assert "MK_MOE_SWIGLU" not in h and sw == {**h, "MK_MOE_SWIGLU": 1}
    assert CP.compile_module(ML.FUSED_SOURCE, h, arch=ARCH).cubin != CP.compile_module(ML.FUSED_SOURCE, sw,
                                                                                       arch=ARCH).cubin


# ---- moe_dispatch_gemm(swiglu=True) against driver fakes -------------------------------------------
class _FusedKernel:
    """mk_moe_dispatch_gemm of one specialization: prepared launches log their defines and arguments."""

    def __init__(self, log, defines):
        self.log, self.defines = log, defines

    def max_active_blocks_per_sm(self, threads, smem):
        return 1

    def prepare(self, grid, block, args, **kw):
        log, defines = self.log, self.defines

        class Launch:
            def submit(self):
                log.append(dict(defines=defines, grid=grid, block=block, args=list(args), **kw))
        return Launch()


@pytest.fixture
def fused_env(fake, monkeypatch):
    """(launches of the fused kernel, tensor maps, empty, a one-rank context) with the fused op's device
    pieces faked: the kernel, the GEMM-device check, the arrival counters' memset."""
    _, maps, empty = fake
    launches = []
    monkeypatch.setattr(FU, "kernel", lambda src, defines, name: _FusedKernel(launches, defines))
    monkeypatch.setattr(FU, "require_gemm_device", lambda what, dev: None)
    monkeypatch.setattr(GB, "check", lambda r: None)
    monkeypatch.setattr(GB.cu, "cuMemsetD32Async", lambda *a: None)
    states = {}
    ctx = types.SimpleNamespace(
        size=1, local_size=1, num_nodes=1, device=0, resident_sms=132, workspace_generation=0, world=None, rank=0,
        check=lambda: None, op_state=lambda name: states.setdefault(name, OpState(name)),
        agree=lambda what, sig, world: 1, comm_args=lambda name, digest: ctypes.c_uint64(0),
        workspace=lambda key, nbytes, stream, what: types.SimpleNamespace(ptr=1 << 45, peer_table=1 << 46))
    return launches, maps, empty, ctx


def test_dispatch_gemm_swiglu_plan(fused_env):
    """swiglu=True: the MK_MOE_SWIGLU specialization of fused_swiglu_config's config, B the 5-D gate/up
    view, MoeGemmArgs with N = 2F (the scheduler's) and ldc = F (act's), out [recv_rows, F]; the plan says
    "epilogue".  swiglu=False keeps the h kernel's defines, B map and ldc = 2F."""
    launches, maps, empty, ctx = fused_env
    T, H, F, k, E = 64, 256, 192, 2, 4
    R = MoeRouting(ctx, T, k, E)
    x, w = empty((T, H), "bfloat16"), empty((E, 2 * F, H), "bfloat16")
    act, xr = FU.moe_dispatch_gemm(ctx, x, R, w, stream=0, swiglu=True)
    assert act.shape == (R.recv_rows, F) and xr.shape == (R.recv_rows, H)
    (l,) = launches
    cfg = ML.fused_swiglu_config(F, MoeOptions())
    c = G.CONFIGS[cfg]
    assert l["defines"] == FU.fused_defines("bfloat16", cfg, swiglu=True) and l["defines"]["MK_MOE_SWIGLU"] == 1
    assert l["block"] == c.threads and l["smem"] == c.smem and l["cooperative"]
    P, row = G.pair_width(cfg), H * 2
    mb = maps[-1]
    assert mb == dict(ptr=w.ptr, dtype="bfloat16", dims=(H, P, F // P, 2, E), strides=(row, P * row, F * row,
                      2 * F * row), box=(64, P, 1, 2, 1))
    a = l["args"][5]
    assert (a.N, a.K, a.ldc, a.c, a.c_vec_ok) == (2 * F, H, F, act.ptr, 1)
    assert ctx.op_state("moe_dispatch_gemm").last_plan.swiglu == "epilogue"
    h, _ = FU.moe_dispatch_gemm(ctx, x, R, w, stream=0)
    l2 = launches[-1]
    assert "MK_MOE_SWIGLU" not in l2["defines"] and l2["defines"] == FU.fused_defines("bfloat16", ML.fused_config(
        2 * F, MoeOptions()))
    assert h.shape == (R.recv_rows, 2 * F) and (l2["args"][5].ldc, l2["args"][5].N) == (2 * F, 2 * F)
    assert maps[-1]["dims"] == (H, 2 * F, E) and ctx.op_state("moe_dispatch_gemm").last_plan.swiglu == ""


@pytest.mark.parametrize("F,opts,out_cols,swiglu", [
    (100, MoeOptions(), None, True),  # no fused config pairs F = 100
    (72, MoeOptions(), None, True),  # (grouped_gemm_swiglu's config 24 would; the fused kernel's configs do not)
    (96, MoeOptions(gemm_config=2), None, True),  # the forced config's pair width 64 does not divide 96
    (128, MoeOptions(), 256, True),  # out sized for h, not act
    (128, MoeOptions(), None, 1),  # not a bool
])
def test_dispatch_gemm_swiglu_bad_input_raises_before_launch(fused_env, F, opts, out_cols, swiglu):
    launches, maps, empty, ctx = fused_env
    T, H, k, E = 16, 128, 2, 2
    R = MoeRouting(ctx, T, k, E)
    out = None if out_cols is None else empty((R.recv_rows, out_cols), "bfloat16")
    with pytest.raises((TypeError, ValueError)):
        FU.moe_dispatch_gemm(ctx, empty((T, H), "bfloat16"), R, empty((E, 2 * F, H), "bfloat16"), out, stream=0,
                             options=opts, swiglu=swiglu)
    assert launches == []
