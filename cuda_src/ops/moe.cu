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
//                          rank's counts -> this rank's receive layout (expert_offsets) and, per
//                          global expert, where this rank's rows start in the owner's receive buffer.
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
// Buffer reuse: a sender writes into rank d's staging for call e only after d raised consumed >= e-1
// at the end of its previous kernel (docs/design.md, "Epochs, flags and timeouts").
#include "core/mk_copy.cuh"
#include "core/mk_signal.cuh"

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

// Byte offsets of a MoE op's symmetric workspace (moe/layout.py MoeLayout).
struct MoeLayout {
  mk_u64 consumed_off, flags_off;  // call header, ready[src][block] flags (MAX_CHUNKS per row)
  mk_u64 counts_off;   // route: int32 counts[2][P][E]; dispatch: int32 recv_src[R_cap]
  mk_u64 scratch_off;  // route: int32 tile_cnt[ntiles][E], base[E] (this rank only)
  mk_u64 stage_off;    // dispatch: P x T rows; combine: T * k rows (row_bytes each)
  mk_u64 row_bytes;    // H * itemsize (a multiple of 16)
  int flag_stride;
  int pad;
};

struct MoeShape {
  int T, H, k, E, El;  // tokens per rank, hidden, top-k, experts (global), experts per rank
  int capacity;        // rows kept per expert per receiving rank (<= 0: no limit)
  int r_cap;           // rows of the receive buffer (x_recv)
  int softmax_all;     // route from logits: 1 = softmax over all E then top-k renormalised, 0 = softmax over the top-k
};

// The host's ctypes layouts (moe/layout.py MoeLayout / MoeShape, dist/signals.py MkComm), checked by
// tests/cpu/test_moe_host.py: MK_EXPECT_MOE_STRUCTS = {sizeof, offsetof each field...} of the three, in the
// order below.  (A kernel parameter struct that differs from the host's reads garbage sizes.)
#ifdef MK_EXPECT_MOE_STRUCTS
#define MOE_OFF(S, f) ((unsigned long long)__builtin_offsetof(S, f))
constexpr unsigned long long moe_expected_structs[] = MK_EXPECT_MOE_STRUCTS;
constexpr unsigned long long moe_device_structs[] = {
    sizeof(MoeLayout), alignof(MoeLayout), MOE_OFF(MoeLayout, consumed_off), MOE_OFF(MoeLayout, flags_off),
    MOE_OFF(MoeLayout, counts_off), MOE_OFF(MoeLayout, scratch_off), MOE_OFF(MoeLayout, stage_off),
    MOE_OFF(MoeLayout, row_bytes), MOE_OFF(MoeLayout, flag_stride), MOE_OFF(MoeLayout, pad),
    sizeof(MoeShape), alignof(MoeShape), MOE_OFF(MoeShape, T), MOE_OFF(MoeShape, H), MOE_OFF(MoeShape, k),
    MOE_OFF(MoeShape, E), MOE_OFF(MoeShape, El), MOE_OFF(MoeShape, capacity), MOE_OFF(MoeShape, r_cap),
    MOE_OFF(MoeShape, softmax_all),
    sizeof(MkComm), alignof(MkComm), MOE_OFF(MkComm, err), MOE_OFF(MkComm, timeout_ns), MOE_OFF(MkComm, rank),
    MOE_OFF(MkComm, world_size), MOE_OFF(MkComm, local_rank), MOE_OFF(MkComm, local_size), MOE_OFF(MkComm, node),
    MOE_OFF(MkComm, num_nodes), MOE_OFF(MkComm, op), MOE_OFF(MkComm, sig)};
constexpr bool moe_structs_match() {
  if (sizeof(moe_expected_structs) != sizeof(moe_device_structs)) return false;
  for (unsigned i = 0; i < sizeof(moe_device_structs) / sizeof(moe_device_structs[0]); ++i)
    if (moe_expected_structs[i] != moe_device_structs[i]) return false;
  return true;
}
static_assert(moe_structs_match(), "moe.cu: MoeLayout / MoeShape / MkComm differ from the host's ctypes structs");
#undef MOE_OFF
#endif

