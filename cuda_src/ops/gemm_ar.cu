// gemm_ar.cu - GEMM + AllReduce in one persistent kernel: local rank r holds A_r [M, K_r] and B_r; every
// rank gets C = sum over ranks of A_r @ B_r [M, N], the same bits on every rank.  Host side:
// mkernel/ops/gemm_ar/ (op.py, layout.py, planner.py); design, protocol, workspace picture and the deadlock
// argument: docs/gemm_ar.md.  The pieces are mk_gemm_comm.cuh's (shared with gemm_rs.cu).
//
// Kernel mk_gemm_ar_{kn,nk} (cooperative, grid <= #SMs, one block per SM, Cfg::THREADS threads,
// Cfg::SMEM_BYTES dynamic shared memory), one of two schemes per specialization (MK_AR_PATH):
//   0 one-shot (decode-sized M): every rank computes every tile of A_r @ B_r (MkLinearScheduler, the same
//     sequence and grid on every rank) and pushes each tile's partial to every peer (MkOneShotEpilogue);
//     every rank sums every tile in rank order 0..P-1 and stores it.  MK_GEMM_SWAP = 1 (B "nk" only): the
//     kernel's problem is the transposed one, C^T = B_r A_r^T (tmA maps B_r [N, K_r], tmB maps A_r [M, K_r]),
//     its tiles stored transposed from registers (MkEpilogueStoreT) -- pushing and summing are elementwise,
//     blind to the orientation.
//   1 two-phase (large M): reduce-scatter as gemm_rs.cu (MkOwnerScheduler, owners' rows split on tile rows,
//     partials to their owner, the owner sums them in a fixed order), then the owner pushes its reduced tile
//     (out's dtype) to every peer's gather slot (MkRsEpilogue with a gather dtype) and the block's idle
//     producer warp 2 raises its gather flags; after its tile loop every block copies the peers' reduced
//     tiles, as their flags come up, into out (mk_ar_receive).
// Worker 0's idle producer warp 1 announces the call; the last block tells every peer it consumed their
// data and commits the epoch (mk_rs_finish).
//
// Workspace (same layout on every local rank; mkernel/ops/gemm_ar/layout.py):
//   [0]              MkEpochState        this rank's call counter
//   [consumed_off]   MkCallHeader        consumed[P], entered[P], sig[P][2], entry j written by rank j
//   [flags_off]      u64[P][flag_stride] ready[src][t]: call that delivered src's partial of tile t
//   [G.flags_off]    u64[P][flag_stride] (two-phase) gath[owner][t]: call whose reduced tile t of owner landed
//   [data_off]       one-shot: P slots (slot s: rank s's partials of every tile); two-phase: P-1 slots as
//                    gemm_rs.cu's (slot (src - me + P) % P - 1)
//   [G.data_off]     (two-phase) P-1 slots, slot (owner - me + P) % P - 1: owner's reduced tiles, out's dtype
//   tile t at t * tile bytes in a slot, fragment-ordered (mk_gemm_comm.cuh MkFrag).
//
// Specialization: MK_GEMM_IN (bf16 | f16), MK_GEMM_OUT (out dtype), MK_GEMM_CONFIG and its MK_CFG_*
// parameters (mkernel/ops/gemm/configs.py: defines(); mk_gemm_configs.cuh), MK_AR_PATH (0 | 1), MK_GEMM_SWAP
// (one-shot only; then only mk_gemm_ar_nk exists), MK_AR_PARTIAL (partial dtype code; default MK_GEMM_OUT).
// Cooperative configs with one slab per consumer warpgroup, no clusters.
#include "gemm/mk_gemm_configs.cuh"
#include "gemm/mk_gemm_comm.cuh"

#ifndef MK_AR_PARTIAL
#define MK_AR_PARTIAL MK_GEMM_OUT
#endif
#ifndef MK_AR_PATH
#define MK_AR_PATH 1
#endif
#ifndef MK_GEMM_SWAP
#define MK_GEMM_SWAP 0
#endif
#if MK_GEMM_SWAP && MK_AR_PATH != 0
#error "transposed tiles: the one-shot scheme only (MK_AR_PATH 0)"
#endif
typedef typename mk_type<MK_AR_PARTIAL>::T MkPartial;

// Passed by value; mirrored by mkernel/ops/gemm_ar/layout.py:ArArgs (same order, natural alignment).
struct ArArgs {
  char* ws;              // this rank's workspace
  const mk_u64* peers;   // local rank -> its workspace base, as mapped here
  void* c;               // out [M, N], row stride ldc elements
  long long ldc;
  MkRsLayout L;          // partial slots and their ready flags
  MkGatherLayout G;      // two-phase: reduced tiles and their gather flags
  MkOwnerRows rows;      // P, me, N (the kernel's columns: M when transposed), group_m, offs (two-phase)
  int M;                 // one-shot: the kernel's rows (N when transposed)
  int K;                 // K_r of this rank (>= 1)
  int c_vec_ok;          // out's base and ldc allow 2-element vectors
  int c_tma;             // 1: tmC is a map over out (the config's TMA-store epilogue)
  int pad;
};
static_assert(sizeof(ArArgs) == 200, "ArArgs layout changed: update mkernel/ops/gemm_ar/layout.py");

