// moe_layer.cu - the MoE layer after routing in one persistent kernel: dispatch -> gate/up grouped GEMM with
// SwiGLU in its epilogue -> down grouped GEMM -> combine (docs/moe.md, "The layer in one kernel").  Host
// side: mkernel/ops/moe/fused_layer.py.
//
// Kernel mk_moe_layer (cooperative, grid <= the context's resident SMs, one block per SM, Cfg::THREADS
// threads, Cfg::SMEM_BYTES dynamic shared memory):
//   blocks [0, n_comm)    communication: the dispatch of moe_gemm.cu (rows once per destination rank, own
//                         rows first, every row landed counted in arrived[idx(l, b)]), then the combine's
//                         owner sums of moe_gemm_combine.cu (a warp per token, as soon as its rows' column
//                         tiles are counted in cnt[t * k + j]; the warp zeroes them after its sum).
//   blocks [n_comm, grid) GEMM workers, two tile loops on one ring (mk_gemm_run_two: one role split, the
//                         producer issues loop (2)'s K blocks right after loop (1)'s):
//                         (1) act = silu(x_recv @ gate^T) * (x_recv @ up^T) (MkGateUpB: w_gate_up as users
//                             store it), a tile waiting for its rows to have landed (MoeWaitRows); each
//                             finished tile adds 1 to act_done[idx(l, b)] (MoeActDone, release);
//                         (2) y = act @ w_down^T, a tile waiting until act_done[idx(l, b)] counts all
//                             ceil(2F / BN) tiles of its row block (every act column; MoeWaitAct), each
//                             finished tile stored straight into its rows' owners' combine staging and
//                             counted there (MoeCombineStore).
// idx(l, b) = l + o[l] / BM + b (moe_gemm.cu); act_done = arrived + n_slots; the host zeroes both, and this
// rank's cnt words, before each launch.  h and y are never written.
// Workspace (moe/layout.py layer_layout): one control region (one epoch, one call header, the dispatch's
// ready flags), the dispatch's recv_src and staging [P][T] (layout Ld), the combine's cnt [T * k] and staging
// [T * k] (layout Lc).  The protocol is the two kernels' with one epoch: every write into a peer's workspace
// follows that peer's consumed >= e - 1 (it finished every read of call e - 1) -- the dispatch's through
// moe_wait_consumed, the combine stores' through moe_peers_in_call (which also waits for the peer's
// announcement of call e: its host memset of cnt is done) -- and the last block to finish raises consumed[me]
// at every peer (moe_gemm_finish: every block arrives once, communication blocks after their sums, workers'
// consumer warpgroups after loop (2)).
// Deadlock freedom: the dispatch waits only on peers' communication blocks and their end of the previous
// call; loop (1) tiles only on this rank's communication blocks; loop (2) tiles only on loop (1) tiles of
// this rank, which wait on nothing of loop (2) (a worker's producer issues all its loop (1) loads before its
// first loop (2) wait, so its consumers finish loop (1) whatever loop (2) waits on); sums only on loop (2)
// tiles here and at the peers; every block is resident (cooperative launch within the rank's SM share).
//
// Specialization: MK_GEMM_IN (bf16 | f16) = MK_GEMM_OUT, MK_GEMM_CONFIG and its MK_CFG_* (one config for both
// loops: its pair width divides F; mkernel/ops/moe/layout.py fused_swiglu_config).
#include "gemm/mk_gemm_configs.cuh"
#include "gemm/mk_gemm_swiglu.cuh"
#include "ops/mk_moe_gemm_combine.cuh"
#include "ops/mk_moe_gemm_dispatch.cuh"

