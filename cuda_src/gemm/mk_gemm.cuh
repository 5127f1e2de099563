// mk_gemm.cuh - the Hopper GEMM engine as a reusable device component (see docs/gemm.md).
//
// C[M, N] (+)= A[M, K] @ B, bf16/fp16 inputs, fp32 accumulation, on sm_90a:
//   * TMA loads of 64-wide K blocks of A (K-major) and B (K-major "nk" = stored [N, K], or MN-major
//     "kn" = stored [K, N]) into a STAGES-deep ring of 128B-swizzled shared-memory tiles, each stage
//     completed on a "full" mbarrier (transaction bytes) and released on an "empty" mbarrier;
//   * warp specialization: warpgroup 0 is the producer (one warp issues TMA; setmaxnreg.dec), warpgroups
//     1..NC are consumers (setmaxnreg.inc), each computing a 64 x BN slab of the BM x BN tile with
//     wgmma.m64nBNk16, one wgmma batch kept in flight;
//   * persistent: a block processes the tiles its Scheduler hands to `worker_id` of `num_workers`;
//     producer and consumers walk the same deterministic tile sequence independently, so the producer
//     runs ahead across tile boundaries while consumers run the epilogue.
//
// Policies (template parameters, all device-copyable structs):
//   Scheduler  MK_DEVICE void init(int worker_id, int num_workers);
//              MK_DEVICE bool next(MkTile& t);   // false when this worker has no more tiles
//              Must be deterministic and free of side effects visible to other threads: every role
//              of the block runs its own copy and must see the same sequence.
//   Hook       MK_DEVICE bool before_load(int group, int tile_m, int tile_n, int k_block, bool first) const;
//              Called by all 32 lanes of the producer warp before a K block's loads are issued (first:
//              the unit's first K block -- k_block 0, or the start of a split-K unit's range); may
//              wait (mk_warp_wait_geq) and must return a warp-uniform verdict.  false aborts: the
//              kernel's consumers are released and every role of the block returns (false).
//              static constexpr bool kPrefill (optional): true for hooks that never wait and always
//              return true (MkNoWait): the first unit's first ring of loads is then issued by thread 0
//              before the block barrier (before_load is still called for those K blocks, after), and
//              the consumers skip the per-K-block abort check.
//              MK_DEVICE const MkTensorMap* a_map(const MkTile& t, const MkTensorMap* tmA, int& a_row) const;
//              Where the tile's A rows are loaded from: a tensor map and the row of t.row0 in it
//              (MkNoWait: tmA and t.row0).  Lets a fused kernel read some rows in place (e.g. this
//              rank's own shard) and the others from a communication buffer.
//   Epilogue   template <int BN> MK_DEVICE void store(const MkTile& t, int slab, const float (&acc)[BN/2]);
//              Called by every consumer thread once the tile's accumulators are final; `slab` is the
//              consumer index (rows 64*slab .. 64*slab+63 of the tile); the fragment layout is that
//              of mk_wgmma.cuh (see mk_wgmma_frag_for_each).  Configs with two warpgroups side by
//              side along N (Cfg::WG_N == 2) call store<Cfg::WN> with slab = the warpgroup and a tile
//              whose row0 is 64*slab rows higher and whose col0 / cols are its WN-column part, so
//              rows 64*slab + r of that tile are the real tile's rows r.
//              static constexpr bool kTileDone; MK_DEVICE void tile_done(const MkTile& t);
//              If kTileDone, after every consumer thread has returned from store() (named barrier 1),
//              one consumer thread calls tile_done(t) (e.g. __threadfence_system + mk_signal_set).
//              Ping-pong configs (Cfg::PINGPONG): a tile is 64 x BN, owned by one consumer warpgroup w;
//              store() is called with slab = 0 by that warpgroup's 128 threads only, and tile_done(t)
//              by its first thread after named barrier 1 + w (128 threads).
//              static constexpr bool kDrain; MK_DEVICE void drain() const;  if kDrain, every consumer
//              thread calls drain() after its last tile (MkEpilogueTmaStore: wait for the TMA stores).
//              Provided: MkEpilogueStore (registers), MkEpilogueTmaStore (shared memory + TMA stores;
//              configs with staging boxes), MkSplitKEpilogue (wraps one of them for split-K tiles),
//              mk_with_store_epilogue / mk_gemm_run_store (the plain store the config supports);
//              MkEpilogueSwiGLU (mk_gemm_swiglu.cuh: silu(gate) * up of a MkGateUpB config's tile).
//
// Block shape: Cfg::THREADS threads (128 * (NC + 1)); every thread of the block calls mk_gemm_run
// (it initialises barriers and runs __syncthreads once, before the role split), or mk_gemm_run_two for two
// GEMMs one after the other on one ring (docs/gemm.md, "Two GEMMs in one block").  Dynamic shared
// memory: Cfg::SMEM_BYTES.  Named barriers 1 and 2 are used among consumer threads (3 and 4 by
// MkEpilogueTmaStore); a fused kernel
// must not use them concurrently.
#pragma once
#include "core/mk_common.cuh"
#include "core/mk_tma.cuh"
#include "core/mk_trace.cuh"
#include "core/mk_wgmma.cuh"

// ---- configuration --------------------------------------------------------------------------------
// NC consumer warpgroups (1-3; 3: 192-row tiles, setmaxnreg 40 / 152), BN columns (64, 96, 128, 144, 192,
// 224, 256 or 320; the odd widths exist to fill the SMs with fewer wasted tiles, 144, 224 and 320 only with
// B "nk"; 320 = two n160 wgmmas per k16 slice and two 160-row TMA boxes of B), STAGES ring slots, DT input dtype code, B_KN: B stored
// [K, N] (MN-major operand) instead of [N, K], PIPELINED: keep one wgmma batch in flight (0: wait for
// every batch; the debug configuration), PINGPONG (needs NC = 2): the two consumer warpgroups work on
// *different* 64 x BN tiles (BM = 64), alternating along the block's tile sequence, so one's epilogue
// runs while the other's main loop keeps the tensor cores busy (otherwise BM = 64*NC and every consumer
// warpgroup owns a 64-row slab of the same tile).  STAGING_BOXES_ > 0 (cooperative configs): each
// consumer warpgroup gets that many 8 KiB boxes (64 rows x 128 bytes) of shared memory through which
// MkEpilogueTmaStore writes its slab with TMA stores (0: no staging, register epilogues only).
// CLUSTER_N_ = 2: blocks run in clusters of two side by side along N (tiles (m, 2j) and (m, 2j+1));
// each loads one 64-row slab of the shared A tile and multicasts it to both (half the L2 -> SMEM
// traffic for A), and a ring slot is free only when both blocks' consumers released it.
// CLUSTER_M_ = 2: clusters of two blocks one above the other along M (tiles (2i, n) and (2i+1, n)), one
// consumer warpgroup each; each loads one half of the shared B tile (BN/2 rows of an "nk" tile, every
// other 64-column chunk of a "kn" one) and multicasts it to both (half the L2 -> SMEM traffic for B,
// as cuBLAS's 64-row kernels with clusters of 2 do on few-tile shapes).
// CLUSTER_N_ = CLUSTER_M_ = 2 (NC = 2: 128-row tiles): clusters of four blocks, 2 x 2 tiles (rank r =
// 2 * r_m + r_n has tile (2i + r_m, 2j + r_n)); each block loads 64-row slab r_n of its A tile, multicast
// to its row partner, and half r_m of its B tile, multicast to its column partner (half the L2 -> SMEM
// traffic for both operands, as cuBLAS's 2 x 4 / 4 x 1 clusters on mid-size and misaligned shapes).
// WG_N_ = 2 (NC = 2, BM = 64): the two consumer warpgroups multiply the tile's one 64-row A slab by
// the two WN = BN/2 column parts of B (m64nWNk16), as cuBLAS's 64-row kernels do -- two warpgroups
// feeding the tensor cores where one would issue n128 alone.
// CLUSTER_K_ = 2 or 4: split-K inside a cluster -- the CLUSTER_K blocks of a cluster compute the same
// tile over K ranges of their own and add their fp32 partials through distributed shared memory
// (MkClusterKScheduler, MkClusterKEpilogue: no global memory, no atomics); register epilogue only.
// A CM x CN cluster's rank r = CN * r_m + r_n: the block's row r_m and column r_n within the cluster (0 along a
// dimension of 1).  MkGemmConfig's multicast masks and MkClusterTileScheduler's tile offsets both use it.
template <int CM, int CN, class T> MK_DEVICE constexpr T mk_cluster_rank_m(T r) { return CM == 2 ? (CN == 2 ? r >> 1 : r) : T(0); }
template <int CM, int CN, class T> MK_DEVICE constexpr T mk_cluster_rank_n(T r) { return CN == 2 ? (CM == 2 ? r & T(1) : r) : T(0); }

template <int NC_, int BN_, int STAGES_, bool PIPELINED_, int DT_, bool B_KN_, bool PINGPONG_ = false,
          int STAGING_BOXES_ = 0, int CLUSTER_N_ = 1, int CLUSTER_K_ = 1, int CLUSTER_M_ = 1, int WG_N_ = 1>
