// collectives.cu - all-gather, reduce-scatter and all-reduce over NVLink, each one persistent kernel.
//
// Push model.  Every rank owns a symmetric workspace (same layout on every local rank):
//
//   [0]            MkEpochState           this rank's call counter (local only)
//   [consumed_off] u64[P]                 consumed[j] = last call whose data local rank j finished
//                                         reading out of *its* workspace (written by j into ours)
//                  u64[P]                 entered[j] = last call local rank j started (written by j)
//                  u64[P][2]              sig[j][e & 1] = the signature of j's call e (written by j
//                                         before entered[j] = e)
//   [flags_off]    u64[2][P][flag_stride] ready[phase][src][chunk] = call that delivered that chunk
//                                         (flag_stride = MAX_CHUNKS for every call: nothing before
//                                         data0_off moves with the message size, so no flag ever sits
//                                         on bytes an earlier, differently sized call left in a slot)
//   [data0_off]    P slots of slot_bytes  phase-0 receive slots, slot j written by local rank j
//   [data1_off]    P slots of slot_bytes  phase-1 slots (all-reduce's gather phase)
//
// A sender writes into peer p's slot only after p said it consumed the previous call's data
// (consumed[p] >= epoch-1, read in the sender's own memory), then raises p's ready flag.  Receivers
// wait on ready flags in their own memory.  The last block of a call tells every peer that this rank
// has consumed its data.  Epochs live on the device: no host reset, graph-capturable.
//
// Same call everywhere: every rank announces its call's signature (MkComm.sig: op, dtype, shape,
// path) to every peer when the call starts, and a receiver compares the sender's with its own before
// it reads any of the sender's data (a mismatch is MK_ERR_MISMATCH: the host raises CommMismatch).
// The host checks a signature across ranks only the first time it is used; this catches a rank
// repeating an agreed call while a peer makes another agreed one.  The two parity slots keep a
// peer's announcement of call e+1 from overwriting call e's before we read it (a peer cannot start
// e+2 before we pushed our part of e+1).
//
// Work is split into chunks; chunk c is one work item, handled by block c % gridDim.x on every rank:
// the block first pushes chunk c to every peer, then waits for the peers' chunk c.  The block with the
// same index on a peer does the same, so no wait can block a push it depends on, and receiving of
// early chunks overlaps sending of later ones.  Launch: cooperative (every block resident),
// blockDim 512, grid <= #SMs, nchunks >= grid.
#include "core/mk_copy.cuh"
#include "core/mk_signal.cuh"

#ifndef MK_DTYPE
#define MK_DTYPE MK_DTYPE_BF16
#endif
typedef mk_type<MK_DTYPE>::T T;

struct CollLayout {
  mk_u64 consumed_off, flags_off, data0_off, data1_off;
  mk_u64 slot_bytes;   // bytes per receive slot
  mk_u64 chunk_bytes;  // bytes per chunk (multiple of 16)
  int nchunks;         // chunks per slot (flags per source per phase)
  int tail_pieces;     // copy-engine path: the last chunk cut in this many pieces (ce_chunk); 0: none
  int direct;          // copy-engine all-gather into a symmetric `out`: peers copy straight into it
  int flag_stride;     // flags per source per phase in the workspace (MAX_CHUNKS, the same for every call)
};

struct Ws {
  char* base;                 // this rank's workspace
  const mk_u64* __restrict__ peers;  // local rank -> base of its workspace, as mapped here
  CollLayout L;
  int P, me;

  MK_DEVICE char* peer(int j) const { return (char*)peers[j]; }
  MK_DEVICE MkEpochState* epoch_state() const { return (MkEpochState*)base; }
  // the per-call header (mk_signal.cuh MkCallHeader), ours and local rank `owner`'s
  MK_DEVICE MkCallHeader header() const { return {(mk_u64*)(base + L.consumed_off), P}; }
  MK_DEVICE MkCallHeader peer_header(int owner) const { return {(mk_u64*)(peer(owner) + L.consumed_off), P}; }
  MK_DEVICE mk_u64 flag_idx(int phase, int src, int c) const { return ((mk_u64)phase * P + src) * L.flag_stride + c; }
  MK_DEVICE mk_u64* ready(int phase, int src, int c) const { return (mk_u64*)(base + L.flags_off) + flag_idx(phase, src, c); }
  MK_DEVICE mk_u64* peer_ready(int owner, int phase, int src, int c) const {
    return (mk_u64*)(peer(owner) + L.flags_off) + flag_idx(phase, src, c);
  }
  MK_DEVICE char* slot(int phase, int j) const { return base + (phase ? L.data1_off : L.data0_off) + (mk_u64)j * L.slot_bytes; }
  MK_DEVICE char* peer_slot(int owner, int phase, int j) const {
    return peer(owner) + (phase ? L.data1_off : L.data0_off) + (mk_u64)j * L.slot_bytes;
  }
};

