// moe_layer.cu - the MoE layer after routing in one persistent kernel: dispatch -> gate/up grouped GEMM with
// SwiGLU in its epilogue -> down grouped GEMM -> combine (docs/moe.md, "The layer in one kernel").  Host
// side: mkernel/ops/moe/fused_layer.py.
//
// Kernel mk_moe_layer (cooperative, grid <= the context's resident SMs, one block per SM, Cfg::THREADS
// threads, Cfg::SMEM_BYTES dynamic shared memory):
//   blocks [0, n_comm)    communication: the dispatch of moe_gemm.cu (rows once per destination rank, own
//                         rows first, every row landed counted in arrived[idx(l, b)]), then one thread per
//                         block waits until every local rank s raised down_stored[s] >= ep here (all its loop
//                         (2) tiles of the call stored: MoeDownDone), then the combine's owner sums of
//                         moe_gemm_combine.cu (a warp per token; its waits on cnt[t * k + j] then pass at
//                         once; the warp zeroes them after its sum).
//   blocks [n_comm, grid) GEMM workers, two tile loops on one ring (mk_gemm_run_two: one role split, the
//                         producer issues loop (2)'s K blocks right after loop (1)'s):
//                         (1) act = silu(x_recv @ gate^T) * (x_recv @ up^T) (MkGateUpB: w_gate_up as users
//                             store it), a tile waiting for its rows to have landed (MoeWaitRows); each
//                             finished tile adds 1 to act_done[idx(l, b)] (MoeActDone, release);
//                         (2) y = act @ w_down^T, a tile waiting until act_done[idx(l, b)] counts all
//                             ceil(2F / BN) tiles of its row block (every act column; MoeWaitAct), each
//                             finished tile stored straight into its rows' owners' combine staging and
//                             counted there (MoeCombineStore), then counted in this rank's down_done
//                             (MoeDownDone); the add that completes the rank's loop (2) tiles
//                             (MkGroupedScheduler::tiles) raises down_stored[me] = ep at every local rank,
//                             this one included.  A rank with no loop (2) tile raises them from
//                             communication block 0 after its dispatch.
// idx(l, b) = l + o[l] / BM + b (moe_gemm.cu); act_done = arrived + n_slots, down_done = arrived[2 * n_slots];
// the host zeroes them, and this rank's cnt words, before each launch.  down_stored needs no reset: a raise
// writes the call's epoch.  h and y are never written.
// Workspace (moe/layout.py layer_layout): one control region (one epoch, one call header, the dispatch's
// ready flags, u64 down_stored [P] at Lc.scratch_off: entry s written by local rank s), the dispatch's
// recv_src and staging [P][T] (layout Ld), the combine's cnt [T * k] and staging [T * k] (layout Lc).  The
// protocol is the two kernels' with one epoch: every write into a peer's workspace follows that peer's
// consumed >= e - 1 (it finished every read of call e - 1) and its announcement of call e (its host memset of
// cnt is done) -- the dispatch's through moe_wait_consumed and moe_wait_ready, the combine stores' and the
// down_stored raise after them through moe_peers_in_call (the raising tile's block passed it), the zero-tile
// raise after block 0's dispatch -- and the last block to finish raises consumed[me] at every peer
// (moe_gemm_finish: every block arrives once, communication blocks after their sums, workers' consumer
// warpgroups after loop (2)).  Wait flag indices: down_stored[s] -2000 - s (the others as moe_gemm.cu's and
// moe_gemm_combine.cu's).
// Deadlock freedom: the dispatch waits only on peers' communication blocks and their end of the previous
// call; loop (1) tiles only on this rank's communication blocks; loop (2) tiles only on loop (1) tiles of
// this rank, which wait on nothing of loop (2) (a worker's producer issues all its loop (1) loads before its
// first loop (2) wait, so its consumers finish loop (1) whatever loop (2) waits on); a communication block
// waits on down_stored only after its dispatch, and down_stored rises only from loop (2) tiles (here and at
// the peers) or, on a rank without any, from block 0 right after its dispatch -- neither waits on a sum; the
// sums then only on loop (2) tiles too; every block is resident (cooperative launch within the rank's SM
// share).
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

// down_stored[s] in local rank j's workspace (as mapped here): the last call whose loop (2) tiles rank s all
// stored (moe/layout.py layer_layout: u64 [P] at Lc.scratch_off, in the control region).
MK_DEVICE mk_u64* moe_down_stored(const MoeWs& w, int j, int s) {
  return reinterpret_cast<mk_u64*>(w.peer(j) + w.L.scratch_off) + s;
}