struct MkGemmConfig {
  static constexpr int NC = NC_;
  static constexpr bool PINGPONG = PINGPONG_;
  // Consumer warpgroups side by side along N: 1 (each owns a 64-row slab of the tile) or 2 (NC = 2, BM =
  // 64: both multiply the same A slab, each into its own WN-column part of the tile).
  static constexpr int WG_N = WG_N_;
  static constexpr int BM = PINGPONG_ ? 64 : 64 * NC_ / WG_N_;
  static constexpr int BN = BN_;
  static constexpr int WN = BN_ / WG_N_;  // columns of one consumer warpgroup's accumulator (its wgmma N)
  static constexpr int BK = 64;  // 64 16-bit elements = one 128-byte swizzle row
  static constexpr int STAGES = STAGES_;
  static constexpr bool PIPELINED = PIPELINED_;
  static constexpr int DT = DT_;
  static constexpr bool B_KN = B_KN_;
  // B is a gate/up weight seen through the paired view of MkGateUpB (mk_gemm_swiglu.cuh)
  static constexpr bool B_GATE_UP = false;
  static constexpr int THREADS = 128 * (NC_ + 1);
  static constexpr int A_BYTES = BM * BK * 2;
  static constexpr int B_CHUNK_BYTES = 64 * BK * 2;  // one 64-column chunk of an MN-major B tile
  static constexpr int B_CHUNKS = (BN_ + 63) / 64;
  // smem reserved for B: BN*BK*2 rounded up to 8 KiB, or for an "nk" tile narrower than 64 rows to whole
  // 1024-byte swizzle atoms (8 rows)
  static constexpr int B_BYTES = (B_KN_ || BN_ >= 64) ? B_CHUNKS * B_CHUNK_BYTES : (BN_ * 128 + 1023) / 1024 * 1024;
  static constexpr int B_NK_TX_BYTES = BN_ * BK * 2;       // bytes an "nk" B tile's boxes deliver
  // "nk" B tiles wider than a TMA box (256 rows) load as two boxes of BN/2 rows (the host's map)
  static constexpr int B_NK_BOXES = BN_ > 256 ? 2 : 1;
  // Where tile column c (a multiple of 8; of 64 with "kn") starts in a ring slot's B tile: "nk" rows
  // are 128 bytes, "kn" columns come in 64-column chunks.
  static MK_DEVICE constexpr int b_col_bytes(int c) { return B_KN_ ? (c / 64) * B_CHUNK_BYTES : c * 128; }
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int BAR_OFFSET = STAGES * STAGE_BYTES;
  // TMA_STORE: the epilogue stages each consumer warpgroup's output in STAGING_BOXES 128B-swizzled
  // boxes of 64 rows x 128 bytes (a round of boxes at a time) and writes it with TMA stores.
  static constexpr int STAGING_BOXES = STAGING_BOXES_;
  static constexpr bool TMA_STORE = STAGING_BOXES_ > 0;
  // the ring's mbarriers (full + empty per stage) and flags: 256 bytes, 512 past 12 stages
  static constexpr int BAR_BYTES = STAGES_ > 12 ? 512 : 256;
  static constexpr int STAGING_OFFSET = (BAR_OFFSET + BAR_BYTES + 1023) / 1024 * 1024;
  static constexpr int STAGING_BYTES = NC_ * STAGING_BOXES_ * 8192;
  // Cluster split-K: a block finishes the 16-row bands of CK_OWNED_WARPS consumer warps and receives
  // CLUSTER_K - 1 fp32 fragments (one per other block) for each of them, at RX_OFFSET.
  static constexpr int CLUSTER_K = CLUSTER_K_;
  static constexpr int CK_OWNED_WARPS = 4 * NC_ / CLUSTER_K_;
  static constexpr int RX_WARP_BYTES = 32 * (BN_ / 2) * 4;  // one warp's fp32 accumulator fragment
  static constexpr int BODY_END = TMA_STORE ? STAGING_OFFSET + STAGING_BYTES : BAR_OFFSET + BAR_BYTES;
  static constexpr int RX_OFFSET = (BODY_END + 1023) / 1024 * 1024;
  // (reserved for the wider layout -- B_CHUNKS * 64 columns -- so "nk" and "kn" share one launch geometry)
  static constexpr int RX_BYTES = CLUSTER_K_ > 1 ? (CLUSTER_K_ - 1) * CK_OWNED_WARPS * 32 * (B_CHUNKS * 32) * 4 : 0;
  static constexpr int SMEM_BYTES = (CLUSTER_K_ > 1 ? RX_OFFSET + RX_BYTES : BODY_END) + 1024;  // + alignment slack
  // Consumer arrivals that release a ring slot: lane 0 of every warp of the warpgroup(s) reading it
  // (of both blocks of a cluster: the multicast writes the slot in both).
  static constexpr int CLUSTER_N = CLUSTER_N_;
  static constexpr int CLUSTER_M = CLUSTER_M_;
  static constexpr int SHARING = CLUSTER_N_ * CLUSTER_M_;  // blocks a ring slot's multicast loads fill
  static constexpr int EMPTY_ARRIVALS = (PINGPONG_ ? 4 : 4 * NC_) * SHARING;
  static_assert(CLUSTER_N_ == 1 || (CLUSTER_N_ == 2 && NC_ == 2 && !PINGPONG_),
                "clusters of 2 along N: cooperative configs with two 64-row slabs (one per block)");
  // cluster rank r = CLUSTER_N * r_m + r_n; the blocks that share this block's A tile (same r_m) and B tile
  // (same r_n), as multicast masks
  static MK_DEVICE mk_u32 rank_n(mk_u32 r) { return mk_cluster_rank_n<CLUSTER_M_, CLUSTER_N_>(r); }
  static MK_DEVICE mk_u32 rank_m(mk_u32 r) { return mk_cluster_rank_m<CLUSTER_M_, CLUSTER_N_>(r); }
  static MK_DEVICE unsigned short a_mask(mk_u32 r) { return (unsigned short)(0x3u << (CLUSTER_N_ * rank_m(r))); }
  static MK_DEVICE unsigned short b_mask(mk_u32 r) { return (unsigned short)((1u | (1u << CLUSTER_N_)) << rank_n(r)); }
  static_assert(WG_N_ == 1 || (WG_N_ == 2 && NC_ == 2 && !PINGPONG_ && CLUSTER_N_ == 1 && CLUSTER_K_ == 1 &&
                                (B_KN_ ? WN % 64 == 0 : WN % 8 == 0)),
                "warpgroups along N: two cooperative consumer warpgroups on a 64-row tile, whole column parts");
  static_assert(CLUSTER_M_ == 1 || (CLUSTER_M_ == 2 && !PINGPONG_ && CLUSTER_K_ == 1 &&
                                    (BM == 64 || (NC_ == 2 && WG_N_ == 1)) &&
                                    (B_KN_ ? B_CHUNKS % 2 == 0 : (BN_ / 2) % 8 == 0)),
                "clusters of 2 along M: 64-row tiles or 128-row ones (two slabs), B split in two "
                "1024-byte-aligned halves");
  static_assert(CLUSTER_K_ == 1 || ((CLUSTER_K_ == 2 || CLUSTER_K_ == 4) && NC_ == 2 && !PINGPONG_ &&
                                    !TMA_STORE && CLUSTER_N_ == 1),
                "cluster split-K: 2 or 4 blocks, cooperative configs with two slabs, register epilogue");
  static_assert(2 * STAGES_ * 8 + 16 + 8 * (CK_OWNED_WARPS + 1) <= BAR_BYTES, "cluster split-K barriers");
  // Register reallocation (with two or three consumer warpgroups: 128*40 + 256*232 = 64512,
  // 128*40 + 384*152 = 63488 <= 65536).
  static constexpr bool SETMAXNREG = NC_ >= 2;
  static constexpr int PRODUCER_REGS = 40;
  static constexpr int CONSUMER_REGS = NC_ == 3 ? 152 : 232;
  static_assert(NC_ >= 1 && NC_ <= 3, "one to three consumer warpgroups");
  static_assert(NC_ < 3 || (!PINGPONG_ && WG_N_ == 1 && CLUSTER_N_ == 1 && CLUSTER_K_ == 1 && CLUSTER_M_ == 1),
                "three consumer warpgroups: plain cooperative 192-row tiles");
  static_assert(BN_ == 16 || BN_ == 32 || BN_ == 64 || BN_ == 96 || BN_ == 128 || BN_ == 144 || BN_ == 192 ||
                    BN_ == 224 || BN_ == 256 || BN_ == 320,
                "BN must be 16, 32, 64, 96, 128, 144, 192, 224, 256 or 320");
  static_assert(BN_ <= 256 || (!B_KN_ && WG_N_ == 1 && CLUSTER_M_ == 1 && CLUSTER_K_ == 1),
                "320-column tiles: B \"nk\" (two 160-row TMA boxes, two n160 wgmmas), one slab per warpgroup");
  static_assert(BN_ != 96 || WG_N_ == 2 || CLUSTER_K_ > 1, "96-column tiles: two warpgroups of 48 columns, or cluster split-K");
  static_assert(!B_KN_ || BN_ % 64 == 0, "an MN-major (kn) B tile is made of whole 64-column chunks");
  static_assert(!PINGPONG_ || (NC_ == 2 && PIPELINED_), "ping-pong needs two pipelined consumer warpgroups");
  static_assert(!TMA_STORE || !PINGPONG_, "TMA-store epilogue: cooperative configs only");
  static_assert(2 * STAGES_ * 8 + 16 <= BAR_BYTES, "too many stages for the barrier area");
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory budget exceeded");
};

// A config whose producer warpgroup keeps more registers (fused kernels: their schedulers and hooks run
// on the producer).  PRODUCER_REGS * 128 + CONSUMER_REGS * 256 must stay <= 65536.
template <class Base, int PRODUCER_REGS_, int CONSUMER_REGS_> struct MkWithRegs : Base {
  static constexpr int PRODUCER_REGS = PRODUCER_REGS_;
  static constexpr int CONSUMER_REGS = CONSUMER_REGS_;
  static_assert(!Base::SETMAXNREG || 128 * PRODUCER_REGS_ + 128 * Base::NC * CONSUMER_REGS_ <= 65536,
                "register file exceeded");
  static_assert(PRODUCER_REGS_ % 8 == 0 && CONSUMER_REGS_ % 8 == 0, "setmaxnreg counts are multiples of 8");
};

// Compile-time choice between two types (no <type_traits> needed under NVRTC).
template <bool C, class A, class B> struct MkPick { typedef A T; };
template <class A, class B> struct MkPick<false, A, B> { typedef B T; };

// One output tile of one problem (or one split of its K range: split-K).
struct MkTile {
  int group;   // problem index (0 for a plain GEMM)
  int tile_m;  // tile coordinates inside the problem
  int tile_n;
  int row0;    // first row of A / C (absolute row, group offset included)
  int rows;    // valid rows in this tile (1..BM)
  int col0;    // first column of B / C
  int cols;    // valid columns in this tile (1..BN)
  int split = 0;   // split-K: this unit reduces K blocks [split*nkb/splits, (split+1)*nkb/splits)
  int splits = 1;  // (cooperative tile loop only; schedulers that never split leave the defaults)
  int slot = 0;    // split-K: the tile's index among the split tiles (its running sum and counter)
};

// The K blocks [lo, hi) of tile t's unit, of nkb in all.
MK_DEVICE void mk_tile_kblocks(const MkTile& t, int nkb, int& lo, int& hi) {
  lo = t.splits > 1 ? t.split * nkb / t.splits : 0;
  hi = t.splits > 1 ? (t.split + 1) * nkb / t.splits : nkb;
}

// Super-row rasterization: tiles are handed out GROUP_M tile-rows at a time, column by column inside
// a super-row, so concurrently running tiles share A rows and B columns in L2.
MK_DEVICE void mk_raster(int i, int num_m, int num_n, int group_m, int& tm, int& tn) {
  const int per_group = group_m * num_n;
  const int gid = i / per_group;
  const int first_m = gid * group_m;
  const int gsz = min(num_m - first_m, group_m);
  const int local = i - gid * per_group;
  tm = first_m + local % gsz;
  tn = local / gsz;
}

// ---- schedulers -------------------------------------------------------------------------------------
// Split-K units: unit ids before `split_from` are whole tiles; each later tile is `splits` units, one
// per K range, on consecutive ids (no split-K: split_from = the tile count).  Sets t's split fields
// and returns the tile's id.  Shared by MkLinearScheduler and the fused kernels' schedulers.
MK_DEVICE int mk_split_unit(int i, int splits, int split_from, MkTile& t) {
  if (i >= split_from) {
    const int u = i - split_from;
    t.slot = u / splits;
    t.split = u - t.slot * splits;
    t.splits = splits;
    return split_from + t.slot;
  }
  t.split = 0;
  t.splits = 1;
  return i;
}

// One problem of M x N, units u = worker_id, worker_id + num_workers, ...  Tiles (rasterized order)
// before `split_from` are one unit each; every later tile is `splits` units, one per K split, side by
// side on consecutive workers (splits = 1: no split-K; split_from = 0: every tile split, for problems
// with fewer tiles than SMs; split_from = a multiple of the worker count: whole waves of whole tiles,
// then the last, partial wave's tiles split so that it takes a fraction of a tile's time).  Split tiles
// need an epilogue that combines their units (MkSplitKEpilogue).
template <int BM, int BN> struct MkLinearScheduler {
  int M, N, num_m, num_n, group_m, total, splits, split_from;
  int next_i, step;
  MK_DEVICE MkLinearScheduler(int M_, int N_, int group_m_, int splits_ = 1, int split_from_ = 0)
      : M(M_), N(N_), group_m(group_m_ > 0 ? group_m_ : 1), splits(splits_ > 1 ? splits_ : 1) {
    num_m = (M + BM - 1) / BM;
    num_n = (N + BN - 1) / BN;
    const int tiles = num_m * num_n;
    split_from = splits > 1 ? min(max(split_from_, 0), tiles) : tiles;
    total = split_from + (tiles - split_from) * splits;
    next_i = 0;
    step = 1;
  }
  MK_DEVICE void init(int worker_id, int num_workers) {
    next_i = worker_id;
    step = num_workers;
  }
  MK_DEVICE bool next(MkTile& t) {
    if (next_i >= total) return false;
    const int i = mk_split_unit(next_i, splits, split_from, t);
    int tm, tn;
    mk_raster(i, num_m, num_n, group_m, tm, tn);
    next_i += step;
    t.group = 0;
    t.tile_m = tm;
    t.tile_n = tn;
    t.row0 = tm * BM;
    t.rows = min(BM, M - t.row0);
    t.col0 = tn * BN;
    t.cols = min(BN, N - t.col0);
    return true;
  }
};

