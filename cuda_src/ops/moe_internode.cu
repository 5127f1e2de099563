// moe_internode.cu - MoE routing exchange, dispatch and combine across nodes (docs/moe.md, "Across nodes").
//
// P = L * N world ranks, node-major (world rank = node * L + local rank); E experts, El = E / P per rank,
// global expert e on world rank e / El.  A rank on this node is reached by NVLink stores (peers[], indexed
// by local rank), a rank on another node through this rank's CPU proxy (mk_proxy.cuh): the kernel writes
// what a remote rank gets into a staging region of its own workspace (the proxy's window 0), in the
// destination's slot order, then posts WRITE commands of contiguous slot ranges and a FLAG.  The proxy
// sets the flag only after the data (docs/internode.md, "Ordering").  The slot order is the one-node path's
// (moe.cu), so the results are bit-identical to one node's.
//
// Workspace (MoeXLayout; window 0 of the op's proxy; the same layout on every rank):
//   [0]             MkEpochState;   [bar_off] u64 grid barrier (local)
//   [consumed_off]  u64 consumed[P]: world rank r finished reading what we wrote into it (call number)
//   [calls_off]     u64 calls[P][2]: rank r's announcement (e << 32 | sig) of its call e (internode.cu)
//   [ready_off]     u64 ready[P]: rank r's data of call e is here (value e)
//   [a..e_off]      op regions (below)
// A writer waits consumed[dst] >= e - 1 before writing into dst (route: parity slots, no wait needed);
// the last block of a call waits until the proxy read every command it pushed, then raises consumed[me]
// at every rank.  Every wait is bounded (mk_wait_geq) and names the world rank waited on.
#include "ops/mk_moe.cuh"
#include "core/mk_proxy.cuh"

#define MOE_MAX_E 1024  // experts (moe/layout.py MAX_EXPERTS; thread e of the exchange = expert e)

struct MoeXLayout {
  mk_u64 consumed_off, calls_off, ready_off, bar_off;
  mk_u64 a_off, b_off, c_off, d_off, e_off;  // op regions
  mk_u64 row_bytes;
  int L, N;  // ranks per node, nodes
};

// Host ctypes layout (moe/layout.py MoeXLayout), checked by tests/cpu/test_moe_internode.py.
#ifdef MK_EXPECT_MOEX_LAYOUT
#define MOEX_OFF(f) ((unsigned long long)__builtin_offsetof(MoeXLayout, f))
constexpr unsigned long long moex_expected[] = MK_EXPECT_MOEX_LAYOUT;
constexpr unsigned long long moex_device[] = {
    sizeof(MoeXLayout), MOEX_OFF(consumed_off), MOEX_OFF(calls_off), MOEX_OFF(ready_off), MOEX_OFF(bar_off),
    MOEX_OFF(a_off), MOEX_OFF(b_off), MOEX_OFF(c_off), MOEX_OFF(d_off), MOEX_OFF(e_off), MOEX_OFF(row_bytes),
    MOEX_OFF(L), MOEX_OFF(N)};
static_assert(mk_same_words(moex_expected, moex_device), "moe_internode.cu: MoeXLayout differs from the host's ctypes struct");
#undef MOEX_OFF
#endif

struct XWs {
  char* base;
  const mk_u64* __restrict__ peers;  // local rank -> workspace as mapped here
  MoeXLayout X;
  int me, n, P;
  MK_DEVICE bool local(int r) const { return r / X.L == n; }
  MK_DEVICE bool rail(int r) const { return r % X.L == me % X.L; }  // same local rank (the node path's peer)
  // rank r's workspace at byte `off` (r on this node)
  MK_DEVICE char* at(int r, mk_u64 off) const { return (r == me ? base : (char*)peers[r % X.L]) + off; }
  MK_DEVICE MkEpochState* st() const { return (MkEpochState*)base; }
  MK_DEVICE mk_u64 consumed_off(int r) const { return X.consumed_off + 8ull * r; }
  MK_DEVICE mk_u64 call_off(int r, mk_u64 e) const { return X.calls_off + 16ull * r + 8ull * (e & 1); }
  MK_DEVICE mk_u64 ready_off(int r) const { return X.ready_off + 8ull * r; }
  MK_DEVICE mk_u64* word(mk_u64 off) const { return (mk_u64*)(base + off); }
};