struct MoeWs {
  char* base;
  const mk_u64* __restrict__ peers;
  MoeLayout L;
  int P, me;
  MK_DEVICE char* peer(int j) const { return (char*)peers[j]; }
  MK_DEVICE MkEpochState* epoch_state() const { return (MkEpochState*)base; }
  MK_DEVICE MkCallHeader header() const { return {(mk_u64*)(base + L.consumed_off), P}; }
  MK_DEVICE MkCallHeader peer_header(int j) const { return {(mk_u64*)(peer(j) + L.consumed_off), P}; }
  MK_DEVICE int flag_idx(int src, int b) const { return src * L.flag_stride + b; }
  MK_DEVICE mk_u64* ready(int src, int b) const { return (mk_u64*)(base + L.flags_off) + flag_idx(src, b); }
  MK_DEVICE mk_u64* peer_ready(int owner, int src, int b) const {
    return (mk_u64*)(peer(owner) + L.flags_off) + flag_idx(src, b);
  }
};

MK_DEVICE MoeWs moe_ws(const MkComm& c, char* ws, const mk_u64* peers, const MoeLayout& L) {
  return MoeWs{ws, peers, L, c.local_size, c.local_rank};
}

// A grid's warps as one pool: this thread's lane, the pool size, this warp's index in it.
struct MoeWarps {
  int lane, warps, gw;
  MK_DEVICE MoeWarps()
      : lane(threadIdx.x & 31), warps((int)(gridDim.x * (blockDim.x >> 5))),
        gw((int)(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5))) {}
};

// Call number; block 0's first warp announces the call's signature to every peer.
MK_DEVICE mk_u64 moe_begin(const MkComm& c, const MoeWs& w) {
  const mk_u64 e = mk_epoch_begin(w.epoch_state());
  if (blockIdx.x == 0 && threadIdx.x < 32)
    mk_announce_call(c, [&](int j) { return w.peer_header(j); }, e, threadIdx.x, 32);
  return e;
}

// The last block to finish tells every peer that this rank consumed what it sent, then bumps the epoch.
MK_DEVICE void moe_finish(const MoeWs& w, mk_u64 e) {
  if (mk_epoch_arrive(w.epoch_state(), gridDim.x)) {
    for (int j = threadIdx.x; j < w.P; j += blockDim.x)
      if (j != w.me) mk_signal_set(w.peer_header(j).consumed(w.me), e);
    __syncthreads();
    mk_epoch_commit(w.epoch_state(), e);
  }
}

// Whole block: every peer consumed our data of the previous call (we may overwrite its staging).
MK_DEVICE bool moe_wait_consumed(const MkComm& c, const MoeWs& w, mk_u64 e) {
  int ok = 1;
  for (int j = threadIdx.x; j < w.P; j += blockDim.x)
    if (j != w.me) ok &= mk_wait_geq(c, w.header().consumed(j), e - 1, MK_LOCAL_PEER(j), -1 - j);
  return __syncthreads_and(ok) != 0;
}

// Whole block: raise ready[me][blockIdx] = e at every rank in [0, P) (self too when `self`).
MK_DEVICE void moe_raise_ready(const MoeWs& w, mk_u64 e, bool self) {
  __syncthreads();
  for (int j = threadIdx.x; j < w.P; j += blockDim.x)
    if (self || j != w.me) mk_signal_set(w.peer_ready(j, w.me, blockIdx.x), e);
}

// Whole block: every rank's (every block's) ready flag of call e is up and every peer makes our call.
MK_DEVICE bool moe_wait_ready(const MkComm& c, const MoeWs& w, mk_u64 e, bool self) {
  int ok = 1;
  const int n = w.P * (int)gridDim.x;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int src = i / gridDim.x, b = i % gridDim.x;
    if (src == w.me && !self) continue;
    if (b == 0 && src != w.me) ok &= mk_same_call(c, w.header(), e, src);
    if (ok) ok &= mk_wait_geq(c, w.ready(src, b), e, MK_LOCAL_PEER(src), w.flag_idx(src, b));
  }
  return __syncthreads_and(ok) != 0;
}