// Clusters of CM x CN blocks sharing operand tiles by TMA multicast (Cfg::CLUSTER_M x Cfg::CLUSTER_N: 1 x 2
// along N sharing A, 2 x 1 along M sharing B, 2 x 2 sharing both): a cluster takes the units of
// MkLinearScheduler over tiles CM times as tall and CN times as wide, and cluster rank r = CN * r_m + r_n
// the tile (CM i + r_m, CN j + r_n) of each.  A member whose tile lies below M or right of N gets the
// unit anyway (rows or cols <= 0): it must still load and multicast its parts of the shared operands; the
// tile loop skips its epilogue.  Split tiles' slots are CM * CN * slot + r.
template <int BM, int BN, int CM, int CN> struct MkClusterTileScheduler {
  static_assert(CM >= 1 && CM <= 2 && CN >= 1 && CN <= 2 && CM * CN > 1, "clusters of 1 x 2, 2 x 1 or 2 x 2 blocks");
  static constexpr int CS = CM * CN;
  MkLinearScheduler<CM * BM, CN * BN> units;
  int M, N, rank;
  MK_DEVICE MkClusterTileScheduler(int M_, int N_, int group_m_, int splits_ = 1, int split_from_ = 0)
      : units(M_, N_, group_m_, splits_, split_from_), M(M_), N(N_), rank((int)mk_cluster_ctarank()) {}
  MK_DEVICE void init(int worker_id, int num_workers) { units.init(worker_id / CS, num_workers / CS); }
  MK_DEVICE bool next(MkTile& t) {
    if (!units.next(t)) return false;
    if constexpr (CM == 2) {
      t.tile_m = 2 * t.tile_m + mk_cluster_rank_m<CM, CN>(rank);
      t.row0 = t.tile_m * BM;
      t.rows = min(BM, M - t.row0);
    }
    if constexpr (CN == 2) {
      t.tile_n = 2 * t.tile_n + mk_cluster_rank_n<CM, CN>(rank);
      t.col0 = t.tile_n * BN;
      t.cols = min(BN, N - t.col0);
    }
    t.slot = CS * t.slot + rank;
    return true;
  }
};

// Cluster split-K (Cfg::CLUSTER_K == CK): the CK blocks of a cluster take the tiles of
// MkLinearScheduler (one per cluster at a time), cluster rank r the K blocks [r*nkb/CK, (r+1)*nkb/CK)
// of each (MkTile::split = r, splits = CK; MkClusterKEpilogue adds the partials, not MkSplitKEpilogue).
template <int BM, int BN, int CK> struct MkClusterKScheduler {
  MkLinearScheduler<BM, BN> tiles;
  int rank;
  MK_DEVICE MkClusterKScheduler(int M_, int N_, int group_m_)
      : tiles(M_, N_, group_m_), rank((int)mk_cluster_ctarank()) {}
  MK_DEVICE void init(int worker_id, int num_workers) { tiles.init(worker_id / CK, num_workers / CK); }
  MK_DEVICE bool next(MkTile& t) {
    if (!tiles.next(t)) return false;
    t.split = rank;
    t.splits = CK;
    t.slot = 0;
    return true;
  }
};

// Grouped problems (MoE experts): group g owns rows [offs[g], offs[g+1]) of A and C and B[g]; all
// groups share N and K.  Empty groups have no tiles.  Linear tile ids enumerate groups in order, each
// rasterized like a plain GEMM; the cursor only moves forward (a worker's ids increase).
template <int BM, int BN> struct MkGroupedScheduler {
  const void* offs;
  int offs_i32, num_groups, M, N, num_n, group_m;
  int next_i, step;
  int g, base, g_row0, g_row1, g_num_m;  // cursor: group g starts at linear tile `base`
  MK_DEVICE MkGroupedScheduler(const void* offs_, int offs_i32_, int G, int M_, int N_, int group_m_)
      : offs(offs_), offs_i32(offs_i32_), num_groups(G), M(M_), N(N_), group_m(group_m_ > 0 ? group_m_ : 1) {
    num_n = (N + BN - 1) / BN;
    next_i = 0;
    step = 1;
    g = -1;
    base = 0;
    g_row0 = g_row1 = 0;
    g_num_m = 0;
  }
  MK_DEVICE long long offset(int i) const {
    return offs_i32 ? (long long)((const int*)offs)[i] : ((const long long*)offs)[i];
  }
  // Offsets come from the device unchecked: each group is clamped to rows [0, M) and to a non-negative
  // count, so no offsets can make a tile read or write outside A and C (docs/gemm.md, grouped GEMM).
  MK_DEVICE void load_group(int gg) {
    g = gg;
    if (g < num_groups) {
      const long long r0 = min(max(offset(g), 0LL), (long long)M);
      const long long r1 = min(max(offset(g + 1), r0), (long long)M);
      g_row0 = (int)r0;
      g_row1 = (int)r1;
      g_num_m = (g_row1 - g_row0 + BM - 1) / BM;
    }
  }
  MK_DEVICE void init(int worker_id, int num_workers) {
    next_i = worker_id;
    step = num_workers;
    base = 0;
    load_group(0);
  }
  // Tiles of every worker together: next() hands out the linear ids [0, tiles()), each to one worker.
  MK_DEVICE int tiles() const {
    MkGroupedScheduler s = *this;
    int n = 0;
    for (int gg = 0; gg < num_groups; ++gg) {
      s.load_group(gg);
      n += s.g_num_m * num_n;
    }
    return n;
  }
  MK_DEVICE bool next(MkTile& t) {
    const int i = next_i;
    next_i += step;
    while (g < num_groups) {
      const int cnt = g_num_m * num_n;
      if (i < base + cnt) {
        int tm, tn;
        mk_raster(i - base, g_num_m, num_n, group_m, tm, tn);
        t.group = g;
        t.tile_m = tm;
        t.tile_n = tn;
        t.row0 = g_row0 + tm * BM;
        t.rows = min(BM, g_row1 - t.row0);
        t.col0 = tn * BN;
        t.cols = min(BN, N - t.col0);
        return true;
      }
      base += cnt;
      load_group(g + 1);
    }
    return false;
  }
};

// MkGroupedScheduler's tiles, in two phases: first every tile whose row block lies inside its group's
// `first` rows [first[g * stride], first[g * stride + 1]) (clamped into the group), then every other tile;
// each phase in MkGroupedScheduler's order (groups in turn, super-rows of group_m row blocks, column by
// column inside a super-row).  The fused MoE dispatch + GEMM passes each expert's rows from this rank: they
// land first (docs/moe.md, "Dispatch + grouped GEMM, fused").  Whatever `first` holds, the tiles are the
// same, each once: a range only decides a row block's phase.  Same MkTile fields as MkGroupedScheduler.
template <int BM, int BN> struct MkGroupedFirstScheduler {
  MkGroupedScheduler<BM, BN> grp;  // offsets and their clamping; the group under the cursor
  const int* first;
  int stride;
  int next_i, step;
  int phase;   // 0: row blocks inside the first rows, 1: the others, 2: done
  int base;    // linear id of the first tile of super-row sr (this phase)
  int sr;      // super-row of group grp.g under the cursor
  int fa, fb;  // row blocks [fa, fb) of group grp.g lie inside its first rows
  MK_DEVICE MkGroupedFirstScheduler(const void* offs_, int offs_i32_, int G, int M_, int N_, int group_m_,
                                    const int* first_, int stride_)
      : grp(offs_, offs_i32_, G, M_, N_, group_m_), first(first_), stride(stride_) {
    next_i = 0;
    step = 1;
    phase = base = sr = fa = fb = 0;
  }
  MK_DEVICE void load_group(int gg) {
    grp.load_group(gg);
    sr = 0;
    if (gg < grp.num_groups) {
      const int r0 = grp.g_row0, r1 = grp.g_row1;
      const int lo = min(max(first[gg * stride], r0), r1);
      const int hi = min(max(first[gg * stride + 1], lo), r1);
      // the blocks starting at lo or later and ending at hi or earlier (the last one ends at the group's end)
      fa = (lo - r0 + BM - 1) / BM;
      fb = max(fa, hi == r1 ? grp.g_num_m : (hi - r0) / BM);
    }
  }
  MK_DEVICE void init(int worker_id, int num_workers) {
    next_i = worker_id;
    step = num_workers;
    phase = 0;
    base = 0;
    load_group(0);
  }
  MK_DEVICE bool next(MkTile& t) {
    const int i = next_i;
    next_i += step;
    while (phase < 2) {
      if (grp.g >= grp.num_groups) {
        ++phase;
        load_group(0);
        continue;
      }
      const int m0 = sr * grp.group_m;
      if (m0 >= grp.g_num_m) {
        load_group(grp.g + 1);
        continue;
      }
      // this super-row's row blocks [m0, m1) of this phase: [c0, c1) (phase 0), the rest (phase 1)
      const int m1 = min(m0 + grp.group_m, grp.g_num_m);
      const int c0 = min(max(fa, m0), m1), c1 = min(max(fb, c0), m1);
      const int hole = phase ? c1 - c0 : 0;
      const int n = phase ? m1 - m0 - hole : c1 - c0;
      if (i < base + n * grp.num_n) {
        const int j = i - base;
        int tm = (phase ? m0 : c0) + j % n;
        if (tm >= c0) tm += hole;
        const int tn = j / n;
        t.group = grp.g;
        t.tile_m = tm;
        t.tile_n = tn;
        t.row0 = grp.g_row0 + tm * BM;
        t.rows = min(BM, grp.g_row1 - t.row0);
        t.col0 = tn * BN;
        t.cols = min(BN, grp.N - t.col0);
        return true;
      }
      base += n * grp.num_n;
      ++sr;
    }
    return false;
  }
};

// ---- producer hooks -----------------------------------------------------------------------------------
struct MkNoWait {
  static constexpr bool kPrefill = true;  // never waits: loads may be issued before the block barrier
  MK_DEVICE bool before_load(int, int, int, int, bool) const { return true; }
  MK_DEVICE const MkTensorMap* a_map(const MkTile& t, const MkTensorMap* tmA, int& a_row) const {
    a_row = t.row0;
    return tmA;
  }
};

