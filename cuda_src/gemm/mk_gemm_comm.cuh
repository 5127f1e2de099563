// mk_gemm_comm.cuh - policies of the GEMM component (mk_gemm.cuh) for GEMMs whose output tiles belong to
// other local ranks: GEMM + ReduceScatter (cuda_src/ops/gemm_rs.cu) and anything that reduces partial
// tiles on the rank that owns their rows.
//
//   MkOwnerRows          the row split: local rank j owns rows [offs[j], offs[j+1]) of the output
//   MkOwnerScheduler     every owner's tiles, owner by owner in rank-rotated order (me+1, me+2, ...,
//                        this rank's own rows last), each owner's tile grid rasterized on its own (no
//                        tile straddles two owners); t.tile_m = (tile row within the owner << 4) | owner
//   MkRsLayout           where partial tiles and their ready flags live in an op's symmetric workspace
//   MkRsEpilogue         a peer's tile: its fp32 accumulators, converted to the partial dtype, stored
//                        into the owner's workspace (16-byte vectors, fragment order, over NVLink); an own
//                        tile: wait for every peer's partial, add them to the accumulators in a fixed
//                        order, store through the inner epilogue
//   mk_rs_raise_flags    an idle producer warp raises the owners' ready flags of the block's peer tiles as
//                        the consumers finish them (the consumers never wait for the NVLink stores to drain)
//   MkRsHook             MkNoWait + the call's announcement (mk_signal.cuh) and mk_rs_raise_flags, on the
//                        producer warpgroup's idle warps (Hook::side_work)
//   mk_warp_wait_flags   one warp waits for up to 32 flags at once (MkPoll policy, error record)
//   mk_rs_finish         end of call: the last block tells every peer it consumed their partials, commits
//
// Protocol (docs/gemm_rs.md): call e of rank `src` stores its partial of owner j's tile t into j's
// workspace, slot (src - j + P) % P - 1, at t * TILE_BYTES, then (mk_rs_raise_flags) raises j's
// ready[src][t] = e.  Before its
// first store into j's slot in call e, a warp checks (in this rank's own workspace header) that j
// announced call e with this call's signature and consumed call e-1.  Owner j waits for ready[src][t] >= e
// of every src != j before it reads the slots.  The last block of j's call raises consumed[j] = e in
// every peer's header.  A failed wait (timeout, mismatch, another block's failure) marks the block failed
// in shared memory: it stores and raises nothing more, and leaves the epoch open.
//
// Named barriers (consumer threads only, beside the GEMM component's 1-4): 5 (an own tile's verdict),
// 7 (end of call).  Shared memory: `failed` (int) and `done` (u32, tiles the consumers finished), both
// zeroed by the kernel before the GEMM component's block barrier.
//
// Deadlock freedom: pushes wait only for the peers' announcement of this call and their consumption of
// the previous one (both raised at the start / end of the peers' calls, never behind this call's work);
// every block's own tiles come after all its peer tiles, and every block is resident (cooperative
// launch), so every push a waiting owner needs is made by a block that is not waiting.
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

// The reduce-scatter epilogue (cooperative configs with one slab per consumer warpgroup: Cfg::WG_N == 1).
// Partial tiles are stored in fragment order: 16-byte vector v of consumer thread ct at byte
// (v * NT + ct) * 16 of the tile -- every warp stores (and the owner loads) 512 contiguous bytes per
// instruction, and the owner's thread ct finds its own fragment's elements there, so no shuffle is needed.
// PT: the partial dtype (a 16-bit type: 8 values per vector; float: 4).
// Sum order of an own tile: this rank's fp32 accumulators, then the peers' partials in ascending rank
// order -- fixed whatever order they arrive in, so every run gives the same bits; starting from the
// accumulators frees the registers a separate running sum would need, so all of one peer's loads of the
// tile are in flight at once.
// A failed wait marks the block failed (`failed`, shared): its warps store and raise nothing more.  An own
// tile's verdict is voted over every consumer thread (named barrier 5) before the inner epilogue, whose
// TMA path synchronizes each warpgroup: no warp may skip it alone.
template <class Inner, int NC, int BN, typename PT> struct MkRsEpilogue {
  Inner inner;
  const MkComm* c;
  const MkOwnerRows* rows;
  const MkRsLayout* L;
  char* ws;                // this rank's workspace
  const mk_u64* peers;     // local rank -> its workspace base, as mapped here
  mk_u64 epoch;
  volatile int* failed;    // shared: 1 once any warp of the block failed a wait
  unsigned* done;          // shared: tiles of this block whose epilogue every consumer thread finished
  unsigned opened = 0;     // owners whose slot this warp may write in this call (checked once each)
  unsigned tiles = 0;      // (the tile_done thread's count)

  static constexpr int NT = 128 * NC;                          // consumer threads
  static constexpr int VE = 16 / (int)sizeof(PT);              // partial elements per 16-byte vector
  static constexpr int NV = (BN / 2) / VE;                     // vectors per thread
  static constexpr mk_u64 TILE_BYTES = (mk_u64)NT * (BN / 2) * sizeof(PT);
  static_assert((BN / 2) % VE == 0, "whole 16-byte vectors of the accumulator fragment");
  static constexpr bool kTileDone = true;
  static constexpr bool kDrain = Inner::kDrain;
  MK_DEVICE void drain() const { inner.drain(); }

  MK_DEVICE int index(const MkTile& t) const { return (t.tile_m >> 4) * ((rows->N + BN - 1) / BN) + t.tile_n; }
  MK_DEVICE mk_u64 tile_off(int src, int owner, int idx) const {
    return L->data_off + (mk_u64)mk_rs_slot(src, owner, rows->P) * L->slot_bytes + (mk_u64)idx * TILE_BYTES;
  }

  // This warp may write into `owner`'s slot for this call: the owner announced this very call (same
  // signature) and consumed the previous one.  Lane 0 waits (our own header: the peers write there).
  MK_DEVICE bool open(int owner) {
    if ((opened >> owner) & 1u) return true;
    int ok = 1;
    if ((threadIdx.x & 31) == 0) {
      const MkCallHeader h{(mk_u64*)(ws + L->consumed_off), rows->P};
      ok = mk_same_call(*c, h, epoch, owner) &&
           mk_wait_geq(*c, h.consumed(owner), epoch - 1, MK_LOCAL_PEER(owner), -1 - owner);
    }
    ok = __shfl_sync(0xffffffffu, ok, 0);
    if (ok) opened |= 1u << owner;
    return ok != 0;
  }

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
      int4* dst = (int4*)((char*)peers[owner] + tile_off(me, owner, idx)) + ct;
#pragma unroll
      for (int v = 0; v < NV; ++v) dst[v * NT] = mk_pack<PT>(&acc[v * VE]);
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
      const int4* src = (const int4*)(ws + tile_off(s, me, idx)) + ct;
      int4 x[NV];
#pragma unroll
      for (int v = 0; v < NV; ++v) x[v] = __ldcg(src + v * NT);  // (L2: peers rewrite slots between calls)
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        float f[VE];
        mk_unpack<PT>(x[v], f);
#pragma unroll
        for (int q = 0; q < VE; ++q) acc[v * VE + q] += f[q];
      }
    }
    MkTile o = t;  // the owner's output holds its own rows only
    o.row0 -= rows->offs[me];
    inner.template store<BN>(o, slab, acc);
  }

  // One consumer thread, after every consumer thread stored the tile (the GEMM component's named barrier
  // 1): publish the block's count of finished tiles (release, CTA scope) for mk_rs_raise_flags.
  MK_DEVICE void tile_done(const MkTile&) {
    ++tiles;
    asm volatile("st.release.cta.shared.u32 [%0], %1;" ::"r"(mk_smem_addr(done)), "r"(tiles) : "memory");
  }
};