MK_DEVICE Ws make_ws(const MkComm& c, char* ws, const mk_u64* peers, const CollLayout& L) {
  Ws w;
  w.base = ws;
  w.peers = peers;
  w.L = L;
  w.P = c.local_size;
  w.me = c.local_rank;
  return w;
}

// Chunk c of a region of `len` bytes: [off, off+n).
MK_DEVICE mk_u64 chunk_len(mk_u64 len, mk_u64 chunk, int c) {
  const mk_u64 off = (mk_u64)c * chunk;
  return off >= len ? 0 : mk_min(chunk, len - off);
}

// Copy-engine slots: chunk c of a `len`-byte message is [off, off + n): chunks of L.chunk_bytes, but
// with T = L.tail_pieces > 0 the last T indices cut the last chunk into pieces of
// round_up(chunk_bytes / T, 4 KiB) -- the same formula as collectives.py ce_chunk.
MK_DEVICE void ce_chunk(const CollLayout& L, mk_u64 len, int c, mk_u64& off, mk_u64& n) {
  const int T = L.tail_pieces, full = T ? L.nchunks - T : L.nchunks;
  mk_u64 size = L.chunk_bytes;
  if (T && c >= full) {
    size = ((L.chunk_bytes + T - 1) / T + 4095) & ~(mk_u64)4095;
    off = (mk_u64)full * L.chunk_bytes + (mk_u64)(c - full) * size;
  } else {
    off = (mk_u64)c * L.chunk_bytes;
  }
  n = off >= len ? 0 : mk_min(size, len - off);
}

// Sender side: wait until `dst` consumed our previous call's data, write, then raise its flag.
MK_DEVICE bool push_chunk(const MkComm& c, const Ws& w, mk_u64 epoch, int dst, int phase, int ci, const char* src,
                          mk_u64 off, mk_u64 n) {
  if (!mk_block_wait_geq(c, w.header().consumed(dst), epoch - 1, MK_LOCAL_PEER(dst), -1 - dst)) return false;
  if (n) mk_block_copy(w.peer_slot(dst, phase, w.me) + off, src + off, n);
  __syncthreads();
  if (threadIdx.x == 0) mk_signal_set(w.peer_ready(dst, phase, w.me, ci), epoch);
  return true;
}

// Start of a call on this rank: announce its signature to every peer (threads `lane` of `nlanes`).
MK_DEVICE void announce_call(const MkComm& c, const Ws& w, mk_u64 epoch, int lane, int nlanes) {
  mk_announce_call(c, [&](int j) { return w.peer_header(j); }, epoch, lane, nlanes);
}

// The call number, with block 0's first warp announcing the call to the peers.
MK_DEVICE mk_u64 begin_call(const MkComm& c, const Ws& w) {
  const mk_u64 epoch = mk_epoch_begin(w.epoch_state());
  if (blockIdx.x == 0 && threadIdx.x < 32) announce_call(c, w, epoch, threadIdx.x, 32);
  return epoch;
}

// Whole block: src's chunk ci of `phase` has landed, and src makes the same call as we do (checked
// before anything src sent is read; the wait is short: src announces before its first push).
MK_DEVICE bool wait_chunk(const MkComm& c, const Ws& w, mk_u64 epoch, int src, int phase, int ci) {
  int ok = 1;
  if (threadIdx.x == 0)
    ok = (src == w.me || mk_same_call(c, w.header(), epoch, src)) &&
         mk_wait_geq(c, w.ready(phase, src, ci), epoch, MK_LOCAL_PEER(src), (int)w.flag_idx(phase, src, ci));
  return __syncthreads_and(ok) != 0;
}

// End of call: the last block tells every peer we consumed its data, then bumps the epoch.
MK_DEVICE void finish_call(const Ws& w, mk_u64 epoch) {
  if (mk_epoch_arrive(w.epoch_state(), gridDim.x)) {
    for (int j = threadIdx.x; j < w.P; j += blockDim.x)
      if (j != w.me) mk_signal_set(w.peer_header(j).consumed(w.me), epoch);
    __syncthreads();
    mk_epoch_commit(w.epoch_state(), epoch);
  }
}

