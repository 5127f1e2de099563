"""GEMM+ReduceScatter's planner and workspace layout on the CPU (no GPU): the fused kernel's tile
ownership and order (mirrored by layout.tile_order), control words that depend on P only, the workspace
sizes, and the path choice (fused, unfused fallback, plain GEMM, empty)."""
from __future__ import annotations

import ctypes
import itertools

import pytest

from mkernel.dist.signals import MAX_CHUNKS, call_header_bytes
from mkernel.ops.gemm_rs import layout as LY
from mkernel.ops.gemm_rs import planner as PL
from mkernel.ops.gemm_rs.options import CostModel, GemmRsOptions

SPLITS = [(1, 1), (3, 5), (64, 64), (100, 0), (0, 77), (129, 128, 127), (1000, 0, 1, 257), (8,) * 8,
          (65, 130, 195, 260, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)]
TILES = [(64, 128), (128, 128), (128, 256), (128, 192), (128, 224)]


@pytest.mark.parametrize("m_sizes", SPLITS, ids=str)
@pytest.mark.parametrize("N", [1, 8, 136, 1000])
def test_every_output_element_has_one_tile_of_its_owner(m_sizes, N):
    """Every row of the output lies in exactly one tile row of its owner's grid, every column in one
    tile column; no tile reaches past its owner's rows (no straddling); flag indices are unique per owner
    and below the owner's tile count."""
    offs = LY.row_offsets(m_sizes)
    P = len(m_sizes)
    for (bm, bn), me in itertools.product(TILES, range(P)):
        tiles = LY.tile_order(m_sizes, N, bm, bn, me)
        cover = {}
        for t in tiles:
            assert offs[t.owner] <= t.row0 and t.row0 + t.rows <= offs[t.owner + 1], t  # inside its owner's rows
            assert 1 <= t.rows <= bm and 1 <= t.cols <= bn and t.col0 + t.cols <= N
            assert t.row0 == offs[t.owner] + t.tm * bm and t.col0 == t.tn * bn
            assert t.index == t.tm * -(-N // bn) + t.tn
            cover.setdefault(t.owner, []).append(t)
        for j in range(P):
            own = cover.get(j, [])
            assert len(own) == LY.owner_tiles(m_sizes[j], N, bm, bn)
            assert sorted(t.index for t in own) == list(range(len(own)))
            rows = sorted(r for t in own if t.tn == 0 for r in range(t.row0, t.row0 + t.rows))
            assert rows == list(range(offs[j], offs[j + 1]))  # every row of owner j once
            cols = sorted(c for t in own if t.tm == 0 for c in range(t.col0, t.col0 + t.cols))
            assert cols == (list(range(N)) if m_sizes[j] else [])


@pytest.mark.parametrize("m_sizes", SPLITS[1:], ids=str)
def test_rank_rotated_order_own_tiles_last(m_sizes):
    """Rank me's units go owner me+1, me+2, ..., me: every owner's tiles contiguous, its own last."""
    P = len(m_sizes)
    for me in range(P):
        order = [t.owner for t in LY.tile_order(m_sizes, 300, 128, 128, me)]
        owners = [o for i, o in enumerate(order) if i == 0 or order[i - 1] != o]  # runs
        expect = [(me + k) % P for k in range(1, P + 1) if m_sizes[(me + k) % P] > 0]
        assert owners == expect
        if m_sizes[me]:
            assert order[-1] == me


def test_raster_matches_super_rows():
    """raster() is mk_raster: group_m tile-rows at a time, column by column inside a super-row."""
    seen = [LY.raster(i, 10, 3, 4) for i in range(30)]
    assert sorted(seen) == [(m, n) for m in range(10) for n in range(3)]
    assert seen[:5] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1)]
    assert seen[-2:] == [(8, 2), (9, 2)]  # the last super-row has two tile-rows


def test_default_split_and_m_sizes():
    assert LY.split_rows(10, 4) == (3, 3, 2, 2)
    assert LY.split_rows(3, 4) == (1, 1, 1, 0)
    assert PL.m_sizes_for(10, 4) == (3, 3, 2, 2)
    assert PL.m_sizes_for(10, 2, (10, 0)) == (10, 0)
    for bad in ((5, 4), (5, 5, 0), (11, -1)):
        with pytest.raises(ValueError):
            PL.m_sizes_for(10, 2, bad)


