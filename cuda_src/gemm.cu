// gemm.cu - plain and grouped GEMM kernels built from the mk_gemm.cuh component, and the staging
// copy used when an operand's row stride is not TMA-compatible.
//
// Specialization (preprocessor defines, set by mkernel/gemm.py):
//   MK_GEMM_IN      input dtype code (MK_DTYPE_BF16 | MK_DTYPE_F16) of A and B
//   MK_GEMM_OUT     output dtype code (MK_DTYPE_BF16 | MK_DTYPE_F16 | MK_DTYPE_F32)
//   MK_GEMM_CONFIG  tile configuration:
//                     0  debug: BM=64  (1 consumer WG), BN=128, 2 stages, every wgmma batch waited on
//                     1  BM=64  (1 consumer WG), BN=128, 8 stages   (small M / few tiles)
//                     2  BM=128 (2 consumer WGs), BN=128, 6 stages
//                     3  BM=128 (2 consumer WGs), BN=256, 4 stages  (large problems)
//                     4  BM=128 (2 consumer WGs), BN=192, 5 stages  (wave quantization: N = 1536, ...)
//                     5  BM=128 (2 consumer WGs), BN=224, 4 stages with B "nk" (N = 7168, 57344, ...);
//                        with B "kn" (MN-major tiles need whole 64-column chunks) it is config 3's tile
//                     6  ping-pong: 2 consumer WGs on alternate 64x256 tiles, 5 stages (small K: the
//                        epilogue of one WG hides under the other's main loop)
//
// Kernels (each block: MkCfg::THREADS threads, MkCfg::SMEM_BYTES of dynamic shared memory; grid:
// any number of persistent blocks, normally the SM count):
//   mk_gemm_kn / mk_gemm_nk                  C[M, N] = A[M, K] @ B, B stored [K, N] / [N, K]
//   mk_grouped_gemm_kn / mk_grouped_gemm_nk  C[offs[g]:offs[g+1]] = A[offs[g]:offs[g+1]] @ B[g]
//   mk_pad_copy_u16 / mk_pad_copy_u32        dense zero-padded staging copy (see below)
#include "mk_gemm.cuh"

#ifndef MK_GEMM_IN
#define MK_GEMM_IN MK_DTYPE_BF16
#endif
#ifndef MK_GEMM_OUT
#define MK_GEMM_OUT MK_DTYPE_BF16
#endif
#ifndef MK_GEMM_CONFIG
#define MK_GEMM_CONFIG 3
#endif

template <int CONFIG, bool KN> struct MkCfgSel;
template <bool KN> struct MkCfgSel<0, KN> { typedef MkGemmConfig<1, 128, 2, false, MK_GEMM_IN, KN> T; };
template <bool KN> struct MkCfgSel<1, KN> { typedef MkGemmConfig<1, 128, 8, true, MK_GEMM_IN, KN> T; };
template <bool KN> struct MkCfgSel<2, KN> { typedef MkGemmConfig<2, 128, 6, true, MK_GEMM_IN, KN> T; };
template <bool KN> struct MkCfgSel<3, KN> { typedef MkGemmConfig<2, 256, 4, true, MK_GEMM_IN, KN> T; };
template <bool KN> struct MkCfgSel<4, KN> { typedef MkGemmConfig<2, 192, 5, true, MK_GEMM_IN, KN> T; };
template <bool KN> struct MkCfgSel<5, KN> { typedef MkGemmConfig<2, KN ? 256 : 224, 4, true, MK_GEMM_IN, KN> T; };
template <bool KN> struct MkCfgSel<6, KN> { typedef MkGemmConfig<2, 256, 5, true, MK_GEMM_IN, KN, true> T; };
static_assert(MkCfgSel<MK_GEMM_CONFIG, false>::T::SMEM_BYTES == MkCfgSel<MK_GEMM_CONFIG, true>::T::SMEM_BYTES &&
                  MkCfgSel<MK_GEMM_CONFIG, false>::T::THREADS == MkCfgSel<MK_GEMM_CONFIG, true>::T::THREADS,
              "one launch geometry per config (mkernel/gemm_engine.py: TileConfig.smem / threads)");

typedef typename mk_type<MK_GEMM_OUT>::T MkOut;
#define MK_THREADS (MkCfgSel<MK_GEMM_CONFIG, false>::T::THREADS)

// Passed by value; mirrored by mkernel/gemm.py:_GemmArgs (same order, natural alignment, 56 bytes).
struct MkGemmArgs {
  void* c;                    // output, row-major, row stride ldc elements
  const void* group_offsets;  // grouped: G+1 row offsets (int64, or int32 if offsets_i32)
  long long ldc;
  int M;           // rows of A and C (grouped: total rows)
  int N;           // columns of C
  int K;           // reduction length
  int num_groups;  // grouped: G
  int group_m;     // rasterization super-row height, in tiles
  int c_vec_ok;    // 1: C base aligned to two elements and ldc even
  int offsets_i32;
  int pad;
};

template <bool KN, bool GROUPED>
MK_DEVICE void mk_gemm_body(const MkTensorMap* tmA, const MkTensorMap* tmB, const MkGemmArgs& args) {
  typedef typename MkCfgSel<MK_GEMM_CONFIG, KN>::T Cfg;
  extern __shared__ unsigned char mk_smem[];
  MkEpilogueStore<MkOut> epi;
  epi.c = reinterpret_cast<MkOut*>(args.c);
  epi.ldc = args.ldc;
  epi.vec_ok = args.c_vec_ok;
  if constexpr (GROUPED) {
    MkGroupedScheduler<Cfg::BM, Cfg::BN> sched(args.group_offsets, args.offsets_i32, args.num_groups, args.N, args.group_m);
    mk_gemm_run<Cfg>(tmA, tmB, args.K, sched, MkNoWait(), epi, mk_smem, blockIdx.x, gridDim.x);
  } else {
    MkLinearScheduler<Cfg::BM, Cfg::BN> sched(args.M, args.N, args.group_m);
    mk_gemm_run<Cfg>(tmA, tmB, args.K, sched, MkNoWait(), epi, mk_smem, blockIdx.x, gridDim.x);
  }
}

extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
    mk_gemm_kn(const __grid_constant__ MkTensorMap tmA, const __grid_constant__ MkTensorMap tmB, const MkGemmArgs args) {
  mk_gemm_body<true, false>(&tmA, &tmB, args);
}
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
    mk_gemm_nk(const __grid_constant__ MkTensorMap tmA, const __grid_constant__ MkTensorMap tmB, const MkGemmArgs args) {
  mk_gemm_body<false, false>(&tmA, &tmB, args);
}
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
    mk_grouped_gemm_kn(const __grid_constant__ MkTensorMap tmA, const __grid_constant__ MkTensorMap tmB, const MkGemmArgs args) {
  mk_gemm_body<true, true>(&tmA, &tmB, args);
}
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
    mk_grouped_gemm_nk(const __grid_constant__ MkTensorMap tmA, const __grid_constant__ MkTensorMap tmB, const MkGemmArgs args) {
  mk_gemm_body<false, true>(&tmA, &tmB, args);
}

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
