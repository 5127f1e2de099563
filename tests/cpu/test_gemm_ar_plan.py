"""GEMM+AllReduce's planner and workspace layout on the CPU (no GPU): the bandwidth path's owners split on
tile rows, control words that depend on P only, the workspaces, the argument struct, the registered
specializations, the path choice (latency with plain or transposed tiles, bandwidth, unfused fallback, plain
GEMM, empty) -- and, on the Python mirrors of the kernel's tile sequences, the deadlock-freedom argument of
both protocols (a randomized interleaving of every rank's blocks always finishes) and the fixed sum order
(every rank gets the same bits)."""
from __future__ import annotations

import ctypes
import math
import random

import numpy as np
import pytest

from mkernel.dist.signals import call_header_bytes
from mkernel.ops import gemm as G
from mkernel.ops.gemm_ar import layout as LY
from mkernel.ops.gemm_ar import planner as PL
from mkernel.ops.gemm_ar.options import CostModel, GemmArOptions
from mkernel.ops.gemm_comm import FLAGS_PER_SOURCE, raster, row_offsets, tile_order


# ---- owners, workspace, struct ------------------------------------------------------------------------
@pytest.mark.parametrize("M", [1, 63, 64, 65, 1000, 1001, 4096, 5000])
@pytest.mark.parametrize("P", [2, 3, 4, 8])
@pytest.mark.parametrize("bm", [64, 128])
def test_owner_rows_split_on_tile_rows(M, P, bm):
    """Owners' rows start on tile boundaries and cover M once; only the last non-empty owner ends inside a
    tile (at M); tile rows as even as possible (the first owners one more)."""
    m = LY.owner_rows(M, P, bm)
    offs = row_offsets(m)
    assert len(m) == P and offs[-1] == M and all(x >= 0 for x in m)
    for j in range(P):
        assert offs[j] % bm == 0 or offs[j] == M
        if offs[j + 1] != M:
            assert m[j] % bm == 0
    tile_rows = [math.ceil(x / bm) for x in m]
    assert sum(tile_rows) == math.ceil(M / bm) and max(tile_rows) - min(tile_rows) <= 1
    assert tile_rows == sorted(tile_rows, reverse=True)


@pytest.mark.parametrize("P", [2, 3, 8, 16])
def test_control_words_do_not_move_with_the_shape_or_the_path(P):
    consumed, flags, gflags, end = LY.control_offsets(P)
    assert consumed >= 16 and flags >= consumed + call_header_bytes(P) and flags % 256 == 0
    assert gflags == flags + 8 * P * FLAGS_PER_SOURCE and end == gflags + 8 * P * FLAGS_PER_SOURCE
    wss = [LY.latency_workspace(P, 1, 64, 16, 2), LY.latency_workspace(P, 4096, 128, 256, 4),
           LY.bandwidth_workspace(LY.owner_rows(8192, P, 128), 8192, 128, 256, 2, 2),
           LY.bandwidth_workspace(LY.owner_rows(100, P, 64), 1000, 64, 128, 4, 4)]
    for ws in wss:
        assert (ws.consumed_off, ws.flags_off, ws.gflags_off) == (consumed, flags, gflags)
        assert ws.data_off >= end and ws.data_off % 4096 == 0
        L, g = ws.rs_struct(), ws.gather_struct()
        assert (L.consumed_off, L.flags_off, L.flag_stride) == (consumed, flags, FLAGS_PER_SOURCE)
        assert g.flags_off == gflags