@pytest.mark.parametrize("P", [2, 3, 4, 8, 16])
def test_control_words_do_not_move_with_the_shape(P):
    """Epoch state, call header and every ready flag sit at offsets that depend on P only: a call of another
    shape, config or partial dtype never finds a control word on bytes an earlier call left as data."""
    ref = LY.control_offsets(P)
    consumed, flags, end = ref
    assert consumed >= 16 and flags >= consumed + call_header_bytes(P) and flags % 256 == 0
    assert end == flags + 8 * P * LY.FLAGS_PER_SOURCE
    for m_sizes, N, (bm, bn), isz in [((1,) * P, 8, (64, 128), 2), ((4096,) * P, 8192, (128, 256), 2),
                                      (tuple(range(P)), 1000, (128, 192), 4), ((77,) * P, 65536, (128, 224), 2)]:
        ws = LY.workspace_layout(m_sizes, N, bm, bn, isz)
        assert (ws.consumed_off, ws.flags_off) == (consumed, flags)
        assert ws.data_off >= end and ws.data_off % 4096 == 0
        L = ws.struct()
        assert (L.consumed_off, L.flags_off, L.flag_stride) == (consumed, flags, LY.FLAGS_PER_SOURCE)


def test_workspace_slots():
    """P - 1 slots, each the largest owner's tiles (whole bm x bn tiles of the partial dtype)."""
    ws = LY.workspace_layout((300, 200, 100), 1000, 128, 256, 2)
    tiles = LY.owner_tiles(300, 1000, 128, 256)
    assert tiles == 3 * 4
    assert ws.slot_bytes >= tiles * 128 * 256 * 2 and ws.slot_bytes % 4096 == 0
    assert ws.total == ws.data_off + 2 * ws.slot_bytes
    with pytest.raises(ValueError, match="ready flags"):
        LY.workspace_layout((64 * LY.FLAGS_PER_SOURCE + 1, 1), 128, 64, 128, 2)


def test_args_struct_mirrors_the_kernel():
    """RsArgs is gemm_rs.cu's struct: natural alignment, 176 bytes (the kernel static_asserts the size)."""
    assert ctypes.sizeof(LY.RsArgs) == 176 and ctypes.sizeof(LY.RsLayout) == 40
    assert ctypes.sizeof(LY.OwnerRows) == 4 * (4 + LY.MAXP + 1)
    assert LY.RsArgs.L.offset == 32 and LY.RsArgs.rows.offset == 72 and LY.RsArgs.K.offset == 156
    assert LY.FLAGS_PER_SOURCE == LY.FLAG_ROWS_PER_SOURCE * MAX_CHUNKS


def test_slot_of_sender():
    """The device's mk_rs_slot: owner j keeps P - 1 slots, one per other rank, in rank-rotated order."""
    def slot(src, owner, P):
        d = src - owner
        return (d if d > 0 else d + P) - 1
    for P in (2, 3, 8):
        for owner in range(P):
            assert sorted(slot(s, owner, P) for s in range(P) if s != owner) == list(range(P - 1))


def test_registered_specializations():
    from mkernel.core.compiler import registered_specializations

    specs = [d for s, d in registered_specializations() if s == LY.SOURCE]
    assert len(specs) == 2 * len(LY.FUSED_CONFIGS) * 3
    assert sum("MK_RS_PARTIAL" in d for d in specs) == 2 * len(LY.FUSED_CONFIGS)


# ---- the path choice ----------------------------------------------------------------------------------
def _plan(m_sizes, N, Ks, me=0, **kw):
    kw.setdefault("b_layout", "nk")
    return PL.plan(m_sizes, N, Ks, me, in_dtype="bfloat16", out_dtype=kw.pop("out_dtype", "bfloat16"), sms=132, **kw)


def test_trivial_paths():
    assert _plan((0, 0), 128, (64, 64)).path == "empty"
    assert _plan((8, 8), 0, (64, 64)).path == "empty"
    p = _plan((100,), 128, (64,))
    assert p.path == "gemm" and p.grid == 0