// ---------------------------------------------------------------------------------------------
// all-gather: out[j*shard_bytes ...] = in of local rank j.  Byte-oriented (any dtype); `in` may be
// this rank's own part of `out` (in place).
extern "C" __global__ void __launch_bounds__(512, 1)
mk_all_gather(MkComm c, const char* in, char* out, mk_u64 shard_bytes, char* ws,
              const mk_u64* __restrict__ peers, CollLayout L) {
  const Ws w = make_ws(c, ws, peers, L);
  const mk_u64 epoch = begin_call(c, w);
  const int P = w.P, me = w.me;
  const mk_u64 CB = L.chunk_bytes;
  for (int ci = blockIdx.x; ci < L.nchunks; ci += gridDim.x) {
    const mk_u64 off = (mk_u64)ci * CB, len = chunk_len(shard_bytes, CB, ci);
    for (int j = 1; j < P; ++j)
      if (!push_chunk(c, w, epoch, (me + j) % P, 0, ci, in, off, len)) return;
    char* my_out = out + (mk_u64)me * shard_bytes;
    if (my_out != in) mk_block_copy(my_out + off, in + off, len);
    for (int j = 1; j < P; ++j) {
      const int src = (me + P - j) % P;
      if (!wait_chunk(c, w, epoch, src, 0, ci)) return;
      mk_block_copy(out + (mk_u64)src * shard_bytes + off, w.slot(0, src) + off, len);
    }
  }
  finish_call(w, epoch);
}

// dst[0..n) = sum over local ranks j in rank order of (j == me ? own : slot_j)[0..n), fp32
// accumulation.  The fixed order makes the one-shot all-reduce bit-identical on every rank.  Slot
// loads bypass L1 (peers rewrite slots over NVLink between calls).
// (mk_copy.cuh's mk_sum_sources does the same sum; switching to it changes this kernel's code, so it
// waits for a GPU run that can re-validate it.)
MK_DEVICE void reduce_slots(T* dst, const T* own, const Ws& w, int phase, mk_u64 byte_off, mk_u64 n) {
  constexpr int V = mk_vec<T>::N;
  const char* s0 = w.slot(phase, 0) + byte_off;
  const mk_u64 stride = w.L.slot_bytes;
  const bool vec = (((mk_u64)dst | (mk_u64)own | (mk_u64)s0 | stride) & 15) == 0;
  const mk_u64 nvec = vec ? n / V : 0;
  for (mk_u64 i = threadIdx.x; i < nvec; i += blockDim.x) {
    float acc[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = 0.f;
    for (int j = 0; j < w.P; ++j) {
      float f[V];
      mk_unpack<T>(j == w.me ? ((const int4*)own)[i] : __ldcg((const int4*)(s0 + (mk_u64)j * stride) + i), f);
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] += f[k];
    }
    ((int4*)dst)[i] = mk_pack<T>(acc);
  }
  for (mk_u64 i = nvec * V + threadIdx.x; i < n; i += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < w.P; ++j)
      acc += mk_to_f32(j == w.me ? own[i] : __ldcg((const T*)(s0 + (mk_u64)j * stride) + i));
    dst[i] = mk_from_f32<T>(acc);
  }
}

// ---------------------------------------------------------------------------------------------
// reduce-scatter: out[0..n) = sum over local ranks j of in_j[me*n .. (me+1)*n).  `out` must not
// overlap the parts of `in` that go to peers.
extern "C" __global__ void __launch_bounds__(512, 1)
mk_reduce_scatter(MkComm c, const T* in, T* out, mk_u64 n, char* ws, const mk_u64* __restrict__ peers,
                  CollLayout L) {
  const Ws w = make_ws(c, ws, peers, L);
  const mk_u64 epoch = begin_call(c, w);
  const int P = w.P, me = w.me;
  const mk_u64 CB = L.chunk_bytes, bytes = n * sizeof(T);
  for (int ci = blockIdx.x; ci < L.nchunks; ci += gridDim.x) {
    const mk_u64 off = (mk_u64)ci * CB, len = chunk_len(bytes, CB, ci);
    for (int j = 1; j < P; ++j) {
      const int dst = (me + j) % P;
      if (!push_chunk(c, w, epoch, dst, 0, ci, (const char*)(in + (mk_u64)dst * n), off, len)) return;
    }
    for (int j = 1; j < P; ++j)
      if (!wait_chunk(c, w, epoch, (me + P - j) % P, 0, ci)) return;
    reduce_slots((T*)((char*)out + off), (const T*)((const char*)(in + (mk_u64)me * n) + off), w, 0, off,
                 len / sizeof(T));
  }
  finish_call(w, epoch);
}

