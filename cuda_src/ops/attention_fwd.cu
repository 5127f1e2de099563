// attention_fwd.cu - flash-attention forward on Hopper: O = softmax(scale * Q K^T [masked]) V and the
// row log-sum-exp, for one (query block, head, batch) per block (docs/attention.md).
//
// Specialization: MK_ATTN_DT (MK_DTYPE_BF16 | MK_DTYPE_F16: q, k, v and out), MK_ATTN_D (64 | 128: head dim),
// MK_ATTN_CAUSAL (0 | 1), MK_ATTN_MERGE (0 | 1: the epilogue merges into a running fp32 result, below).
// Layout ([B, S, H, D] or [B, H, S, D]) and strides live in the tensor maps.
// Schedule (AttentionOptions.schedule; default: the values below): MK_ATTN_PINGPONG (0 | 1), MK_ATTN_WGS
// (consumer warpgroups, 2 | 3), MK_ATTN_BN (keys per tile), MK_ATTN_STAGES (K/V ring depth).
//
// MK_ATTN_MERGE (ring attention, docs/ring_attention.md "Merge"): the kernel takes a second argument,
// MkAttnMergeArgs.  Instead of writing O and the LSE it combines its partial result with the running one
// (acc: fp32 normalized O, lse: natural-log LSE) by the log-sum-exp rule, o = o1 e^(l1-l) + o2 e^(l2-l),
// l = ln(e^l1 + e^l2), in fp32; rows in [final_lo, final_hi) instead store o in the dtype into out (their
// last partial).  `first`: no running result yet (acc and lse are not read).  Default schedule only (ring
// attention launches the default geometry; merge x ping-pong is neither registered nor compiled).
//
// Block: 1 + WGS warpgroups.  Warpgroup 0 is the producer (one thread issues TMA: the Q tile once, then K and V
// tiles through a ring of STAGES slots, K and V on separate barriers so QK^T starts before V lands);
// the others are consumers, each owning 64 of the block's BM = 64 WGS query rows.  Per K/V tile a consumer
// issues S = Q K^T (wgmma, smem x smem) for the next tile before P V (wgmma, P from registers) of the
// current one, so the softmax of one tile runs while the tensor cores work on the other's matrix products.
// Key tiles are visited from the last to the first, so the masked ones (the sequence tail, the causal
// diagonal) come first and the rest run without mask arithmetic.
// Ping-pong (MK_ATTN_PINGPONG): the consumer warpgroups also take turns, round robin, to issue their wgmmas
// (named barriers 1 .. WGS), so one warpgroup's softmax runs while another's matrix products occupy the
// tensor cores (docs/attention.md, "Ping-pong schedule").
//
// Grid: (ceil(S_q / BM), H_q, B).  With heavy_first the x index runs over query blocks from the last one
// (causal: the longest rows start first).
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
static_assert((1 + 4 * MK_STAGES) * 8 <= MK_BAR_BYTES, "barriers");
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

#if MK_ATTN_MERGE
// Mirrored by mkernel/ops/attention/kernels.py:AttnMergeArgs (32 bytes).  Rows are the launch's query rows
// q (0 .. s_q); the running result of row q is row `row0 + q` of acc ([B, H_q, s_acc, D] fp32 contiguous)
// and of args.lse ([B, H_q, s_acc]).
struct MkAttnMergeArgs {
  float* acc;
  int row0, s_acc;
  int first;               // 1: no running result yet
  int final_lo, final_hi;  // rows in [final_lo, final_hi) store o into args.out (dtype) instead of acc
  int pad;
};
#endif

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
};

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

