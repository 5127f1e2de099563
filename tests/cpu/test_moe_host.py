"""MoE on the CPU: every moe.cu specialization compiles for sm_90a without spills; the options, the
workspace layouts and the float64 reference of the routing layout (docs/moe.md) -- no GPU needed."""
from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

import _compile_cache

from mkernel.core import compiler as CP
from mkernel.dist.signals import workspace_control
from mkernel.ops.moe import MoeOptions
from mkernel.ops.moe import layout as ML
from mkernel.ops.moe import reference as ref

ARCH = "sm_90a"
SPECS = [(s, d) for s, d in CP.registered_specializations() if s == ML.SOURCE]
KERNELS = ("mk_moe_route_tiles", "mk_moe_route_exchange", "mk_moe_route_slots", "mk_moe_dispatch", "mk_moe_combine",
           "mk_moe_swiglu", "mk_moe_dispatch_ll")
FUSED_SPECS = [(s, d) for s, d in CP.registered_specializations() if s == ML.FUSED_SOURCE]
LIMITS = {"mk_moe_route_exchange": ML.EXCHANGE_THREADS, "mk_moe_route_tiles": ML.TILE}


def test_specializations_registered():
    assert {(d["MK_DTYPE"], d["MK_OUT_DTYPE"], d["MK_LOGIT_DTYPE"]) for _, d in SPECS} == set(ML.SPECIALIZATIONS)


@pytest.mark.parametrize("source,defines", SPECS, ids=[
    f"d{d['MK_DTYPE']}-o{d['MK_OUT_DTYPE']}-l{d['MK_LOGIT_DTYPE']}" for _, d in SPECS])
def test_compiles_clean(source, defines):
    mod = CP.compile_module(source, defines, arch=ARCH)
    _compile_cache.assert_clean(mod, KERNELS, lambda fn: LIMITS.get(fn, ML.THREADS))


def test_structs_match_the_kernel():
    """The kernels take MoeLayout, MoeShape and MkComm by value from the host's ctypes structs: the device
    compiler checks every size, alignment and field offset against the host's (static_assert in moe.cu); a
    figure off by one fails the compile (so the check is live)."""
    from mkernel.dist.signals import MkComm

    assert ctypes.sizeof(ML.MoeLayout) == 56 and ctypes.sizeof(ML.MoeShape) == 32
    assert [f[0] for f in ML.MoeLayout._fields_] == ["consumed_off", "flags_off", "counts_off", "scratch_off",
                                                     "stage_off", "row_bytes", "flag_stride", "pad"]
    assert [f[0] for f in ML.MoeShape._fields_] == ["T", "H", "k", "E", "El", "capacity", "r_cap", "softmax_all"]
    want = _compile_cache.struct_figures(ML.MoeLayout, ML.MoeShape, MkComm)
    defines = {**ML.kernel_defines(0, 0, 2), "MK_EXPECT_MOE_STRUCTS": want}
    CP.compile_module(ML.SOURCE, defines, arch=ARCH)
    bad = want.replace("{56,", "{48,", 1)
    assert bad != want
    with pytest.raises(CP.CompileError, match="host's ctypes structs"):
        CP.compile_module(ML.SOURCE, {**defines, "MK_EXPECT_MOE_STRUCTS": bad}, arch=ARCH, use_disk_cache=False)


@pytest.mark.parametrize("bad", [dict(softmax="max"), dict(expert_capacity=0), dict(capacity_factor=-1.0),
                                 dict(expert_capacity=4, capacity_factor=1.0), dict(recv_rows=True), dict(blocks=-1)])
def test_bad_options(bad):
    with pytest.raises(ValueError):
        MoeOptions(**bad).checked()


