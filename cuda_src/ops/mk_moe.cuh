// mk_moe.cuh - what the MoE kernels share (moe.cu, moe_gemm.cu): the workspace layout and shape structs
// (mirrored by mkernel/ops/moe/layout.py), the workspace view, and the call's flag protocol (docs/moe.md,
// "Signals, waits, reuse").
#pragma once
#include "core/mk_copy.cuh"
#include "core/mk_signal.cuh"

// Byte offsets of a MoE op's symmetric workspace (moe/layout.py MoeLayout).
struct MoeLayout {
  mk_u64 consumed_off, flags_off;  // call header, ready[src][block] flags (MAX_CHUNKS per row)
  mk_u64 counts_off;   // route: int32 counts[2][P][E]; dispatch: int32 recv_src[R_cap]
  mk_u64 scratch_off;  // route: int32 tile_cnt[ntiles][E], base[E] (this rank only); the one-kernel layer's
                       // combine layout: u64 down_stored[P] (control words written by the peers: moe_layer.cu)
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

// sizeof, alignof and every field's offset of MoeLayout then MoeShape, in declaration order: the kernels'
// checks of the host's ctypes mirrors (moe.cu, moe_layer.cu; the expected lists come as MK_EXPECT_* defines).
#define MK_MOE_LAYOUT_SHAPE_WORDS                                                                                   \
  sizeof(MoeLayout), alignof(MoeLayout), MK_OFFSET_WORD(MoeLayout, consumed_off),                                   \
      MK_OFFSET_WORD(MoeLayout, flags_off), MK_OFFSET_WORD(MoeLayout, counts_off),                                  \
      MK_OFFSET_WORD(MoeLayout, scratch_off), MK_OFFSET_WORD(MoeLayout, stage_off),                                 \
      MK_OFFSET_WORD(MoeLayout, row_bytes), MK_OFFSET_WORD(MoeLayout, flag_stride), MK_OFFSET_WORD(MoeLayout, pad), \
      sizeof(MoeShape), alignof(MoeShape), MK_OFFSET_WORD(MoeShape, T), MK_OFFSET_WORD(MoeShape, H),                \
      MK_OFFSET_WORD(MoeShape, k), MK_OFFSET_WORD(MoeShape, E), MK_OFFSET_WORD(MoeShape, El),                       \
      MK_OFFSET_WORD(MoeShape, capacity), MK_OFFSET_WORD(MoeShape, r_cap), MK_OFFSET_WORD(MoeShape, softmax_all)

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

// Whole block: every rank's ready flags of call e from blocks [0, nblocks) are up (nblocks < 0: the
// grid) and every peer makes our call.
MK_DEVICE bool moe_wait_ready(const MkComm& c, const MoeWs& w, mk_u64 e, bool self, int nblocks = -1) {
  int ok = 1;
  const int nb = nblocks < 0 ? (int)gridDim.x : nblocks;
  const int n = w.P * nb;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int src = i / nb, b = i % nb;
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

// Count exchange, thread e = expert e (`on`: e < E).  tile_cnt[q][e] := this rank's pairs of expert e in
// the tiles before q (what mk_moe_route_slots adds to a pair's rank in its tile); returns the rank's total.
MK_DEVICE int moe_tile_prefix(int* __restrict__ tile_cnt, int ntiles, int E, int e, bool on) {
  int mine = 0;
  if (on)
    for (int q = 0; q < ntiles; ++q) {
      const int n = tile_cnt[(mk_u64)q * E + e];
      tile_cnt[(mk_u64)q * E + e] = mine;
      mine += n;
    }
  return mine;
}

// Where expert e's rows land in its owner's receive buffer, from every rank's counts cnts[P][E] (written by
// the peers: read past L1).  Whole block (block_scan over the experts), thread e = expert e.
struct MoeExpertPlace {
  int start;      // the expert's first row, owner-relative (the owner's experts in order)
  int kept;       // its rows kept: min(sum over ranks, capacity)
  int before_me;  // rows of lower source ranks (this rank's rows follow them)
  int cap;        // the capacity (no limit: INT_MAX)
};
MK_DEVICE MoeExpertPlace moe_expert_place(const int* cnts, const MoeShape& s, int P, int me, int e, bool on,
                                          int* sh) {
  MoeExpertPlace pl;
  pl.cap = s.capacity > 0 ? s.capacity : 0x7fffffff;
  int total = 0;
  pl.before_me = 0;
  if (on)
    for (int j = 0; j < P; ++j) {
      const int n = __ldcg(cnts + (mk_u64)j * s.E + e);
      if (j < me) pl.before_me += n;
      total += n;
    }
  pl.kept = on ? min(total, pl.cap) : 0;
  const int incl = block_scan(pl.kept, sh);  // over all experts; the owner's share starts at its first expert
  const int owner_first = on ? (e / s.El) * s.El : 0;
  sh[threadIdx.x] = incl - pl.kept;  // exclusive
  __syncthreads();
  pl.start = on ? sh[threadIdx.x] - sh[owner_first] : 0;
  return pl;
}

// (thread e, on) base[e] = this rank's first row for expert e, base[E + e] = how many of its pairs fit the
// capacity; the owner's expert_offsets[l] (and [El] after its last expert), clamped to the receive buffer.
MK_DEVICE void moe_store_place(const MoeExpertPlace& pl, const MoeShape& s, int me, int e, int* __restrict__ base,
                               int* __restrict__ expert_offsets) {
  base[e] = pl.start + pl.before_me;
  base[s.E + e] = pl.cap - pl.before_me;
  if (e / s.El == me) {
    const int l = e - me * s.El;
    expert_offsets[l] = min(pl.start, s.r_cap);
    if (l == s.El - 1) expert_offsets[s.El] = min(pl.start + pl.kept, s.r_cap);
  }
}

// (thread e, on) When e is this rank's local expert l = e - me * El: src_offsets[l][j] = the first row of
// source j's rows of l (j = P: the expert's end; sources follow each other in rank order, the slot order),
// clamped as expert_offsets are.  cnts: every rank's counts [P][E].
MK_DEVICE void moe_store_src_offsets(const MoeExpertPlace& pl, const int* cnts, const MoeShape& s, int P, int me,
                                     int e, int* __restrict__ src_offsets) {
  if (e / s.El != me) return;
  const int l = e - me * s.El;
  int cum = 0;
  for (int j = 0; j <= P; ++j) {
    src_offsets[l * (P + 1) + j] = min(pl.start + min(cum, pl.kept), s.r_cap);
    if (j < P) cum += __ldcg(cnts + (mk_u64)j * s.E + e);
  }
}

// V consecutive fp32 values -> V elements of TO_ at `o` (one or two 16-byte stores when V * sizeof(TO_) is
// 16 or 32 bytes; o aligned to that; else scalar stores).
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

// Every pair counts (moe_combine_token's `keep`).
struct MoeKeepAll {
  MK_DEVICE bool operator()(int, int) const { return true; }
};

// This lane's choice of token t (lane < k): its slot (-1: dropped or no such lane), owning rank, weight.
struct MoeChoice {
  int slot, d;
  float w;
};
MK_DEVICE MoeChoice moe_choice(mk_u64 t, int k, int El, int lane, const int* __restrict__ slots,
                               const int* __restrict__ ids, const float* __restrict__ weights) {
  MoeChoice ch{-1, -1, 0.f};
  if (lane < k) {
    const mk_u64 o = t * k + lane;
    ch.slot = slots[o];
    if (ch.slot >= 0) {
      ch.d = ids[o] / El;
      ch.w = weights[o];
    }
  }
  return ch;
}

// acc[V] += w_j * row_of(j, d_j, slot_j)[vector i] over the kept pairs j < k with keep(j, d_j), in j order
// (fp32 fma).  Every lane runs every shuffle (warp-uniform loop); `act`: lane i is inside the row.
template <typename T, int V, typename RowOf, typename Keep>
MK_DEVICE void moe_acc_pairs(float* acc, const MoeChoice& ch, int k, int i, bool act, RowOf row_of, Keep keep) {
  for (int j = 0; j < k; ++j) {  // (warp-uniform: every lane shuffles)
    const int sj = __shfl_sync(0xffffffffu, ch.slot, j);
    const int dj = __shfl_sync(0xffffffffu, ch.d, j);
    const float wj = __shfl_sync(0xffffffffu, ch.w, j);
    if (sj < 0 || !act || !keep(j, dj)) continue;
    const T* row = row_of(j, dj, sj);
    float f[V];
    mk_unpack<T>(__ldcg((const int4*)(row + (mk_u64)i * V)), f);
#pragma unroll
    for (int q = 0; q < V; ++q) acc[q] = fmaf(wj, f[q], acc[q]);
  }
}

// One warp writes token t's output row: vector i of out[t] := the fp32 values `fill(acc, ch, i, act)` leaves in
// acc[V] (zeroed first; ch: this lane's choice of t; act: vector i is inside the row).  A 16-byte vector of
// the row per lane (H * sizeof(T) a multiple of 16).  The vector loop has the same trip count on every lane
// and every lane runs every shuffle: a full-mask __shfl_sync in divergent code is undefined and deadlocks the
// warp at the next barrier, where no bounded wait can end it (docs/moe.md).
template <typename T, typename TO, typename Fill>
MK_DEVICE void moe_token_out(mk_u64 t, int k, int H, int El, int lane, const int* __restrict__ slots,
                             const int* __restrict__ ids, const float* __restrict__ weights, TO* __restrict__ out,
                             Fill fill) {
  constexpr int V = mk_vec<T>::N;
  const int nv = H / V;
  const MoeChoice ch = moe_choice(t, k, El, lane, slots, ids, weights);
  for (int i0 = 0; i0 < nv; i0 += 32) {  // (warp-uniform trip count)
    const int i = i0 + lane;
    const bool act = i < nv;
    float acc[V];
#pragma unroll
    for (int q = 0; q < V; ++q) acc[q] = 0.f;
    fill(acc, ch, i, act);
    if (act) moe_store<TO, V>(out + t * H + (mk_u64)i * V, acc);
  }
}

// One warp combines token t: out[t] = sum over j < k, in j order, of weights[t][j] * row_of(j, d_j, slot_j)
// in fp32 (dropped pairs, slot < 0, add nothing); d_j = ids[t][j] / El owns the pair's expert.
template <typename T, typename TO, typename RowOf>
MK_DEVICE void moe_combine_token(mk_u64 t, int k, int H, int El, int lane, const int* __restrict__ slots,
                                 const int* __restrict__ ids, const float* __restrict__ weights, TO* __restrict__ out,
                                 RowOf row_of) {
  moe_token_out<T, TO>(t, k, H, El, lane, slots, ids, weights, out, [&](float* acc, const MoeChoice& ch, int i, bool act) {
    moe_acc_pairs<T, mk_vec<T>::N>(acc, ch, k, i, act, row_of, MoeKeepAll());
  });
}