// ---- epilogues -------------------------------------------------------------------------------------------
// Store the tile into a row-major C (row stride ldc elements), masked to the tile's valid rows/cols.
// vec_ok: C's base is aligned to two elements and ldc is even, so column pairs are stored as one vector.
template <typename OutT> struct MkPair;
template <> struct MkPair<__nv_bfloat16> {
  typedef __nv_bfloat162 V;
  static MK_DEVICE V make(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <> struct MkPair<__half> {
  typedef __half2 V;
  static MK_DEVICE V make(float a, float b) { return __floats2half2_rn(a, b); }
};
template <> struct MkPair<float> {
  typedef float2 V;
  static MK_DEVICE V make(float a, float b) { return make_float2(a, b); }
};

template <typename OutT> struct MkEpilogueStore {
  OutT* c;
  long long ldc;
  int vec_ok;
  static constexpr bool kTileDone = false;
  static constexpr bool kDrain = false;  // true: drain() is called by every consumer thread at the end
  MK_DEVICE void drain() const {}
  template <int BN> MK_DEVICE void store(const MkTile& t, int slab, const float (&acc)[BN / 2]) {
    store_from<BN, 0>(t, slab, acc);
  }
  // Only the fragment's column groups J0.. (tile columns 8*J0 and up: the TMA-store epilogue's columns
  // past its last whole box), and of those only tile columns c_lo.. (even: whole pairs).
  template <int BN, int J0> MK_DEVICE void store_from(const MkTile& t, int slab, const float (&acc)[BN / 2],
                                                      int c_lo = 0) {
    const int rbase = 64 * slab;
    OutT* const cbase = c + (long long)t.row0 * ldc + t.col0;
    mk_wgmma_frag_for_each<BN, J0>(acc, [&](int r, int col, float v0, float v1) {
      const int rr = rbase + r;
      if (rr < t.rows && col >= c_lo) {
        OutT* p = cbase + (long long)rr * ldc + col;
        if (col + 1 < t.cols) {
          if (vec_ok) {
            *reinterpret_cast<typename MkPair<OutT>::V*>(p) = MkPair<OutT>::make(v0, v1);
          } else {
            p[0] = mk_from_f32<OutT>(v0);
            p[1] = mk_from_f32<OutT>(v1);
          }
        } else if (col < t.cols) {
          p[0] = mk_from_f32<OutT>(v0);
        }
      }
    });
  }
  MK_DEVICE void tile_done(const MkTile&) {}
};

// The transposed store: the kernel computed C^T = B A^T (a plain GEMM with the operands' roles exchanged,
// mkernel/ops/gemm's swapped plans), so the tile's rows are C's columns and its columns C's rows:
// element (r, col) goes to C[(col0 + col) * ldc + row0 + r], masked to the tile's valid rows / cols, from
// registers (a warp's stores cover 8 consecutive columns of C in 4 rows: 16-byte pieces for 16-bit C).
template <typename OutT> struct MkEpilogueStoreT {
  OutT* c;
  long long ldc;
  static constexpr bool kTileDone = false;
  static constexpr bool kDrain = false;
  MK_DEVICE void drain() const {}
  template <int BN> MK_DEVICE void store(const MkTile& t, int slab, const float (&acc)[BN / 2]) {
    const int rbase = 64 * slab;
    OutT* const cbase = c + (long long)t.col0 * ldc + t.row0;
    mk_wgmma_frag_for_each<BN>(acc, [&](int r, int col, float v0, float v1) {
      const int rr = rbase + r;
      if (rr < t.rows) {
        if (col < t.cols) cbase[(long long)col * ldc + rr] = mk_from_f32<OutT>(v0);
        if (col + 1 < t.cols) cbase[(long long)(col + 1) * ldc + rr] = mk_from_f32<OutT>(v1);
      }
    });
  }
  MK_DEVICE void tile_done(const MkTile&) {}
};

// Store through shared memory and TMA (Cfg::TMA_STORE).  A box is 64 rows x 128 bytes of C (64 16-bit
// or 32 fp32 columns: BOXC), 128B-swizzled exactly as the C tensor map ({N, M}, box {BOXC, 64}) lays
// it out.  Per tile, each consumer warpgroup writes its 64-row slab in rounds of SB boxes: the thread
// that issued the previous round's stores waits until they have read the staging buffer, the
// warpgroup writes the round's fragment columns into it, fences (generic -> async proxy), and one
// thread issues a TMA store per box and commits; the warpgroup returns to the main loop while the
// stores drain (drain() waits for them before the block exits).  Columns past the last whole box
// (BN % BOXC, i.e. the 224-wide tile's last 32) are stored from registers (MkEpilogueStore).
//
// Masking: TMA clips a box only at C's bounds (rows >= M, columns >= N16).  Columns: a TMA store writes
// whole 16-byte pieces of a row -- it would write up to 15 bytes past N into a padded row (measured:
// tools/recheck_tiles.py) -- so the host's map ends at N16, N rounded down to 16 bytes, and the last
// tile's columns N16 .. N-1 are stored from registers; a tile's columns end at N or at the next tile
// (a 16-byte multiple), so clipping is exact.  Rows: a slab with fewer than 64 valid rows is
// written through TMA only if `clip_rows` (its rows end at M: a plain GEMM); otherwise (a group of a
// grouped GEMM, a shard of AllGather+GEMM ending inside C) the register epilogue writes it, so the
// next group's rows are never touched.  use_tma = 0: every tile through `direct` (C not 16-byte
// aligned).  Named barriers 3 + slab (128 threads each).
template <typename OutT, int SB> struct MkEpilogueTmaStore {
  MkEpilogueStore<OutT> direct;
  const MkTensorMap* tmC;   // {N, M} over C, box {BOXC, 64}, 128B swizzle
  unsigned char* staging;   // 1024-aligned, SB * 8 KiB per consumer warpgroup
  int use_tma;
  int clip_rows;            // 1: C's row bound is every tile's row bound (plain GEMM)
  static constexpr bool kTileDone = false;
  static constexpr bool kDrain = true;
  static constexpr int ESZ = (int)sizeof(OutT);
  static constexpr int BOXC = 128 / ESZ;  // columns per box
  template <int BN> MK_DEVICE void store(const MkTile& t, int slab, const float (&acc)[BN / 2]) {
    static_assert(SB > 0, "staging boxes");
    constexpr int FULL = BN / BOXC;                   // whole boxes in a tile row
    constexpr int ROUNDS = (FULL + SB - 1) / SB;
    constexpr int JB = BOXC / 8;                      // fragment column groups (8 columns) per box
    const int valid = t.rows - 64 * slab;
    if (valid <= 0) return;  // the slab lies below the tile's rows (uniform per warpgroup)
    if (!use_tma || (valid < 64 && !clip_rows)) {
      direct.template store<BN>(t, slab, acc);
      return;
    }
    const int wt = threadIdx.x & 127;
    unsigned char* const buf = staging + slab * (SB * 8192);
    // tile columns at and past `tail` lie beyond C's last 16-byte boundary (the map's N16): registers
    constexpr int VEC = 16 / ESZ;
    const int tail = ((t.col0 + t.cols) & ~(VEC - 1)) - t.col0;
    int r0, c0;
    mk_wgmma_frag_origin(r0, c0);
    const int sw = r0 & 7;  // rows r0 and r0 + 8 share the swizzle phase
    typedef typename MkPair<OutT>::V V;
#pragma unroll
    for (int h = 0; h < ROUNDS; ++h) {
      if (h * SB * BOXC >= t.cols) break;  // uniform: the rest of the tile lies right of N
      if (wt == 0) mk_tma_store_wait_read<0>();  // the previous round's stores have read the buffer
      mk_named_barrier_sync(3 + slab, 128);
#pragma unroll
      for (int bi = 0; bi < SB; ++bi) {
        const int b = h * SB + bi;
        if (b >= FULL) break;  // compile-time after unrolling
        unsigned char* const box = buf + bi * 8192;
#pragma unroll
        for (int jj = 0; jj < JB; ++jj) {
          const int j = b * JB + jj;
          const int cb = (8 * jj + c0) * ESZ;  // byte of the pair inside its 128-byte box row
          const int off = (((cb >> 4) ^ sw) << 4) + (cb & 15);
          *reinterpret_cast<V*>(box + r0 * 128 + off) = MkPair<OutT>::make(acc[4 * j], acc[4 * j + 1]);
          *reinterpret_cast<V*>(box + (r0 + 8) * 128 + off) = MkPair<OutT>::make(acc[4 * j + 2], acc[4 * j + 3]);
        }
      }
      mk_fence_proxy_async_smem();  // generic-proxy writes -> visible to the TMA unit
      mk_named_barrier_sync(3 + slab, 128);
      if (wt == 0) {
        const int row = t.row0 + 64 * slab;
#pragma unroll
        for (int bi = 0; bi < SB; ++bi) {
          const int b = h * SB + bi;
          if (b < FULL && b * BOXC < tail) mk_tma_store_2d(tmC, buf + bi * 8192, t.col0 + b * BOXC, row);
        }
        mk_tma_store_commit();
      }
    }
    // the columns past the last whole box (BN % BOXC), and C's columns past its last 16-byte boundary,
    // from registers
    if constexpr (BN % BOXC != 0) direct.template store_from<BN, FULL * JB>(t, slab, acc);
    if (tail < t.cols && tail < FULL * BOXC) direct.template store_from<BN, 0>(t, slab, acc, tail);
  }
  MK_DEVICE void tile_done(const MkTile&) {}
  // Every consumer thread at the end of the tile loop: the stores are complete before the block exits.
  MK_DEVICE void drain() const {
    if (use_tma && (threadIdx.x & 127) == 0) mk_tma_store_wait<0>();
  }
};

// ---- shared-memory carve-up ------------------------------------------------------------------------------
template <class Cfg> struct MkGemmSmem {
  unsigned char* base;  // 1024-byte aligned
  MK_DEVICE explicit MkGemmSmem(unsigned char* raw) {
    const mk_u32 a = mk_smem_addr(raw);
    base = raw + ((1024u - (a & 1023u)) & 1023u);
  }
  MK_DEVICE unsigned char* a(int s) const { return base + s * Cfg::STAGE_BYTES; }
  MK_DEVICE unsigned char* b(int s) const { return base + s * Cfg::STAGE_BYTES + Cfg::A_BYTES; }
  MK_DEVICE mk_u64* full(int s) const { return reinterpret_cast<mk_u64*>(base + Cfg::BAR_OFFSET) + s; }
  MK_DEVICE mk_u64* empty(int s) const { return reinterpret_cast<mk_u64*>(base + Cfg::BAR_OFFSET) + Cfg::STAGES + s; }
  MK_DEVICE unsigned char* staging() const { return base + Cfg::STAGING_OFFSET; }  // Cfg::TMA_STORE
  // Cluster split-K (Cfg::CLUSTER_K > 1): received fragments, their barriers (one per owned warp) and
  // the barrier that tells this block's senders their previous fragments were consumed.
  MK_DEVICE float* rx() const { return reinterpret_cast<float*>(base + Cfg::RX_OFFSET); }
  MK_DEVICE mk_u64* rx_full(int i) const {
    return reinterpret_cast<mk_u64*>(base + Cfg::BAR_OFFSET + 2 * Cfg::STAGES * 8 + 16) + i;
  }
  MK_DEVICE mk_u64* rx_free() const { return rx_full(Cfg::CK_OWNED_WARPS); }
  MK_DEVICE volatile int* abort_flag() const {
    return reinterpret_cast<volatile int*>(base + Cfg::BAR_OFFSET + 2 * Cfg::STAGES * 8);
  }
  // Ping-pong only: ring positions the producer has issued so far (see mk_gemm_run_pingpong).
  MK_DEVICE volatile unsigned* issued() const {
    return reinterpret_cast<volatile unsigned*>(base + Cfg::BAR_OFFSET + 2 * Cfg::STAGES * 8 + 4);
  }
};

// ---- pieces shared by the cooperative and ping-pong tile loops ----------------------------------------------
// Producer (one lane): arm full[stage] with the bytes of K block kb of tile t and issue its TMA loads
// (A rows from the map and row Hook::a_map gives; asked per K block, so nothing stays live in the
// 40-register producer across the loop).
// The A tile of a stage: one TMA load (box {64, BM}), or with clusters along N this block's 64-row slab
// (box {64, 64}) multicast to the two blocks sharing the tile, which then each count the whole A tile
// on their barrier.
template <class Cfg>
MK_DEVICE void mk_gemm_load_a(const MkGemmSmem<Cfg>& sm, int stage, const MkTensorMap* tmA, int k0, int a_row) {
  if constexpr (Cfg::CLUSTER_N == 2) {  // slab r_n, to the blocks sharing the A tile
    const mk_u32 r = mk_cluster_ctarank();
    const mk_u32 rn = Cfg::rank_n(r);
    mk_tma_load_2d_multicast(sm.a(stage) + rn * 64 * 128, tmA, sm.full(stage), k0, a_row + 64 * (int)rn, Cfg::a_mask(r));
  } else {
    mk_tma_load_2d(sm.a(stage), tmA, sm.full(stage), k0, a_row);
  }
}

// The B tile of a stage (kn: its first `nchunks` 64-column chunks), or with clusters along M this
// block's half -- BN/2 rows of an "nk" tile (the host's map has BN/2-row boxes), every other chunk of a
// "kn" one -- multicast to the two blocks sharing the tile, which then each count the whole tile on
// their barrier.
template <class Cfg>
MK_DEVICE void mk_gemm_load_b(const MkGemmSmem<Cfg>& sm, int stage, const MkTensorMap* tmB, const MkTile& t, int k0,
                              int nchunks) {
  // (clusters along M: half r_m, to the blocks sharing the B tile)
  const mk_u32 rank = Cfg::CLUSTER_M == 2 ? mk_cluster_ctarank() : 0u;
  const int r = (int)Cfg::rank_m(rank);
  const unsigned short mask = Cfg::b_mask(rank);
  if constexpr (Cfg::B_KN) {
    for (int j = r; j < nchunks; j += Cfg::CLUSTER_M) {
      if constexpr (Cfg::CLUSTER_M == 2)
        mk_tma_load_3d_multicast(sm.b(stage) + Cfg::b_col_bytes(64 * j), tmB, sm.full(stage), t.col0 + 64 * j, k0,
                                 t.group, mask);
      else
        mk_tma_load_3d(sm.b(stage) + Cfg::b_col_bytes(64 * j), tmB, sm.full(stage), t.col0 + 64 * j, k0, t.group);
    }
  } else if constexpr (Cfg::B_GATE_UP) {
    // (MkGateUpB: tmB is the 5-D view {K, PAIR, F / PAIR, 2, groups}; warpgroup part q's WN rows are
    // chunk col0 / WN + q of the gate rows, then the same chunk of the up rows)
#pragma unroll
    for (int q = 0; q < Cfg::WG_N; ++q)
      mk_tma_load_5d(sm.b(stage) + Cfg::b_col_bytes(q * Cfg::WN), tmB, sm.full(stage), k0, 0, t.col0 / Cfg::WN + q,
                     0, t.group);
  } else if constexpr (Cfg::CLUSTER_M == 2) {
    mk_tma_load_3d_multicast(sm.b(stage) + Cfg::b_col_bytes(r * (Cfg::BN / 2)), tmB, sm.full(stage), k0,
                             t.col0 + r * (Cfg::BN / 2), t.group, mask);
  } else {
#pragma unroll
    for (int h = 0; h < Cfg::B_NK_BOXES; ++h) {
      constexpr int ROWS = Cfg::BN / Cfg::B_NK_BOXES;
      mk_tma_load_3d(sm.b(stage) + h * ROWS * 128, tmB, sm.full(stage), k0, t.col0 + h * ROWS, t.group);
    }
  }
}

#ifndef MK_GEMM_PROBE
#define MK_GEMM_PROBE 0  // timing probes only (wrong results; docs/gemm.md, "Debugging on a GPU"): 1 = no loads at
                         // all (the consumers multiply whatever the ring holds), 2 = every K block loads K
                         // block kb % 2 (A and B tiles stay in L2: the fill without HBM), 3 = loads but no
                         // wgmma (the consumers wait for each K block and release it)
#endif
template <class Cfg, class Hook>
MK_DEVICE void mk_gemm_issue_loads(const MkGemmSmem<Cfg>& sm, int stage, const Hook& hook, const MkTensorMap* tmA_default,
                                   const MkTensorMap* tmB, const MkTile& t, int kb) {
#if MK_GEMM_PROBE == 1
  mk_mbar_arrive(sm.full(stage));
  return;
#elif MK_GEMM_PROBE == 2
  kb &= 1;
#endif
  int a_row;
  const MkTensorMap* tmA = hook.a_map(t, tmA_default, a_row);
  const int k0 = kb * Cfg::BK;
  // "kn": the 64-column chunks to load -- none wholly right of N (a pair along N's phantom half, cols <=
  // 0: none); a pair along M loads whole tiles
  const int nchunks = !Cfg::B_KN                        ? 0
                      : Cfg::CLUSTER_M == 2             ? Cfg::B_CHUNKS
                      : (Cfg::CLUSTER_N > 1 && t.cols <= 0) ? 0
                                                        : (t.cols + 63) / 64;
  const int b_bytes = Cfg::B_KN ? nchunks * Cfg::B_CHUNK_BYTES : Cfg::B_NK_TX_BYTES;
  mk_mbar_arrive_expect_tx(sm.full(stage), Cfg::A_BYTES + b_bytes);
  mk_gemm_load_a<Cfg>(sm, stage, tmA, k0, a_row);
  mk_gemm_load_b<Cfg>(sm, stage, tmB, t, k0, nchunks);
}

// The descriptor of k16 slice 0 of a B tile at shared address `b_addr` (K-major for "nk", MN-major
// chunks for "kn").
template <class Cfg> MK_DEVICE mk_u64 mk_gemm_b_desc(mk_u32 b_addr) {
  return Cfg::B_KN ? mk_wgmma_desc_mnmajor(b_addr, 0, Cfg::B_CHUNK_BYTES) : mk_wgmma_desc_kmajor(b_addr, 0);
}

// Consumer warpgroup: one K block (4 k16 slices) of acc(64 x WN) += A * B, committed as one wgmma
// batch; `da` / `db` describe k16 slice 0 of the stage's A slab (K-major) and B tile or column part (mk_gemm_b_desc),
// and slice k is k steps further (MK_WGMMA_K16_STEP_*): only adds, so a warp-uniform descriptor stays
// in uniform registers and the batch issues back to back.  accumulate = false: the first K block
// overwrites acc.
template <class Cfg>
MK_DEVICE void mk_gemm_mma_kblock(float (&acc)[Cfg::WN / 2], mk_u64 da, mk_u64 db, bool accumulate) {
  constexpr mk_u64 kStepB = Cfg::B_KN ? MK_WGMMA_K16_STEP_MNMAJOR : MK_WGMMA_K16_STEP_KMAJOR;
  mk_wgmma_fence_regs(acc);
  mk_wgmma_fence();
#pragma unroll
  for (int k = 0; k < Cfg::BK / 16; ++k) {
    MkWgmma<Cfg::WN, Cfg::DT, Cfg::B_KN ? 1 : 0>::mma(acc, da + MK_WGMMA_K16_STEP_KMAJOR * (mk_u64)k,
                                                      db + kStepB * (mk_u64)k, (accumulate || k > 0) ? 1 : 0);
  }
  mk_wgmma_commit();
}

// Hook::kPrefill (optional, default false): before_load never waits and always returns true, so the
// producer may issue the first unit's first ring of loads before the block barrier (MkNoWait).
template <class H, class = void> struct MkHookPrefill {
  static constexpr bool value = false;
};
template <class H> struct MkHookPrefill<H, decltype((void)H::kPrefill)> {
  static constexpr bool value = H::kPrefill;
};
static_assert(MkHookPrefill<MkNoWait>::value && !MkHookPrefill<MkTile>::value, "hook trait");

// Hook::side_work(warp, worker_id) (optional, declared by `static constexpr bool kSideWork = true`):
// run by warps 1..3 of the producer warpgroup -- idle in the tile loop -- after the block barrier, on
// the producer's register budget, concurrently with the block's tiles (e.g. a fused kernel's call
// bookkeeping that must not hold up the GEMM).  Cooperative configs only (a ping-pong loop with such a
// hook does not compile).
template <class H, class = void> struct MkHookSideWork {
  static constexpr bool value = false;
};
template <class H> struct MkHookSideWork<H, decltype((void)H::kSideWork)> {
  static constexpr bool value = H::kSideWork;
};

// Barrier setup shared by both loops; every thread of the block calls it (one __syncthreads).  Nothing
// before it may touch global memory the previous kernel in the stream writes (programmatic
// dependent launch: thread 0 waits for that kernel here).
// prefill(): called by thread 0 (the producer's issuing lane) once the barriers are initialised and
// fenced, before the block barrier: the first loads' latency overlaps the rest of the prologue.
template <class Cfg, class Prefill>
MK_DEVICE void mk_gemm_setup(const MkGemmSmem<Cfg>& sm, const MkTensorMap* tmA, const MkTensorMap* tmB,
                             Prefill&& prefill) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < Cfg::STAGES; ++s) {
      mk_mbar_init(sm.full(s), 1);
      mk_mbar_init(sm.empty(s), Cfg::EMPTY_ARRIVALS);  // lane 0 of every consumer warp reading the slot
    }
    if constexpr (Cfg::CLUSTER_K > 1) {
      for (int i = 0; i < Cfg::CK_OWNED_WARPS; ++i) mk_mbar_init(sm.rx_full(i), 1);  // + the senders' bytes
      mk_mbar_init(sm.rx_free(), (Cfg::CLUSTER_K - 1) * Cfg::CK_OWNED_WARPS);  // the other blocks' owner warps
    }
    *sm.abort_flag() = 0;
    *sm.issued() = 0;
    mk_mbar_init_fence();
    mk_tma_prefetch_desc(tmA);
    mk_tma_prefetch_desc(tmB);
    // Launched as a programmatic dependent: the previous kernel (which may write A, B, C or the
    // split-K workspace) is complete from here on, for every thread past the block barrier below.
    mk_grid_dependency_wait();
    prefill();
  }
  __syncthreads();
  // clusters: the peer's barriers are initialised before anyone multicasts into them or arrives
  if constexpr (Cfg::SHARING > 1 || Cfg::CLUSTER_K > 1) mk_cluster_sync();
}