// Online softmax of one score tile (keys n0 ..): masks (when `masked`), updates the running max and sums,
// turns `s` into the unnormalized probabilities exp2(scale_log2 * s - m) and returns in alpha the factor
// by which the rows' earlier output must be scaled.  A row that has seen only masked keys keeps m = -inf
// and subtracts 0 (its probabilities are exp2(-inf) = 0).
MK_DEVICE void mk_attn_softmax(float (&s)[MK_BN / 2], MkAttnRows& r, float (&alpha)[2], bool masked, int n0,
                               int row, int col0, const MkAttnFwdArgs& args) {
  if (masked) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      // keys at or past `lim` are masked for row `row + 8e` (bottom-right aligned causal, and S_k)
      int lim = args.s_k;
      if (MK_ATTN_CAUSAL) lim = min(lim, row + 8 * e + 1 + args.s_k - args.s_q);
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
    const float m_new = fmaxf(r.m[e], mx * args.scale_log2);  // (scale_log2 > 0: the host checks)
    const float base = m_new == -MK_ATTN_INF ? 0.f : m_new;
    alpha[e] = mk_attn_exp2(r.m[e] - base);
    r.m[e] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < MK_BN / 8; ++j) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float& x = s[4 * j + 2 * e + i];
        x = mk_attn_exp2(fmaf(x, args.scale_log2, -base));
        sum += x;
      }
    }
    r.l[e] = r.l[e] * alpha[e] + sum;
  }
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

// A key tile needs masking if it reaches past S_k or, causal, past the diagonal of the block's first row.
MK_DEVICE bool mk_attn_tile_masked(int n0, int m0, const MkAttnFwdArgs& args) {
  return n0 + MK_BN > args.s_k || (MK_ATTN_CAUSAL && n0 + MK_BN - 1 > m0 + args.s_k - args.s_q);
}

extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
    mk_attention_fwd(const __grid_constant__ MkTensorMap tmQ, const __grid_constant__ MkTensorMap tmK,
                     const __grid_constant__ MkTensorMap tmV, const MkAttnFwdArgs args
#if MK_ATTN_MERGE
                     , const MkAttnMergeArgs margs
#endif
                     ) {
  extern __shared__ unsigned char mk_smem_raw[];
  const MkAttnSmem sm{reinterpret_cast<unsigned char*>(((unsigned long long)mk_smem_raw + 1023) & ~1023ull)};
  const int num_m = (args.s_q + MK_BM - 1) / MK_BM;
  const int mb = args.heavy_first ? num_m - 1 - (int)blockIdx.x : (int)blockIdx.x;
  const int m0 = mb * MK_BM;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / args.group;
  // keys [0, n_end) are visible to some row of the block
  int n_end = args.s_k;
  if (MK_ATTN_CAUSAL) n_end = min(n_end, m0 + MK_BM + args.s_k - args.s_q);
  const int n_blocks = n_end > 0 ? (n_end + MK_BN - 1) / MK_BN : 0;
  const int tid = threadIdx.x;

  if (tid == 0) {
    mk_mbar_init(sm.q_full(), 1);
    for (int s = 0; s < MK_STAGES; ++s) {
      mk_mbar_init(sm.k_full(s), 1);
      mk_mbar_init(sm.v_full(s), 1);
      // lane 0 of every consumer warp (a warp's wgmma.wait_group covers that warp's reads of the slot)
      mk_mbar_init(sm.k_empty(s), 4 * MK_WGS);
      mk_mbar_init(sm.v_empty(s), 4 * MK_WGS);
    }
    mk_mbar_init_fence();
  } else if (tid == 32) {
    mk_tma_prefetch_desc(&tmQ);
    mk_tma_prefetch_desc(&tmK);
    mk_tma_prefetch_desc(&tmV);
  }
  __syncthreads();

  if (tid < 128) {
    // ================= producer =================
    mk_setmaxnreg_dec<MK_PRODUCER_REGS>();
    if (MK_ATTN_PINGPONG && n_blocks > 0) mk_named_barrier_arrive(1, 256);  // warpgroup 0's first turn
    if (tid == 0 && n_blocks > 0) {
      mk_mbar_arrive_expect_tx(sm.q_full(), MK_Q_BYTES);
      mk_attn_load_tile<MK_D, MK_BM>(sm.q(), &tmQ, sm.q_full(), m0, h, b);
      for (int it = 0; it < n_blocks; ++it) {
        const int n = n_blocks - 1 - it, st = it % MK_STAGES;
        const mk_u32 ph = (it / MK_STAGES) & 1u;
        mk_mbar_wait(sm.k_empty(st), ph ^ 1u);
        mk_mbar_arrive_expect_tx(sm.k_full(st), MK_KV_BYTES);
        mk_attn_load_tile<MK_D, MK_BN>(sm.k(st), &tmK, sm.k_full(st), n * MK_BN, hk, b);
        mk_mbar_wait(sm.v_empty(st), ph ^ 1u);
        mk_mbar_arrive_expect_tx(sm.v_full(st), MK_KV_BYTES);
        mk_attn_load_tile<MK_D, MK_BN>(sm.v(st), &tmV, sm.v_full(st), n * MK_BN, hk, b);
      }
    }
    return;
  }

  // ================= consumers =================
  mk_setmaxnreg_inc<MK_CONSUMER_REGS>();
  const int wg = tid / 128 - 1;
  const bool leader = (tid & 31) == 0;  // arrives on the empty barriers for its warp
  int r0, c0;
  mk_wgmma_frag_origin(r0, c0);
  const int row = m0 + 64 * wg + r0;  // this thread's rows: row and row + 8
  MkAttnRows r;
#pragma unroll
  for (int i = 0; i < MK_D / 2; ++i) r.o[i] = 0.f;
  r.m[0] = r.m[1] = -MK_ATTN_INF;
  r.l[0] = r.l[1] = 0.f;

  if (n_blocks > 0) {
    float s[MK_BN / 2];
    mk_u32 p[MK_BN / 16][4];
    float alpha[2];
    mk_mbar_wait(sm.q_full(), 0);
    // first tile: S, softmax, P (the output is still zero: no rescale)
    mk_mbar_wait(sm.k_full(0), 0);
    mk_attn_turn_wait(wg);
    mk_attn_qk(s, sm, wg, 0);
    mk_attn_turn_pass(wg, false);
    mk_wgmma_wait<0>();
    mk_wgmma_fence_regs(s);
    if (leader) mk_mbar_arrive(sm.k_empty(0));
    int n0 = (n_blocks - 1) * MK_BN;
    mk_attn_softmax(s, r, alpha, mk_attn_tile_masked(n0, m0, args), n0, row, c0, args);
    mk_attn_pack_a<MK_ATTN_DT, MK_BN>(s, p);
    for (int it = 1; it < n_blocks; ++it) {
      const int st = it % MK_STAGES, pst = (it - 1) % MK_STAGES;
      const mk_u32 ph = (it / MK_STAGES) & 1u, pph = ((it - 1) / MK_STAGES) & 1u;
      n0 -= MK_BN;
      mk_mbar_wait(sm.k_full(st), ph);
      mk_attn_turn_wait(wg);
      mk_attn_qk(s, sm, wg, st);  // S of this tile ...
      mk_mbar_wait(sm.v_full(pst), pph);
      mk_attn_pv(r.o, p, sm, pst);  // ... then O += P V of the previous one
      mk_attn_turn_pass(wg, false);
      mk_wgmma_wait<1>();           // S is ready (P V may still run)
      mk_wgmma_fence_regs(s);
      if (leader) mk_mbar_arrive(sm.k_empty(st));
      mk_attn_softmax(s, r, alpha, mk_attn_tile_masked(n0, m0, args), n0, row, c0, args);
      mk_wgmma_wait<0>();  // P V done: its P registers and V slot are free, O may be rescaled
      mk_wgmma_fence_regs(r.o);
      if (leader) mk_mbar_arrive(sm.v_empty(pst));
      mk_attn_rescale(r.o, alpha);
      mk_attn_pack_a<MK_ATTN_DT, MK_BN>(s, p);
    }
    const int lst = (n_blocks - 1) % MK_STAGES;
    mk_mbar_wait(sm.v_full(lst), ((n_blocks - 1) / MK_STAGES) & 1u);
    mk_attn_turn_wait(wg);
    mk_attn_pv(r.o, p, sm, lst);
    mk_attn_turn_pass(wg, true);
    mk_wgmma_wait<0>();
    mk_wgmma_fence_regs(r.o);
    if (leader) mk_mbar_arrive(sm.v_empty(lst));
  }

  // ---- epilogue: O / l (0 for a row with no visible key), LSE = ln(sum exp(scale * q.k)) (-inf likewise)
  float inv[2], lse[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float l = mk_attn_quad_sum(r.l[e]);
    inv[e] = l > 0.f ? 1.f / l : 0.f;
    lse[e] = l > 0.f ? (r.m[e] + __log2f(l)) * 0.69314718055994531f : -MK_ATTN_INF;
  }
  MkElt* out = reinterpret_cast<MkElt*>(args.out) + (long long)b * args.out_sb + (long long)h * args.out_sh;
#if MK_ATTN_MERGE
  // running result: weights of the old (wa) and new (wn) partials, in log2 units (a -inf LSE weighs 0)
  const long long bh_row = ((long long)b * args.h_q + h) * margs.s_acc + margs.row0;
  // the running LSE is read by the quad's four lanes before its first lane overwrites it
  float la[2];
#pragma unroll
  for (int e = 0; e < 2; ++e)
    la[e] = (margs.first || row + 8 * e >= args.s_q) ? -MK_ATTN_INF
                                                     : args.lse[bh_row + row + 8 * e] * 1.4426950408889634f;
  __syncwarp();
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int q = row + 8 * e;
    if (q >= args.s_q) continue;
    const float ln = lse[e] * 1.4426950408889634f;
    const float mx = fmaxf(la[e], ln);
    float wa = 0.f, wn = 0.f, lnew = -MK_ATTN_INF;
    if (mx != -MK_ATTN_INF) {
      wa = mk_attn_exp2(la[e] - mx);
      wn = mk_attn_exp2(ln - mx);
      const float tot = wa + wn;
      lnew = (mx + __log2f(tot)) * 0.69314718055994531f;
      wa /= tot;
      wn = wn / tot * inv[e];
    }
    float* arow = margs.acc + (bh_row + q) * MK_D;
    const bool fin = q >= margs.final_lo && q < margs.final_hi;
    MkElt* orow = out + (long long)q * args.out_ss;
#pragma unroll
    for (int j = 0; j < MK_D / 8; ++j) {
      float2* ap = reinterpret_cast<float2*>(arow + 8 * j + c0);
      float2 a = make_float2(0.f, 0.f);
      if (!margs.first) a = *ap;
      const float x = fmaf(a.x, wa, r.o[4 * j + 2 * e] * wn), y = fmaf(a.y, wa, r.o[4 * j + 2 * e + 1] * wn);
      if (fin)
        *reinterpret_cast<mk_u32*>(orow + 8 * j + c0) = mk_attn_pack2<MK_ATTN_DT>(x, y);
      else
        *ap = make_float2(x, y);
    }
    if ((tid & 3) == 0) args.lse[bh_row + q] = lnew;
  }
#else
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int q = row + 8 * e;
    if (q >= args.s_q) continue;
    MkElt* orow = out + (long long)q * args.out_ss;
#pragma unroll
    for (int j = 0; j < MK_D / 8; ++j)
      *reinterpret_cast<mk_u32*>(orow + 8 * j + c0) =
          mk_attn_pack2<MK_ATTN_DT>(r.o[4 * j + 2 * e] * inv[e], r.o[4 * j + 2 * e + 1] * inv[e]);
    if ((tid & 3) == 0) args.lse[((long long)b * args.h_q + h) * args.s_q + q] = lse[e];
  }
#endif
}
