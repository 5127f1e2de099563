"""The fused dispatch + GEMM's tile order on the CPU (docs/moe.md, "Dispatch + grouped GEMM, fused"): this rank's
own rows first.  The routing's src_offsets (mk_moe_route_exchange, mirrored) against the float64 layout: each
expert's rows from this rank are exactly [src_offsets[l][me], src_offsets[l][me + 1]).  A line-by-line port
of MkGroupedFirstScheduler (mk_gemm.cuh) against MkGroupedScheduler's tiles: the same tiles, each once, the
tiles of row blocks inside the first rows first, each phase in the grouped order, on random and adversarial
offsets and ranges (empty experts, every row local, none, counts not multiples of BM, offsets clamped or past
r_cap, ranges outside their group or reversed).  The arrival protocol emulated over that order: every worker
runs all of its own-row tiles before any peer's row lands, and then every tile (no deadlock).  The host's
launch arguments against the kernels' parameter lists in the PTX."""
from __future__ import annotations

import ctypes
import types
import zlib

import numpy as np
import pytest

from mkernel.core import compiler as CP
from mkernel.dist.opstate import OpState
from mkernel.dist.signals import OPS, MkComm
from mkernel.ops import gemm as G
from mkernel.ops.moe import fused as FU
from mkernel.ops.moe import gemm_bound as GB
from mkernel.ops.moe import layout as ML
from mkernel.ops.moe import op as MO
from mkernel.ops.moe import reference as ref
from mkernel.ops.moe.op import MoeRouting

from test_gemm_compile import fake  # noqa: F401 (the driver fakes of the GEMM plans)
from test_moe_layer_kernel import _grouped  # MkGroupedScheduler's tiles for one worker
from test_proxy_layout import _ptx_param_sizes


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


# ---- the routing's src_offsets ---------------------------------------------------------------------------
def _src_offsets_kernel(ids, E, capacity, r_cap, d):
    """mk_moe_route_exchange's src_offsets on rank d (moe_expert_place + moe_store_src_offsets, mk_moe.cuh)
    from every rank's counts."""
    P = len(ids)
    El = E // P
    cnts = np.array([[int(np.sum(i == e)) for e in range(E)] for i in ids])  # [P][E]
    cap = capacity if capacity > 0 else 0x7fffffff
    kept = np.minimum(cnts.sum(0), cap)
    out = np.zeros((El, P + 1), np.int64)
    start = 0  # (the owner's experts in order: an exclusive prefix over them)
    for l in range(El):
        e = d * El + l
        cum = 0
        for j in range(P + 1):
            out[l, j] = min(start + min(cum, int(kept[e])), r_cap)
            if j < P:
                cum += int(cnts[j, e])
        start += int(kept[e])
    return out