def test_workspaces():
    """Latency: P slots of every tile; bandwidth: P - 1 partial slots and P - 1 gather slots of the largest
    owner's tiles (the gather slots in out's dtype)."""
    ws = LY.latency_workspace(4, 100, 64, 128, 2)
    assert ws.slot_bytes >= 100 * 64 * 128 * 2 and ws.total == ws.data_off + 4 * ws.slot_bytes
    m = LY.owner_rows(1000, 3, 128)  # 8 tile rows: 3, 3, 2
    ws = LY.bandwidth_workspace(m, 1000, 128, 256, 2, 4)
    most = 3 * 4
    assert ws.slot_bytes >= most * 128 * 256 * 2 and ws.gslot_bytes >= most * 128 * 256 * 4
    assert ws.gdata_off == ws.data_off + 2 * ws.slot_bytes and ws.total == ws.gdata_off + 2 * ws.gslot_bytes
    with pytest.raises(ValueError, match="ready flags"):
        LY.latency_workspace(2, FLAGS_PER_SOURCE + 1, 64, 128, 2)
    with pytest.raises(ValueError, match="ready flags"):
        LY.bandwidth_workspace((64 * FLAGS_PER_SOURCE + 64, 0), 128, 64, 128, 2, 2)


def test_args_struct_mirrors_the_kernel():
    """ArArgs is gemm_ar.cu's struct: natural alignment, 200 bytes (the kernel static_asserts the size)."""
    A = LY.ArArgs
    assert ctypes.sizeof(A) == 200
    assert (A.L.offset, A.G.offset, A.rows.offset, A.M.offset, A.K.offset, A.c_tma.offset) == (32, 72, 96, 180, 184, 192)


def test_registered_specializations():
    from mkernel.core.compiler import registered_specializations

    specs = [d for s, d in registered_specializations() if s == LY.SOURCE]
    assert len(specs) == len({tuple(sorted(d.items())) for d in specs}) == 36
    assert all(d["MK_AR_PATH"] == 0 for d in specs if d.get("MK_GEMM_SWAP"))
    assert {d["MK_GEMM_CONFIG"] for d in specs if d.get("MK_GEMM_SWAP")} == set(LY.TRANSPOSED_CONFIGS)
    assert {d["MK_GEMM_CONFIG"] for d in specs if d["MK_AR_PATH"] == 1} == set(LY.BANDWIDTH_CONFIGS)
    with pytest.raises(ValueError, match="latency path only"):
        LY.kernel_defines("bfloat16", "bfloat16", 53, "bandwidth", transposed=True)
    d = LY.kernel_defines("bfloat16", "bfloat16", 3, "bandwidth", "float32")
    assert d["MK_AR_PARTIAL"] == 2 and "MK_AR_PARTIAL" not in LY.kernel_defines("bfloat16", "float32", 3, "latency",
                                                                                 "float32")


# ---- the path choice ----------------------------------------------------------------------------------
def _plan(M, N, Ks, me=0, **kw):
    kw.setdefault("b_layout", "nk")
    return PL.plan(M, N, Ks, me, in_dtype="bfloat16", out_dtype=kw.pop("out_dtype", "bfloat16"), sms=132, **kw)


def test_trivial_paths():
    assert _plan(0, 128, (64, 64)).path == "empty"
    assert _plan(8, 0, (64, 64)).path == "empty"
    p = _plan(100, 128, (64,))
    assert p.path == "gemm" and p.grid == 0


@pytest.mark.parametrize("M", [1, 8, 16, 17, 32])
def test_decode_nk_runs_transposed_on_the_decode_tiles(M):
    """B "nk", M <= 32: the latency path on mkernel.gemm's decode tiles, transposed (53 up to 16 rows, 54)."""
    p = _plan(M, 8192, (4096, 4096))
    assert p.path == "latency" and p.transposed and p.config == (53 if M <= 16 else 54), p
    assert p.units == 8192 // 64 * math.ceil(M / G.CONFIGS[p.config].tile_n("nk")) and p.grid == min(132, p.units)
    assert p.predicted_latency < p.predicted_unfused
    q = _plan(M, 8192, (4096, 4096), options=GemmArOptions(transposed=False))
    assert q.path == "latency" and not q.transposed and q.config in (1, 3)


@pytest.mark.parametrize("M", [1, 8, 32, 128])
def test_decode_kn_runs_plain(M):
    """B "kn": plain tiles (config 53's 64 x 64 "kn" tile where it makes more tiles than 64 x 128)."""
    p = _plan(M, 8192, (4096, 4096), b_layout="kn")
    assert p.path == "latency" and not p.transposed and p.config in LY.LATENCY_CONFIGS, p
    if M <= 64:
        assert p.config == 53 and p.units == 8192 // 64


