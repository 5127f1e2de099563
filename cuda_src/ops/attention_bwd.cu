// attention_bwd.cu - flash-attention backward (docs/attention_bwd.md): dQ, dK, dV of
// O = softmax(scale * Q K^T + mask) V from Q, K, V, O, dO and the forward's LSE, never materializing the
// S_q x S_k probabilities.  Tensor cores through mma.sync m16n8k16 (bf16/fp16 in, fp32 accumulate),
// shared-memory tiles loaded with cp.async into padded rows (row stride D + 8 elements: the 8 row
// addresses of every ldmatrix fall in distinct bank groups).
//
// Kernels (one specialization per dtype and head dim; MKATT_* defines):
//  * mk_attn_bwd_pre: Dsum[b, h, i] = sum_d dO * O (fp32), and zeroes the fp32 dQ accumulator rows.
//  * mk_attn_bwd_main: one block per (KV block of BC rows, KV head, batch); warp w owns KV rows
//    [16 w, 16 w + 16) of the block and keeps their dK, dV in registers over every query head of the KV
//    group and every query block of BR rows: S^T = K Q^T, P^T = exp(scale S^T - lse), dP^T = V dO^T,
//    dS^T = P^T (dP^T - Dsum), dV += P^T dO, dK += dS^T Q; then (unless deterministic) dS goes through
//    shared memory and the block adds dQ += dS K into the fp32 accumulator (red.global.add.v2.f32).
//  * mk_attn_bwd_dq (deterministic mode): one block per (query block, query head, batch) recomputes S and
//    dP and sums dQ = scale dS K over the KV blocks in order, in registers: no atomics, bit-identical runs.
//  * mk_attn_bwd_convert: dq = scale * accumulator, in q's dtype and layout.
//  * mk_attn_bwd_wgmma (MKATT_WGMMA=1, a specialization of its own holding only this kernel): the main
//    kernel on Hopper's TMA + wgmma path (docs/attention_bwd.md, "wgmma kernel"); pre, convert and the
//    deterministic dQ kernel come from the MKATT_WGMMA=0 specialization.
//  * MKATT_PARTIAL=1 (ring attention's backward, docs/ring_attention.md "Backward"; a specialization
//    holding mk_attn_bwd_main and mk_attn_bwd_part_sum only): the main kernel writes scale * dK and dV as
//    fp32 partials to part_k / part_v ([S_k, B, H_kv, D], seq-major so a prefix of rows is a prefix of
//    memory) instead of the dtype, and reads Dsum / adds dQ at row pitch acc_pitch (a launch covers a
//    window of the accumulator's rows); mk_attn_bwd_part_sum sums P such partials in a fixed order.
//    With MKATT_WGMMA=1 too: mk_attn_bwd_wgmma only, with the same partial epilogue and pitch (the ring's
//    main kernel where TMA can read its operands).
// Softmax scale: P uses exp2(scale log2(e) S - log2(e) lse); the scale of dS is applied once, to dK at
// the end and to dQ at the conversion.  Masking: key j >= S_k, and (causal) j > i + S_k - S_q; rows of a
// fully masked query (lse = -inf) and rows past S_q read lse as +inf, so their P is 0.
#include "core/mk_common.cuh"

#ifndef MKATT_DTYPE
#define MKATT_DTYPE MK_DTYPE_BF16
#endif
#ifndef MKATT_D
#define MKATT_D 64
#endif
#ifndef MKATT_WARPS  // main kernel: warps per block; BC = 16 * warps KV rows
#define MKATT_WARPS 8
#endif
#ifndef MKATT_BR  // main kernel: query rows per step
#define MKATT_BR 64
#endif
#ifndef MKATT_DQ_WARPS  // dq kernel: warps per block; 16 * warps query rows
#define MKATT_DQ_WARPS 4
#endif
#ifndef MKATT_DQ_BK  // dq kernel: KV rows per step
#define MKATT_DQ_BK 64
#endif
#ifndef MKATT_WGMMA  // 1: this specialization holds mk_attn_bwd_wgmma only
#define MKATT_WGMMA 0
#endif
#ifndef MKATT_PARTIAL  // 1: mk_attn_bwd_main writes fp32 dK / dV partials; plus mk_attn_bwd_part_sum
#define MKATT_PARTIAL 0
#endif

typedef mk_type<MKATT_DTYPE>::T mkatt_t;
#define MKATT_INF __int_as_float(0x7f800000)

#define D_ MKATT_D
#define LD_ (MKATT_D + 8)
#define BC_ (16 * MKATT_WARPS)
#define BR_ MKATT_BR
#define NT_ (32 * MKATT_WARPS)
#define BQ_ (16 * MKATT_DQ_WARPS)
#define BK_ MKATT_DQ_BK
#define NTQ_ (32 * MKATT_DQ_WARPS)

static_assert(D_ == 64 || D_ == 128, "head dim 64 or 128");
static_assert(BR_ % 16 == 0 && BK_ % 16 == 0, "tiles of 16 rows");
static_assert(MKATT_WARPS % (BR_ / 16) == 0, "dQ tiles: the warps cover BR / 16 row tiles");
static_assert((D_ / (MKATT_WARPS / (BR_ / 16))) % 16 == 0, "dQ tiles: whole 16-column pairs per warp");

// Element strides (the head dim is contiguous) and pointers; mkernel/ops/attention_bwd/op.py's BwdArgs.
struct MkAttnBwdArgs {
  const mkatt_t* q;
  const mkatt_t* k;
  const mkatt_t* v;
  const mkatt_t* o;
  const mkatt_t* dout;
  const float* lse;
  mkatt_t* dq;
  mkatt_t* dk;
  mkatt_t* dv;
  float* dq_acc;  // [B, Hq, Sq, D] fp32 (unused in deterministic mode)
  float* dsum;    // [B, Hq, Sq] fp32
  mk_i64 q_s[3], k_s[3], v_s[3], o_s[3], do_s[3], dq_s[3], dk_s[3], dv_s[3];  // (batch, seq, head)
  mk_i64 lse_s[3];                                                             // (batch, head, seq)
  int B, Hq, Hkv, Sq, Sk;
  int causal;
  float scale;        // softmax scale
  float scale_log2;   // scale * log2(e)
  float* part_k;      // MKATT_PARTIAL: fp32 scale * dK partial [S_k, B, H_kv, D] (else unused)
  float* part_v;      // MKATT_PARTIAL: fp32 dV partial, same layout
  int acc_pitch;      // MKATT_PARTIAL: rows per (b, h) of dsum and dq_acc (else S_q is)
  int pad_;
};
static_assert(sizeof(MkAttnBwdArgs) == 360, "MkAttnBwdArgs must match BwdArgs (op.py)");

// ---- small device helpers ---------------------------------------------------------------------