// One thread: this rank's loop (2) tiles of call ep are all stored; down_stored[me] = ep at every local rank
// (fenced releases: whatever this thread has acquired is visible to a waiter that acquires the flag).
MK_DEVICE void moe_raise_down_stored(const MoeWs& w, mk_u64 ep) {
  for (int j = 0; j < w.P; ++j) mk_signal_set(moe_down_stored(w, j, w.me), ep);
}

// Loop (2)'s epilogue: MoeCombineStore, then (thread 128, after the consumers' barrier) the tile counted in
// down_done; the add that completes total raises down_stored (docs/moe.md, "The layer in one kernel").
// Ordering: every consumer thread's staging stores precede the barrier, so thread 128's fenced .sys add
// releases them (cumulativity); the adds on down_done form one read-modify-write chain, so the completing
// add (acquire) follows every counted tile's release, of any block, and its fenced release of down_stored
// carries them all to the waiter that acquires it.  A tile whose block failed its peer check stored nothing
// and is not counted: total is then never reached and no flag rises (the waiters time out).
template <int NC> struct MoeDownDone {
  MoeCombineStore<NC> inner;
  mk_u64* done;  // down_done: this rank's loop (2) tiles finished in this call (zero at launch)
  mk_u64 total;  // this rank's loop (2) tiles, every worker's (the scheduler's tiles())
  static constexpr bool kTileDone = true;
  static constexpr bool kDrain = false;
  MK_DEVICE void drain() const {}
  template <int BN> MK_DEVICE void store(const MkTile& t, int slab, const float (&acc)[BN / 2]) {
    inner.template store<BN>(t, slab, acc);
  }
  MK_DEVICE void tile_done(const MkTile&) const {
    if (!inner.ok) return;
    __threadfence_system();
    if (mk_atom_add_acq_rel(done, 1) + 1 == total) moe_raise_down_stored(*inner.w, inner.ep);
  }
};

// Communication blocks (all threads): every local rank s raised down_stored[s] >= ep here.  One waiting
// thread per block, so the sum warps' per-pair waits pass at once instead of polling through the down GEMM
// (docs/design.md, "Waiting").  false, in every thread, if a wait failed (recorded).
MK_DEVICE bool moe_wait_down_stored(const MkComm& c, const MoeWs& w, mk_u64 ep) {
  int ok = 1;
  if (threadIdx.x == 0)
    for (int s = 0; s < w.P && ok; ++s)
      ok = mk_wait_geq(c, reinterpret_cast<const mk_u64*>(w.base + w.L.scratch_off) + s, ep, MK_LOCAL_PEER(s),
                       -2000 - s);
  return __syncthreads_and(ok) != 0;
}

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
// a.K = H, a.arrived: 2 * n_slots + 1 counters); b: the loop (2) + combine arguments (b.K = F).
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
  MkGroupedScheduler<Cfg::BM, Cfg::BN> down_sched(a.offs, 1, s.El, s.r_cap, s.H, a.group_m);
  if ((int)blockIdx.x < a.n_comm) {
    int ok = moe_gemm_comm<Cfg::BM>(c, wd, ep, a, s);
    // a rank without loop (2) tiles raises down_stored here, once (its dispatch checked every peer's call)
    if (ok && blockIdx.x == 0 && threadIdx.x == 0 && down_sched.tiles() == 0) moe_raise_down_stored(wc, ep);
    ok = ok && moe_wait_down_stored(c, wc, ep);
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
  MoeWaitAct<Cfg::BM> act_complete;
  act_complete.c = &c;
  act_complete.done = act_done;
  act_complete.offs = a.offs;
  act_complete.M = s.r_cap;
  act_complete.tiles = (mk_u64)((a.N + Cfg::BN - 1) / Cfg::BN);
  MoeDownDone<Cfg::NC> comb_epi;
  comb_epi.inner = moe_combine_store<Cfg::NC>(c, wc, b, s, ep, &verdict);
  comb_epi.done = a.arrived + 2 * n_slots;
  comb_epi.total = (mk_u64)down_sched.tiles();
  const bool r = mk_gemm_run_two(mk_tile_loop<CfgUp>(&tmX, &tmGU, a.K, up_sched, rows_landed, act_epi),
                                 mk_tile_loop<Cfg>(&tmAct, &tmWD, b.K, down_sched, act_complete, comb_epi), mk_smem,
                                 (int)blockIdx.x - a.n_comm, (int)gridDim.x - a.n_comm);
  // the producer warpgroup is done; the consumers close the call
  if (threadIdx.x < 128 || !r || !comb_epi.inner.ok) return;
  moe_gemm_finish(wd, ep, 128, 128 * Cfg::NC);
}