MK_DEVICE XWs make_xws(const MkComm& c, char* ws, const mk_u64* peers, const MoeXLayout& X) {
  return XWs{ws, peers, X, c.rank, c.node, X.L * X.N};
}

// Which ranks a helper below covers and whose call word vouches for rank r's data: every rank, itself (the
// per-rank path); the node path passes its neighbours and forwarders (moe_node.cuh).
struct XEvery {
  MK_DEVICE bool operator()(int) const { return true; }
};
struct XSelf {
  MK_DEVICE int operator()(int r) const { return r; }
};

// One thread: the u64 at `off` of rank r's workspace := v (NVLink store, or a proxy FLAG).
MK_DEVICE bool x_set(const MkComm& c, const XWs& w, const MkProxy& p, int r, mk_u64 off, mk_u64 v) {
  if (w.local(r)) {
    mk_signal_set((mk_u64*)w.at(r, off), v);
    return true;
  }
  return mk_proxy_push(c, p, MK_PROXY_OP_FLAG, r, 0, 0, 0, 0, 0, off, v) != MK_PROXY_NO_FLAG;
}

// Every block first: block 0's thread 0 announces (call, signature) to every rank `near` covers (its
// readers); block-uniform verdict.
template <class Near = XEvery>
MK_DEVICE bool x_open(const MkComm& c, const XWs& w, const MkProxy& p, mk_u64 e, Near near = Near()) {
  int ok = 1;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const mk_u64 word = (e << 32) | (mk_u64)c.sig;
    for (int r = 0; r < w.P && ok; ++r)
      if (r != w.me && near(r)) ok = x_set(c, w, p, r, w.call_off(w.me, e), word);
  }
  return __syncthreads_and(ok) != 0;
}

// Whole block, block-uniform verdict: block 0's thread 0 raises ready[me] = e at every other rank -- at a
// rank on another node after `send(r)` pushed its WRITEs (false: a push failed, stop), the FLAG after them
// ("flag visible => data complete", docs/internode.md).
template <class Send>
MK_DEVICE bool x_publish(const MkComm& c, const XWs& w, const MkProxy& p, mk_u64 e, Send send) {
  int ok = 1;
  if (blockIdx.x == 0 && threadIdx.x == 0)
    for (int r = 0; r < w.P && ok; ++r)
      if (r != w.me) ok = (w.local(r) || send(r)) && x_set(c, w, p, r, w.ready_off(w.me), e);
  return __syncthreads_and(ok) != 0;
}

// Whole block: every other rank `near` covers (those we write into) consumed what we wrote in call e - 1.
template <class Near = XEvery>
MK_DEVICE bool x_wait_consumed(const MkComm& c, const XWs& w, mk_u64 e, Near near = Near()) {
  int ok = 1;
  for (int r = threadIdx.x; r < w.P; r += blockDim.x)
    if (r != w.me && near(r)) ok &= mk_wait_geq(c, w.word(w.consumed_off(r)), e - 1, r, -1 - r);
  return __syncthreads_and(ok) != 0;
}

