// mk_wgmma.cuh - Hopper warpgroup MMA (wgmma.mma_async) primitives: shared-memory matrix
// descriptors for 128-byte-swizzled tiles, fences, and m64nNk16 bf16/fp16 -> fp32 MMAs
// (N = 48, 64, 96, 128, 144, 192, 224, 256).
//
// Shared-memory tiles (written by TMA with CU_TENSOR_MAP_SWIZZLE_128B, every tile 1024-byte aligned):
//
//   K-major ("no transpose": A always, B when stored [N, K]): the tile is R rows of 64 16-bit
//   elements, row r at byte 128*r, its eight 16-byte chunks XOR-permuted by (r % 8).  Eight rows form
//   a 1024-byte swizzle atom.  Descriptor: SBO = 1024 (stride between 8-row groups along M/N),
//   LBO = 16 (unused for swizzled K-major layouts, 1 by convention), mode = 128B.  The k-th
//   16-element slice of K (one wgmma k16 step) starts 32*k bytes into the tile; the hardware applies
//   the swizzle to the final address bits, so stepping the start address by 32 bytes is exact.
//
//   MN-major ("transpose", B when stored [K, N]): the tile is BN/64 column chunks; chunk j holds
//   N-columns 64j..64j+63 as 64 K-rows of 128 bytes (row k at 128*k, swizzled by k % 8), so a chunk
//   is 8 KiB.  Descriptor (CUTLASS canonical ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO))): LBO = stride
//   between 64-wide N chunks (8192 bytes), SBO = stride between 8-row groups along K (1024 bytes),
//   mode = 128B.  The k-th k16 slice starts 16*128 = 2048*k bytes into each chunk.
//
// Descriptor bits: [0,14) start address >> 4, [16,30) LBO >> 4, [32,46) SBO >> 4, [49,52) base
// offset (0: every atom is 1024-aligned), [62,64) swizzle mode (1 = 128B, 2 = 64B, 3 = 32B).
//
// Accumulator fragment of m64nNk16 (fp32, N/2 registers per thread): thread t of the warpgroup,
// warp w = t / 32, lane l = t % 32, register i holds
//   row = 16*w + l/4 + 8*((i/2) % 2),   col = 8*(i/4) + 2*(l%4) + (i%2).
// i.e. registers 4j, 4j+1 are columns (8j + 2(l%4), +1) of row 16w + l/4, and 4j+2, 4j+3 the same
// columns of row 16w + l/4 + 8.
//
// Ordering rules followed by the GEMM: registers written by ordinary instructions are made visible to
// wgmma by `mk_wgmma_fence()` (wgmma.fence) before the first wgmma of a batch; the batch is closed by
// `mk_wgmma_commit()`, and its accumulators (and its smem operands) may be reused only after
// `mk_wgmma_wait<N>()` leaves at most N batches outstanding.  Shared memory written by TMA is made
// visible by the mbarrier completing its transaction count (no extra fence); shared memory written
// by ordinary stores needs `mk_fence_proxy_async_smem()` before a wgmma reads it.
#pragma once
#include "core/mk_common.cuh"

MK_DEVICE mk_u64 mk_wgmma_desc_encode(mk_u32 x) { return (mk_u64)((x & 0x3FFFFu) >> 4); }

// 128B-swizzled operand descriptor; `smem_addr` is a shared-state-space address (mk_smem_addr).
MK_DEVICE mk_u64 mk_wgmma_desc_sw128(mk_u32 smem_addr, mk_u32 lbo_bytes, mk_u32 sbo_bytes) {
  return mk_wgmma_desc_encode(smem_addr) | (mk_wgmma_desc_encode(lbo_bytes) << 16) |
         (mk_wgmma_desc_encode(sbo_bytes) << 32) | (1ull << 62);
}
// K-major tile (rows of 64 elements), k16 slice `k` of the 64-wide K block.
MK_DEVICE mk_u64 mk_wgmma_desc_kmajor(mk_u32 tile_addr, int k) {
  return mk_wgmma_desc_sw128(tile_addr + 32u * (mk_u32)k, 16u, 1024u);
}
// MN-major tile of 64-K-row chunks (chunk stride `chunk_bytes` = 64 rows * 128 B), k16 slice `k`.
MK_DEVICE mk_u64 mk_wgmma_desc_mnmajor(mk_u32 tile_addr, int k, mk_u32 chunk_bytes) {
  return mk_wgmma_desc_sw128(tile_addr + 2048u * (mk_u32)k, chunk_bytes, 1024u);
}
// Stepping a descriptor by one k16 slice is an add to its start-address field (address >> 4): 32 bytes
// for a K-major tile, 2048 for an MN-major one.  (Exact while the address stays inside shared memory,
// < 2^18 bytes: the field never carries into LBO.)
constexpr mk_u64 MK_WGMMA_K16_STEP_KMAJOR = 32 >> 4;
constexpr mk_u64 MK_WGMMA_K16_STEP_MNMAJOR = 2048 >> 4;

