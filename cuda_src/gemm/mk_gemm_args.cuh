// mk_gemm_args.cuh - the launch arguments of the GEMM kernels (gemm.cu, gemm_swiglu.cu).
#pragma once

// Passed by value; mirrored by mkernel/ops/gemm/plan.py:GemmArgs (same order, natural alignment, 80 bytes).
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
  int c_tma;       // 1: tmC is a map over C (16-byte aligned base and row stride); configs with staging store through it
  float* partials;  // split-K (plain GEMM, splits > 1): fp32 running sums [split tiles][BM * BN], zero between calls
  int* counters;    // split-K: [split tiles], zero before the first call (the kernel leaves them zero)
  int splits;       // plain GEMM: K splits per split tile (1: none; cooperative configs only)
  int split_from;   // split-K: tiles (rasterized order) before this one are not split
};