// A consumer warp's release of a ring slot: on this block's empty barrier, and with clusters on every
// block's (the multicast writes the slot in all of them).
template <class Cfg>
MK_DEVICE void mk_gemm_release(mk_u64* empty_bar) {
  if constexpr (Cfg::SHARING > 1) {
#pragma unroll
    for (int r = 0; r < Cfg::SHARING; ++r) mk_mbar_arrive_cluster(empty_bar, (mk_u32)r);
  } else {
    mk_mbar_arrive(empty_bar);
  }
}

// ---- the ping-pong tile loop (Cfg::PINGPONG) -----------------------------------------------------------------
// The block's tiles (Scheduler order) j = 0, 1, 2, ... are 64 x BN; consumer warpgroup w computes the
// tiles with j % 2 == w, each alone (one m64nBNk16 per k16 slice, the whole tile in its registers), and
// runs that tile's epilogue while the other warpgroup's main loop uses the tensor cores.
//
// Ring bookkeeping: the producer fills ring positions p = 0, 1, 2, ... in tile order (tile j's K block
// kb is position j*nkb + kb, slot p % STAGES, phase parity (p / STAGES) & 1), so a warpgroup starts tile
// j at position j*nkb and simply never touches the other warpgroup's positions.  Because a warpgroup
// jumps over the other's positions, a parity wait alone could pass on a phase completed STAGES
// positions earlier (parity aliasing); the producer therefore publishes in shared memory how many
// positions it has issued, and a consumer waits for position p to be issued before its parity wait.  Each slot is read by
// one warpgroup, so its empty barrier counts 4 arrivals (EMPTY_ARRIVALS).  There is no cycle: the
// producer only waits for slots released by the warpgroup whose tile came earlier in the sequence.
//
// Abort (hook returned false at position p): the producer raises the smem abort flag, waits until the
// loads it already issued (positions p-STAGES .. p-1) have landed (their full barriers complete, so no
// TMA write is in flight when the block exits) and returns false.  Consumers poll the flag while they
// wait for a full barrier, so a warpgroup waiting on a position that will never be filled returns
// (after draining its wgmmas) instead of hanging; one that has run out of tiles returns true.
template <class Cfg, class Sched, class Hook, class Epi>
MK_DEVICE bool mk_gemm_run_pingpong(const MkTensorMap* tmA, const MkTensorMap* tmB, int K, Sched sched,
                                    const Hook& hook, Epi& epi, unsigned char* smem_raw, int worker_id,
                                    int num_workers) {
  static_assert(Cfg::PINGPONG && Cfg::NC == 2 && Cfg::BM == 64, "ping-pong layout");
  static_assert(!MkHookSideWork<Hook>::value, "Hook::side_work runs in the cooperative loop only");
  const MkGemmSmem<Cfg> sm(smem_raw);
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int nkb = (K + Cfg::BK - 1) / Cfg::BK;
  mk_gemm_setup<Cfg>(sm, tmA, tmB, [] {});

  if (tid < 128) {
    // ================= producer warpgroup =================
    mk_setmaxnreg_dec<Cfg::PRODUCER_REGS>();
    if (tid >= 32) return true;
    sched.init(worker_id, num_workers);
    unsigned pos = 0;  // ring positions issued so far
    MkTile t;
    while (sched.next(t)) {
      for (int kb = 0; kb < nkb; ++kb) {
        if (!hook.before_load(t.group, t.tile_m, t.tile_n, kb, kb == 0)) {
          if (lane == 0) *sm.abort_flag() = 1;
          const unsigned first = pos > (unsigned)Cfg::STAGES ? pos - Cfg::STAGES : 0u;
          for (unsigned q = first; q < pos; ++q) mk_mbar_wait(sm.full(q % Cfg::STAGES), (q / Cfg::STAGES) & 1u);
          __syncwarp();
          return false;
        }
        const int stage = (int)(pos % Cfg::STAGES);
        mk_mbar_wait(sm.empty(stage), ((pos / Cfg::STAGES) & 1u) ^ 1u);
        if (lane == 0) {
          mk_gemm_issue_loads<Cfg>(sm, stage, hook, tmA, tmB, t, kb);
          *sm.issued() = pos + 1;
        }
        __syncwarp();
        ++pos;
      }
    }
    return true;
  }

  // ================= consumer warpgroups =================
  mk_setmaxnreg_inc<Cfg::CONSUMER_REGS>();
  const int wg = tid / 128 - 1;  // 0 or 1
  float acc[Cfg::BN / 2];
#pragma unroll
  for (int i = 0; i < Cfg::BN / 2; ++i) acc[i] = 0.f;
  sched.init(worker_id, num_workers);
  bool aborted = false;
  unsigned j = 0;  // index of the tile in the block's sequence
  MkTile t;
  while (sched.next(t)) {
    const unsigned tile_j = j++;
    if ((int)(tile_j & 1u) != wg) continue;  // the other warpgroup's tile
    const unsigned start = tile_j * (unsigned)nkb;
    int stage = (int)(start % Cfg::STAGES);
    mk_u32 phase = (start / Cfg::STAGES) & 1u;
    int prev = -1;
    for (int kb = 0; kb < nkb; ++kb) {
      // Parity waits are exact only once position start+kb was issued (the slot's barrier has then
      // completed q or q+1 phases, never q-1); before that, wait for the producer to get there.
      while (*sm.issued() <= start + (unsigned)kb || !mk_mbar_try_wait(sm.full(stage), phase)) {
        if (*sm.abort_flag()) {
          aborted = true;
          break;
        }
      }
      if (aborted) break;
      mk_gemm_mma_kblock<Cfg>(acc, mk_wgmma_desc_kmajor(mk_smem_addr(sm.a(stage)), 0),
                                   mk_gemm_b_desc<Cfg>(mk_smem_addr(sm.b(stage))), kb > 0);
      mk_wgmma_wait<1>();  // the previous batch is done: its slot can be refilled
      mk_wgmma_fence_regs(acc);
      if (prev >= 0 && lane == 0) mk_mbar_arrive(sm.empty(prev));
      prev = stage;
      if (++stage == Cfg::STAGES) {
        stage = 0;
        phase ^= 1;
      }
    }
    mk_wgmma_wait<0>();
    mk_wgmma_fence_regs(acc);
    if (aborted) break;
    if (prev >= 0 && lane == 0) mk_mbar_arrive(sm.empty(prev));
    epi.template store<Cfg::BN>(t, 0, acc);
    if constexpr (Epi::kTileDone) {
      mk_named_barrier_sync(1 + wg, 128);
      if ((tid & 127) == 0) epi.tile_done(t);
    }
  }
  return !aborted;
}