@pytest.mark.parametrize("M", [4096, 8192, 16384, 32768])
def test_large_m_runs_the_bandwidth_path(M):
    for N, K in ((8192, 4096), (16384, 8192)):
        p = _plan(M, N, (K, K))
        assert p.path == "bandwidth" and p.config in LY.BANDWIDTH_CONFIGS, p
        assert p.m_sizes == LY.owner_rows(M, 2, G.CONFIGS[p.config].bm)
        assert p.predicted_bandwidth < p.predicted_unfused and p.ws.gslot_bytes > 0


def test_forced_and_impossible():
    assert _plan(8192, 8192, (4096, 4096), options=GemmArOptions(path="latency")).path == "latency"
    assert _plan(8, 8192, (4096, 4096), options=GemmArOptions(path="bandwidth")).path == "bandwidth"
    assert _plan(8, 8192, (4096, 4096), options=GemmArOptions(path="unfused")).path == "unfused"
    p = _plan(8192, 8192, (4096, 4096), options=GemmArOptions(config=2))
    assert p.path == "bandwidth" and p.config == 2
    with pytest.raises(ValueError, match="not possible"):
        _plan(8, 8192, (4096, 4096), options=GemmArOptions(path="latency", config=2))
    p = _plan(64, 256, (64, 0))
    assert p.path == "unfused" and "K_r = 0" in p.reason and p.predicted_latency is None
    with pytest.raises(ValueError, match="not possible"):
        _plan(64, 256, (64, 0), options=GemmArOptions(path="bandwidth"))
    p = _plan(64, 256, (64,) * 17)
    assert p.path == "unfused" and "local ranks" in p.reason
    p = _plan(16, 4096, (512, 512), options=GemmArOptions(partial_dtype="float32"))
    assert p.partial_dtype == "float32" and p.ws.slot_bytes >= 64 * 16 * 4 * (4096 // 64)
    assert _plan(16, 4096, (512, 512), options=GemmArOptions(path="unfused", partial_dtype="float32")
                 ).partial_dtype == "bfloat16"
    # a transposed config forced on M > 32 rows or B "kn": plain tiles
    p = _plan(256, 4096, (512, 512), options=GemmArOptions(path="latency", config=53))
    assert p.path == "latency" and not p.transposed


def test_plans_agree_across_ranks():
    """Every rank computes the same decision (path, config, workspace, grid): only ``me`` differs."""
    for M, N, Ks in ((8, 8192, (1024, 2048, 1024, 512)), (8192, 8192, (1024, 2048, 1024, 512))):
        plans = [_plan(M, N, Ks, me) for me in range(4)]
        for p in plans:
            assert (p.path, p.config, p.ws, p.grid, p.m_sizes, p.transposed) == (
                plans[0].path, plans[0].config, plans[0].ws, plans[0].grid, plans[0].m_sizes, plans[0].transposed)


def test_model_knobs_move_the_choice():
    m, N, K = 16384, 8192, (512, 512)
    assert _plan(m, N, K).path in ("latency", "bandwidth")
    slow = GemmArOptions(model=CostModel(sm_push_bw=0.2e9))
    assert _plan(m, N, K, options=slow).path == "unfused"


def test_options_checked():
    GemmArOptions().checked()
    for bad in (dict(path="fast"), dict(config=6), dict(config=0), dict(config=True), dict(partial_dtype="int8"),
                dict(model=CostModel(link_bw=0))):
        with pytest.raises(ValueError):
            GemmArOptions(**bad).checked()
    with pytest.raises(TypeError):
        GemmArOptions(model="fast").checked()
    with pytest.raises(TypeError):
        GemmArOptions(transposed=1).checked()
    assert hash(GemmArOptions(config=3)) == hash(GemmArOptions(config=3))


# ---- the protocols on the Python mirrors of the tile sequences -------------------------------------
def _linear_tiles(M, N, bm, bn):
    num_m, num_n = math.ceil(M / bm), math.ceil(N / bn)
    return [raster(i, num_m, num_n, G.GROUP_M) for i in range(num_m * num_n)]


def _run(blocks, ready, seed):
    """Step every rank's blocks (generators yielding a wait predicate before each wait) in a random order
    until all finish; fail if no block can move (a deadlock)."""
    rng = random.Random(seed)
    live = {k: (g, next(g, None)) for k, g in blocks.items()}
    live = {k: v for k, v in live.items() if v[1] is not None}
    while live:
        movable = [k for k, (g, wait) in live.items() if wait()]
        assert movable, f"deadlock: every live block waits ({sorted(live)[:6]} ...)"
        k = rng.choice(movable)
        g, _ = live[k]
        nxt = next(g, None)
        if nxt is None:
            del live[k]
        else:
            live[k] = (g, nxt)


@pytest.mark.parametrize("P,M,N,grid", [(2, 200, 1000, 7), (3, 64, 640, 5), (4, 130, 300, 3), (2, 1, 256, 4)])
def test_latency_protocol_never_deadlocks(P, M, N, grid):
    """Every rank's block b walks tiles b, b + grid, ... of the same sequence; per tile it pushes (raises its
    flag in every peer) and then waits for every peer's flag of that tile."""
    tiles = _linear_tiles(M, N, 64, 128)
    for seed in range(20):
        ready = set()  # (src, tile)

        def block(r, b):
            for t in tiles[b::grid]:
                ready.add((r, t))  # push + flag (waits only for announcement / consumption: raised up front)
                yield lambda t=t: all((s, t) in ready for s in range(P))
        _run({(r, b): block(r, b) for r in range(P) for b in range(grid)}, ready, seed)


@pytest.mark.parametrize("P,M,N,grid", [(2, 1000, 1000, 7), (3, 700, 300, 4), (4, 1300, 520, 9), (2, 100, 256, 3)])
def test_bandwidth_protocol_never_deadlocks(P, M, N, grid):
    """Rank r's block b walks units b, b + grid, ... of MkOwnerScheduler's order (peers' tiles, own tiles
    last): a peer tile is pushed (its ready flag raised), an own tile waits for every peer's ready flag then
    raises its gather flags; after its tiles the block takes receive units (peers' tiles, rotated workers)
    and waits for their gather flags."""
    bm, bn = 128, 128
    m_sizes = LY.owner_rows(M, P, bm)
    for seed in range(20):
        ready, gath = set(), set()

        def block(r, b):
            order = tile_order(m_sizes, N, bm, bn, r)
            for t in order[b::grid]:
                if t.owner != r:
                    ready.add((r, t.owner, t.index))
                else:
                    yield lambda t=t: all((s, r, t.index) in ready for s in range(P) if s != r)
                    gath.add((r, t.index))
            units = len(order)
            worker = (b - units % grid) % grid
            for t in [t for t in order if t.owner != r][worker::grid]:
                yield lambda t=t: (t.owner, t.index) in gath
        _run({(r, b): block(r, b) for r in range(P) for b in range(grid)}, None, seed)


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_one_shot_sum_order_gives_every_rank_the_same_bits(P):
    """The latency epilogue's order (P == 2: own + peer; rank 0: own, then 1..P-1; else slot 0, 1, ...,
    P-1 with the own partial in its slot), each rank's own partial rounded to the partial dtype as it was
    sent: the same fp32 bits on every rank."""
    rng = np.random.default_rng(P)
    parts = [rng.standard_normal(4096).astype(np.float32) * 10.0 ** rng.integers(-3, 4, 4096) for _ in range(P)]
    parts = [p.astype(np.float16).astype(np.float32) for p in parts]  # (rounded to the partial dtype)
    results = []
    for me in range(P):
        acc = parts[me].copy()
        if P == 2:
            acc = acc + parts[1 - me]
        else:
            if me > 0:
                acc = parts[0].copy()
            for s in range(1, P):
                acc = acc + parts[s]
        results.append(acc.view(np.uint32))
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])
