// gemm.cu - plain and grouped GEMM kernels built from the mk_gemm.cuh component, and the staging
// copy used when an operand's row stride is not TMA-compatible.
//
// Specialization: MK_GEMM_IN, MK_GEMM_OUT, MK_GEMM_CONFIG and its MK_CFG_* parameters (mk_gemm_configs.cuh);
// MK_GEMM_SWAP = 1: the plain kernels compute the transposed problem and store it transposed
// (MkEpilogueStoreT, below).
//
// Kernels (each block: MkCfg::THREADS threads, MkCfg::SMEM_BYTES of dynamic shared memory; grid:
// any number of persistent blocks, normally the SM count):
//   mk_gemm_kn / mk_gemm_nk                  C[M, N] = A[M, K] @ B, B stored [K, N] / [N, K]
//   mk_grouped_gemm_kn / mk_grouped_gemm_nk  C[offs[g]:offs[g+1]] = A[offs[g]:offs[g+1]] @ B[g]
//   mk_pad_copy_u16 / mk_pad_copy_u32        dense zero-padded staging copy (see below)
#include "gemm/mk_gemm_args.cuh"
#include "gemm/mk_gemm_configs.cuh"

#ifndef MK_GEMM_SWAP
#define MK_GEMM_SWAP 0
#endif

// A plain GEMM's register store: the direct one, or transposed (MK_GEMM_SWAP).
template <bool SWAP> struct MkRegisterStore {
  typedef MkEpilogueStore<MkOut> T;
  static MK_DEVICE T make(const MkEpilogueStore<MkOut>& direct) { return direct; }
};
template <> struct MkRegisterStore<true> {
  typedef MkEpilogueStoreT<MkOut> T;
  static MK_DEVICE T make(const MkEpilogueStore<MkOut>& direct) { return T{direct.c, direct.ldc}; }
};

// tmC: {N, M} over C (used by configurations with TMA-store staging when args.c_tma).
// MK_GEMM_SWAP = 1 (plain GEMM): the host passes the transposed problem -- args.M / args.N are C's columns /
// rows, tmA maps the caller's B ([N, K]) and tmB the caller's A ([M, K], an "nk" operand) -- and every tile
// is stored transposed into the row-major C (args.c, args.ldc) from registers; tmC is unused.
template <bool KN, bool GROUPED>
MK_DEVICE void mk_gemm_body(const MkTensorMap* tmA, const MkTensorMap* tmB, const MkTensorMap* tmC,
                            const MkGemmArgs& args) {
  typedef MkCfg<KN> Cfg;
  extern __shared__ unsigned char mk_smem[];
  MkEpilogueStore<MkOut> epi;
  epi.c = reinterpret_cast<MkOut*>(args.c);
  epi.ldc = args.ldc;
  epi.vec_ok = args.c_vec_ok;
  if constexpr (GROUPED && (Cfg::SHARING > 1 || Cfg::CLUSTER_K > 1 || MK_GEMM_SWAP)) {
    __trap();  // grouped GEMMs do not run in clusters or transposed (mkernel/ops/gemm never launches this)
  } else if constexpr (GROUPED) {
    // a tile ending inside a group must not write the next group's rows: clip_rows = 0
    MkGroupedScheduler<Cfg::BM, Cfg::BN> sched(args.group_offsets, args.offsets_i32, args.num_groups, args.M, args.N,
                                                 args.group_m);
    mk_gemm_run_store<Cfg>(tmA, tmB, tmC, args.K, sched, MkNoWait(), epi, args.c_tma, 0, mk_smem, blockIdx.x, gridDim.x);
  } else if constexpr (Cfg::PINGPONG) {  // (no split-K: the ping-pong loop's ring positions assume whole tiles)
    if constexpr (MK_GEMM_SWAP) {
      __trap();  // (no swapped ping-pong plans)
    } else {
      MkLinearScheduler<Cfg::BM, Cfg::BN> sched(args.M, args.N, args.group_m);
      mk_gemm_run_store<Cfg>(tmA, tmB, tmC, args.K, sched, MkNoWait(), epi, args.c_tma, 1, mk_smem, blockIdx.x, gridDim.x);
    }
  } else {
    typedef typename MkRegisterStore<MK_GEMM_SWAP>::T RegEpi;
    const RegEpi reg = MkRegisterStore<MK_GEMM_SWAP>::make(epi);
    if constexpr (Cfg::CLUSTER_K > 1) {  // split-K inside clusters, partials added through DSMEM
      MkClusterKScheduler<Cfg::BM, Cfg::BN, Cfg::CLUSTER_K> sched(args.M, args.N, args.group_m);
      MkClusterKEpilogue<Cfg, RegEpi> ck{reg, MkGemmSmem<Cfg>(mk_smem), mk_cluster_ctarank(), 0u};
      mk_gemm_run<Cfg>(tmA, tmB, args.K, sched, MkNoWait(), ck, mk_smem, blockIdx.x, gridDim.x);
    } else {
      typedef typename MkPick<Cfg::SHARING == 1, MkLinearScheduler<Cfg::BM, Cfg::BN>,
                              MkClusterTileScheduler<Cfg::BM, Cfg::BN, Cfg::CLUSTER_M, Cfg::CLUSTER_N>>::T Sched;
      Sched sched(args.M, args.N, args.group_m, args.splits, args.split_from);
      auto run_split = [&](auto& inner) {
        auto sk = mk_split_k_epilogue<Cfg::NC>(inner, args.partials, args.counters);
        return mk_gemm_run<Cfg>(tmA, tmB, args.K, sched, MkNoWait(), sk, mk_smem, blockIdx.x, gridDim.x);
      };
      if constexpr (MK_GEMM_SWAP) {
        run_split(reg);  // (no TMA store of a transposed tile)
      } else {
        mk_with_store_epilogue<Cfg>(epi, tmC, args.c_tma, 1, mk_smem, run_split);
      }
    }
  }
}

