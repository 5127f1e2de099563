// mk_signal.cuh - flags between GPUs with release/acquire ordering, per-call epochs kept on the
// device, and waits that time out instead of hanging.
//
// Flags are 64-bit counters that only grow: a call numbered `epoch` raises a flag to `epoch` and a
// waiter waits for `flag >= epoch`.  Epochs are kept on the device (mk_epoch_begin/end), so no host
// reset is ever needed between calls and a launch can be captured in a CUDA graph and replayed.
//
// Scope: peers are other GPUs (NVLink, CUDA IPC mappings) or the host proxy, so every flag access
// that crosses a device uses .sys scope.  A writer makes its data visible before the flag with
// `__syncthreads(); if (tid==0) mk_signal_set(...)` (release at .sys scope is cumulative over what
// the block's threads wrote before the barrier); a waiter acquires.
#pragma once
#include "core/mk_common.cuh"

// Error codes, shared with mkernel/dist/signals.py.
#define MK_OK 0
#define MK_ERR_TIMEOUT 1
#define MK_ERR_MISMATCH 2
#define MK_ERR_PROXY 3

// A peer named by its local rank (index within the node) rather than its world rank; the host
// translates it.
#define MK_LOCAL_PEER(j) (0x40000000 | (j))

// Written once (first failing thread wins) into host-mapped memory; read by the host after a sync.
struct MkErrorRecord {
  int code;        // MK_ERR_*; 0 while nothing failed
  int rank;        // world rank of the waiter
  int op;          // op id (mkernel/dist/signals.py OPS)
  int peer;        // world rank waited on, or MK_LOCAL_PEER(local rank); -1 if unknown
  int flag_index;  // which flag (op-specific index)
  int block;       // blockIdx.x of the waiter
  mk_u64 expected; // value waited for
  mk_u64 seen;     // value last seen
  mk_u64 waited_ns;
};

// Passed by value to every communicating kernel.
struct MkComm {
  MkErrorRecord* err;  // device pointer of the host-mapped error record
  mk_u64 timeout_ns;   // per-wait timeout
  int rank, world_size;        // world
  int local_rank, local_size;  // ranks joined by NVLink (this node)
  int node, num_nodes;
  int op;              // op id, for error reports
  unsigned sig;        // the call's signature (host: Context.agree's digest), for kernels that compare
                       // it with their peers' (collectives.cu); 0 where unused
};