MK_DEVICE mk_u32 mkatt_smem(const void* p) { return (mk_u32)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared; reads zeros where !valid (src-size 0).
MK_DEVICE void mkatt_cp16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(mkatt_smem(dst)), "l"(src),
               "r"(valid ? 16 : 0) : "memory");
}
MK_DEVICE void mkatt_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> MK_DEVICE void mkatt_cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Double buffering: the current stage's cp.async group has landed and is visible to the block; when the
// next stage's loads were just issued (`prefetched`), they are committed and left in flight.
MK_DEVICE void mkatt_stage_ready(bool prefetched) {
  if (prefetched) {
    mkatt_cp_commit();
    mkatt_cp_wait<1>();
  } else {
    mkatt_cp_wait<0>();
  }
  __syncthreads();
}

MK_DEVICE void mkatt_ldsm4(mk_u32 (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(mkatt_smem(p)));
}
MK_DEVICE void mkatt_ldsm4t(mk_u32 (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(mkatt_smem(p)));
}

// ldmatrix x4 lane addresses over a 16 x 16 block at (r0, c0) of a row-major tile with row stride LD_
// (or ld).  "X" order -- matrices (r0, c0), (r0 + 8, c0), (r0, c0 + 8), (r0 + 8, c0 + 8) -- gives an A
// fragment of a row-major [m][k] tile, or (with .trans) the B fragments of two n-tiles of a [k][n] tile.
// "Y" order -- (r0, c0), (r0, c0 + 8), (r0 + 8, c0), (r0 + 8, c0 + 8) -- gives the B fragments of two
// n-tiles of an [n][k] tile, or (with .trans) an A fragment of a [k][m] tile.
MK_DEVICE const mkatt_t* mkatt_at_x(const mkatt_t* t, int ld, int r0, int c0, int lane) {
  return t + (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + c0 + (lane >> 4) * 8;
}
MK_DEVICE const mkatt_t* mkatt_at_y(const mkatt_t* t, int ld, int r0, int c0, int lane) {
  return t + (r0 + (lane & 7) + (lane >> 4) * 8) * ld + c0 + ((lane >> 3) & 1) * 8;
}

// d += a (16 x 16) b (16 x 8).
MK_DEVICE void mkatt_mma(float (&d)[4], const mk_u32 (&a)[4], mk_u32 b0, mk_u32 b1) {
#if MKATT_DTYPE == MK_DTYPE_BF16
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

MK_DEVICE mk_u32 mkatt_pack(float lo, float hi) {
#if MKATT_DTYPE == MK_DTYPE_BF16
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
#else
  __half2 h = __floats2half2_rn(lo, hi);
#endif
  return *reinterpret_cast<mk_u32*>(&h);
}

MK_DEVICE float mkatt_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// acc[m-tile rows 16][N cols] += A (16 x 16 K, row-major [m][k] at (m0, k0) of `a`) x B ([n][k] rows of `b`)
// over K = KD: the "S = A B^T" product of two row-major tiles.
template <int KD, int N>
MK_DEVICE void mkatt_gemm_abt(float (&acc)[N / 8][4], const mkatt_t* a, int lda, int m0, const mkatt_t* b, int ldb,
                              int n0, int lane) {
#pragma unroll
  for (int kk = 0; kk < KD / 16; ++kk) {
    mk_u32 af[4];
    mkatt_ldsm4(af, mkatt_at_x(a, lda, m0, kk * 16, lane));
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      mk_u32 bf[4];
      mkatt_ldsm4(bf, mkatt_at_y(b, ldb, n0 + np * 16, kk * 16, lane));
      mkatt_mma(acc[2 * np], af, bf[0], bf[1]);
      mkatt_mma(acc[2 * np + 1], af, bf[2], bf[3]);
    }
  }
}

// acc[16][N] += A (16 x K from registers: af[k-step]) x B (row-major [k][n] tile `b`, columns n0..n0+N).
template <int KSTEPS, int N>
MK_DEVICE void mkatt_gemm_rb(float (&acc)[N / 8][4], const mk_u32 (&af)[KSTEPS][4], const mkatt_t* b, int ldb,
                             int n0, int lane) {
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      mk_u32 bf[4];
      mkatt_ldsm4t(bf, mkatt_at_x(b, ldb, kk * 16, n0 + np * 16, lane));
      mkatt_mma(acc[2 * np], af[kk], bf[0], bf[1]);
      mkatt_mma(acc[2 * np + 1], af[kk], bf[2], bf[3]);
    }
  }
}

// Load `rows` rows (from global row r0, of which `valid` exist) of D_ elements into a padded tile.
template <int ROWS, int THREADS>
MK_DEVICE void mkatt_load_tile(mkatt_t* dst, const mkatt_t* src, mk_i64 row_stride, int r0, int valid, int tid) {
  constexpr int CH = D_ / 8;  // 16-byte chunks per row
#pragma unroll
  for (int c = tid; c < ROWS * CH; c += THREADS) {
    const int r = c / CH, ch = c % CH;
    const bool ok = r0 + r < valid;
    const mkatt_t* s = ok ? src + (mk_i64)(r0 + r) * row_stride + ch * 8 : src;
    mkatt_cp16(dst + r * LD_ + ch * 8, s, ok);
  }
}

// lse in log2 units for P = exp2(scale_log2 S - lse2); +inf for rows past S_q and fully masked rows
// (lse = -inf), so their P is 0 (never inf - inf).
MK_DEVICE float mkatt_lse2(float lse) {
  return lse == -MKATT_INF ? MKATT_INF : lse * 1.4426950408889634f;
}

// The (b, h, i) query row of this warp in the row kernels (8 warps per block, row = (b Hq + h) Sq + i);
// false past the last row.
MK_DEVICE bool mkatt_warp_row(const MkAttnBwdArgs& a, mk_i64* row, int* b, int* h, int* i) {
  const mk_i64 r = (mk_i64)blockIdx.x * 8 + (threadIdx.x >> 5);
  if (r >= (mk_i64)a.B * a.Hq * a.Sq) return false;
  *row = r;
  *i = (int)(r % a.Sq);
  *h = (int)((r / a.Sq) % a.Hq);
  *b = (int)(r / ((mk_i64)a.Sq * a.Hq));
  return true;
}

// Row pitch of dsum and dq_acc per (b, h): S_q, or (MKATT_PARTIAL) the launch's window's acc_pitch.
MK_DEVICE mk_i64 mkatt_acc_pitch(const MkAttnBwdArgs& a) {
#if MKATT_PARTIAL
  return a.acc_pitch;
#else
  return a.Sq;
#endif
}

#if !MKATT_WGMMA
#if !MKATT_PARTIAL
// ---- preprocess ---------------------------------------------------------------------------------

