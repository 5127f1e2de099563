// moe_gemm_combine.cu - the MoE down grouped GEMM fused with the combine's communication in one persistent
// kernel (docs/moe.md, "Down GEMM + combine, fused").  Host side: mkernel/ops/moe/fused_combine.py.
//
// y[r] = act[r] @ w_down[l]^T for the received rows r of local expert l (rows [o[l], o[l+1]) of act, o = the
// routing's expert_offsets), each finished tile stored straight into the combine staging of the row's token
// owner, and the owners' weighted sums, in one launch.
//
// Kernel mk_moe_gemm_combine (cooperative, grid <= the context's resident SMs, one block per SM,
// Cfg::THREADS threads, Cfg::SMEM_BYTES dynamic shared memory):
//   blocks [0, n_comm)    the owner's sums, a warp per token t of this rank: wait until the counter of every
//                         kept pair (t, j), cnt[t * k + j], counts the nN = ceil(H / BN) column tiles of its
//                         row, then out[t] = sum_j w[t][j] * staging[t * k + j] in fp32, in j order (the
//                         combine's moe_combine_token: bit-reproducible), then zero the pair counters.
//   blocks [n_comm, grid) GEMM workers (mk_gemm.cuh): MkGroupedScheduler over (expert, row block, H tile);
//                         the epilogue (MoeCombineStore) stores row r of a tile into owner s's staging row
//                         t * k + j (recv_map[r] = s * T * k + t * k + j; NVLink stores for a peer, local for
//                         this rank's own pairs), then, after a consumer barrier, one thread per row adds 1
//                         (release, .sys) to s's cnt[t * k + j].
// Workspace (moe/layout.py gemm_combine_layout): control, u64 cnt[T * k] (added to by the rows' GEMM ranks;
// zeroed by the host on the stream before each launch, and by the owner once summed), staging rows [T * k]
// of y's row_bytes.  Protocol: before its first store a GEMM block checks that every peer announced this
// call with our signature (mk_same_call) and consumed our stores of the previous call; the last block to
// finish raises consumed[me] at every peer (moe_gemm_finish).  The host's zeroing is needed because calls
// of other T or k reuse the workspace: their staging rows lie where this call's counters do.
// Deadlock freedom: GEMM workers wait only on the peers' start and end of the previous call; sum warps wait
// only on GEMM workers (here and at the peers); every block is resident (cooperative launch within the
// rank's SM share, so ranks sharing a GPU are co-resident).
//
// Specialization: MK_GEMM_IN (bf16 | f16) = MK_GEMM_OUT (y, staging and out), MK_GEMM_CONFIG and its
// MK_CFG_* (mkernel/ops/gemm configs.py defines()); B (w_down) is "nk": [El, H, F].
#include "gemm/mk_gemm_configs.cuh"
#include "ops/mk_moe_gemm.cuh"

// Passed by value; mirrored by mkernel/ops/moe/layout.py MoeCombineArgs (same order, natural alignment).
struct MoeCombineArgs {
  const int* ids;        // routing: [T, k] global expert ids
  const int* slots;      // routing: [T, k] row in the expert owner's receive buffer (-1: dropped)
  const float* weights;  // routing: [T, k]
  const int* offs;       // routing: [El + 1] this rank's expert offsets
  const int* recv_map;   // [r_cap] s * T * k + t * k + j of each received row (the dispatch's)
  void* out;             // [T, H] this rank's tokens
  char* ws;              // this rank's workspace (gemm_combine_layout)
  const mk_u64* peers;   // local rank -> its workspace base, as mapped here
  int K;                 // F
  int n_comm;            // sum blocks
  int group_m;           // rasterization super-row height
  int pad;
};
static_assert(sizeof(MoeCombineArgs) == 80, "MoeCombineArgs layout changed: update mkernel/ops/moe/layout.py");

