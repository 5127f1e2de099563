"""The persistent ring attention kernel on the CPU (RingAttentionOptions(persistent=True), mkernel/ops/ring_attention/
fused.py, cuda_src/ops/ring_attention_fused.cu): its specializations compile for sm_90a with no spills; an
emulation of its tile and segment index math (a line-by-line mirror of mk_ring_tile / mk_ring_seg and the
masks) computes full, causal zigzag and non-causal, attention on every rank, each (row, key) pair once;
the workspace layout; the host's submissions in order on a fake driver."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from mkernel.core import compiler as CP
from mkernel.core.arrays import DeviceArray
from mkernel.ops.attention import kernels as AK
from mkernel.ops.ring_attention import RingAttentionOptions, make_plan, zigzag_indices
from mkernel.ops.ring_attention import common as RC
from mkernel.ops.ring_attention import fused as FU
from mkernel.ops.ring_attention import op as RO

import _compile_cache
from test_ring_attention_host import _arr, _Ctx, _fake_driver, _FakeWs, ctx  # noqa: F401  (fixture)

SPECS = [(s, d) for s, d in CP.registered_specializations() if s == FU.SOURCE]


# ------------------------------------------------------------------ compile
def test_every_specialization_registered():
    assert sorted((d["MK_ATTN_DT"], d["MK_ATTN_D"]) for _, d in SPECS) == [(0, 64), (0, 128), (1, 64), (1, 128)]


compile_cache = _compile_cache.module_fixture("test_compiles_clean", "sm_90a")


@pytest.mark.parametrize("source,defines", SPECS, ids=[f"dt{d['MK_ATTN_DT']}-d{d['MK_ATTN_D']}" for _, d in SPECS])
def test_compiles_clean(source, defines, compile_cache, monkeypatch):
    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(compile_cache))
    mod = CP.compile_module(source, defines, arch="sm_90a")
    _compile_cache.assert_clean(mod, [FU.KERNEL], lambda name: AK.THREADS)


# ------------------------------------------------------------------ index math (mirror of the kernel)
BM, BN = AK.BM, AK.BN


def _tile(P, me, B, Hq, chunk, m_tiles, causal, t):
    per_chunk = B * Hq * m_tiles
    ca = 1 - t // per_chunk if causal else 0
    r = t % per_chunk
    return ca, (m_tiles - 1 - r % m_tiles) * BM, (r // m_tiles) % Hq, r // (m_tiles * Hq)


def _seg(P, me, chunk, causal, ca, m0, sg):
    nb = 1 + causal
    s, kb = sg // nb, sg % nb
    j = (me - s) % P
    row0, length, diag = kb * chunk, chunk, False
    if causal:
        gq = me if ca == 0 else 2 * P - 1 - me
        gk = j if kb == 0 else 2 * P - 1 - j
        if gk > gq:
            return None
        diag = gk == gq
    n_end = min(length, m0 + BM) if diag else length
    n_tiles = -(-n_end // BN)
    return (s, j, row0, length, diag, n_tiles) if n_tiles > 0 else None


def _emulate(P, me, B, Hq, S, causal, q, k_all, v_all, scale):
    """The kernel's computation in float64 on rank ``me``: every tile (any block order: tiles are
    independent), its segments in order, key tiles from the last, masked keys dropped, online softmax in
    one pass; returns (out, lse, visits) with visits[b, h, row, global key] counting the keys used."""
    chunk, m_tiles, tiles = FU.num_tiles(B, Hq, S, causal)
    out = np.full((B, Hq, S, q.shape[-1]), np.nan)
    lse = np.full((B, Hq, S), np.nan)
    Sg = S * P
    visits = np.zeros((B, Hq, S, Sg), np.int32)
    pos = [zigzag_indices(Sg, P, j) if causal else np.arange(j * S, (j + 1) * S) for j in range(P)]
    for t in range(tiles):
        ca, m0, h, b = _tile(P, me, B, Hq, chunk, m_tiles, causal, t)
        rows = np.arange(m0, min(m0 + BM, chunk))  # chunk-relative rows stored
        if rows.size == 0:
            continue
        qr = q[b, h, ca * chunk + rows]
        m = np.full(rows.size, -np.inf)
        l = np.zeros(rows.size)
        o = np.zeros((rows.size, q.shape[-1]))
        for sg in range(P * (1 + causal)):
            g = _seg(P, me, chunk, causal, ca, m0, sg)
            if g is None:
                continue
            _, j, row0, length, diag, n_tiles = g
            for n in range(n_tiles - 1, -1, -1):
                keys = np.arange(n * BN, n * BN + BN)  # segment-relative
                lim = np.minimum(length, rows + 1) if diag else np.full(rows.size, length)
                vis = keys[None, :] < lim[:, None]
                kr = np.minimum(row0 + keys, S - 1)  # (rows past S are TMA zeros, always masked)
                sc = qr @ k_all[j][b, h * k_all[j].shape[1] // Hq, kr].T * scale
                sc = np.where(vis, sc, -np.inf)
                ii, kk = np.nonzero(vis)
                np.add.at(visits, (b, h, ca * chunk + rows[ii], pos[j][row0 + keys[kk]]), 1)
                mn = np.maximum(m, sc.max(axis=1))
                base = np.where(np.isinf(mn), 0.0, mn)
                p = np.exp(sc - base[:, None])
                alpha = np.exp(m - base)
                l = l * alpha + p.sum(axis=1)
                o = o * alpha[:, None] + p @ v_all[j][b, h * v_all[j].shape[1] // Hq, kr]
                m = mn
        out[b, h, ca * chunk + rows] = o / l[:, None]
        lse[b, h, ca * chunk + rows] = m + np.log(l)
    return out, lse, visits


@pytest.mark.parametrize("P,S,causal,Hq,Hkv", [(1, 200, False, 2, 1), (2, 130, False, 2, 2), (3, 260, True, 2, 1),
                                                (2, 300, True, 4, 2), (4, 2, True, 1, 1), (1, 258, True, 2, 2)])
def test_emulated_kernel_computes_full_attention(P, S, causal, Hq, Hkv):
    """Every rank's tiles and segments, emulated, give attention over the whole sequence (causal: global
    positions, zigzag shards), each visible (row, key) pair visited exactly once, no other."""
    rng = np.random.default_rng(P * 1000 + S)
    B, D = 2, 8
    Sg = S * P
    qg, kg, vg = (rng.standard_normal((B, H, Sg, D)) for H in (Hq, Hkv, Hkv))
    scale = 0.3
    pos = [zigzag_indices(Sg, P, j) if causal else np.arange(j * S, (j + 1) * S) for j in range(P)]
    k_all = [kg[:, :, pos[j]] for j in range(P)]
    v_all = [vg[:, :, pos[j]] for j in range(P)]
    mask = np.tril(np.ones((Sg, Sg), bool)) if causal else np.ones((Sg, Sg), bool)
    for me in range(P):
        q = qg[:, :, pos[me]]
        out, lse, visits = _emulate(P, me, B, Hq, S, causal, q, k_all, v_all, scale)
        want_vis = np.broadcast_to(mask[pos[me]], visits.shape)
        np.testing.assert_array_equal(visits, want_vis.astype(np.int32))
        kf = np.repeat(kg, Hq // Hkv, axis=1)
        vf = np.repeat(vg, Hq // Hkv, axis=1)
        sc = np.einsum("bhqd,bhkd->bhqk", q, kf) * scale
        sc = np.where(mask[pos[me]], sc, -np.inf)
        ref_lse = np.log(np.exp(sc).sum(-1))
        ref = np.einsum("bhqk,bhkd->bhqd", np.exp(sc - ref_lse[..., None]), vf)
        np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_tiles_heavy_chunk_first():
    chunk, m_tiles, tiles = FU.num_tiles(2, 3, 1000, True)
    assert (chunk, m_tiles, tiles) == (500, 4, 2 * 3 * 2 * 4)
    first = [_tile(2, 0, 2, 3, chunk, m_tiles, True, t) for t in range(tiles)]
    assert all(ca == 1 for ca, *_ in first[:tiles // 2]) and all(ca == 0 for ca, *_ in first[tiles // 2:])
    assert len(set(first)) == tiles


def test_grid_leaves_an_sm_for_the_gates():
    assert FU.grid_size(10_000, 132, 2) == 131
    assert FU.grid_size(10_000, 66, 2) == 65  # two ranks sharing a GPU: their share of it
    assert FU.grid_size(10_000, 132, 1) == 132
    assert FU.grid_size(5, 132, 8) == 5


def test_fused_layout():
    a, b = FU.fused_workspace_layout(4, 1 << 20), FU.fused_workspace_layout(4, 3 * 4096)
    step, data_off, _ = RO.workspace_layout(4, 2 << 20)
    # the control words sit where the step path's do (one workspace, either path per call)
    assert (a.ctl.consumed_off, a.ctl.flags_off) == (b.ctl.consumed_off, b.ctl.flags_off) == \
        (step.consumed_off, step.flags_off)
    assert a.k_off == b.k_off == data_off
    for L in (a, b):
        kv = L.kv_bytes
        assert L.k_slot(3) + kv <= L.v_off and L.v_slot(3) + kv == L.total
        assert L.k_off % 256 == 0 and L.v_off % 256 == 0 and kv % 16 == 0


def test_args_mirror_the_kernel_struct():
    assert ctypes.sizeof(FU.RingFusedArgs) == 104
    src = (CP.cuda_src_dir() / FU.SOURCE).read_text()
    assert "static_assert(sizeof(MkRingFusedArgs) == 104" in src


def test_options_persistent_checked():
    with pytest.raises(ValueError, match="persistent"):
        RingAttentionOptions(persistent=1).checked()
    assert RingAttentionOptions(persistent=True).checked().persistent


# ------------------------------------------------------------------ host submissions
class _Ctx2(_Ctx):
    resident_sms = 132

    def side_stream(self):
        return 77

    def comm_args(self, op, digest):
        return ("comm", op, digest)

    def workspace(self, key, nbytes, stream, what):
        assert key == ("ring_attention",) and nbytes <= _FakeWs.nbytes
        return _FakeWs()


def test_bound_submits_in_order(ctx, monkeypatch):
    """Local rank 1 of 3: fork; begin (the epoch the kernel waits for), the caller's stream waits for it;
    home copies and announcements; per source (steps 1, 2: ranks 0, 2) the gate, then its K and V slots,
    its consumed flag and our arrival flag; the one persistent launch; join."""
    log = []
    Kern, Cu, Ev, _ = _fake_driver(log)
    launched = []

    class Main:
        def prepare(self, grid, threads, args, stream=None, smem=0):
            launched.append((grid, threads, stream, smem, args))
            return lambda: log.append(("persistent",))

    monkeypatch.setattr(RC, "control", Kern)
    monkeypatch.setattr(FU, "get", lambda dt, d: Main())
    monkeypatch.setattr(FU, "copy_async", lambda cps, s: log.append(("copy", tuple(cps))))
    monkeypatch.setattr(FU, "Events", Ev)
    monkeypatch.setattr(FU, "cu", Cu)
    monkeypatch.setattr(FU, "check", lambda r: r)
    maps = []

    class Map:
        def __init__(self, x, layout, rows):
            self.x, self.rows, self.buf = x, rows, len(maps)
            maps.append(self)

        def point(self, ptr):
            pass

    monkeypatch.setattr(AK, "tensor_map", Map)
    monkeypatch.setattr(DeviceArray, "from_numpy", staticmethod(lambda x, device=None: _arr(x.shape, "int64")))
    c = _Ctx2()
    c.local_rank, c.local_size = 1, 3
    B, S, Hq, Hkv, D = 1, 64, 4, 2, 128
    q, k, v = _arr((B, S, Hq, D)), _arr((B, S, Hkv, D)), _arr((B, S, Hkv, D))
    call = RO._Call()
    call.q, call.k, call.v, call.out, call.lse = q, k, v, _arr((B, S, Hq, D)), _arr((B, Hq, S), "float32")
    call.dims, call.layout, call.stream, call.causal, call.scale = (B, S, S, Hq, Hkv, D), "bshd", 5, True, 0.1
    call.options = RingAttentionOptions(persistent=True)
    plan = make_plan(1, 3, S, True, 2 * k.nbytes)
    bound = FU.RingFusedBound(c, call, plan, 0x1234)
    bound.run(5, call)
    ws, kv, L = _FakeWs(), k.nbytes, bound.layout
    want = [("record", "fork", 5), ("wait", "fork", 77), ("mk_ring_begin",), ("record", "begun", 77),
            ("wait", "begun", 5),
            ("copy", ((ws.ptr + L.k_slot(1), k.ptr, kv), (ws.ptr + L.v_slot(1), v.ptr, kv),
                      (ws.peer_ptr(0, L.ctl.flags_off + 8), ws.ptr + RO.VALUE_OFF, 8),
                      (ws.peer_ptr(2, L.ctl.flags_off + 8), ws.ptr + RO.VALUE_OFF, 8)))]
    for src in (0, 2):
        want += [("mk_ring_wait", src),
                 ("copy", ((ws.ptr + L.k_slot(src), ws.peer_ptr(src, L.k_slot(src)), kv),
                           (ws.ptr + L.v_slot(src), ws.peer_ptr(src, L.v_slot(src)), kv),
                           (ws.peer_ptr(src, L.ctl.consumed_off + 8), ws.ptr + RO.VALUE_OFF, 8),
                           (bound.arrived.ptr + 8 * src, ws.ptr + RO.VALUE_OFF, 8)))]
    want += [("persistent",), ("record", "join", 77), ("wait", "join", 5)]
    assert log == want and bound.plan is plan  # (ctx.last_plan)
    (grid, threads, stream, smem, args), = launched
    chunk, m_tiles, tiles = FU.num_tiles(B, Hq, S, True)
    assert grid == (min(tiles, 131), 1, 1) and threads == AK.THREADS and stream == 5 and smem == AK.smem_bytes(D)
    a = args[5]
    assert (a.P, a.me, a.causal, a.chunk, a.m_tiles, a.num_tiles, a.group) == (3, 1, 1, 32, 1, tiles, 2)
    assert a.epoch == ws.ptr and a.arrived == bound.arrived.ptr and a.out == call.out.ptr
    # the maps: q, k, v, then the K and V areas as [P * B, S, H_kv, D] arrays
    assert args[:5] == [0, 1, 2, 3, 4] and [m.rows for m in maps] == [AK.BM] + [AK.BN] * 4
    for m, off in ((maps[3], L.k_off), (maps[4], L.v_off)):
        assert (m.x.ptr, m.x.shape, m.x.strides) == (ws.ptr + off, (3 * B, S, Hkv, D), k.strides)


def test_bind_picks_the_persistent_path_on_one_node_only(ctx, monkeypatch):
    monkeypatch.setattr(FU, "RingFusedBound", lambda *a: "persistent")
    monkeypatch.setattr(RO, "_RingBound", lambda *a: "steps")
    call = RO._Call()
    call.options = RingAttentionOptions(persistent=True)
    call.dims, call.causal = (1, 8, 8, 1, 1, 64), False
    call.k = _arr((1, 8, 1, 64))
    plan = RO._RING.plan(ctx, call, 0)
    assert plan.persistent and RO._RING.bind(ctx, call, plan) == "persistent"
    call.options = RingAttentionOptions()
    plan = RO._RING.plan(ctx, call, 0)
    assert not plan.persistent and RO._RING.bind(ctx, call, plan) == "steps"
