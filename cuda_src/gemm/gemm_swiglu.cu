// gemm_swiglu.cu - the grouped gate/up GEMM with SwiGLU in its epilogue (mk_gemm_swiglu.cuh; docs/moe.md,
// "SwiGLU epilogue").  Host side: mkernel/ops/gemm/swiglu.py.
//
//   mk_grouped_gemm_swiglu   act[offs[g]:offs[g+1]] = swiglu(A[offs[g]:offs[g+1]] @ W[g]^T)
//     W [G, 2F, K] (gate rows, then up rows), act [rows, F]; args.N = 2F (the scheduler's columns), args.ldc
//     and tmC ({F, M}, as gemm.cu's C map) describe act; tmB is the paired 5-D view of W.
// Specialization: MK_GEMM_IN = MK_GEMM_OUT, MK_GEMM_CONFIG and its MK_CFG_* (mk_gemm_configs.cuh); grid and
// block as gemm.cu's grouped kernels.
#include "gemm/mk_gemm_args.cuh"
#include "gemm/mk_gemm_configs.cuh"
#include "gemm/mk_gemm_swiglu.cuh"

extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
    mk_grouped_gemm_swiglu(const __grid_constant__ MkTensorMap tmA, const __grid_constant__ MkTensorMap tmB,
                           const __grid_constant__ MkTensorMap tmC, const MkGemmArgs args) {
  typedef MkGateUpB<MkCfg<false>> Cfg;
  static_assert(Cfg::SHARING == 1 && Cfg::CLUSTER_K == 1, "grouped GEMMs run unclustered");
  extern __shared__ unsigned char mk_smem[];
  MkEpilogueStore<MkOut> direct;
  direct.c = reinterpret_cast<MkOut*>(args.c);
  direct.ldc = args.ldc;
  direct.vec_ok = args.c_vec_ok;
  MkGroupedScheduler<Cfg::BM, Cfg::BN> sched(args.group_offsets, args.offsets_i32, args.num_groups, args.M, args.N,
                                              args.group_m);
  // a tile ending inside a group must not write the next group's rows: clip_rows = 0
  mk_with_store_epilogue<Cfg>(direct, &tmC, args.c_tma, 0, mk_smem, [&](auto& store) {
    auto epi = mk_swiglu_epilogue(store);
    return mk_gemm_run<Cfg>(&tmA, &tmB, args.K, sched, MkNoWait(), epi, mk_smem, blockIdx.x, gridDim.x);
  });
}