// One warp per (b, h, i) row: Dsum = sum_d dO * O in fp32, and the row of the dQ accumulator zeroed
// (when dq_acc is set).  Grid: ceil(B Hq Sq / 8) blocks of 256 threads.
extern "C" __global__ void __launch_bounds__(256) mk_attn_bwd_pre(MkAttnBwdArgs a) {
  const int lane = threadIdx.x & 31;
  mk_i64 row;
  int b, h, i;
  if (!mkatt_warp_row(a, &row, &b, &h, &i)) return;
  const mkatt_t* o = a.o + b * a.o_s[0] + i * a.o_s[1] + h * a.o_s[2];
  const mkatt_t* g = a.dout + b * a.do_s[0] + i * a.do_s[1] + h * a.do_s[2];
  constexpr int E = D_ / 32;  // elements per lane (2 or 4, contiguous)
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < E; ++e) s += mk_to_f32(o[lane * E + e]) * mk_to_f32(g[lane * E + e]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0) a.dsum[row] = s;
  if (a.dq_acc != nullptr) {
#pragma unroll
    for (int e = 0; e < E; ++e) a.dq_acc[row * D_ + lane * E + e] = 0.f;
  }
}

#endif  // !MKATT_PARTIAL

// ---- main kernel: dK, dV (and dQ by atomics) ----------------------------------------------------

struct MkAttnMainSmem {
  mkatt_t k[BC_ * LD_];
  mkatt_t v[BC_ * LD_];
  mkatt_t q[2][BR_ * LD_];
  mkatt_t g[2][BR_ * LD_];      // dO
  mkatt_t ds[BC_ * (BR_ + 8)];  // dS^T [KV row][query row]
  float lse2[2][BR_];
  float dsum[2][BR_];
};

// The query-block work item `it` of this KV block: query head h = hq0 + it / nqb, query block m.
MK_DEVICE void mkatt_main_load(const MkAttnBwdArgs& a, MkAttnMainSmem& sm, int buf, int b, int h, int m, int tid) {
  const int i0 = m * BR_;
  mkatt_load_tile<BR_, NT_>(sm.q[buf], a.q + b * a.q_s[0] + h * a.q_s[2], a.q_s[1], i0, a.Sq, tid);
  mkatt_load_tile<BR_, NT_>(sm.g[buf], a.dout + b * a.do_s[0] + h * a.do_s[2], a.do_s[1], i0, a.Sq, tid);
  if (tid < BR_) {
    const int i = i0 + tid;
    const bool ok = i < a.Sq;
    sm.lse2[buf][tid] = ok ? mkatt_lse2(a.lse[b * a.lse_s[0] + h * a.lse_s[1] + i * a.lse_s[2]]) : MKATT_INF;
    sm.dsum[buf][tid] = ok ? a.dsum[((mk_i64)b * a.Hq + h) * mkatt_acc_pitch(a) + i] : 0.f;
  }
}

// Grid (ceil(Sk / BC), Hkv, B), NT_ threads, sizeof(MkAttnMainSmem) dynamic shared memory.  dq_acc null:
// dK and dV only (deterministic mode: mk_attn_bwd_dq computes dQ).
extern "C" __global__ void __launch_bounds__(NT_, 1) mk_attn_bwd_main(MkAttnBwdArgs a) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  MkAttnMainSmem& sm = *reinterpret_cast<MkAttnMainSmem*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int j0 = blockIdx.x * BC_, hk = blockIdx.y, b = blockIdx.z;
  const int group = a.Hq / a.Hkv;
  const int off = a.Sk - a.Sq;  // causal: query i sees keys j <= i + off
  const int nqb = (a.Sq + BR_ - 1) / BR_;
  // causal: the first query block with a query that sees key j0
  int m_begin = 0;
  if (a.causal) {
    const int ifirst = j0 - off;
    m_begin = ifirst <= 0 ? 0 : (ifirst >= a.Sq ? nqb : ifirst / BR_);
  }
  const int per_head = nqb - m_begin;
  const int items = per_head * group;

  mkatt_load_tile<BC_, NT_>(sm.k, a.k + b * a.k_s[0] + hk * a.k_s[2], a.k_s[1], j0, a.Sk, tid);
  mkatt_load_tile<BC_, NT_>(sm.v, a.v + b * a.v_s[0] + hk * a.v_s[2], a.v_s[1], j0, a.Sk, tid);
  if (items > 0) mkatt_main_load(a, sm, 0, b, hk * group, m_begin, tid);
  mkatt_cp_commit();

  float dk[D_ / 8][4], dv[D_ / 8][4];
