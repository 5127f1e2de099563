// mk_attention.cuh - device pieces of the flash-attention kernels (docs/attention.md): 4-D TMA loads of
// [rows x 64] head-dim chunks, wgmma with the A operand in registers (P @ V), the fp32 accumulator ->
// A-fragment repacking, quad reductions and the fast exp2.
//
// Tiles in shared memory: a [rows x D] tile of 16-bit elements is D/64 chunks, chunk c holding head-dim
// columns 64c..64c+63 as `rows` rows of 128 bytes, 128B-swizzled (TMA, CU_TENSOR_MAP_SWIZZLE_128B), every
// chunk 1024-byte aligned.  Read as a wgmma operand:
//   * Q and K (reduction over the head dim) are K-major: mk_wgmma_desc_kmajor(chunk + 128 * row0, k16).
//   * V (reduction over the keys, N = head dim) is MN-major: the key rows are the K dimension, the chunks the
//     64-wide N blocks (LBO = chunk bytes), k16 slice kk of the keys at +2048 * kk (mk_wgmma.cuh).
#pragma once
#include "core/mk_tma.cuh"
#include "core/mk_wgmma.cuh"

// +infinity as a float (NVRTC has no math.h INFINITY).
#define MK_ATTN_INF __int_as_float(0x7f800000)

// Global -> shared 4-D tile load (coordinates innermost first), completion counted on `bar`.
MK_DEVICE void mk_attn_tma_load_4d(void* dst, const MkTensorMap* tm, mk_u64* bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(mk_smem_addr(dst)),
      "l"((mk_u64)tm), "r"(mk_smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// A [rows x D] tile (D/64 swizzled chunks of `rows` x 128 bytes) at head-dim 0, row `row0` of (head, batch).
template <int D, int ROWS>
MK_DEVICE void mk_attn_load_tile(unsigned char* dst, const MkTensorMap* tm, mk_u64* bar, int row0, int head, int batch) {
#pragma unroll
  for (int c = 0; c < D / 64; ++c) mk_attn_tma_load_4d(dst + c * ROWS * 128, tm, bar, 64 * c, row0, head, batch);
}

// acc (+)= A B^T over a head dim of D: A and B [rows x D] tiles of D/64 K-major chunks (chunk strides
// A_CHUNK, B_CHUNK bytes), N = B's rows; the first k16 step overwrites acc.  Not fenced or committed.
template <int N, int DT, int D, int A_CHUNK, int B_CHUNK>
MK_DEVICE void mk_attn_gemm_kmajor(float (&acc)[N / 2], mk_u32 a, mk_u32 b) {
#pragma unroll
  for (int c = 0; c < D / 64; ++c) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      MkWgmma<N, DT, 0>::mma(acc, mk_wgmma_desc_kmajor(a + c * A_CHUNK, kk), mk_wgmma_desc_kmajor(b + c * B_CHUNK, kk),
                             (c | kk) != 0);
  }
}

// ---- wgmma m64nNk16 with A from registers ------------------------------------------------------------
// D(64xN, fp32) += A(64x16, 4 registers of two 16-bit values per thread) * B(16xN, smem descriptor, MN-major:
// trans-b = 1).  A's fragment: thread (warp w, lane l) holds rows 16w + l/4 (+8) and columns 2(l%4) (+1)
// and 8 + 2(l%4) (+1), the same places as a m64nNk16 fp32 accumulator's columns 0..15 (mk_attn_pack_a).
#define MK_ATTN_D32                                                                                          \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define MK_ATTN_D64                                                                                          \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "  \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define MK_ATTN_F8(b)                                                                                          \
  "+f"(d[b + 0]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]), "+f"(d[b + 6]), \
      "+f"(d[b + 7])
#define MK_ATTN_F32 MK_ATTN_F8(0), MK_ATTN_F8(8), MK_ATTN_F8(16), MK_ATTN_F8(24)
#define MK_ATTN_F64 MK_ATTN_F32, MK_ATTN_F8(32), MK_ATTN_F8(40), MK_ATTN_F8(48), MK_ATTN_F8(56)
// N, TY (bf16 | f16), the accumulator list, and the operand numbers of a0..a3 and the B descriptor.
#define MK_ATTN_WGMMA_RS(N, TY, DREGS, DOPS, A0, A1, A2, A3, DB)                                              \
  MK_DEVICE void mk_attn_wgmma_rs_m64n##N##k16_##TY(float (&d)[N / 2], const mk_u32 (&a)[4], mk_u64 db) {     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                  \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TY "." #TY " " DREGS ", {" A0 ", " A1     \
                 ", " A2 ", " A3 "}, " DB ", p, 1, 1, 1;\n}\n"                                               \
                 : DOPS                                                                                        \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));                                     \
  }
