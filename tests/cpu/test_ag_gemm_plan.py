"""AllGather+GEMM host logic on the CPU: the planner's path choice and its copy-engine chunking, the
side stream's copy list (order, flag addresses, the local rows read in place), path validation."""
from __future__ import annotations

import numpy as np
import pytest

from mkernel.core import compiler as CP
from mkernel.core.arrays import DeviceArray
from mkernel.ops import gemm as G
from mkernel.ops.ag_gemm import AgGemmOptions
from mkernel.ops.ag_gemm import layout as LY
from mkernel.ops.ag_gemm import op as OPM
from mkernel.ops.ag_gemm import planner as PL


def test_plan_prefers_copy_engines_where_communication_matters():
    p = PL.plan([2048, 2048], 5120, 8192, 2, 132)  # Llama-3-70B qkv, M = 4096 over 2 GPUs
    assert p.path == "fused_ce" and p.workers == 132 and p.comm_sms == 0, p.describe()
    assert p.chunk_rows >= 128 and p.chunk_rows & (p.chunk_rows - 1) == 0
    assert -(-2048 // p.chunk_rows) <= PL.MODEL.ce_chunks
    tiny = PL.plan([128, 128], 1024, 1024, 2, 132)
    assert tiny.path == "unfused", tiny.describe()
    assert PL.plan([64], 256, 256, 2, 132).path == "unfused"  # one rank: nothing to gather
    # mKernel's M = K = 4096 sweep point (N = 256 per rank): communication is most of the call and
    # the copy engines start on the peer's shard at once (own rows read in place): measured fused_ce
    # 0.093 ms vs unfused 0.130 and NCCL + cuBLAS 0.127 (docs/journal/validation.md)
    sweep = PL.plan([2048, 2048], 256, 4096, 2, 132)
    assert sweep.path == "fused_ce", sweep.describe()
    assert sweep.predicted_fused < 0.9 * sweep.predicted_unfused


def test_sm_paths_cut_shards_for_their_blocks():
    """SM communication: every pushing block gets >= chunks_per_block chunks of the largest shard,
    down to min_chunk_bytes (a power of two of rows); the unfused gather takes the collectives' grid:
    every SM from 2 MiB shards, SMALL_SLOT_BLOCKS below."""
    from mkernel.ops.collectives import layout as C

    m = PL.MODEL
    rb = 4096 * 2  # the M = K = 4096 sweep point: 2048-row shards of 8 KiB rows
    for n in (4, 8, 16, 32):
        p = PL.plan([2048, 2048], 256, 4096, 2, 132, comm_sms=n)
        nch = -(-2048 // p.chunk_rows)
        assert p.chunk_rows & (p.chunk_rows - 1) == 0 and p.chunk_rows * rb >= m.min_chunk_bytes
        assert nch >= min(m.chunks_per_block * n, 2048 * rb // m.min_chunk_bytes), (n, p.chunk_rows)
        assert p.chunk_rows <= PL.chunk_rows_for([2048, 2048], rb)  # never coarser than before
    u = PL.plan([2048, 2048], 256, 4096, 2, 132, force_path="unfused")
    assert u.gather_blocks == 132 and -(-2048 // u.chunk_rows) >= 132, u.describe()
    small = PL.plan([100, 100], 256, 4096, 2, 132, force_path="unfused")  # 800 KiB shards
    assert small.gather_blocks <= C.SMALL_SLOT_BLOCKS and small.chunk_rows * rb >= m.min_chunk_bytes
    # rows wider than min_chunk_bytes: one row per chunk at least (8 by the hook's limit)
    assert PL.chunk_rows_for([4096, 4096], 128 << 10, blocks=132) == 8


def test_plan_overrides():
    assert PL.plan([128, 128], 1024, 1024, 2, 132, force_path="fused_ce").path == "fused_ce"
    assert PL.plan([2048, 2048], 5120, 8192, 2, 132, force_path="unfused").path == "unfused"
    p = PL.plan([2048, 2048], 5120, 8192, 2, 132, comm_sms=6)
    assert p.path == "fused" and p.comm_sms == 6 and p.workers == 126
    assert PL.plan([2048, 2048], 5120, 8192, 2, 132, comm_sms=0).path == "unfused"
    assert PL.ce_chunk_rows([1000, 1100]) == 512 and PL.ce_chunk_rows([3, 5]) == 128


def test_plan_last_wave_split():
    """Llama-3-405B mlp_up at M = 1024 over 2 GPUs: 832 tiles of 128 x 256 on 132 workers leave a last
    wave of 40 tiles, split in 3 along K; never with tail_split=False; K too short to pay for it: none."""
    p = PL.plan([512, 512], 26624, 16384, 2, 132)
    assert p.path == "fused_ce" and p.config == 3 and (p.splits, p.split_from) == (3, 792), p.describe()
    assert "splits=3" in p.describe()
    off = PL.plan([512, 512], 26624, 16384, 2, 132, tail_split=False)
    assert off.splits == 1 and off.predicted_gemm > p.predicted_gemm
    assert PL.plan([512, 512], 26624, 256, 2, 132, tail_split=True, force_path="fused_ce").splits == 1
    # fewer tiles than SMs: no whole-wave split, but every tile (8 of 64 x 128, K = 16384) split 16 ways
    # over the idle workers: the own shard's tiles would otherwise bound the call
    tiny = PL.plan([64, 64], 512, 16384, 2, 132, force_path="fused_ce")
    assert (tiny.splits, tiny.split_from) == (16, 0), tiny.describe()
    assert PL.plan([64, 64], 512, 16384, 2, 132, force_path="fused_ce", tail_split=False).splits == 1


def test_default_options_from_the_environment(mkenv):
    """MKERNEL_AG_GEMM_* set the default options (re-read on env.reload: the mkenv fixture); options passed
    explicitly are what they say."""
    for v, want in (("", None), ("auto", None), ("0", False), ("1", True)):
        mkenv("MKERNEL_AG_GEMM_TAIL_SPLIT", v)
        assert AgGemmOptions.default().tail_split is want
    with pytest.raises(ValueError, match="MKERNEL_AG_GEMM_TAIL_SPLIT"):
        mkenv("MKERNEL_AG_GEMM_TAIL_SPLIT", "yes")
    mkenv("MKERNEL_AG_GEMM_TAIL_SPLIT")
    assert AgGemmOptions.default() == AgGemmOptions()
    mkenv("MKERNEL_AG_GEMM_PATH", "unfused")
    mkenv("MKERNEL_AG_GEMM_FUSED_AUTO", "1")
    mkenv("MKERNEL_AG_GEMM_MODEL", "per_block_bw=15e9, ce_chunks=8")
    d = AgGemmOptions.default()
    assert (d.path, d.fused_auto, d.model.per_block_bw, d.model.ce_chunks) == ("unfused", True, 15e9, 8)
    assert AgGemmOptions.default() is d  # (cached until the environment is read again)
    assert d.with_forced(path="fused_ce") is d.with_forced(path="fused_ce")  # (a cheap key, call after call)
    assert d.with_forced(comm_sms=0).path == "unfused" and d.with_forced() is d
    mkenv("MKERNEL_AG_GEMM_PATH", "fast")
    with pytest.raises(ValueError, match="MKERNEL_AG_GEMM_PATH"):
        AgGemmOptions.default()
    mkenv("MKERNEL_AG_GEMM_PATH")
    mkenv("MKERNEL_AG_GEMM_MODEL", "speed=1")
    with pytest.raises(ValueError, match="MKERNEL_AG_GEMM_MODEL: unknown field 'speed'"):
        AgGemmOptions.default()


@pytest.mark.parametrize("bad,match", [(dict(path="fast"), "path"), (dict(comm_sms=-1), "comm_sms"),
                                       (dict(comm_sms=True), "comm_sms"), (dict(config=6), "config"),
                                       (dict(tail_split=2), "tail_split"), (dict(fused_auto=None), "fused_auto"),
                                       (dict(model=PL.CostModel(link_bw=0.0)), "CostModel.link_bw"),
                                       (dict(model=PL.CostModel(max_comm_sms=2.5)), "CostModel.max_comm_sms")])
def test_options_checked(bad, match):
    with pytest.raises(ValueError, match=match):
        AgGemmOptions(**bad).checked()
    with pytest.raises(TypeError, match="CostModel"):
        AgGemmOptions(model={"link_bw": 1.0}).checked()
    assert AgGemmOptions(path="fused", comm_sms=8, config=0, tail_split=True).checked()


class _Ws:
    ptr = 1 << 40

    @staticmethod
    def peer_ptr(j, offset=0):
        return (1 << 44) * (j + 1) + offset


@pytest.mark.parametrize("local_map", [True, False])
def test_ce_copies(local_map):
    P, me, K = 3, 1, 64
    m_sizes = (300, 200, 100)
    p = PL.plan(m_sizes, 512, K, 2, 132, force_path="fused_ce")
    L = LY.workspace_layout(P, m_sizes, p.chunk_rows, K * 2)
    offs = (0, 300, 500, 600)
    A = DeviceArray(1 << 36, (200, K), "bfloat16", None, 0, None)
    copies = OPM.ce_copies(p.chunk_rows, p.ce_group_max, L, offs, _Ws, A.ptr, me, K * 2, local_map)
    rb, cr = K * 2, p.chunk_rows
    nch = -(-200 // cr)
    dests = [2, 0] if local_map else [1, 2, 0]  # rank-rotated, me+1 first
    assert len(copies) == 2 * nch * len(dests)
    i = 0
    for d in dests:
        base = _Ws.ptr if d == me else _Ws.peer_ptr(d)
        for c in range(nch):
            dst, src, n = copies[i]
            assert dst == base + L.data_off + offs[me] * rb + c * cr * rb and src == A.ptr + c * cr * rb
            assert n == min(cr, 200 - c * cr) * rb
            fdst, fsrc, fn = copies[i + 1]
            assert fdst == base + L.flags_off + 8 * (me * L.nch_stride + c) and fsrc == _Ws.ptr + L.value_off and fn == 8
            i += 2
    assert L.value_off >= L.flags_off + 8 * P * L.nch_stride and L.data_off >= L.value_off + 8


@pytest.mark.parametrize("nch,gmax,want", [(1, 64, [1]), (2, 64, [1, 1]), (5, 64, [1, 2, 1, 1]),
                                           (8, 64, [4, 2, 1, 1]), (64, 16, [16, 16, 16, 8, 4, 2, 1, 1]),
                                           (7, 1, [1] * 7), (0, 64, [])])
def test_ce_copy_groups(nch, gmax, want):
    assert PL.ce_copy_groups(nch, gmax) == want


def test_ce_copy_groups_cover_every_chunk_once():
    for nch in range(1, 300):
        for gmax in (1, 2, 8, 64, 1000):
            g = PL.ce_copy_groups(nch, gmax)
            assert sum(g) == nch and min(g) >= 1 and max(g) <= min(max(gmax, 1), LY.CE_VALUES)
            assert g[-1] == 1  # the rows that land last are one chunk: the least GEMM work after the transfer


def test_ce_copies_in_groups():
    """A grouped plan: one data copy per group of consecutive chunks, each followed by one flag copy of
    as many consecutive ready flags, from the CE_VALUES flag-value slots."""
    P, me, K = 2, 0, 64
    m_sizes = (1000, 1000)
    p = PL.plan(m_sizes, 512, K, 2, 132, force_path="fused_ce")
    p.chunk_rows, p.ce_group_max = 128, 4
    L = LY.workspace_layout(P, m_sizes, p.chunk_rows, K * 2)
    A = DeviceArray(1 << 36, (1000, K), "bfloat16", None, 0, None)
    copies = OPM.ce_copies(p.chunk_rows, p.ce_group_max, L, (0, 1000, 2000), _Ws, A.ptr, me, K * 2, True)
    groups = PL.ce_copy_groups(8, 4)
    assert groups == [4, 2, 1, 1]
    assert len(copies) == 2 * len(groups)
    rb, c = K * 2, 0
    for i, g in enumerate(groups):
        dst, src, n = copies[2 * i]
        assert dst == _Ws.peer_ptr(1) + L.data_off + c * 128 * rb and src == A.ptr + c * 128 * rb
        assert n == (min(1000, (c + g) * 128) - c * 128) * rb
        fdst, fsrc, fn = copies[2 * i + 1]
        assert fdst == _Ws.peer_ptr(1) + L.flags_off + 8 * (me * L.nch_stride + c)
        assert fsrc == _Ws.ptr + L.value_off and fn == 8 * g <= 8 * LY.CE_VALUES
        c += g
    assert c == 8 and L.value_off + 8 * LY.CE_VALUES <= L.go_off


def test_env_defines(monkeypatch):
    monkeypatch.setenv("MKERNEL_DEFINES", "MK_A=1, MK_B ,")
    assert CP._env_defines() == {"MK_A": "1", "MK_B": True}
    monkeypatch.setenv("MKERNEL_DEFINES", "1BAD=2")
    with pytest.raises(ValueError, match="MKERNEL_DEFINES"):
        CP._env_defines()




def test_call_digest_and_layout_for_signatures():
    """The digest the kernels compare is a function of the agreed call only (every rank computes the
    same one), differs between different calls, and fits MkComm.sig; the workspace header holds
    consumed[P], entered[P] and sig[P][2] before the flags."""
    p = PL.plan([2048, 2048], 5120, 8192, 2, 132)
    d = PL.call_digest("bfloat16", (2048, 2048), 8192, 5120, False, p)
    assert d == PL.call_digest("bfloat16", (2048, 2048), 8192, 5120, False, p) and 0 <= d < 1 << 32
    q = PL.plan([2048, 1024], 5120, 8192, 2, 132)
    assert d != PL.call_digest("bfloat16", (2048, 1024), 8192, 5120, False, q)
    assert d != PL.call_digest("bfloat16", (2048, 2048), 8192, 5120, True, p)
    for P in (2, 7, 16):
        L = LY.workspace_layout(P, [1000] * P, 128, 16384)
        assert L.consumed_off + 4 * 8 * P <= L.flags_off and L.flags_off % 256 == 0
        assert L.flags_off + 8 * P * L.nch_stride <= L.value_off < L.data_off


@pytest.mark.parametrize("P", [2, 3, 8])
def test_control_words_do_not_move_with_the_shape(P):
    """Every call shares the op's workspace: the epoch, call header, ready flags, copy-engine value
    and go word sit at offsets of P only, whatever the shapes, plans and paths, so none of them ever
    lies on bytes an earlier call of another shape left in its data region (tests/gpu
    test_stale_workspace_bytes_are_never_flags); no plan has more chunks per shard than there are
    flags, even for shards far beyond 8192 x MAX_CHUNKS rows."""
    layouts = []
    for m in (1, 100, 1000, 16384, 1 << 20, 1 << 24, (1 << 31) // P - 1):
        for K in (8, 1024, 8192):
            ms = [m] * P
            crs = [PL.chunk_rows_for(ms, K * 2)] + [PL.ce_chunk_rows(ms, n) for n in (4, 16, 1 << 20)]
            if m <= 16384:  # (the planner simulates the copy-engine path tile by tile)
                crs += [PL.plan(ms, 512, K, 2, 132, force_path=path).chunk_rows
                        for path in ("fused_ce", "fused", "unfused")]
            for cr in crs:
                assert -(-m // cr) <= LY.MAX_CHUNKS, (m, K, cr)
                layouts.append(LY.workspace_layout(P, ms, cr, K * 2))
    control = {(L.consumed_off, L.flags_off, L.nch_stride, L.value_off, L.go_off, L.data_off) for L in layouts}
    assert len(control) == 1, control
    L = layouts[0]
    assert L.flags_off + 8 * P * LY.MAX_CHUNKS <= L.value_off and L.value_off + 8 * LY.CE_VALUES <= L.go_off
    assert L.go_off + 4 <= L.data_off and L.data_off % 4096 == 0
    with pytest.raises(AssertionError, match="chunks per shard"):
        LY.workspace_layout(P, [LY.MAX_CHUNKS + 1] * P, 1, 16)


def test_raster_rows_follow_mk_raster():
    """The simulated tile order is the scheduler's: super-rows of GROUP_M tile rows, column by column
    inside one, the last super-row shorter."""
    rows = PL._raster_rows(10, 3)  # GROUP_M = 8: rows 0-7 for each of 3 columns, then rows 8-9
    assert list(rows) == list(range(8)) * 3 + [8, 9] * 3


def test_ce_ready_times():
    """Own rows at once; a peer's tile when the last chunk its rows overlap has landed; with 3 ranks the
    second peer's shard comes after its sender pushed a whole shard to its first destination."""
    m = PL.CostModel(ce_link_bw=1e9, ce_op_latency=0.0, ce_start_latency=1.0)
    cfg = G.CONFIGS[2]  # 128 x 128
    rb = 1000  # bytes per row: a chunk of 256 rows takes 256 us at 1 GB/s
    r = PL._ce_ready_times([256, 512], 0, 128, cfg, 256, rb, m)
    assert list(r[:2]) == [0.0, 0.0]  # own 2 tiles
    assert np.allclose(r[2:], [1 + 256e-6, 1 + 256e-6, 1 + 512e-6, 1 + 512e-6])  # 4 row bands, 2 chunks
    r3 = PL._ce_ready_times([128, 256, 128], 0, 128, cfg, 128, rb, m)  # order: own, rank 2, rank 1
    assert np.allclose(r3, [0.0, 1 + 128e-6, 1 + 256e-6 + 128e-6, 1 + 256e-6 + 256e-6])


def test_ce_finish_static_round_robin():
    """Unit u runs on worker u % workers after that worker's previous unit; split tiles are `splits`
    consecutive units."""
    ready = np.array([0.0, 0.0, 5.0])
    assert PL._ce_finish(ready, 2, 1.0, 1.0, 1, 3) == 6.0  # worker 0: tile 0, then tile 2 at 5
    assert abs(PL._ce_finish(ready, 2, 1.0, 0.6, 2, 2) - 5.6) < 1e-12  # tile 2's halves on both workers
    assert PL._ce_finish(ready, 8, 1.0, 1.0, 1, 3) == 6.0


def test_transfer_bound_plan_splits_the_late_tiles():
    """mKernel's sweep point M = K = 16384 (N = 1024 per rank) is transfer-bound: the peer's rows land
    over ~0.7 ms and each 128 x 256 tile takes ~0.2 ms of one SM, so the tiles of the late chunks are
    split along K over the workers (more, smaller chunks at the end); the plan must be predicted well
    below the unsplit one.  Compute-bound shapes keep 4 chunks and no split;
    MKERNEL_AG_GEMM_TAIL_SPLIT=0 (tail_split=False) turns every split off."""
    p = PL.plan([8192, 8192], 1024, 16384, 2, 132)
    off = PL.plan([8192, 8192], 1024, 16384, 2, 132, tail_split=False)
    tiles = 2 * 64 * 4
    assert p.path == "fused_ce" and p.config == 3 and p.splits > 1, p.describe()
    assert tiles // 2 <= p.split_from < tiles and p.workers == 132  # only the peer's (last) shard
    assert off.splits == 1 and off.chunk_rows == PL.ce_chunk_rows([8192, 8192]) == 2048
    assert p.predicted_fused < 0.93 * off.predicted_fused, (p.describe(), off.describe())
    q = PL.plan([4096, 4096], 5120, 8192, 2, 132)  # llama 70B qkv M=8192: compute-bound
    assert q.path == "fused_ce" and q.splits == 1 and q.chunk_rows == 1024, q.describe()
    # chunk counts beyond the default only when the model allows them
    m4 = PL.CostModel(ce_chunks_max=4)
    assert PL.plan([8192, 8192], 1024, 16384, 2, 132, model=m4).chunk_rows == 2048


def test_config5_only_when_every_b_is_nk():
    """Llama-3-70B mlp_up at M = 1024 over 2 GPUs (N = 14336 = 64 x 224 per rank): with every rank's
    weights [N, K] the fused kernel takes config 5's 128 x 224 tile (512 tiles: 4 waves on 132 workers,
    where 128 x 192 needs 5) and fusion pays; with "kn" config 5 is config 3's tile and not offered."""
    nk = PL.plan([512, 512], 14336, 8192, 2, 132, b_layout="nk")
    assert (nk.path, nk.config) == ("fused_ce", 5), nk.describe()
    kn = PL.plan([512, 512], 14336, 8192, 2, 132, b_layout="kn")
    assert kn.config != 5, kn.describe()
    assert PL.tile_config(5, "nk").bn == 224 and PL.tile_config(5, "kn").bn == 256
    assert PL.tile_config(3, "kn") is G.CONFIGS[3]
    # forced config 5 with "kn": the plan counts config 3's tile width (what the kernel runs)
    f = PL.plan([700, 717], 3000, 4096, 2, 132, config=5, b_layout="kn", force_path="fused_ce", tail_split=True)
    t = PL._fused_tiles([700, 717], 3000, PL.tile_config(5, "kn"))
    assert t == 12 * 12 and f.split_from <= t, f.describe()


def test_ce_values_match_the_kernel():
    """The flag-value slots the planner's copy groups rely on are the ones the kernel writes."""
    import re

    from mkernel.core.compiler import cuda_src_dir

    src = (cuda_src_dir() / LY.SOURCE).read_text()
    assert int(re.search(r"#define AG_CE_VALUES (\d+)", src).group(1)) == LY.CE_VALUES
    assert max(PL.CE_GROUP_OPTIONS) <= LY.CE_VALUES