MK_DEVICE void mk_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
MK_DEVICE void mk_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> MK_DEVICE void mk_wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// Keep the compiler from moving accumulator reads/writes across wgmma boundaries.
template <int R> MK_DEVICE void mk_wgmma_fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// ---- m64nNk16 MMAs: D(64xN, fp32) (+)= A(64x16, smem desc) * B(16xN, smem desc) ----------------
// TB = 1: B is MN-major (transposed); scale_d = 0: D = A*B (accumulators ignored).
// One wrapper per N and input type, from MK_WGMMA_DEF: the N/2 accumulators are operands %0 ..
// %(N/2 - 1) ("+f", 16 at a time), then the A and B descriptors, scale_d and TB.
#define MK_WGMMA_R0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define MK_WGMMA_R1 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MK_WGMMA_R2 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define MK_WGMMA_R3 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define MK_WGMMA_R4 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define MK_WGMMA_R5 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define MK_WGMMA_R6 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111"
#define MK_WGMMA_R7 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
// (accumulators OFF + b ..: a wrapper's template parameter, so two narrower wgmmas can fill one wider fragment)
#define MK_WGMMA_ACC16(b)                                                                     \
  "+f"(d[OFF + b + 0]), "+f"(d[OFF + b + 1]), "+f"(d[OFF + b + 2]), "+f"(d[OFF + b + 3]), \
  "+f"(d[OFF + b + 4]), "+f"(d[OFF + b + 5]), "+f"(d[OFF + b + 6]), "+f"(d[OFF + b + 7]), \
  "+f"(d[OFF + b + 8]), "+f"(d[OFF + b + 9]), "+f"(d[OFF + b + 10]), "+f"(d[OFF + b + 11]), \
  "+f"(d[OFF + b + 12]), "+f"(d[OFF + b + 13]), "+f"(d[OFF + b + 14]), "+f"(d[OFF + b + 15])
#define MK_WGMMA_REGS_64 MK_WGMMA_R0 "," MK_WGMMA_R1
#define MK_WGMMA_ACC_64 MK_WGMMA_ACC16(0), MK_WGMMA_ACC16(16)
#define MK_WGMMA_R4H "%64, %65, %66, %67, %68, %69, %70, %71"
#define MK_WGMMA_ACC8(b)                                                                      \
  "+f"(d[OFF + b + 0]), "+f"(d[OFF + b + 1]), "+f"(d[OFF + b + 2]), "+f"(d[OFF + b + 3]), \
  "+f"(d[OFF + b + 4]), "+f"(d[OFF + b + 5]), "+f"(d[OFF + b + 6]), "+f"(d[OFF + b + 7])
