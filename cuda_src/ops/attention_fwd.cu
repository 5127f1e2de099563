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
#include "ops/mk_attention_fwd.cuh"

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
    mk_attn_init_barriers(sm, false);
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
  mk_attn_row_stats(r, inv, lse);
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
