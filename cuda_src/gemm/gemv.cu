// gemv.cu - skinny GEMM for decode-shaped calls: C[M, N] = A[M, K] @ B[N, K]^T with M <= 8 * MK_GEMV_NT
// and B "nk" (weights [N, K], K contiguous).  Memory-bound: B is read once from HBM; the math runs on
// the tensor cores (mma.sync m16n8k16) with the roles swapped -- B's rows are the MMA's 16-row "A"
// operand and A's rows its 8-column "B" operand, so C^T[n, m] comes out of the accumulators.
//
// Specialization: MK_GEMM_IN (bf16 | f16) of A and B, MK_GEMM_OUT (bf16 | f16 | f32) of C, MK_GEMV_NT
// (1: M <= 8, 2: M <= 16), MK_GEMV_UNROLL (32-element K chunks a warp has in flight), MK_GEMV_MINB
// (blocks per SM the registers are budgeted for: a second resident block keeps loads in flight while
// the first starts up or reduces).  mkernel/ops/gemm/gemv.py's VARIANTS pick the last two per NT.
//
// Launch: grid ceil(N / 16) blocks of MK_GEMV_THREADS threads, no dynamic shared memory; may be a
// programmatic dependent launch (it waits for the previous kernel before its first load and lets the
// next one launch at once).  Block b owns rows [16 b, 16 b + 16) of B (columns of C); its warps split K
// in runs of MK_GEMV_UNROLL chunks of 32 and add their partial 16 x 8 NT tiles through shared memory.
//
// Requirements (checked on the host, mkernel/ops/gemm/gemv.py): K a multiple of 8; A, B 16-byte aligned with row
// strides lda, ldb multiples of 8 elements; C any row stride ldc >= N.  Rows of A past M, rows of B past
// N and K past K (whole 8-element pieces) read as zeros.
//
// Reduction order: a lane's 8 K elements are one MMA k-slot pair (the K order inside an MMA is free:
// A and B use the same permutation -- physical k = 32 c + 8 t + e for chunk c, lane group t, element
// e -- so each lane loads 16 contiguous bytes of a row instead of four 4-byte pieces).
#include "gemm/mk_gemm_dtypes.cuh"

#ifndef MK_GEMV_NT
#define MK_GEMV_NT 1
#endif
#ifndef MK_GEMV_UNROLL
#define MK_GEMV_UNROLL 8  // 32-element K chunks a warp has in flight (2 x 16 B of B per lane each)
#endif
#ifndef MK_GEMV_MINB
#define MK_GEMV_MINB 2
#endif
#define MK_GEMV_WARPS 8
#define MK_GEMV_THREADS (32 * MK_GEMV_WARPS)

// 16 bytes of a streamed operand (read once: not kept in L1) / of a reused one (kept).  The second as
// volatile asm too, not __ldg: the intrinsic changes ptxas's load schedule from the one measured.
MK_DEVICE uint4 mk_ld_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
MK_DEVICE uint4 mk_ld_keep16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// d += a (16 x 16, row) * b (16 x 8, col), fp32 accumulators.
MK_DEVICE void mk_mma16816(float (&d)[4], mk_u32 a0, mk_u32 a1, mk_u32 a2, mk_u32 a3, mk_u32 b0, mk_u32 b1) {
#if MK_GEMM_IN == MK_DTYPE_BF16
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

extern "C" __global__ void __launch_bounds__(MK_GEMV_THREADS, MK_GEMV_MINB) mk_gemv_nk(
    const unsigned short* __restrict__ A, long long lda, const unsigned short* __restrict__ B, long long ldb,
    MkOut* __restrict__ C, long long ldc, int M, int N, int K) {
  constexpr int NT = MK_GEMV_NT, U = MK_GEMV_UNROLL, W = MK_GEMV_WARPS;
  constexpr int RUN = 32 * U, STRIDE = W * RUN;  // K elements of one run of a warp / of all the warps
  __shared__ float red[W][16][8 * NT];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;  // the MMA fragments' group (row) and thread-in-group
  const long long n0 = (long long)blockIdx.x * 16;
  // this lane's rows: B rows n0 + g and n0 + g + 8 (MMA rows), A rows g and g + 8 (MMA columns); its
  // pointers start at the warp's first run, at the lane's 8 elements of each chunk, and advance by
  // STRIDE a run (rows past M / N stay at the base and are never read)
  const bool b_lo = n0 + g < N, b_hi = n0 + g + 8 < N;
  const int k_lane = warp * RUN + 8 * t;
  const unsigned short* pb_lo = B + (b_lo ? (n0 + g) * ldb : 0) + k_lane;
  const unsigned short* pb_hi = B + (b_hi ? (n0 + g + 8) * ldb : 0) + k_lane;
  bool a_ok[NT];
  const unsigned short* pa[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    a_ok[j] = 8 * j + g < M;
    pa[j] = A + (a_ok[j] ? (long long)(8 * j + g) * lda : 0) + k_lane;
  }
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  mk_grid_dependency_wait();  // A may be the previous kernel's output (programmatic dependent launch)
  mk_grid_launch_dependents();
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  // The loop bound is the warp's (K - its run's first element), the same for all its lanes: mma.sync
  // is warp-collective, so no lane may leave the loop before the others.  A lane's chunk u of the run
  // is in range when its first element 32 u + 8 t is below that bound (K % 8 == 0: whole pieces).
  for (int k_left = K - warp * RUN; k_left > 0; k_left -= STRIDE) {
    uint4 p[U], q[U], v[U][NT];
#pragma unroll
    for (int u = 0; u < U; ++u) {  // every load of the run first: U x (2 + NT) 16-byte loads in flight
      const bool kin = 32 * u + 8 * t < k_left;
      p[u] = kin && b_lo ? mk_ld_stream16(pb_lo + 32 * u) : zero;
      q[u] = kin && b_hi ? mk_ld_stream16(pb_hi + 32 * u) : zero;
#pragma unroll
      for (int j = 0; j < NT; ++j) v[u][j] = kin && a_ok[j] ? mk_ld_keep16(pa[j] + 32 * u) : zero;
    }
    pb_lo += STRIDE;
    pb_hi += STRIDE;
#pragma unroll
    for (int j = 0; j < NT; ++j) pa[j] += STRIDE;
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        // elements 0-3 of the lane's 8 are MMA k-slots {2t, 2t+1, 2t+8, 2t+9}; elements 4-7 the same
        // slots of a second MMA
        mk_mma16816(acc[j], p[u].x, q[u].x, p[u].y, q[u].y, v[u][j].x, v[u][j].y);
        mk_mma16816(acc[j], p[u].z, q[u].z, p[u].w, q[u].w, v[u][j].z, v[u][j].w);
      }
    }
  }
  // accumulator (j, r): C^T row (n) g + 8 (r / 2), column (m) 8 j + 2 t + (r % 2)
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int r = 0; r < 4; ++r) red[warp][g + 8 * (r >> 1)][8 * j + 2 * t + (r & 1)] = acc[j][r];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 16 * 8 * NT; i += MK_GEMV_THREADS) {
    const int m = i / 16, n = i % 16;  // consecutive threads: consecutive columns of C
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) s += red[w][n][m];
    if (m < M && n0 + n < N) C[(long long)m * ldc + n0 + n] = mk_from_f32<MkOut>(s);
  }
}
