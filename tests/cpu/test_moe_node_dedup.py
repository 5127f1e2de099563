"""MoE node-level de-duplication on the CPU (docs/moe.md, "Node-level de-duplication";
cuda_src/ops/moe_node.cuh): a float64 numpy emulation of the whole protocol -- the batches that cross the
network (rows, meta, counts), the slots, the ready flags and who raised them, the rail peers' fan-out over
NVLink and their per-node partial sums -- with every rank's steps and every network message run in a random
order, checked against the float64 references of dispatch and combine (mkernel.ops.moe.reference) on random
and adversarial routings over N x L node shapes 2x1, 2x2, 3x2, 2x4; the network bytes against the per-rank
path's; the host's plan and launch arguments (driver fakes); bad inputs raising before any launch."""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import pytest

from mkernel import MoeOptions
from mkernel.ops.moe import layout as ML
from mkernel.ops.moe import reference as ref

from test_ring_attention_host import _Ctx as _OneNodeCtx

SHAPES = [(2, 1), (2, 2), (3, 2), (2, 4)]  # (nodes N, ranks per node L)


# ------------------------------------------------------------------ routings
def _routing(rng, P, T, k, E, L, kind):
    El = E // P
    if kind == "random":
        return [np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int32) for _ in range(P)]
    if kind == "one_expert":  # every token's first choice is expert 0 (k = 1: all tokens to one expert)
        out = []
        for _ in range(P):
            rest = np.argsort(rng.random((T, E - 1)), axis=1)[:, :k - 1] + 1
            out.append(np.concatenate([np.zeros((T, 1), np.int64), rest], axis=1).astype(np.int32))
        return out
    if kind == "rank0_empty":  # nobody picks rank 0's experts (empty experts, a rank receiving nothing)
        return [(El + np.argsort(rng.random((T, E - El)), axis=1)[:, :k]).astype(np.int32) for _ in range(P)]
    if kind == "node0_empty":  # nobody picks node 0's experts (a whole node receiving nothing)
        n0 = L * El
        return [(n0 + np.argsort(rng.random((T, E - n0)), axis=1)[:, :k]).astype(np.int32) for _ in range(P)]
    raise AssertionError(kind)


