"""MoE across nodes on the CPU (docs/moe.md, "Across nodes"): moe_internode.cu compiles for sm_90a without
spills and with the host's MoeXLayout; the workspace layouts; the contiguous slot ranges the kernels send
through the proxy (send_ranges / src_offsets) cover exactly the rows each rank must move, on random and
adversarial routings, against the float64 layout reference -- no GPU needed."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

import _compile_cache

from mkernel.core import compiler as CP
from mkernel.ops.moe import layout as ML
from mkernel.ops.moe import reference as ref

ARCH = "sm_90a"
SPECS = [(s, d) for s, d in CP.registered_specializations() if s == ML.INTERNODE_SOURCE]
KERNELS = ("mk_moe_x_route_exchange", "mk_moe_x_dispatch", "mk_moe_x_combine", "mk_moe_n_dispatch", "mk_moe_n_combine")
LIMITS = {"mk_moe_x_route_exchange": ML.EXCHANGE_THREADS}


def test_specializations_registered():
    import mkernel.ops.moe.internode  # noqa: F401  (registers them)
    specs = {(d["MK_DTYPE"], d["MK_OUT_DTYPE"]) for s, d in CP.registered_specializations()
             if s == ML.INTERNODE_SOURCE}
    assert specs == {(d, o) for d, o, _ in ML.SPECIALIZATIONS}


def _specs():
    import mkernel.ops.moe.internode  # noqa: F401
    return [d for s, d in CP.registered_specializations() if s == ML.INTERNODE_SOURCE]


@pytest.mark.parametrize("defines", _specs(), ids=lambda d: f"d{d['MK_DTYPE']}-o{d['MK_OUT_DTYPE']}")
def test_compiles_clean(defines):
    mod = CP.compile_module(ML.INTERNODE_SOURCE, defines, arch=ARCH)
    _compile_cache.assert_clean(mod, KERNELS, lambda fn: LIMITS.get(fn, ML.THREADS))


def _figures(S) -> str:
    return "{" + ",".join(map(str, [ctypes.sizeof(S)] + [getattr(S, f[0]).offset for f in S._fields_])) + "}"


def test_layout_struct_matches_the_kernel():
    """The device compiler checks MoeXLayout's size and offsets against the host's; a wrong figure fails."""
    d = {"MK_DTYPE": 0, "MK_OUT_DTYPE": 0}
    CP.compile_module(ML.INTERNODE_SOURCE, {**d, "MK_EXPECT_MOEX_LAYOUT": _figures(ML.MoeXLayout)}, arch=ARCH)
    bad = _figures(ML.MoeXLayout).replace("{", "{1+", 1)
    with pytest.raises(Exception, match="MoeXLayout"):
        CP.compile_module(ML.INTERNODE_SOURCE, {**d, "MK_EXPECT_MOEX_LAYOUT": bad}, arch=ARCH, use_disk_cache=False)


@pytest.mark.parametrize("L,N", [(1, 2), (2, 2), (4, 2), (1, 3)])
def test_control_words_do_not_move_and_regions_do_not_overlap(L, N):
    """Control offsets depend on (L, N) only; regions are 256-aligned, disjoint, inside the workspace."""
    a, _ = ML.x_dispatch_layout(L, N, 5, 32, 40)
    b, _ = ML.x_combine_layout(L, N, 1000, 8, 1024, 7000)
    c, _ = ML.x_route_layout(L, N, 3, 16)
    for f in ("consumed_off", "calls_off", "ready_off", "bar_off"):
        assert getattr(a, f) == getattr(b, f) == getattr(c, f)
    P = L * N
    assert a.bar_off + 8 <= a.consumed_off and a.calls_off >= a.consumed_off + 8 * P
    assert a.ready_off >= a.calls_off + 16 * P and a.a_off >= a.ready_off + 8 * P
    T, RB, RC = 37, 48, 111
    X, total = ML.x_dispatch_layout(L, N, T, RB, RC)
    sizes = [4 * RC, P * T * RB, RC * RB, P * RC * RB, 4 * P * RC]
    offs = [X.a_off, X.b_off, X.c_off, X.d_off, X.e_off]
    for i in range(5):
        assert offs[i] % 256 == 0 and offs[i] + sizes[i] <= (offs[i + 1] if i < 4 else total)


def _routing(rng, P, T, k, E, kind):
    if kind == "random":
        return [np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32) for _ in range(P)]
    if kind == "one_expert":  # every token's first choice is expert 0
        ids = _routing(rng, P, T, k, E, "random")
        for a in ids:
            a[:, 0] = 0
            for t in range(T):
                rest = [e for e in rng.permutation(E) if e != 0][:k - 1]
                a[t, 1:] = rest
        return ids
    if kind == "rank0_empty":  # nobody picks rank 0's experts
        El = E // P
        return [np.stack([El + rng.choice(E - El, k, replace=False) for _ in range(T)]).astype(np.int32)
                for _ in range(P)]
    raise AssertionError(kind)


@pytest.mark.parametrize("P,T,k,E,kind,cap,r_cap", [
    (2, 37, 2, 8, "random", 0, None), (2, 1, 1, 2, "random", 0, None), (3, 29, 8, 24, "random", 0, None),
    (2, 50, 4, 8, "one_expert", 0, None), (2, 33, 2, 4, "rank0_empty", 0, None), (4, 41, 3, 16, "random", 5, None),
    (2, 64, 8, 16, "random", 0, 100)])
def test_proxy_ranges_move_exactly_the_remote_rows(P, T, k, E, kind, cap, r_cap):
    """Play the kernels' proxy commands on the float64 reference layout: per (source s, remote owner d)
    the dispatch WRITEs send_ranges[e] for d's experts e, the combine WRITEs src_offsets[l][s] ranges back;
    every row d receives from s is covered exactly once, and nothing else (the slot order is the one-node
    path's, so every range is contiguous)."""
    rng = np.random.default_rng(P * 1000 + T)
    ids = _routing(rng, P, T, k, E, kind)
    lay = ref.layout_reference(ids, E, cap, r_cap)
    El, Tk = E // P, T * k
    for d in range(P):
        src_of_row = np.asarray(lay[d]["recv_src"]) // Tk
        R = int(lay[d]["expert_offsets"][-1])
        assert len(src_of_row) == R
        so = ref.src_offsets_reference(lay[d], P, T, k)
        for s in range(P):
            sr = ref.send_ranges_reference(lay[s]["slots"], ids[s], E)
            sent = np.zeros(R, np.int64)
            for e in range(d * El, (d + 1) * El):
                first, n = sr[e]
                sent[first:first + n] += 1
            back = np.zeros(R, np.int64)
            for l in range(El):
                back[so[l, s]:so[l, s + 1]] += 1
            want = (src_of_row == s).astype(np.int64)
            np.testing.assert_array_equal(sent, want, err_msg=f"dispatch ranges s={s} -> d={d}")
            np.testing.assert_array_equal(back, want, err_msg=f"combine ranges d={d} -> s={s}")
