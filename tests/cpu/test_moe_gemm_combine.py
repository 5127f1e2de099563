"""The fused down GEMM + combine on the CPU (docs/moe.md, "Down GEMM + combine, fused"): every
moe_gemm_combine.cu specialization compiles for sm_90a clean; the kernel's tile -> owner staging-row mapping
and its per-pair counters, emulated in numpy over the grouped tiles (thread fragments included), give the
float64 layer's output on random and adversarial routings, and a token is complete exactly when its last
tile lands; the host plan against driver fakes; the layer's path choice; bad inputs raise before launch."""
from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest

import _compile_cache
from mkernel.core import compiler as CP
from mkernel.dist.opstate import OpState
from mkernel.dist.signals import OPS, workspace_control
from mkernel.ops import gemm as G
from mkernel.ops.moe import MoeOptions, fused_combine as FC
from mkernel.ops.moe import gemm_bound as GB
from mkernel.ops.moe import layout as ML
from mkernel.ops.moe import reference as ref
from mkernel.ops.moe.layer import combine_path
from mkernel.ops.moe.op import MoeRouting

from test_gemm_compile import fake, map_ptr  # noqa: F401 (the driver fakes of the GEMM plans)

ARCH = "sm_90a"
SPECS = [(s, d) for s, d in CP.registered_specializations() if s == ML.COMBINE_SOURCE]


def test_specializations_registered():
    want = {(G.DTYPE_CODES[dt], c) for dt in G.IN_DTYPES for c in ML.FUSED_CONFIGS}
    assert {(d["MK_GEMM_IN"], d["MK_GEMM_CONFIG"]) for _, d in SPECS} == want
    assert all(d["MK_GEMM_OUT"] == d["MK_GEMM_IN"] for _, d in SPECS)


compile_cache = _compile_cache.module_fixture("test_compiles_clean", ARCH)


@pytest.mark.parametrize("source,defines", SPECS, ids=[f"in{d['MK_GEMM_IN']}-cfg{d['MK_GEMM_CONFIG']}" for _, d in SPECS])
def test_compiles_clean(source, defines, compile_cache, monkeypatch):
    """mk_moe_gemm_combine: no spills, no stack, no ptxas warnings, registers within one block per SM."""
    _compile_cache.assert_gemm_spec_clean(source, defines, compile_cache, monkeypatch, FC.NAME, ARCH)


def test_args_and_layout():
    """MoeCombineArgs mirrors the kernel's struct (static_assert 80 bytes); the workspace: control words where
    every MoE workspace has them, u64 counters then 16-byte aligned staging rows, disjoint."""
    assert ctypes.sizeof(ML.MoeCombineArgs) == 80
    assert [f[0] for f in ML.MoeCombineArgs._fields_][-4:] == ["K", "n_comm", "group_m", "pad"]
    assert ML.MoeCombineArgs.K.offset == 64
    for P, T, k in ((1, 1, 1), (2, 37, 8), (8, 4096, 8)):
        rb = 7168 * 2
        L, total = ML.gemm_combine_layout(P, T, k, rb)
        c, f, end = workspace_control(P, P)
        assert (L.consumed_off, L.flags_off) == (c, f) and L.counts_off >= end and L.counts_off % 8 == 0
        assert L.stage_off >= L.counts_off + 8 * T * k and L.stage_off % 256 == 0
        assert total == L.stage_off + T * k * rb and L.row_bytes == rb