#pragma unroll
  for (int n = 0; n < D_ / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;

  const int jw = j0 + warp * 16;  // this warp's first KV row
  const bool kv_edge = j0 + BC_ > a.Sk;
  constexpr int RT = BR_ / 16, CC = MKATT_WARPS / RT, CW = D_ / CC;  // dQ tiles of 16 x CW per warp

  for (int it = 0; it < items; ++it) {
    const int buf = it & 1;
    const int h = hk * group + it / per_head, m = m_begin + it % per_head;
    const bool more = it + 1 < items;
    if (more)
      mkatt_main_load(a, sm, buf ^ 1, b, hk * group + (it + 1) / per_head, m_begin + (it + 1) % per_head, tid);
    mkatt_stage_ready(more);
    const int i0 = m * BR_;
    const mkatt_t* sq = sm.q[buf];
    const mkatt_t* sg = sm.g[buf];

    // S^T (16 KV rows x BR queries) and dP^T
    float s[BR_ / 8][4], dp[BR_ / 8][4];
#pragma unroll
    for (int n = 0; n < BR_ / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
    mkatt_gemm_abt<D_, BR_>(s, sm.k, LD_, warp * 16, sq, LD_, 0, lane);
    mkatt_gemm_abt<D_, BR_>(dp, sm.v, LD_, warp * 16, sg, LD_, 0, lane);

    const bool mask = kv_edge || (a.causal && jw + 15 > i0 + off);
    mk_u32 pf[BR_ / 16][4], dsf[BR_ / 16][4];  // P^T, dS^T as A fragments (k = query)
#pragma unroll
    for (int n = 0; n < BR_ / 8; ++n) {
      float p[4], d[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int ic = n * 8 + 2 * t + (e & 1);  // query column in the block
        const int j = jw + g + (e >> 1) * 8;
        float x = s[n][e] * a.scale_log2 - sm.lse2[buf][ic];
        if (mask && (j >= a.Sk || (a.causal && j > i0 + ic + off))) x = -MKATT_INF;
        p[e] = mkatt_exp2(x);
        d[e] = p[e] * (dp[n][e] - sm.dsum[buf][ic]);
      }
      // C fragment of n-tile n -> half of the A fragment of k-step n / 2
      pf[n >> 1][(n & 1) * 2 + 0] = mkatt_pack(p[0], p[1]);
      pf[n >> 1][(n & 1) * 2 + 1] = mkatt_pack(p[2], p[3]);
      dsf[n >> 1][(n & 1) * 2 + 0] = mkatt_pack(d[0], d[1]);
      dsf[n >> 1][(n & 1) * 2 + 1] = mkatt_pack(d[2], d[3]);
    }
    mkatt_gemm_rb<BR_ / 16, D_>(dv, pf, sg, LD_, 0, lane);
    mkatt_gemm_rb<BR_ / 16, D_>(dk, dsf, sq, LD_, 0, lane);

    if (a.dq_acc != nullptr) {
      // dS^T -> shared; dQ (BR x D) += dS (BR x BC) K (BC x D): warp tile rows 16 rt, columns CW cc
#pragma unroll
      for (int kk = 0; kk < BR_ / 16; ++kk) {
        mk_u32* r0 = reinterpret_cast<mk_u32*>(sm.ds + (warp * 16 + g) * (BR_ + 8) + kk * 16 + 2 * t);
        mk_u32* r1 = reinterpret_cast<mk_u32*>(sm.ds + (warp * 16 + g + 8) * (BR_ + 8) + kk * 16 + 2 * t);
        r0[0] = dsf[kk][0];
        r1[0] = dsf[kk][1];
        r0[4] = dsf[kk][2];  // (+8 columns = 4 words)
        r1[4] = dsf[kk][3];
      }
      __syncthreads();
      const int rt = warp % RT, cc = warp / RT;
      float q[CW / 8][4];
#pragma unroll
      for (int n = 0; n < CW / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) q[n][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < BC_ / 16; ++kk) {
        mk_u32 af[4];
        mkatt_ldsm4t(af, mkatt_at_y(sm.ds, BR_ + 8, kk * 16, rt * 16, lane));
#pragma unroll
        for (int np = 0; np < CW / 16; ++np) {
          mk_u32 bf[4];
          mkatt_ldsm4t(bf, mkatt_at_x(sm.k, LD_, kk * 16, cc * CW + np * 16, lane));
          mkatt_mma(q[2 * np], af, bf[0], bf[1]);
          mkatt_mma(q[2 * np + 1], af, bf[2], bf[3]);
        }
      }
      float* acc = a.dq_acc + (((mk_i64)b * a.Hq + h) * mkatt_acc_pitch(a)) * D_;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = i0 + rt * 16 + g + hh * 8;
        if (i < a.Sq) {
          float* row = acc + (mk_i64)i * D_ + cc * CW + 2 * t;
#pragma unroll
          for (int n = 0; n < CW / 8; ++n)
            asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(row + n * 8), "f"(q[n][2 * hh]),
                         "f"(q[n][2 * hh + 1]) : "memory");
        }
      }
    }
    __syncthreads();  // buffers of this step are refilled by the next one's prefetch
  }

  mkatt_cp_wait<0>();  // (no step ran: the K, V loads are still in flight)

  // epilogue: dK (times the softmax scale), dV
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int j = jw + g + hh * 8;
#if MKATT_PARTIAL
    if (j < a.Sk) {
      const mk_i64 row = (((mk_i64)j * a.B + b) * a.Hkv + hk) * D_ + 2 * t;
#pragma unroll
      for (int n = 0; n < D_ / 8; ++n) {
        *reinterpret_cast<float2*>(a.part_k + row + n * 8) = make_float2(dk[n][2 * hh] * a.scale, dk[n][2 * hh + 1] * a.scale);
        *reinterpret_cast<float2*>(a.part_v + row + n * 8) = make_float2(dv[n][2 * hh], dv[n][2 * hh + 1]);
      }
    }
#else
    if (j < a.Sk) {
      mkatt_t* rk = a.dk + b * a.dk_s[0] + (mk_i64)j * a.dk_s[1] + hk * a.dk_s[2] + 2 * t;
      mkatt_t* rv = a.dv + b * a.dv_s[0] + (mk_i64)j * a.dv_s[1] + hk * a.dv_s[2] + 2 * t;
#pragma unroll
      for (int n = 0; n < D_ / 8; ++n) {
        *reinterpret_cast<mk_u32*>(rk + n * 8) = mkatt_pack(dk[n][2 * hh] * a.scale, dk[n][2 * hh + 1] * a.scale);
        *reinterpret_cast<mk_u32*>(rv + n * 8) = mkatt_pack(dv[n][2 * hh], dv[n][2 * hh + 1]);
      }
    }
#endif
  }
}

#ifdef MKATT_EXPECT_MAIN_SMEM  // the host's size (kernels.main_smem), checked by tests/cpu
static_assert(sizeof(MkAttnMainSmem) == MKATT_EXPECT_MAIN_SMEM, "main kernel shared memory != kernels.main_smem");
#endif

#if MKATT_PARTIAL
// ---- ring backward: the fixed-order sum of dK / dV partials --------------------------------------

#define MKATT_MAX_PARTS 8  // local ranks of a node; mirrored in mkernel/ops/attention_bwd/op.py

// Mirror of PartSumArgs (op.py).  Source i's partial: part_k[i], part_v[i] ([S, B, H_kv, D] fp32, only its
// first rows[i] rows written: the rest count as zeros).  dk, dv: the outputs, element strides (batch,
// seq, head) like MkAttnBwdArgs.
struct MkAttnPartSumArgs {
  const float* part_k[MKATT_MAX_PARTS];
  const float* part_v[MKATT_MAX_PARTS];
  mkatt_t* dk;
  mkatt_t* dv;
  mk_i64 dk_s[3], dv_s[3];
  int rows[MKATT_MAX_PARTS];
  int P, B, Hkv, S;
};
static_assert(sizeof(MkAttnPartSumArgs) == 240, "MkAttnPartSumArgs must match PartSumArgs (op.py)");

// dk = sum_i part_k[i], dv = sum_i part_v[i], i = 0 .. P-1 in that order (fp32; the same rounding on every
// run and rank: deterministic), in the dtype.  One thread per 4 consecutive elements of a row; the
// partials may be peers' memory (NVLink loads, not cached: each is read once).  Grid ceil(S B H_kv D / 4
// / 256) x 256 threads.
extern "C" __global__ void __launch_bounds__(256) mk_attn_bwd_part_sum(MkAttnPartSumArgs a) {
  const mk_i64 q = (mk_i64)blockIdx.x * 256 + threadIdx.x;
  const mk_i64 rows = (mk_i64)a.S * a.B * a.Hkv;
  if (q >= rows * (D_ / 4)) return;
  const mk_i64 r = q / (D_ / 4);
  const int col = (int)(q % (D_ / 4)) * 4;
  const int j = (int)(r / ((mk_i64)a.B * a.Hkv));
  const int b = (int)((r / a.Hkv) % a.B), hk = (int)(r % a.Hkv);
  float4 sk = make_float4(0.f, 0.f, 0.f, 0.f), sv = sk;
  for (int i = 0; i < a.P; ++i) {
    if (j >= a.rows[i]) continue;
    const float4 xk = __ldcv(reinterpret_cast<const float4*>(a.part_k[i] + r * D_ + col));
    const float4 xv = __ldcv(reinterpret_cast<const float4*>(a.part_v[i] + r * D_ + col));
    sk.x += xk.x; sk.y += xk.y; sk.z += xk.z; sk.w += xk.w;
    sv.x += xv.x; sv.y += xv.y; sv.z += xv.z; sv.w += xv.w;
  }
  mkatt_t* ok = a.dk + b * a.dk_s[0] + (mk_i64)j * a.dk_s[1] + hk * a.dk_s[2] + col;
  mkatt_t* ov = a.dv + b * a.dv_s[0] + (mk_i64)j * a.dv_s[1] + hk * a.dv_s[2] + col;
  *reinterpret_cast<uint2*>(ok) = make_uint2(mkatt_pack(sk.x, sk.y), mkatt_pack(sk.z, sk.w));
  *reinterpret_cast<uint2*>(ov) = make_uint2(mkatt_pack(sv.x, sv.y), mkatt_pack(sv.z, sv.w));
}
#else
// ---- deterministic dQ ---------------------------------------------------------------------------

