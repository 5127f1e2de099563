// gemm_rs.cu - GEMM + ReduceScatter in one persistent kernel (row-parallel tensor parallelism): local
// rank r holds A_r [M, K_r] and B_r; S = sum over ranks of A_r @ B_r; rank r keeps rows
// [offs[r], offs[r+1]) of S.  Host side: mkernel/ops/gemm_rs/ (op.py, layout.py, planner.py); design,
// protocol and workspace picture: docs/gemm_rs.md.
//
// Kernel mk_gemm_rs_{kn,nk} (cooperative, grid <= #SMs, one block per SM, Cfg::THREADS threads,
// Cfg::SMEM_BYTES dynamic shared memory): every block is a GEMM worker (mk_gemm.cuh) over the tiles of
// A_r @ B_r, owner by owner in rank-rotated order (MkOwnerScheduler: me+1, me+2, ..., own rows last).
// A peer's tile goes, as a partial in the partial dtype, into that peer's workspace (MkRsEpilogue,
// mk_gemm_comm.cuh), and the block's idle producer warp 2 raises its ready flag once the stores are done
// (mk_rs_raise_flags); an own tile waits for every peer's partial, adds them in a fixed order and is
// stored into `out` ([M_me, N], row stride ldc).  Worker 0's idle producer warp 1 announces the call to
// the peers (MkRsHook); the last block tells every peer it consumed their partials and commits the epoch
// (mk_rs_finish).
//
// Workspace (same layout on every local rank; mkernel/ops/gemm_rs/layout.py):
//   [0]              MkEpochState       this rank's call counter
//   [consumed_off]   MkCallHeader       consumed[P], entered[P], sig[P][2], entry j written by rank j
//   [flags_off]      u64[P][flag_stride] ready[src][t]: call that delivered src's partial of our tile t
//   [data_off]       P-1 slots          slot (src - me + P) % P - 1: src's partials of our tiles, tile t
//                                       at t * TILE_BYTES, fragment-ordered (MkRsEpilogue)
//
// Specialization: MK_GEMM_IN (bf16 | f16), MK_GEMM_OUT (out dtype), MK_GEMM_CONFIG and its MK_CFG_*
// parameters (mkernel/ops/gemm/configs.py: defines(); mk_gemm_configs.cuh), MK_RS_PARTIAL (partial dtype
// code; default: MK_GEMM_OUT).  Cooperative configs with one slab per consumer warpgroup, no clusters.
#include "gemm/mk_gemm_configs.cuh"
#include "gemm/mk_gemm_comm.cuh"

#ifndef MK_RS_PARTIAL
#define MK_RS_PARTIAL MK_GEMM_OUT
#endif
typedef typename mk_type<MK_RS_PARTIAL>::T MkPartial;

// Passed by value; mirrored by mkernel/ops/gemm_rs/layout.py:RsArgs (same order, natural alignment).
struct RsArgs {
  char* ws;              // this rank's workspace
  const mk_u64* peers;   // local rank -> its workspace base, as mapped here
  void* c;               // out [M_me, N], row stride ldc elements
  long long ldc;
  MkRsLayout L;
  MkOwnerRows rows;
  int K;                 // K_r of this rank (>= 1)
  int c_vec_ok;          // out's base and ldc allow 2-element vectors
  int c_tma;             // 1: tmC is a map over out (the config's TMA-store epilogue)
  int pad;
};
static_assert(sizeof(RsArgs) == 176, "RsArgs layout changed: update mkernel/ops/gemm_rs/layout.py");

template <bool KN>
MK_DEVICE void gemm_rs_body(const MkTensorMap* tmA, const MkTensorMap* tmB, const MkTensorMap* tmC, const MkComm& c,
                            const RsArgs& a) {
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
  MkOwnerScheduler<Cfg::BM, Cfg::BN> sched(&a.rows);
  MkRsHook<Cfg::BM, Cfg::BN> hook;
  hook.c = &c;
  hook.rows = &a.rows;
  hook.L = &a.L;
  hook.peers = a.peers;
  hook.epoch = epoch;
  hook.done = &done;
  hook.failed = &failed;
  MkEpilogueStore<MkOut> direct;
  direct.c = reinterpret_cast<MkOut*>(a.c);
  direct.ldc = a.ldc;
  direct.vec_ok = a.c_vec_ok;
  // own tiles end at out's last row (out holds this rank's rows only): clip_rows = 1
  mk_with_store_epilogue<Cfg>(direct, tmC, a.c_tma, 1, mk_smem, [&](auto& inner) {
    auto epi = mk_rs_epilogue<Cfg::NC, Cfg::BN, MkPartial>(inner, &c, &a.rows, &a.L, a.ws, a.peers, epoch, &failed,
                                                           &done);
    return mk_gemm_run<Cfg>(tmA, tmB, a.K, sched, hook, epi, mk_smem, (int)blockIdx.x, (int)gridDim.x);
  });
  // The producer warpgroup is done (its warp 2 may still raise flags); the consumers finish the call (the
  // hook never aborts the loop).
  if (threadIdx.x < 128) return;
  mk_rs_finish(es, a.peers, a.L.consumed_off, a.rows.P, a.rows.me, epoch, &failed, 128, 128 * Cfg::NC);
}

// tmA: A_r [M, K_r]; tmB: B_r (mk_gemm.cuh's map for the layout); tmC: out (used when a.c_tma).
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
    mk_gemm_rs_kn(const __grid_constant__ MkTensorMap tmA, const __grid_constant__ MkTensorMap tmB,
                  const __grid_constant__ MkTensorMap tmC, const __grid_constant__ MkComm c,
                  const __grid_constant__ RsArgs a) {
  gemm_rs_body<true>(&tmA, &tmB, &tmC, c, a);
}
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
    mk_gemm_rs_nk(const __grid_constant__ MkTensorMap tmA, const __grid_constant__ MkTensorMap tmB,
                  const __grid_constant__ MkTensorMap tmC, const __grid_constant__ MkComm c,
                  const __grid_constant__ RsArgs a) {
  gemm_rs_body<false>(&tmA, &tmB, &tmC, c, a);
}