def _routing(rng, kind, P, T, k, E):
    """Every rank's ids [T, k] (distinct per token): "random"; "own" (each rank picks only its own experts:
    every row local); "others" (only peers' experts: no row local; P >= 2); "one_expert" (every token's
    first choice is expert 0); "sparse" (a few experts only: empty experts)."""
    El = E // P
    out = []
    for s in range(P):
        if kind == "own":
            pool = np.arange(s * El, (s + 1) * El)
        elif kind == "others":
            pool = np.array([e for e in range(E) if e // El != s])
        elif kind == "sparse":
            pool = np.array(sorted(rng.choice(E, size=max(k, E // 4), replace=False)))
        else:
            pool = np.arange(E)
        ids = np.stack([rng.choice(pool, size=k, replace=False) for _ in range(T)]) if T else np.zeros((0, k), int)
        if kind == "one_expert" and T:
            for t in range(T):
                if 0 not in ids[t]:
                    ids[t, 0] = 0
        out.append(ids.astype(np.int32))
    return out


ROUTINGS = [("random", 2, 300, 4, 8, 0, None), ("random", 3, 97, 2, 9, 0, None), ("own", 2, 200, 2, 8, 0, None),
            ("others", 2, 150, 3, 8, 0, None), ("one_expert", 4, 80, 2, 16, 0, None),
            ("sparse", 2, 260, 2, 16, 0, None), ("random", 2, 300, 4, 8, 70, None), ("random", 4, 129, 8, 32, 0, 500),
            ("random", 1, 333, 3, 5, 0, None), ("random", 2, 0, 2, 4, 0, None)]


@pytest.mark.parametrize("kind,P,T,k,E,cap,r_cap", ROUTINGS)
def test_src_offsets_bound_each_sources_rows(kind, P, T, k, E, cap, r_cap):
    """The exchange's src_offsets equal src_offsets_reference (capacity and r_cap drops included), and rows
    [src_offsets[l][s], src_offsets[l][s + 1]) are exactly expert l's rows from source s."""
    rng = np.random.default_rng(_seed(kind, P, T, k, E, cap))
    ids = _routing(rng, kind, P, T, k, E)
    lay = ref.layout_reference(ids, E, cap, r_cap)
    r_cap = P * T * min(k, E // P) if r_cap is None else r_cap
    Tk = max(T * k, 1)
    for d in range(P):
        so = _src_offsets_kernel(ids, E, cap, r_cap, d)
        np.testing.assert_array_equal(so, ref.src_offsets_reference(lay[d], P, T, k))
        o = lay[d]["expert_offsets"]
        src = np.asarray(lay[d]["recv_src"], np.int64) // Tk
        for l in range(E // P):
            assert so[l, 0] == o[l] and so[l, P] == o[l + 1]
            for s in range(P):
                rows = np.arange(o[l], o[l + 1])
                assert set(rows[src[o[l]:o[l + 1]] == s]) == set(range(so[l, s], so[l, s + 1]))


# ---- the tile order ---------------------------------------------------------------------------------------
class GroupedFirst:
    """MkGroupedFirstScheduler<BM, BN> (mk_gemm.cuh), line by line; `first` is the flat array the kernel
    points at plus `at` (the kernel's src_offs + me), `stride` P + 1.  Tiles as _grouped writes them."""

    def __init__(self, o, first, at, stride, G_, M, N, BM, BN, group_m):
        self.o, self.first, self.at, self.stride = o, first, at, stride
        self.G, self.M, self.N, self.BM, self.BN = G_, M, N, BM, BN
        self.group_m = group_m if group_m > 0 else 1
        self.num_n = -(-N // BN)
        self.g = -1
        self.g_row0 = self.g_row1 = self.g_num_m = 0

    def load_group(self, gg):
        self.g = gg  # (MkGroupedScheduler::load_group)
        if gg < self.G:
            r0 = min(max(int(self.o[gg]), 0), self.M)
            r1 = min(max(int(self.o[gg + 1]), r0), self.M)
            self.g_row0, self.g_row1, self.g_num_m = r0, r1, -(-(r1 - r0) // self.BM)
        self.sr = 0
        if gg < self.G:
            r0, r1 = self.g_row0, self.g_row1
            lo = min(max(int(self.first[self.at + gg * self.stride]), r0), r1)
            hi = min(max(int(self.first[self.at + gg * self.stride + 1]), lo), r1)
            self.fa = (lo - r0 + self.BM - 1) // self.BM
            self.fb = max(self.fa, self.g_num_m if hi == r1 else (hi - r0) // self.BM)

    def tiles(self, worker, workers):
        self.next_i, self.step, self.phase, self.base = worker, workers, 0, 0
        self.load_group(0)
        out = []
        while True:
            t = self.next()
            if t is None:
                return out
            out.append(t)

    def next(self):
        i = self.next_i
        self.next_i += self.step
        while self.phase < 2:
            if self.g >= self.G:
                self.phase += 1
                self.load_group(0)
                continue
            m0 = self.sr * self.group_m
            if m0 >= self.g_num_m:
                self.load_group(self.g + 1)
                continue
            m1 = min(m0 + self.group_m, self.g_num_m)
            c0 = min(max(self.fa, m0), m1)
            c1 = min(max(self.fb, c0), m1)
            hole = c1 - c0 if self.phase else 0
            n = m1 - m0 - hole if self.phase else c1 - c0
            if i < self.base + n * self.num_n:
                j = i - self.base
                tm = (m0 if self.phase else c0) + j % n
                if tm >= c0:
                    tm += hole
                tn = j // n
                row0 = self.g_row0 + tm * self.BM
                return (self.g, tm, row0, min(self.BM, self.g_row1 - row0), tn * self.BN,
                        min(self.BN, self.N - tn * self.BN))
            self.base += n * self.num_n
            self.sr += 1
        return None


def _inside(t, o, first, at, stride, M):
    """Tile t's row block lies inside its group's first rows (clamped into the group) -- the rule, stated
    without the scheduler's block arithmetic."""
    g, tm, row0, rows = t[:4]
    r0 = min(max(int(o[g]), 0), M)
    r1 = min(max(int(o[g + 1]), r0), M)
    lo = min(max(int(first[at + g * stride]), r0), r1)
    hi = min(max(int(first[at + g * stride + 1]), lo), r1)
    return lo <= row0 and row0 + rows <= hi


def _check_order(o, first, at, stride, El, M, N, BM, BN, group_m, workers_list=(1, 2, 3, 7)):
    """Every worker's tiles = the stable partition of MkGroupedScheduler's linear order (inside tiles first),
    strided by worker; returns that order and how many tiles are inside."""
    seq = _grouped(o, El, M, N, BM, BN, 0, 1, group_m)
    assert len(set(seq)) == len(seq)
    ins = [t for t in seq if _inside(t, o, first, at, stride, M)]
    want = ins + [t for t in seq if not _inside(t, o, first, at, stride, M)]
    sched = GroupedFirst(o, first, at, stride, El, M, N, BM, BN, group_m)
    for workers in workers_list:
        got = [sched.tiles(w, workers) for w in range(workers)]
        for w in range(workers):
            assert got[w] == want[w::workers], (w, workers)
        assert sorted(t for q in got for t in q) == sorted(seq)  # the same tiles, each once
    return want, len(ins)


def _random_offsets(rng, El, BM, M, kind):
    if kind == "empty":
        sizes = np.zeros(El, int)
    elif kind == "ragged":  # not multiples of BM, some empty
        sizes = np.array([BM + 1, 0, 5, 2 * BM - 1, 3 * BM, 1] * El)[:El]
    else:
        sizes = rng.integers(0, 4 * BM, El) * (rng.random(El) < 0.75)
    o = np.concatenate([[0], np.cumsum(sizes)])
    if kind == "past_r_cap":  # a bad routing: offsets past M and not monotonic reach the kernel unclamped
        return o + rng.integers(-BM, 2 * BM, El + 1)
    return np.minimum(o, M)


def _random_first(rng, o, El, P, me, kind):
    """A flat [El][P + 1] array (the kernel reads [l][me], [l][me + 1]) of a kind: "split" (a source split of
    each expert, as the routing makes), "all" / "none" (every row / no row local), "wild" (anything: outside
    the group, reversed, negative)."""
    so = np.zeros((El, P + 1), np.int64)
    for l in range(El):
        a, b = int(o[l]), int(o[l + 1])
        if kind == "wild":
            so[l] = rng.integers(min(a, b) - 300, max(a, b) + 300, P + 1)
        elif kind == "all":
            so[l, :me + 1], so[l, me + 1:] = a, b
        elif kind == "none":
            so[l] = a
        else:
            cuts = np.sort(rng.integers(min(a, b), max(a, b) + 1, P - 1)) if b > a else np.full(P - 1, a)
            so[l] = [a, *cuts, b]
    return so.reshape(-1)


@pytest.mark.parametrize("cfg", ML.FUSED_CONFIGS)
@pytest.mark.parametrize("okind", ["random", "empty", "ragged", "past_r_cap"])
@pytest.mark.parametrize("fkind", ["split", "all", "none", "wild"])
def test_order_is_a_stable_partition_of_the_grouped_tiles(cfg, okind, fkind):
    c = G.CONFIGS[cfg]
    BM, BN = c.bm, c.tile_n("nk")
    rng = np.random.default_rng(_seed(cfg, okind, fkind))
    for _ in range(12):
        El = int(rng.integers(1, 7))
        P = int(rng.integers(1, 5))
        me = int(rng.integers(0, P))
        M = int(rng.integers(1, 7 * BM))
        N = int(rng.choice([8, BN, BN + 8, 3 * BN, 5 * BN - 16]))
        o = _random_offsets(rng, El, BM, M, okind)
        first = _random_first(rng, o, El, P, me, fkind)
        for group_m in (G.GROUP_M, 1, 3):
            want, n_in = _check_order(o, first, me, P + 1, El, M, N, BM, BN, group_m)
            if fkind == "none":
                assert n_in == 0
            if fkind == "all" and okind != "past_r_cap":
                assert n_in == len(want)


@pytest.mark.parametrize("kind,P,T,k,E,cap,r_cap", ROUTINGS)
def test_order_over_routings(kind, P, T, k, E, cap, r_cap):
    """The routing's own src_offsets: inside tiles are exactly the row blocks holding only this rank's rows."""
    rng = np.random.default_rng(_seed(kind, P, T, k, E, cap, 1))
    ids = _routing(rng, kind, P, T, k, E)
    lay = ref.layout_reference(ids, E, cap, r_cap)
    M = P * T * min(k, E // P) if r_cap is None else r_cap
    M = max(M, 1)
    Tk = max(T * k, 1)
    for cfg in (1, 3):
        c = G.CONFIGS[cfg]
        BM, BN = c.bm, c.tile_n("nk")
        for d in range(P):
            so = ref.src_offsets_reference(lay[d], P, T, k).reshape(-1)
            o = lay[d]["expert_offsets"]
            src = np.asarray(lay[d]["recv_src"], np.int64) // Tk
            want, n_in = _check_order(o, so, d, P + 1, E // P, M, 2 * BN, BM, BN, G.GROUP_M)
            for t in want[:n_in]:
                assert (src[t[2]:t[2] + t[3]] == d).all()
            for t in want[n_in:]:
                assert (src[t[2]:t[2] + t[3]] != d).any()


# ---- the arrival protocol over the order ------------------------------------------------------------------
def _run(queues, arrived, o, BM, M, land, rng):
    """Workers take their queues in order; a tile starts when arrived[its block] == its rows (MoeWaitRows);
    rows of `land` land in random interleaving with the workers.  Returns the tiles run."""
    ran = []
    land = list(land)
    while True:
        ready = []
        for w, q in enumerate(queues):
            if q:
                g, tm, row0, rows = q[0][:4]
                o0 = min(max(int(o[g]), 0), M)
                o1 = min(max(int(o[g + 1]), o0), M)
                assert rows == min(BM, o1 - o0 - tm * BM)  # (the hook's count: the scheduler's rows)
                if arrived[g + o0 // BM + tm] == rows:
                    ready.append(w)
        if not ready and not land:
            return ran
        if land and (not ready or rng.random() < 0.5):
            r = land.pop(int(rng.integers(0, len(land))))
            l = min(int(np.searchsorted(o, r, side="right")) - 1, len(o) - 2)  # moe_expert_of_row
            arrived[l + int(o[l]) // BM + (r - int(o[l])) // BM] += 1  # moe_row_landed
        else:
            ran.append(queues[int(rng.choice(ready))].pop(0))


@pytest.mark.parametrize("kind,P,T,k,E,cap,r_cap", [r for r in ROUTINGS if r[1] > 1 and r[2] > 0])
@pytest.mark.parametrize("cfg", [1, 3])
def test_arrivals_own_rows_first(kind, P, T, k, E, cap, r_cap, cfg):
    """This rank's rows land first (communication step 1), the peers' after every rank's ready flags (step 3).
    With the local-first order every worker has run all of its tiles of own rows before the first peer row
    lands; then every tile runs once (no deadlock) and each counter ends at its block's rows.  The grouped
    order leaves some own-row tiles behind a peer-row tile (so the check sees the difference)."""
    c = G.CONFIGS[cfg]
    BM, BN = c.bm, c.tile_n("nk")
    rng = np.random.default_rng(_seed(kind, P, T, k, E, cap, cfg))
    ids = _routing(rng, kind, P, T, k, E)
    lay = ref.layout_reference(ids, E, cap, r_cap)
    M = max(P * T * min(k, E // P) if r_cap is None else r_cap, 1)
    El, Tk = E // P, T * k
    behind = 0
    for d in range(P):
        o = np.asarray(lay[d]["expert_offsets"], np.int64)
        src = np.asarray(lay[d]["recv_src"], np.int64) // Tk
        so = ref.src_offsets_reference(lay[d], P, T, k).reshape(-1)
        n_slots = ML.arrived_slots(El, M, BM)
        own = [int(r) for r in np.flatnonzero(src == d)]
        peer = [int(r) for r in np.flatnonzero(src != d)]
        N = 3 * BN
        for workers in (1, 3, 8):
            for order in ("local_first", "grouped"):
                if order == "local_first":
                    sched = GroupedFirst(o, so, d, P + 1, El, M, N, BM, BN, G.GROUP_M)
                    queues = [sched.tiles(w, workers) for w in range(workers)]
                else:
                    queues = [_grouped(o, El, M, N, BM, BN, w, workers) for w in range(workers)]
                all_tiles = sorted(t for q in queues for t in q)
                own_tiles = {t for t in all_tiles if (src[t[2]:t[2] + t[3]] == d).all()}
                arrived = np.zeros(n_slots, np.int64)
                first = _run(queues, arrived, o, BM, M, own, rng)
                if order == "local_first":
                    assert set(first) == own_tiles
                else:
                    behind += len(own_tiles - set(first))
                rest = _run(queues, arrived, o, BM, M, peer, rng)
                assert not any(queues), "a worker waits on a row block that never completes"
                assert sorted(first + rest) == all_tiles
                for l in range(El):
                    for b in range(-(-int(o[l + 1] - o[l]) // BM)):
                        assert arrived[l + int(o[l]) // BM + b] == min(BM, int(o[l + 1]) - int(o[l]) - b * BM)
    if (kind, cap, r_cap) == ("random", 0, None) and E // P >= 4:  # (every source's rows span blocks here)
        assert behind > 0


# ---- launch arguments against the kernels' parameters ------------------------------------------------------
def _ptx(source: str, defines: dict) -> str:
    """PTX of cuda_src/<source> with ``defines`` (NVRTC, compute_90a)."""
    from cuda.bindings import nvrtc

    sources = {}
    CP._collect_sources(source, CP.cuda_src_dir(), sources)
    opts = ["-std=c++17", "--gpu-architecture=compute_90a", "-default-device",
            *(f"-I{d}" for d in [str(CP.cuda_src_dir()), *CP.include_dirs()]), *CP._define_flags(dict(defines))]
    prog = nvrtc.nvrtcCreateProgram(sources[source].encode(), source.encode(), 0, [], [])[1]
    try:
        err, = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
        n = nvrtc.nvrtcGetPTXSize(prog)[1]
        ptx = b" " * n
        nvrtc.nvrtcGetPTX(prog, ptx)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return ptx.decode(errors="replace")


def _sizes(args) -> list[int]:
    return [len(a) if isinstance(a, (bytes, bytearray)) else ctypes.sizeof(a) for a in args]


class _Kernel:
    def __init__(self, log, defines, name):
        self.log, self.defines, self.name = log, defines, name

    def max_active_blocks_per_sm(self, threads, smem=0):
        return 1

    def prepare(self, grid, block, args, **kw):
        log, defines, name = self.log, self.defines, self.name

        class Launch:
            def submit(self):
                log.append(dict(name=name, defines=defines, args=list(args)))
        return Launch()


@pytest.fixture
def env(fake, monkeypatch):
    """(launches, empty, a one-rank context whose comm arguments are a real MkComm) with the route's and the
    fused op's device pieces faked."""
    _, maps, empty = fake
    launches = []
    for mod in (FU, MO):
        monkeypatch.setattr(mod, "kernel", lambda src, defines, name: _Kernel(launches, defines, name))
    monkeypatch.setattr(MO, "_memcpy", lambda *a: None)
    monkeypatch.setattr(FU, "require_gemm_device", lambda what, dev: None)
    monkeypatch.setattr(GB, "check", lambda r: None)
    monkeypatch.setattr(GB.cu, "cuMemsetD32Async", lambda *a: None)
    states = {}
    ctx = types.SimpleNamespace(
        size=1, local_size=1, num_nodes=1, device=0, resident_sms=132, sm_count=132, workspace_generation=0,
        world=None, rank=0, check=lambda: None, op_state=lambda name: states.setdefault(name, OpState(name)),
        agree=lambda what, sig, world: 1, comm_args=lambda name, digest: MkComm(op=OPS[name]),
        workspace=lambda key, nbytes, stream, what: types.SimpleNamespace(ptr=1 << 45, peer_table=1 << 46))
    return launches, empty, ctx


def test_route_exchange_writes_the_routings_src_offsets(env):
    """mk_moe_route_exchange's launch: argument sizes as its PTX parameters; src_offsets points at the call's
    routing (re-pointed when another routing of the same shapes comes)."""
    launches, empty, ctx = env
    T, k, E = 40, 2, 4
    R = MO.moe_route(ctx, topk_ids=empty((T, k), "int32"), topk_weights=empty((T, k), "float32"), num_experts=E)
    ex = [l for l in launches if l["name"] == "mk_moe_route_exchange"]
    assert len(ex) == 1 and R.src_offsets.shape == (E, 2)
    want = _ptx_param_sizes(_ptx(ML.SOURCE, ex[0]["defines"]), "mk_moe_route_exchange")
    assert _sizes(ex[0]["args"]) == want
    assert ex[0]["args"][5].value == R.src_offsets.ptr
    R2 = MoeRouting(ctx, T, k, E)
    MO.moe_route(ctx, topk_ids=empty((T, k), "int32"), topk_weights=empty((T, k), "float32"), num_experts=E, out=R2)
    ex = [l for l in launches if l["name"] == "mk_moe_route_exchange"]
    assert len(ex) == 2 and ex[1]["args"][5].value == R2.src_offsets.ptr != R.src_offsets.ptr


@pytest.mark.parametrize("swiglu", [False, True])
def test_fused_launch_passes_src_offsets(env, swiglu):
    """mk_moe_dispatch_gemm's launch: argument sizes as its PTX parameters (both variants); the last is the
    call's routing's src_offsets, re-pointed per call."""
    launches, empty, ctx = env
    T, H, F, k, E = 64, 256, 128, 2, 4
    R = MoeRouting(ctx, T, k, E)
    x, w = empty((T, H), "bfloat16"), empty((E, 2 * F, H), "bfloat16")
    FU.moe_dispatch_gemm(ctx, x, R, w, stream=0, swiglu=swiglu)
    (l,) = launches
    want = _ptx_param_sizes(_ptx(ML.FUSED_SOURCE, l["defines"]), "mk_moe_dispatch_gemm")
    assert _sizes(l["args"]) == want and len(want) == 7
    assert l["args"][6].value == R.src_offsets.ptr
    R2 = MoeRouting(ctx, T, k, E)
    FU.moe_dispatch_gemm(ctx, x, R2, w, stream=0, swiglu=swiglu)
    assert launches[-1]["args"][6].value == R2.src_offsets.ptr != R.src_offsets.ptr


# ---- the device source itself, compiled for the host ---------------------------------------------------
def _block(text: str, start: str) -> str:
    """The declaration of mk_gemm.cuh that begins with ``start``, through its closing brace (and ';')."""
    i = text.index(start)
    j = text.index("{", i)
    depth = 0
    while True:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
        if depth == 0:
            break
    return text[i:j + (text[j] == ";")]


_HARNESS = """
#include <algorithm>
#include <cstdio>
#include <vector>
using std::max;
using std::min;
#define MK_DEVICE inline
%s
template <int BM, int BN> void run() {
  int G, M, N, group_m, P, me, workers;
  std::scanf("%%d %%d %%d %%d %%d %%d %%d", &G, &M, &N, &group_m, &P, &me, &workers);
  std::vector<int> o(G + 1), first(G * (P + 1));
  for (int& v : o) std::scanf("%%d", &v);
  for (int& v : first) std::scanf("%%d", &v);
  for (int w = 0; w < workers; ++w) {
    MkGroupedFirstScheduler<BM, BN> s(o.data(), 1, G, M, N, group_m, first.data() + me, P + 1);
    s.init(w, workers);
    MkTile t;
    while (s.next(t))
      std::printf("%%d %%d %%d %%d %%d %%d %%d\\n", w, t.group, t.tile_m, t.row0, t.rows, t.col0, t.cols);
  }
}
int main() {
  int bm, bn;
  while (std::scanf("%%d %%d", &bm, &bn) == 2) {
    if (bm == 64 && bn == 128) run<64, 128>();
    else if (bm == 128 && bn == 128) run<128, 128>();
    else run<128, 256>();
    std::printf("end\\n");
  }
}
"""


@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="no host C++ compiler")
def test_device_scheduler_source_matches_the_mirror(tmp_path):
    """MkGroupedFirstScheduler's own text (with MkGroupedScheduler, mk_raster and MkTile), compiled by g++ for
    the host, hands every worker the tiles the Python port does, on the adversarial cases above."""
    import subprocess

    text = (CP.cuda_src_dir() / "gemm" / "mk_gemm.cuh").read_text()
    decls = [_block(text, s) for s in ("struct MkTile {", "MK_DEVICE void mk_raster(",
                                       "template <int BM, int BN> struct MkGroupedScheduler {",
                                       "template <int BM, int BN> struct MkGroupedFirstScheduler {")]
    (tmp_path / "h.cpp").write_text(_HARNESS % "\n".join(decls))
    subprocess.run(["g++", "-std=c++17", "-O1", "-o", str(tmp_path / "h"), str(tmp_path / "h.cpp")], check=True)
    rng = np.random.default_rng(_seed("host"))
    cases, lines = [], []
    for trial in range(300):
        BM, BN = [(64, 128), (128, 128), (128, 256)][trial % 3]
        El, P = int(rng.integers(1, 7)), int(rng.integers(1, 5))
        me, M = int(rng.integers(0, P)), int(rng.integers(1, 7 * BM))
        N = int(rng.choice([8, BN, 3 * BN, 5 * BN - 16]))
        group_m, workers = int(rng.choice([G.GROUP_M, 1, 3])), int(rng.integers(1, 8))
        o = _random_offsets(rng, El, BM, M, ["random", "empty", "ragged", "past_r_cap"][trial % 4])
        first = _random_first(rng, o, El, P, me, ["split", "all", "none", "wild"][(trial // 4) % 4])
        cases.append((o, first, me, P + 1, El, M, N, BM, BN, group_m, workers))
        lines.append(" ".join(map(str, [BM, BN, El, M, N, group_m, P, me, workers, *o, *first])))
    out = subprocess.run([str(tmp_path / "h")], input="\n".join(lines) + "\n", capture_output=True, text=True,
                         check=True).stdout.split("end\n")
    for (o, first, at, stride, El, M, N, BM, BN, group_m, workers), got in zip(cases, out):
        per = [[] for _ in range(workers)]
        for ln in got.splitlines():
            w, *t = map(int, ln.split())
            per[w].append(tuple(t))
        sched = GroupedFirst(o, first, at, stride, El, M, N, BM, BN, group_m)
        assert per == [sched.tiles(w, workers) for w in range(workers)]
        _check_order(o, first, at, stride, El, M, N, BM, BN, group_m, (workers,))