// ---------------------------------------------------------------------------------------------
// all-reduce: out[0..n) = sum over local ranks of in; `out` may alias `in`.
//  one_shot: every rank pushes all of `in` to every peer and reduces everything itself (small
//            messages: one flag hop).
//  two-phase: reduce-scatter of shards (`shard` elements each; rank r owns [r*shard, ...)), then the
//            owner pushes its reduced shard to every peer.  Every element is summed by exactly one
//            rank, so all ranks hold bit-identical results.  Chunk c of every shard is one item.
extern "C" __global__ void __launch_bounds__(512, 1)
mk_all_reduce(MkComm c, const T* in, T* out, mk_u64 n, mk_u64 shard, int one_shot, char* ws,
              const mk_u64* __restrict__ peers, CollLayout L) {
  const Ws w = make_ws(c, ws, peers, L);
  const mk_u64 epoch = begin_call(c, w);
  const int P = w.P, me = w.me;
  const mk_u64 CB = L.chunk_bytes;
  if (one_shot) {
    const mk_u64 bytes = n * sizeof(T);
    for (int ci = blockIdx.x; ci < L.nchunks; ci += gridDim.x) {
      const mk_u64 off = (mk_u64)ci * CB, len = chunk_len(bytes, CB, ci);
      for (int j = 1; j < P; ++j)
        if (!push_chunk(c, w, epoch, (me + j) % P, 0, ci, (const char*)in, off, len)) return;
      for (int j = 1; j < P; ++j)
        if (!wait_chunk(c, w, epoch, (me + P - j) % P, 0, ci)) return;
      reduce_slots((T*)((char*)out + off), (const T*)((const char*)in + off), w, 0, off, len / sizeof(T));
    }
    finish_call(w, epoch);
    return;
  }
  auto shard_bytes = [&](int r) -> mk_u64 {
    const mk_u64 s = (mk_u64)r * shard;
    return s >= n ? 0 : mk_min(shard, n - s) * sizeof(T);
  };
  T* my_out = out + (mk_u64)me * shard;
  const T* my_in = in + (mk_u64)me * shard;
  for (int ci = blockIdx.x; ci < L.nchunks; ci += gridDim.x) {
    const mk_u64 off = (mk_u64)ci * CB;
    // phase 0: my copy of chunk ci of shard dst goes to dst
    for (int j = 1; j < P; ++j) {
      const int dst = (me + j) % P;
      if (!push_chunk(c, w, epoch, dst, 0, ci, (const char*)(in + (mk_u64)dst * shard), off,
                      chunk_len(shard_bytes(dst), CB, ci)))
        return;
    }
    // reduce chunk ci of my shard, then hand it to every peer (phase 1)
    const mk_u64 len = chunk_len(shard_bytes(me), CB, ci);
    for (int j = 1; j < P; ++j)
      if (!wait_chunk(c, w, epoch, (me + P - j) % P, 0, ci)) return;
    reduce_slots((T*)((char*)my_out + off), (const T*)((const char*)my_in + off), w, 0, off, len / sizeof(T));
    __syncthreads();
    for (int j = 1; j < P; ++j)
      if (!push_chunk(c, w, epoch, (me + j) % P, 1, ci, (const char*)my_out, off, len)) return;
    // gather chunk ci of every other shard
    for (int j = 1; j < P; ++j) {
      const int src = (me + P - j) % P;
      if (!wait_chunk(c, w, epoch, src, 1, ci)) return;
      mk_block_copy((char*)(out + (mk_u64)src * shard) + off, w.slot(1, src) + off,
                    chunk_len(shard_bytes(src), CB, ci));
    }
  }
  finish_call(w, epoch);
}