#define MK_WGMMA_R1H "%16, %17, %18, %19, %20, %21, %22, %23"
#define MK_WGMMA_R0H "%0, %1, %2, %3, %4, %5, %6, %7"
#define MK_WGMMA_REGS_16 MK_WGMMA_R0H
#define MK_WGMMA_ACC_16 MK_WGMMA_ACC8(0)
#define MK_WGMMA_REGS_32 MK_WGMMA_R0
#define MK_WGMMA_ACC_32 MK_WGMMA_ACC16(0)
#define MK_WGMMA_REGS_48 MK_WGMMA_R0 "," MK_WGMMA_R1H
#define MK_WGMMA_ACC_48 MK_WGMMA_ACC16(0), MK_WGMMA_ACC8(16)
#define MK_WGMMA_REGS_144 MK_WGMMA_R0 "," MK_WGMMA_R1 "," MK_WGMMA_R2 "," MK_WGMMA_R3 "," MK_WGMMA_R4H
#define MK_WGMMA_ACC_144 MK_WGMMA_ACC16(0), MK_WGMMA_ACC16(16), MK_WGMMA_ACC16(32), MK_WGMMA_ACC16(48), MK_WGMMA_ACC8(64)
#define MK_WGMMA_REGS_160 MK_WGMMA_R0 "," MK_WGMMA_R1 "," MK_WGMMA_R2 "," MK_WGMMA_R3 "," MK_WGMMA_R4
#define MK_WGMMA_ACC_160 MK_WGMMA_ACC16(0), MK_WGMMA_ACC16(16), MK_WGMMA_ACC16(32), MK_WGMMA_ACC16(48), MK_WGMMA_ACC16(64)
#define MK_WGMMA_REGS_96 MK_WGMMA_R0 "," MK_WGMMA_R1 "," MK_WGMMA_R2
#define MK_WGMMA_ACC_96 MK_WGMMA_ACC16(0), MK_WGMMA_ACC16(16), MK_WGMMA_ACC16(32)
#define MK_WGMMA_REGS_128 MK_WGMMA_R0 "," MK_WGMMA_R1 "," MK_WGMMA_R2 "," MK_WGMMA_R3
#define MK_WGMMA_ACC_128 MK_WGMMA_ACC16(0), MK_WGMMA_ACC16(16), MK_WGMMA_ACC16(32), MK_WGMMA_ACC16(48)
#define MK_WGMMA_REGS_192 MK_WGMMA_R0 "," MK_WGMMA_R1 "," MK_WGMMA_R2 "," MK_WGMMA_R3 "," MK_WGMMA_R4 "," MK_WGMMA_R5
#define MK_WGMMA_ACC_192 MK_WGMMA_ACC16(0), MK_WGMMA_ACC16(16), MK_WGMMA_ACC16(32), MK_WGMMA_ACC16(48), MK_WGMMA_ACC16(64), MK_WGMMA_ACC16(80)
#define MK_WGMMA_REGS_224 MK_WGMMA_R0 "," MK_WGMMA_R1 "," MK_WGMMA_R2 "," MK_WGMMA_R3 "," MK_WGMMA_R4 "," MK_WGMMA_R5 "," MK_WGMMA_R6
#define MK_WGMMA_ACC_224 MK_WGMMA_ACC16(0), MK_WGMMA_ACC16(16), MK_WGMMA_ACC16(32), MK_WGMMA_ACC16(48), MK_WGMMA_ACC16(64), MK_WGMMA_ACC16(80), MK_WGMMA_ACC16(96)
#define MK_WGMMA_REGS_256 MK_WGMMA_R0 "," MK_WGMMA_R1 "," MK_WGMMA_R2 "," MK_WGMMA_R3 "," MK_WGMMA_R4 "," MK_WGMMA_R5 "," MK_WGMMA_R6 "," MK_WGMMA_R7
#define MK_WGMMA_ACC_256 MK_WGMMA_ACC16(0), MK_WGMMA_ACC16(16), MK_WGMMA_ACC16(32), MK_WGMMA_ACC16(48), MK_WGMMA_ACC16(64), MK_WGMMA_ACC16(80), MK_WGMMA_ACC16(96), MK_WGMMA_ACC16(112)
// N, TY (bf16 | f16), R = N / 2 (the descriptors are %R and %R+1, scale_d %R+2, TB %R+3).  The N/2
// accumulators are d[OFF ..] of a fragment of R registers (OFF = 0, R = N/2: the whole fragment).
#define MK_WGMMA_DEF(N, TY, DA, DB, SCALE, TBI)                                                                 \
  template <int TB, int OFF = 0, int R>                                                                        \
  MK_DEVICE void mk_wgmma_m64n##N##k16_##TY(float (&d)[R], mk_u64 da, mk_u64 db, int scale_d) {                \
    static_assert(OFF >= 0 && OFF + N / 2 <= R, "accumulator range");                                          \
    asm volatile("{\n.reg .pred p;\n"                                                                          \
                 "setp.ne.b32 p, " SCALE ", 0;\n"                                                               \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TY "." #TY " "                                \
                 "{" MK_WGMMA_REGS_##N "}, " DA ", " DB ", p, 1, 1, 0, " TBI ";\n}\n"                              \
                 : MK_WGMMA_ACC_##N                                                                             \
                 : "l"(da), "l"(db), "r"(scale_d), "n"(TB));                                                    \
  }
