// mk_attention_fwd.cuh - the flash-attention forward's tile program (docs/attention.md, "Kernel"): geometry
// from the MK_ATTN_* macros of the including kernel (defaults below), shared memory, the running row state,
// the two matrix products of a K/V tile and the online softmax.  Included by attention_fwd.cu (one query
// block per block) and ring_attention_fused.cu (a persistent loop over query blocks and ring steps).
#pragma once
#include "ops/mk_attention.cuh"

#ifndef MK_ATTN_DT
#define MK_ATTN_DT MK_DTYPE_BF16
#endif
#ifndef MK_ATTN_D
#define MK_ATTN_D 128
#endif
#ifndef MK_ATTN_CAUSAL
#define MK_ATTN_CAUSAL 0
#endif
#ifndef MK_ATTN_PINGPONG
#define MK_ATTN_PINGPONG 0
#endif
#ifndef MK_ATTN_WGS
#define MK_ATTN_WGS 2
#endif
#ifndef MK_ATTN_BN
#define MK_ATTN_BN 128
#endif
#ifndef MK_ATTN_STAGES
#define MK_ATTN_STAGES (MK_ATTN_D == 64 ? 4 : 2)  // K/V ring depth (what fits next to Q in 227 KiB)
#endif
#ifndef MK_ATTN_MERGE
#define MK_ATTN_MERGE 0
#endif

constexpr int MK_D = MK_ATTN_D;
constexpr int MK_WGS = MK_ATTN_WGS;            // consumer warpgroups
constexpr int MK_BM = 64 * MK_WGS;             // query rows per block (64 per consumer warpgroup)
constexpr int MK_BN = MK_ATTN_BN;              // keys per K/V tile
constexpr int MK_STAGES = MK_ATTN_STAGES;
constexpr int MK_THREADS = 128 * (1 + MK_WGS);
constexpr int MK_Q_BYTES = MK_BM * MK_D * 2;
constexpr int MK_KV_BYTES = MK_BN * MK_D * 2;
constexpr int MK_BAR_BYTES = 256;
// dynamic shared memory: 1024 bytes of alignment slack, Q, the K and V rings, the barriers
constexpr int MK_SMEM_BYTES = 1024 + MK_Q_BYTES + 2 * MK_STAGES * MK_KV_BYTES + MK_BAR_BYTES;
constexpr int MK_PRODUCER_REGS = 24;
// 240 with two consumer warpgroups; 160 with three (S, P and O of a 64 x 128 tile at D = 64 fit)
constexpr int MK_CONSUMER_REGS = MK_WGS == 2 ? 240 : 160;
static_assert(MK_D == 64 || MK_D == 128, "head dim");
static_assert(MK_WGS == 2 || MK_WGS == 3, "consumer warpgroups");
static_assert(!(MK_ATTN_MERGE && MK_ATTN_PINGPONG), "the merge epilogue is the default schedule's only");
static_assert(MK_BN % 16 == 0 && MK_BN <= 256 && (MK_BN * 128) % 1024 == 0, "key tile (TMA box, swizzle atoms)");
static_assert(MK_SMEM_BYTES <= 227 * 1024, "shared memory");
static_assert((2 + 4 * MK_STAGES) * 8 <= MK_BAR_BYTES, "barriers");
static_assert(MK_PRODUCER_REGS * 128 + MK_CONSUMER_REGS * 128 * MK_WGS <= 65536, "register file");
#ifdef MK_EXPECT_SMEM  // the host's figures (mkernel/ops/attention/kernels.py), checked by the CPU tests
static_assert(MK_EXPECT_SMEM == MK_SMEM_BYTES && MK_EXPECT_BM == MK_BM && MK_EXPECT_BN == MK_BN, "host geometry");
static_assert(MK_EXPECT_THREADS == MK_THREADS, "host geometry");
#endif

typedef mk_type<MK_ATTN_DT>::T MkElt;

// Passed by value; mirrored by mkernel/ops/attention/kernels.py:AttnFwdArgs (same order, 64 bytes).
struct MkAttnFwdArgs {
  void* out;                       // [B, S_q, H_q, D] or [B, H_q, S_q, D] view, unit head-dim stride
  float* lse;                      // [B, H_q, S_q] contiguous
  long long out_sb, out_ss, out_sh;  // out's batch, sequence and head strides (elements)
  int s_q, s_k, h_q;
  int group;         // H_q / H_kv: query head h reads K/V head h / group
  float scale_log2;  // softmax_scale * log2(e)
  int heavy_first;   // 1: blockIdx.x = 0 is the last query block
};