// ---- the tile loop ----------------------------------------------------------------------------------------
// tmA: 2-D map over A (dims {K, rows}, box {64, BM}).  tmB: 3-D map over B (kn: dims {N, K, groups},
// box {64, 64, 1}; nk: dims {K, N, groups}, box {64, BN, 1}); both 128B-swizzled (mkernel/core/tensormap.py).
// K: the reduction length (k blocks = ceil(K / 64); loads past the maps' bounds are zero-filled).
// Its two roles are functions of their own so that a block can run two tile loops in sequence on one ring
// (mk_gemm_run_two): each takes the ring position to start from and returns where it stopped.

// Hook::kPrefill for this config: no clusters (a multicast needs the peer's barriers).  (A function, not a
// static member: NVRTC emits every referenced static constexpr member into the cubin's globals.)
template <class Cfg, class Hook> MK_DEVICE constexpr bool mk_gemm_prefills() {
  return MkHookPrefill<Hook>::value && Cfg::SHARING == 1 && Cfg::CLUSTER_K == 1;
}

// A position in the ring (the next slot and its phase parity) and a role's verdict so far.  (Returned by
// value: ring positions passed by reference cost the plain tile loop a few instructions.)
struct MkRingPos {
  int stage;
  mk_u32 phase;
  bool ok;  // false: the hook aborted
};

// The producer's issuing warp (all 32 lanes): the K blocks of every unit of `sched` for `worker_id` of
// `num_workers`, from ring position `at` on; returns the position past the last one issued.  The first
// `prefilled` K blocks were issued before the block barrier (mk_gemm_prefills).  ok false: the hook aborted --
// the abort flag is raised and the phase the consumers wait on next completed without data.
template <class Cfg, class Sched, class Hook>
MK_DEVICE MkRingPos mk_gemm_produce(const MkGemmSmem<Cfg>& sm, const MkTensorMap* tmA, const MkTensorMap* tmB,
                                    int nkb, Sched& sched, const Hook& hook, int worker_id, int num_workers,
                                    MkRingPos at, int prefilled) {
  const int lane = threadIdx.x & 31;
  int stage = at.stage;
  mk_u32 phase = at.phase;
  constexpr bool kPrefill = mk_gemm_prefills<Cfg, Hook>();
  sched.init(worker_id, num_workers);
  int issued = prefilled;  // (trace only: event 3 is the first issue, prefilled or not)
  MkTile t;
  while (sched.next(t)) {
    int kb_lo, kb_hi;
    mk_tile_kblocks(t, nkb, kb_lo, kb_hi);
    for (int kb = kb_lo; kb < kb_hi; ++kb) {
      if (!hook.before_load(t.group, t.tile_m, t.tile_n, kb, kb == kb_lo)) {
        // Abort: flag it, then complete the phase the consumers will wait on next without data.
        if (lane == 0) *sm.abort_flag() = 1;
        mk_mbar_wait(sm.empty(stage), phase ^ 1);
        if (lane == 0) mk_mbar_arrive(sm.full(stage));
        __syncwarp();
        return MkRingPos{stage, phase, false};
      }
      if (kPrefill && prefilled > 0) {  // issued before the block barrier (the first unit's first K blocks)
        --prefilled;
      } else {
        mk_mbar_wait(sm.empty(stage), phase ^ 1);
        if (lane == 0) {
          MK_TRACE_IF(3, issued++ == 0);
          mk_gemm_issue_loads<Cfg>(sm, stage, hook, tmA, tmB, t, kb);
          MK_TRACE(4);
        }
      }
      __syncwarp();
      if (++stage == Cfg::STAGES) {
        stage = 0;
        phase ^= 1;
      }
    }
  }
  return MkRingPos{stage, phase, true};
}