MK_WGMMA_DEF(16, bf16, "%8", "%9", "%10", "%11")
MK_WGMMA_DEF(16, f16, "%8", "%9", "%10", "%11")
MK_WGMMA_DEF(32, bf16, "%16", "%17", "%18", "%19")
MK_WGMMA_DEF(32, f16, "%16", "%17", "%18", "%19")
MK_WGMMA_DEF(48, bf16, "%24", "%25", "%26", "%27")
MK_WGMMA_DEF(48, f16, "%24", "%25", "%26", "%27")
MK_WGMMA_DEF(64, bf16, "%32", "%33", "%34", "%35")
MK_WGMMA_DEF(64, f16, "%32", "%33", "%34", "%35")
MK_WGMMA_DEF(96, bf16, "%48", "%49", "%50", "%51")
MK_WGMMA_DEF(96, f16, "%48", "%49", "%50", "%51")
MK_WGMMA_DEF(128, bf16, "%64", "%65", "%66", "%67")
MK_WGMMA_DEF(128, f16, "%64", "%65", "%66", "%67")
MK_WGMMA_DEF(144, bf16, "%72", "%73", "%74", "%75")
MK_WGMMA_DEF(144, f16, "%72", "%73", "%74", "%75")
MK_WGMMA_DEF(160, bf16, "%80", "%81", "%82", "%83")
MK_WGMMA_DEF(160, f16, "%80", "%81", "%82", "%83")
MK_WGMMA_DEF(192, bf16, "%96", "%97", "%98", "%99")
MK_WGMMA_DEF(192, f16, "%96", "%97", "%98", "%99")
MK_WGMMA_DEF(224, bf16, "%112", "%113", "%114", "%115")
MK_WGMMA_DEF(224, f16, "%112", "%113", "%114", "%115")
MK_WGMMA_DEF(256, bf16, "%128", "%129", "%130", "%131")
MK_WGMMA_DEF(256, f16, "%128", "%129", "%130", "%131")
#undef MK_WGMMA_DEF
#undef MK_WGMMA_REGS_160
#undef MK_WGMMA_ACC_160
#undef MK_WGMMA_ACC16
#undef MK_WGMMA_ACC8
#undef MK_WGMMA_R1H
#undef MK_WGMMA_R4H
#undef MK_WGMMA_R0H
#undef MK_WGMMA_REGS_16
#undef MK_WGMMA_ACC_16
#undef MK_WGMMA_REGS_32
#undef MK_WGMMA_ACC_32
#undef MK_WGMMA_REGS_48
#undef MK_WGMMA_ACC_48
#undef MK_WGMMA_REGS_144
#undef MK_WGMMA_ACC_144
#undef MK_WGMMA_R0
#undef MK_WGMMA_R1
#undef MK_WGMMA_R2
#undef MK_WGMMA_R3
#undef MK_WGMMA_R4
#undef MK_WGMMA_R5
#undef MK_WGMMA_R6
#undef MK_WGMMA_R7
#undef MK_WGMMA_REGS_64
#undef MK_WGMMA_REGS_96
#undef MK_WGMMA_ACC_96
#undef MK_WGMMA_REGS_128
#undef MK_WGMMA_REGS_192
#undef MK_WGMMA_REGS_224
#undef MK_WGMMA_REGS_256
#undef MK_WGMMA_ACC_64
#undef MK_WGMMA_ACC_128
#undef MK_WGMMA_ACC_192
#undef MK_WGMMA_ACC_224
#undef MK_WGMMA_ACC_256

// Dispatch on (N, input dtype code).
template <int N, int DT, int TB> struct MkWgmma;
#define MK_WGMMA_DISPATCH(N_, DT_, NAME_)                                                                   \
  template <int TB> struct MkWgmma<N_, DT_, TB> {                                                          \
    static MK_DEVICE void mma(float (&d)[N_ / 2], mk_u64 da, mk_u64 db, int scale_d) {                    \
      NAME_<TB>(d, da, db, scale_d);                                                                       \
    }                                                                                                      \
  };
