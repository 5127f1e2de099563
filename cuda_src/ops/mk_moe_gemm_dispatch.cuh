// mk_moe_gemm_dispatch.cuh - the dispatch side of the MoE kernels built on the GEMM component (moe_gemm.cu:
// dispatch + gate/up GEMM; moe_layer.cu: the whole layer): the kernel arguments, the communication blocks'
// dispatch with per-(expert, row block) arrival counts, and the producer hook that waits for a tile's rows
// (docs/moe.md, "Dispatch + grouped GEMM, fused").
#pragma once
#include "ops/mk_moe_gemm.cuh"

// Passed by value; mirrored by mkernel/ops/moe/layout.py MoeGemmArgs (same order, natural alignment).
struct MoeGemmArgs {
  const char* x;           // [T, H] this rank's tokens (row_bytes each)
  const int* ids;          // routing: [T, k] global expert ids
  const int* slots;        // routing: [T, k] row in the destination's x_recv (-1: dropped)
  const int* offs;         // routing: [El + 1] this rank's expert offsets
  char* x_recv;            // [r_cap, H] rows grouped by local expert
  int* recv_map;           // [r_cap]
  void* c;                 // h [r_cap, N] (MK_MOE_SWIGLU: act [r_cap, N / 2]), row stride ldc elements
  char* ws;                // this rank's workspace (dispatch layout: recv_src, staging [P][T])
  const mk_u64* peers;     // local rank -> its workspace base, as mapped here
  mk_u64* arrived;         // [El + r_cap / BM + 1] rows landed per (expert, row block); zero at launch
  long long ldc;
  int N, K;                // 2F (the scheduler's columns, also with MK_MOE_SWIGLU), H
  int n_comm;              // communication blocks
  int group_m;             // rasterization super-row height
  int c_vec_ok;
  int pad;
};
static_assert(sizeof(MoeGemmArgs) == 112, "MoeGemmArgs layout changed: update mkernel/ops/moe/layout.py");

// The arrival counter of row block b of local expert l, whose rows start at o (see the file comment).
template <int BM> MK_DEVICE int moe_block_idx(int l, int o, int b) { return l + o / BM + b; }

// Local expert of received row r (o[l] <= r < o[l+1]); offsets non-decreasing, r < o[El].
MK_DEVICE int moe_expert_of_row(const int* offs, int El, int r) {
  int lo = 0, hi = El - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldcg(offs + mid) <= r) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// One warp: row r of x_recv was written by this warp's lanes; publish it to the GEMM (release add).
template <int BM>
MK_DEVICE void moe_row_landed(const MoeGemmArgs& a, int El, int r, int lane) {
  __syncwarp();
  if (lane == 0) {
    const int l = moe_expert_of_row(a.offs, El, r);
    const int o = __ldcg(a.offs + l);
    mk_atom_add_release(a.arrived + moe_block_idx<BM>(l, o, (r - o) / BM), 1);
  }
}

