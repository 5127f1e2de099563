"""The MoE layer after routing in one kernel on the CPU (docs/moe.md, "The layer in one kernel"): every
moe_layer.cu specialization compiles for sm_90a clean (setmaxnreg kept: no ptxas warning); the kernel's
argument structs against the host's ctypes mirrors (static_assert); the workspace layout; the act_done
protocol between the two tile loops emulated over MkGroupedScheduler's tiles (clamped and empty groups, every
fused config, workers running their tiles in order: a down tile starts only once every act element of its
rows is stored, and every tile runs); the down_stored protocol emulated over several ranks and calls (the add
completing a rank's loop (2) tiles raises its flags once, a rank without tiles raises them once from block 0,
the sums start only once every rank's tiles are stored, a failed peer check raises nothing); the host plan and the layer's submission against driver fakes; bad
inputs raise before launch; the options."""
from __future__ import annotations

import types

import numpy as np
import pytest

import _compile_cache
from _launch_fakes import LoggedKernel
from mkernel.core import compiler as CP
from mkernel.core.arrays import DeviceArray
from mkernel.dist.opstate import OpState
from mkernel.dist.signals import OPS, workspace_control
from mkernel.ops import gemm as G
from mkernel.ops.moe import MoeOptions, fused_layer as FL
from mkernel.ops.moe import layer as LY
from mkernel.ops.moe import gemm_bound as GB
from mkernel.ops.moe import layout as ML
from mkernel.ops.moe import op as MO
from mkernel.ops.gemm_comm import raster  # (mk_gemm.cuh mk_raster)
from mkernel.ops.moe.op import MoeRouting

from test_gemm_compile import fake, map_ptr  # noqa: F401 (the driver fakes of the GEMM plans)

ARCH = "sm_90a"
SPECS = [(s, d) for s, d in CP.registered_specializations() if s == ML.LAYER_SOURCE]


def test_specializations_registered():
    want = {(G.DTYPE_CODES[dt], c) for dt in G.IN_DTYPES for c in ML.FUSED_CONFIGS}
    assert {(d["MK_GEMM_IN"], d["MK_GEMM_CONFIG"]) for _, d in SPECS} == want
    assert all(d["MK_GEMM_OUT"] == d["MK_GEMM_IN"] for _, d in SPECS)
    # every F the layer takes this path for runs one of them
    for F in range(8, 4096, 8):
        c = FL.layer_config(F, MoeOptions())
        assert c is None or (c in ML.FUSED_CONFIGS and F % G.pair_width(c) == 0)


compile_cache = _compile_cache.module_fixture("test_compiles_clean", ARCH)


@pytest.mark.parametrize("source,defines", SPECS, ids=[f"in{d['MK_GEMM_IN']}-cfg{d['MK_GEMM_CONFIG']}" for _, d in SPECS])
def test_compiles_clean(source, defines, compile_cache, monkeypatch):
    """mk_moe_layer: no spills, no stack, no ptxas warnings (C7507 would say setmaxnreg was dropped: both tile
    loops stay inside the role split), registers within one block per SM."""
    _compile_cache.assert_gemm_spec_clean(source, defines, compile_cache, monkeypatch, FL.NAME, ARCH)


def test_structs_match_the_kernel():
    """The kernel takes MoeGemmArgs, MoeCombineArgs, two MoeLayouts and MoeShape by value from the host's
    ctypes structs: the device compiler checks every size, alignment and field offset (static_assert in
    moe_layer.cu); a figure off by one fails the compile (so the check is live)."""
    want = _compile_cache.struct_figures(ML.MoeGemmArgs, ML.MoeCombineArgs, ML.MoeLayout, ML.MoeShape)
    defines = {**FL.layer_defines("bfloat16", 2), "MK_EXPECT_MOE_LAYER_STRUCTS": want}
    CP.compile_module(ML.LAYER_SOURCE, defines, arch=ARCH)
    bad = want.replace("{112,", "{104,", 1)
    assert bad != want
    with pytest.raises(CP.CompileError, match="host's ctypes structs"):
        CP.compile_module(ML.LAYER_SOURCE, {**defines, "MK_EXPECT_MOE_LAYER_STRUCTS": bad}, arch=ARCH,
                          use_disk_cache=False)