def test_compute_bound_shapes_fuse():
    """Row-parallel projections with K_r in the thousands: the GEMM hides the partials' transfer."""
    for P, M, N, K in [(2, 8192, 8192, 4096), (8, 16384, 16384, 2048), (4, 4096, 8192, 7168)]:
        p = _plan(PL.m_sizes_for(M, P), N, (K,) * P)
        assert p.path == "fused", p
        assert p.predicted_fused < p.predicted_unfused
        assert p.config in LY.FUSED_CONFIGS and p.grid == min(132, p.units)
        assert p.ws is not None and p.ws.total > p.ws.data_off


def test_few_tiles_long_k_falls_back():
    """Few output tiles and a long K: the fused kernel leaves most SMs idle where mkernel.gemm splits K."""
    p = _plan((128, 128), 512, (32768, 32768))
    assert p.path == "unfused" and p.predicted_fused > p.predicted_unfused
    assert "unfused" in p.reason
    assert _plan((128, 128), 512, (32768, 32768), options=GemmRsOptions(path="fused")).path == "fused"


def test_unfusable_calls():
    p = _plan((64, 64), 256, (64, 0))
    assert p.path == "unfused" and "K_r = 0" in p.reason and p.predicted_fused is None
    with pytest.raises(ValueError, match="not possible"):
        _plan((64, 64), 256, (64, 0), options=GemmRsOptions(path="fused"))
    p = _plan((1,) * 17, 256, (64,) * 17)
    assert p.path == "unfused" and "local ranks" in p.reason
    # more tiles per owner than flags, whatever the config: unfused
    p = _plan((64 * LY.FLAGS_PER_SOURCE, 8), 128 * 8, (64, 64))
    assert p.path == "unfused" and "flags" in p.reason


def test_forced_options():
    m, N, K = (4096, 4096), 8192, (4096, 4096)
    assert _plan(m, N, K, options=GemmRsOptions(path="unfused")).path == "unfused"
    p = _plan(m, N, K, options=GemmRsOptions(config=2))
    assert p.path == "fused" and p.config == 2
    p = _plan(m, N, K, options=GemmRsOptions(partial_dtype="float32"))
    assert p.partial_dtype == "float32" and p.ws.slot_bytes >= 2 * _plan(m, N, K).ws.slot_bytes - 4096
    assert _plan(m, N, K, options=GemmRsOptions(path="unfused", partial_dtype="float32")).partial_dtype == "bfloat16"
    # config 5's 224 columns exist with B "nk" only: with "kn" its tile is 256 wide
    assert _plan(m, 7168, K, b_layout="kn", options=GemmRsOptions(config=5)).ws.slot_bytes >= 32 * 28 * 128 * 256 * 2


def test_plans_agree_across_ranks():
    """Every rank computes the same decision (path, config, workspace): only grid / units are its own."""
    m_sizes, N, Ks = (1000, 24, 3000, 0), 4104, (1024, 2048, 1024, 512)
    plans = [_plan(m_sizes, N, Ks, me) for me in range(4)]
    for p in plans:
        assert (p.path, p.config, p.ws, p.predicted_fused) == (plans[0].path, plans[0].config, plans[0].ws,
                                                                plans[0].predicted_fused)
    assert {p.units for p in plans} == {plans[0].units}  # every rank computes every owner's tiles


def test_model_knobs_move_the_choice():
    m, N, K = (8192, 8192), 8192, (512, 512)
    slow_link = GemmRsOptions(model=CostModel(sm_push_bw=0.5e9))
    assert _plan(m, N, K).path == "fused"
    assert _plan(m, N, K, options=slow_link).path == "unfused"


def test_options_checked():
    GemmRsOptions().checked()
    assert GemmRsOptions(m_sizes=[3, 4]).m_sizes == (3, 4)
    import numpy as np

    assert GemmRsOptions(m_sizes=np.array([3, 4])).m_sizes == (3, 4)
    for bad in (dict(path="fast"), dict(config=6), dict(config=0), dict(partial_dtype="int8"), dict(m_sizes=(1, -2)),
                dict(m_sizes=(1.5, 2)), dict(model=CostModel(link_bw=0))):
        with pytest.raises(ValueError):
            GemmRsOptions(**bad).checked()
    with pytest.raises(TypeError):
        GemmRsOptions(model="fast").checked()