MK_DEVICE int warp_sum(int v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
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
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, E = s.E, k = s.k;
  for (int e = lane; e < E; e += 32) cnt[warp][e] = 0;
  __syncwarp();
  const int t0 = blockIdx.x * MOE_TILE + warp * 32;
  for (int i = 0; i < 32; ++i) {
    const int t = t0 + i;
    if (t >= s.T) break;
    if (logits != nullptr) {
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
    __syncwarp();
    // position among the tile's pairs of the same expert (this warp's part; warps combined below)
    int e = -1;
    if (lane < k) {
      e = ids[(mk_u64)t * k + lane];
      if (e < 0 || e >= E) e = -1;
    }
    const unsigned same = __match_any_sync(0xffffffffu, e);
    int pos = 0;
    if (e >= 0) {
      const int before = __popc(same & ((1u << lane) - 1u));
      pos = cnt[warp][e] + before;
    }
    __syncwarp();
    if (e >= 0 && (same & ((1u << lane) - 1u)) == 0) cnt[warp][e] += __popc(same);
    __syncwarp();
    if (lane < k) slots[(mk_u64)t * k + lane] = e >= 0 ? pos : -1;
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
    tile_cnt[(mk_u64)blockIdx.x * E + e] = run;
  }
  __syncthreads();
  for (int i = 0; i < 32; ++i) {
    const int t = t0 + i;
    if (t >= s.T) break;
    if (lane < k) {
      const mk_u64 o = (mk_u64)t * k + lane;
      const int p = slots[o];
      const int e = ids[o];
      if (p >= 0) slots[o] = p + cnt[warp][e];
    }
  }
}

// Block-wide inclusive scan of one int per thread (blockDim <= 1024).
MK_DEVICE int block_scan(int v, int* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int o = 1; o < (int)blockDim.x; o <<= 1) {
    const int a = threadIdx.x >= (unsigned)o ? sh[threadIdx.x - o] : 0;
    __syncthreads();
    sh[threadIdx.x] += a;
    __syncthreads();
  }
  const int r = sh[threadIdx.x];
  __syncthreads();
  return r;
}