struct MkAttnDqSmem {
  mkatt_t q[BQ_ * LD_];
  mkatt_t g[BQ_ * LD_];
  mkatt_t k[2][BK_ * LD_];
  mkatt_t v[2][BK_ * LD_];
};

#ifdef MKATT_EXPECT_DQ_SMEM
static_assert(sizeof(MkAttnDqSmem) == MKATT_EXPECT_DQ_SMEM, "dq kernel shared memory != kernels.dq_smem");
#endif

// Grid (ceil(Sq / BQ), Hq, B), NTQ_ threads, sizeof(MkAttnDqSmem) dynamic shared memory.  Needs dsum
// (mk_attn_bwd_pre).  Warp w owns query rows [16 w, 16 w + 16) of the block; KV blocks in order.
extern "C" __global__ void __launch_bounds__(NTQ_, 1) mk_attn_bwd_dq(MkAttnBwdArgs a) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  MkAttnDqSmem& sm = *reinterpret_cast<MkAttnDqSmem*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int i0 = blockIdx.x * BQ_, h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (a.Hq / a.Hkv);
  const int off = a.Sk - a.Sq;
  // KV blocks seen by some query of this block
  int kv_end = a.Sk;
  if (a.causal) {
    const int ilast = (i0 + BQ_ < a.Sq ? i0 + BQ_ : a.Sq) - 1;
    kv_end = ilast + off + 1 < a.Sk ? ilast + off + 1 : a.Sk;
  }
  const int nkb = kv_end > 0 ? (kv_end + BK_ - 1) / BK_ : 0;
  const mkatt_t* kbase = a.k + b * a.k_s[0] + hk * a.k_s[2];
  const mkatt_t* vbase = a.v + b * a.v_s[0] + hk * a.v_s[2];

  mkatt_load_tile<BQ_, NTQ_>(sm.q, a.q + b * a.q_s[0] + h * a.q_s[2], a.q_s[1], i0, a.Sq, tid);
  mkatt_load_tile<BQ_, NTQ_>(sm.g, a.dout + b * a.do_s[0] + h * a.do_s[2], a.do_s[1], i0, a.Sq, tid);
  if (nkb > 0) {
    mkatt_load_tile<BK_, NTQ_>(sm.k[0], kbase, a.k_s[1], 0, a.Sk, tid);
    mkatt_load_tile<BK_, NTQ_>(sm.v[0], vbase, a.v_s[1], 0, a.Sk, tid);
  }
  mkatt_cp_commit();

  // this thread's two query rows: lse (log2 units) and Dsum
  float l2[2], ds[2];
  int irow[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int i = i0 + warp * 16 + g + hh * 8;
    irow[hh] = i;
    const bool ok = i < a.Sq;
    l2[hh] = ok ? mkatt_lse2(a.lse[b * a.lse_s[0] + h * a.lse_s[1] + i * a.lse_s[2]]) : MKATT_INF;
    ds[hh] = ok ? a.dsum[((mk_i64)b * a.Hq + h) * a.Sq + i] : 0.f;
  }

  float acc[D_ / 8][4];
#pragma unroll
  for (int n = 0; n < D_ / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;

  for (int nb = 0; nb < nkb; ++nb) {
    const int buf = nb & 1;
    const bool more = nb + 1 < nkb;
    if (more) {
      mkatt_load_tile<BK_, NTQ_>(sm.k[buf ^ 1], kbase, a.k_s[1], (nb + 1) * BK_, a.Sk, tid);
      mkatt_load_tile<BK_, NTQ_>(sm.v[buf ^ 1], vbase, a.v_s[1], (nb + 1) * BK_, a.Sk, tid);
    }
    mkatt_stage_ready(more);
    const int jb = nb * BK_;
    float s[BK_ / 8][4], dp[BK_ / 8][4];
#pragma unroll
    for (int n = 0; n < BK_ / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
    mkatt_gemm_abt<D_, BK_>(s, sm.q, LD_, warp * 16, sm.k[buf], LD_, 0, lane);
    mkatt_gemm_abt<D_, BK_>(dp, sm.g, LD_, warp * 16, sm.v[buf], LD_, 0, lane);
    const bool mask = jb + BK_ > a.Sk || (a.causal && jb + BK_ - 1 > i0 + warp * 16 + off);
    mk_u32 dsf[BK_ / 16][4];
#pragma unroll
    for (int n = 0; n < BK_ / 8; ++n) {
      float d[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = jb + n * 8 + 2 * t + (e & 1);
        const int hh = e >> 1;
        float x = s[n][e] * a.scale_log2 - l2[hh];
        if (mask && (j >= a.Sk || (a.causal && j > irow[hh] + off))) x = -MKATT_INF;
        const float p = mkatt_exp2(x);
        d[e] = p * (dp[n][e] - ds[hh]);
      }
      dsf[n >> 1][(n & 1) * 2 + 0] = mkatt_pack(d[0], d[1]);
      dsf[n >> 1][(n & 1) * 2 + 1] = mkatt_pack(d[2], d[3]);
    }
    mkatt_gemm_rb<BK_ / 16, D_>(acc, dsf, sm.k[buf], LD_, 0, lane);
    __syncthreads();
  }
  mkatt_cp_wait<0>();  // (no KV block: the Q, dO loads are still in flight)

#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int i = irow[hh];
    if (i < a.Sq) {
      mkatt_t* r = a.dq + b * a.dq_s[0] + (mk_i64)i * a.dq_s[1] + h * a.dq_s[2] + 2 * t;
#pragma unroll
      for (int n = 0; n < D_ / 8; ++n)
        *reinterpret_cast<mk_u32*>(r + n * 8) = mkatt_pack(acc[n][2 * hh] * a.scale, acc[n][2 * hh + 1] * a.scale);
    }
  }
}

// ---- dQ conversion ------------------------------------------------------------------------------