template <bool KN>
MK_DEVICE void gemm_ar_body(const MkTensorMap* tmA, const MkTensorMap* tmB, const MkTensorMap* tmC, const MkComm& c,
                            const ArArgs& a) {
  typedef MkCfg<KN> Cfg;
  static_assert(!Cfg::PINGPONG && Cfg::WG_N == 1 && Cfg::SHARING == 1 && Cfg::CLUSTER_K == 1,
                "cooperative configs, one slab per consumer warpgroup, no clusters");
  extern __shared__ unsigned char mk_smem[];
  __shared__ int failed;
  __shared__ unsigned done;
  if (threadIdx.x == 0) {  // (ordered before any use by mk_gemm_run's block barrier)
    failed = 0;
    done = 0;
  }
  MkEpochState* es = (MkEpochState*)a.ws;
  const mk_u64 epoch = mk_epoch_begin(es);
  MkEpilogueStore<MkOut> direct;
  direct.c = reinterpret_cast<MkOut*>(a.c);
  direct.ldc = a.ldc;
  direct.vec_ok = a.c_vec_ok;
  const int blk = (int)blockIdx.x, grid = (int)gridDim.x;
#if MK_AR_PATH == 0
  MkLinearScheduler<Cfg::BM, Cfg::BN> sched(a.M, a.rows.N, a.rows.group_m);
  MkRsHook<Cfg::BM, Cfg::BN, MK_FLAGS_NONE> hook;  // (the announcement only: consumers raise the flags)
  hook.c = &c;
  hook.rows = &a.rows;
  hook.L = &a.L;
  hook.peers = a.peers;
  hook.epoch = epoch;
  hook.done = &done;
  hook.failed = &failed;
  auto run = [&](auto& inner) {
    auto epi = mk_one_shot_epilogue<Cfg::NC, Cfg::BN, MkPartial>(inner, &c, &a.L, a.ws, a.peers, epoch, &failed,
                                                                 a.rows.P, a.rows.me, (a.rows.N + Cfg::BN - 1) / Cfg::BN);
    return mk_gemm_run<Cfg>(tmA, tmB, a.K, sched, hook, epi, mk_smem, blk, grid);
  };
#if MK_GEMM_SWAP
  MkEpilogueStoreT<MkOut> inner{direct.c, direct.ldc};  // (no TMA store of a transposed tile)
  run(inner);
#else
  // every tile ends at out's last row or a whole tile above it: clip_rows = 1
  mk_with_store_epilogue<Cfg>(direct, tmC, a.c_tma, 1, mk_smem, [&](auto& inner) { return run(inner); });
#endif
#else
  MkOwnerScheduler<Cfg::BM, Cfg::BN> sched(&a.rows);
  MkRsHook<Cfg::BM, Cfg::BN, MK_FLAGS_RS_GATHER> hook;
  hook.c = &c;
  hook.rows = &a.rows;
  hook.L = &a.L;
  hook.peers = a.peers;
  hook.epoch = epoch;
  hook.done = &done;
  hook.failed = &failed;
  hook.G = &a.G;
  // Owners' rows are split on tile rows, so every tile ends at out's last row or a whole tile above it:
  // clip_rows = 1.
  mk_with_store_epilogue<Cfg>(direct, tmC, a.c_tma, 1, mk_smem, [&](auto& inner) {
    auto epi = mk_rs_epilogue<Cfg::NC, Cfg::BN, MkPartial, MkOut>(inner, &c, &a.rows, &a.L, a.ws, a.peers, epoch,
                                                                 &failed, &done, &a.G);
    // (the receive units run in epi.drain(), after the block's tile loop)
    return mk_gemm_run<Cfg>(tmA, tmB, a.K, sched, hook, epi, mk_smem, blk, grid);
  });
#endif
  // The producer warpgroup is done (its warp 2 may still raise flags); the consumers finish the call (the
  // hook never aborts the loop).
  if (threadIdx.x < 128) return;
  mk_rs_finish(es, a.peers, a.L.consumed_off, a.rows.P, a.rows.me, epoch, &failed, 128, 128 * Cfg::NC);
}

// tmA: A_r [M, K_r] (transposed: B_r [N, K_r]); tmB: B_r (mk_gemm.cuh's map for the layout; transposed: A_r as
// an "nk" operand); tmC: out (used when a.c_tma).
#if !MK_GEMM_SWAP
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
    mk_gemm_ar_kn(const __grid_constant__ MkTensorMap tmA, const __grid_constant__ MkTensorMap tmB,
                  const __grid_constant__ MkTensorMap tmC, const __grid_constant__ MkComm c,
                  const __grid_constant__ ArArgs a) {
  gemm_ar_body<true>(&tmA, &tmB, &tmC, c, a);
}
#endif
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
    mk_gemm_ar_nk(const __grid_constant__ MkTensorMap tmA, const __grid_constant__ MkTensorMap tmB,
                  const __grid_constant__ MkTensorMap tmC, const __grid_constant__ MkComm c,
                  const __grid_constant__ ArArgs a) {
  gemm_ar_body<false>(&tmA, &tmB, &tmC, c, a);
}