# ------------------------------------------------------------------ the emulated world
class _World:
    """N x L ranks running the node path's dispatch then combine (moe_node.cuh), one generator per rank and
    kernel: a step runs when the flags it waits for are up; network messages (per sender and destination in
    push order, as one proxy queue pair; across pairs in any order) carry (data, flag) and copy their source
    when delivered.  Flags record their writer: a reader checks it is the rank whose call word it checks."""

    def __init__(self, N, L, ids, ws, E, cap, r_cap, H, rng):
        self.N, self.L, self.P = N, L, N * L
        self.ids, self.ws, self.E, self.H, self.rng = ids, ws, E, H, rng
        self.T, self.k = ids[0].shape
        self.El = E // self.P
        self.lay = ref.layout_reference(ids, E, cap, r_cap)
        self.r_cap = r_cap
        self.W = 1 + 3 * self.k
        self.M = ML.node_meta_words(self.T, self.k)
        self.bytes = {"rows": 0, "meta": 0, "flags": 0, "partials": 0}

    # ---- helpers
    def node(self, r):
        return r // self.L

    def rail(self, r, m):
        return m * self.L + r % self.L

    def writer(self, me, r):
        """moe_node.cuh XNodeWriter: who raises ready[r] at me."""
        L, n = self.L, self.node(me)
        return r if (r // L == n or r % L == me % L) else n * L + r % L

    def set_flag(self, dst, r, by):
        assert self.ready[dst][r] is None, f"ready[{r}] at {dst} raised twice"
        assert by == self.writer(dst, r), f"ready[{r}] at {dst} raised by {by}, not its writer"
        self.ready[dst][r] = by

    def run(self, gens):
        """Step runnable ranks and deliver messages in a random order until every generator finished."""
        live = {r: g for r, g in enumerate(gens)}
        waits = {r: next(g) for r, g in live.items()}
        while live or any(self.net.values()):
            acts = [("rank", r) for r in live if waits[r]()] + [("net", key) for key, q in self.net.items() if q]
            assert acts, f"deadlock: ranks {sorted(live)} wait, no message in flight"
            kind, x = acts[self.rng.integers(len(acts))]
            if kind == "net":
                self.net[x].pop(0)()
                continue
            try:
                waits[x] = next(live[x])
            except StopIteration:
                del live[x], waits[x]

    def push(self, src, dst, deliver):
        self.net.setdefault((src, dst), []).append(deliver)

    # ---- dispatch
    def dispatch(self, xs):
        P, N, T, L = self.P, self.N, self.T, self.L
        RB = xs[0].shape[1]
        X, total = ML.x_node_dispatch_layout(L, N, T, self.k, RB * 8, self.r_cap)
        cnt_off, in_off, out_off = ML.node_meta_offsets(X, T, self.k)
        assert out_off + 4 * N * self.M <= total and in_off >= cnt_off + 4 * N  # the regions the kernel uses fit
        assert X.d_off - X.c_off >= N * T * RB * 8 and X.e_off - X.d_off >= N * T * RB * 8
        self.ready = [[None] * P for _ in range(P)]
        self.net = {}
        self.ws_ = [{"in_src": np.full(self.r_cap, -7, np.int64), "b": np.full((P, T, RB), np.nan),
                     "c": np.full((N, T, RB), np.nan), "d": np.full((N, T, RB), np.nan), "cnt": np.zeros(N, int),
                     "meta_in": np.full((N, self.M), -9, np.int64), "meta_out": np.full((N, self.M), -9, np.int64)}
                    for _ in range(P)]
        self.node_pos = [np.full((T, N), -5, np.int64) for _ in range(P)]
        self.node_meta = [np.full((N, self.M), -9, np.int64) for _ in range(P)]
        self.x_recv = [None] * P
        self.recv_map = [None] * P
        self.run([self._dispatch_rank(me, xs) for me in range(P)])
        return self.x_recv, self.recv_map

    def _dispatch_rank(self, me, xs):
        P, N, T, k, L, El = self.P, self.N, self.T, self.k, self.L, self.El
        n, w, Tk = self.node(me), self.ws_[me], T * k
        slots, ids = self.lay[me]["slots"], self.ids[me]
        yield lambda: True
        for t in self.rng.permutation(T):  # phase 1: warps in any order
            d = [ids[t, j] // El if slots[t, j] >= 0 else -1 for j in range(k)]
            for j in range(k):
                if d[j] >= 0 and self.node(d[j]) == n:
                    self.ws_[d[j]]["in_src"][slots[t, j]] = me * Tk + t * k + j
            for dst in {x for x in d if x >= 0 and self.node(x) == n and x != me}:
                self.ws_[dst]["b"][me, t] = xs[me][t]
            self.node_pos[me][t] = -1
            for m in sorted({self.node(x) for x in d if x >= 0 and self.node(x) != n}):
                q = w["cnt"][m]
                w["cnt"][m] += 1
                self.node_pos[me][t, m] = q
                w["d"][m, q] = xs[me][t]
                w["meta_out"][m, 1 + q * self.W:1 + (q + 1) * self.W] = np.concatenate(
                    [[t], ids[t], slots[t], self.ws[me][t].view(np.int32)])
        yield lambda: True  # grid barrier
        for r in range(n * L, (n + 1) * L):  # n_publish_batches
            if r != me:
                self.set_flag(r, me, me)
        for m in range(N):
            if m != n:
                cnt = int(w["cnt"][m])
                w["meta_out"][m, 0] = cnt
                self.push(me, self.rail(me, m), self._batch(me, self.rail(me, m), m, n, cnt))
        rails = [self.rail(me, m) for m in range(N) if m != n]
        yield lambda: all(self.ready[me][s] is not None for s in rails)
        entries = [(m, q) for m in range(N) if m != n for q in range(int(w["meta_in"][m, 0]))]
        for m in range(N):
            if m != n:
                self.node_meta[me][m, 0] = w["meta_in"][m, 0]
        for i in self.rng.permutation(len(entries)):  # n_forward, warps in any order
            self._forward_entry(me, *entries[i])
        yield lambda: True  # grid barrier
        for r in range(n * L, (n + 1) * L):  # n_raise_forwarded
            if r != me:
                for s in rails:
                    self.set_flag(r, s, me)
        yield lambda: all(self.ready[me][r] is not None for r in range(P) if r != me)
        R = int(self.lay[me]["expert_offsets"][-1])
        rm = w["in_src"][:R].copy()
        src, t = rm // Tk, (rm % Tk) // k
        self.recv_map[me] = rm
        self.x_recv[me] = np.stack([xs[me][t[r]] if src[r] == me else w["b"][src[r], t[r]] for r in range(R)]) \
            if R else np.zeros((0, xs[0].shape[1]))

    def _batch(self, me, g, m, n, cnt):
        """The two WRITEs of a batch and the FLAG riding on the second (read when delivered)."""
        src, dst, W = self.ws_[me], self.ws_[g], self.W
        RB = src["d"].shape[2]

        def deliver():
            dst["c"][n, :cnt] = src["d"][m, :cnt]
            dst["meta_in"][n, :1 + cnt * W] = src["meta_out"][m, :1 + cnt * W]
            self.bytes["rows"] += cnt * RB * 2  # (bf16 rows)
            self.bytes["meta"] += 4 * (1 + cnt * W)
            self.bytes["flags"] += 8
            self.set_flag(g, me, me)
        return deliver

    def _forward_entry(self, me, m, q):
        k, El, L, n, T = self.k, self.El, self.L, self.node(me), self.T
        w = self.ws_[me]
        ent = w["meta_in"][m, 1 + q * self.W:1 + (q + 1) * self.W]
        t, ids, slots = int(ent[0]), ent[1:1 + k], ent[1 + k:1 + 2 * k]
        s = self.rail(me, m)
        keep = np.where((slots >= 0) & (ids // El // L == n), slots, -1)
        self.node_meta[me][m, 1 + q * self.W:1 + (q + 1) * self.W] = np.concatenate(
            [[t], ids, keep, ent[1 + 2 * k:]])
        for j in range(k):
            if keep[j] >= 0:
                self.ws_[ids[j] // El]["in_src"][keep[j]] = s * T * k + t * k + j
        for dst in {int(ids[j]) // El for j in range(k) if keep[j] >= 0}:
            self.ws_[dst]["b"][s, t] = w["c"][m, q]

    # ---- combine
    def combine(self, ys):
        P, N, T, k, L, H = self.P, self.N, self.T, self.k, self.L, self.H
        X, total = ML.x_node_combine_layout(L, N, T, k, H, H * 2)
        assert X.c_off - X.b_off >= T * k * H * 2 and X.d_off - X.c_off >= N * T * k * H * 2
        assert X.e_off - X.d_off >= N * T * H * 4 and total - X.e_off >= N * T * H * 4
        self.ready = [[None] * P for _ in range(P)]
        self.net = {}
        self.cws = [{"b": np.full((T * k, H), np.nan), "c": np.full((N, T * k, H), np.nan),
                     "d": np.full((N, T, H), np.nan), "e": np.full((N, T, H), np.nan)} for _ in range(P)]
        self.out = [None] * P
        self.run([self._combine_rank(me, ys) for me in range(P)])
        return self.out

    def _combine_rank(self, me, ys):
        P, N, T, k, L, El, H = self.P, self.N, self.T, self.k, self.L, self.El, self.H
        n, w, Tk = self.node(me), self.cws[me], T * k
        yield lambda: True
        for r in self.rng.permutation(len(self.recv_map[me])):  # n_return_rows
            v = int(self.recv_map[me][r])
            src, tj = v // Tk, v % Tk
            fwd = n * L + src % L
            if src == me or (self.node(src) != n and fwd == me):
                continue
            if self.node(src) == n:
                self.cws[src]["b"][tj] = ys[me][r]
            else:
                self.cws[fwd]["c"][self.node(src), tj] = ys[me][r]
        yield lambda: True  # grid barrier
        for r in range(n * L, (n + 1) * L):  # n_raise_local
            if r != me:
                self.set_flag(r, me, me)
        yield lambda: all(self.ready[me][r] is not None for r in range(n * L, (n + 1) * L) if r != me)
        for m in range(N):  # n_partials (order of entries is irrelevant: each is its own sum)
            if m == n:
                continue
            meta = self.node_meta[me][m]
            for q in range(int(meta[0])):
                ent = meta[1 + q * self.W:1 + (q + 1) * self.W]
                t, ids, slots = int(ent[0]), ent[1:1 + k], ent[1 + k:1 + 2 * k]
                wts = ent[1 + 2 * k:].astype(np.int32).view(np.float32)
                acc = np.zeros(H)
                for j in range(k):  # j order
                    if slots[j] >= 0:
                        d = int(ids[j]) // El
                        row = ys[me][slots[j]] if d == me else w["c"][m, t * k + j]
                        acc = acc + float(wts[j]) * row
                w["d"][m, q] = acc
        yield lambda: True  # grid barrier
        for m in range(N):  # n_publish_partials
            if m != n:
                self.push(me, self.rail(me, m), self._partials(me, m, n, int(self.node_meta[me][m][0])))
        rails = [self.rail(me, m) for m in range(N) if m != n]
        yield lambda: all(self.ready[me][s] is not None for s in rails)
        slots, ids, wts = self.lay[me]["slots"], self.ids[me], self.ws[me]
        out = np.zeros((T, H))
        for t in range(T):  # n_sum_nodes: node order
            for m in range(N):
                if m == n:
                    acc = np.zeros(H)
                    for j in range(k):
                        d = int(ids[t, j]) // El
                        if slots[t, j] >= 0 and self.node(d) == n:
                            row = ys[me][slots[t, j]] if d == me else w["b"][t * k + j]
                            acc = acc + float(wts[t, j]) * row
                    out[t] = out[t] + acc
                elif self.node_pos[me][t, m] >= 0:
                    out[t] = out[t] + w["e"][m, self.node_pos[me][t, m]]
        self.out[me] = out

    def _partials(self, me, m, n, cnt):
        src, dst = self.cws[me], self.cws[self.rail(me, m)]

        def deliver():
            dst["e"][n, :cnt] = src["d"][m, :cnt]
            self.bytes["partials"] += cnt * self.H * 4
            self.bytes["flags"] += 8
            self.set_flag(self.rail(me, m), me, me)
        return deliver


def _per_rank_bytes(w: _World, RB: int) -> tuple[int, int]:
    """(dispatch, combine) network bytes of the per-rank path: a row (and its recv_src int) per kept pair whose
    owner is on another node, and the row back (moe_internode.cu)."""
    n_far = 0
    for s in range(w.P):
        d = w.ids[s] // w.El
        n_far += int(((w.lay[s]["slots"] >= 0) & (d // w.L != s // w.L)).sum())
    return n_far * (RB + 4), n_far * RB


def _token_nodes(w: _World) -> int:
    """(token, other node holding a kept pair of it) pairs: the rows the node path sends."""
    n = 0
    for s in range(w.P):
        d = np.where(w.lay[s]["slots"] >= 0, w.ids[s] // w.El // w.L, -1)
        for t in range(w.T):
            n += len({int(m) for m in d[t] if m >= 0 and m != s // w.L})
    return n


CASES = [(37, 2, 2, "random", 0, None), (29, 8, 4, "random", 0, None), (41, 1, 2, "random", 0, None),
         (33, 1, 1, "one_expert", 0, None), (50, 3, 2, "one_expert", 0, None), (31, 2, 2, "rank0_empty", 0, None),
         (23, 2, 2, "node0_empty", 0, None), (45, 4, 2, "random", 6, None), (64, 8, 2, "random", 0, 70),
         (0, 2, 2, "random", 0, None), (1, 1, 1, "random", 0, None)]


@pytest.mark.parametrize("N,L", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("T,k,El,kind,cap,r_cap", CASES)
def test_emulated_protocol_matches_the_references(N, L, T, k, El, kind, cap, r_cap):
    """Dispatch (x_recv and recv_map bit-exact), combine (float64 against the reference), twice with other
    random schedules (bit-identical outputs: the sums' order is fixed), and the bytes on the network."""
    P = N * L
    E = El * P
    if k > E:
        pytest.skip("k > E")
    seed = hash((N, L, T, k, El, kind, cap, r_cap)) % 2 ** 32
    rng = np.random.default_rng(seed)
    ids = _routing(rng, P, T, k, E, L, kind)
    ws = [rng.random((T, k)).astype(np.float32) for _ in range(P)]
    H = 8
    rc = r_cap or P * T * min(k, El)
    rc = max(1, rc)
    xs = [rng.standard_normal((T, H)) for _ in range(P)]
    ys = [rng.standard_normal((rc, H)) for _ in range(P)]
    lay = ref.layout_reference(ids, E, cap, rc)
    want_x = ref.dispatch_reference(xs, lay, k)
    want_out = ref.combine_reference(ys, ids, ws, [l["slots"] for l in lay], E)
    outs = []
    for sched in range(2):
        w = _World(N, L, ids, ws, E, cap, rc, H, np.random.default_rng(seed + 1 + sched))
        x_recv, recv_map = w.dispatch(xs)
        for d in range(P):
            np.testing.assert_array_equal(recv_map[d], lay[d]["recv_src"], err_msg=f"recv_map of rank {d}")
            np.testing.assert_array_equal(x_recv[d], want_x[d], err_msg=f"x_recv of rank {d}")
        out = w.combine(ys)
        for s in range(P):
            np.testing.assert_allclose(out[s], want_out[s], rtol=1e-12, atol=1e-12, err_msg=f"out of rank {s}")
        outs.append(out)
        rows = _token_nodes(w)
        assert w.bytes["rows"] == rows * H * 2 and w.bytes["partials"] == rows * H * 4
        assert w.bytes["meta"] == 4 * (P * (N - 1) + rows * (1 + 3 * k))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)  # another schedule, the same bits


def test_network_rows_fall_by_the_pairs_per_node():
    """Top-8 of 256 experts over 2 nodes x 4 ranks (DeepSeek-like routing shape): the per-rank path sends a
    row per kept pair on another node (~4 per token), the node path one per token and other node (~1):
    dispatch bytes fall ~3.9x at H = 7168 bf16; combine bytes (fp32 partials against bf16 rows) ~1.9x."""
    N, L, T, k, El, H = 2, 4, 64, 8, 32, 7168
    P, E = N * L, 32 * N * L
    rng = np.random.default_rng(7)
    ids = _routing(rng, P, T, k, E, L, "random")
    w = _World(N, L, ids, [rng.random((T, k)).astype(np.float32) for _ in range(P)], E, 0, P * T * k, 1, rng)
    RB = H * 2
    per_rank_d, per_rank_c = _per_rank_bytes(w, RB)
    rows = _token_nodes(w)
    node_d = rows * RB + 4 * (P * (N - 1) + rows * (1 + 3 * k))
    node_c = rows * H * 4
    assert per_rank_d / node_d > 3.5 and per_rank_c / node_c > 1.75, (per_rank_d / node_d, per_rank_c / node_c)
    # top-1: one pair per token and node -- dispatch a wash, combine partials twice the bf16 rows
    ids1 = [a[:, :1].copy() for a in ids]
    w1 = _World(N, L, ids1, [np.ones((T, 1), np.float32)] * P, E, 0, P * T, 1, rng)
    d1, c1 = _per_rank_bytes(w1, RB)
    r1 = _token_nodes(w1)
    assert r1 * RB == d1 // (RB + 4) * RB and r1 * H * 4 == 2 * c1


# ------------------------------------------------------------------ kernels against the host
_SRC = Path(__file__).resolve().parents[2] / "cuda_src" / "ops" / "moe_node.cuh"


def _params(kernel: str) -> list[str]:
    text = _SRC.read_text()
    m = re.search(kernel + r"\((.*?)\)\s*\{", text, re.S)
    return [re.split(r"[\s*]+", p.strip())[-1] for p in m.group(1).split(",")]


def test_node_meta_offsets_match_the_kernel_formula():
    """x_node_meta of moe_node.cuh: cnt at e_off, meta_in after round_up(4N, 16), meta_out after N * M words."""
    X, total = ML.x_node_dispatch_layout(2, 3, 37, 4, 48, 100)
    cnt, mi, mo = ML.node_meta_offsets(X, 37, 4)
    M = 1 + 37 * 13
    assert (cnt, mi, mo) == (X.e_off, X.e_off + 16, X.e_off + 16 + 3 * M * 4) and mo + 3 * M * 4 <= total
    assert "m.in_off = X.e_off + (((mk_u64)X.N * 4 + 15) & ~15ull);" in _SRC.read_text()


class _Ctx(_OneNodeCtx):
    num_nodes, local_size, local_rank, rank, size, device, node = 2, 2, 1, 1, 4, 0, 0
    node_of_rank = [0, 0, 1, 1]
    workspace_generation, resident_sms, sm_count, timeout, world = 0, 132, 132, 10.0, None

    def agree(self, what, sig, world):
        return 1234

    def comm_args(self, op, digest):
        return ("comm", op, digest)


_ADDR = [0x10000000]


def _arr(shape, dtype="bfloat16"):
    from mkernel.core.arrays import DeviceArray

    _ADDR[0] += 1 << 28
    return DeviceArray(_ADDR[0], shape, dtype, None, device=0)


@pytest.fixture
def fakes(monkeypatch):
    """The inter-node MoE ops on driver fakes: arrays at fake addresses, kernels logging their launches'
    arguments, a fake proxy state and memset; returns (ctx, log)."""
    from mkernel.core.arrays import DeviceArray
    from mkernel.ops.moe import internode as XI

    log = []

    class Kern:
        def __init__(self, name):
            self.name = name

        def max_active_blocks_per_sm(self, threads):
            return 1

        def prepare(self, grid, threads, args, stream=None, cooperative=False):
            assert cooperative and threads == ML.THREADS and grid == XI.grid(_Ctx)
            name = self.name

            class Launch:
                def submit(self):
                    log.append(("launch", name, args))
            return Launch()

    class Proxy:
        def ring_device_struct(self):
            return "ring"

    class St:
        proxy = Proxy()

        class ws:
            ptr, peer_table, nbytes = 0x5000_0000, 0x6000_0000, 1 << 40

    class Cu:
        CUdeviceptr = CUstream = staticmethod(lambda v: v)

        @staticmethod
        def cuMemsetD32Async(ptr, v, n, stream):
            log.append(("memset", ptr, v, n, stream))
            return (0,)

    monkeypatch.setattr(DeviceArray, "empty", staticmethod(lambda shape, dtype, device=None: _arr(shape, dtype)))
    monkeypatch.setattr(XI, "_kernel", lambda name, d=0, o=0: Kern(name))
    monkeypatch.setattr(XI, "proxy_state", lambda ctx, op, nbytes, stream: (log.append(("proxy", op, nbytes)), St)[1])
    monkeypatch.setattr(XI, "cu", Cu)
    monkeypatch.setattr(XI, "check", lambda r: r)
    monkeypatch.setattr(XI, "mark_proxy_launch", lambda stream: log.append(("marked", stream)))
    monkeypatch.setattr(XI._XRoute, "bind", lambda self, ctx, call, p: pytest.fail("routing launched"))
    return _Ctx(), log


def _routing_obj(ctx, T=10, k=2, E=8):
    from mkernel.ops.moe.op import MoeRouting

    return MoeRouting(ctx, T, k, E)


def test_node_path_plan_and_launch_arguments(fakes):
    """dispatch / combine with node_dedup: plan "node", the node kernels with one argument per kernel
    parameter (in order), the counters zeroed before the dispatch launch, both launches marked as waiting on
    the proxy, the node path's own workspace; without it the per-rank kernels and plan "rank"."""
    import mkernel

    ctx, log = fakes
    R = _routing_obj(ctx)
    opts = MoeOptions(node_dedup=True)
    x = _arr((10, 64))
    xr = _arr((R.recv_rows, 64))
    mkernel.moe_dispatch(ctx, x, R, xr, options=opts, stream=5)
    assert ctx.op_state("moe_dispatch").last_plan.transport == "node" and R.dispatched_by == "node"
    out = _arr((10, 64), "float32")
    mkernel.moe_combine(ctx, xr, R, out, options=opts, stream=5)
    assert ctx.op_state("moe_combine").last_plan.transport == "node"
    kinds = [e[0] for e in log]
    assert kinds == ["proxy", "memset", "launch", "marked", "proxy", "launch", "marked"], kinds
    assert [e[1] for e in log if e[0] == "proxy"] == ["moe_dispatch_node", "moe_combine_node"]
    mem = log[1]
    lay = ctx.op_state("moe_dispatch").last_plan.layout
    assert mem == ("memset", 0x5000_0000 + ML.node_meta_offsets(lay, 10, 2)[0], 0, 2, 5)
    for e in (log[2], log[5]):
        assert len(e[2]) == len(_params(e[1])), (e[1], _params(e[1]))
    d_args = log[2][2]
    assert d_args[2].value == x.ptr and d_args[7].value == xr.ptr and d_args[9].value == R.node_pos.ptr
    assert d_args[10].value == R.node_meta.ptr
    c_args = log[5][2]
    assert c_args[2].value == xr.ptr and c_args[8].value == R.node_pos.ptr and c_args[10].value == out.ptr
    log.clear()
    mkernel.moe_dispatch(ctx, x, R, xr, stream=5)
    assert ctx.op_state("moe_dispatch").last_plan.transport == "rank" and R.dispatched_by == "rank"
    assert [e[1] for e in log if e[0] == "launch"] == ["mk_moe_x_dispatch"]


def test_bad_inputs_raise_before_launch(fakes):
    import mkernel

    ctx, log = fakes
    R = _routing_obj(ctx)
    xr = _arr((R.recv_rows, 64))
    with pytest.raises(ValueError, match="node_dedup"):
        mkernel.moe_combine(ctx, xr, R, options=MoeOptions(node_dedup=True))  # never dispatched
    mkernel.moe_dispatch(ctx, _arr((10, 64)), R, xr)
    with pytest.raises(ValueError, match="node_dedup"):
        mkernel.moe_combine(ctx, xr, R, options=MoeOptions(node_dedup=True))  # dispatched per rank
    with pytest.raises(ValueError, match="node_dedup"):
        MoeOptions(node_dedup=1).checked()
    with pytest.raises(ValueError):
        mkernel.moe_dispatch(ctx, _arr((11, 64)), R, xr, options=MoeOptions(node_dedup=True))  # T mismatch
    with pytest.raises(ValueError, match="16 bytes"):
        mkernel.moe_dispatch(ctx, _arr((10, 7)), R, options=MoeOptions(node_dedup=True))
    assert [e[1] for e in log if e[0] == "launch"] == ["mk_moe_x_dispatch"]
    assert ctypes.sizeof(ML.MoeXLayout) == 88