// Communication blocks (all threads).  false: a wait failed (recorded); the caller returns.
template <int BM>
MK_DEVICE bool moe_gemm_comm(const MkComm& c, const MoeWs& w, mk_u64 ep, const MoeGemmArgs& a, const MoeShape& s) {
  const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  const int warps = a.n_comm * nw, gw = blockIdx.x * nw + (threadIdx.x >> 5);
  const int k = s.k, me = w.me, El = s.El;
  const mk_u64 RB = w.L.row_bytes, Tk = (mk_u64)s.T * k;
  int* recv_src_me = (int*)(w.base + w.L.counts_off);
  if (!moe_wait_consumed(c, w, ep)) return false;
  // (1) sends and this rank's own rows
  for (int t = gw; t < s.T; t += warps) {
    int d = -1, slot = -1;
    if (lane < k) {
      slot = a.slots[(mk_u64)t * k + lane];
      if (slot >= 0) d = a.ids[(mk_u64)t * k + lane] / El;
    }
    const int code = (int)((mk_u64)me * Tk + (mk_u64)t * k + lane);
    if (slot >= 0) {
      int* rs = d == me ? recv_src_me : (int*)(w.peer(d) + w.L.counts_off);
      rs[slot] = code;
    }
    const char* row = a.x + (mk_u64)t * RB;
    unsigned mine = __ballot_sync(0xffffffffu, slot >= 0 && d == me);
    while (mine) {  // (warp-uniform)
      const int j = __ffs(mine) - 1;
      mine &= mine - 1;
      const int r = __shfl_sync(0xffffffffu, slot, j);
      mk_copy(a.x_recv + (mk_u64)r * RB, row, RB, lane, 32);
      if (lane == 0) a.recv_map[r] = (int)((mk_u64)me * Tk + (mk_u64)t * k + j);
      moe_row_landed<BM>(a, El, r, lane);
    }
    unsigned todo = __ballot_sync(0xffffffffu, slot >= 0 && d != me);
    while (todo) {
      const int dst = __shfl_sync(0xffffffffu, d, __ffs(todo) - 1);
      todo &= ~__ballot_sync(0xffffffffu, slot >= 0 && d == dst);
      mk_copy(w.peer(dst) + w.L.stage_off + ((mk_u64)me * s.T + t) * RB, row, RB, lane, 32);
    }
  }
  // (2) every rank's communication blocks are done sending (ours too: recv_src of our own rows)
  moe_raise_ready(w, ep, true);
  if (!moe_wait_ready(c, w, ep, true, a.n_comm)) return false;
  // (3) the peers' rows
  const int R = min(__ldcg(a.offs + El), s.r_cap);
  for (int r = gw; r < R; r += warps) {
    const int v = __ldcg(recv_src_me + r);
    if (v < 0 || (mk_u64)v >= (mk_u64)w.P * Tk) continue;  // (never, with a consistent routing: no wild read)
    const int src = (int)(v / Tk), t = (int)((v % Tk) / k);
    if (src == me) continue;  // (landed in (1))
    if (lane == 0) a.recv_map[r] = v;
    mk_copy(a.x_recv + (mk_u64)r * RB, w.base + w.L.stage_off + ((mk_u64)src * s.T + t) * RB, RB, lane, 32);
    moe_row_landed<BM>(a, El, r, lane);
  }
  return true;
}

// Producer hook: a tile's first K block waits for every row of its row block to have landed.
template <int BM> struct MoeWaitRows {
  const MkComm* c;
  const MoeGemmArgs* a;
  int El, M;
  MK_DEVICE const MkTensorMap* a_map(const MkTile& t, const MkTensorMap* tmA, int& a_row) const {
    a_row = t.row0;
    return tmA;
  }
  MK_DEVICE bool before_load(int g, int tm, int, int, bool unit_start) const {
    if (!unit_start) return true;
    // the tile's rows, clamped as MkGroupedScheduler clamps its groups
    const int o0 = min(max(__ldcg(a->offs + g), 0), M);
    const int o1 = min(max(__ldcg(a->offs + g + 1), o0), M);
    const int rows = min(BM, o1 - o0 - tm * BM);
    const int idx = moe_block_idx<BM>(g, o0, tm);
    if (!mk_warp_wait_geq(*c, a->arrived + idx, (mk_u64)rows, MK_LOCAL_PEER(c->local_rank), idx)) return false;
    asm volatile("fence.proxy.async.global;" ::: "memory");  // generic writes of x_recv before TMA reads
    return true;
  }
};

// The gate/up GEMM's hook over x_recv (rows of s.r_cap) and its register store into a.c (h or act).
template <int BM> MK_DEVICE MoeWaitRows<BM> moe_wait_rows(const MkComm& c, const MoeGemmArgs& a, const MoeShape& s) {
  MoeWaitRows<BM> h;
  h.c = &c;
  h.a = &a;
  h.El = s.El;
  h.M = s.r_cap;
  return h;
}
MK_DEVICE MkEpilogueStore<MkOut> moe_gate_up_store(const MoeGemmArgs& a) {
  MkEpilogueStore<MkOut> st;
  st.c = reinterpret_cast<MkOut*>(a.c);
  st.ldc = a.ldc;
  st.vec_ok = a.c_vec_ok;
  return st;
}
