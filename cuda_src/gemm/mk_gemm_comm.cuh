// mk_gemm_comm.cuh - policies of the GEMM component (mk_gemm.cuh) for GEMMs whose output tiles travel to
// other local ranks: GEMM + ReduceScatter (cuda_src/ops/gemm_rs.cu), GEMM + AllReduce (cuda_src/ops/gemm_ar.cu)
// and anything that reduces partial tiles on another rank.
//
//   MkOwnerRows          the row split: local rank j owns rows [offs[j], offs[j+1]) of the output
//   MkOwnerScheduler     every owner's tiles, owner by owner in rank-rotated order (me+1, me+2, ...,
//                        this rank's own rows last), each owner's tile grid rasterized on its own (no
//                        tile straddles two owners); t.tile_m = (tile row within the owner << 4) | owner
//   MkRsLayout           where partial tiles and their ready flags live in an op's symmetric workspace
//   MkGatherLayout       where reduced tiles pushed back by their owners and their flags live (all-reduce)
//   MkRsEpilogue         a peer's tile: its fp32 accumulators, converted to the partial dtype, stored
//                        into the owner's workspace (16-byte vectors, fragment order, over NVLink); an own
//                        tile: wait for every peer's partial, add them to the accumulators in a fixed
//                        order, store through the inner epilogue -- and with a gather dtype, push the
//                        reduced tile to every peer's gather slot (the all-reduce's second half)
//   MkOneShotEpilogue    every tile's partial to every peer, then every peer's partial of the same tile
//                        summed in rank order 0..P-1 (each rank reduces every tile: the one-shot all-reduce)
//   mk_frag_push / mk_frag_load_sum   fragment-ordered tile stores and fixed-order sums (shared by both)
//   mk_rs_raise_flags    an idle producer warp raises the owners' ready flags of the block's peer tiles (and
//                        the peers' gather flags of its own tiles) as the consumers finish them (the
//                        consumers never wait for the NVLink stores to drain)
//   MkRsHook             MkNoWait + the call's announcement (mk_signal.cuh) and mk_rs_raise_flags, on the
//                        producer warpgroup's idle warps (Hook::side_work)
//   mk_ar_receive        consumer threads after their tile loop: the peers' reduced tiles, as they arrive,
//                        copied from this rank's gather slots into out
//   mk_warp_wait_flags   one warp waits for up to 32 flags at once (MkPoll policy, error record)
//   mk_rs_finish         end of call: the last block tells every peer it consumed their data, commits
//
// Protocol (docs/gemm_rs.md, docs/gemm_ar.md): call e of rank `src` stores its partial of owner j's tile t
// into j's workspace, slot (src - j + P) % P - 1, at t * TILE_BYTES, then (mk_rs_raise_flags) raises j's
// ready[src][t] = e.  Before its first store into j's workspace in call e, a warp checks (in this rank's
// own workspace header) that j announced call e with this call's signature and consumed call e-1.  Owner
// j waits for ready[src][t] >= e of every src != j before it reads the slots.  The last block of j's call
// raises consumed[j] = e in every peer's header.  A failed wait (timeout, mismatch, another block's
// failure) marks the block failed in shared memory: it stores and raises nothing more, and leaves the
// epoch open.
//
// Named barriers (consumer threads only, beside the GEMM component's 1-4): 5 (a tile's wait verdict),
// 6 (MkOneShotEpilogue: every push of a tile issued), 7 (end of call).  Shared memory: `failed` (int) and
// `done` (u32, tiles the consumers finished), both zeroed by the kernel before the GEMM component's block
// barrier.
//
// Deadlock freedom: pushes wait only for the peers' announcement of this call and their consumption of
// the previous one (both raised at the start / end of the peers' calls, never behind this call's work);
// every block's own tiles come after all its peer tiles, and every block is resident (cooperative
// launch), so every push a waiting owner needs is made by a block that is not waiting.  Gather waits
// (mk_ar_receive) come after a block's whole tile loop and depend only on owners' own tiles, which depend
// only on pushes.  One-shot: every block pushes a tile before it waits for that tile, and every rank
// walks the same tile sequence on the same grid (docs/gemm_ar.md).
#pragma once
#include "core/mk_copy.cuh"
#include "core/mk_signal.cuh"
#include "gemm/mk_gemm.cuh"

#define MK_COMM_MAXP 16  // local ranks: t.tile_m carries the owner in its low 4 bits