struct MkAttnSmem {
  unsigned char* base;  // 1024-aligned
  MK_DEVICE unsigned char* q() const { return base; }
  MK_DEVICE unsigned char* k(int s) const { return base + MK_Q_BYTES + s * MK_KV_BYTES; }
  MK_DEVICE unsigned char* v(int s) const { return base + MK_Q_BYTES + (MK_STAGES + s) * MK_KV_BYTES; }
  MK_DEVICE mk_u64* bars() const { return reinterpret_cast<mk_u64*>(base + MK_Q_BYTES + 2 * MK_STAGES * MK_KV_BYTES); }
  MK_DEVICE mk_u64* q_full() const { return bars(); }
  MK_DEVICE mk_u64* k_full(int s) const { return bars() + 1 + s; }
  MK_DEVICE mk_u64* k_empty(int s) const { return bars() + 1 + MK_STAGES + s; }
  MK_DEVICE mk_u64* v_full(int s) const { return bars() + 1 + 2 * MK_STAGES + s; }
  MK_DEVICE mk_u64* v_empty(int s) const { return bars() + 1 + 3 * MK_STAGES + s; }
  MK_DEVICE mk_u64* q_empty() const { return bars() + 1 + 4 * MK_STAGES; }  // (persistent kernels)
};

// The block's barriers (one thread, then mk_mbar_init_fence and a block barrier): Q full (the producer's
// expect_tx), and per K/V stage full / empty; an empty barrier counts lane 0 of every consumer warp (a
// warp's wgmma.wait_group covers that warp's reads of the slot).  `q_empty`: persistent kernels' Q reuse.
MK_DEVICE void mk_attn_init_barriers(const MkAttnSmem& sm, bool q_empty) {
  mk_mbar_init(sm.q_full(), 1);
  if (q_empty) mk_mbar_init(sm.q_empty(), 4 * MK_WGS);
  for (int s = 0; s < MK_STAGES; ++s) {
    mk_mbar_init(sm.k_full(s), 1);
    mk_mbar_init(sm.v_full(s), 1);
    mk_mbar_init(sm.k_empty(s), 4 * MK_WGS);
    mk_mbar_init(sm.v_empty(s), 4 * MK_WGS);
  }
  mk_mbar_init_fence();
}

// One consumer warpgroup's running state for its 64 query rows: the output accumulator (fp32, m64nDk16
// fragment), and per thread row (r0, r0 + 8) the running max (log2 units, scale applied) and the thread's
// partial row sum (its 4-lane quad's sum is the row's).
struct MkAttnRows {
  float o[MK_D / 2];
  float m[2];
  float l[2];
};

// S = Q K^T of this warpgroup's 64 rows against K slot `st` (issued, committed, not waited).
MK_DEVICE void mk_attn_qk(float (&s)[MK_BN / 2], const MkAttnSmem& sm, int wg, int st) {
  const mk_u32 qa = mk_smem_addr(sm.q()) + wg * 64 * 128;
  const mk_u32 ka = mk_smem_addr(sm.k(st));
  mk_wgmma_fence();
  mk_attn_gemm_kmajor<MK_BN, MK_ATTN_DT, MK_D, MK_BM * 128, MK_BN * 128>(s, qa, ka);
  mk_wgmma_commit();
}

// O += P V_slot (issued, committed, not waited): P from registers, V MN-major (mk_attention.cuh).
MK_DEVICE void mk_attn_pv(float (&o)[MK_D / 2], const mk_u32 (&p)[MK_BN / 16][4], const MkAttnSmem& sm, int st) {
  const mk_u32 va = mk_smem_addr(sm.v(st));
  mk_wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < MK_BN / 16; ++kk)
    MkAttnWgmmaRs<MK_D, MK_ATTN_DT>::mma(o, p[kk], mk_wgmma_desc_sw128(va + 2048u * kk, MK_BN * 128, 1024));
  mk_wgmma_commit();
}

