// moe_gemm.cu - MoE dispatch fused with the gate/up grouped GEMM in one persistent kernel (docs/moe.md,
// "Dispatch + grouped GEMM, fused").  Host side: mkernel/ops/moe/fused.py.
//
// h[r] = x_recv[r] @ w_gate_up[l]^T for the received rows r of local expert l (rows [o[l], o[l+1]) of
// x_recv, o = the routing's expert_offsets), while the rows are still being dispatched.
//
// Kernel mk_moe_dispatch_gemm (cooperative, grid <= the context's resident SMs, one block per SM,
// Cfg::THREADS threads, Cfg::SMEM_BYTES dynamic shared memory):
//   blocks [0, n_comm)    communication (a warp per token, then a warp per received row):
//                         (1) each token row once to every peer holding one of its experts (staging
//                         [me][t] of that peer's workspace, recv_src[slot] written there: the protocol of
//                         mk_moe_dispatch), and this rank's own pairs straight into x_recv[slot] (local
//                         rows first: the GEMM starts on them while the rest is in flight);
//                         (2) ready[me][block] at every rank, wait for every rank's blocks;
//                         (3) the received rows of the peers: x_recv[r] = staging[src][t].
//                         Every row written into x_recv adds 1 to arrived[idx(l, row block)] (release).
//   blocks [n_comm, grid) GEMM workers (mk_gemm.cuh): MkGroupedScheduler over (expert, row block, N
//                         tile) from the device offsets; before a tile's first K block the producer
//                         waits until arrived[idx] == the tile's rows, then fences the generic-proxy
//                         writes before its TMA loads of A (x_recv).
// idx(l, b) = l + o[l] / BM + b: unique per (expert, row block) (a group's blocks end before the next
// group's first index), < El + r_cap / BM + 1 (the host sizes `arrived` so; it zeroes it before each
// launch).  Deadlock freedom: communication blocks wait only on peers' communication blocks (and the
// peers' consumption of the previous call); workers wait only on this rank's communication blocks; every
// block is resident (cooperative launch within the rank's share of the SMs).
//
// Specialization: MK_GEMM_IN (bf16 | f16), MK_GEMM_OUT, MK_GEMM_CONFIG and its MK_CFG_* (mkernel/ops/gemm
// configs.py defines()); B (w_gate_up) is "nk": [El, 2F, H].  MK_MOE_SWIGLU=1: the SwiGLU variant
// (docs/moe.md, "SwiGLU epilogue"): tmB is the paired gate/up view of w_gate_up (MkGateUpB) and c is
// act [r_cap, F] = silu(h[:, :F]) * h[:, F:] from the accumulators, h never written.
#include "gemm/mk_gemm_configs.cuh"
#include "gemm/mk_gemm_swiglu.cuh"
#include "ops/mk_moe_gemm.cuh"

#ifndef MK_MOE_SWIGLU
#define MK_MOE_SWIGLU 0
#endif

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

// The GEMM's epilogue: the plain store of h, or (MK_MOE_SWIGLU) SwiGLU stored as act by the same store, so
// h is never written (docs/moe.md, "SwiGLU epilogue", "In the fused kernel").
template <class Store> MK_DEVICE auto moe_gemm_epilogue(const Store& store) {
#if MK_MOE_SWIGLU
  return mk_swiglu_epilogue(store);
#else
  return store;
#endif
}

// tmA: x_recv [r_cap, H]; tmB: w_gate_up [El, 2F, H] ("nk", or with MK_MOE_SWIGLU its paired gate/up view).
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
    mk_moe_dispatch_gemm(const __grid_constant__ MkTensorMap tmA, const __grid_constant__ MkTensorMap tmB,
                         const __grid_constant__ MkComm c, const __grid_constant__ MoeLayout L,
                         const __grid_constant__ MoeShape s, const __grid_constant__ MoeGemmArgs a) {
  // the producer runs the grouped scheduler and the row waits: 48 registers, not 40
  typedef MkWithRegs<MkCfg<false>, 48, 224> Base;
  // SwiGLU: B through the paired gate/up view, so one thread holds gate f and up F + f (mk_gemm_swiglu.cuh)
  typedef typename MkPick<MK_MOE_SWIGLU != 0, MkGateUpB<Base>, Base>::T Cfg;
  static_assert(Cfg::SHARING == 1 && Cfg::CLUSTER_K == 1 && !Cfg::PINGPONG, "moe_gemm: cooperative, unclustered configs");
  extern __shared__ unsigned char mk_smem[];
  const MoeWs w = moe_ws(c, a.ws, a.peers, L);
  const mk_u64 ep = moe_begin(c, w);  // (block 0 is a communication block: it announces the call)
  if ((int)blockIdx.x < a.n_comm) {
    if (!moe_gemm_comm<Cfg::BM>(c, w, ep, a, s)) return;
    moe_gemm_finish(w, ep, 0, blockDim.x);
    return;
  }
  MkGroupedScheduler<Cfg::BM, Cfg::BN> sched(a.offs, 1, s.El, s.r_cap, a.N, a.group_m);
  MoeWaitRows<Cfg::BM> hook;
  hook.c = &c;
  hook.a = &a;
  hook.El = s.El;
  hook.M = s.r_cap;
  MkEpilogueStore<MkOut> store;
  store.c = reinterpret_cast<MkOut*>(a.c);
  store.ldc = a.ldc;
  store.vec_ok = a.c_vec_ok;
  auto epi = moe_gemm_epilogue(store);
  const bool r = mk_gemm_run<Cfg>(&tmA, &tmB, a.K, sched, hook, epi, mk_smem, (int)blockIdx.x - a.n_comm,
                                  (int)gridDim.x - a.n_comm);
  if (threadIdx.x < 128 || !r) return;  // the producer warpgroup is done; the consumers close the call
  moe_gemm_finish(w, ep, 128, 128 * Cfg::NC);
}