// Threads [tid0, tid0 + n) (named barrier `bar`): every peer announced call e with our signature and
// consumed our stores of call e-1 -- the rule before writing into a peer's workspace (docs/moe.md,
// "Signals, waits, reuse").  Bounded waits; the verdict is the same for every thread.
MK_DEVICE bool moe_peers_in_call(const MkComm& c, const MoeWs& w, mk_u64 e, int* verdict, int bar, int tid0, int n) {
  const int i = (int)threadIdx.x - tid0;
  if (i == 0) *verdict = 1;
  mk_named_barrier_sync(bar, n);
  for (int j = i; j < w.P; j += n)
    if (j != w.me && !(mk_same_call(c, w.header(), e, j) &&
                       mk_wait_geq(c, w.header().consumed(j), e - 1, MK_LOCAL_PEER(j), -1 - j)))
      *verdict = 0;
  mk_named_barrier_sync(bar, n);
  return *verdict != 0;
}

// Received row `row` -> its pair's index t * k + j at the owner; false for a value outside [0, P * T * k)
// (never, with a consistent routing: no wild store).
MK_DEVICE bool moe_row_pair(const MoeCombineArgs& a, const MoeWs& w, mk_u64 Tk, int row, int& owner, mk_u64& pair) {
  const int v = a.recv_map[row];
  if (v < 0 || (mk_u64)v >= (mk_u64)w.P * Tk) return false;
  owner = (int)((mk_u64)v / Tk);
  pair = (mk_u64)v % Tk;
  return true;
}

// The GEMM's epilogue: a tile's rows into their owners' staging rows, then the rows' counters (the file
// comment).  Named barrier 5 among the consumer warpgroups (the GEMM component uses 1-4, the finish 7).
template <int NC> struct MoeCombineStore {
  const MkComm* c;
  const MoeWs* w;
  const MoeCombineArgs* a;
  mk_u64 Tk, ep;
  int* verdict;       // shared: the block's peer check
  bool checked, ok;   // (the same in every consumer thread: they store the same tiles)
  static constexpr bool kTileDone = false;
  static constexpr bool kDrain = false;
  MK_DEVICE void drain() const {}
  MK_DEVICE void tile_done(const MkTile&) {}
  // the tile's columns of its row rr in the row's owner's staging (nullptr: past the tile, or no pair)
  MK_DEVICE MkOut* row_dest(const MkTile& t, int rr) const {
    int s;
    mk_u64 pair;
    if (rr >= t.rows || !moe_row_pair(*a, *w, Tk, t.row0 + rr, s, pair)) return nullptr;
    return reinterpret_cast<MkOut*>(w->peer(s) + w->L.stage_off + pair * w->L.row_bytes) + t.col0;
  }
  template <int BN> MK_DEVICE void store(const MkTile& t, int slab, const float (&acc)[BN / 2]) {
    if (!checked) {  // before the first store into a peer's workspace
      ok = moe_peers_in_call(*c, *w, ep, verdict, 5, 128, 128 * NC);
      checked = true;
    }
    if (!ok) return;
    int r0, c0;
    mk_wgmma_frag_origin(r0, c0);
    MkOut* const d0 = row_dest(t, 64 * slab + r0);
    MkOut* const d1 = row_dest(t, 64 * slab + r0 + 8);
    mk_wgmma_frag_for_each<BN>(acc, [&](int r, int col, float v0, float v1) {
      MkOut* const p = r == r0 ? d0 : d1;
      if (p == nullptr || col >= t.cols) return;
      if (col + 1 < t.cols) *reinterpret_cast<typename MkPair<MkOut>::V*>(p + col) = MkPair<MkOut>::make(v0, v1);
      else p[col] = mk_from_f32<MkOut>(v0);
    });
    mk_named_barrier_sync(5, 128 * NC);  // every row of the tile stored (release below covers the block's)
    const int i = (int)threadIdx.x - 128;
    int s;
    mk_u64 pair;
    if (i < t.rows && moe_row_pair(*a, *w, Tk, t.row0 + i, s, pair))
      mk_signal_add(reinterpret_cast<mk_u64*>(w->peer(s) + w->L.counts_off) + pair, 1);
  }
};