// The row split (passed by value inside a kernel's argument struct; the schedulers read it there).
struct MkOwnerRows {
  int P, me;                  // local ranks, this rank
  int N;                      // output columns
  int group_m;                // rasterization super-row height (tiles)
  int offs[MK_COMM_MAXP + 1]; // owner j's rows are [offs[j], offs[j+1]) of A and of the full output
};

// Owner tiles in rank-rotated order: owner me+1 first, this rank's own last.  Units u = worker_id,
// worker_id + num_workers, ... of the concatenated per-owner tile grids.  Deterministic, no side effects.
template <int BM, int BN> struct MkOwnerScheduler {
  const MkOwnerRows* r;
  int next_i, step;
  MK_DEVICE explicit MkOwnerScheduler(const MkOwnerRows* r_) : r(r_), next_i(0), step(1) {}
  MK_DEVICE void init(int worker_id, int num_workers) {
    next_i = worker_id;
    step = num_workers;
  }
  MK_DEVICE bool next(MkTile& t) {
    int i = next_i;
    next_i += step;
    const int P = r->P, me = r->me, N = r->N;
    const int num_n = (N + BN - 1) / BN;
    for (int k = 1; k <= P; ++k) {
      const int owner = me + k < P ? me + k : me + k - P;
      const int row0 = r->offs[owner], rows = r->offs[owner + 1] - row0;
      const int cnt = (rows + BM - 1) / BM * num_n;
      if (i < cnt) {
        int tm, tn;
        mk_raster(i, (rows + BM - 1) / BM, num_n, r->group_m, tm, tn);
        t.group = 0;
        t.tile_m = (tm << 4) | owner;
        t.tile_n = tn;
        t.row0 = row0 + tm * BM;
        t.rows = min(BM, rows - tm * BM);
        t.col0 = tn * BN;
        t.cols = min(BN, N - t.col0);
        return true;
      }
      i -= cnt;
    }
    return false;
  }
};

// Where the partials live in every rank's workspace (the same offsets on every local rank; every offset
// before data_off depends on P only: mkernel/ops/gemm_rs/layout.py).
struct MkRsLayout {
  mk_u64 consumed_off;  // the call header (MkCallHeader: consumed, entered, sig)
  mk_u64 flags_off;     // u64 ready[src][flag_stride]: ready[src][t] = call that delivered src's tile t
  mk_u64 data_off;      // P - 1 slots of slot_bytes; slot (src - owner + P) % P - 1 holds src's tiles
  mk_u64 slot_bytes;
  int flag_stride;      // flags per source (tiles per owner never exceed it: the host's plan)
  int pad;
};

// Where the reduced tiles an all-reduce's owners push back live in every rank's workspace (offsets as
// MkRsLayout's: the flags' offset depends on P only).
struct MkGatherLayout {
  mk_u64 flags_off;   // u64 gath[owner][flag_stride]: gath[j][t] = call whose reduced tile t of owner j landed
  mk_u64 data_off;    // P - 1 slots of slot_bytes; slot mk_rs_slot(owner, me, P) holds owner's reduced tiles
  mk_u64 slot_bytes;
};

// Compile-time "is T void" (no <type_traits> under NVRTC).
template <class T> struct MkIsVoid { static constexpr bool value = false; };
template <> struct MkIsVoid<void> { static constexpr bool value = true; };

// Slot of sender `src` in owner `owner`'s workspace (P - 1 slots: an owner keeps no slot for itself).
MK_DEVICE int mk_rs_slot(int src, int owner, int P) {
  const int d = src - owner;
  return (d > 0 ? d : d + P) - 1;
}

// One warp waits until *flag >= expected in every lane that is `active` (each lane its own flag; inactive
// lanes pass).  All 32 lanes call it; the verdict is warp-uniform.  Polls as mk_wait_geq does (MkPoll:
// back-off, the error record read about every millisecond after the first), on lane 0's clock; a timeout
// is reported by the first late lane (error record naming `peer_of_lane`'s rank and `index`).
MK_DEVICE bool mk_warp_wait_flags(const MkComm& c, bool active, const mk_u64* flag, mk_u64 expected, int peer,
                                  int index) {
  const int lane = threadIdx.x & 31;
  mk_u64 v = active ? mk_ld_acquire(flag) : expected;
  bool ready = (mk_i64)(v - expected) >= 0;
  if (__all_sync(0xffffffffu, ready)) return true;
  MkPoll poll;
  poll.start();
  while (true) {
    poll.pause();
    if (!ready) {
      v = mk_ld_acquire(flag);
      ready = (mk_i64)(v - expected) >= 0;
    }
    if (__all_sync(0xffffffffu, ready)) break;
    mk_u64 dt;
    const int verdict = __shfl_sync(0xffffffffu, poll.tick(c, &dt), 0);
    if (verdict == 1) {
      const unsigned late = __ballot_sync(0xffffffffu, !ready);
      if (lane == __ffs(late) - 1) mk_report(c, MK_ERR_TIMEOUT, peer, index, expected, v, dt);
      return false;
    }
    if (verdict == 2 && __shfl_sync(0xffffffffu, lane == 0 ? (int)mk_failed(c) : 0, 0)) return false;
  }
  __syncwarp();  // every lane's acquire precedes the warp's later loads
  return true;
}

