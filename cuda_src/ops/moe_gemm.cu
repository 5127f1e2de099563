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
//   blocks [n_comm, grid) GEMM workers (mk_gemm.cuh): MkGroupedFirstScheduler over (expert, row block, N
//                         tile) from the device offsets, this rank's own rows first: every tile whose
//                         row block holds only rows from this rank (rows [src_offs[l][me],
//                         src_offs[l][me + 1]) of expert l), then the others, each in the grouped
//                         order; before a tile's first K block the producer waits until arrived[idx]
//                         == the tile's rows, then fences the generic-proxy writes before its TMA
//                         loads of A (x_recv).
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
#include "ops/mk_moe_gemm_dispatch.cuh"

#ifndef MK_MOE_SWIGLU
#define MK_MOE_SWIGLU 0
#endif

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
// src_offs: the routing's src_offsets [El][P + 1] (where each source's rows of local expert l start).
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
    mk_moe_dispatch_gemm(const __grid_constant__ MkTensorMap tmA, const __grid_constant__ MkTensorMap tmB,
                         const __grid_constant__ MkComm c, const __grid_constant__ MoeLayout L,
                         const __grid_constant__ MoeShape s, const __grid_constant__ MoeGemmArgs a,
                         const int* __restrict__ src_offs) {
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
  // this rank's own row blocks first (they land first): a worker gets to its blocks holding peers' rows only
  // after all of its own-row ones (docs/moe.md, "Dispatch + grouped GEMM, fused")
  MkGroupedFirstScheduler<Cfg::BM, Cfg::BN> sched(a.offs, 1, s.El, s.r_cap, a.N, a.group_m, src_offs + w.me, w.P + 1);
  const MoeWaitRows<Cfg::BM> hook = moe_wait_rows<Cfg::BM>(c, a, s);
  auto epi = moe_gemm_epilogue(moe_gate_up_store(a));
  const bool r = mk_gemm_run<Cfg>(&tmA, &tmB, a.K, sched, hook, epi, mk_smem, (int)blockIdx.x - a.n_comm,
                                  (int)gridDim.x - a.n_comm);
  if (threadIdx.x < 128 || !r) return;  // the producer warpgroup is done; the consumers close the call
  moe_gemm_finish(w, ep, 128, 128 * Cfg::NC);
}