// Whole block: the data of call e of every other rank `near` covers is here (ready[r]) and its writer
// `writer(r)` made this very call (its announced signature is ours; another one is MK_ERR_MISMATCH naming
// it: docs/internode.md, "Call signatures").
template <class Near = XEvery, class Writer = XSelf>
MK_DEVICE bool x_wait_ready(const MkComm& c, const XWs& w, mk_u64 e, Near near = Near(), Writer writer = Writer()) {
  int ok = 1;
  for (int r = threadIdx.x; r < w.P; r += blockDim.x) {
    if (r == w.me || !near(r)) continue;
    if (!(ok = ok && mk_wait_geq(c, w.word(w.ready_off(r)), e, r, r))) break;
    const int wr = writer(r), fi = -1000 - wr;
    if (!(ok = mk_wait_geq(c, w.word(w.call_off(wr, e)), e << 32, wr, fi))) break;
    const mk_u64 got = mk_ld_acquire(w.word(w.call_off(wr, e)));
    if (got != ((e << 32) | (mk_u64)c.sig)) {
      mk_report(c, MK_ERR_MISMATCH, wr, fi, c.sig, got & 0xffffffffull, 0);
      ok = 0;
    }
  }
  return __syncthreads_and(ok) != 0;
}

// Whole grid: every block's stores so far are done and visible system-wide (the proxy reads the staging
// next): barrier `bar` of `per_call` in call e.  The barrier word counts arrivals across calls, so the grid
// is fixed per workspace (moe/internode.py).
MK_DEVICE bool x_grid_wait(const MkComm& c, const XWs& w, mk_u64 e, int per_call, int bar) {
  __syncthreads();
  int ok = 1;
  if (threadIdx.x == 0) {
    __threadfence_system();
    mk_u64* word = w.word(w.X.bar_off);
    atomicAdd(word, 1ull);
    ok = mk_wait_geq(c, word, (e * per_call - (per_call - 1 - bar)) * (mk_u64)gridDim.x, -1, -101);
  }
  return __syncthreads_and(ok) != 0;
}

// One barrier per call (the per-rank path's kernels).
MK_DEVICE bool x_grid_sync(const MkComm& c, const XWs& w, mk_u64 e) { return x_grid_wait(c, w, e, 1, 0); }

// End of call (every block): the last one waits until the proxy read every command we pushed, raises
// consumed[me] = e at every rank `near` covers (those that write into us), and commits the epoch.
template <class Near = XEvery>
MK_DEVICE void x_finish(const MkComm& c, const XWs& w, const MkProxy& p, mk_u64 e, Near near = Near()) {
  if (mk_epoch_arrive(w.st(), gridDim.x)) {
    if (threadIdx.x == 0) {
      const mk_u64 head = *((volatile mk_u64*)p.head);
      if (head > 0 && !mk_proxy_wait_done(c, p, head - 1)) return;
      for (int r = 0; r < w.P; ++r)
        if (r != w.me && near(r) && !x_set(c, w, p, r, w.consumed_off(w.me), e)) return;
    }
    __syncthreads();
    mk_epoch_commit(w.st(), e);
  }
}