// Named barrier `id` over `nthreads` threads that also ANDs `pred` over them (bar.red.and): a verdict every
// participating thread gets alike.
MK_DEVICE bool mk_named_barrier_and(int id, int nthreads, bool pred) {
  unsigned r;
  asm volatile(
      "{\n.reg .pred q, p;\nsetp.ne.u32 q, %1, 0;\nbar.red.and.pred p, %2, %3, q;\nselp.u32 %0, 1, 0, p;\n}"
      : "=r"(r)
      : "r"((unsigned)pred), "r"(id), "r"(nthreads)
      : "memory");
  return r != 0;
}

// ---- fragment-ordered tiles ---------------------------------------------------------------------------------
// A tile travels in the accumulator fragment's order: 16-byte vector v of consumer thread ct (of NT) at byte
// (v * NT + ct) * 16 of the tile -- every warp stores (and the reader loads) 512 contiguous bytes per
// instruction, and the reader's thread ct finds exactly its own fragment's elements there (the same config
// on every rank), so no shuffle, no shared-memory transpose, no row arithmetic.  T: the element type on the
// wire (16-bit: 8 values per vector; float: 4).
template <typename T, int BN> struct MkFrag {
  static constexpr int VE = 16 / (int)sizeof(T);  // elements per 16-byte vector
  static constexpr int NV = (BN / 2) / VE;        // vectors per consumer thread
  static_assert((BN / 2) % VE == 0, "whole 16-byte vectors of the accumulator fragment");
  template <int NT> static constexpr mk_u64 tile_bytes() { return (mk_u64)NT * (BN / 2) * sizeof(T); }
};

// Store thread ct's accumulators, converted to T, into the fragment-ordered tile at `tile`.
template <typename T, int NT, int BN> MK_DEVICE void mk_frag_push(void* tile, int ct, const float (&acc)[BN / 2]) {
  typedef MkFrag<T, BN> F;
  int4* dst = (int4*)tile + ct;
#pragma unroll
  for (int v = 0; v < F::NV; ++v) dst[v * NT] = mk_pack<T>(&acc[v * F::VE]);
}

// acc (+)= thread ct's elements of the fragment-ordered tile at `tile` (ADD false: acc =), every load of the
// tile in flight at once, through L2 (peers rewrite the tile between calls).
template <typename T, int NT, int BN, bool ADD>
MK_DEVICE void mk_frag_load(float (&acc)[BN / 2], const void* tile, int ct) {
  typedef MkFrag<T, BN> F;
  const int4* src = (const int4*)tile + ct;
  int4 x[F::NV];
#pragma unroll
  for (int v = 0; v < F::NV; ++v) x[v] = __ldcg(src + v * NT);
#pragma unroll
  for (int v = 0; v < F::NV; ++v) {
    float f[F::VE];
    mk_unpack<T>(x[v], f);
#pragma unroll
    for (int q = 0; q < F::VE; ++q) {
      if (ADD) {
        acc[v * F::VE + q] += f[q];
      } else {
        acc[v * F::VE + q] = f[q];
      }
    }
  }
}

// acc rounded to T and back (what a rank sends of its partial is what it adds of its own).
template <typename T, int BN> MK_DEVICE void mk_frag_round(float (&acc)[BN / 2]) {
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = mk_to_f32(mk_from_f32<T>(acc[i]));
}

// Whether this consumer thread's fragment of slab `slab` holds an element of tile t's valid part (its rows
// r0, r0 + 8 of the slab, its columns c0 + 8j, c0 + 8j + 1): a thread that holds none need not send, wait
// for or sum anything of the tile (a decode tile of 1 valid row: 4 threads of 128 send).
MK_DEVICE bool mk_frag_holds(const MkTile& t, int slab) {
  int r0, c0;
  mk_wgmma_frag_origin(r0, c0);
  return 64 * slab + r0 < t.rows && c0 < t.cols;
}