// The host's ctypes mirrors (moe/layout.py MoeGemmArgs, MoeCombineArgs, MoeLayout, MoeShape), checked by
// tests/cpu/test_moe_layer_kernel.py: MK_EXPECT_MOE_LAYER_STRUCTS = {sizeof, alignof, offsetof each field...}
// of the four, in the order below.  (A kernel parameter struct that differs from the host's reads garbage.)
#ifdef MK_EXPECT_MOE_LAYER_STRUCTS
constexpr unsigned long long moel_expected[] = MK_EXPECT_MOE_LAYER_STRUCTS;
constexpr unsigned long long moel_device[] = {
    sizeof(MoeGemmArgs), alignof(MoeGemmArgs), MK_OFFSET_WORD(MoeGemmArgs, x), MK_OFFSET_WORD(MoeGemmArgs, ids),
    MK_OFFSET_WORD(MoeGemmArgs, slots), MK_OFFSET_WORD(MoeGemmArgs, offs), MK_OFFSET_WORD(MoeGemmArgs, x_recv),
    MK_OFFSET_WORD(MoeGemmArgs, recv_map), MK_OFFSET_WORD(MoeGemmArgs, c), MK_OFFSET_WORD(MoeGemmArgs, ws),
    MK_OFFSET_WORD(MoeGemmArgs, peers), MK_OFFSET_WORD(MoeGemmArgs, arrived), MK_OFFSET_WORD(MoeGemmArgs, ldc),
    MK_OFFSET_WORD(MoeGemmArgs, N), MK_OFFSET_WORD(MoeGemmArgs, K), MK_OFFSET_WORD(MoeGemmArgs, n_comm),
    MK_OFFSET_WORD(MoeGemmArgs, group_m), MK_OFFSET_WORD(MoeGemmArgs, c_vec_ok), MK_OFFSET_WORD(MoeGemmArgs, pad),
    sizeof(MoeCombineArgs), alignof(MoeCombineArgs), MK_OFFSET_WORD(MoeCombineArgs, ids),
    MK_OFFSET_WORD(MoeCombineArgs, slots), MK_OFFSET_WORD(MoeCombineArgs, weights),
    MK_OFFSET_WORD(MoeCombineArgs, offs), MK_OFFSET_WORD(MoeCombineArgs, recv_map),
    MK_OFFSET_WORD(MoeCombineArgs, out), MK_OFFSET_WORD(MoeCombineArgs, ws), MK_OFFSET_WORD(MoeCombineArgs, peers),
    MK_OFFSET_WORD(MoeCombineArgs, K), MK_OFFSET_WORD(MoeCombineArgs, n_comm),
    MK_OFFSET_WORD(MoeCombineArgs, group_m), MK_OFFSET_WORD(MoeCombineArgs, pad), MK_MOE_LAYOUT_SHAPE_WORDS};
static_assert(mk_same_words(moel_expected, moel_device),
              "moe_layer.cu: MoeGemmArgs / MoeCombineArgs / MoeLayout / MoeShape differ from the host's ctypes structs");
#endif

// Loop (1)'s epilogue: Inner's store, then (thread 128, after the consumers' barrier: every thread's act
// stores of the tile are done) one release add on the tile's row block counter.
template <int BM, class Inner> struct MoeActDone {
  static_assert(!Inner::kTileDone, "MoeActDone calls no inner tile_done");
  Inner inner;
  mk_u64* done;  // act_done
  static constexpr bool kTileDone = true;
  static constexpr bool kDrain = Inner::kDrain;
  MK_DEVICE void drain() const { inner.drain(); }
  template <int BN> MK_DEVICE void store(const MkTile& t, int slab, float (&acc)[BN / 2]) {
    inner.template store<BN>(t, slab, acc);
  }
  MK_DEVICE void tile_done(const MkTile& t) const {
    __threadfence();
    // (row0 - tile_m * BM: the group's first row as the scheduler clamped it, which MoeWaitAct reads too)
    mk_atom_add_release(done + moe_block_idx<BM>(t.group, t.row0 - t.tile_m * BM, t.tile_m), 1);
  }
};

// Loop (2)'s producer hook: a tile's first K block waits until every act column of its row block is stored.
template <int BM> struct MoeWaitAct {
  const MkComm* c;
  const mk_u64* done;
  const int* offs;
  int M;          // rows of act (r_cap): the scheduler's clamp
  mk_u64 tiles;   // loop (1) tiles per row block: ceil(2F / BN)
  MK_DEVICE const MkTensorMap* a_map(const MkTile& t, const MkTensorMap* tmA, int& a_row) const {
    a_row = t.row0;
    return tmA;
  }
  MK_DEVICE bool before_load(int g, int tm, int, int, bool unit_start) const {
    if (!unit_start) return true;
    const int o0 = min(max(__ldcg(offs + g), 0), M);
    const int idx = moe_block_idx<BM>(g, o0, tm);
    if (!mk_warp_wait_geq(*c, done + idx, tiles, MK_LOCAL_PEER(c->local_rank), idx)) return false;
    asm volatile("fence.proxy.async.global;" ::: "memory");  // generic act stores (other SMs) before TMA reads
    return true;
  }
};