// ---------------------------------------------------------------------------------------------
// Routing exchange across nodes (one block of MOE_MAX_E threads; thread e = global expert e): as
// mk_moe_route_exchange of moe.cu over the P world ranks.  Regions: a = int32 counts[2][P][E] (row s
// written by rank s, parity e & 1), b = int32 my counts [E] (the proxy's source).  Outputs besides
// expert_offsets / base / src_offsets (moe.cu): send_ranges[e] = (first row, rows) of this rank's kept pairs
// of expert e in its owner's receive buffer.
extern "C" __global__ void __launch_bounds__(MOE_MAX_E, 1)
mk_moe_x_route_exchange(MkComm c, MkProxy p, int* __restrict__ tile_cnt, int ntiles, int* __restrict__ expert_offsets,
                        int* __restrict__ base, int* __restrict__ send_ranges, int* __restrict__ src_offsets, char* ws,
                        const mk_u64* __restrict__ peers, MoeXLayout X, MoeShape s) {
  __shared__ int sh[MOE_MAX_E];
  const XWs w = make_xws(c, ws, peers, X);
  const mk_u64 ep = mk_epoch_begin(w.st());
  const int e = threadIdx.x, E = s.E, P = w.P, me = w.me;
  const bool on = e < E;
  if (!x_open(c, w, p, ep)) return;
  const int mine = moe_tile_prefix(tile_cnt, ntiles, E, e, on);
  const int par = (int)(ep & 1);
  const mk_u64 row_off = X.a_off + ((mk_u64)par * P + me) * E * 4;  // counts[par][me][.]
  if (on) {
    ((int*)(w.base + X.b_off))[e] = mine;
    for (int r = 0; r < P; ++r)
      if (w.local(r)) ((int*)w.at(r, row_off))[e] = mine;
  }
  __syncthreads();
  int ok = 1;
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int r = 0; r < P && ok; ++r) {
      if (r == me) continue;
      if (w.local(r)) mk_signal_set((mk_u64*)w.at(r, w.ready_off(me)), ep);
      else
        ok = mk_proxy_push(c, p, MK_PROXY_OP_WRITE, r, 0, X.b_off, row_off, (mk_u64)E * 4, 0, w.ready_off(me), ep) !=
             MK_PROXY_NO_FLAG;
    }
  }
  if (!__syncthreads_and(ok)) return;
  if (!x_wait_ready(c, w, ep)) return;
  const int* cnts = (const int*)(w.base + X.a_off) + (mk_u64)par * P * E;
  const MoeExpertPlace pl = moe_expert_place(cnts, s, P, me, e, on, sh);
  if (on) {
    moe_store_place(pl, s, me, e, base, expert_offsets);
    const int b = pl.start + pl.before_me;
    send_ranges[2 * e] = b;
    send_ranges[2 * e + 1] = max(0, min(mine, min(pl.cap - pl.before_me, s.r_cap - b)));
    moe_store_src_offsets(pl, cnts, s, P, me, e, src_offsets);
  }
  __syncthreads();
  x_finish(c, w, p, ep);
}