// A warp's verdict on the block's `failed` flag (lane 0's read, so every lane takes the same branch into the
// warp-collective waits that follow).
MK_DEVICE bool mk_warp_failed(volatile int* failed) {
  return __shfl_sync(0xffffffffu, (threadIdx.x & 31) == 0 ? *failed : 0, 0) != 0;
}

// This warp may write into local peer j's workspace for call `epoch`: j announced this very call (same
// signature) and consumed the previous one.  Lane 0 waits (in this rank's own header: the peers write
// there); `opened` caches the owners already checked by this warp.  All 32 lanes call it.
MK_DEVICE bool mk_open_peer(const MkComm& c, const char* ws, mk_u64 consumed_off, int P, mk_u64 epoch, int j,
                            unsigned& opened) {
  if ((opened >> j) & 1u) return true;
  int ok = 1;
  if ((threadIdx.x & 31) == 0) {
    const MkCallHeader h{(mk_u64*)(ws + consumed_off), P};
    ok = mk_same_call(c, h, epoch, j) && mk_wait_geq(c, h.consumed(j), epoch - 1, MK_LOCAL_PEER(j), -1 - j);
  }
  ok = __shfl_sync(0xffffffffu, ok, 0);
  if (ok) opened |= 1u << j;
  return ok != 0;
}

// The reduce-scatter epilogue (cooperative configs with one slab per consumer warpgroup: Cfg::WG_N == 1).
// Partial tiles travel fragment-ordered (MkFrag).  PT: the partial dtype.
// Sum order of an own tile: this rank's fp32 accumulators, then the peers' partials in ascending rank
// order -- fixed whatever order they arrive in, so every run gives the same bits; starting from the
// accumulators frees the registers a separate running sum would need, so all of one peer's loads of the
// tile are in flight at once.
// GT (gather dtype; void: none): after the inner store, the reduced tile, converted to GT (out's dtype),
// goes to every peer's gather slot (MkGatherLayout `G`; mk_rs_raise_flags raises its flags) -- the
// all-reduce's all-gather half; out is then the whole [M, N] output (every rank stores every row) instead
// of the owner's rows.
// A failed wait marks the block failed (`failed`, shared): its warps store and raise nothing more.  An own
// tile's verdict is voted over every consumer thread (named barrier 5) before the inner epilogue, whose
// TMA path synchronizes each warpgroup: no warp may skip it alone.
template <class Inner, int NC, int BN, typename PT, typename GT = void> struct MkRsEpilogue {
  Inner inner;
  const MkComm* c;
  const MkOwnerRows* rows;
  const MkRsLayout* L;
  char* ws;                // this rank's workspace
  const mk_u64* peers;     // local rank -> its workspace base, as mapped here
  mk_u64 epoch;
  volatile int* failed;    // shared: 1 once any warp of the block failed a wait
  unsigned* done;          // shared: tiles of this block whose epilogue every consumer thread finished
  const MkGatherLayout* G = nullptr;  // (GT != void)
  unsigned opened = 0;     // owners whose slot this warp may write in this call (checked once each)
  unsigned tiles = 0;      // (the tile_done thread's count)

  static constexpr int NT = 128 * NC;                          // consumer threads
  static constexpr mk_u64 TILE_BYTES = MkFrag<PT, BN>::template tile_bytes<NT>();
  static constexpr bool kGather = !MkIsVoid<GT>::value;
  static constexpr bool kTileDone = true;
  static constexpr bool kDrain = Inner::kDrain || kGather;
  // Every consumer thread after its last tile (in the consumer branch of the tile loop, under the consumer
  // register budget: code after mk_gemm_run returns runs under the producer's too).  With a gather dtype:
  // the receive units (mk_ar_receive), dealt round robin first to the blocks with one tile fewer (the GEMM
  // units go round robin from block 0): they finish their tile loop first.
  MK_DEVICE void drain();

  MK_DEVICE int index(const MkTile& t) const { return (t.tile_m >> 4) * ((rows->N + BN - 1) / BN) + t.tile_n; }
  MK_DEVICE mk_u64 tile_off(int src, int owner, int idx) const {
    return L->data_off + (mk_u64)mk_rs_slot(src, owner, rows->P) * L->slot_bytes + (mk_u64)idx * TILE_BYTES;
  }
  MK_DEVICE bool open(int owner) { return mk_open_peer(*c, ws, L->consumed_off, rows->P, epoch, owner, opened); }

  template <int BN_> MK_DEVICE void store(const MkTile& t, int slab, float (&acc)[BN_ / 2]) {
    static_assert(BN_ == BN, "one slab per consumer warpgroup (Cfg::WG_N == 1)");
    const int P = rows->P, me = rows->me, owner = t.tile_m & 15, idx = index(t);
    const int ct = (int)threadIdx.x - 128;
    if (owner != me) {
      if (*failed) return;
      if (!open(owner)) {
        *failed = 1;
        return;
      }
      mk_frag_push<PT, NT, BN>((char*)peers[owner] + tile_off(me, owner, idx), ct, acc);
      return;
    }
    // own tile: every peer's partial has landed (lane s watches ready[s][idx])
    const int lane = (int)threadIdx.x & 31;
    const bool active = lane < P && lane != me;
    const mk_u64* flag = (const mk_u64*)(ws + L->flags_off) + (active ? lane * L->flag_stride + idx : 0);
    bool ok = *failed == 0;
    if (ok) ok = mk_warp_wait_flags(*c, active, flag, epoch, MK_LOCAL_PEER(lane), lane * L->flag_stride + idx);
    if (!mk_named_barrier_and(5, NT, ok)) {
      *failed = 1;
      return;
    }
    for (int s = 0; s < P; ++s) {
      if (s == me) continue;
      mk_frag_load<PT, NT, BN, true>(acc, ws + tile_off(s, me, idx), ct);
    }
    MkTile o = t;
    if constexpr (!kGather) o.row0 -= rows->offs[me];  // a reduce-scatter's output holds the owner's rows only
    inner.template store<BN>(o, slab, acc);
    if constexpr (kGather) {
      // the reduced tile to every peer (after the inner store: its TMA path synchronizes the warpgroup, so
      // no warp may leave before it); the same bits as our own out's (round to nearest either way)
      for (int j = 0; j < P; ++j) {
        if (j == me) continue;
        if (mk_warp_failed(failed) || !open(j)) {
          *failed = 1;
          break;
        }
        constexpr mk_u64 GB = MkFrag<GT, BN>::template tile_bytes<NT>();
        mk_frag_push<GT, NT, BN>((char*)peers[j] + G->data_off + (mk_u64)mk_rs_slot(me, j, P) * G->slot_bytes +
                                     (mk_u64)idx * GB,
                                 ct, acc);
      }
    }
  }

  // One consumer thread, after every consumer thread stored the tile (the GEMM component's named barrier
  // 1): publish the block's count of finished tiles (release, CTA scope) for mk_rs_raise_flags.
  MK_DEVICE void tile_done(const MkTile&) {
    ++tiles;
    asm volatile("st.release.cta.shared.u32 [%0], %1;" ::"r"(mk_smem_addr(done)), "r"(tiles) : "memory");
  }
};