// One warp per (b, h, i) row: dq = scale * dq_acc in q's dtype.  Grid: ceil(B Hq Sq / 8) x 256 threads.
extern "C" __global__ void __launch_bounds__(256) mk_attn_bwd_convert(MkAttnBwdArgs a) {
  const int lane = threadIdx.x & 31;
  mk_i64 row;
  int b, h, i;
  if (!mkatt_warp_row(a, &row, &b, &h, &i)) return;
  mkatt_t* r = a.dq + b * a.dq_s[0] + i * a.dq_s[1] + h * a.dq_s[2];
  constexpr int E = D_ / 32;
  const float* src = a.dq_acc + row * D_ + lane * E;
#pragma unroll
  for (int e = 0; e < E; e += 2)
    *reinterpret_cast<mk_u32*>(r + lane * E + e) = mkatt_pack(src[e] * a.scale, src[e + 1] * a.scale);
}
#endif  // MKATT_PARTIAL
#endif  // !MKATT_WGMMA

#if MKATT_WGMMA
// ---- main kernel on TMA + wgmma (docs/attention_bwd.md, "wgmma kernel") ----------------------------
//
// One block of 3 warpgroups per (KV block of 128 rows, KV head, batch).  Warpgroup 0 produces: thread 0
// loads the K and V tiles once and then Q and dO tiles of 64 query rows through a ring of MKW_STAGES
// slots (TMA, 128B-swizzled, mk_attention.cuh's layout), warp 1 fills the slot's lse (log2 units) and
// Dsum rows.  Consumer warpgroup w (1 or 2) owns KV rows [64 (w - 1), 64 w) of the block and keeps their
// dK, dV in registers over every query head of the KV group and every query block:
//   S^T = K Q^T and dP^T = V dO^T (wgmma, both operands K-major in shared memory, N = 64 queries),
//   P^T = exp2(scale log2e S^T - lse2), dS^T = P^T (dP^T - Dsum) in registers, then rounded to the
//   dtype and reused as A fragments of dV += P^T dO and dK += dS^T Q (wgmma, dO and Q MN-major);
//   dS^T is also stored to shared memory ([key][query], swizzled) and read back, M-major, as the A
//   operand of dQ = dS K: D = 128: each warpgroup the 64 head-dim columns 64 (w - 1) .. over all 128 keys
//   (both halves of dS^T: a 256-thread barrier); D = 64: each warpgroup all columns over its own 64 keys
//   (wgmma's N-major B must be whole 64-column swizzle atoms).  The fp32 result is added into the dQ
//   accumulator with red.global.add.v2.f32 (unless deterministic: dq_acc null).
// MKATT_PARTIAL (the ring backward's step launches, docs/ring_attention.md "Backward"): Dsum and the dQ
// accumulator at row pitch acc_pitch (the launch's query rows are a window of them), dK / dV written as fp32
// partials; the Q / dO tensor maps cover the window, the K / V maps the step's key rows.
#include "ops/mk_attention.cuh"

constexpr int MKW_BN = 128;                  // KV rows per block
constexpr int MKW_BM = 64;                   // query rows per step
constexpr int MKW_STAGES = 3;                // Q / dO / lse / Dsum ring depth
constexpr int MKW_KV_BYTES = MKW_BN * D_ * 2;
constexpr int MKW_QT_BYTES = MKW_BM * D_ * 2;
constexpr int MKW_DS_BYTES = MKW_BN * MKW_BM * 2;  // dS^T: 128 key rows of 64 queries (128 bytes)
constexpr int MKW_ROW_BYTES = MKW_BM * 4;          // one slot's lse2 or Dsum
constexpr int MKW_BAR_BYTES = 128;
constexpr int MKW_SMEM_BYTES = 1024 + 2 * MKW_KV_BYTES + 2 * MKW_STAGES * MKW_QT_BYTES + 2 * MKW_DS_BYTES +
                               2 * MKW_STAGES * MKW_ROW_BYTES + MKW_BAR_BYTES;
// the producer's two loops (TMA, lse / Dsum rows) need more than 40 registers: 48 leaves 224 per consumer
constexpr int MKW_PRODUCER_REGS = 48;
constexpr int MKW_CONSUMER_REGS = 224;
constexpr bool MKW_DQ_SPLIT_N = D_ == 128;  // dQ split by head-dim columns (else by keys), see above
static_assert(MKW_SMEM_BYTES <= 227 * 1024, "shared memory");
static_assert((1 + 2 * MKW_STAGES) * 8 <= MKW_BAR_BYTES, "barriers");
static_assert(MKW_PRODUCER_REGS * 128 + MKW_CONSUMER_REGS * 256 <= 65536, "register file");
#ifdef MKATT_EXPECT_WGMMA_SMEM  // the host's size (kernels.wgmma_smem), checked by tests/cpu
static_assert(MKATT_EXPECT_WGMMA_SMEM == MKW_SMEM_BYTES, "wgmma kernel shared memory != kernels.wgmma_smem");
#endif

struct MkwSmem {
  unsigned char* base;  // 1024-aligned
  MK_DEVICE unsigned char* k() const { return base; }
  MK_DEVICE unsigned char* v() const { return base + MKW_KV_BYTES; }
  MK_DEVICE unsigned char* q(int s) const { return base + 2 * MKW_KV_BYTES + s * MKW_QT_BYTES; }
  MK_DEVICE unsigned char* g(int s) const { return base + 2 * MKW_KV_BYTES + (MKW_STAGES + s) * MKW_QT_BYTES; }
  MK_DEVICE unsigned char* ds(int i) const {
    return base + 2 * MKW_KV_BYTES + 2 * MKW_STAGES * MKW_QT_BYTES + i * MKW_DS_BYTES;
  }
  MK_DEVICE float* lse2(int s) const {
    return reinterpret_cast<float*>(base + 2 * MKW_KV_BYTES + 2 * MKW_STAGES * MKW_QT_BYTES + 2 * MKW_DS_BYTES) +
           s * MKW_BM;
  }
  MK_DEVICE float* dsum(int s) const { return lse2(MKW_STAGES + s); }
  MK_DEVICE mk_u64* bars() const { return reinterpret_cast<mk_u64*>(lse2(2 * MKW_STAGES)); }
  MK_DEVICE mk_u64* kv_full() const { return bars(); }
  MK_DEVICE mk_u64* full(int s) const { return bars() + 1 + s; }
  MK_DEVICE mk_u64* empty(int s) const { return bars() + 1 + MKW_STAGES + s; }
};

// acc += A B: A from registers (MKW_BM/16 k16 fragments), B a [MKW_BM x D] MN-major tile (dV, dK).
MK_DEVICE void mkw_gemm_rs(float (&acc)[D_ / 2], const mk_u32 (&a)[MKW_BM / 16][4], mk_u32 b) {
#pragma unroll
  for (int kk = 0; kk < MKW_BM / 16; ++kk)
    MkAttnWgmmaRs<D_, MKATT_DTYPE>::mma(acc, a[kk], mk_wgmma_desc_sw128(b + 2048u * kk, MKW_BM * 128, 1024));
}