// ---------------------------------------------------------------------------------------------
// Dispatch across nodes (cooperative, fixed grid, blocks of 256 threads, a warp per token / row).
// Regions: a = int32 in_src[r_cap] (recv_src of every received row, written by its sender), b = rows
// [P][T] (rank s's token t, from NVLink senders), c = rows [r_cap] (remote senders' rows at their slot),
// d = rows [P][r_cap] (ours for remote rank r, at the slot: the proxy's source), e = int32 [P][r_cap]
// (in_src values for remote rank r, likewise).
//   1. a warp per token: to this node's ranks the row once per destination rank (as moe.cu); to a remote
//      rank the row into d[r][slot] for each kept pair (and its in_src value into e[r][slot]);
//   2. grid barrier; block 0: ready[me] at this node's ranks; per remote rank r and expert of r, WRITE the
//      contiguous slot range send_ranges[e] of rows and of in_src values, then FLAG ready[me];
//   3. wait for every rank's ready flag and call; expand x_recv[r] from x, b or c by in_src[r].
extern "C" __global__ void __launch_bounds__(256, 1)
mk_moe_x_dispatch(MkComm c, MkProxy p, const char* __restrict__ x, const int* __restrict__ ids,
                  const int* __restrict__ slots, const int* __restrict__ send_ranges,
                  const int* __restrict__ expert_offsets, char* __restrict__ x_recv, int* __restrict__ recv_map,
                  char* ws, const mk_u64* __restrict__ peers, MoeXLayout X, MoeShape s) {
  const XWs w = make_xws(c, ws, peers, X);
  const mk_u64 ep = mk_epoch_begin(w.st());
  const MoeWarps pool;
  const int lane = pool.lane, warps = pool.warps, gw = pool.gw, k = s.k, me = w.me, P = w.P, El = s.El;
  const mk_u64 RB = X.row_bytes, Tk = (mk_u64)s.T * k, RC = (mk_u64)s.r_cap;
  if (!x_open(c, w, p, ep)) return;
  if (!x_wait_consumed(c, w, ep)) return;
  for (int t = gw; t < s.T; t += warps) {  // (warp-uniform)
    int d = -1, slot = -1;
    if (lane < k) {
      slot = slots[(mk_u64)t * k + lane];
      if (slot >= 0) d = ids[(mk_u64)t * k + lane] / El;
    }
    const bool near = slot >= 0 && w.local(d);
    if (slot >= 0) {
      const int v = (int)((mk_u64)me * Tk + (mk_u64)t * k + lane);
      if (near) ((int*)w.at(d, X.a_off))[slot] = v;
      else ((int*)(w.base + X.e_off))[(mk_u64)d * RC + slot] = v;
    }
    unsigned todo = __ballot_sync(0xffffffffu, near && d != me);
    while (todo) {
      const int dst = __shfl_sync(0xffffffffu, d, __ffs(todo) - 1);
      todo &= ~__ballot_sync(0xffffffffu, near && d == dst);
      mk_copy(w.at(dst, X.b_off + ((mk_u64)me * s.T + t) * RB), x + (mk_u64)t * RB, RB, lane, 32);
    }
    unsigned far = __ballot_sync(0xffffffffu, slot >= 0 && !near);
    while (far) {
      const int j = __ffs(far) - 1;
      far &= far - 1;
      const int dj = __shfl_sync(0xffffffffu, d, j), sj = __shfl_sync(0xffffffffu, slot, j);
      mk_copy(w.base + X.d_off + ((mk_u64)dj * RC + sj) * RB, x + (mk_u64)t * RB, RB, lane, 32);
    }
  }
  if (!x_grid_sync(c, w, ep)) return;
  if (!x_publish(c, w, p, ep, [&](int r) {
        for (int e = r * El; e < (r + 1) * El; ++e) {
          const mk_u64 first = (mk_u64)send_ranges[2 * e], n = (mk_u64)send_ranges[2 * e + 1];
          if (n == 0) continue;
          if (mk_proxy_push(c, p, MK_PROXY_OP_WRITE, r, 0, X.d_off + ((mk_u64)r * RC + first) * RB,
                            X.c_off + first * RB, n * RB, 0, MK_PROXY_NO_FLAG, 0) == MK_PROXY_NO_FLAG ||
              mk_proxy_push(c, p, MK_PROXY_OP_WRITE, r, 0, X.e_off + ((mk_u64)r * RC + first) * 4,
                            X.a_off + first * 4, n * 4, 0, MK_PROXY_NO_FLAG, 0) == MK_PROXY_NO_FLAG)
            return false;
        }
        return true;
      }))
    return;
  if (!x_wait_ready(c, w, ep)) return;
  const int R = min(__ldcg(expert_offsets + El), s.r_cap);
  const int* in_src = (const int*)(w.base + X.a_off);
  for (int r = gw; r < R; r += warps) {
    const int v = __ldcg(in_src + r);
    if (lane == 0) recv_map[r] = v;
    if (v < 0 || (mk_u64)v >= (mk_u64)P * Tk) continue;  // (never, with a consistent routing: no wild read)
    const int src = (int)(v / Tk), t = (int)((v % Tk) / k);
    const char* from = src == me       ? x + (mk_u64)t * RB
                       : w.local(src) ? w.base + X.b_off + ((mk_u64)src * s.T + t) * RB
                                      : w.base + X.c_off + (mk_u64)r * RB;
    mk_copy(x_recv + (mk_u64)r * RB, from, RB, lane, 32);
  }
  x_finish(c, w, p, ep);
}

#ifndef MK_DTYPE
#define MK_DTYPE MK_DTYPE_BF16
#endif
#ifndef MK_OUT_DTYPE
#define MK_OUT_DTYPE MK_DTYPE
#endif
typedef mk_type<MK_DTYPE>::T T;
typedef mk_type<MK_OUT_DTYPE>::T TO;