@pytest.mark.parametrize("P,T,k,rb,r_cap", [(1, 1, 1, 16, 1), (2, 37, 8, 272, 600), (8, 4096, 8, 14336, 4096 * 16),
                                            (4, 0, 2, 32, 1), (2, 5, 3, 48, 7)])
def test_layout(P, T, k, rb, r_cap):
    """One control region where every MoE workspace has it (both layouts' consumed_off / flags_off), then
    down_stored (u64 [P] at Lc.scratch_off) at an offset of P only; the dispatch's regions as dispatch_layout
    places them after a control region (shifted past down_stored); then the combine's cnt (u64 [T * k]) and
    staging ([T * k] rows): 256-aligned, disjoint, in order, inside the total."""
    Ld, Lc, total = ML.layer_layout(P, T, k, rb, rb + 16, r_cap)
    D, dtotal = ML.dispatch_layout(P, T, rb, r_cap)
    c, f, end = workspace_control(P, P)
    for L in (Ld, Lc):
        assert (L.consumed_off, L.flags_off, L.flag_stride) == (c, f, ML.MAX_CHUNKS)
    shift = Ld.counts_off - D.counts_off
    assert shift > 0 and shift % 256 == 0
    moved = ("counts_off", "scratch_off", "stage_off")
    assert all(getattr(Ld, n) == getattr(D, n) + (shift if n in moved else 0) for n, _ in ML.MoeLayout._fields_)
    assert (Ld.row_bytes, Lc.row_bytes) == (rb, rb + 16)
    regions = [(c, f), (f, end),                                   # header, ready flags
               (Lc.scratch_off, Lc.scratch_off + 8 * P),            # down_stored
               (Ld.counts_off, Ld.counts_off + 4 * r_cap),          # recv_src
               (Ld.stage_off, Ld.stage_off + P * T * rb),           # dispatch staging
               (Lc.counts_off, Lc.counts_off + 8 * T * k),          # cnt
               (Lc.stage_off, Lc.stage_off + T * k * (rb + 16))]    # combine staging
    assert all(a1 <= b0 for (_, a1), (b0, _) in zip(regions, regions[1:]))
    assert regions[-1][1] == total and dtotal + shift == Ld.stage_off + P * T * rb
    assert all(o % 256 == 0 for o in (Lc.scratch_off, Ld.counts_off, Ld.stage_off, Lc.counts_off, Lc.stage_off))
    # control words never move with the call's size (a stale data byte there would read as a raised flag)
    Ld2, Lc2, _ = ML.layer_layout(P, T + 9, k + 1, rb + 32, rb, r_cap + 300)
    assert (Lc2.scratch_off, Ld2.counts_off) == (Lc.scratch_off, Ld.counts_off)