MK_ATTN_WGMMA_RS(64, bf16, MK_ATTN_D32, MK_ATTN_F32, "%32", "%33", "%34", "%35", "%36")
MK_ATTN_WGMMA_RS(64, f16, MK_ATTN_D32, MK_ATTN_F32, "%32", "%33", "%34", "%35", "%36")
MK_ATTN_WGMMA_RS(128, bf16, MK_ATTN_D64, MK_ATTN_F64, "%64", "%65", "%66", "%67", "%68")
MK_ATTN_WGMMA_RS(128, f16, MK_ATTN_D64, MK_ATTN_F64, "%64", "%65", "%66", "%67", "%68")
#undef MK_ATTN_WGMMA_RS
#undef MK_ATTN_F64
#undef MK_ATTN_F32
#undef MK_ATTN_F8
#undef MK_ATTN_D64
#undef MK_ATTN_D32

// Dispatch on (N, dtype code).
template <int N, int DT> struct MkAttnWgmmaRs;
template <> struct MkAttnWgmmaRs<64, MK_DTYPE_BF16> {
  static MK_DEVICE void mma(float (&d)[32], const mk_u32 (&a)[4], mk_u64 db) { mk_attn_wgmma_rs_m64n64k16_bf16(d, a, db); }
};
template <> struct MkAttnWgmmaRs<64, MK_DTYPE_F16> {
  static MK_DEVICE void mma(float (&d)[32], const mk_u32 (&a)[4], mk_u64 db) { mk_attn_wgmma_rs_m64n64k16_f16(d, a, db); }
};
template <> struct MkAttnWgmmaRs<128, MK_DTYPE_BF16> {
  static MK_DEVICE void mma(float (&d)[64], const mk_u32 (&a)[4], mk_u64 db) { mk_attn_wgmma_rs_m64n128k16_bf16(d, a, db); }
};
template <> struct MkAttnWgmmaRs<128, MK_DTYPE_F16> {
  static MK_DEVICE void mma(float (&d)[64], const mk_u32 (&a)[4], mk_u64 db) { mk_attn_wgmma_rs_m64n128k16_f16(d, a, db); }
};

// Two fp32 values as one register of two 16-bit values (x in the low half: the lower column).
template <int DT> MK_DEVICE mk_u32 mk_attn_pack2(float x, float y);
template <> MK_DEVICE mk_u32 mk_attn_pack2<MK_DTYPE_BF16>(float x, float y) {
  __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<mk_u32*>(&v);
}
template <> MK_DEVICE mk_u32 mk_attn_pack2<MK_DTYPE_F16>(float x, float y) {
  __half2 v = __floats2half2_rn(x, y);
  return *reinterpret_cast<mk_u32*>(&v);
}

// The A fragments of a 64 x N probability tile held as a m64nNk16 fp32 accumulator `s`: k16 slice kk is
// accumulator column groups 2kk and 2kk+1, i.e. registers 8kk .. 8kk+7, in the A fragment's order.
template <int DT, int N>
MK_DEVICE void mk_attn_pack_a(const float (&s)[N / 2], mk_u32 (&p)[N / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk) {
#pragma unroll
    for (int i = 0; i < 4; ++i) p[kk][i] = mk_attn_pack2<DT>(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
  }
}

// 2^x (MUFU; -inf -> 0, flushes subnormal results to 0: the softmax's weights below 2^-126 of the row's
// largest contribute nothing measurable).
MK_DEVICE float mk_attn_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Reductions over the four lanes holding one accumulator row (lanes 4r .. 4r+3).
MK_DEVICE float mk_attn_quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
MK_DEVICE float mk_attn_quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---- wgmma m64n64k16 with both operands MN-major in shared memory ----------------------------------
// D(64x64, fp32) (+)= A(64x16) * B(16x64), A stored M-major (tnspA = 1: rows of the tile are the K index,
// 64 M elements of 128 bytes each, the V-tile layout above) and B N-major.  scale_d = 0: D = A*B.  Used by
// the backward's dQ = dS K with dS^T staged as [key][query] (docs/attention_bwd.md, "wgmma kernel").
#define MK_ATTN_WGMMA_SS_TT(TY)                                                                              \
  MK_DEVICE void mk_attn_wgmma_ss_tt_m64n64k16_##TY(float (&d)[32], mk_u64 da, mk_u64 db, int scale_d) {     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                              \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." #TY "." #TY                                   \
                 " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "    \
                 "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, 1;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
                   "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
                   "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
                   "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
                   "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                        \
                 : "l"(da), "l"(db), "r"(scale_d));                                                          \
  }
MK_ATTN_WGMMA_SS_TT(bf16)
MK_ATTN_WGMMA_SS_TT(f16)
#undef MK_ATTN_WGMMA_SS_TT

template <int DT> struct MkAttnWgmmaSsTT;
template <> struct MkAttnWgmmaSsTT<MK_DTYPE_BF16> {
  static MK_DEVICE void mma(float (&d)[32], mk_u64 da, mk_u64 db, int scale_d) {
    mk_attn_wgmma_ss_tt_m64n64k16_bf16(d, da, db, scale_d);
  }
};
template <> struct MkAttnWgmmaSsTT<MK_DTYPE_F16> {
  static MK_DEVICE void mma(float (&d)[32], mk_u64 da, mk_u64 db, int scale_d) {
    mk_attn_wgmma_ss_tt_m64n64k16_f16(d, da, db, scale_d);
  }
};