// A consumer thread: the units of `sched` for `worker_id` of `num_workers`, reading the ring from position `at`
// on, each stored through `epi` (and drained at the end when Epi::kDrain and kDrainHere; else the caller
// drains); returns the position past the last K block read (every slot read is released).  ok false: the
// producer aborted (the abort flag, read after each full barrier when kMayAbort).
template <class Cfg, bool kMayAbort, bool kDrainHere, class Sched, class Epi>
MK_DEVICE MkRingPos mk_gemm_consume(const MkGemmSmem<Cfg>& sm, int nkb, Sched& sched, Epi& epi, int worker_id,
                                    int num_workers, MkRingPos at) {
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  // (broadcast from lane 0: the compiler then knows the slab -- and every descriptor below -- is
  // warp-uniform and keeps them in uniform registers)
  const int wg = __shfl_sync(0xffffffffu, tid / 128 - 1, 0);
  // Cfg::WG_N == 1: warpgroup wg multiplies the tile's 64-row slab wg by the whole B tile; == 2: the
  // one 64-row slab by B's WN-column part wg (nk: WN rows of 128 bytes; kn: WN / 64 chunks)
  const int slab = Cfg::WG_N == 1 ? wg : 0;
  const int part = Cfg::WG_N == 1 ? 0 : wg;
  // descriptors of k16 slice 0 of ring slot 0; slot s is STAGE_BYTES / 16 further
  const mk_u64 da0 = mk_wgmma_desc_kmajor(mk_smem_addr(sm.a(0)) + slab * 64 * 128, 0);
  const mk_u64 db0 = mk_gemm_b_desc<Cfg>(mk_smem_addr(sm.b(0)) + part * Cfg::b_col_bytes(Cfg::WN));
  float acc[Cfg::WN / 2];
#pragma unroll
  for (int i = 0; i < Cfg::WN / 2; ++i) acc[i] = 0.f;
  sched.init(worker_id, num_workers);
  int stage = at.stage;
  mk_u32 phase = at.phase;
  bool aborted = false;
  int units = 0;  // (trace only)
  MkTile t;
  while (sched.next(t)) {
    int prev = -1;
    int kb_lo, kb_hi;
    mk_tile_kblocks(t, nkb, kb_lo, kb_hi);
    if constexpr (Cfg::CLUSTER_K > 1) {  // a block of the cluster may get no K block at all (nkb < CLUSTER_K)
      if (kb_lo == kb_hi) {
#pragma unroll
        for (int i = 0; i < Cfg::WN / 2; ++i) acc[i] = 0.f;
      }
    }
    bool ready = false;  // full[stage] already seen complete (checked at the end of the previous K block)
    for (int kb = kb_lo; kb < kb_hi; ++kb) {
      if (!ready) mk_mbar_wait(sm.full(stage), phase);
      if constexpr (kMayAbort) {
        if (*sm.abort_flag()) {
          aborted = true;
          break;
        }
      }
      if (tid == 128 && kb == kb_lo) {
        MK_TRACE_IF(5, units == 0);
        MK_TRACE(13);
      }
#if MK_GEMM_PROBE != 3
      const mk_u64 soff = (mk_u64)((mk_u32)stage * (mk_u32)(Cfg::STAGE_BYTES / 16));
      mk_gemm_mma_kblock<Cfg>(acc, da0 + soff, db0 + soff, kb > kb_lo);
#endif
      if constexpr (Cfg::PIPELINED) {
        mk_wgmma_wait<1>();  // the previous batch is done: its stage can be refilled
        mk_wgmma_fence_regs(acc);
        if (prev >= 0 && lane == 0) mk_gemm_release<Cfg>(sm.empty(prev));
      } else {
        mk_wgmma_wait<0>();
        mk_wgmma_fence_regs(acc);
        if (lane == 0) mk_gemm_release<Cfg>(sm.empty(stage));
      }
      prev = stage;
      if (++stage == Cfg::STAGES) {
        stage = 0;
        phase ^= 1;
      }
      // look at the next slot's barrier now: its latency overlaps the loop's bookkeeping instead of
      // delaying the next batch's issue
      ready = kb + 1 < kb_hi && mk_mbar_try_wait(sm.full(stage), phase);
    }
    if constexpr (Cfg::PIPELINED) {
      mk_wgmma_wait<0>();
      mk_wgmma_fence_regs(acc);
      if (!aborted && prev >= 0 && lane == 0) mk_gemm_release<Cfg>(sm.empty(prev));
    }
    if (tid == 128) {
      MK_TRACE_IF(6, units == 0);
      MK_TRACE(14);
    }
    if (aborted) break;
    // a cluster member's tile below M or right of N: nothing to store
    if ((Cfg::CLUSTER_M > 1 && t.rows <= 0) || (Cfg::CLUSTER_N > 1 && t.cols <= 0)) continue;
    if constexpr (Cfg::WG_N == 1) {
      epi.template store<Cfg::BN>(t, slab, acc);
    } else {
      // warpgroup wg's WN-column part, presented as slab wg of a tile that starts 64 * wg rows higher
      // (so the epilogue's rows 64 * slab + r are the tile's rows r, and its staging / barrier are wg's)
      MkTile tp = t;
      tp.row0 -= 64 * wg;
      tp.rows += 64 * wg;
      tp.col0 += Cfg::WN * wg;
      tp.cols -= Cfg::WN * wg;
      epi.template store<Cfg::WN>(tp, wg, acc);
    }
    MK_TRACE_STMT(++units);
    if (tid == 128) {
      MK_TRACE(9);
      MK_TRACE_VAL(12, units);
    }
    if constexpr (Epi::kTileDone) {
      mk_named_barrier_sync(1, 128 * Cfg::NC);
      if (tid == 128) epi.tile_done(t);
    }
  }
  if constexpr (Epi::kDrain && kDrainHere) epi.drain();
  return MkRingPos{stage, phase, !aborted};
}