// Online softmax of one score tile (keys n0 ..): when `masked`, keys at or past lim_of(e) are masked for the
// thread's row e (row, row + 8); updates the running max and sums, turns `s` into the unnormalized
// probabilities exp2(scale_log2 * s - m) and returns in alpha the factor by which the rows' earlier output
// must be scaled.  A row that has seen only masked keys keeps m = -inf and subtracts 0 (its probabilities
// are exp2(-inf) = 0).
template <class LimOf>
MK_DEVICE void mk_attn_softmax_by(float (&s)[MK_BN / 2], MkAttnRows& r, float (&alpha)[2], bool masked, int n0,
                                  int col0, float scale_log2, LimOf lim_of) {
  if (masked) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int lim = lim_of(e);
#pragma unroll
      for (int j = 0; j < MK_BN / 8; ++j) {
#pragma unroll
        for (int i = 0; i < 2; ++i)
          if (n0 + 8 * j + col0 + i >= lim) s[4 * j + 2 * e + i] = -MK_ATTN_INF;
      }
    }
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float mx = -MK_ATTN_INF;
#pragma unroll
    for (int j = 0; j < MK_BN / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * e], s[4 * j + 2 * e + 1]));
    mx = mk_attn_quad_max(mx);
    const float m_new = fmaxf(r.m[e], mx * scale_log2);  // (scale_log2 > 0: the host checks)
    const float base = m_new == -MK_ATTN_INF ? 0.f : m_new;
    alpha[e] = mk_attn_exp2(r.m[e] - base);
    r.m[e] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < MK_BN / 8; ++j) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float& x = s[4 * j + 2 * e + i];
        x = mk_attn_exp2(fmaf(x, scale_log2, -base));
        sum += x;
      }
    }
    r.l[e] = r.l[e] * alpha[e] + sum;
  }
}

// The single-launch forward's mask: keys past S_k and, causal, past the bottom-right aligned diagonal.
MK_DEVICE void mk_attn_softmax(float (&s)[MK_BN / 2], MkAttnRows& r, float (&alpha)[2], bool masked, int n0,
                               int row, int col0, const MkAttnFwdArgs& args) {
  mk_attn_softmax_by(s, r, alpha, masked, n0, col0, args.scale_log2, [=](int e) {
    int lim = args.s_k;
    if (MK_ATTN_CAUSAL) lim = min(lim, row + 8 * e + 1 + args.s_k - args.s_q);
    return lim;
  });
}

MK_DEVICE void mk_attn_rescale(float (&o)[MK_D / 2], const float (&alpha)[2]) {
#pragma unroll
  for (int j = 0; j < MK_D / 8; ++j) {
    o[4 * j] *= alpha[0];
    o[4 * j + 1] *= alpha[0];
    o[4 * j + 2] *= alpha[1];
    o[4 * j + 3] *= alpha[1];
  }
}

// The thread's rows' normalizer and LSE: inv = 1 / l (0 for a row with no visible key), lse = ln(sum exp(scale
// q.k)) (-inf likewise).  Every lane calls it (quad shuffles).
MK_DEVICE void mk_attn_row_stats(const MkAttnRows& r, float (&inv)[2], float (&lse)[2]) {
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float l = mk_attn_quad_sum(r.l[e]);
    inv[e] = l > 0.f ? 1.f / l : 0.f;
    lse[e] = l > 0.f ? (r.m[e] + __log2f(l)) * 0.69314718055994531f : -MK_ATTN_INF;
  }
}

// Ping-pong turns: consumer warpgroup wg waits on named barrier 1 + wg before issuing its wgmmas and, once
// they are issued, passes the turn to the next warpgroup (barrier of 256 threads: the waiting warpgroup's
// bar.sync and the previous one's bar.arrive; the producer gives warpgroup 0 its first turn).  Every
// warpgroup takes n_blocks + 1 turns; the very last one passes nothing, so no barrier is left half-arrived.
// Without MK_ATTN_PINGPONG both are empty.
MK_DEVICE void mk_attn_turn_wait(int wg) {
  if (MK_ATTN_PINGPONG) mk_named_barrier_sync(1 + wg, 256);
}
MK_DEVICE void mk_attn_turn_pass(int wg, bool last) {
  if (MK_ATTN_PINGPONG && !(last && wg == MK_WGS - 1)) mk_named_barrier_arrive(1 + (wg + 1) % MK_WGS, 256);
}