MK_DEVICE mk_u64 mk_ld_acquire(const mk_u64* p) {
  mk_u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
MK_DEVICE void mk_st_release(mk_u64* p, mk_u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
MK_DEVICE void mk_st_relaxed(mk_u64* p, mk_u64 v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
MK_DEVICE mk_u64 mk_atom_add_release(mk_u64* p, mk_u64 v) {
  mk_u64 old;
  asm volatile("atom.add.release.sys.global.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
}
// (acquire too: the adder that reads the last of a count of releases sees every counted writer's data)
MK_DEVICE mk_u64 mk_atom_add_acq_rel(mk_u64* p, mk_u64 v) {
  mk_u64 old;
  asm volatile("atom.add.acq_rel.sys.global.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
}

// Raise a (possibly remote) flag to `v`: everything this thread wrote, and everything its block wrote
// before a preceding __syncthreads, is visible to whoever acquires the flag.
MK_DEVICE void mk_signal_set(mk_u64* flag, mk_u64 v) {
  __threadfence_system();
  mk_st_release(flag, v);
}
MK_DEVICE void mk_signal_add(mk_u64* flag, mk_u64 v) {
  __threadfence_system();
  mk_atom_add_release(flag, v);
}

MK_DEVICE bool mk_failed(const MkComm& c) {
  return *((volatile int*)&c.err->code) != MK_OK;
}

// Record the first failure; later ones are dropped.
MK_DEVICE void mk_report(const MkComm& c, int code, int peer, int flag_index, mk_u64 expected, mk_u64 seen,
                         mk_u64 waited_ns) {
  if (atomicCAS_system(&c.err->code, MK_OK, -1) == MK_OK) {
    c.err->rank = c.rank;
    c.err->op = c.op;
    c.err->peer = peer;
    c.err->flag_index = flag_index;
    c.err->block = blockIdx.x;
    c.err->expected = expected;
    c.err->seen = seen;
    c.err->waited_ns = waited_ns;
    __threadfence_system();
    atomicExch_system(&c.err->code, code);
  }
}

// Polling policy, shared by every wait in mkernel (docs/design.md, "Waiting"):
//  * back off from the first miss: __nanosleep starting at MK_POLL_SLEEP_MIN_NS, doubling up to
//    MK_POLL_SLEEP_MAX_NS, so a hundred waiting warps do not flood the memory system with .sys loads
//    while communication blocks of the same kernel are moving data;
//  * the host-mapped error record (another block of this rank failed) is read over PCIe only after
//    MK_POLL_ERR_CHECK_NS of waiting, then every 128 polls: a failing rank still drains within about
//    a millisecond, and a healthy wait never touches the PCIe bus;
//  * the clock is read every 8 polls for the timeout.
// The start time is the 64-bit globaltimer (ns) and every comparison is in 64 bits, so any timeout the
// host accepts (mkernel/dist/timeouts.py: up to a day) is exact: a 32-bit clock would wrap.
#ifndef MK_POLL_SLEEP_MIN_NS
#define MK_POLL_SLEEP_MIN_NS 32
#endif
#ifndef MK_POLL_SLEEP_MAX_NS
#define MK_POLL_SLEEP_MAX_NS 512
#endif
#ifndef MK_POLL_ERR_CHECK_NS
#define MK_POLL_ERR_CHECK_NS 1000000ull
#endif

// Back-off state of one waiting thread (or warp: every lane holds the same state).
struct MkPoll {
  mk_u64 t0;  // globaltimer at start (ns)
  unsigned spins;
  MK_DEVICE void start() {
    t0 = mk_globaltimer();
    spins = 0;
  }
  MK_DEVICE void pause() const {
#if MK_POLL_SLEEP_MAX_NS > 0
    const unsigned s = spins < 16u ? (unsigned)MK_POLL_SLEEP_MIN_NS << spins : 0xffffffffu;
    __nanosleep(s < (unsigned)MK_POLL_SLEEP_MAX_NS ? s : (unsigned)MK_POLL_SLEEP_MAX_NS);
#endif
  }
  // Call once per poll.  Every 8th call reads the clock: 1 = timed out (waited ns in *dt), 2 = time
  // to look at the error record, 0 = keep polling.
  MK_DEVICE int tick(const MkComm& c, mk_u64* dt) {
    if ((++spins & 7u) != 0) return 0;
    const mk_u64 waited = mk_globaltimer() - t0;
    *dt = waited;
    if (waited > c.timeout_ns) return 1;
    if (waited >= (mk_u64)MK_POLL_ERR_CHECK_NS && (spins & 127u) == 0) return 2;
    return 0;
  }
};

// Spin until *flag >= expected (wrap-safe), with a timeout.  Returns false on timeout (error record
// with `err_code`), or when another thread of this rank already failed (so every block drains
// quickly); the caller must then stop and return.  One thread calls this.
MK_DEVICE bool mk_wait_geq_or(const MkComm& c, const mk_u64* flag, mk_u64 expected, int peer, int flag_index,
                              int err_code) {
  mk_u64 v = mk_ld_acquire(flag);
  if ((mk_i64)(v - expected) >= 0) return true;
  MkPoll poll;
  poll.start();
  while (true) {
    poll.pause();
    v = mk_ld_acquire(flag);
    if ((mk_i64)(v - expected) >= 0) return true;
    mk_u64 dt;
    const int t = poll.tick(c, &dt);
    if (t == 1) {
      mk_report(c, err_code, peer, flag_index, expected, v, dt);
      return false;
    }
    if (t == 2 && mk_failed(c)) return false;
  }
}
// A peer's flag: a timeout is MK_ERR_TIMEOUT.
MK_DEVICE bool mk_wait_geq(const MkComm& c, const mk_u64* flag, mk_u64 expected, int peer, int flag_index) {
  return mk_wait_geq_or(c, flag, expected, peer, flag_index, MK_ERR_TIMEOUT);
}

// Whole-block wait: thread 0 spins, every thread gets the verdict.  All threads must call it.
MK_DEVICE bool mk_block_wait_geq(const MkComm& c, const mk_u64* flag, mk_u64 expected, int peer, int flag_index) {
  int ok = 1;
  if (threadIdx.x == 0) ok = mk_wait_geq(c, flag, expected, peer, flag_index);
  return __syncthreads_and(ok) != 0;
}

// Warp-level wait (warp-specialized kernels): lane 0 spins, the warp gets the verdict.
MK_DEVICE bool mk_warp_wait_geq(const MkComm& c, const mk_u64* flag, mk_u64 expected, int peer, int flag_index) {
  int ok = 1;
  if ((threadIdx.x & 31) == 0) ok = mk_wait_geq(c, flag, expected, peer, flag_index);
  return __shfl_sync(0xffffffffu, ok, 0) != 0;
}

// ---- call signatures -------------------------------------------------------------------------
// Every rank announces the signature of call `epoch` (MkComm.sig: the host's digest of the agreed
// call) to each peer: peer_sig[epoch & 1] = sig, then peer_entered = epoch (release).  Two parity
// slots: a peer's announcement of call e+1 cannot overwrite call e's before it is read (a peer cannot
// start e+2 before this rank took part in e+1).  mk_same_call (one thread) waits until `peer`
// announced `epoch` and compares: a different signature is MK_ERR_MISMATCH (the host raises
// CommMismatch) -- the hole the host's first-call agreement leaves: a rank repeating an agreed call
// while a peer makes another agreed one.
//
// The per-call header of an op workspace (signals.call_header_bytes; collectives.cu and ag_gemm.cu
// place it at their consumed_off): u64 consumed[P], entered[P], sig[P][2], entry j written by local
// rank j into this rank's header -- consumed[j] = the last call whose data j finished reading,
// entered[j] / sig[j][e & 1] = j's announcement of its call e.  A view of this rank's header or of a
// peer's (as mapped here).
struct MkCallHeader {
  mk_u64* h;
  int P;
  MK_DEVICE mk_u64* consumed(int j) const { return h + j; }
  MK_DEVICE mk_u64* entered(int j) const { return h + P + j; }
  MK_DEVICE mk_u64* sigs(int j) const { return h + 2 * P + 2 * j; }  // [2]
};

// Announce call `epoch` to every local peer (threads `lane` of `nlanes`): into peer j's header
// (`peer_header(j)`, an MkCallHeader), our entry.
template <class PeerHeader>
MK_DEVICE void mk_announce_call(const MkComm& c, PeerHeader&& peer_header, mk_u64 epoch, int lane, int nlanes) {
  const int me = c.local_rank;
  for (int j = lane; j < c.local_size; j += nlanes) {
    if (j == me) continue;
    const MkCallHeader ph = peer_header(j);
    mk_st_relaxed(ph.sigs(me) + (epoch & 1), c.sig);
    mk_signal_set(ph.entered(me), epoch);  // (fenced: the signature lands first)
  }
}
// One thread: local peer j announced call `epoch` (in our header `h`) with our signature.
MK_DEVICE bool mk_same_call(const MkComm& c, const MkCallHeader& h, mk_u64 epoch, int j) {
  const int peer = MK_LOCAL_PEER(j), flag_index = -1000 - j;
  if (!mk_wait_geq(c, h.entered(j), epoch, peer, flag_index)) return false;
  const mk_u32 theirs = (mk_u32)mk_ld_acquire(h.sigs(j) + (epoch & 1));
  if (theirs == c.sig) return true;
  mk_report(c, MK_ERR_MISMATCH, peer, flag_index, c.sig, theirs, 0);
  return false;
}

// ---- per-call epochs -------------------------------------------------------------------------
// Each op workspace holds a `MkEpochState` in this GPU's own memory.  Every block of a launch
// calls mk_epoch_begin first (all read the same value: the counter only moves once every block has
// arrived), and mk_epoch_arrive last; the last block to arrive then calls mk_epoch_commit.  Launches on one stream are ordered, so the
// next call sees the bumped counter.
struct MkEpochState {
  mk_u64 epoch;     // number of completed calls
  unsigned arrived; // blocks of the current call that finished
  unsigned pad;
};

MK_DEVICE mk_u64 mk_epoch_begin(const MkEpochState* s) {
  return *((volatile const mk_u64*)&s->epoch) + 1;
}

// All threads of the block call it after their last access to shared state; it returns true, in
// every thread of the block, in the last block to arrive.  That block may do end-of-call work (e.g.
// tell peers their data was consumed) and must then call mk_epoch_commit.
MK_DEVICE bool mk_epoch_arrive(MkEpochState* s, unsigned num_blocks) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(&s->arrived, 1u) == num_blocks - 1;
  }
  __syncthreads();
  return last != 0;
}
MK_DEVICE void mk_epoch_commit(MkEpochState* s, mk_u64 epoch) {
  if (threadIdx.x == 0) {
    s->arrived = 0;
    __threadfence();
    *((volatile mk_u64*)&s->epoch) = epoch;
  }
}

// Start of a copy-engine transfer (one warp, on the side stream, before the copies) of call `e` (the
// previous call committed its epoch before the fork event this stream waited on).  `h`: this rank's
// per-call header (MkCallHeader).  With `check_peers`, first wait until every local
// peer j announced call e with our signature (mk_same_call) -- where the copy engines write memory a
// peer may still read until its call starts, and so that a peer making another call gets nothing;
// then wait until every j consumed call e-1; then write e into `value[0 .. nvalues)`, the source of the
// copy engine's flag writes (several values: one copy raises that many consecutive flags).  A timeout
// or mismatch leaves the values at e-1, so the peers' waits for this call's flags stop too instead of
// reading data that was never sent.
MK_DEVICE void mk_ce_begin(const MkComm& c, mk_u64 e, const MkCallHeader& h, mk_u64* value, bool check_peers,
                           int nvalues = 1) {
  const int lane = threadIdx.x & 31;  // (any one warp of a block, not only warp 0)
  bool ok = true;
  for (int j = lane; j < c.local_size; j += 32)
    if (j != c.local_rank)
      ok = ok && (!check_peers || mk_same_call(c, h, e, j)) &&
           mk_wait_geq(c, h.consumed(j), e - 1, MK_LOCAL_PEER(j), -1 - j);
  if (!__all_sync(0xffffffffu, ok)) return;
  for (int i = lane; i < nvalues; i += 32) value[i] = e;
}