// Lane 0 of one warp (a producer warp, idle in the tile loop): walks the block's tile sequence and, for
// each peer tile (and with GATHER each own tile), waits until the consumers finished it (`done`: acquire of
// tile_done's release, which follows the consumers' named barrier), then raises the owner's ready flag
// (GATHER, own tile: every peer's gather flag) -- its fence orders the consumers' stores, synchronized
// through that chain, before the flag.  The fence waits for the tile's NVLink stores to drain; here it
// holds no consumer warp, so the next tile's MMAs run meanwhile.  Terminates: tile_done runs for every
// tile of the block (the hook never aborts the loop).
template <int BM, int BN, bool GATHER = false>
MK_DEVICE void mk_rs_raise_flags(const MkOwnerRows* rows, const MkRsLayout* L, const mk_u64* peers, mk_u64 epoch,
                                 const unsigned* done, volatile int* failed, int worker, int workers,
                                 const MkGatherLayout* G = nullptr) {
  if ((threadIdx.x & 31) != 0) return;
  MkOwnerScheduler<BM, BN> sched(rows);
  sched.init(worker, workers);
  const mk_u32 done_addr = mk_smem_addr(done);
  const int P = rows->P, me = rows->me, num_n = (rows->N + BN - 1) / BN;
  unsigned j = 0;
  MkTile t;
  while (sched.next(t)) {
    ++j;
    const int owner = t.tile_m & 15;
    if (owner == me && !GATHER) continue;
    while (true) {
      unsigned seen;
      asm volatile("ld.acquire.cta.shared.u32 %0, [%1];" : "=r"(seen) : "r"(done_addr) : "memory");
      if (seen >= j) break;
      __nanosleep(128);
    }
    if (*failed) continue;
    const int idx = (t.tile_m >> 4) * num_n + t.tile_n;
    if (owner != me) {
      mk_signal_set((mk_u64*)((char*)peers[owner] + L->flags_off) + me * L->flag_stride + idx, epoch);
    } else if constexpr (GATHER) {
      __threadfence_system();  // (once: every release below is ordered after the tile's stores)
      for (int k = 0; k < P; ++k)
        if (k != me) mk_st_release((mk_u64*)((char*)peers[k] + G->flags_off) + me * L->flag_stride + idx, epoch);
    }
  }
}