# ---- the kernel's index math in numpy -----------------------------------------------------------------
def _frag_rows_cols(BN: int):
    """Per consumer thread (128 of a warpgroup): its rows r0, r0 + 8 of the slab and columns (mk_wgmma.cuh
    mk_wgmma_frag_origin / mk_wgmma_frag_for_each): [thread, j] pairs (8j + c0, +1) for both rows."""
    t = np.arange(128)
    r0 = 16 * (t >> 5) + ((t & 31) >> 2)
    c0 = 2 * (t & 3)
    cols = 8 * np.arange(BN // 8)[None, :] + c0[:, None]
    return r0, cols


def _grouped_tiles(o, El, r_cap, H, BM, BN):
    """MkGroupedScheduler's tiles (group, row0, rows, col0, cols), offsets clamped to r_cap."""
    for g in range(El):
        r0 = min(max(int(o[g]), 0), r_cap)
        r1 = min(max(int(o[g + 1]), r0), r_cap)
        for tm in range(-(-(r1 - r0) // BM)):
            for tn in range(-(-H // BN)):
                row0 = r0 + tm * BM
                yield g, row0, min(BM, r1 - row0), tn * BN, min(BN, H - tn * BN)


def _emulate(xs, ids, weights, wg, wd, E, cfg, capacity=0, r_cap=None, order_seed=None):
    """Every rank's fused down GEMM + combine: (out per rank, counters per rank, the owners' staging writes per
    element), with the tiles of all ranks landing in a random order (``order_seed``); asserts that a token's
    pairs' counters reach nN exactly when its last tile lands (never before) and that no staging element is
    written twice."""
    P = len(xs)
    T, k = ids[0].shape
    H = xs[0].shape[1]
    El, F = wd[0].shape[0], wd[0].shape[2]
    c = G.CONFIGS[cfg]
    BM, BN, NC = c.bm, c.tile_n("nk"), c.bm // 64
    nN = -(-H // BN)
    lays = ref.layout_reference(ids, E, capacity, r_cap)
    slots = [lays[d]["slots"] for d in range(P)]
    r_cap = r_cap if r_cap is not None else P * T * min(k, El)
    x_recv = ref.dispatch_reference([np.asarray(x, np.float64) for x in xs], lays, k)
    stage = [np.full((T * k, H), np.nan) for _ in range(P)]
    writes = [np.zeros((T * k, H), int) for _ in range(P)]
    cnt = [np.zeros(T * k, int) for _ in range(P)]
    tiles = []
    for d in range(P):
        o, rs = lays[d]["expert_offsets"], lays[d]["recv_src"]
        for g, row0, rows, col0, cols in _grouped_tiles(o, El, r_cap, H, BM, BN):
            xr = x_recv[d][row0:row0 + rows]
            h = xr @ np.asarray(wg[d][g], np.float64).T
            act = h[:, :F] / (1 + np.exp(-h[:, :F])) * h[:, F:]
            tiles.append((d, row0, rows, col0, cols, act @ np.asarray(wd[d][g], np.float64).T, rs))
    rng = np.random.default_rng(order_seed)
    r0, fcols = _frag_rows_cols(BN)
    Tk = T * k
    need = {(s, q): nN for s in range(P) for q in range(Tk) if slots[s].ravel()[q] >= 0}
    done = set()
    for i in rng.permutation(len(tiles)) if order_seed is not None else range(len(tiles)):
        d, row0, rows, col0, cols, y, rs = tiles[i]
        for slab in range(NC):  # MoeCombineStore::store, thread by thread (row_dest: rr >= t.rows -> none)
            for rr_thread in (r0, r0 + 8):
                rr = 64 * slab + rr_thread  # [thread]
                for th in np.nonzero(rr < rows)[0]:
                    v = int(rs[row0 + rr[th]])
                    assert 0 <= v < P * Tk
                    s, q = v // Tk, v % Tk
                    for cc in fcols[th]:
                        for col in (cc, cc + 1):
                            if col < cols:
                                stage[s][q, col0 + col] = y[rr[th], col0 + col]
                                writes[s][q, col0 + col] += 1
        for r in range(rows):  # then one thread per row: the owner's counter
            v = int(rs[row0 + r])
            cnt[v // Tk][v % Tk] += 1
        # the tokens whose every kept pair counts nN are complete -- exactly those whose rows all landed
        for s in range(P):
            for t in range(T):
                if (s, t) in done:
                    continue
                qs = [t * k + j for j in range(k) if slots[s][t, j] >= 0]
                if all(cnt[s][q] >= need[(s, q)] for q in qs):
                    assert all((writes[s][q] == 1).all() for q in qs), "a token complete before its rows landed"
                    done.add((s, t))
    outs = []
    for s in range(P):
        assert (writes[s] <= 1).all()
        kept = slots[s].ravel() >= 0
        assert (cnt[s][kept] == nN).all() and (cnt[s][~kept] == 0).all()
        assert (writes[s][kept] == 1).all() and (writes[s][~kept] == 0).all()
        o = np.zeros((T, H))
        for t in range(T):  # moe_combine_token: fp32 in the kernel, j order
            for j in range(k):
                if slots[s][t, j] >= 0:
                    o[t] += float(weights[s][t, j]) * stage[s][t * k + j]
        outs.append(o)
    assert len(done) == P * T
    return outs, slots


def _routing(kind: str, P: int, T: int, k: int, E: int, rng):
    if kind == "random":
        return [np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32) for _ in range(P)]
    if kind == "one_expert":  # every token to experts 0 .. k-1 (all on rank 0 when k <= E_local)
        return [np.tile(np.arange(k, dtype=np.int32), (T, 1)) for _ in range(P)]
    if kind == "empty_experts":  # only the even experts of the first half
        pool = np.arange(0, E // 2, 2)
        return [np.stack([rng.choice(pool, k, replace=False) for _ in range(T)]).astype(np.int32) for _ in range(P)]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind,P,T,k,E,H,F,cap", [
    ("random", 2, 37, 2, 8, 136, 24, 0),
    ("random", 1, 13, 2, 4, 64, 16, 0),
    ("random", 2, 5, 1, 4, 200, 8, 0),          # top-1, H not a multiple of BN
    ("random", 4, 13, 8, 32, 72, 16, 0),        # top-8
    ("one_expert", 2, 37, 2, 8, 136, 24, 0),    # rank 1 receives nothing
    ("one_expert", 2, 300, 1, 4, 64, 8, 0),     # one expert, more rows than a row block
    ("empty_experts", 2, 29, 2, 16, 96, 16, 0),
    ("random", 2, 37, 2, 8, 136, 24, 5),        # capacity: dropped pairs add nothing, count nothing
    ("random", 1, 1, 1, 1, 8, 8, 0),
])
def test_emulated_tiles_and_counters_give_the_layer(kind, P, T, k, E, H, F, cap):
    rng = np.random.default_rng(abs(hash((kind, P, T, k, E, cap))) % 2 ** 32)
    El = E // P
    ids = _routing(kind, P, T, k, E, rng)
    weights = [rng.random((T, k)) for _ in range(P)]
    xs = [rng.standard_normal((T, H)) for _ in range(P)]
    wg = [rng.standard_normal((El, 2 * F, H)) / np.sqrt(H) for _ in range(P)]
    wd = [rng.standard_normal((El, H, F)) / np.sqrt(F) for _ in range(P)]
    cfg = FC.combine_config(H, MoeOptions())
    for seed in (None, 1, 2):
        outs, slots = _emulate(xs, ids, weights, wg, wd, E, cfg, capacity=cap, order_seed=seed)
        want = ref.layer_reference(xs, ids, weights, slots, wg, wd)
        for s in range(P):
            np.testing.assert_allclose(outs[s], want[s], rtol=1e-10, atol=1e-10)
    if kind == "one_expert" and P == 2 and k <= El:
        assert (ref.layout_reference(ids, E)[1]["expert_offsets"] == 0).all()  # (rank 1 received nothing)


def test_emulated_tiles_other_configs():
    """Every fused config's tile shape (BM 64 / 128 / 192 rows, BN 128-256 columns) maps rows alike."""
    rng = np.random.default_rng(3)
    P, T, k, E, H, F = 2, 70, 2, 4, 264, 8
    ids = _routing("random", P, T, k, E, rng)
    weights = [rng.random((T, k)) for _ in range(P)]
    xs = [rng.standard_normal((T, H)) for _ in range(P)]
    wg = [rng.standard_normal((E // P, 2 * F, H)) / 16 for _ in range(P)]
    wd = [rng.standard_normal((E // P, H, F)) / 4 for _ in range(P)]
    for cfg in ML.FUSED_CONFIGS:
        outs, slots = _emulate(xs, ids, weights, wg, wd, E, cfg)
        want = ref.layer_reference(xs, ids, weights, slots, wg, wd)
        for s in range(P):
            np.testing.assert_allclose(outs[s], want[s], rtol=1e-10, atol=1e-10)


# ---- the host plan against driver fakes -----------------------------------------------------------------
class _Kernel:
    def __init__(self, log, defines, name):
        self.log, self.defines, self.name = log, defines, name

    def max_active_blocks_per_sm(self, threads, smem):
        return 1

    def prepare(self, grid, block, args, **kw):
        log, defines, name = self.log, self.defines, self.name

        class Launch:
            def submit(self):
                log.append(dict(defines=defines, name=name, grid=grid, block=block, args=list(args), **kw))
        return Launch()


@pytest.fixture
def env(fake, monkeypatch):
    """(launches, tensor maps, empty, a one-rank context, workspace requests) with the op's device pieces
    faked."""
    _, maps, empty = fake
    launches, ws = [], []
    monkeypatch.setattr(FC, "kernel", lambda src, defines, name: _Kernel(launches, defines, name))
    monkeypatch.setattr(GB.cu, "cuMemsetD32Async",  # (recorded in launch order: the counters' zeroing)
                        lambda ptr, v, n, stream: launches.append(dict(memset=(int(ptr), v, n))))
    monkeypatch.setattr(FC, "require_gemm_device", lambda what, dev: None)
    states = {}

    def workspace(key, nbytes, stream, what):
        ws.append((key, nbytes))
        return types.SimpleNamespace(ptr=1 << 45, peer_table=1 << 46)
    ctx = types.SimpleNamespace(
        size=1, local_size=1, num_nodes=1, device=0, resident_sms=132, workspace_generation=0, world=None, rank=0,
        check=lambda: None, op_state=lambda name: states.setdefault(name, OpState(name)),
        agree=lambda what, sig, world: 1, comm_args=lambda name, digest: ctypes.c_uint64(0), workspace=workspace)
    return launches, maps, empty, ctx, ws


def test_plan(env):
    """The config of N = H, grid = the SM share (sum blocks first), A = act [recv_rows, F], B = w_down "nk"
    [El, H, F], the args' pointers, the workspace of gemm_combine_layout; the plan says "fused"; a second
    call with other arrays re-points them."""
    launches, maps, empty, ctx, ws = env
    T, H, F, k, E = 64, 512, 192, 2, 4
    R = MoeRouting(ctx, T, k, E)
    act, wd = empty((R.recv_rows, F), "bfloat16"), empty((E, H, F), "bfloat16")
    out = FC.moe_gemm_combine(ctx, act, R, wd, stream=0)
    assert out.shape == (T, H) and out.dtype.name == "bfloat16"
    zero, l = launches
    # the pair counters zeroed before the launch: another call's staging rows may lie where they do
    assert zero["memset"] == ((1 << 45) + ML.gemm_combine_layout(1, T, k, H * 2)[0].counts_off, 0, 2 * T * k)
    cfg = FC.combine_config(H, MoeOptions())
    c = G.CONFIGS[cfg]
    assert cfg == 3 and l["defines"] == FC.combine_defines("bfloat16", cfg) and l["name"] == FC.NAME
    assert l["grid"] == 132 and l["block"] == c.threads and l["smem"] == c.smem and l["cooperative"]
    ma, mb = maps[-2:]
    assert ma == dict(ptr=act.ptr, dtype="bfloat16", dims=(F, R.recv_rows), strides=(F * 2,), box=(64, c.bm))
    assert mb["ptr"] == wd.ptr and mb["dims"] == (F, H, E)
    a = l["args"][5]
    assert isinstance(a, ML.MoeCombineArgs)
    assert (a.K, a.n_comm, a.group_m, a.out, a.recv_map, a.offs) == (F, ML.fused_grid(132, MoeOptions())[0], G.GROUP_M,
                                                                     out.ptr, R.recv_map.ptr, R.expert_offsets.ptr)
    assert (a.ids, a.slots, a.weights) == (R.ids.ptr, R.slots.ptr, R.weights.ptr)
    shape = l["args"][4]
    assert (shape.T, shape.H, shape.k, shape.E) == (T, H, k, E)
    assert ws == [(("moe_gemm_combine",), ML.gemm_combine_layout(1, T, k, H * 2)[1])]
    p = ctx.op_state("moe_gemm_combine").last_plan
    assert p.combine == "fused" and p.grid == 132
    assert OPS["moe_gemm_combine"] not in [v for n, v in OPS.items() if n != "moe_gemm_combine"]  # (error records)
    act2, out2 = empty((R.recv_rows, F), "bfloat16"), empty((T, H), "bfloat16")
    assert FC.moe_gemm_combine(ctx, act2, R, wd, out2, stream=0) is out2
    zero2, l2 = launches[-2:]
    assert zero2 == zero and l2["args"][5].out == out2.ptr and map_ptr(l2["args"][0]) == act2.ptr
    # a forced config, fp16
    R2 = MoeRouting(ctx, T, k, E, MoeOptions(gemm_config=1))
    FC.moe_gemm_combine(ctx, empty((R2.recv_rows, F), "float16"), R2, empty((E, H, F), "float16"), stream=0,
                        options=MoeOptions(gemm_config=1))
    assert launches[-1]["defines"] == FC.combine_defines("float16", 1)


@pytest.mark.parametrize("bad", [
    dict(act_cols=128),                 # w_down's F (64) differs
    dict(act_rows=5),                   # not [recv_rows, F]
    dict(wd_dtype="float16"),           # another dtype than act's
    dict(out_dtype="float32"),          # out must be act's dtype
    dict(out_rows=3),                   # not [T, H]
    dict(H=60),                         # rows of 120 bytes: not a multiple of 16
    dict(F=4),                          # act rows of 8 bytes
    dict(act_dtype="float32"),          # not bf16 / fp16
    dict(wd_ndim=2),
    dict(low_latency=True),             # a low-latency routing
])
def test_bad_input_raises_before_launch(env, bad):
    launches, maps, empty, ctx, ws = env
    T, k, E = 16, 2, 2
    H, F = bad.get("H", 128), bad.get("F", 64)
    opts = MoeOptions(mode="low_latency") if bad.get("low_latency") else MoeOptions()
    R = MoeRouting(ctx, T, k, E, opts)
    adt = bad.get("act_dtype", "bfloat16")
    act = empty((bad.get("act_rows", R.recv_rows), bad.get("act_cols", F)), adt)
    wd = empty((E, H, F), bad.get("wd_dtype", adt)) if bad.get("wd_ndim", 3) == 3 else empty((H, F), adt)
    out = empty((bad.get("out_rows", T), H), bad.get("out_dtype", adt)) if "out_dtype" in bad or "out_rows" in bad else None
    with pytest.raises((TypeError, ValueError)):
        FC.moe_gemm_combine(ctx, act, R, wd, out, stream=0, options=opts)
    assert launches == []


def test_layer_path_choice_and_options():
    on = MoeOptions(fused_combine=True)
    assert on.checked() is on and MoeOptions(fused=True, fused_combine=True).checked()
    assert combine_path(on, "bfloat16", "bfloat16") == "fused"
    assert combine_path(on, "bfloat16", "float32") == "kernel"  # (the fused sums are stored in x's dtype)
    assert combine_path(MoeOptions(), "bfloat16", "bfloat16") == "kernel"  # off until GPU-validated
    for bad in (dict(fused_combine=1), dict(mode="low_latency", fused_combine=True)):
        with pytest.raises(ValueError):
            MoeOptions(**bad).checked()