// ---------------------------------------------------------------------------------------------
// Routing, launch 2: one block of MOE_MAX_E threads (thread e = global expert e).  tile_cnt becomes its
// exclusive prefix over tiles; this rank's counts go to every peer; then from every rank's counts:
// expert_offsets[0..El] (this rank's receive layout, clamped to r_cap), base[e] = first row of this
// rank's pairs of expert e in its owner's receive buffer (rank-in-expert offset included: the sum of
// lower source ranks' counts), kept[e] = how many of them fit the expert's capacity.
extern "C" __global__ void __launch_bounds__(MOE_MAX_E, 1)
mk_moe_route_exchange(MkComm c, int* __restrict__ tile_cnt, int ntiles, int* __restrict__ expert_offsets,
                      int* __restrict__ base, char* ws, const mk_u64* __restrict__ peers, MoeLayout L, MoeShape s) {
  __shared__ int sh[MOE_MAX_E];
  const MoeWs w = moe_ws(c, ws, peers, L);
  const mk_u64 ep = moe_begin(c, w);
  const int e = threadIdx.x, E = s.E, P = w.P, me = w.me;
  const bool on = e < E;
  int mine = 0;
  if (on)
    for (int q = 0; q < ntiles; ++q) {
      const int n = tile_cnt[(mk_u64)q * E + e];
      tile_cnt[(mk_u64)q * E + e] = mine;
      mine += n;
    }
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
  const int cap = s.capacity > 0 ? s.capacity : 0x7fffffff;
  int total = 0, before_me = 0;
  if (on)
    for (int j = 0; j < P; ++j) {
      const int n = __ldcg(cnts + (mk_u64)j * E + e);
      if (j < me) before_me += n;
      total += n;
    }
  const int kept = on ? min(total, cap) : 0;
  const int incl = block_scan(kept, sh);  // over all experts; the owner's share starts at its first expert
  const int owner_first = on ? (e / s.El) * s.El : 0;
  sh[threadIdx.x] = incl - kept;  // exclusive
  __syncthreads();
  const int start = on ? sh[threadIdx.x] - sh[owner_first] : 0;
  if (on) {
    base[e] = start + before_me;
    base[E + e] = cap - before_me;  // how many of this rank's pairs of e fit the expert's capacity
    if (e / s.El == me) {
      expert_offsets[e - me * s.El] = min(start, s.r_cap);
      if (e == (me + 1) * s.El - 1) expert_offsets[s.El] = min(start + kept, s.r_cap);
    }
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

// V consecutive fp32 values -> V elements of TO_ at `o` (one or two 16-byte stores when V * sizeof(TO_) is
// 16 or 32 bytes; o aligned to that).
template <typename TO_, int V>
MK_DEVICE void moe_store(TO_* o, const float* acc) {
  if constexpr (V * sizeof(TO_) == 16) {
    ((int4*)o)[0] = mk_pack<TO_>(acc);
  } else if constexpr (V * sizeof(TO_) == 32) {
    ((int4*)o)[0] = mk_pack<TO_>(acc);
    ((int4*)o)[1] = mk_pack<TO_>(acc + mk_vec<TO_>::N);
  } else {
#pragma unroll
    for (int q = 0; q < V; ++q) o[q] = mk_from_f32<TO_>(acc[q]);
  }
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
  // A 16-byte vector of y per lane: V elements (8 for bf16 / fp16, 4 for fp32; H * sizeof(T) is a multiple
  // of 16, so nv * V == H exactly).  The vector loop runs the same trip count on every lane (lanes past nv
  // only take part in the shuffles): a __shfl_sync(0xffffffff) under `for (i = lane; i < nv; i += 32)` with
  // nv % 32 != 0 (H = 136 bf16: 17 vectors) is a divergent full-mask shuffle -- undefined behaviour, and the
  // warp deadlocks (lanes 0..16 in the shuffle, lanes 17..31 at the next __syncthreads) with no bounded
  // wait involved: the kernel never ends.
  constexpr int V = mk_vec<T>::N;
  const int H = s.H, nv = H / V;
  for (int t = gw; t < s.T; t += warps) {  // (warp-uniform)
    int slot = -1, d = -1;
    float wt = 0.f;
    if (lane < k) {
      const mk_u64 o = (mk_u64)t * k + lane;
      slot = slots[o];
      if (slot >= 0) {
        d = ids[o] / s.El;
        wt = weights[o];
      }
    }
    for (int i0 = 0; i0 < nv; i0 += 32) {  // (warp-uniform trip count)
      const int i = i0 + lane;
      const bool act = i < nv;
      float acc[V];
#pragma unroll
      for (int q = 0; q < V; ++q) acc[q] = 0.f;
      for (int j = 0; j < k; ++j) {  // (warp-uniform: every lane shuffles)
        const int sj = __shfl_sync(0xffffffffu, slot, j);
        const int dj = __shfl_sync(0xffffffffu, d, j);
        const float wj = __shfl_sync(0xffffffffu, wt, j);
        if (sj < 0 || !act) continue;
        const T* row = dj == me ? y + (mk_u64)sj * H
                                : (const T*)(w.base + L.stage_off + ((mk_u64)t * k + j) * RB);
        float f[V];
        mk_unpack<T>(__ldcg((const int4*)(row + (mk_u64)i * V)), f);
#pragma unroll
        for (int q = 0; q < V; ++q) acc[q] = fmaf(wj, f[q], acc[q]);
      }
      if (act) moe_store<TO, V>(out + (mk_u64)t * H + (mk_u64)i * V, acc);
    }
  }
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