MK_WGMMA_DISPATCH(16, MK_DTYPE_BF16, mk_wgmma_m64n16k16_bf16)
MK_WGMMA_DISPATCH(16, MK_DTYPE_F16, mk_wgmma_m64n16k16_f16)
MK_WGMMA_DISPATCH(32, MK_DTYPE_BF16, mk_wgmma_m64n32k16_bf16)
MK_WGMMA_DISPATCH(32, MK_DTYPE_F16, mk_wgmma_m64n32k16_f16)
MK_WGMMA_DISPATCH(48, MK_DTYPE_BF16, mk_wgmma_m64n48k16_bf16)
MK_WGMMA_DISPATCH(48, MK_DTYPE_F16, mk_wgmma_m64n48k16_f16)
MK_WGMMA_DISPATCH(64, MK_DTYPE_BF16, mk_wgmma_m64n64k16_bf16)
MK_WGMMA_DISPATCH(96, MK_DTYPE_BF16, mk_wgmma_m64n96k16_bf16)
MK_WGMMA_DISPATCH(96, MK_DTYPE_F16, mk_wgmma_m64n96k16_f16)
MK_WGMMA_DISPATCH(128, MK_DTYPE_BF16, mk_wgmma_m64n128k16_bf16)
MK_WGMMA_DISPATCH(256, MK_DTYPE_BF16, mk_wgmma_m64n256k16_bf16)
MK_WGMMA_DISPATCH(64, MK_DTYPE_F16, mk_wgmma_m64n64k16_f16)
MK_WGMMA_DISPATCH(128, MK_DTYPE_F16, mk_wgmma_m64n128k16_f16)
MK_WGMMA_DISPATCH(256, MK_DTYPE_F16, mk_wgmma_m64n256k16_f16)
MK_WGMMA_DISPATCH(144, MK_DTYPE_BF16, mk_wgmma_m64n144k16_bf16)
MK_WGMMA_DISPATCH(144, MK_DTYPE_F16, mk_wgmma_m64n144k16_f16)
MK_WGMMA_DISPATCH(192, MK_DTYPE_BF16, mk_wgmma_m64n192k16_bf16)
MK_WGMMA_DISPATCH(224, MK_DTYPE_BF16, mk_wgmma_m64n224k16_bf16)
MK_WGMMA_DISPATCH(192, MK_DTYPE_F16, mk_wgmma_m64n192k16_f16)
MK_WGMMA_DISPATCH(224, MK_DTYPE_F16, mk_wgmma_m64n224k16_f16)
#undef MK_WGMMA_DISPATCH
// N = 320 (K-major B only): two m64n160k16 on B rows 0..159 and 160..319 (160 rows of 128 bytes = 20 KiB
// further, a whole number of 1024-byte swizzle atoms); their fragments side by side are the n320 layout
// (element pair j at column 8j + c0).
#define MK_WGMMA_DISPATCH_320(DT_, TY)                                                                     \
  template <> struct MkWgmma<320, DT_, 0> {                                                                \
    static MK_DEVICE void mma(float (&d)[160], mk_u64 da, mk_u64 db, int scale_d) {                        \
      mk_wgmma_m64n160k16_##TY<0, 0>(d, da, db, scale_d);                                                  \
      mk_wgmma_m64n160k16_##TY<0, 80>(d, da, db + (160 * 128 >> 4), scale_d);                               \
    }                                                                                                      \
  };
MK_WGMMA_DISPATCH_320(MK_DTYPE_BF16, bf16)
MK_WGMMA_DISPATCH_320(MK_DTYPE_F16, f16)
#undef MK_WGMMA_DISPATCH_320

// Visit this thread's part of a 64xN fp32 accumulator fragment: f(row, col, v_col, v_col+1) with
// row in [0, 64), col even in [0, N), relative to the warpgroup's 64-row slab.
// This thread's first fragment element (row r0, column c0) in its warpgroup's 64-row slab: element pair
// j of the fragment sits at (r0, 8j + c0) and (r0 + 8, 8j + c0), columns c and c+1 each.
MK_DEVICE void mk_wgmma_frag_origin(int& r0, int& c0) {
  const int t = threadIdx.x & 127;
  r0 = 16 * (t >> 5) + ((t & 31) >> 2);
  c0 = 2 * (t & 3);
}
// J0 > 0: only column groups J0 .. N/8 - 1 (tile columns 8*J0 and up).
template <int N, int J0 = 0, class F> MK_DEVICE void mk_wgmma_frag_for_each(const float (&d)[N / 2], F&& f) {
  int r0, c0;
  mk_wgmma_frag_origin(r0, c0);
#pragma unroll
  for (int j = J0; j < N / 8; ++j) {
    f(r0, 8 * j + c0, d[4 * j], d[4 * j + 1]);
    f(r0 + 8, 8 * j + c0, d[4 * j + 2], d[4 * j + 3]);
  }
}
