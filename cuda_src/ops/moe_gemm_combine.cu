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
#include "ops/mk_moe_gemm_combine.cuh"

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
  MoeCombineStore<Cfg::NC> epi = moe_combine_store<Cfg::NC>(c, w, a, s, ep, &verdict);
  mk_gemm_run<Cfg>(&tmA, &tmB, a.K, sched, hook, epi, mk_smem, (int)blockIdx.x - a.n_comm,
                   (int)gridDim.x - a.n_comm);
  if (threadIdx.x < 128 || !epi.ok) return;  // the producer warpgroup is done; the consumers close the call
  moe_gemm_finish(w, ep, 128, 128 * Cfg::NC);
}