template <int NC, int BN, typename PT, typename GT = void, class Inner>
MK_DEVICE MkRsEpilogue<Inner, NC, BN, PT, GT> mk_rs_epilogue(const Inner& inner, const MkComm* c,
                                                             const MkOwnerRows* rows, const MkRsLayout* L, char* ws,
                                                             const mk_u64* peers, mk_u64 epoch, volatile int* failed,
                                                             unsigned* done, const MkGatherLayout* G = nullptr) {
  MkRsEpilogue<Inner, NC, BN, PT, GT> e;
  e.inner = inner;
  e.c = c;
  e.rows = rows;
  e.L = L;
  e.ws = ws;
  e.peers = peers;
  e.epoch = epoch;
  e.failed = failed;
  e.done = done;
  e.G = G;
  return e;
}

// The one-shot all-reduce epilogue (cooperative configs, Cfg::WG_N == 1; every rank runs the same tile
// sequence -- MkLinearScheduler over the whole output -- on the same grid).  Per tile: the partial, rounded
// to PT, goes to every peer's slot of this rank (slot s of a workspace: rank s's partials; tile t at
// t * TILE_BYTES, fragment order); once every consumer thread issued its stores (named barrier 6), threads
// 0 .. P-1 raise peer ct's ready[me][t]; then every warp waits for every peer's ready[s][t], and the tile is
// summed in rank order 0..P-1 (fp32; the own partial at its rank's turn, rounded as it was sent), so every
// rank computes the same bits, and stored through the inner epilogue.  Only the threads whose fragment holds
// part of the tile's valid region send and sum (mk_frag_holds).
// Sum order: P == 2: own + peer (fp32 addition commutes: p0 + p1 either way); me == 0: own, then slots
// 1..P-1; otherwise slot 0, 1, ..., P-1 with the own partial stored into this rank's own slot first (a
// running sum beside the accumulators would double the registers).
// Deadlock freedom: a block pushes a tile before it waits for that tile; the block of the same index on
// every rank has the same tile at the same place of its sequence; every block is resident.
template <class Inner, int NC, int BN, typename PT> struct MkOneShotEpilogue {
  Inner inner;
  const MkComm* c;
  const MkRsLayout* L;     // P slots (slot s: rank s's partials) and ready[src][flag_stride]
  char* ws;
  const mk_u64* peers;
  mk_u64 epoch;
  volatile int* failed;
  int P, me, num_n;        // ranks, this rank, tile columns of the kernel's problem
  unsigned opened = 0;

  static constexpr int NT = 128 * NC;
  static constexpr mk_u64 TILE_BYTES = MkFrag<PT, BN>::template tile_bytes<NT>();
  static constexpr bool kTileDone = false;
  static constexpr bool kDrain = Inner::kDrain;
  MK_DEVICE void drain() const { inner.drain(); }
  MK_DEVICE void tile_done(const MkTile&) {}
  MK_DEVICE mk_u64 tile_off(int src, int idx) const {
    return L->data_off + (mk_u64)src * L->slot_bytes + (mk_u64)idx * TILE_BYTES;
  }

  template <int BN_> MK_DEVICE void store(const MkTile& t, int slab, float (&acc)[BN_ / 2]) {
    static_assert(BN_ == BN, "one slab per consumer warpgroup (Cfg::WG_N == 1)");
    const int idx = t.tile_m * num_n + t.tile_n;
    const int ct = (int)threadIdx.x - 128, lane = (int)threadIdx.x & 31;
    const bool holds = mk_frag_holds(t, slab);
    mk_frag_round<PT, BN>(acc);
    bool ok = !mk_warp_failed(failed);
    for (int j = 0; j < P && ok; ++j)
      if (j != me) ok = mk_open_peer(*c, ws, L->consumed_off, P, epoch, j, opened);
    if (ok && holds) {
      for (int j = 0; j < P; ++j)
        if (j != me) mk_frag_push<PT, NT, BN>((char*)peers[j] + tile_off(me, idx), ct, acc);
      if (P > 2 && me > 0) mk_frag_push<PT, NT, BN>(ws + tile_off(me, idx), ct, acc);
    }
    if (!mk_named_barrier_and(6, NT, ok)) {  // every consumer thread's stores of the tile issued
      *failed = 1;
      return;
    }
    if (ct < P && ct != me)
      mk_signal_set((mk_u64*)((char*)peers[ct] + L->flags_off) + me * L->flag_stride + idx, epoch);
    // every peer's partial of this tile (lane s watches ready[s][idx])
    const bool active = lane < P && lane != me;
    const mk_u64* flag = (const mk_u64*)(ws + L->flags_off) + (active ? lane * L->flag_stride + idx : 0);
    ok = mk_warp_wait_flags(*c, active, flag, epoch, MK_LOCAL_PEER(lane), lane * L->flag_stride + idx);
    if (!mk_named_barrier_and(5, NT, ok)) {
      *failed = 1;
      return;
    }
    if (holds) {
      if (P == 2) {
        mk_frag_load<PT, NT, BN, true>(acc, ws + tile_off(1 - me, idx), ct);
      } else {
        if (me > 0) mk_frag_load<PT, NT, BN, false>(acc, ws + tile_off(0, idx), ct);
        for (int s = 1; s < P; ++s) mk_frag_load<PT, NT, BN, true>(acc, ws + tile_off(s, idx), ct);
      }
    }
    inner.template store<BN>(t, slab, acc);
  }
};