def test_capacity_and_recv_rows():
    o = MoeOptions()
    assert ML.capacity_of(2, 100, 8, 16, o) == 0 and ML.recv_rows(2, 100, 8, 16, o) == 2 * 100 * 8
    assert ML.recv_rows(2, 100, 8, 4, o) == 2 * 100 * 2  # k > E_local: a token sends at most E_local rows
    c = MoeOptions(capacity_factor=1.25)
    assert ML.capacity_of(2, 100, 2, 8, c) == 63  # ceil(1.25 * 2 * 100 * 2 / 8)
    assert ML.recv_rows(2, 100, 2, 8, c) == 4 * 63
    assert ML.recv_rows(2, 100, 2, 8, MoeOptions(recv_rows=17)) == 17


@pytest.mark.parametrize("P", [1, 2, 8])
def test_control_words_do_not_move_with_the_call(P):
    """Epoch, header and flags sit where workspace_control puts them whatever T, H, E (docs/design.md)."""
    c, f, _ = workspace_control(P, P)
    for L, _ in (ML.route_layout(P, 1, 8), ML.route_layout(P, 9999, 1024), ML.dispatch_layout(P, 5, 16, 7),
                 ML.dispatch_layout(P, 4096, 14336, 4096 * 16), ML.combine_layout(P, 3, 1, 16),
                 ML.combine_layout(P, 16384, 8, 14336)):
        assert (L.consumed_off, L.flags_off) == (c, f)
    L, total = ML.dispatch_layout(P, 100, 256, 1000)
    assert L.stage_off >= L.counts_off + 4 * 1000 and total == L.stage_off + P * 100 * 256


