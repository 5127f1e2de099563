"""AllGather+GEMM host logic on the CPU: the planner's path choice and its copy-engine chunking, the
side stream's copy list (order, flag addresses, the local rows read in place), path validation."""
from __future__ import annotations

import importlib

import numpy as np
import pytest

from mkernel.ops import gemm as G
from mkernel.ops.gemm import operands as GO
from mkernel.core import compiler as CP
from mkernel.core.arrays import DeviceArray

agm = importlib.import_module("mkernel.ops.ag_gemm.op")


def test_plan_prefers_copy_engines_where_communication_matters():
    p = agm.plan([2048, 2048], 5120, 8192, 2, 132)  # Llama-3-70B qkv, M = 4096 over 2 GPUs
    assert p.path == "fused_ce" and p.workers == 132 and p.comm_sms == 0, p.describe()
    assert p.chunk_rows >= 128 and p.chunk_rows & (p.chunk_rows - 1) == 0
    assert -(-2048 // p.chunk_rows) <= agm.MODEL.ce_chunks
    tiny = agm.plan([128, 128], 1024, 1024, 2, 132)
    assert tiny.path == "unfused", tiny.describe()
    assert agm.plan([64], 256, 256, 2, 132).path == "unfused"  # one rank: nothing to gather
    # mKernel's M = K = 4096 sweep point (N = 256 per rank): communication is most of the call and
    # the copy engines start on the peer's shard at once (own rows read in place): measured fused_ce
    # 0.093 ms vs unfused 0.130 and NCCL + cuBLAS 0.127 (docs/validation.md, fifth session)
    sweep = agm.plan([2048, 2048], 256, 4096, 2, 132)
    assert sweep.path == "fused_ce", sweep.describe()
    assert sweep.predicted_fused < 0.9 * sweep.predicted_unfused


def test_sm_paths_cut_shards_for_their_blocks():
    """SM communication: every pushing block gets >= chunks_per_block chunks of the largest shard,
    down to min_chunk_bytes (a power of two of rows); the unfused gather takes the collectives' grid:
    every SM from 2 MiB shards, SMALL_SLOT_BLOCKS below."""
    from mkernel.ops.collectives import layout as C

    m = agm.MODEL
    rb = 4096 * 2  # the M = K = 4096 sweep point: 2048-row shards of 8 KiB rows
    for n in (4, 8, 16, 32):
        p = agm.plan([2048, 2048], 256, 4096, 2, 132, comm_sms=n)
        nch = -(-2048 // p.chunk_rows)
        assert p.chunk_rows & (p.chunk_rows - 1) == 0 and p.chunk_rows * rb >= m.min_chunk_bytes
        assert nch >= min(m.chunks_per_block * n, 2048 * rb // m.min_chunk_bytes), (n, p.chunk_rows)
        assert p.chunk_rows <= agm.chunk_rows_for([2048, 2048], rb)  # never coarser than before
    u = agm.plan([2048, 2048], 256, 4096, 2, 132, force_path="unfused")
    assert u.gather_blocks == 132 and -(-2048 // u.chunk_rows) >= 132, u.describe()
    small = agm.plan([100, 100], 256, 4096, 2, 132, force_path="unfused")  # 800 KiB shards
    assert small.gather_blocks <= C.SMALL_SLOT_BLOCKS and small.chunk_rows * rb >= m.min_chunk_bytes
    # rows wider than min_chunk_bytes: one row per chunk at least (8 by the hook's limit)
    assert agm.chunk_rows_for([4096, 4096], 128 << 10, blocks=132) == 8


def test_plan_overrides():
    assert agm.plan([128, 128], 1024, 1024, 2, 132, force_path="fused_ce").path == "fused_ce"
    assert agm.plan([2048, 2048], 5120, 8192, 2, 132, force_path="unfused").path == "unfused"
    p = agm.plan([2048, 2048], 5120, 8192, 2, 132, comm_sms=6)
    assert p.path == "fused" and p.comm_sms == 6 and p.workers == 126
    assert agm.plan([2048, 2048], 5120, 8192, 2, 132, comm_sms=0).path == "unfused"
    assert agm.ce_chunk_rows([1000, 1100]) == 512 and agm.ce_chunk_rows([3, 5]) == 128


def test_plan_last_wave_split(monkeypatch):
    """Llama-3-405B mlp_up at M = 1024 over 2 GPUs: 832 tiles of 128 x 256 on 132 workers leave a last
    wave of 40 tiles, split in 3 along K; never with tail_split=False; K too short to pay for it: none."""
    p = agm.plan([512, 512], 26624, 16384, 2, 132)
    assert p.path == "fused_ce" and p.config == 3 and (p.splits, p.split_from) == (3, 792), p.describe()
    assert "splits=3" in p.describe()
    off = agm.plan([512, 512], 26624, 16384, 2, 132, tail_split=False)
    assert off.splits == 1 and off.predicted_gemm > p.predicted_gemm
    assert agm.plan([512, 512], 26624, 256, 2, 132, tail_split=True, force_path="fused_ce").splits == 1
    # fewer tiles than SMs: no whole-wave split, but every tile (8 of 64 x 128, K = 16384) split 16 ways
    # over the idle workers: the own shard's tiles would otherwise bound the call
    tiny = agm.plan([64, 64], 512, 16384, 2, 132, force_path="fused_ce")
    assert (tiny.splits, tiny.split_from) == (16, 0), tiny.describe()
    assert agm.plan([64, 64], 512, 16384, 2, 132, force_path="fused_ce", tail_split=False).splits == 1
    for v, want in (("", None), ("auto", None), ("0", False), ("1", True)):
        monkeypatch.setenv("MKERNEL_AG_GEMM_TAIL_SPLIT", v)
        assert agm._tail_split_env() is want
    monkeypatch.setenv("MKERNEL_AG_GEMM_TAIL_SPLIT", "yes")
    with pytest.raises(ValueError, match="MKERNEL_AG_GEMM_TAIL_SPLIT"):
        agm._tail_split_env()


class _Ws:
    ptr = 1 << 40

    @staticmethod
    def peer_ptr(j, offset=0):
        return (1 << 44) * (j + 1) + offset


@pytest.mark.parametrize("local_map", [True, False])
def test_ce_copies(local_map):
    P, me, K = 3, 1, 64
    m_sizes = (300, 200, 100)
    p = agm.plan(m_sizes, 512, K, 2, 132, force_path="fused_ce")
    L = agm._layout(P, m_sizes, p.chunk_rows, K * 2)
    offs = (0, 300, 500, 600)
    sig = agm._Sig(p, L, offs, P)
    A = DeviceArray(1 << 36, (200, K), "bfloat16", None, 0, None)
    copies = agm._ce_copies(sig, _Ws, A, me, K * 2, local_map)
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
    assert agm.ce_copy_groups(nch, gmax) == want


def test_ce_copy_groups_cover_every_chunk_once():
    for nch in range(1, 300):
        for gmax in (1, 2, 8, 64, 1000):
            g = agm.ce_copy_groups(nch, gmax)
            assert sum(g) == nch and min(g) >= 1 and max(g) <= min(max(gmax, 1), agm.CE_VALUES)
            assert g[-1] == 1  # the rows that land last are one chunk: the least GEMM work after the transfer


def test_ce_copies_in_groups():
    """A grouped plan: one data copy per group of consecutive chunks, each followed by one flag copy of
    as many consecutive ready flags, from the CE_VALUES flag-value slots."""
    P, me, K = 2, 0, 64
    m_sizes = (1000, 1000)
    p = agm.plan(m_sizes, 512, K, 2, 132, force_path="fused_ce")
    p.chunk_rows, p.ce_group_max = 128, 4
    L = agm._layout(P, m_sizes, p.chunk_rows, K * 2)
    sig = agm._Sig(p, L, (0, 1000, 2000), P)
    A = DeviceArray(1 << 36, (1000, K), "bfloat16", None, 0, None)
    copies = agm._ce_copies(sig, _Ws, A, me, K * 2, True)
    groups = agm.ce_copy_groups(8, 4)
    assert groups == [4, 2, 1, 1]
    assert len(copies) == 2 * len(groups)
    rb, c = K * 2, 0
    for i, g in enumerate(groups):
        dst, src, n = copies[2 * i]
        assert dst == _Ws.peer_ptr(1) + L.data_off + c * 128 * rb and src == A.ptr + c * 128 * rb
        assert n == (min(1000, (c + g) * 128) - c * 128) * rb
        fdst, fsrc, fn = copies[2 * i + 1]
        assert fdst == _Ws.peer_ptr(1) + L.flags_off + 8 * (me * L.nch_stride + c)
        assert fsrc == _Ws.ptr + L.value_off and fn == 8 * g <= 8 * agm.CE_VALUES
        c += g
    assert c == 8 and L.value_off + 8 * agm.CE_VALUES <= L.go_off


def test_env_defines(monkeypatch):
    monkeypatch.setenv("MKERNEL_DEFINES", "MK_A=1, MK_B ,")
    assert CP._env_defines() == {"MK_A": "1", "MK_B": True}
    monkeypatch.setenv("MKERNEL_DEFINES", "1BAD=2")
    with pytest.raises(ValueError, match="MKERNEL_DEFINES"):
        CP._env_defines()



class _FakeKernel:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def max_active_blocks_per_sm(self, *a):
        return 1

    def launch(self, grid, block, args, *, stream=None, **kw):
        self.log.append((self.name, args))


class _Ctx:
    local_rank, device = 0, 0

    def comm_args(self, op, sig=0):
        return object()


@pytest.mark.parametrize("path", ["fused", "unfused"])
def test_binding_repointed_at_each_output(monkeypatch, path):
    """A bound call (tensor maps, packed args) serves every output of the same layout and every
    gathered_a: the launch carries the call's output (its C map and pointer) and gathered_a pointer,
    the binding's own arguments untouched."""
    log, gemms = [], []
    monkeypatch.setattr(agm, "_kernel", lambda i, o, c, name: _FakeKernel(log, name))
    monkeypatch.setattr(agm, "encode_tiled", lambda ptr, *a, **k: ("map", ptr))
    monkeypatch.setattr(GO, "encode_tiled", lambda ptr, *a, **k: ("map", ptr))  # (B's and C's maps)
    monkeypatch.setattr(agm.G, "gemm", lambda a, b, out, **kw: gemms.append(out.ptr))
    P, K, N = 2, 256, 512
    m_sizes = (300, 300)
    kw = dict(comm_sms=4) if path == "fused" else dict(force_path="unfused")
    p = agm.plan(m_sizes, N, K, 2, 132, **kw)
    assert p.path == path
    L = agm._layout(P, m_sizes, p.chunk_rows, K * 2)
    sig = agm._Sig(p, L, (0, 300, 600), P)
    ws = _Ws()
    ws.peer_table = 1 << 45
    A = DeviceArray(1 << 36, (300, K), "bfloat16", None, 0, None)
    B = DeviceArray(1 << 37, (K, N), "bfloat16", None, 0, None)
    outs = [DeviceArray((1 << 38) + i * (1 << 30), (600, N), "bfloat16", None, 0, None) for i in range(3)]
    gas = [DeviceArray((1 << 42) + i * (1 << 30), (600, K), "bfloat16", None, 0, None) for i in range(2)]
    run = agm._bind(_Ctx(), sig, ws, A, B, outs[0], gas[0], "kn", "bfloat16", "bfloat16", 600, N, K)
    assert run.buffers is False  # aligned B, no split-K: nothing a captured graph would replay (no pinning)
    calls = [(o, gas[0]) for o in outs + [outs[0]]] + [(outs[0], gas[1])]
    for o, ga in calls:
        run(0, o, ga.ptr)
    if path == "unfused":
        assert gemms == [o.ptr for o, _ in calls]
        gathers = [args[1] for name, args in log if name == "mk_ag_gather"]
        assert [a.gathered_out for a in gathers] == [ga.ptr for _, ga in calls]
        return
    fused = [args for name, args in log if name.startswith("mk_ag_gemm")]
    assert [a[5].c for a in fused] == [o.ptr for o, _ in calls]
    assert [a[3] for a in fused] == [("map", o.ptr) for o, _ in calls]  # C's map
    assert [a[5].gathered_out for a in fused] == [ga.ptr for _, ga in calls]
    assert fused[0][5] is fused[3][5] and fused[1][5] is not fused[0][5]  # the binding's own args reused
    cfg = agm.G.CONFIGS[p.config]  # no split-K: every unit is a whole tile (split_from = the tile count)
    assert (fused[0][5].splits, fused[0][5].split_from) == (1, agm._fused_tiles(m_sizes, N, cfg))


def test_call_digest_and_layout_for_signatures():
    """The digest the kernels compare is a function of the agreed call only (every rank computes the
    same one), differs between different calls, and fits MkComm.sig; the workspace header holds
    consumed[P], entered[P] and sig[P][2] before the flags."""
    p = agm.plan([2048, 2048], 5120, 8192, 2, 132)
    d = agm.call_digest("bfloat16", (2048, 2048), 8192, 5120, False, p)
    assert d == agm.call_digest("bfloat16", (2048, 2048), 8192, 5120, False, p) and 0 <= d < 1 << 32
    q = agm.plan([2048, 1024], 5120, 8192, 2, 132)
    assert d != agm.call_digest("bfloat16", (2048, 1024), 8192, 5120, False, q)
    assert d != agm.call_digest("bfloat16", (2048, 2048), 8192, 5120, True, p)
    for P in (2, 7, 16):
        L = agm._layout(P, [1000] * P, 128, 16384)
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
            crs = [agm.chunk_rows_for(ms, K * 2)] + [agm.ce_chunk_rows(ms, n) for n in (4, 16, 1 << 20)]
            if m <= 16384:  # (the planner simulates the copy-engine path tile by tile)
                crs += [agm.plan(ms, 512, K, 2, 132, force_path=path).chunk_rows
                        for path in ("fused_ce", "fused", "unfused")]
            for cr in crs:
                assert -(-m // cr) <= agm.MAX_CHUNKS, (m, K, cr)
                layouts.append(agm._layout(P, ms, cr, K * 2))
    control = {(L.consumed_off, L.flags_off, L.nch_stride, L.value_off, L.go_off, L.data_off) for L in layouts}
    assert len(control) == 1, control
    L = layouts[0]
    assert L.flags_off + 8 * P * agm.MAX_CHUNKS <= L.value_off and L.value_off + 8 * agm.CE_VALUES <= L.go_off
    assert L.go_off + 4 <= L.data_off and L.data_off % 4096 == 0
    with pytest.raises(AssertionError, match="chunks per shard"):
        agm._layout(P, [agm.MAX_CHUNKS + 1] * P, 1, 16)


def test_raster_rows_follow_mk_raster():
    """The simulated tile order is the scheduler's: super-rows of GROUP_M tile rows, column by column
    inside one, the last super-row shorter."""
    rows = agm._raster_rows(10, 3)  # GROUP_M = 8: rows 0-7 for each of 3 columns, then rows 8-9
    assert list(rows) == list(range(8)) * 3 + [8, 9] * 3


def test_ce_ready_times():
    """Own rows at once; a peer's tile when the last chunk its rows overlap has landed; with 3 ranks the
    second peer's shard comes after its sender pushed a whole shard to its first destination."""
    m = agm.CostModel(ce_link_bw=1e9, ce_op_latency=0.0, ce_start_latency=1.0)
    cfg = G.CONFIGS[2]  # 128 x 128
    rb = 1000  # bytes per row: a chunk of 256 rows takes 256 us at 1 GB/s
    r = agm._ce_ready_times([256, 512], 0, 128, cfg, 256, rb, m)
    assert list(r[:2]) == [0.0, 0.0]  # own 2 tiles
    assert np.allclose(r[2:], [1 + 256e-6, 1 + 256e-6, 1 + 512e-6, 1 + 512e-6])  # 4 row bands, 2 chunks
    r3 = agm._ce_ready_times([128, 256, 128], 0, 128, cfg, 128, rb, m)  # order: own, rank 2, rank 1
    assert np.allclose(r3, [0.0, 1 + 128e-6, 1 + 256e-6 + 128e-6, 1 + 256e-6 + 256e-6])


def test_ce_finish_static_round_robin():
    """Unit u runs on worker u % workers after that worker's previous unit; split tiles are `splits`
    consecutive units."""
    ready = np.array([0.0, 0.0, 5.0])
    assert agm._ce_finish(ready, 2, 1.0, 1.0, 1, 3) == 6.0  # worker 0: tile 0, then tile 2 at 5
    assert abs(agm._ce_finish(ready, 2, 1.0, 0.6, 2, 2) - 5.6) < 1e-12  # tile 2's halves on both workers
    assert agm._ce_finish(ready, 8, 1.0, 1.0, 1, 3) == 6.0


def test_transfer_bound_plan_splits_the_late_tiles():
    """mKernel's sweep point M = K = 16384 (N = 1024 per rank) is transfer-bound: the peer's rows land
    over ~0.7 ms and each 128 x 256 tile takes ~0.2 ms of one SM, so the tiles of the late chunks are
    split along K over the workers (more, smaller chunks at the end); the plan must be predicted well
    below the unsplit one.  Compute-bound shapes keep 4 chunks and no split;
    MKERNEL_AG_GEMM_TAIL_SPLIT=0 (tail_split=False) turns every split off."""
    p = agm.plan([8192, 8192], 1024, 16384, 2, 132)
    off = agm.plan([8192, 8192], 1024, 16384, 2, 132, tail_split=False)
    tiles = 2 * 64 * 4
    assert p.path == "fused_ce" and p.config == 3 and p.splits > 1, p.describe()
    assert tiles // 2 <= p.split_from < tiles and p.workers == 132  # only the peer's (last) shard
    assert off.splits == 1 and off.chunk_rows == agm.ce_chunk_rows([8192, 8192]) == 2048
    assert p.predicted_fused < 0.93 * off.predicted_fused, (p.describe(), off.describe())
    q = agm.plan([4096, 4096], 5120, 8192, 2, 132)  # llama 70B qkv M=8192: compute-bound
    assert q.path == "fused_ce" and q.splits == 1 and q.chunk_rows == 1024, q.describe()
    # chunk counts beyond the default only when the model allows them
    m4 = agm.CostModel(ce_chunks_max=4)
    assert agm.plan([8192, 8192], 1024, 16384, 2, 132, model=m4).chunk_rows == 2048


def test_config5_only_when_every_b_is_nk():
    """Llama-3-70B mlp_up at M = 1024 over 2 GPUs (N = 14336 = 64 x 224 per rank): with every rank's
    weights [N, K] the fused kernel takes config 5's 128 x 224 tile (512 tiles: 4 waves on 132 workers,
    where 128 x 192 needs 5) and fusion pays; with "kn" config 5 is config 3's tile and not offered."""
    nk = agm.plan([512, 512], 14336, 8192, 2, 132, b_layout="nk")
    assert (nk.path, nk.config) == ("fused_ce", 5), nk.describe()
    kn = agm.plan([512, 512], 14336, 8192, 2, 132, b_layout="kn")
    assert kn.config != 5, kn.describe()
    assert agm.tile_config(5, "nk").bn == 224 and agm.tile_config(5, "kn").bn == 256
    assert agm.tile_config(3, "kn") is G.CONFIGS[3]
    # forced config 5 with "kn": the plan counts config 3's tile width (what the kernel runs)
    f = agm.plan([700, 717], 3000, 4096, 2, 132, config=5, b_layout="kn", force_path="fused_ce", tail_split=True)
    t = agm._fused_tiles([700, 717], 3000, agm.tile_config(5, "kn"))
    assert t == 12 * 12 and f.split_from <= t, f.describe()


def test_ce_values_match_the_kernel():
    """The flag-value slots the planner's copy groups rely on are the ones the kernel writes."""
    import re

    from mkernel.core.compiler import cuda_src_dir

    src = (cuda_src_dir() / agm.SOURCE).read_text()
    assert int(re.search(r"#define AG_CE_VALUES (\d+)", src).group(1)) == agm.CE_VALUES
    assert max(agm.CE_GROUP_OPTIONS) <= agm.CE_VALUES


def test_fast_key(monkeypatch):
    """The eager fast path's key: mkernel DeviceArrays only (foreign arrays and out=None take the full
    path); any field of an array, the options, the environment read per call or the workspace
    generation gives another key."""

    class Ctx:
        _ws_gen = 3

    ctx = Ctx()
    a = DeviceArray(1 << 36, (64, 128), "bfloat16", None, 0, None)
    b = DeviceArray(1 << 37, (128, 256), "bfloat16", None, 0, None)
    o = DeviceArray(1 << 38, (128, 256), "bfloat16", None, 0, None)
    key = lambda *args, **kw: agm._fast_key(ctx, *args, **kw)  # noqa: E731
    base = ("kn", None, None, None, None, None)
    k0 = key(a, b, o, None, *base)
    assert k0 is not None and k0 == key(a, b, o, None, *base)
    assert key(a, b, None, None, *base) is None
    assert key(np.zeros((64, 128)), b, o, None, *base) is None
    assert key(a, b, DeviceArray(1 << 38, (128, 256), "bfloat16", None, 0, None, readonly=True), None, *base) is None
    others = [key(DeviceArray((1 << 36) + 256, (64, 128), "bfloat16", None, 0, None), b, o, None, *base),
              key(a, b, o, DeviceArray(1 << 39, (128, 128), "bfloat16", None, 0, None), *base),
              key(a, b, o, None, "nk", None, None, None, None, None),
              key(a, b, o, None, "kn", None, 0, None, None, None),
              key(a, b, o, None, "kn", None, None, None, None, "fused_ce")]
    monkeypatch.setenv("MKERNEL_AG_GEMM_TAIL_SPLIT", "0")
    others.append(key(a, b, o, None, *base))
    monkeypatch.delenv("MKERNEL_AG_GEMM_TAIL_SPLIT")
    ctx._ws_gen = 4
    others.append(key(a, b, o, None, *base))
    assert len({k0, *others}) == len(others) + 1