template <int NC, int BN, typename PT, class Inner>
MK_DEVICE MkOneShotEpilogue<Inner, NC, BN, PT> mk_one_shot_epilogue(const Inner& inner, const MkComm* c,
                                                                    const MkRsLayout* L, char* ws,
                                                                    const mk_u64* peers, mk_u64 epoch,
                                                                    volatile int* failed, int P, int me, int num_n) {
  MkOneShotEpilogue<Inner, NC, BN, PT> e;
  e.inner = inner;
  e.c = c;
  e.L = L;
  e.ws = ws;
  e.peers = peers;
  e.epoch = epoch;
  e.failed = failed;
  e.P = P;
  e.me = me;
  e.num_n = num_n;
  return e;
}

// MkNoWait (loads never wait) plus work for the producer warpgroup's idle warps: worker 0's warp 1 writes
// this rank's entered / sig entries into every peer's header at once (mk_announce_call); with FLAGS, warp 2
// of every block raises its tiles' flags (mk_rs_raise_flags; workers = the grid): MK_FLAGS_RS the owners'
// ready flags of its peer tiles, MK_FLAGS_RS_GATHER those and the peers' gather flags of its own tiles.
#define MK_FLAGS_NONE 0
#define MK_FLAGS_RS 1
#define MK_FLAGS_RS_GATHER 2
template <int BM, int BN, int FLAGS = MK_FLAGS_RS> struct MkRsHook : MkNoWait {
  const MkComm* c;
  const MkOwnerRows* rows;
  const MkRsLayout* L;
  const mk_u64* peers;
  mk_u64 epoch;
  const unsigned* done;
  volatile int* failed;
  const MkGatherLayout* G = nullptr;  // (MK_FLAGS_RS_GATHER)
  static constexpr bool kSideWork = true;
  MK_DEVICE void side_work(int warp, int worker) const {
    if (warp == 2 && FLAGS != MK_FLAGS_NONE) {
      mk_rs_raise_flags<BM, BN, FLAGS == MK_FLAGS_RS_GATHER>(rows, L, peers, epoch, done, failed, worker,
                                                            (int)gridDim.x, G);
    } else if (warp == 1 && worker == 0) {
      const int P = rows->P;
      const mk_u64* pt = peers;
      const mk_u64 off = L->consumed_off;
      mk_announce_call(*c, [&](int j) { return MkCallHeader{(mk_u64*)((char*)pt[j] + off), P}; }, epoch,
                       (int)threadIdx.x & 31, 32);
    }
  }
};