// Sum blocks, one warp per token: false if a wait failed (recorded; the warp stops).
template <int BN>
MK_DEVICE bool moe_owner_sums(const MkComm& c, const MoeWs& w, const MoeCombineArgs& a, const MoeShape& s) {
  const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  const int warps = a.n_comm * nw, gw = blockIdx.x * nw + (threadIdx.x >> 5), k = s.k;
  const mk_u64 need = (mk_u64)((s.H + BN - 1) / BN);  // column tiles of a row
  mk_u64* cnt = reinterpret_cast<mk_u64*>(w.base + w.L.counts_off);
  const char* stage = w.base + w.L.stage_off;
  for (int t = gw; t < s.T; t += warps) {  // (warp-uniform)
    const mk_u64 q = (mk_u64)t * k + lane;
    int ok = 1;
    if (lane < k && a.slots[q] >= 0) ok = mk_wait_geq(c, cnt + q, need, MK_LOCAL_PEER(a.ids[q] / s.El), (int)q);
    if (!__all_sync(0xffffffffu, ok)) return false;
    __syncwarp();  // (the lanes' acquires order every lane's reads of the rows)
    moe_combine_token<MkOut, MkOut>(t, k, s.H, s.El, lane, a.slots, a.ids, a.weights, (MkOut*)a.out,
                                    [&](int j, int, int) {
                                      return (const MkOut*)(stage + ((mk_u64)t * k + j) * w.L.row_bytes);
                                    });
    if (lane < k) cnt[q] = 0;  // (the next call's adds follow our consumed signal)
  }
  return true;
}

// tmA: act [r_cap, F]; tmB: w_down [El, H, F] ("nk").
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
    mk_moe_gemm_combine(const __grid_constant__ MkTensorMap tmA, const __grid_constant__ MkTensorMap tmB,
                        const __grid_constant__ MkComm c, const __grid_constant__ MoeLayout L,
                        const __grid_constant__ MoeShape s, const __grid_constant__ MoeCombineArgs a) {
  typedef MkWithRegs<MkCfg<false>, 48, 224> Cfg;
  static_assert(Cfg::SHARING == 1 && Cfg::CLUSTER_K == 1 && !Cfg::PINGPONG && Cfg::WG_N == 1,
                "moe_gemm_combine: cooperative, unclustered configs, one slab per consumer warpgroup");
  extern __shared__ unsigned char mk_smem[];
  __shared__ int verdict;
  const MoeWs w = moe_ws(c, a.ws, a.peers, L);
  const mk_u64 ep = moe_begin(c, w);  // (block 0 is a sum block: it announces the call)
  if ((int)blockIdx.x < a.n_comm) {
    int ok = moe_peers_in_call(c, w, ep, &verdict, 5, 0, blockDim.x);
    ok = ok && moe_owner_sums<Cfg::BN>(c, w, a, s);
    if (!__syncthreads_and(ok)) return;  // (a failed warp's block stops whole: the finish barrier is the block's)
    moe_gemm_finish(w, ep, 0, blockDim.x);
    return;
  }
  MkGroupedScheduler<Cfg::BM, Cfg::BN> sched(a.offs, 1, s.El, s.r_cap, s.H, a.group_m);
  MkNoWait hook;  // act is complete at launch (the gate/up kernel ran before, on the stream)
  MoeCombineStore<Cfg::NC> epi;
  epi.c = &c;
  epi.w = &w;
  epi.a = &a;
  epi.Tk = (mk_u64)s.T * s.k;
  epi.ep = ep;
  epi.verdict = &verdict;
  epi.checked = false;
  epi.ok = true;
  mk_gemm_run<Cfg>(&tmA, &tmB, a.K, sched, hook, epi, mk_smem, (int)blockIdx.x - a.n_comm,
                   (int)gridDim.x - a.n_comm);
  if (threadIdx.x < 128 || !epi.ok) return;  // the producer warpgroup is done; the consumers close the call
  moe_gemm_finish(w, ep, 128, 128 * Cfg::NC);
}