def test_topk_reference_ties_and_softmax():
    lg = np.array([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    ids, w = ref.topk_reference(lg, 2)
    np.testing.assert_array_equal(ids, [[1, 2], [0, 1]])
    np.testing.assert_allclose(w, [[0.5, 0.5], [0.5, 0.5]])
    _, wa = ref.topk_reference(lg, 2, "all")
    np.testing.assert_allclose(wa[1], [0.25, 0.25])


def test_layout_reference_order_and_offsets():
    """Two ranks, 4 experts (2 each): rows grouped by expert, then source rank, then token."""
    ids = [np.array([[0, 2], [0, 1], [3, 0]], np.int32), np.array([[2, 0], [1, 3], [0, 1]], np.int32)]
    lay = ref.layout_reference(ids, 4)
    T, k = 3, 2
    # rank 0 holds experts 0, 1: expert 0 from rank 0 tokens 0, 1, 2, then rank 1 tokens 0, 2; expert 1 ...
    np.testing.assert_array_equal(lay[0]["expert_offsets"], [0, 5, 8])
    src = [(v // (T * k), (v % (T * k)) // k, v % k) for v in lay[0]["recv_src"]]
    assert src == [(0, 0, 0), (0, 1, 0), (0, 2, 1), (1, 0, 1), (1, 2, 0), (0, 1, 1), (1, 1, 0), (1, 2, 1)]
    np.testing.assert_array_equal(lay[1]["expert_offsets"], [0, 2, 4])
    np.testing.assert_array_equal(lay[0]["slots"], [[0, 0], [1, 5], [2, 2]])
    np.testing.assert_array_equal(lay[1]["slots"], [[1, 3], [6, 3], [4, 7]])


def test_layout_reference_capacity_and_r_cap():
    ids = [np.zeros((5, 1), np.int32), np.zeros((5, 1), np.int32)]  # everything to expert 0
    lay = ref.layout_reference(ids, 2, capacity=7)
    np.testing.assert_array_equal(lay[0]["expert_offsets"], [0, 7])
    assert (lay[0]["slots"] >= 0).all() and (lay[1]["slots"][:2] >= 0).all() and (lay[1]["slots"][2:] == -1).all()
    lay = ref.layout_reference(ids, 2, r_cap=3)
    np.testing.assert_array_equal(lay[0]["expert_offsets"], [0, 3])
    assert (lay[0]["slots"][3:] == -1).all() and (lay[1]["slots"] == -1).all()


def test_combine_and_layer_reference_agree():
    """The layer reference equals dispatch -> per-expert FFN -> combine built from the other references."""
    rng = np.random.default_rng(1)
    P, T, k, El, H, F = 2, 9, 2, 3, 8, 4
    E = P * El
    ids = [np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int32) for _ in range(P)]
    ws = [rng.random((T, k)) for _ in range(P)]
    xs = [rng.standard_normal((T, H)) for _ in range(P)]
    wg = [rng.standard_normal((El, 2 * F, H)) for _ in range(P)]
    wd = [rng.standard_normal((El, H, F)) for _ in range(P)]
    lay = ref.layout_reference(ids, E)
    xr = ref.dispatch_reference(xs, lay, k)
    ys = []
    for d in range(P):
        o = lay[d]["expert_offsets"]
        y = np.zeros((len(xr[d]), H))
        for l in range(El):
            h = xr[d][o[l]:o[l + 1]] @ wg[d][l].T
            y[o[l]:o[l + 1]] = (h[:, :F] / (1 + np.exp(-h[:, :F])) * h[:, F:]) @ wd[d][l].T
        ys.append(y)
    a = ref.combine_reference(ys, ids, ws, [l["slots"] for l in lay], E)
    b = ref.layer_reference(xs, ids, ws, [l["slots"] for l in lay], wg, wd)
    for d in range(P):
        np.testing.assert_allclose(a[d], b[d], rtol=1e-12, atol=1e-12)


# ---- the fused dispatch + GEMM kernel and low-latency mode ------------------------------------------
def test_fused_specializations_registered():
    from mkernel.ops import gemm as G
    from mkernel.ops.moe.options import FUSED_CONFIGS

    want = {(G.DTYPE_CODES[dt], c, sw) for dt in G.IN_DTYPES for c in FUSED_CONFIGS for sw in (0, 1)}
    assert {(d["MK_GEMM_IN"], d["MK_GEMM_CONFIG"], d.get("MK_MOE_SWIGLU", 0)) for _, d in FUSED_SPECS} == want


@pytest.mark.parametrize("source,defines", FUSED_SPECS, ids=[
    f"in{d['MK_GEMM_IN']}-cfg{d['MK_GEMM_CONFIG']}{'-swiglu' if d.get('MK_MOE_SWIGLU') else ''}"
    for _, d in FUSED_SPECS])
def test_fused_compiles_clean(source, defines):
    """mk_moe_dispatch_gemm (and its SwiGLU variant): no spills, no stack, no ptxas warnings, registers
    within one block per SM."""
    from mkernel.ops import gemm as G

    mod = CP.compile_module(source, defines, arch=ARCH)
    u = mod.resource_usage["mk_moe_dispatch_gemm"]
    assert u.get("spill_stores", 0) == 0 and u.get("spill_loads", 0) == 0 and u.get("stack", 0) == 0, u
    assert u["registers"] * G.CONFIGS[defines["MK_GEMM_CONFIG"]].threads <= 65536, u
    warnings = [ln for ln in mod.log.splitlines() if re.search(r"warning|C75\d\d", ln, re.I)]
    assert not warnings, "ptxas warnings:\n" + "\n".join(warnings)


@pytest.mark.parametrize("bad", [dict(mode="fast"), dict(mode="low_latency", fused=True),
                                 dict(mode="low_latency", expert_capacity=4), dict(mode="low_latency", recv_rows=8),
                                 dict(mode="low_latency", capacity_factor=1.5), dict(fused=1), dict(comm_blocks=-1),
                                 dict(comm_blocks=True), dict(gemm_config=0), dict(gemm_config=6)])
def test_bad_new_options(bad):
    with pytest.raises(ValueError):
        MoeOptions(**bad).checked()


def test_good_new_options():
    for o in (MoeOptions(mode="low_latency"), MoeOptions(fused=True, comm_blocks=4, gemm_config=2)):
        assert o.checked() is o


@pytest.mark.parametrize("bm", [64, 128])
def test_arrival_counter_indices_unique_and_in_range(bm):
    """idx(l, b) = l + o[l] // bm + b over every row block of every expert: distinct and below
    arrived_slots (random, empty and full experts; offsets clamped to r_cap as the routing clamps them)."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        El = int(rng.integers(1, 9))
        r_cap = int(rng.integers(1, 1200))
        sizes = rng.integers(0, 400, El) * (rng.random(El) < 0.7)
        o = np.minimum(np.concatenate([[0], np.cumsum(sizes)]), r_cap)
        seen = set()
        for l in range(El):
            n = int(o[l + 1] - o[l])
            for b in range(-(-n // bm)):
                i = l + int(o[l]) // bm + b
                assert i not in seen
                seen.add(i)
                assert i < ML.arrived_slots(El, r_cap, bm)


def test_fused_grid_within_the_share():
    for sms in (2, 3, 66, 132):
        for cb in (0, 1, 5, 1000):
            comm, workers = ML.fused_grid(sms, MoeOptions(comm_blocks=cb))
            assert comm >= 1 and workers >= 1 and comm + workers == sms
    assert ML.fused_grid(132, MoeOptions()) == (16, 116)
    assert ML.fused_config(4096, MoeOptions()) == 3 and ML.fused_config(256, MoeOptions()) == 2
    assert ML.fused_config(4096, MoeOptions(gemm_config=1)) == 1


@pytest.mark.parametrize("P", [1, 2, 8])
def test_low_latency_layout(P):
    """Regions in order and disjoint; control words where every other MoE workspace has them; the grid
    holds a layout block per source and its local flags (grid + P) fit the flag row."""
    T, k, E, rb = 256, 8, 64 * P, 7168 * 2
    L, total = ML.low_latency_layout(P, T, k, E, rb)
    c, f, end = workspace_control(P, P)
    assert (L.consumed_off, L.flags_off) == (c, f) and L.counts_off >= end
    assert L.scratch_off >= L.counts_off + 4 * P * T * k
    assert L.stage_off >= L.scratch_off + 4 * (P * T * k + P * E)
    assert total == L.stage_off + P * T * rb and L.stage_off % 16 == 0
    for sms in (P, 66, 132):
        for blocks in (0, 1, 4096):
            g = ML.low_latency_grid(P, T, sms, blocks)
            assert P <= g <= max(P, sms) and g + P <= ML.MAX_CHUNKS


def test_moe_gemm_args_size():
    """MoeGemmArgs mirrors moe_gemm.cu's struct (the kernel static_asserts 112 bytes)."""
    assert ctypes.sizeof(ML.MoeGemmArgs) == 112
    assert ML.MoeGemmArgs.ldc.offset == 80 and ML.MoeGemmArgs.N.offset == 88


def test_kernel_args_point_at_a_calls_routing():
    """MoeGemmArgs.point / MoeCombineArgs.point (every fused kernel's re-pointing) set each routing field from
    its own array and touch nothing else."""
    from types import SimpleNamespace as NS

    R = NS(**{n: NS(ptr=0x1000 * (i + 1)) for i, n in enumerate(("ids", "slots", "weights", "expert_offsets",
                                                                  "recv_map"))})
    g = ML.MoeGemmArgs()
    g.x_recv, g.c, g.ldc = 7, 8, 9
    g.point(0x77, R)
    assert (g.x, g.ids, g.slots, g.offs, g.recv_map) == (0x77, 0x1000, 0x2000, 0x4000, 0x5000)
    assert (g.x_recv, g.c, g.ldc) == (7, 8, 9)
    c = ML.MoeCombineArgs()
    c.ws, c.K = 5, 6
    c.point(R, 0x99)
    assert (c.ids, c.slots, c.weights, c.offs, c.recv_map, c.out) == (0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x99)
    assert (c.ws, c.K) == (5, 6)