#define MK_GEMM_ENTRY(NAME, KN, GROUPED)                                                                           \
  extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)                                                      \
      NAME(const __grid_constant__ MkTensorMap tmA, const __grid_constant__ MkTensorMap tmB,                     \
           const __grid_constant__ MkTensorMap tmC, const MkGemmArgs args) {                                     \
    mk_gemm_body<KN, GROUPED>(&tmA, &tmB, &tmC, args);                                                          \
  }
MK_GEMM_ENTRY(mk_gemm_kn, true, false)
MK_GEMM_ENTRY(mk_gemm_nk, false, false)
MK_GEMM_ENTRY(mk_grouped_gemm_kn, true, true)
MK_GEMM_ENTRY(mk_grouped_gemm_nk, false, true)

// dst[(b*rows + r)*dst_ld + c] = c < cols ? src[b*sb + r*sr + c*sc] : 0 for c < cols_p; src == nullptr
// writes zeros.  Strides in elements.  Used to stage an operand whose row stride or base address is
// not 16-byte aligned (TMA needs both) as a dense zero-padded copy, and to zero C when K == 0.
template <typename T>
MK_DEVICE void mk_pad_copy(T* __restrict__ dst, const T* __restrict__ src, long long batch, long long rows, long long cols,
                           long long cols_p, long long dst_ld, long long sb, long long sr, long long sc) {
  const long long total = batch * rows * cols_p;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const long long c = i % cols_p;
    const long long rest = i / cols_p;
    const long long r = rest % rows;
    const long long b = rest / rows;
    dst[rest * dst_ld + c] = (src != nullptr && c < cols) ? src[b * sb + r * sr + c * sc] : (T)0;
  }
}
extern "C" __global__ void mk_pad_copy_u16(unsigned short* dst, const unsigned short* src, long long batch, long long rows,
                                           long long cols, long long cols_p, long long dst_ld, long long sb, long long sr,
                                           long long sc) {
  mk_pad_copy(dst, src, batch, rows, cols, cols_p, dst_ld, sb, sr, sc);
}
extern "C" __global__ void mk_pad_copy_u32(unsigned int* dst, const unsigned int* src, long long batch, long long rows,
                                           long long cols, long long cols_p, long long dst_ld, long long sb, long long sr,
                                           long long sc) {
  mk_pad_copy(dst, src, batch, rows, cols, cols_p, dst_ld, sb, sr, sc);
}
