// ring_attention_fused.cu - ring attention forward in one persistent kernel per call (docs/ring_attention.md,
// "One persistent kernel").  Each block takes query tiles in turn and runs the online softmax of a tile over
// the K/V of every ring step, in step order, without leaving registers: no partial results, no merge pass.
// Step 0 reads this rank's k, v in place; step s reads source j = (me - s) mod P from slot j of the
// workspace's K and V areas, which the copy engines fill (pulls on the side stream, the host's program);
// before its first load from slot j a block's producer waits for arrived[j] >= the call's epoch, so the
// first tiles compute on the local block while the others are in flight.
//
// Specialization: MK_ATTN_DT, MK_ATTN_D (the forward's; default schedule geometry).  Causal or not is a
// runtime argument: zigzag shards (rank me holds global chunks me and 2P-1-me of C rows each); a query
// tile lies inside one chunk, and each (query chunk, key chunk) pair is full, diagonal (causal mask) or
// skipped (mkernel/ops/ring_attention/plan.py: classify).
//
// Block: the forward's (a producer warpgroup, two consumer warpgroups of 64 rows); grid: at most the SMs the
// context may fill less one (the side stream's gate kernels must find an SM).  Tiles are dealt statically,
// block i taking tiles i, i + grid, ...; the high zigzag chunk (the most keys) first.
#include "ops/mk_attention_fwd.cuh"
#include "core/mk_signal.cuh"

static_assert(!MK_ATTN_MERGE && !MK_ATTN_PINGPONG && !MK_ATTN_CAUSAL, "the persistent ring kernel has its own mask");

// Passed by value; mirrored by mkernel/ops/ring_attention/fused.py:RingFusedArgs (104 bytes).
struct MkRingFusedArgs {
  void* out;                         // [B, S, H_q, D] or [B, H_q, S, D] view, unit head-dim stride
  float* lse;                        // [B, H_q, S] contiguous
  long long out_sb, out_ss, out_sh;  // out's strides (elements)
  const mk_u64* arrived;             // [P], local: arrived[j] >= epoch once slot j holds this call's K/V
  const mk_u64* epoch;               // the call's epoch (written by mk_ring_begin before the launch)
  int b, s_loc, h_q, group;          // B, S (local rows), H_q, H_q / H_kv
  float scale_log2;
  int P, me;                         // ring size and this rank's place in it
  int causal;                        // zigzag shards, causal mask
  int chunk;                         // query rows of a chunk: C = S / 2 (causal) or S
  int m_tiles;                       // query tiles per chunk, ceil(chunk / BM)
  int num_tiles;                     // B * H_q * (1 + causal) * m_tiles
  int pad;
};
static_assert(sizeof(MkRingFusedArgs) == 104, "host mirror");

// One (step, key chunk) segment of a query tile: keys [row0, row0 + len) of source j's block, `diag`: the
// causal mask (key n visible to chunk-relative row q iff n <= q), n_tiles key tiles of BN.
struct MkRingSeg {
  int j, row0, len, diag, n_tiles;
};

// Segment `sg` (of P * (1 + causal)) of the tile of query chunk `ca` starting at chunk-relative row m0;
// false when it is skipped.
MK_DEVICE bool mk_ring_seg(const MkRingFusedArgs& a, int ca, int m0, int sg, MkRingSeg& g) {
  const int nb = 1 + a.causal;
  const int s = sg / nb, kb = sg % nb;
  g.j = a.me - s < 0 ? a.me - s + a.P : a.me - s;
  g.row0 = kb * a.chunk;
  g.len = a.chunk;
  g.diag = 0;
  if (a.causal) {
    const int gq = ca == 0 ? a.me : 2 * a.P - 1 - a.me;
    const int gk = kb == 0 ? g.j : 2 * a.P - 1 - g.j;
    if (gk > gq) return false;
    g.diag = gk == gq;
  }
  const int n_end = g.diag ? min(g.len, m0 + MK_BM) : g.len;
  g.n_tiles = (n_end + MK_BN - 1) / MK_BN;
  return g.n_tiles > 0;
}

