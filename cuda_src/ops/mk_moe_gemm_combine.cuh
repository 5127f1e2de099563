// mk_moe_gemm_combine.cuh - the combine side of the MoE kernels built on the GEMM component
// (moe_gemm_combine.cu: down GEMM + combine; moe_layer.cu: the whole layer): the kernel arguments, the
// epilogue that stores a finished tile's rows into their token owners' combine staging and counts them, and
// the owners' sum blocks (docs/moe.md, "Down GEMM + combine, fused").
#pragma once
#include "gemm/mk_gemm_dtypes.cuh"
#include "ops/mk_moe_gemm.cuh"

// Passed by value; mirrored by mkernel/ops/moe/layout.py MoeCombineArgs (same order, natural alignment).
struct MoeCombineArgs {
  const int* ids;        // routing: [T, k] global expert ids
  const int* slots;      // routing: [T, k] row in the expert owner's receive buffer (-1: dropped)
  const float* weights;  // routing: [T, k]
  const int* offs;       // routing: [El + 1] this rank's expert offsets
  const int* recv_map;   // [r_cap] s * T * k + t * k + j of each received row (the dispatch's)
  void* out;             // [T, H] this rank's tokens
  char* ws;              // this rank's workspace (gemm_combine_layout)
  const mk_u64* peers;   // local rank -> its workspace base, as mapped here
  int K;                 // F
  int n_comm;            // sum blocks
  int group_m;           // rasterization super-row height
  int pad;
};
static_assert(sizeof(MoeCombineArgs) == 80, "MoeCombineArgs layout changed: update mkernel/ops/moe/layout.py");

// Threads [tid0, tid0 + n) (named barrier `bar`): every peer announced call e with our signature and
// consumed our stores of call e-1 -- the rule before writing into a peer's workspace (docs/moe.md,
// "Signals, waits, reuse").  Bounded waits; the verdict is the same for every thread.
MK_DEVICE bool moe_peers_in_call(const MkComm& c, const MoeWs& w, mk_u64 e, int* verdict, int bar, int tid0, int n) {
  const int i = (int)threadIdx.x - tid0;
  if (i == 0) *verdict = 1;
  mk_named_barrier_sync(bar, n);
  for (int j = i; j < w.P; j += n)
    if (j != w.me && !(mk_same_call(c, w.header(), e, j) &&
                       mk_wait_geq(c, w.header().consumed(j), e - 1, MK_LOCAL_PEER(j), -1 - j)))
      *verdict = 0;
  mk_named_barrier_sync(bar, n);
  return *verdict != 0;
}

// Received row `row` -> its pair's index t * k + j at the owner; false for a value outside [0, P * T * k)
// (never, with a consistent routing: no wild store).
MK_DEVICE bool moe_row_pair(const MoeCombineArgs& a, const MoeWs& w, mk_u64 Tk, int row, int& owner, mk_u64& pair) {
  const int v = a.recv_map[row];
  if (v < 0 || (mk_u64)v >= (mk_u64)w.P * Tk) return false;
  owner = (int)((mk_u64)v / Tk);
  pair = (mk_u64)v % Tk;
  return true;
}

