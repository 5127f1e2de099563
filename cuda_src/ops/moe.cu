// moe.cu - MoE expert parallelism on one node: routing, dispatch, combine, SwiGLU (docs/moe.md).
//
// Ranks: P local ranks (NVLink or one shared GPU), E experts in total, El = E / P per rank; global
// expert e lives on rank e / El as its local expert e % El.  Every rank has T tokens of H elements.
//
// Routing (three launches, one stream, no host sync):
//   mk_moe_route_tiles     one block per tile of 256 tokens: top-k (from logits) or the given ids, then
//                          each (token, j)'s position among the tile's pairs of its expert, in token
//                          order (a warp walks its 32 tokens in order; __match_any_sync orders equal
//                          experts inside a token by j), and the tile's count per expert.
//   mk_moe_route_exchange  one block: counts per expert over the tiles (exclusive prefix per tile),
//                          pushed to every peer (parity slot e & 1, flag = call number), then every
//                          rank's counts -> this rank's receive layout (expert_offsets, and per local
//                          expert where each source's rows start: src_offsets) and, per global expert,
//                          where this rank's rows start in the owner's receive buffer.
//   mk_moe_route_slots     slot[t][j] = row of (t, j) in the destination rank's receive buffer, -1 if
//                          dropped (expert capacity or the receive buffer's capacity).
// Receive order on rank d, local expert l: rows grouped by expert, then by source rank, then by token
// index, then j -- deterministic, so every run lays rows out alike.
//
// Dispatch (mk_moe_dispatch, cooperative): each token row goes once to each destination rank that
// holds one of its experts, into that rank's staging slot [source][token]; the sender also writes,
// for every kept (t, j), recv_src[slot] = src * T * k + t * k + j into the destination's workspace.
// Then every block raises ready[src][block] at every rank, waits for all of them, and the receiver
// expands: x_recv[r] = staging[src][t] (its own rows straight from x), recv_map[r] = recv_src[r].
// Combine (mk_moe_combine, cooperative): every received row r goes back to its owner's staging slot
// [t * k + j] (own rows stay), then the owner sums out[t] = sum_j w[t][j] * y(t, j) in fp32, j order.
// Low-latency dispatch (mk_moe_dispatch_ll, cooperative; T <= 256, dropless): routing and dispatch in
// one kernel, the same slot order, no count exchange: every rank's ids travel with the rows.
// Buffer reuse: a sender writes into rank d's staging for call e only after d raised consumed >= e-1
// at the end of its previous kernel (docs/design.md, "Epochs, flags and timeouts").
#include "ops/mk_moe.cuh"

#ifndef MK_DTYPE
#define MK_DTYPE MK_DTYPE_BF16
#endif
#ifndef MK_OUT_DTYPE
#define MK_OUT_DTYPE MK_DTYPE
#endif
#ifndef MK_LOGIT_DTYPE
#define MK_LOGIT_DTYPE MK_DTYPE_F32
#endif
typedef mk_type<MK_DTYPE>::T T;
typedef mk_type<MK_OUT_DTYPE>::T TO;
typedef mk_type<MK_LOGIT_DTYPE>::T TL;

#define MOE_TILE 256       // tokens per routing tile (8 warps x 32)
#define MOE_MAX_E 1024     // experts (moe/layout.py MAX_EXPERTS)
#define MOE_MAX_K 32       // top-k (one lane per choice)
#define MOE_PER_LANE (MOE_MAX_E / 32)
#define MOE_NEG_INF (-__int_as_float(0x7f800000))

// The host's ctypes layouts (moe/layout.py MoeLayout / MoeShape, dist/signals.py MkComm), checked by
// tests/cpu/test_moe_host.py: MK_EXPECT_MOE_STRUCTS = {sizeof, offsetof each field...} of the three, in the
// order below.  (A kernel parameter struct that differs from the host's reads garbage sizes.)
#ifdef MK_EXPECT_MOE_STRUCTS
constexpr unsigned long long moe_expected_structs[] = MK_EXPECT_MOE_STRUCTS;
constexpr unsigned long long moe_device_structs[] = {
    MK_MOE_LAYOUT_SHAPE_WORDS, sizeof(MkComm), alignof(MkComm), MK_OFFSET_WORD(MkComm, err),
    MK_OFFSET_WORD(MkComm, timeout_ns), MK_OFFSET_WORD(MkComm, rank), MK_OFFSET_WORD(MkComm, world_size),
    MK_OFFSET_WORD(MkComm, local_rank), MK_OFFSET_WORD(MkComm, local_size), MK_OFFSET_WORD(MkComm, node),
    MK_OFFSET_WORD(MkComm, num_nodes), MK_OFFSET_WORD(MkComm, op), MK_OFFSET_WORD(MkComm, sig)};