// Consumer threads (all NT of them, after their tile loop): every peer owner's reduced tiles, as their
// gather flags come up, copied from this rank's gather slots into out through `inner` (the store epilogue;
// exact: GT -> fp32 -> GT).  Units: the peer owners' tiles in MkOwnerScheduler's order (own tiles come last:
// none of them), round robin from `worker` of `workers`.  Each wait's verdict is voted over the consumer
// threads (named barrier 5: the inner TMA path synchronizes each warpgroup); a failed wait marks the block
// failed and every thread stops at the same unit.  Error records name gather flags P * flag_stride + j *
// flag_stride + t (ready flags are below P * flag_stride).
template <int BM, int BN, int NC, typename GT, class Inner>
MK_DEVICE void mk_ar_receive(Inner& inner, const MkComm& c, const MkOwnerRows* rows, const MkRsLayout* L,
                             const MkGatherLayout* G, const char* ws, mk_u64 epoch, volatile int* failed, int worker,
                             int workers) {
  constexpr int NT = 128 * NC;
  constexpr mk_u64 GB = MkFrag<GT, BN>::template tile_bytes<NT>();
  const int P = rows->P, me = rows->me, num_n = (rows->N + BN - 1) / BN;
  const int ct = (int)threadIdx.x - 128, slab = __shfl_sync(0xffffffffu, ct / 128, 0);
  const int lane = (int)threadIdx.x & 31;
  MkOwnerScheduler<BM, BN> sched(rows);
  sched.init(worker, workers);
  float acc[BN / 2];
  MkTile t;
  while (sched.next(t)) {
    const int owner = t.tile_m & 15;
    if (owner == me) break;
    const int idx = (t.tile_m >> 4) * num_n + t.tile_n;
    const mk_u64* flag = (const mk_u64*)(ws + G->flags_off) + owner * L->flag_stride + idx;
    bool ok = !mk_warp_failed(failed);
    if (ok)
      ok = mk_warp_wait_flags(c, lane == 0, flag, epoch, MK_LOCAL_PEER(owner), (P + owner) * L->flag_stride + idx);
    if (!mk_named_barrier_and(5, NT, ok)) {
      *failed = 1;
      break;
    }
    mk_frag_load<GT, NT, BN, false>(acc, ws + G->data_off + (mk_u64)mk_rs_slot(owner, me, P) * G->slot_bytes +
                                             (mk_u64)idx * GB,
                                    ct);
    inner.template store<BN>(t, slab, acc);
  }
}
template <class Inner, int NC, int BN, typename PT, typename GT>
MK_DEVICE void MkRsEpilogue<Inner, NC, BN, PT, GT>::drain() {
  if constexpr (kGather) {
    const int P = rows->P, grid = (int)gridDim.x;
    int units = 0;
    for (int j = 0; j < P; ++j) units += (rows->offs[j + 1] - rows->offs[j] + (64 * NC) - 1) / (64 * NC);
    units *= (rows->N + BN - 1) / BN;
    const int worker = ((int)blockIdx.x - units % grid + grid) % grid;
    mk_ar_receive<(64 * NC), BN, NC, GT>(inner, *c, rows, L, G, ws, epoch, failed, worker, grid);
  }
  if constexpr (Inner::kDrain) inner.drain();
}

// End of call, run by the `nthreads` consumer threads from `tid0` (the producer warpgroup has returned,
// so no code runs under both setmaxnreg budgets; named barrier 7): the block arrives; the last block tells
// every peer this rank consumed its partials of this call (consumed[me] = epoch in the peer's header),
// then commits the epoch.  A block that failed (`failed`) returns without arriving: the epoch stays open.
MK_DEVICE void mk_rs_finish(MkEpochState* s, const mk_u64* peers, mk_u64 consumed_off, int P, int me, mk_u64 epoch,
                            volatile int* failed, int tid0, int nthreads) {
  __shared__ int last;
  const int t = (int)threadIdx.x - tid0;
  mk_named_barrier_sync(7, nthreads);  // every thread of the group is done with the call's data
  if (*failed) return;
  if (t == 0) {
    __threadfence();
    last = atomicAdd(&s->arrived, 1u) == gridDim.x - 1;
  }
  mk_named_barrier_sync(7, nthreads);
  if (!last) return;
  for (int j = t; j < P; j += nthreads)
    if (j != me) mk_signal_set(MkCallHeader{(mk_u64*)((char*)peers[j] + consumed_off), P}.consumed(me), epoch);
  mk_named_barrier_sync(7, nthreads);
  if (t == 0) {
    s->arrived = 0;
    __threadfence();
    *((volatile mk_u64*)&s->epoch) = epoch;
  }
}