// The GEMM's epilogue: a tile's rows into their owners' staging rows, then the rows' counters (the file
// comment).  Named barrier 5 among the consumer warpgroups (the GEMM component uses 1-4, the finish 7).
template <int NC> struct MoeCombineStore {
  const MkComm* c;
  const MoeWs* w;
  const MoeCombineArgs* a;
  mk_u64 Tk, ep;
  int* verdict;       // shared: the block's peer check
  bool checked, ok;   // (the same in every consumer thread: they store the same tiles)
  static constexpr bool kTileDone = false;
  static constexpr bool kDrain = false;
  MK_DEVICE void drain() const {}
  MK_DEVICE void tile_done(const MkTile&) {}
  // the tile's columns of its row rr in the row's owner's staging (nullptr: past the tile, or no pair)
  MK_DEVICE MkOut* row_dest(const MkTile& t, int rr) const {
    int s;
    mk_u64 pair;
    if (rr >= t.rows || !moe_row_pair(*a, *w, Tk, t.row0 + rr, s, pair)) return nullptr;
    return reinterpret_cast<MkOut*>(w->peer(s) + w->L.stage_off + pair * w->L.row_bytes) + t.col0;
  }
  template <int BN> MK_DEVICE void store(const MkTile& t, int slab, const float (&acc)[BN / 2]) {
    if (!checked) {  // before the first store into a peer's workspace
      ok = moe_peers_in_call(*c, *w, ep, verdict, 5, 128, 128 * NC);
      checked = true;
    }
    if (!ok) return;
    int r0, c0;
    mk_wgmma_frag_origin(r0, c0);
    MkOut* const d0 = row_dest(t, 64 * slab + r0);
    MkOut* const d1 = row_dest(t, 64 * slab + r0 + 8);
    mk_wgmma_frag_for_each<BN>(acc, [&](int r, int col, float v0, float v1) {
      MkOut* const p = r == r0 ? d0 : d1;
      if (p == nullptr || col >= t.cols) return;
      if (col + 1 < t.cols) *reinterpret_cast<typename MkPair<MkOut>::V*>(p + col) = MkPair<MkOut>::make(v0, v1);
      else p[col] = mk_from_f32<MkOut>(v0);
    });
    mk_named_barrier_sync(5, 128 * NC);  // every row of the tile stored (release below covers the block's)
    const int i = (int)threadIdx.x - 128;
    int s;
    mk_u64 pair;
    if (i < t.rows && moe_row_pair(*a, *w, Tk, t.row0 + i, s, pair))
      mk_signal_add(reinterpret_cast<mk_u64*>(w->peer(s) + w->L.counts_off) + pair, 1);
  }
};

// The down GEMM's epilogue into the owners' combine staging of workspace w, call ep (verdict: the block's
// shared peer-check word).
template <int NC>
MK_DEVICE MoeCombineStore<NC> moe_combine_store(const MkComm& c, const MoeWs& w, const MoeCombineArgs& a,
                                                const MoeShape& s, mk_u64 ep, int* verdict) {
  MoeCombineStore<NC> e;
  e.c = &c;
  e.w = &w;
  e.a = &a;
  e.Tk = (mk_u64)s.T * s.k;
  e.ep = ep;
  e.verdict = verdict;
  e.checked = false;
  e.ok = true;
  return e;
}

// Sum blocks, one warp per token: false if a wait failed (recorded; the warp stops).
template <int BN>
MK_DEVICE bool moe_owner_sums(const MkComm& c, const MoeWs& w, const MoeCombineArgs& a, const MoeShape& s) {
  const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  const int warps = a.n_comm * nw, gw = blockIdx.x * nw + (threadIdx.x >> 5), k = s.k;
  const mk_u64 need = (mk_u64)((s.H + BN - 1) / BN);  // column tiles of a row
  mk_u64* cnt = reinterpret_cast<mk_u64*>(w.base + w.L.counts_off);
  const char* stage = w.base + w.L.stage_off;
  for (int t = gw; t < s.T; t += warps) {  // (warp-uniform)
    const mk_u64 q = (mk_u64)t * k + lane;
    int ok = 1;
    if (lane < k && a.slots[q] >= 0) ok = mk_wait_geq(c, cnt + q, need, MK_LOCAL_PEER(a.ids[q] / s.El), (int)q);
    if (!__all_sync(0xffffffffu, ok)) return false;
    __syncwarp();  // (the lanes' acquires order every lane's reads of the rows)
    moe_combine_token<MkOut, MkOut>(t, k, s.H, s.El, lane, a.slots, a.ids, a.weights, (MkOut*)a.out,
                                    [&](int j, int, int) {
                                      return (const MkOut*)(stage + ((mk_u64)t * k + j) * w.L.row_bytes);
                                    });
    if (lane < k) cnt[q] = 0;  // (the next call's adds follow our consumed signal)
  }
  return true;
}