// ---------------------------------------------------------------------------------------------
// Copy-engine path (large messages; mkernel/ops/collectives/api.py decides).  The copy engines move the
// data between GPUs -- at the link's copy-engine rate, with no SM spent on NVLink traffic -- and
// SM kernels only wait, reduce and copy locally.  Same workspace layout and protocol as above (a
// separate workspace per op and path), plus one u64 at MK_COLL_CE_VALUE_OFF: this call's number,
// the source of the copy engine's flag writes.  Per call, on the caller's stream S and the
// context's side stream X (forked from S, joined back at the end):
//   X: mk_coll_ce_begin (one warp: call number e; announces the call's signature to the peers; waits
//      until every peer consumed call e-1; writes e into the value slot), then for each peer p (rank-rotated, me+1 first) and chunk c: copy
//      chunk c of the data p needs into p's slot[phase 0][me], then copy the value slot into p's
//      ready[0][me][c] (a stream's copies run in order: the flag lands after the data).
//   S: mk_all_gather_ce / mk_reduce_scatter_ce: grid-wide, chunk by chunk in arrival order, every
//      block waits for the chunk's flag(s) and copies / reduces its share; the last block tells the
//      peers it consumed their data and commits the epoch.
//   all-gather into a symmetric `out` (L.direct): X copies straight into p's `out` rows of this rank
//      (no slot, no local copy on the receiver; the begin kernel first waits until p started the call).
//   all-reduce: S runs mk_all_reduce_ce phase 0 (reduce my shard into out), then X (after an event
//   on S) copies my reduced shard into every peer's slot[1][me] + ready[1] flags, and S runs phase 1
//   (copy the peers' shards out, finish).  Each element is summed by one rank: bit-identical results.
//   With 2 ranks, one-shot instead (phase 2): X pushes the whole buffer, S reduces all of it (every
//   rank sums in rank order: bit-identical too).
// Launch: grid <= #SMs - 1 (a free SM for the begin kernel), blockDim 512; not cooperative (blocks
// wait only on flags the copy engines write).  A timeout anywhere leaves the flag values stale, so
// every peer's waits time out too.
#define MK_COLL_CE_VALUE_OFF 32  // inside the first 64 bytes (after MkEpochState); mirrored in collectives.py

// Direct (L.direct, all-gather into a symmetric `out`): the copy engines write into the peers' `out`,
// which a peer may still be reading for earlier work on its stream until its call starts, so the begin
// kernel also waits until every peer announced this call (with our signature: a peer making another
// call raises CommMismatch; the copies are enqueued already and may still land in its buffer).
extern "C" __global__ void __launch_bounds__(32, 1)
mk_coll_ce_begin(MkComm c, char* ws, const mk_u64* __restrict__ peers, CollLayout L) {
  const Ws w = make_ws(c, ws, peers, L);
  const mk_u64 e = mk_epoch_begin(w.epoch_state());
  announce_call(c, w, e, threadIdx.x, 32);  // (the receivers check it)
  mk_ce_begin(c, e, w.header(), (mk_u64*)(ws + MK_COLL_CE_VALUE_OFF), L.direct != 0);
}

// This block's share [lo, hi) of a chunk of `len` bytes (16-byte multiples, so vector copies stay
// aligned when the chunk is).
MK_DEVICE void block_share(mk_u64 len, mk_u64& lo, mk_u64& hi) {
  const mk_u64 part = ((len + gridDim.x - 1) / gridDim.x + 15) & ~(mk_u64)15;
  lo = mk_min(len, (mk_u64)blockIdx.x * part);
  hi = mk_min(len, lo + part);
}

// Every peer's chunk ci of `phase` has landed (rank-rotated: the order the peers send in).
MK_DEVICE bool wait_peers_chunk(const MkComm& c, const Ws& w, mk_u64 epoch, int phase, int ci) {
  for (int j = 1; j < w.P; ++j)
    if (!wait_chunk(c, w, epoch, (w.me + w.P - j) % w.P, phase, ci)) return false;
  return true;
}

// out[src*stride ...] = slot[phase][src] for every peer src (bytes_of(src) bytes), one source after
// another in arrival order (L.direct: the copy engines wrote `out` itself; only wait for the chunks).
template <class F>
MK_DEVICE bool gather_slots_ce(const MkComm& c, const Ws& w, mk_u64 epoch, int phase, char* out, mk_u64 stride,
                               F bytes_of) {
  for (int j = 1; j < w.P; ++j) {
    const int src = (w.me + w.P - j) % w.P;
    const mk_u64 sb = bytes_of(src);
    for (int ci = 0; ci < w.L.nchunks; ++ci) {
      if (!wait_chunk(c, w, epoch, src, phase, ci)) return false;
      if (w.L.direct) continue;
      mk_u64 off, len, lo, hi;
      ce_chunk(w.L, sb, ci, off, len);
      block_share(len, lo, hi);
      mk_block_copy(out + (mk_u64)src * stride + off + lo, w.slot(phase, src) + off + lo, hi - lo);
    }
  }
  return true;
}