// tmX: x_recv [r_cap, H]; tmGU: w_gate_up [El, 2F, H] through the paired gate/up view; tmAct: act [r_cap, F];
// tmWD: w_down [El, H, F] ("nk").  a: the dispatch + loop (1) arguments (a.c = act, a.ldc = F, a.N = 2F,
// a.K = H, a.arrived: 2 * n_slots counters); b: the loop (2) + combine arguments (b.K = F).
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
    mk_moe_layer(const __grid_constant__ MkTensorMap tmX, const __grid_constant__ MkTensorMap tmGU,
                 const __grid_constant__ MkTensorMap tmAct, const __grid_constant__ MkTensorMap tmWD,
                 const __grid_constant__ MkComm c, const __grid_constant__ MoeLayout Ld,
                 const __grid_constant__ MoeLayout Lc, const __grid_constant__ MoeShape s,
                 const __grid_constant__ MoeGemmArgs a, const __grid_constant__ MoeCombineArgs b, int n_slots) {
  // the producer runs the grouped schedulers and the waits: 48 registers, not 40 (as moe_gemm.cu)
  typedef MkWithRegs<MkCfg<false>, 48, 224> Cfg;
  typedef MkGateUpB<Cfg> CfgUp;  // loop (1): B through the paired view, one thread holds gate f and up F + f
  static_assert(Cfg::SHARING == 1 && Cfg::CLUSTER_K == 1 && !Cfg::PINGPONG && Cfg::WG_N == 1,
                "moe_layer: cooperative, unclustered configs, one slab per consumer warpgroup");
  extern __shared__ unsigned char mk_smem[];
  __shared__ int verdict;
  const MoeWs wd = moe_ws(c, a.ws, a.peers, Ld);
  const MoeWs wc = moe_ws(c, a.ws, a.peers, Lc);  // (the same control region: one epoch, one header)
  const mk_u64 ep = moe_begin(c, wd);  // (block 0 is a communication block: it announces the call)
  if ((int)blockIdx.x < a.n_comm) {
    int ok = moe_gemm_comm<Cfg::BM>(c, wd, ep, a, s);
    ok = ok && moe_owner_sums<Cfg::BN>(c, wc, b, s);
    if (!__syncthreads_and(ok)) return;  // (a failed warp's block stops whole: the finish barrier is the block's)
    moe_gemm_finish(wd, ep, 0, blockDim.x);
    return;
  }
  mk_u64* const act_done = a.arrived + n_slots;
  // loop (1): gate/up + SwiGLU -> act, a tile's rows landed first
  MkGroupedScheduler<Cfg::BM, Cfg::BN> up_sched(a.offs, 1, s.El, s.r_cap, a.N, a.group_m);
  const MoeWaitRows<Cfg::BM> rows_landed = moe_wait_rows<Cfg::BM>(c, a, s);
  MoeActDone<Cfg::BM, MkEpilogueSwiGLU<MkEpilogueStore<MkOut>>> act_epi;
  act_epi.inner = mk_swiglu_epilogue(moe_gate_up_store(a));
  act_epi.done = act_done;
  // loop (2): down -> the owners' combine staging, a tile's act row block complete first
  MkGroupedScheduler<Cfg::BM, Cfg::BN> down_sched(a.offs, 1, s.El, s.r_cap, s.H, a.group_m);
  MoeWaitAct<Cfg::BM> act_complete;
  act_complete.c = &c;
  act_complete.done = act_done;
  act_complete.offs = a.offs;
  act_complete.M = s.r_cap;
  act_complete.tiles = (mk_u64)((a.N + Cfg::BN - 1) / Cfg::BN);
  MoeCombineStore<Cfg::NC> comb_epi = moe_combine_store<Cfg::NC>(c, wc, b, s, ep, &verdict);
  const bool r = mk_gemm_run_two(mk_tile_loop<CfgUp>(&tmX, &tmGU, a.K, up_sched, rows_landed, act_epi),
                                 mk_tile_loop<Cfg>(&tmAct, &tmWD, b.K, down_sched, act_complete, comb_epi), mk_smem,
                                 (int)blockIdx.x - a.n_comm, (int)gridDim.x - a.n_comm);
  if (threadIdx.x < 128 || !r || !comb_epi.ok) return;  // the producer warpgroup is done; the consumers close the call
  moe_gemm_finish(wd, ep, 128, 128 * Cfg::NC);
}