// Tile t -> (query chunk, chunk-relative first row, head, batch); the high chunk's tiles first, and within a
// chunk the last query tiles (the most diagonal keys) first.
MK_DEVICE void mk_ring_tile(const MkRingFusedArgs& a, int t, int& ca, int& m0, int& h, int& b) {
  const int per_chunk = a.b * a.h_q * a.m_tiles;
  ca = a.causal ? 1 - t / per_chunk : 0;
  const int r = t % per_chunk;
  m0 = (a.m_tiles - 1 - r % a.m_tiles) * MK_BM;
  h = (r / a.m_tiles) % a.h_q;
  b = r / (a.m_tiles * a.h_q);
}

MK_DEVICE int mk_ring_tile_iters(const MkRingFusedArgs& a, int ca, int m0) {
  int n = 0;
  for (int sg = 0; sg < a.P * (1 + a.causal); ++sg) {
    MkRingSeg g;
    if (mk_ring_seg(a, ca, m0, sg, g)) n += g.n_tiles;
  }
  return n;
}

extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
    mk_ring_attention_fused(const __grid_constant__ MkTensorMap tmQ, const __grid_constant__ MkTensorMap tmK,
                            const __grid_constant__ MkTensorMap tmV, const __grid_constant__ MkTensorMap tmKr,
                            const __grid_constant__ MkTensorMap tmVr, const MkRingFusedArgs args, const MkComm comm) {
  extern __shared__ unsigned char mk_smem_raw[];
  const MkAttnSmem sm{reinterpret_cast<unsigned char*>(((unsigned long long)mk_smem_raw + 1023) & ~1023ull)};
  const int tid = threadIdx.x;

  if (tid == 0) {
    mk_attn_init_barriers(sm, true);
  } else if (tid == 32) {
    mk_tma_prefetch_desc(&tmQ);
    mk_tma_prefetch_desc(&tmK);
    mk_tma_prefetch_desc(&tmV);
    mk_tma_prefetch_desc(&tmKr);
    mk_tma_prefetch_desc(&tmVr);
  }
  __syncthreads();

  if (tid < 128) {
    // ================= producer =================
    mk_setmaxnreg_dec<MK_PRODUCER_REGS>();
    if (tid != 0) return;
    const mk_u64 epoch = *(volatile const mk_u64*)args.epoch;
    int waited = 0;  // ring steps whose slot is known to hold this call's K/V (step 0: local)
    bool ok = true;  // false after a failed wait: load on (the data is never used: the host raises)
    int it = 0, qi = 0;
    for (int t = blockIdx.x; t < args.num_tiles; t += gridDim.x, ++qi) {
      int ca, m0, h, b;
      mk_ring_tile(args, t, ca, m0, h, b);
      const int hk = h / args.group;
      mk_mbar_wait(sm.q_empty(), (qi & 1) ^ 1u);
      mk_mbar_arrive_expect_tx(sm.q_full(), MK_Q_BYTES);
      mk_attn_load_tile<MK_D, MK_BM>(sm.q(), &tmQ, sm.q_full(), ca * args.chunk + m0, h, b);
      for (int sg = 0; sg < args.P * (1 + args.causal); ++sg) {
        MkRingSeg g;
        if (!mk_ring_seg(args, ca, m0, sg, g)) continue;
        const int step = sg / (1 + args.causal);
        if (step > waited) {
          if (ok) {
            ok = mk_wait_geq(comm, args.arrived + g.j, epoch, MK_LOCAL_PEER(g.j), 2048 + g.j);
            asm volatile("fence.proxy.async.global;" ::: "memory");  // copy-engine data before TMA reads
          }
          waited = step;
        }
        const bool local = g.j == args.me;
        const MkTensorMap* km = local ? &tmK : &tmKr;
        const MkTensorMap* vm = local ? &tmV : &tmVr;
        const int kb = local ? b : g.j * args.b + b;
        for (int n = g.n_tiles - 1; n >= 0; --n, ++it) {
          const int st = it % MK_STAGES;
          const mk_u32 ph = (it / MK_STAGES) & 1u;
          mk_mbar_wait(sm.k_empty(st), ph ^ 1u);
          mk_mbar_arrive_expect_tx(sm.k_full(st), MK_KV_BYTES);
          mk_attn_load_tile<MK_D, MK_BN>(sm.k(st), km, sm.k_full(st), g.row0 + n * MK_BN, hk, kb);
          mk_mbar_wait(sm.v_empty(st), ph ^ 1u);
          mk_mbar_arrive_expect_tx(sm.v_full(st), MK_KV_BYTES);
          mk_attn_load_tile<MK_D, MK_BN>(sm.v(st), vm, sm.v_full(st), g.row0 + n * MK_BN, hk, kb);
        }
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
  int it = 0, qi = 0;
  for (int t = blockIdx.x; t < args.num_tiles; t += gridDim.x, ++qi) {
    int ca, m0, h, b;
    mk_ring_tile(args, t, ca, m0, h, b);
    const int qrow = m0 + 64 * wg + r0;  // chunk-relative rows of this thread: qrow and qrow + 8
    const int total = mk_ring_tile_iters(args, ca, m0);
    MkAttnRows r;
#pragma unroll
    for (int i = 0; i < MK_D / 2; ++i) r.o[i] = 0.f;
    r.m[0] = r.m[1] = -MK_ATTN_INF;
    r.l[0] = r.l[1] = 0.f;
    float s[MK_BN / 2];
    mk_u32 p[MK_BN / 16][4];
    float alpha[2];
    mk_mbar_wait(sm.q_full(), qi & 1);
    int k = 0, pst = 0;
    mk_u32 pph = 0;
    for (int sg = 0; sg < args.P * (1 + args.causal); ++sg) {
      MkRingSeg g;
      if (!mk_ring_seg(args, ca, m0, sg, g)) continue;
      for (int n = g.n_tiles - 1; n >= 0; --n, ++k, ++it) {
        const int st = it % MK_STAGES;
        const mk_u32 ph = (it / MK_STAGES) & 1u;
        const int n0 = n * MK_BN;
        mk_mbar_wait(sm.k_full(st), ph);
        mk_attn_qk(s, sm, wg, st);  // S of this tile ...
        if (k > 0) {
          mk_mbar_wait(sm.v_full(pst), pph);
          mk_attn_pv(r.o, p, sm, pst);  // ... then O += P V of the previous one
          mk_wgmma_wait<1>();           // S is ready (P V may still run)
        } else {
          mk_wgmma_wait<0>();
        }
        mk_wgmma_fence_regs(s);
        if (leader) {
          mk_mbar_arrive(sm.k_empty(st));
          if (k == total - 1) mk_mbar_arrive(sm.q_empty());  // the tile's last read of Q is done
        }
        const bool masked = n0 + MK_BN > g.len || (g.diag && n0 + MK_BN - 1 > m0);
        mk_attn_softmax_by(s, r, alpha, masked, n0, c0, args.scale_log2,
                           [&](int e) { return g.diag ? min(g.len, qrow + 8 * e + 1) : g.len; });
        if (k > 0) {
          mk_wgmma_wait<0>();  // P V done: its P registers and V slot are free, O may be rescaled
          mk_wgmma_fence_regs(r.o);
          if (leader) mk_mbar_arrive(sm.v_empty(pst));
          mk_attn_rescale(r.o, alpha);
        }
        mk_attn_pack_a<MK_ATTN_DT, MK_BN>(s, p);
        pst = st;
        pph = ph;
      }
    }
    // (total >= 1: every query tile sees at least its own diagonal or block)
    mk_mbar_wait(sm.v_full(pst), pph);
    mk_attn_pv(r.o, p, sm, pst);
    mk_wgmma_wait<0>();
    mk_wgmma_fence_regs(r.o);
    if (leader) mk_mbar_arrive(sm.v_empty(pst));

    // ---- epilogue: O / l and the LSE of the tile's rows inside its chunk
    float inv[2], lse[2];
    mk_attn_row_stats(r, inv, lse);
    MkElt* out = reinterpret_cast<MkElt*>(args.out) + (long long)b * args.out_sb + (long long)h * args.out_sh;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int q = qrow + 8 * e;
      if (q >= args.chunk) continue;
      const int row = ca * args.chunk + q;
      MkElt* orow = out + (long long)row * args.out_ss;
#pragma unroll
      for (int j = 0; j < MK_D / 8; ++j)
        *reinterpret_cast<mk_u32*>(orow + 8 * j + c0) =
            mk_attn_pack2<MK_ATTN_DT>(r.o[4 * j + 2 * e] * inv[e], r.o[4 * j + 2 * e + 1] * inv[e]);
      if ((tid & 3) == 0) args.lse[((long long)b * args.h_q + h) * args.s_loc + row] = lse[e];
    }
  }
}