// dst[0 .. bytes) = own + every peer's slot[0], chunk by chunk as the chunks land (each block its
// share).  wait_own: also wait for our own ready[0][me][ci] (the copy engine pushed chunk ci of `own`
// to every peer) before writing -- an in-place all-reduce overwrites its input.
MK_DEVICE bool reduce_chunks_ce(const MkComm& c, const Ws& w, mk_u64 epoch, T* dst, const T* own, mk_u64 bytes,
                                bool wait_own) {
  for (int ci = 0; ci < w.L.nchunks; ++ci) {
    if (!wait_peers_chunk(c, w, epoch, 0, ci)) return false;
    if (wait_own && !wait_chunk(c, w, epoch, w.me, 0, ci)) return false;
    mk_u64 off, len, lo, hi;
    ce_chunk(w.L, bytes, ci, off, len);
    block_share(len, lo, hi);
    reduce_slots((T*)((char*)dst + off + lo), (const T*)((const char*)own + off + lo), w, 0, off + lo,
                 (hi - lo) / sizeof(T));
  }
  return true;
}

extern "C" __global__ void __launch_bounds__(512, 1)
mk_all_gather_ce(MkComm c, const char* in, char* out, mk_u64 shard_bytes, char* ws,
                 const mk_u64* __restrict__ peers, CollLayout L) {
  const Ws w = make_ws(c, ws, peers, L);
  const mk_u64 epoch = mk_epoch_begin(w.epoch_state());
  char* my_out = out + (mk_u64)w.me * shard_bytes;
  if (my_out != in) {  // our own rows first: they need no wait
    mk_u64 lo, hi;
    block_share(shard_bytes, lo, hi);
    mk_block_copy(my_out + lo, in + lo, hi - lo);
  }
  if (!gather_slots_ce(c, w, epoch, 0, out, shard_bytes, [&](int) { return shard_bytes; })) return;
  finish_call(w, epoch);
}

extern "C" __global__ void __launch_bounds__(512, 1)
mk_reduce_scatter_ce(MkComm c, const T* in, T* out, mk_u64 n, char* ws, const mk_u64* __restrict__ peers,
                     CollLayout L) {
  const Ws w = make_ws(c, ws, peers, L);
  const mk_u64 epoch = mk_epoch_begin(w.epoch_state());
  if (!reduce_chunks_ce(c, w, epoch, out, in + (mk_u64)w.me * n, n * sizeof(T), false)) return;
  finish_call(w, epoch);
}

// Bytes of local rank r's shard of an all-reduce over n elements in shards of `shard`.
MK_DEVICE mk_u64 shard_bytes_of(mk_u64 n, mk_u64 shard, int r) {
  const mk_u64 s = (mk_u64)r * shard;
  return s >= n ? 0 : mk_min(shard, n - s) * sizeof(T);
}

// phase 0: reduce my shard into out (the call stays open for phase 1); phase 1: gather the peers'
// reduced shards, finish.  phase 2 (one-shot: every peer pushed its whole buffer; shard = n): reduce
// everything, finish -- one copy-engine round instead of two, the same bytes per link direction
// when P = 2.
extern "C" __global__ void __launch_bounds__(512, 1)
mk_all_reduce_ce(MkComm c, const T* in, T* out, mk_u64 n, mk_u64 shard, int phase, char* ws,
                 const mk_u64* __restrict__ peers, CollLayout L) {
  const Ws w = make_ws(c, ws, peers, L);
  const mk_u64 epoch = mk_epoch_begin(w.epoch_state());
  if (phase == 2) {  // in place: `in` is overwritten only once our copy engine pushed it everywhere
    if (!reduce_chunks_ce(c, w, epoch, out, in, n * sizeof(T), (const void*)in == (const void*)out)) return;
    finish_call(w, epoch);
    return;
  }
  if (phase == 0) {  // reduce my shard into out; the call stays open for phase 1
    reduce_chunks_ce(c, w, epoch, out + (mk_u64)w.me * shard, in + (mk_u64)w.me * shard,
                     shard_bytes_of(n, shard, w.me), false);
    return;
  }
  if (!gather_slots_ce(c, w, epoch, 1, (char*)out, shard * sizeof(T),
                       [&](int r) { return shard_bytes_of(n, shard, r); }))
    return;
  finish_call(w, epoch);
}