// Lane 0 of one warp (a producer warp, idle in the tile loop): walks the block's tile sequence and, for
// each peer tile, waits until the consumers finished it (`done`: acquire of tile_done's release, which
// follows the consumers' named barrier), then raises the owner's ready flag (mk_signal_set: its fence
// orders the consumers' stores, synchronized through that chain, before the flag).  The fence waits for
// the tile's NVLink stores to drain; here it holds no consumer warp, so the next tile's MMAs run
// meanwhile.  Terminates: tile_done runs for every tile of the block (the hook never aborts the loop).
template <int BM, int BN>
MK_DEVICE void mk_rs_raise_flags(const MkOwnerRows* rows, const MkRsLayout* L, const mk_u64* peers, mk_u64 epoch,
                                 const unsigned* done, volatile int* failed, int worker, int workers) {
  if ((threadIdx.x & 31) != 0) return;
  MkOwnerScheduler<BM, BN> sched(rows);
  sched.init(worker, workers);
  const mk_u32 done_addr = mk_smem_addr(done);
  const int me = rows->me, num_n = (rows->N + BN - 1) / BN;
  unsigned j = 0;
  MkTile t;
  while (sched.next(t)) {
    ++j;
    const int owner = t.tile_m & 15;
    if (owner == me) continue;
    while (true) {
      unsigned seen;
      asm volatile("ld.acquire.cta.shared.u32 %0, [%1];" : "=r"(seen) : "r"(done_addr) : "memory");
      if (seen >= j) break;
      __nanosleep(128);
    }
    if (*failed) continue;
    const int idx = (t.tile_m >> 4) * num_n + t.tile_n;
    mk_signal_set((mk_u64*)((char*)peers[owner] + L->flags_off) + me * L->flag_stride + idx, epoch);
  }
}

template <int NC, int BN, typename PT, class Inner>
MK_DEVICE MkRsEpilogue<Inner, NC, BN, PT> mk_rs_epilogue(const Inner& inner, const MkComm* c, const MkOwnerRows* rows,
                                                         const MkRsLayout* L, char* ws, const mk_u64* peers,
                                                         mk_u64 epoch, volatile int* failed, unsigned* done) {
  MkRsEpilogue<Inner, NC, BN, PT> e;
  e.inner = inner;
  e.c = c;
  e.rows = rows;
  e.L = L;
  e.ws = ws;
  e.peers = peers;
  e.epoch = epoch;
  e.failed = failed;
  e.done = done;
  return e;
}

// MkNoWait (loads never wait) plus work for the producer warpgroup's idle warps: worker 0's warp 1 writes
// this rank's entered / sig entries into every peer's header at once (mk_announce_call); warp 2 of every
// block raises its peer tiles' ready flags (mk_rs_raise_flags; workers = the grid).
template <int BM, int BN> struct MkRsHook : MkNoWait {
  const MkComm* c;
  const MkOwnerRows* rows;
  const MkRsLayout* L;
  const mk_u64* peers;
  mk_u64 epoch;
  const unsigned* done;
  volatile int* failed;
  static constexpr bool kSideWork = true;
  MK_DEVICE void side_work(int warp, int worker) const {
    if (warp == 2) {
      mk_rs_raise_flags<BM, BN>(rows, L, peers, epoch, done, failed, worker, (int)gridDim.x);
    } else if (warp == 1 && worker == 0) {
      const int P = rows->P;
      const mk_u64* pt = peers;
      const mk_u64 off = L->consumed_off;
      mk_announce_call(*c, [&](int j) { return MkCallHeader{(mk_u64*)((char*)pt[j] + off), P}; }, epoch,
                       (int)threadIdx.x & 31, 32);
    }
  }
};

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