// The 4-byte word of a swizzled [row][64 elements] tile holding elements (row, col), (row, col + 1), col even.
MK_DEVICE mk_u32 mkw_swz(int row, int col) {
  return (mk_u32)(row * 128 + ((((col >> 3) ^ row) & 7) << 4) + (col & 7) * 2);
}

#if MKATT_PARTIAL
// Row j (< S_k) of this thread's dK, dV fragments (rows r0 + 8 e, columns 8 jj + c0 (+1)) as the fp32
// partials [S_k, B, H_kv, D], dK times the softmax scale (the mma kernel's MKATT_PARTIAL epilogue).
MK_DEVICE void mkw_store_partial(const MkAttnBwdArgs& a, const float (&dk)[D_ / 2], const float (&dv)[D_ / 2], int j,
                                 int b, int hk, int c0, int e) {
  const mk_i64 row = (((mk_i64)j * a.B + b) * a.Hkv + hk) * D_ + c0;
#pragma unroll
  for (int jj = 0; jj < D_ / 8; ++jj) {
    *reinterpret_cast<float2*>(a.part_k + row + 8 * jj) =
        make_float2(dk[4 * jj + 2 * e] * a.scale, dk[4 * jj + 2 * e + 1] * a.scale);
    *reinterpret_cast<float2*>(a.part_v + row + 8 * jj) = make_float2(dv[4 * jj + 2 * e], dv[4 * jj + 2 * e + 1]);
  }
}
#endif

// Grid (ceil(Sk / 128), Hkv, B), 384 threads, MKW_SMEM_BYTES of dynamic shared memory.  Tensor maps
// {D, S, H, B} with boxes {64, rows, 1, 1}: Q and dO 64 rows, K and V 128 rows (op.py).
extern "C" __global__ void __launch_bounds__(384, 1)
    mk_attn_bwd_wgmma(const __grid_constant__ MkTensorMap tmQ, const __grid_constant__ MkTensorMap tmK,
                      const __grid_constant__ MkTensorMap tmV, const __grid_constant__ MkTensorMap tmG,
                      const MkAttnBwdArgs a) {
  extern __shared__ unsigned char mkw_smem_raw[];
  const MkwSmem sm{reinterpret_cast<unsigned char*>(((unsigned long long)mkw_smem_raw + 1023) & ~1023ull)};
  const int tid = threadIdx.x;
  const int j0 = blockIdx.x * MKW_BN, hk = blockIdx.y, b = blockIdx.z;
  const int group = a.Hq / a.Hkv;
  const int off = a.Sk - a.Sq;  // causal: query i sees keys j <= i + off
  const int nqb = (a.Sq + MKW_BM - 1) / MKW_BM;
  int m_begin = 0;  // causal: the first query block with a query that sees key j0
  if (a.causal) {
    const int ifirst = j0 - off;
    m_begin = ifirst <= 0 ? 0 : (ifirst >= a.Sq ? nqb : ifirst / MKW_BM);
  }
  const int per_head = nqb - m_begin;
  const int items = per_head * group;

  if (tid == 0) {
    mk_mbar_init(sm.kv_full(), 1);
    for (int s = 0; s < MKW_STAGES; ++s) {
      mk_mbar_init(sm.full(s), 1 + 32);  // the TMA thread's expect_tx and warp 1's lanes (lse, Dsum)
      mk_mbar_init(sm.empty(s), 8);      // lane 0 of every consumer warp
    }
    mk_mbar_init_fence();
  } else if (tid == 32) {
    mk_tma_prefetch_desc(&tmQ);
    mk_tma_prefetch_desc(&tmK);
    mk_tma_prefetch_desc(&tmV);
    mk_tma_prefetch_desc(&tmG);
  }
  __syncthreads();

  if (tid < 128) {
    // ================= producer =================
    mk_setmaxnreg_dec<MKW_PRODUCER_REGS>();
    if (items == 0) return;
    if (tid == 0) {
      mk_mbar_arrive_expect_tx(sm.kv_full(), 2 * MKW_KV_BYTES);
      mk_attn_load_tile<D_, MKW_BN>(sm.k(), &tmK, sm.kv_full(), j0, hk, b);
      mk_attn_load_tile<D_, MKW_BN>(sm.v(), &tmV, sm.kv_full(), j0, hk, b);
      for (int it = 0; it < items; ++it) {
        const int st = it % MKW_STAGES;
        const int h = hk * group + it / per_head, i0 = (m_begin + it % per_head) * MKW_BM;
        mk_mbar_wait(sm.empty(st), ((it / MKW_STAGES) & 1u) ^ 1u);
        mk_mbar_arrive_expect_tx(sm.full(st), 2 * MKW_QT_BYTES);
        mk_attn_load_tile<D_, MKW_BM>(sm.q(st), &tmQ, sm.full(st), i0, h, b);
        mk_attn_load_tile<D_, MKW_BM>(sm.g(st), &tmG, sm.full(st), i0, h, b);
      }
    } else if (tid >= 32 && tid < 64) {
      const int lane = tid - 32;
      for (int it = 0; it < items; ++it) {
        const int st = it % MKW_STAGES;
        const int h = hk * group + it / per_head, i0 = (m_begin + it % per_head) * MKW_BM;
        mk_mbar_wait(sm.empty(st), ((it / MKW_STAGES) & 1u) ^ 1u);
#pragma unroll
        for (int r = lane; r < MKW_BM; r += 32) {
          const int i = i0 + r;
          const bool ok = i < a.Sq;
          sm.lse2(st)[r] = ok ? mkatt_lse2(a.lse[b * a.lse_s[0] + h * a.lse_s[1] + i * a.lse_s[2]]) : MKATT_INF;
          sm.dsum(st)[r] = ok ? a.dsum[((mk_i64)b * a.Hq + h) * mkatt_acc_pitch(a) + i] : 0.f;
        }
        mk_mbar_arrive(sm.full(st));
      }
    }
    return;
  }

  // ================= consumers =================
  mk_setmaxnreg_inc<MKW_CONSUMER_REGS>();
  const int wg = tid / 128 - 1;
  const bool leader = (tid & 31) == 0;
  int r0, c0;
  mk_wgmma_frag_origin(r0, c0);
  const int jw = j0 + 64 * wg;  // this warpgroup's first KV row
  const bool kv_edge = jw + 64 > a.Sk;
  float dk[D_ / 2], dv[D_ / 2];
#pragma unroll
  for (int i = 0; i < D_ / 2; ++i) dk[i] = dv[i] = 0.f;
  const mk_u32 ka = mk_smem_addr(sm.k()), va = mk_smem_addr(sm.v());
  // dQ = dS K: this warpgroup's k16 steps and offsets into dS^T and K (see the kernel comment)
  constexpr int DQ_STEPS = MKW_DQ_SPLIT_N ? MKW_BN / 16 : 4;
  const mk_u32 dq_a_off = MKW_DQ_SPLIT_N ? 0u : (mk_u32)wg * 64 * 128;
  const mk_u32 dq_b_off = MKW_DQ_SPLIT_N ? (mk_u32)wg * MKW_BN * 128 : (mk_u32)wg * 64 * 128;
  const int dq_col0 = MKW_DQ_SPLIT_N ? 64 * wg : 0;

  if (items > 0) mk_mbar_wait(sm.kv_full(), 0);
  for (int it = 0; it < items; ++it) {
    const int st = it % MKW_STAGES;
    const int h = hk * group + it / per_head, i0 = (m_begin + it % per_head) * MKW_BM;
    mk_mbar_wait(sm.full(st), (it / MKW_STAGES) & 1u);
    const mk_u32 qa = mk_smem_addr(sm.q(st)), ga = mk_smem_addr(sm.g(st));
    float s[MKW_BM / 2], dp[MKW_BM / 2];
    mk_wgmma_fence();
    mk_attn_gemm_kmajor<MKW_BM, MKATT_DTYPE, D_, MKW_BN * 128, MKW_BM * 128>(s, ka + wg * 64 * 128, qa);
    mk_wgmma_commit();
    mk_attn_gemm_kmajor<MKW_BM, MKATT_DTYPE, D_, MKW_BN * 128, MKW_BM * 128>(dp, va + wg * 64 * 128, ga);
    mk_wgmma_commit();

    // P^T (rows: keys jw + r0 (+8); columns: queries i0 + 8 jj + c0 (+1))
    const float* l2 = sm.lse2(st);
    const float* dsm = sm.dsum(st);
    const bool mask = kv_edge || (a.causal && jw + 63 > i0 + off);
    mk_wgmma_wait<1>();
    mk_wgmma_fence_regs(s);
#pragma unroll
    for (int jj = 0; jj < MKW_BM / 8; ++jj) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * jj + c0 + (e & 1), j = jw + r0 + 8 * (e >> 1);
        float x = fmaf(s[4 * jj + e], a.scale_log2, -l2[col]);
        if (mask && (j >= a.Sk || (a.causal && j > i0 + col + off))) x = -MKATT_INF;
        s[4 * jj + e] = mkatt_exp2(x);
      }
    }
    mk_wgmma_wait<0>();
    mk_wgmma_fence_regs(dp);