// ---------------------------------------------------------------------------------------------
// Combine across nodes (cooperative, fixed grid, blocks of 256 threads).  Regions: b = rows [T * k]
// (y(t, j) from this node's ranks, at t * k + j), c = rows [P][r_cap] (rank d's rows for us, at d's
// slot), d = rows [r_cap] (our rows for remote owners, at the row: the proxy's source).
//   1. a warp per received row r: owner on this node -> its b[t * k + j] (NVLink); remote -> our d[r];
//   2. grid barrier; block 0: ready[me] at this node's ranks; per remote owner s and local expert l, WRITE
//      rows [src_offsets[l][s], src_offsets[l][s + 1]) of d to s's c[me][same rows], then FLAG ready[me];
//   3. wait for every rank; out[t] = sum_j w[t][j] * y(t, j) in fp32, j order (as moe.cu: bit-identical).
extern "C" __global__ void __launch_bounds__(256, 1)
mk_moe_x_combine(MkComm c, MkProxy p, const T* __restrict__ y, const int* __restrict__ ids,
                 const float* __restrict__ weights, const int* __restrict__ slots,
                 const int* __restrict__ expert_offsets, const int* __restrict__ src_offsets,
                 const int* __restrict__ recv_map, TO* __restrict__ out, char* ws, const mk_u64* __restrict__ peers,
                 MoeXLayout X, MoeShape s) {
  const XWs w = make_xws(c, ws, peers, X);
  const mk_u64 ep = mk_epoch_begin(w.st());
  const MoeWarps pool;
  const int lane = pool.lane, warps = pool.warps, gw = pool.gw, k = s.k, me = w.me, P = w.P, El = s.El;
  const mk_u64 RB = X.row_bytes, Tk = (mk_u64)s.T * k, RC = (mk_u64)s.r_cap;
  if (!x_open(c, w, p, ep)) return;
  if (!x_wait_consumed(c, w, ep)) return;
  const int R = min(__ldcg(expert_offsets + El), s.r_cap);
  for (int r = gw; r < R; r += warps) {
    const int v = __ldcg(recv_map + r);
    if (v < 0 || (mk_u64)v >= (mk_u64)P * Tk) continue;  // (never, with a consistent routing: no wild store)
    const int src = (int)(v / Tk);
    if (src == me) continue;
    char* to = w.local(src) ? w.at(src, X.b_off + (mk_u64)(v % Tk) * RB) : w.base + X.d_off + (mk_u64)r * RB;
    mk_copy(to, (const char*)y + (mk_u64)r * RB, RB, lane, 32);
  }
  if (!x_grid_sync(c, w, ep)) return;
  if (!x_publish(c, w, p, ep, [&](int r) {
        for (int l = 0; l < El; ++l) {
          const mk_u64 a = (mk_u64)src_offsets[l * (P + 1) + r], b = (mk_u64)src_offsets[l * (P + 1) + r + 1];
          if (b <= a) continue;
          if (mk_proxy_push(c, p, MK_PROXY_OP_WRITE, r, 0, X.d_off + a * RB, X.c_off + ((mk_u64)me * RC + a) * RB,
                            (b - a) * RB, 0, MK_PROXY_NO_FLAG, 0) == MK_PROXY_NO_FLAG)
            return false;
        }
        return true;
      }))
    return;
  if (!x_wait_ready(c, w, ep)) return;
  // a 16-byte vector per lane, the same trip count on every lane (full-mask shuffles: docs/moe.md)
  for (int t = gw; t < s.T; t += warps)  // (warp-uniform)
    moe_combine_token<T, TO>(t, k, s.H, El, lane, slots, ids, weights, out, [&](int j, int dj, int sj) {
      return dj == me       ? y + (mk_u64)sj * s.H
             : w.local(dj) ? (const T*)(w.base + X.b_off + ((mk_u64)t * k + j) * RB)
                           : (const T*)(w.base + X.c_off + ((mk_u64)dj * RC + sj) * RB);
    });
  x_finish(c, w, p, ep);
}

#include "ops/moe_node.cuh"