static_assert(mk_same_words(moe_expected_structs, moe_device_structs),
              "moe.cu: MoeLayout / MoeShape / MkComm differ from the host's ctypes structs");
#endif

// One warp: top-k of token t's logits [E] -> ids[t][0..k), weights[t][0..k) (fp32): k rounds of warp
// argmax, ties to the lower expert index; softmax over the k chosen (softmax_all: over all E).
MK_DEVICE void moe_topk_token(const TL* __restrict__ logits, int* __restrict__ ids, float* __restrict__ weights,
                               int t, const MoeShape& s) {
  const int lane = threadIdx.x & 31, E = s.E, k = s.k;
  float v[MOE_PER_LANE];
  float mx = MOE_NEG_INF;
#pragma unroll
  for (int q = 0; q < MOE_PER_LANE; ++q) {
    const int e = q * 32 + lane;
    v[q] = e < E ? mk_to_f32(logits[(mk_u64)t * E + e]) : MOE_NEG_INF;
    mx = fmaxf(mx, v[q]);
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float denom = 0.f;  // softmax over all experts (used when softmax_all)
#pragma unroll
  for (int q = 0; q < MOE_PER_LANE; ++q)
    if (q * 32 + lane < E) denom += __expf(v[q] - mx);
#pragma unroll
  for (int o = 16; o; o >>= 1) denom += __shfl_xor_sync(0xffffffffu, denom, o);
  float my_val = 0.f;
  int my_id = 0;
  for (int j = 0; j < k; ++j) {  // k rounds of warp argmax, lowest index on ties
    float bv = MOE_NEG_INF;
    int bi = 0x7fffffff;
#pragma unroll
    for (int q = 0; q < MOE_PER_LANE; ++q) {
      const int e = q * 32 + lane;
      if (e < E && (v[q] > bv || (v[q] == bv && e < bi))) { bv = v[q]; bi = e; }
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
#pragma unroll
    for (int q = 0; q < MOE_PER_LANE; ++q)
      if (q * 32 + lane == bi) v[q] = MOE_NEG_INF;
    if (lane == j) { my_val = bv; my_id = bi; }
  }
  // weights: softmax over the top-k (= softmax over all E, renormalised over the top-k)
  const float p = lane < k ? __expf(my_val - mx) : 0.f;
  float psum = p;
#pragma unroll
  for (int o = 16; o; o >>= 1) psum += __shfl_xor_sync(0xffffffffu, psum, o);
  if (lane < k) {
    ids[(mk_u64)t * k + lane] = my_id;
    weights[(mk_u64)t * k + lane] = s.softmax_all ? p / denom : p / psum;
  }
}


// Whole block (MOE_TILE threads): the position of each pair (t, j) of tokens [t_tile, t_tile + MOE_TILE)
// among the tile's pairs of its expert, in (t, j) order -- a warp walks its 32 tokens in order,
// __match_any_sync orders a repeated expert inside a token by j -- into pos[t][j] (-1: an id outside
// [0, E)), and the tile's count per expert into tile_cnt[e].  ids, pos: [T, k]; cnt: shared scratch.
MK_DEVICE void moe_tile_positions(const int* ids, int* pos, int* __restrict__ tile_cnt, int t_tile, const MoeShape& s,
                                  int (*cnt)[MOE_MAX_E]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, E = s.E, k = s.k;
  for (int e = lane; e < E; e += 32) cnt[warp][e] = 0;
  __syncwarp();
  const int t0 = t_tile + warp * 32;
  for (int i = 0; i < 32; ++i) {
    const int t = t0 + i;
    if (t >= s.T) break;
    // position among the tile's pairs of the same expert (this warp's part; warps combined below)
    int e = -1;
    if (lane < k) {
      e = ids[(mk_u64)t * k + lane];
      if (e < 0 || e >= E) e = -1;
    }
    const unsigned same = __match_any_sync(0xffffffffu, e);
    int p = 0;
    if (e >= 0) p = cnt[warp][e] + __popc(same & ((1u << lane) - 1u));
    __syncwarp();
    if (e >= 0 && (same & ((1u << lane) - 1u)) == 0) cnt[warp][e] += __popc(same);
    __syncwarp();
    if (lane < k) pos[(mk_u64)t * k + lane] = e >= 0 ? p : -1;
  }
  __syncthreads();
  // warps' counts -> exclusive prefix over warps (in place) and the tile's total
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int run = 0;
#pragma unroll
    for (int q = 0; q < MOE_TILE / 32; ++q) {
      const int n = cnt[q][e];
      cnt[q][e] = run;
      run += n;
    }
    tile_cnt[e] = run;
  }
  __syncthreads();
  for (int i = 0; i < 32; ++i) {
    const int t = t0 + i;
    if (t >= s.T) break;
    if (lane < k) {
      const mk_u64 o = (mk_u64)t * k + lane;
      const int p = pos[o];
      if (p >= 0) pos[o] = p + cnt[warp][ids[o]];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Routing, launch 1: grid = ceil(T / 256), block 256.  logits [T, E] (or nullptr: ids / weights given)
// -> ids [T, k], weights [T, k] (fp32); slots[t][j] = position of (t, j) among the tile's pairs of
// its expert (rewritten by mk_moe_route_slots); tile_cnt[tile][e] = the tile's pairs of expert e.
// Top-k ties go to the lower expert index.  An id outside [0, E) is dropped (slot -1 in the end).
extern "C" __global__ void __launch_bounds__(MOE_TILE, 1)
mk_moe_route_tiles(const TL* __restrict__ logits, int* __restrict__ ids, float* __restrict__ weights,
                   int* __restrict__ slots, int* __restrict__ tile_cnt, MoeShape s) {
  __shared__ int cnt[MOE_TILE / 32][MOE_MAX_E];
  const int t_tile = blockIdx.x * MOE_TILE;
  if (logits != nullptr) {  // each warp its 32 tokens of the tile (the ones it reads back below)
    const int t0 = t_tile + (threadIdx.x >> 5) * 32;
    for (int i = 0; i < 32 && t0 + i < s.T; ++i) moe_topk_token(logits, ids, weights, t0 + i, s);
    __syncwarp();
  }
  moe_tile_positions(ids, slots, tile_cnt + (mk_u64)blockIdx.x * s.E, t_tile, s, cnt);
}

// ---------------------------------------------------------------------------------------------
// Routing, launch 2: one block of MOE_MAX_E threads (thread e = global expert e).  tile_cnt becomes its
// exclusive prefix over tiles; this rank's counts go to every peer; then from every rank's counts:
// expert_offsets[0..El] (this rank's receive layout, clamped to r_cap), src_offsets[l][0..P] (where each
// source's rows of local expert l start, the end last; the fused dispatch + GEMM orders its tiles by them),
// base[e] = first row of this rank's pairs of expert e in its owner's receive buffer (rank-in-expert
// offset included: the sum of lower source ranks' counts), kept[e] = how many of them fit the expert's
// capacity.
extern "C" __global__ void __launch_bounds__(MOE_MAX_E, 1)
mk_moe_route_exchange(MkComm c, int* __restrict__ tile_cnt, int ntiles, int* __restrict__ expert_offsets,
                      int* __restrict__ base, int* __restrict__ src_offsets, char* ws, const mk_u64* __restrict__ peers,
                      MoeLayout L, MoeShape s) {
  __shared__ int sh[MOE_MAX_E];
  const MoeWs w = moe_ws(c, ws, peers, L);
  const mk_u64 ep = moe_begin(c, w);
  const int e = threadIdx.x, E = s.E, P = w.P, me = w.me;
  const bool on = e < E;
  const int mine = moe_tile_prefix(tile_cnt, ntiles, E, e, on);
  // this rank's counts into every rank's counts[parity][me][.] (ours too)
  const int par = (int)(ep & 1);
  if (on)
    for (int j = 0; j < P; ++j) ((int*)(w.peer(j) + L.counts_off))[((mk_u64)par * P + me) * E + e] = mine;
  __syncthreads();
  if (threadIdx.x < P) {
    const int j = threadIdx.x;
    if (j == me) mk_signal_set(w.ready(me, 0), ep);
    else mk_signal_set(w.peer_ready(j, me, 0), ep);
  }
  int ok = 1;
  if (threadIdx.x < P) {
    const int j = threadIdx.x;
    if (j != me) ok = mk_same_call(c, w.header(), ep, j);
    if (ok) ok = mk_wait_geq(c, w.ready(j, 0), ep, MK_LOCAL_PEER(j), w.flag_idx(j, 0));
  }
  if (!__syncthreads_and(ok)) return;
  const int* cnts = (const int*)(w.base + L.counts_off) + (mk_u64)par * P * E;
  const MoeExpertPlace pl = moe_expert_place(cnts, s, P, me, e, on, sh);
  if (on) {
    moe_store_place(pl, s, me, e, base, expert_offsets);
    moe_store_src_offsets(pl, cnts, s, P, me, e, src_offsets);
  }
  __syncthreads();
  if (mk_epoch_arrive(w.epoch_state(), gridDim.x)) mk_epoch_commit(w.epoch_state(), ep);
}

// ---------------------------------------------------------------------------------------------
// Routing, launch 3: grid-stride over the T * k pairs.  slots[t][j] (the tile position) becomes the row
// in the destination rank's receive buffer, or -1: dropped by the expert's capacity, by the receive
// buffer's r_cap, or an invalid id.
extern "C" __global__ void __launch_bounds__(256)
mk_moe_route_slots(const int* __restrict__ ids, int* __restrict__ slots, const int* __restrict__ tile_cnt,
                   const int* __restrict__ base, MoeShape s) {
  const mk_u64 n = (mk_u64)s.T * s.k;
  for (mk_u64 i = (mk_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (mk_u64)gridDim.x * blockDim.x) {
    const int p = slots[i];
    if (p < 0) continue;
    const int e = ids[i];
    const int t = (int)(i / s.k);
    const int q = tile_cnt[(mk_u64)(t / MOE_TILE) * s.E + e] + p;  // rank among this rank's pairs of e
    const int row = base[e] + q;
    slots[i] = (q < base[s.E + e] && row < s.r_cap) ? row : -1;
  }
}

// ---------------------------------------------------------------------------------------------
// Dispatch (cooperative; blocks of 256 threads, a warp per token / row).  x [T, H] (row_bytes per row,
// contiguous) -> x_recv [r_cap, H] (rows [0, expert_offsets[El]) written), recv_map [r_cap] (same rows).
extern "C" __global__ void __launch_bounds__(256, 1)
mk_moe_dispatch(MkComm c, const char* __restrict__ x, const int* __restrict__ ids, const int* __restrict__ slots,
                const int* __restrict__ expert_offsets, char* __restrict__ x_recv, int* __restrict__ recv_map,
                char* ws, const mk_u64* __restrict__ peers, MoeLayout L, MoeShape s) {
  const MoeWs w = moe_ws(c, ws, peers, L);
  const mk_u64 ep = moe_begin(c, w);
  const MoeWarps pool;
  const int lane = pool.lane, warps = pool.warps, gw = pool.gw, k = s.k, me = w.me;
  const mk_u64 RB = L.row_bytes, Tk = (mk_u64)s.T * k;
  if (!moe_wait_consumed(c, w, ep)) return;
  // send: token t once to every rank holding one of its kept experts
  for (int t = gw; t < s.T; t += warps) {
    int d = -1, slot = -1;
    if (lane < k) {
      slot = slots[(mk_u64)t * k + lane];
      if (slot >= 0) d = ids[(mk_u64)t * k + lane] / s.El;
    }
    if (slot >= 0) {
      int* rs = d == me ? (int*)(w.base + L.counts_off) : (int*)(w.peer(d) + L.counts_off);
      rs[slot] = (int)((mk_u64)me * Tk + (mk_u64)t * k + lane);
    }
    unsigned todo = __ballot_sync(0xffffffffu, slot >= 0 && d != me);
    while (todo) {
      const int src_lane = __ffs(todo) - 1;
      const int dst = __shfl_sync(0xffffffffu, d, src_lane);
      todo &= ~__ballot_sync(0xffffffffu, slot >= 0 && d == dst);
      char* to = w.peer(dst) + L.stage_off + ((mk_u64)me * s.T + t) * RB;
      mk_copy(to, x + (mk_u64)t * RB, RB, lane, 32);
    }
  }
  moe_raise_ready(w, ep, true);
  if (!moe_wait_ready(c, w, ep, true)) return;
  // expand: received rows, grouped by local expert
  const int R = min(__ldcg(expert_offsets + s.El), s.r_cap);
  const int* recv_src = (const int*)(w.base + L.counts_off);
  for (int r = gw; r < R; r += warps) {
    const int v = __ldcg(recv_src + r);
    if (lane == 0) recv_map[r] = v;
    if (v < 0 || (mk_u64)v >= (mk_u64)w.P * Tk) continue;  // (never, with a consistent routing: no wild read)
    const int src = (int)(v / Tk), t = (int)((v % Tk) / k);
    const char* from = src == me ? x + (mk_u64)t * RB : w.base + L.stage_off + ((mk_u64)src * s.T + t) * RB;
    mk_copy(x_recv + (mk_u64)r * RB, from, RB, lane, 32);
  }
  moe_finish(w, ep);
}

// ---------------------------------------------------------------------------------------------
// Low-latency dispatch (cooperative; blocks of MOE_TILE threads, grid >= P; T <= MOE_TILE; dropless):
// routing and dispatch in one kernel, with the slot order of the throughput path (docs/moe.md,
// "Low-latency mode").  Workspace (moe/layout.py low_latency_layout): ids_all [P][T][k] int32 (row s
// written by rank s), this rank's scratch pos [P][T][k] and cnt [P][E] int32, staging rows [P][T].
//   (1) a warp per token: top-k (logits; else ids / weights were copied in), the token's ids row into
//       every rank's ids_all[me], its row once into the staging [me][t] of every other rank it goes to;
//   (2) ready[me][block] at every rank, wait for every rank's blocks (every rank's ids are here);
//   (3) block s < P: the positions of source s's pairs among its pairs of each expert (one routing
//       tile: moe_tile_positions) and its counts per expert, then the local flag ready[me][grid + s];
//   (4) every block, once the P local flags are up: each expert's start in its owner's buffer (prefix
//       over the owner's experts of the counts of every source), this rank's expert_offsets and slots,
//       and the expansion x_recv[r] = staging[s][t] (own rows from x), recv_map[r], for every pair of
//       every source that chose one of this rank's experts.
extern "C" __global__ void __launch_bounds__(MOE_TILE, 1)
mk_moe_dispatch_ll(MkComm c, const TL* __restrict__ logits, const char* __restrict__ x, int* __restrict__ ids,
                   float* __restrict__ weights, int* __restrict__ slots, int* __restrict__ expert_offsets,
                   char* __restrict__ x_recv, int* __restrict__ recv_map, char* ws, const mk_u64* __restrict__ peers,
                   MoeLayout L, MoeShape s) {
  __shared__ int cnt[MOE_TILE / 32][MOE_MAX_E];  // (3): positions; (4): start[e] in cnt[0]
  const MoeWs w = moe_ws(c, ws, peers, L);
  const mk_u64 ep = moe_begin(c, w);
  const MoeWarps pool;
  const int lane = pool.lane, warps = pool.warps, gw = pool.gw, k = s.k, me = w.me, P = w.P, E = s.E;
  const mk_u64 RB = L.row_bytes, Tk = (mk_u64)s.T * k;
  const int G = (int)gridDim.x;
  int* ids_all = (int*)(w.base + L.counts_off);
  int* pos_all = (int*)(w.base + L.scratch_off);
  int* cnt_all = pos_all + (mk_u64)P * Tk;
  if (!moe_wait_consumed(c, w, ep)) return;
  // (1)
  for (int t = gw; t < s.T; t += warps) {  // (warp-uniform)
    if (logits != nullptr) {
      moe_topk_token(logits, ids, weights, t, s);
      __syncwarp();
    }
    int d = -1;
    if (lane < k) {
      const int e = ids[(mk_u64)t * k + lane];
      if (e >= 0 && e < E) d = e / s.El;
      for (int j = 0; j < P; ++j) ((int*)(w.peer(j) + L.counts_off))[(mk_u64)me * Tk + (mk_u64)t * k + lane] = e;
    }
    unsigned todo = __ballot_sync(0xffffffffu, d >= 0 && d != me);
    while (todo) {
      const int dst = __shfl_sync(0xffffffffu, d, __ffs(todo) - 1);
      todo &= ~__ballot_sync(0xffffffffu, d == dst);
      mk_copy(w.peer(dst) + L.stage_off + ((mk_u64)me * s.T + t) * RB, x + (mk_u64)t * RB, RB, lane, 32);
    }
  }
  // (2)
  moe_raise_ready(w, ep, true);
  if (!moe_wait_ready(c, w, ep, true)) return;
  // (3)
  if ((int)blockIdx.x < P) {
    const int src = blockIdx.x;
    moe_tile_positions(ids_all + (mk_u64)src * Tk, pos_all + (mk_u64)src * Tk, cnt_all + (mk_u64)src * E, 0, s, cnt);
    __syncthreads();
    if (threadIdx.x == 0) mk_signal_set(w.ready(me, G + src), ep);
  }
  // (4)
  int ok = 1;
  if ((int)threadIdx.x < P)
    ok = mk_wait_geq(c, w.ready(me, G + threadIdx.x), ep, MK_LOCAL_PEER(me), w.flag_idx(me, G + threadIdx.x));
  if (!__syncthreads_and(ok)) return;
  int* start = cnt[0];
  if ((int)threadIdx.x < P) {  // thread d: the starts of owner d's experts (a prefix over them)
    int run = 0;
    for (int e = threadIdx.x * s.El; e < (int)(threadIdx.x + 1) * s.El; ++e) {
      start[e] = run;
      for (int j = 0; j < P; ++j) run += __ldcg(cnt_all + (mk_u64)j * E + e);
    }
    if ((int)threadIdx.x == me && blockIdx.x == 0) expert_offsets[s.El] = min(run, s.r_cap);
  }
  __syncthreads();
  if (blockIdx.x == 0)
    for (int l = threadIdx.x; l < s.El; l += blockDim.x) expert_offsets[l] = min(start[me * s.El + l], s.r_cap);
  // the row of source src's pair i (expert e) in e's owner's buffer; -1 past its r_cap rows (only
  // possible with repeated given ids: otherwise r_cap = P * T * min(k, El) holds every pair)
  auto row_of = [&](int src, mk_u64 i, int e) {
    int r = start[e] + __ldcg(pos_all + (mk_u64)src * Tk + i);
    for (int j = 0; j < src; ++j) r += __ldcg(cnt_all + (mk_u64)j * E + e);
    return r < s.r_cap ? r : -1;
  };
  for (mk_u64 i = (mk_u64)blockIdx.x * blockDim.x + threadIdx.x; i < Tk; i += (mk_u64)G * blockDim.x) {
    const int e = __ldcg(ids + i);
    slots[i] = (e >= 0 && e < E) ? row_of(me, i, e) : -1;
  }
  for (int q = gw; q < P * s.T; q += warps) {  // (warp-uniform) a warp per (source, token)
    const int src = q / s.T, t = q % s.T;
    const mk_u64 i = (mk_u64)t * k + lane;
    int r = -1;
    if (lane < k) {
      const int e = __ldcg(ids_all + (mk_u64)src * Tk + i);
      if (e >= 0 && e < E && e / s.El == me) r = row_of(src, i, e);
    }
    const char* from = src == me ? x + (mk_u64)t * RB : w.base + L.stage_off + ((mk_u64)src * s.T + t) * RB;
    unsigned todo = __ballot_sync(0xffffffffu, r >= 0);
    while (todo) {
      const int j = __ffs(todo) - 1;
      todo &= todo - 1;
      const int rj = __shfl_sync(0xffffffffu, r, j);
      if (lane == 0) recv_map[rj] = (int)((mk_u64)src * Tk + (mk_u64)t * k + j);
      mk_copy(x_recv + (mk_u64)rj * RB, from, RB, lane, 32);
    }
  }
  moe_finish(w, ep);
}

// ---------------------------------------------------------------------------------------------
// Combine (cooperative; blocks of 256 threads).  y [r_cap, H] (T, rows in the receive order of the
// dispatch that made recv_map) -> out [T, H] (TO): out[t] = sum over j of weights[t][j] * y(t, j), fp32,
// in j order (dropped pairs add nothing).  y(t, j) is read locally when this rank holds the expert.
extern "C" __global__ void __launch_bounds__(256, 1)
mk_moe_combine(MkComm c, const T* __restrict__ y, const int* __restrict__ ids, const float* __restrict__ weights,
               const int* __restrict__ slots, const int* __restrict__ expert_offsets, const int* __restrict__ recv_map,
               TO* __restrict__ out, char* ws, const mk_u64* __restrict__ peers, MoeLayout L, MoeShape s) {
  const MoeWs w = moe_ws(c, ws, peers, L);
  const mk_u64 ep = moe_begin(c, w);
  const MoeWarps pool;
  const int lane = pool.lane, warps = pool.warps, gw = pool.gw, k = s.k, me = w.me;
  const mk_u64 RB = L.row_bytes, Tk = (mk_u64)s.T * k;
  if (!moe_wait_consumed(c, w, ep)) return;
  const int R = min(__ldcg(expert_offsets + s.El), s.r_cap);
  for (int r = gw; r < R; r += warps) {
    const int v = __ldcg(recv_map + r);
    if (v < 0 || (mk_u64)v >= (mk_u64)w.P * Tk) continue;  // (never, with a consistent routing: no wild store)
    const int src = (int)(v / Tk);
    if (src == me) continue;
    mk_copy(w.peer(src) + L.stage_off + (mk_u64)(v % Tk) * RB, (const char*)y + (mk_u64)r * RB, RB, lane, 32);
  }
  moe_raise_ready(w, ep, false);
  if (!moe_wait_ready(c, w, ep, false)) return;
  for (int t = gw; t < s.T; t += warps)  // (warp-uniform)
    moe_combine_token<T, TO>(t, k, s.H, s.El, lane, slots, ids, weights, out, [&](int j, int dj, int sj) {
      return dj == me ? y + (mk_u64)sj * s.H : (const T*)(w.base + L.stage_off + ((mk_u64)t * k + j) * RB);
    });
  moe_finish(w, ep);
}

// ---------------------------------------------------------------------------------------------
// SwiGLU: act[r][f] = silu(h[r][f]) * h[r][F + f] for r < rows[0] (a device count, clamped to r_cap), fp32
// math.  h [r_cap, 2F] row-major (gate columns, then up), act [r_cap, F]; F a multiple of 8.
extern "C" __global__ void __launch_bounds__(256)
mk_moe_swiglu(const T* __restrict__ h, TO* __restrict__ act, const int* __restrict__ rows, int r_cap, int F) {
  const int R = min(rows[0], r_cap), nv = F / 8;
  const mk_u64 n = (mk_u64)R * nv;
  for (mk_u64 i = (mk_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (mk_u64)gridDim.x * blockDim.x) {
    const mk_u64 r = i / nv, v = i % nv;
    const T* g = h + r * 2 * F + v * 8;
    float a[8], b[8], o[8];
    if constexpr (sizeof(T) == 2) {
      mk_unpack<T>(*(const int4*)g, a);
      mk_unpack<T>(*(const int4*)(g + F), b);
    } else {
      mk_unpack<T>(((const int4*)g)[0], a);
      mk_unpack<T>(((const int4*)g)[1], a + 4);
      mk_unpack<T>(((const int4*)(g + F))[0], b);
      mk_unpack<T>(((const int4*)(g + F))[1], b + 4);
    }
#pragma unroll
    for (int q = 0; q < 8; ++q) o[q] = a[q] / (1.f + __expf(-a[q])) * b[q];
    TO* d = act + r * F + v * 8;
    if constexpr (sizeof(TO) == 2) {
      *(int4*)d = mk_pack<TO>(o);
    } else {
      ((int4*)d)[0] = mk_pack<TO>(o);
      ((int4*)d)[1] = mk_pack<TO>(o + 4);
    }
  }
}