# ---- the act_done protocol between the two tile loops ---------------------------------------------------
def _tiles(o, El, M, N, BM, BN):
    """MkGroupedScheduler::tiles: every worker's tiles together (groups clamped as the scheduler clamps them)."""
    n = 0
    for g in range(El):
        r0 = min(max(int(o[g]), 0), M)
        r1 = min(max(int(o[g + 1]), r0), M)
        n += -(-(r1 - r0) // BM) * -(-N // BN)
    return n


def _grouped(o, El, M, N, BM, BN, worker, workers, group_m=G.GROUP_M):
    """MkGroupedScheduler's tiles for one worker: (group, tile_m, row0, rows, col0, cols), offsets clamped to
    [0, M] as the scheduler clamps them."""
    num_n = -(-N // BN)
    groups = []
    base = 0
    for g in range(El):
        r0 = min(max(int(o[g]), 0), M)
        r1 = min(max(int(o[g + 1]), r0), M)
        nm = -(-(r1 - r0) // BM)
        groups.append((g, r0, r1, nm, base))
        base += nm * num_n
    out = []
    for i in range(worker, base, workers):
        g, r0, r1, nm, b = next(x for x in groups if x[4] <= i < x[4] + x[3] * num_n)
        tm, tn = raster(i - b, nm, num_n, group_m)
        row0 = r0 + tm * BM
        out.append((g, tm, row0, min(BM, r1 - row0), tn * BN, min(BN, N - tn * BN)))
    return out


def _offsets(kind, El, r_cap, BM, rng):
    if kind == "random":
        sizes = rng.integers(0, 3 * BM, El) * (rng.random(El) < 0.8)
    elif kind == "one_hot":  # one expert takes everything, more rows than r_cap: clamped
        sizes = np.zeros(El, int)
        sizes[El // 2] = r_cap + 3 * BM
    elif kind == "empty":
        sizes = np.zeros(El, int)
    else:  # "ragged": rows not multiples of BM, the last groups past r_cap
        sizes = np.array([BM + 1, 0, 5, 2 * BM - 1] * El)[:El]
    o = np.concatenate([[0], np.cumsum(sizes)])
    return np.minimum(o, r_cap) if kind != "unclamped" else o


@pytest.mark.parametrize("cfg", ML.FUSED_CONFIGS)
@pytest.mark.parametrize("kind", ["random", "one_hot", "empty", "ragged"])
def test_act_done_protocol(cfg, kind):
    """Loop (1) tiles (N = 2F through the paired view: tile n stores act columns [n * BN / 2, (n + 1) * BN / 2) of
    its rows) add 1 to act_done[idx] with MoeActDone's index (the clamped group start t.row0 - t.tile_m * BM);
    a loop (2) tile (N = H) may start once act_done[MoeWaitAct's index] reaches ceil(2F / BN).  Workers run
    their loop (1) tiles, then their loop (2) tiles, in scheduler order, in a random interleaving: every loop (2)
    tile runs (no deadlock), and when it starts every act element of its rows is stored; the counters end at
    exactly ceil(2F / BN), at indices below arrived_slots.  The two indices agree also where offsets exceed
    r_cap (groups clamped to r_cap, as the scheduler clamps them)."""
    c = G.CONFIGS[cfg]
    BM, BN = c.bm, c.tile_n("nk")
    P_ = BN // 2  # pair width (one slab per warpgroup along N)
    assert P_ == G.pair_width(cfg)
    rng = np.random.default_rng(cfg * 7 + len(kind))
    for trial in range(4):
        El = int(rng.integers(1, 6))
        F = P_ * int(rng.integers(1, 4))
        H = int(rng.choice([8, BN - 8, BN + 64, 3 * BN]))
        r_cap = int(rng.integers(1, 5 * BM))
        o = _offsets(kind, El, r_cap, BM, rng)
        if trial == 3:  # offsets past r_cap reach the kernel unclamped only through a bad routing: still safe
            o = o + int(rng.integers(0, 2 * BM))
        workers = int(rng.integers(1, 5))
        need = -(-2 * F // BN)
        n_slots = ML.arrived_slots(El, r_cap, BM)
        act = np.zeros((r_cap, F), bool)
        done = np.zeros(n_slots, int)
        queues = []
        for w in range(workers):
            q = [("up", t) for t in _grouped(o, El, r_cap, 2 * F, BM, BN, w, workers)]
            q += [("down", t) for t in _grouped(o, El, r_cap, H, BM, BN, w, workers)]
            queues.append(q)
        down_total = sum(1 for q in queues for s, _ in q if s == "down")
        assert down_total == _tiles(o, El, r_cap, H, BM, BN)  # (what MoeDownDone counts to)
        down_ran = 0
        while any(queues):
            ready = []
            for w, q in enumerate(queues):
                if not q:
                    continue
                stage, (g, tm, row0, rows, col0, cols) = q[0]
                if stage == "up":
                    ready.append(w)
                else:
                    o0 = min(max(int(o[g]), 0), r_cap)
                    if done[g + o0 // BM + tm] >= need:  # MoeWaitAct
                        ready.append(w)
            assert ready, "no worker can make progress: a loop (2) tile waits on a row block loop (1) never completes"
            w = int(rng.choice(ready))
            stage, (g, tm, row0, rows, col0, cols) = queues[w].pop(0)
            if stage == "up":
                assert cols == BN  # (F a multiple of the pair width: no N tile is clipped)
                act[row0:row0 + rows, col0 // 2:(col0 + cols) // 2] = True
                idx = g + (row0 - tm * BM) // BM + tm  # MoeActDone
                assert 0 <= idx < n_slots
                done[idx] += 1
            else:
                assert act[row0:row0 + rows].all(), "a down tile started before its rows' act was complete"
                down_ran += 1
        assert down_ran == down_total
        assert set(np.unique(done)) <= {0, need}


# ---- the down_stored protocol between loop (2) and the sums ---------------------------------------------
@pytest.mark.parametrize("cfg", [1, 3])
@pytest.mark.parametrize("scenario", ["ok", "rank_without_tiles", "all_without_tiles", "failed_check"])
def test_down_stored_protocol(cfg, scenario):
    """P ranks, two calls (epochs 1, 2; down_done zeroed by the host per launch, down_stored never reset), each
    rank's workers running their loop (2) tiles (MkGroupedScheduler's, over its offsets) in a random
    interleaving with every rank's communication blocks.  A counted tile adds 1 to its rank's down_done
    (MoeDownDone: only if its block's peer check passed); the add reaching tiles() raises down_stored[r] = ep at
    every rank; a rank with tiles() == 0 raises them from block 0 once its dispatch is done.  A communication
    block passes its wait when down_stored[s] >= ep for every s at its rank.  Every rank raises exactly once
    per call, only after all its tiles are stored; a block passes only once every rank's tiles are stored.  A
    block failing its peer check (call 2) stores and counts nothing: its rank never raises, and no
    communication block waiting on it passes (the bounded waits time out)."""
    c = G.CONFIGS[cfg]
    BM, BN = c.bm, c.tile_n("nk")
    rng = np.random.default_rng(cfg * 11 + len(scenario))
    failures = 0
    for trial in range(6):
        P = int(rng.integers(1, 5))
        El = int(rng.integers(1, 5))
        H = int(rng.choice([8, BN + 64, 3 * BN]))
        r_cap = int(rng.integers(1, 4 * BM))
        n_comm = int(rng.integers(1, 4))
        flags = np.zeros((P, P), int)  # flags[r, s]: down_stored[s] in rank r's workspace
        for ep in (1, 2):
            offs, tiles, queues, ok = [], [], [], []
            for r in range(P):
                kind = "empty" if scenario == "all_without_tiles" or (scenario == "rank_without_tiles" and
                                                                       r == P - 1) else "random"
                o = _offsets(kind, El, r_cap, BM, rng)
                workers = int(rng.integers(1, 5))
                q = [[(w, i) for i, _ in enumerate(_grouped(o, El, r_cap, H, BM, BN, w, workers))]
                     for w in range(workers)]
                total = _tiles(o, El, r_cap, H, BM, BN)
                assert sum(map(len, q)) == total
                # the peer check's verdict per worker block (call 2 of "failed_check": one block with tiles fails)
                v = [True] * workers
                busy = [w for w in range(workers) if q[w]]
                if scenario == "failed_check" and ep == 2 and r == 0 and busy:
                    v[int(rng.choice(busy))] = False
                offs.append(o)
                tiles.append(total)
                queues.append(q)
                ok.append(v)
            failed = {r for r in range(P) if not all(ok[r])}
            done = np.zeros(P, int)  # down_done, zeroed by the host before the launch
            stored = [0] * P
            raised = [0] * P
            # per rank: block 0's dispatch, then every communication block's wait
            comm = [[("dispatch", 0)] + [("wait", b) for b in range(n_comm)] for _ in range(P)]
            passed = 0
            while True:
                moves = [("tile", r, w) for r in range(P) for w, q in enumerate(queues[r]) if q]
                moves += [("comm", r, None) for r in range(P) if comm[r] and (
                    comm[r][0][0] == "dispatch" or (flags[r] >= ep).all())]
                if not moves:
                    break
                kind, r, w = moves[int(rng.integers(len(moves)))]
                if kind == "tile":
                    queues[r][w].pop(0)
                    if not ok[r][w]:
                        continue  # MoeCombineStore stored nothing; MoeDownDone's tile_done counts nothing
                    stored[r] += 1
                    old = done[r]
                    done[r] += 1
                    if old + 1 == tiles[r]:
                        assert stored[r] == tiles[r], "down_stored raised before every loop (2) tile was stored"
                        flags[:, r] = ep
                        raised[r] += 1
                else:
                    step, b = comm[r].pop(0)
                    if step == "dispatch":
                        if tiles[r] == 0:
                            flags[:, r] = ep
                            raised[r] += 1
                    else:
                        assert all(stored[s] == tiles[s] for s in range(P)), "sums started before every tile was stored"
                        passed += 1
            for r in range(P):
                assert raised[r] == (0 if r in failed else 1), (r, raised, failed)
            if failed:
                failures += 1
                assert passed == 0 and all(len(comm[r]) == n_comm for r in range(P))
                assert all(flags[r, s] == ep - 1 for r in range(P) for s in failed)
                break
            assert passed == P * n_comm and (flags == ep).all() and (done == np.array(tiles)).all()
    assert failures > 0 if scenario == "failed_check" else failures == 0


# ---- the host plan against driver fakes ---------------------------------------------------------------
@pytest.fixture
def env(fake, monkeypatch):
    """(events: launches and memsets in stream order, tensor maps, empty, a one-rank context, workspace requests)
    with the op's device pieces faked."""
    _, maps, empty = fake
    events, ws = [], []
    monkeypatch.setattr(FL, "kernel", lambda src, defines, name: LoggedKernel(events, defines, name))
    monkeypatch.setattr(FL, "require_gemm_device", lambda what, dev: None)
    monkeypatch.setattr(GB, "check", lambda r: None)
    monkeypatch.setattr(GB.cu, "cuMemsetD32Async", lambda ptr, v, n, s: events.append(
        dict(kind="memset", ptr=int(ptr), value=v, words=n)))
    states = {}

    def workspace(key, nbytes, stream, what):
        ws.append((key, nbytes))
        return types.SimpleNamespace(ptr=1 << 45, peer_table=1 << 46)
    ctx = types.SimpleNamespace(
        size=1, local_size=1, num_nodes=1, device=0, resident_sms=132, sm_count=132, workspace_generation=0,
        world=None, rank=0, check=lambda: None, op_state=lambda name: states.setdefault(name, OpState(name)),
        agree=lambda what, sig, world: 1, comm_args=lambda name, digest: types.SimpleNamespace(op=OPS[name]),
        workspace=workspace)
    return events, maps, empty, ctx, ws


def test_plan(env):
    """The config pairing F, grid = the SM share (communication blocks first); maps: x_recv [recv_rows, H] and
    act [recv_rows, F] (the bound call's), w_gate_up's 5-D paired view, w_down "nk" [El, H, F]; MoeGemmArgs
    (act with ldc = F, N = 2F, K = H) and MoeCombineArgs (K = F, out) point at the call's arrays; n_slots; the
    two layouts of layer_layout; before the launch the counters (2 * n_slots + 1 u64: arrived, act_done,
    down_done) and this rank's cnt words are zeroed; the plan says "layer" / "epilogue"; a second call with other arrays re-points them."""
    events, maps, empty, ctx, ws = env
    T, H, F, k, E = 64, 512, 192, 2, 4
    R = MoeRouting(ctx, T, k, E)
    x, wg, wd = empty((T, H), "bfloat16"), empty((E, 2 * F, H), "bfloat16"), empty((E, H, F), "bfloat16")
    out = FL.moe_ffn_fused(ctx, x, R, wg, wd, stream=0)
    assert out.shape == (T, H) and out.dtype.name == "bfloat16"
    m1, (l,) = [e for e in events if e["kind"] == "memset"], [e for e in events if e["kind"] == "launch"]
    assert events == m1 + [l]  # (the memsets first)
    cfg = FL.layer_config(F, MoeOptions())
    c = G.CONFIGS[cfg]
    assert cfg == 4 and l["defines"] == FL.layer_defines("bfloat16", cfg) and l["name"] == FL.NAME == "mk_moe_layer"
    assert l["grid"] == 132 and l["block"] == c.threads and l["smem"] == c.smem and l["cooperative"]
    tx, tgu, tact, twd, comm, Ld, Lc, shape, a, b, n_slots = l["args"]
    assert comm.op == OPS["moe_ffn_fused"]
    mx, mact, mgu, mwd = maps[-4:]  # (in the order the bound call encodes them)
    rr = R.recv_rows
    P_ = G.pair_width(cfg)
    assert mx["dims"] == (H, rr) and mx["strides"] == (H * 2,) and mx["box"] == (64, c.bm)
    assert mact["dims"] == (F, rr) and mact["strides"] == (F * 2,) and mact["box"] == (64, c.bm)
    assert mgu == dict(ptr=wg.ptr, dtype="bfloat16", dims=(H, P_, F // P_, 2, E),
                       strides=(H * 2, P_ * H * 2, F * H * 2, 2 * F * H * 2), box=(64, P_, 1, 2, 1))
    assert mwd["ptr"] == wd.ptr and mwd["dims"] == (F, H, E)
    assert map_ptr(tx) == mx["ptr"] and map_ptr(tact) == mact["ptr"] and map_ptr(tgu) == wg.ptr
    assert isinstance(a, ML.MoeGemmArgs) and isinstance(b, ML.MoeCombineArgs)
    n_comm = ML.fused_grid(132, MoeOptions())[0]
    assert (a.x, a.ids, a.slots, a.offs, a.recv_map) == (x.ptr, R.ids.ptr, R.slots.ptr, R.expert_offsets.ptr,
                                                          R.recv_map.ptr)
    assert (a.x_recv, a.c) == (mx["ptr"], mact["ptr"])
    assert (a.ldc, a.N, a.K, a.n_comm, a.group_m, a.c_vec_ok) == (F, 2 * F, H, n_comm, G.GROUP_M, 1)
    assert (a.ws, a.peers) == (1 << 45, 1 << 46)
    assert (b.ids, b.slots, b.weights, b.offs, b.recv_map, b.out) == (R.ids.ptr, R.slots.ptr, R.weights.ptr,
                                                                       R.expert_offsets.ptr, R.recv_map.ptr, out.ptr)
    assert (b.K, b.n_comm, b.group_m, b.ws, b.peers) == (F, n_comm, G.GROUP_M, 1 << 45, 1 << 46)
    assert n_slots.value == ML.arrived_slots(E, rr, c.bm)
    wLd, wLc, total = ML.layer_layout(1, T, k, H * 2, H * 2, rr)
    for got, want in ((Ld, wLd), (Lc, wLc)):
        assert [getattr(got, n) for n, _ in ML.MoeLayout._fields_] == [getattr(want, n) for n, _ in ML.MoeLayout._fields_]
    assert (shape.T, shape.H, shape.k, shape.E, shape.El, shape.r_cap) == (T, H, k, E, E, rr)
    assert m1 == [dict(kind="memset", ptr=a.arrived, value=0, words=2 * (2 * n_slots.value + 1)),
                  dict(kind="memset", ptr=(1 << 45) + Lc.counts_off, value=0, words=2 * T * k)]
    assert ws == [(("moe_ffn_fused",), total)]
    p = ctx.op_state("moe_ffn_fused").last_plan
    assert (p.combine, p.swiglu, p.grid, p.recv_rows) == ("layer", "epilogue", 132, rr)
    assert OPS["moe_ffn_fused"] not in [v for n, v in OPS.items() if n != "moe_ffn_fused"]  # (error records)
    # other arrays of the same layout: re-pointed, the counters zeroed again, nothing planned again
    x2, wg2, wd2, out2 = (empty(t.shape, "bfloat16") for t in (x, wg, wd, out))
    events.clear()
    assert FL.moe_ffn_fused(ctx, x2, R, wg2, wd2, out2, stream=0) is out2
    assert [e["kind"] for e in events] == ["memset", "memset", "launch"]
    l2 = events[-1]
    assert l2["args"][8].x == x2.ptr and l2["args"][9].out == out2.ptr
    assert map_ptr(l2["args"][1]) == wg2.ptr and map_ptr(l2["args"][3]) == wd2.ptr and len(ws) == 1
    # fp16, a forced config
    opts = MoeOptions(gemm_config=1)
    R2 = MoeRouting(ctx, T, k, E, opts)
    FL.moe_ffn_fused(ctx, empty((T, H), "float16"), R2, empty((E, 2 * F, H), "float16"), empty((E, H, F), "float16"),
                     stream=0, options=opts)
    assert events[-1]["defines"] == FL.layer_defines("float16", 1)


@pytest.mark.parametrize("bad", [
    dict(F=104),                        # no fused config pairs F = 104 (pair widths 64, 96, 112, 128)
    dict(F=100),                        # 2F not a multiple of 16
    dict(F=96, opts=MoeOptions(gemm_config=2)),  # the forced config's pair width 64 does not divide 96
    dict(x_dtype="float32"),            # not bf16 / fp16
    dict(wg_dtype="float16"),           # another dtype than x's
    dict(wd_dtype="float16"),
    dict(out_dtype="float32"),          # out must be x's dtype
    dict(out_rows=3),                   # not [T, H]
    dict(x_rows=5),                     # not the routing's T
    dict(wd_F=64),                      # w_down's F differs from w_gate_up's
    dict(H=60),                         # rows of 120 bytes: not a multiple of 16
    dict(wg_ndim=2),
    dict(wd_ndim=2),
    dict(low_latency=True),             # a low-latency routing
    dict(x_strided=True),               # x not C-contiguous
    dict(overlap=True),                 # out overlaps x
])
def test_bad_input_raises_before_launch(env, bad):
    events, maps, empty, ctx, ws = env
    T, k, E = 16, 2, 2
    H, F = bad.get("H", 128), bad.get("F", 128)
    opts = MoeOptions(mode="low_latency") if bad.get("low_latency") else bad.get("opts", MoeOptions())
    R = MoeRouting(ctx, T, k, E, opts)
    xdt = bad.get("x_dtype", "bfloat16")
    x = empty((bad.get("x_rows", T), H), xdt)
    if bad.get("x_strided"):  # every other row of a [2T, H] buffer
        x = DeviceArray(empty((2 * T, H), xdt).ptr, (T, H), xdt, (2 * H, 1), 0)
    wg = empty((E, 2 * F, H), bad.get("wg_dtype", xdt)) if bad.get("wg_ndim", 3) == 3 else empty((2 * F, H), xdt)
    wd = empty((E, H, bad.get("wd_F", F)), bad.get("wd_dtype", xdt)) if bad.get("wd_ndim", 3) == 3 else empty((H, F), xdt)
    out = None
    if "out_dtype" in bad or "out_rows" in bad:
        out = empty((bad.get("out_rows", T), H), bad.get("out_dtype", xdt))
    if bad.get("overlap"):
        out = x
    with pytest.raises((TypeError, ValueError)):
        FL.moe_ffn_fused(ctx, x, R, wg, wd, out, stream=0, options=opts)
    assert events == []


def test_options_and_path_choice():
    on = MoeOptions(one_kernel=True)
    assert on.checked() is on and MoeOptions(one_kernel=True, fused=True, fused_combine=True).checked()
    for bad in (dict(one_kernel=1), dict(mode="low_latency", one_kernel=True)):
        with pytest.raises(ValueError):
            MoeOptions(**bad).checked()
    assert MoeOptions().one_kernel is False  # off until GPU-validated
    path = LY.one_kernel_path
    assert path(2048, on, "bfloat16", "bfloat16") and path(96, on, "float16", "float16")
    assert not path(2048, on, "bfloat16", "float32")  # (the kernel's sums are stored in x's dtype)
    assert not path(100, on, "bfloat16", "bfloat16") and not path(72, on, "bfloat16", "bfloat16")
    assert not path(96, MoeOptions(one_kernel=True, gemm_config=2), "bfloat16", "bfloat16")
    assert not path(2048, MoeOptions(), "bfloat16", "bfloat16")


def test_layer_runs_route_then_the_one_kernel(env, monkeypatch):
    """moe_layer with one_kernel: the routing's kernels, then mk_moe_layer (nothing else: no dispatch, GEMM
    or combine launch); the plan says "layer"; the routing returned is the one the kernel filled."""
    events, maps, empty, ctx, ws = env
    monkeypatch.setattr(MO, "kernel", lambda src, defines, name: LoggedKernel(events, defines, name))
    monkeypatch.setattr(MO, "_memcpy", lambda *a: events.append(dict(kind="copy")))
    T, H, F, k, E = 40, 256, 128, 2, 4
    x, wg, wd = empty((T, H), "bfloat16"), empty((E, 2 * F, H), "bfloat16"), empty((E, H, F), "bfloat16")
    ids, w = empty((T, k), "int32"), empty((T, k), "float32")
    opts = MoeOptions(one_kernel=True)
    out, R = LY.moe_layer(ctx, x, wg, wd, topk_ids=ids, topk_weights=w, options=opts)
    names = [e.get("name") for e in events if e["kind"] == "launch"]
    assert names == ["mk_moe_route_tiles", "mk_moe_route_exchange", "mk_moe_route_slots", "mk_moe_layer"]
    l = events[-1]
    assert l["args"][8].x == x.ptr and l["args"][9].out == out.ptr and l["args"][8].recv_map == R.recv_map.ptr
    assert ctx.op_state("moe_layer").last_plan.combine == "layer"
    assert ctx.op_state("moe_layer").last_plan.swiglu == "epilogue"


@pytest.mark.parametrize("bad", ["H", "align", "overlap"])
def test_layer_bad_input_raises_before_routing(env, monkeypatch, bad):
    """moe_layer with one_kernel checks what the kernel needs before its first launch (the routing's): rows of
    x a multiple of 16 bytes, 16-byte aligned x, out not overlapping x."""
    events, maps, empty, ctx, ws = env
    monkeypatch.setattr(MO, "kernel", lambda src, defines, name: LoggedKernel(events, defines, name))
    monkeypatch.setattr(MO, "_memcpy", lambda *a: events.append(dict(kind="copy")))
    T, H, F, k, E = 40, 60 if bad == "H" else 256, 128, 2, 4
    x = empty((T, H), "bfloat16")
    if bad == "align":
        x = DeviceArray(x.ptr + 2, (T, H), "bfloat16", None, 0)
    out = x if bad == "overlap" else None
    wg, wd = empty((E, 2 * F, H), "bfloat16"), empty((E, H, F), "bfloat16")
    ids, w = empty((T, k), "int32"), empty((T, k), "float32")
    with pytest.raises(ValueError):
        LY.moe_layer(ctx, x, wg, wd, topk_ids=ids, topk_weights=w, out=out, options=MoeOptions(one_kernel=True))
    assert events == []