// Returns false if the hook aborted.
template <class Cfg, class Sched, class Hook, class Epi>
MK_DEVICE bool mk_gemm_run_cooperative(const MkTensorMap* tmA, const MkTensorMap* tmB, int K, Sched sched,
                                       const Hook& hook, Epi& epi, unsigned char* smem_raw, int worker_id,
                                       int num_workers) {
  const MkGemmSmem<Cfg> sm(smem_raw);
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int nkb = (K + Cfg::BK - 1) / Cfg::BK;

  if (tid == 0) {
    MK_TRACE(0);
    MK_TRACE_NS(1);
  }
  // Prefill (hooks that never wait, no clusters: a multicast needs the peer's barriers): thread 0
  // issues the first unit's first min(STAGES, its K blocks) loads into ring slots 0.. (phase 0, whose
  // empty-barrier waits pass at once) before the block barrier; the producer loop skips them.
  constexpr bool kPrefill = mk_gemm_prefills<Cfg, Hook>();
  int prefilled = 0;
  mk_gemm_setup<Cfg>(sm, tmA, tmB, [&] {
    if constexpr (kPrefill) {
      Sched first = sched;
      first.init(worker_id, num_workers);
      MkTile t0;
      if (first.next(t0)) {
        int lo, hi;
        mk_tile_kblocks(t0, nkb, lo, hi);
        prefilled = min(hi - lo, Cfg::STAGES);
        MK_TRACE(3);
        for (int i = 0; i < prefilled; ++i) mk_gemm_issue_loads<Cfg>(sm, i, hook, tmA, tmB, t0, lo + i);
      }
    }
  });
  if (tid == 0) MK_TRACE(2);

  if (tid < 128) {
    // ================= producer warpgroup =================
    if constexpr (Cfg::SETMAXNREG) mk_setmaxnreg_dec<Cfg::PRODUCER_REGS>();
    if (tid >= 32) {
      if constexpr (MkHookSideWork<Hook>::value) hook.side_work(tid >> 5, worker_id);
      return true;
    }
    if constexpr (kPrefill) prefilled = __shfl_sync(0xffffffffu, prefilled, 0);  // (set by thread 0 = lane 0)
    const MkRingPos end = mk_gemm_produce<Cfg>(sm, tmA, tmB, nkb, sched, hook, worker_id, num_workers,
                                               MkRingPos{0, 0, true}, prefilled);
    if (!end.ok) return false;
    // every load of this block is issued: a dependent GEMM may start launching (its blocks wait for
    // this grid to complete before they read anything)
    if (lane == 0) mk_grid_launch_dependents();
    if constexpr (Cfg::SHARING > 1) {
      // Producer tail: every slot released by both blocks' consumers (the peer's remote arrivals on
      // our barriers have landed) before this block may exit.
      int stage = end.stage;
      mk_u32 phase = end.phase;
      for (int s = 0; s < Cfg::STAGES; ++s) {
        mk_mbar_wait(sm.empty(stage), phase ^ 1);
        if (++stage == Cfg::STAGES) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    return true;
  }

  // ================= consumer warpgroups =================
  if constexpr (Cfg::SETMAXNREG) mk_setmaxnreg_inc<Cfg::CONSUMER_REGS>();
  // hooks that never wait never abort: no abort flag to read in the main loop.  (The drain waits for the same
  // stores inside the role or after it; where it goes keeps this loop's cubins as they were before its roles
  // were functions, byte for byte: docs/gemm.md, "Two GEMMs in one block".)
  constexpr bool kMayAbort = !MkHookPrefill<Hook>::value;
  const MkRingPos end = mk_gemm_consume<Cfg, kMayAbort, kMayAbort>(sm, nkb, sched, epi, worker_id, num_workers,
                                                                   MkRingPos{0, 0, true});
  if constexpr (Epi::kDrain && !kMayAbort) epi.drain();
  if (tid == 128) {
    MK_TRACE(10);
    MK_TRACE_NS(11);
  }
  return end.ok;
}

// ---- two tile loops in one block ------------------------------------------------------------------------
// One GEMM's tile loop as mk_gemm_run_two takes it: config, maps, K, scheduler (by value, as mk_gemm_run
// takes it), hook and epilogue (by reference: they outlive the run).
template <class Cfg_, class Sched_, class Hook, class Epi> struct MkTileLoop {
  typedef Cfg_ Cfg;
  typedef Sched_ Sched;
  typedef Epi EpiT;
  // hooks that never wait never abort: the consumers then read no abort flag (as mk_gemm_run)
  static constexpr bool kMayAbort = !MkHookPrefill<Hook>::value;
  static_assert(!MkHookSideWork<Hook>::value, "two tile loops: no hook side work");
  const MkTensorMap* tmA;
  const MkTensorMap* tmB;
  int K;
  Sched_ sched;
  const Hook* hook;
  Epi* epi;
};
template <class Cfg, class Sched, class Hook, class Epi>
MK_DEVICE MkTileLoop<Cfg, Sched, Hook, Epi> mk_tile_loop(const MkTensorMap* tmA, const MkTensorMap* tmB, int K,
                                                         const Sched& sched, const Hook& hook, Epi& epi) {
  return MkTileLoop<Cfg, Sched, Hook, Epi>{tmA, tmB, K, sched, &hook, &epi};
}

// A fused kernel's two GEMMs one after the other in every block, on one ring (moe_layer.cu): every thread of
// the block calls this instead of mk_gemm_run.  One barrier setup and one role split: the producer issues
// loop 1's K blocks, then loop 2's from the ring position where loop 1's ended (every slot a consumer reads
// is released, so the two loops' K blocks are one sequence to the ring: no block barrier between them, and
// loop 2's first loads may be in flight while the consumers run loop 1's last epilogue); the consumers run
// loop 1, then loop 2.  Each role's code stays in its own branch of the role split, so ptxas keeps the
// setmaxnreg budgets (code that runs after mk_gemm_run returns runs under both: docs/gemm_ar.md).  A hook
// abort in loop 1 skips loop 2; the verdict is returned as mk_gemm_run's.  Loop 2's maps are prefetched in
// the setup.  The configs must lay out one ring alike (MkGateUpB<C> and C do): cooperative, unclustered, no
// hook side work; loop 2 is never prefilled.
template <class L1, class L2>
MK_DEVICE bool mk_gemm_run_two(const L1& l1, const L2& l2, unsigned char* smem_raw, int worker_id, int num_workers) {
  typedef typename L1::Cfg C1;
  typedef typename L2::Cfg C2;
  static_assert(!C1::PINGPONG && !C2::PINGPONG && C1::SHARING == 1 && C2::SHARING == 1 && C1::CLUSTER_K == 1 &&
                    C2::CLUSTER_K == 1,
                "two tile loops: cooperative, unclustered configs");
  static_assert(C1::STAGES == C2::STAGES && C1::STAGE_BYTES == C2::STAGE_BYTES && C1::A_BYTES == C2::A_BYTES &&
                    C1::BAR_OFFSET == C2::BAR_OFFSET && C1::EMPTY_ARRIVALS == C2::EMPTY_ARRIVALS &&
                    C1::THREADS == C2::THREADS && C1::SETMAXNREG == C2::SETMAXNREG &&
                    C1::PRODUCER_REGS == C2::PRODUCER_REGS && C1::CONSUMER_REGS == C2::CONSUMER_REGS,
                "two tile loops: one ring layout and one register split");
  const MkGemmSmem<C1> sm1(smem_raw);
  const MkGemmSmem<C2> sm2(smem_raw);
  const int tid = threadIdx.x;
  const int nkb1 = (l1.K + C1::BK - 1) / C1::BK, nkb2 = (l2.K + C2::BK - 1) / C2::BK;
  mk_gemm_setup<C1>(sm1, l1.tmA, l1.tmB, [&] {
    mk_tma_prefetch_desc(l2.tmA);
    mk_tma_prefetch_desc(l2.tmB);
  });
  typename L1::Sched s1 = l1.sched;
  typename L2::Sched s2 = l2.sched;
  if (tid < 128) {
    // ================= producer warpgroup =================
    if constexpr (C1::SETMAXNREG) mk_setmaxnreg_dec<C1::PRODUCER_REGS>();
    if (tid >= 32) return true;
    const MkRingPos mid = mk_gemm_produce<C1>(sm1, l1.tmA, l1.tmB, nkb1, s1, *l1.hook, worker_id, num_workers,
                                              MkRingPos{0, 0, true}, 0);
    if (!mid.ok) return false;
    return mk_gemm_produce<C2>(sm2, l2.tmA, l2.tmB, nkb2, s2, *l2.hook, worker_id, num_workers, mid, 0).ok;
  }
  // ================= consumer warpgroups =================
  if constexpr (C1::SETMAXNREG) mk_setmaxnreg_inc<C1::CONSUMER_REGS>();
  const MkRingPos mid = mk_gemm_consume<C1, L1::kMayAbort, true>(sm1, nkb1, s1, *l1.epi, worker_id, num_workers,
                                                                 MkRingPos{0, 0, true});
  if (!mid.ok) return false;
  return mk_gemm_consume<C2, L2::kMayAbort, true>(sm2, nkb2, s2, *l2.epi, worker_id, num_workers, mid).ok;
}

// The component's entry point (see the contract at the top of this file and docs/gemm.md).
template <class Cfg, class Sched, class Hook, class Epi>
MK_DEVICE bool mk_gemm_run(const MkTensorMap* tmA, const MkTensorMap* tmB, int K, Sched sched, const Hook& hook,
                           Epi& epi, unsigned char* smem_raw, int worker_id, int num_workers) {
  if constexpr (Cfg::PINGPONG) {
    return mk_gemm_run_pingpong<Cfg>(tmA, tmB, K, sched, hook, epi, smem_raw, worker_id, num_workers);
  } else {
    return mk_gemm_run_cooperative<Cfg>(tmA, tmB, K, sched, hook, epi, smem_raw, worker_id, num_workers);
  }
}

// Split-K (split tiles from MkLinearScheduler / AgScheduler): every unit adds its fp32 partial
// accumulators into its tile's running sum in `partials` (red.global.add.v4.f32, performed at L2) and
// counts itself in counters[tile]; the last one to count reads the sum back, re-zeroes it, resets the
// counter (so the next call finds both at 0: nothing to clean up between calls, CUDA-graph safe) and
// runs the inner epilogue.  Nothing waits.  The sum is fragment-ordered in 16-byte vectors (values
// i..i+3 of consumer thread ct at ((i/4) * NT + ct) * 4: a warp's vectors are contiguous) and read
// through L2 (ld.cg: other SMs added to it).  Units of unsplit tiles go straight to the inner
// epilogue.  Uses named barrier 1 (all consumer threads).
template <class Inner, int NC> struct MkSplitKEpilogue {
  Inner inner;
  float* partials;     // [split tiles][BN / 8][NT][4] fp32 running sums, indexed by MkTile::slot; 0 between calls
  int* counters;       // [split tiles], 0 between calls
  static constexpr int NT = 128 * NC;  // consumer threads
  static constexpr bool kTileDone = false;
  static constexpr bool kDrain = Inner::kDrain;
  MK_DEVICE void drain() const { inner.drain(); }
  MK_DEVICE void tile_done(const MkTile&) {}
  template <int BN> MK_DEVICE void store(const MkTile& t, int slab, float (&acc)[BN / 2]) {
    static_assert((BN / 2) % 4 == 0, "16-byte vectors of the accumulator");
    if (t.splits <= 1) {
      inner.template store<BN>(t, slab, acc);
      return;
    }
    __shared__ int last;
    const int ct = (int)threadIdx.x - 128;  // consumer thread (the producer warpgroup is threads 0..127)
    const int tile = t.slot;
    // Every unit adds its partial into the tile's one fp32 sum (vector reductions at L2: a warp's 32
    // vectors are contiguous), the last to count reads the sum back, re-zeroes it and stores the tile:
    // its serial part is one tile's read + one tile's zeroing, whatever the split factor.  (fp32
    // additions in arrival order: the low bits may differ between runs.)
    float* const sum = partials + (long long)tile * (BN / 2) * NT;
#pragma unroll
    for (int i = 0; i < BN / 2; i += 4) {
      float* const p = sum + ((long long)(i / 4) * NT + ct) * 4;
      asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(acc[i]), "f"(acc[i + 1]),
                   "f"(acc[i + 2]), "f"(acc[i + 3])
                   : "memory");
    }
    __threadfence();  // this thread's additions are performed device-wide before the tile's count
    if (ct == 0) MK_TRACE(7);
    mk_named_barrier_sync(1, NT);
    if (ct == 0) last = atomicAdd(counters + tile, 1) == t.splits - 1;
    mk_named_barrier_sync(1, NT);
    if (ct == 0) MK_TRACE(8);
    if (!last) return;
    if (ct == 0) MK_TRACE_COUNT(15);
    __threadfence();  // acquire: every unit's additions (counted before us) are visible
#pragma unroll
    for (int i = 0; i < BN / 2; i += 4) {
      float4* const p = reinterpret_cast<float4*>(sum + ((long long)(i / 4) * NT + ct) * 4);
      const float4 v = __ldcg(p);
      acc[i] = v.x, acc[i + 1] = v.y, acc[i + 2] = v.z, acc[i + 3] = v.w;
      __stcg(p, make_float4(0.f, 0.f, 0.f, 0.f));  // zero for the next call
    }
    if (ct == 0) counters[tile] = 0;  // every unit of this tile has counted: ready for the next call
    inner.template store<BN>(t, slab, acc);
  }
};
// Cluster split-K (Cfg::CLUSTER_K = CK blocks per tile, MkClusterKScheduler): consumer warp w's
// 16-row band of the tile (rows 16w ..) is finished by block w / OWNED of the cluster (OWNED =
// Cfg::CK_OWNED_WARPS).  Every other block's warp w writes its fp32 fragment into the owner's shared
// memory with st.async (16-byte vectors, lane-interleaved: conflict-free; counted in transaction
// bytes on the owner's rx_full[w % OWNED]); the owner's warp w adds the CK - 1 fragments to its own in
// block order (the same bits every run), tells every sender block its buffer is free (rx_free, in the
// sender's shared memory) and stores the band with the inner (register) epilogue.  No global memory,
// no atomics, nothing to clean up between calls.  drain(): a cluster barrier, so no block exits while
// a peer may still write into it or arrive on its barriers.
template <class Cfg, class Inner> struct MkClusterKEpilogue {
  Inner inner;
  MkGemmSmem<Cfg> sm;
  mk_u32 rank;
  mk_u32 phase;  // parity of the current tile (every block of the cluster sees the same tiles)
  static constexpr int CK = Cfg::CLUSTER_K, OWNED = Cfg::CK_OWNED_WARPS;
  static constexpr bool kTileDone = false;
  static constexpr bool kDrain = true;
  MK_DEVICE void tile_done(const MkTile&) {}
  MK_DEVICE void drain() const {
    if constexpr (Inner::kDrain) inner.drain();
    mk_cluster_sync();
  }
  template <int BN> MK_DEVICE void store(const MkTile& t, int slab, float (&acc)[BN / 2]) {
    static_assert((BN / 2) % 4 == 0, "16-byte vectors of the accumulator");
    constexpr int NV = BN / 8;  // 16-byte vectors per thread
    const int ct = (int)threadIdx.x - 128, w = ct >> 5, lane = ct & 31;
    const int owner = w / OWNED, wl = w % OWNED;
    if (owner != (int)rank) {
      mk_mbar_wait(sm.rx_free(), phase ^ 1);  // every owner consumed what we sent for the previous tile
      const int slot = (int)rank - ((int)rank > owner ? 1 : 0);  // our index among the owner's senders
      const mk_u32 dst = mk_cluster_map(sm.rx() + (mk_u32)((slot * OWNED + wl) * NV * 32 * 4), (mk_u32)owner);
      const mk_u32 bar = mk_cluster_map(sm.rx_full(wl), (mk_u32)owner);
#pragma unroll
      for (int i = 0; i < BN / 2; i += 4)
        mk_st_async_v4(dst + (mk_u32)(((i / 4) * 32 + lane) * 16), acc[i], acc[i + 1], acc[i + 2], acc[i + 3], bar);
    } else {
      if (lane == 0) mk_mbar_arrive_expect_tx(sm.rx_full(wl), (mk_u32)((CK - 1) * Cfg::RX_WARP_BYTES));
      mk_mbar_wait(sm.rx_full(wl), phase);
#pragma unroll
      for (int s = 0; s < CK - 1; ++s) {
        const float* src = sm.rx() + (s * OWNED + wl) * NV * 32 * 4;
#pragma unroll
        for (int i = 0; i < BN / 2; i += 4) {
          const float4 v = *reinterpret_cast<const float4*>(src + ((i / 4) * 32 + lane) * 4);
          acc[i] += v.x, acc[i + 1] += v.y, acc[i + 2] += v.z, acc[i + 3] += v.w;
        }
      }
      __syncwarp();
      if (lane == 0) {
#pragma unroll
        for (int b = 0; b < CK; ++b)
          if (b != (int)rank) mk_mbar_arrive_cluster(sm.rx_free(), (mk_u32)b);
      }
      inner.template store<BN>(t, slab, acc);
    }
    phase ^= 1;
  }
};

template <int NC, class Inner>
MK_DEVICE MkSplitKEpilogue<Inner, NC> mk_split_k_epilogue(const Inner& inner, float* partials, int* counters) {
  MkSplitKEpilogue<Inner, NC> e;
  e.inner = inner;
  e.partials = partials;
  e.counters = counters;
  return e;
}

// Calls f(epi) with the plain store epilogue this config has: through shared memory and TMA stores
// when the config has staging (Cfg::TMA_STORE) and C is TMA-addressable (c_tma), else from registers.
// tmC: {N, M} over C, box {128 / sizeof(OutT), 64}, 128B swizzle (unused otherwise).  clip_rows: see
// MkEpilogueTmaStore.
template <class Cfg, typename OutT, class F>
MK_DEVICE bool mk_with_store_epilogue(const MkEpilogueStore<OutT>& direct, const MkTensorMap* tmC, int c_tma,
                                      int clip_rows, unsigned char* smem_raw, F&& f) {
  if constexpr (Cfg::TMA_STORE) {
    MkEpilogueTmaStore<OutT, Cfg::STAGING_BOXES> epi;
    epi.direct = direct;
    epi.tmC = tmC;
    epi.staging = MkGemmSmem<Cfg>(smem_raw).staging();
    epi.use_tma = c_tma;
    epi.clip_rows = clip_rows;
    return f(epi);
  } else {
    MkEpilogueStore<OutT> epi = direct;
    return f(epi);
  }
}

// mk_gemm_run with that store epilogue.
template <class Cfg, class Sched, class Hook, typename OutT>
MK_DEVICE bool mk_gemm_run_store(const MkTensorMap* tmA, const MkTensorMap* tmB, const MkTensorMap* tmC, int K,
                                 Sched sched, const Hook& hook, const MkEpilogueStore<OutT>& direct, int c_tma,
                                 int clip_rows, unsigned char* smem_raw, int worker_id, int num_workers) {
  return mk_with_store_epilogue<Cfg>(direct, tmC, c_tma, clip_rows, smem_raw, [&](auto& epi) {
    return mk_gemm_run<Cfg>(tmA, tmB, K, sched, hook, epi, smem_raw, worker_id, num_workers);
  });
}