#pragma unroll
    for (int jj = 0; jj < MKW_BM / 8; ++jj) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[4 * jj + e] = s[4 * jj + e] * (dp[4 * jj + e] - dsm[8 * jj + c0 + (e & 1)]);
    }
    mk_u32 pf[MKW_BM / 16][4], dsf[MKW_BM / 16][4];
    mk_attn_pack_a<MKATT_DTYPE, MKW_BM>(s, pf);
    mk_attn_pack_a<MKATT_DTYPE, MKW_BM>(dp, dsf);
    mk_wgmma_fence();
    mkw_gemm_rs(dv, pf, ga);
    mkw_gemm_rs(dk, dsf, qa);
    mk_wgmma_commit();

    if (a.dq_acc != nullptr) {
      // dS^T -> shared ([key row][query], swizzled), then dQ = dS K (this warpgroup's part)
      unsigned char* dsb = sm.ds(it & 1);
#pragma unroll
      for (int kk = 0; kk < MKW_BM / 16; ++kk) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = 64 * wg + r0 + 8 * (i & 1), col = 16 * kk + 8 * (i >> 1) + c0;
          *reinterpret_cast<mk_u32*>(dsb + mkw_swz(row, col)) = dsf[kk][i];
        }
      }
      mk_fence_proxy_async_smem();
      if (MKW_DQ_SPLIT_N)
        mk_named_barrier_sync(1, 256);
      else
        mk_named_barrier_sync(2 + wg, 128);
      const mk_u32 dsa = mk_smem_addr(dsb) + dq_a_off;
      float dq[32];
      mk_wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < DQ_STEPS; ++kk)
        MkAttnWgmmaSsTT<MKATT_DTYPE>::mma(dq, mk_wgmma_desc_sw128(dsa + 2048u * kk, MKW_DS_BYTES, 1024),
                                          mk_wgmma_desc_sw128(ka + dq_b_off + 2048u * kk, MKW_BN * 128, 1024),
                                          kk != 0);
      mk_wgmma_commit();
      mk_wgmma_wait<0>();
      mk_wgmma_fence_regs(dq);
      mk_wgmma_fence_regs(dk);
      mk_wgmma_fence_regs(dv);
      __syncwarp();  // every lane's lse2 / dsum reads of the slot before the leader frees it
      if (leader) mk_mbar_arrive(sm.empty(st));
      float* acc = a.dq_acc + (((mk_i64)b * a.Hq + h) * mkatt_acc_pitch(a)) * D_ + dq_col0 + c0;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = i0 + r0 + 8 * e;
        if (i < a.Sq) {
          float* row = acc + (mk_i64)i * D_;
#pragma unroll
          for (int jj = 0; jj < 8; ++jj)
            asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(row + 8 * jj), "f"(dq[4 * jj + 2 * e]),
                         "f"(dq[4 * jj + 2 * e + 1]) : "memory");
        }
      }
    } else {
      mk_wgmma_wait<0>();
      mk_wgmma_fence_regs(dk);
      mk_wgmma_fence_regs(dv);
      __syncwarp();  // (as above)
      if (leader) mk_mbar_arrive(sm.empty(st));
    }
  }

  // epilogue: dK (times the softmax scale), dV; rows past S_k are not written
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int j = jw + r0 + 8 * e;
#if MKATT_PARTIAL
    if (j < a.Sk) mkw_store_partial(a, dk, dv, j, b, hk, c0, e);
#else
    if (j < a.Sk) {
      mkatt_t* rk = a.dk + b * a.dk_s[0] + (mk_i64)j * a.dk_s[1] + hk * a.dk_s[2] + c0;
      mkatt_t* rv = a.dv + b * a.dv_s[0] + (mk_i64)j * a.dv_s[1] + hk * a.dv_s[2] + c0;
#pragma unroll
      for (int jj = 0; jj < D_ / 8; ++jj) {
        *reinterpret_cast<mk_u32*>(rk + 8 * jj) = mkatt_pack(dk[4 * jj + 2 * e] * a.scale, dk[4 * jj + 2 * e + 1] * a.scale);
        *reinterpret_cast<mk_u32*>(rv + 8 * jj) = mkatt_pack(dv[4 * jj + 2 * e], dv[4 * jj + 2 * e + 1]);
      }
    }
#endif
  }
}
#endif  // MKATT_WGMMA
