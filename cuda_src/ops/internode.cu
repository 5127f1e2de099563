// internode.cu - hierarchical all-gather and reduce-scatter across nodes: NVLink inside a node
// (CUDA IPC peer pointers), the CPU proxy across nodes (mk_proxy.cuh commands: RDMA WRITE or TCP).
//
// Ranks are node-major: world rank of (node m, local l) is m*L + l (checked on the host).  Across
// nodes every rank talks only to its "rail" counterparts (same local index l on the other nodes), so
// each byte crosses the network once per node pair and NVLink spreads it inside the node.
//
// Workspace (symmetric inside a node, and window 0 of the proxy on every rank; same layout on all):
//   [0]             MkEpochState
//   [8*8]           u64 barrier counter (grid barrier, local)
//   [consumed_off]  u64[P]  consumed[r]: world rank r finished reading what we wrote into it
//   [calls_off]     u64[P][2] calls[r][e & 1] = (e << 32) | sig: world rank r's announcement of its call e
//                   and that call's signature (MkComm.sig), one word (NVLink store or proxy FLAG)
//   [ready_off]     u64[R]  ready flags (op-specific index), value = epoch
//   [data_off]      slots (op-specific)
// A writer (NVLink push or proxy WRITE) waits consumed[dst] >= epoch-1 first; the proxy raises the
// destination's ready flag after the data (RC ordering / TCP copy-then-flag); the last block of a
// call tells every writer it consumed (NVLink flag to local peers, proxy FLAG to rail peers) after
// waiting until the proxy finished reading our source regions.
//
// Same call everywhere (docs/internode.md, "Call signatures"): at the start of a call one thread
// announces (epoch, sig) to every rank that reads what we send (local peers by NVLink, rail peers by a
// proxy FLAG), and before a block reads a slot that world rank s filled it checks s's announcement of
// this call (inter_same_call): another signature is MK_ERR_MISMATCH, raised as CommMismatch.  Two
// parity words per sender: s cannot announce e+2 before we took part in e+1 (every call needs every
// rank's data), so word e & 1 still holds e when we read it.  The word's high half is the call number
// (wrap-safe for 2^32 calls), so waiting for calls[s][e & 1] >= e << 32 waits for the announcement.
//
// Work is whole-slot items strided over blocks (cooperative launch: every block resident).
#include "core/mk_copy.cuh"
#include "core/mk_proxy.cuh"
#include "core/mk_signal.cuh"

#ifndef MK_DTYPE
#define MK_DTYPE MK_DTYPE_BF16
#endif
typedef mk_type<MK_DTYPE>::T T;

struct InterLayout {
  mk_u64 consumed_off, calls_off, ready_off, data_off;
  mk_u64 slot_bytes;  // bytes per slot (multiple of 256)
  int L, N;           // ranks per node, nodes
};

struct IWs {
  char* base;
  const mk_u64* __restrict__ peers;  // local rank -> workspace base as mapped here
  InterLayout Lo;
  int me, l, n, P;

  MK_DEVICE char* peer(int j) const { return (char*)peers[j]; }
  MK_DEVICE MkEpochState* st() const { return (MkEpochState*)base; }
  MK_DEVICE mk_u64* barrier() const { return (mk_u64*)(base + 64); }
  MK_DEVICE mk_u64* consumed(int r) const { return (mk_u64*)(base + Lo.consumed_off) + r; }
  MK_DEVICE mk_u64 consumed_off(int r) const { return Lo.consumed_off + 8ull * r; }
  // world rank r's announcement of call e (parity e & 1) in this rank's workspace
  MK_DEVICE mk_u64 call_off(int r, mk_u64 e) const { return Lo.calls_off + 16ull * r + 8ull * (e & 1); }
  MK_DEVICE mk_u64* call(int r, mk_u64 e) const { return (mk_u64*)(base + call_off(r, e)); }
  MK_DEVICE mk_u64* ready(int i) const { return (mk_u64*)(base + Lo.ready_off) + i; }
  MK_DEVICE mk_u64 ready_off(int i) const { return Lo.ready_off + 8ull * i; }
  MK_DEVICE mk_u64 slot_off(int i) const { return Lo.data_off + (mk_u64)i * Lo.slot_bytes; }
  MK_DEVICE char* slot(int i) const { return base + slot_off(i); }
  MK_DEVICE int world(int node, int local) const { return node * Lo.L + local; }
};

MK_DEVICE IWs make_iws(const MkComm& c, char* ws, const mk_u64* peers, const InterLayout& Lo) {
  IWs w;
  w.base = ws;
  w.peers = peers;
  w.Lo = Lo;
  w.me = c.rank;
  w.l = c.local_rank;
  w.n = c.node;
  w.P = Lo.L * Lo.N;
  return w;
}

// Grid barrier number k (1-based) of call `epoch` with `nb` barriers per call.
MK_DEVICE bool grid_sync(const MkComm& c, const IWs& w, mk_u64 epoch, int nb, int k) {
  __syncthreads();
  int ok = 1;
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(w.barrier(), 1ull);
    const mk_u64 target = ((epoch - 1) * nb + k) * (mk_u64)gridDim.x;
    ok = mk_wait_geq(c, w.barrier(), target, -1, -100 - k);
  }
  return __syncthreads_and(ok) != 0;
}

MK_DEVICE mk_u64 inter_call_word(const MkComm& c, mk_u64 epoch) { return (epoch << 32) | (mk_u64)c.sig; }

// Announce call `epoch` (one thread, before anything of the call is pushed): our word into every
// local peer's workspace (NVLink) and, through the proxy, every rail peer's.  False if the proxy
// ring stayed full (recorded).
MK_DEVICE bool inter_announce(const MkComm& c, const IWs& w, const MkProxy& p, mk_u64 epoch) {
  const mk_u64 word = inter_call_word(c, epoch);
  const mk_u64 off = w.call_off(w.me, epoch);
  for (int j = 0; j < w.Lo.L; ++j)
    if (j != w.l) mk_signal_set((mk_u64*)(w.peer(j) + off), word);
  for (int m = 0; m < w.Lo.N; ++m) {
    if (m == w.n) continue;
    if (mk_proxy_push(c, p, MK_PROXY_OP_FLAG, w.world(m, w.l), 0, 0, 0, 0, 0, off, word) == MK_PROXY_NO_FLAG)
      return false;
  }
  return true;
}

// Every block calls it first: block 0's thread 0 announces; block-uniform verdict.
MK_DEVICE bool inter_open(const MkComm& c, const IWs& w, const MkProxy& p, mk_u64 epoch) {
  int ok = 1;
  if (blockIdx.x == 0 && threadIdx.x == 0) ok = inter_announce(c, w, p, epoch);
  return __syncthreads_and(ok) != 0;
}

// One thread: world rank `s` announced call `epoch` with our signature.  Waits (bounded) for the
// announcement; another signature is MK_ERR_MISMATCH (peer s, flag index -1000 - s).
MK_DEVICE bool inter_same_call(const MkComm& c, const IWs& w, mk_u64 epoch, int s) {
  const int flag_index = -1000 - s;
  if (!mk_wait_geq(c, w.call(s, epoch), epoch << 32, s, flag_index)) return false;
  const mk_u64 word = mk_ld_acquire(w.call(s, epoch));
  if (word == inter_call_word(c, epoch)) return true;
  mk_report(c, MK_ERR_MISMATCH, s, flag_index, c.sig, word & 0xffffffffull, 0);
  return false;
}

// Whole block: slot data that world rank `s` wrote and raised `flag` for in call `epoch` may be read --
// the flag is up and s made this very call (a forwarder checked the rank it forwards for first).
MK_DEVICE bool inter_wait_from(const MkComm& c, const IWs& w, mk_u64 epoch, const mk_u64* flag, int s, int flag_idx) {
  int ok = 1;
  if (threadIdx.x == 0) ok = mk_wait_geq(c, flag, epoch, s, flag_idx) && inter_same_call(c, w, epoch, s);
  return __syncthreads_and(ok) != 0;
}

// Copy `bytes` from local `src` into local peer j's workspace at `dst_off`, then raise its flag
// `flag_idx` to epoch.  Waits first until j consumed our previous call.
MK_DEVICE bool nvl_push(const MkComm& c, const IWs& w, mk_u64 epoch, int j, const char* src, mk_u64 dst_off,
                        mk_u64 bytes, int flag_idx) {
  const int dst = w.world(w.n, j);
  if (!mk_block_wait_geq(c, w.consumed(dst), epoch - 1, dst, -1 - dst)) return false;
  mk_block_copy(w.peer(j) + dst_off, src, bytes);
  __syncthreads();
  if (threadIdx.x == 0) mk_signal_set((mk_u64*)(w.peer(j) + w.ready_off(flag_idx)), epoch);
  return true;
}

// Proxy WRITE of our window [src_off, +bytes) to world rank dst at dst_off, flag flag_idx := epoch.
// One thread.  Returns the ticket (or MK_PROXY_NO_FLAG on failure).
MK_DEVICE mk_u64 net_put(const MkComm& c, const IWs& w, const MkProxy& p, mk_u64 epoch, int dst, mk_u64 src_off,
                         mk_u64 dst_off, mk_u64 bytes, int flag_idx) {
  if (!mk_wait_geq(c, w.consumed(dst), epoch - 1, dst, -1 - dst)) return MK_PROXY_NO_FLAG;
  return mk_proxy_push(c, p, MK_PROXY_OP_WRITE, dst, 0, src_off, dst_off, bytes, 0, w.ready_off(flag_idx), epoch);
}

// End of call.  The last block to arrive waits until the proxy has read every command pushed this
// call (the ring's head), tells the peers their data was consumed, and commits the epoch.
MK_DEVICE void inter_finish(const MkComm& c, const IWs& w, const MkProxy& p, mk_u64 epoch) {
  if (mk_epoch_arrive(w.st(), gridDim.x)) {
    if (threadIdx.x == 0) {
      // every command we pushed this call must have been read out of our window
      const mk_u64 head = *((volatile mk_u64*)p.head);
      if (head > 0 && !mk_proxy_wait_done(c, p, head - 1)) return;
      for (int m = 0; m < w.Lo.N; ++m) {
        if (m == w.n) continue;
        const int dst = w.world(m, w.l);
        if (mk_proxy_push(c, p, MK_PROXY_OP_FLAG, dst, 0, 0, 0, 0, 0, w.consumed_off(w.me), epoch) ==
            MK_PROXY_NO_FLAG)
          return;
      }
      for (int j = 0; j < w.Lo.L; ++j)
        if (j != w.l) mk_signal_set((mk_u64*)(w.peer(j) + w.consumed_off(w.me)), epoch);
    }
    __syncthreads();
    mk_epoch_commit(w.st(), epoch);
  }
}

// ---------------------------------------------------------------------------------------------
// all-gather over every world rank: out[r*shard ...] = in of world rank r.  Byte-oriented.
// Slots: slot r = world rank r's shard.  Flags: ready[r] = slot r present.
extern "C" __global__ void __launch_bounds__(512, 1)
mk_inter_all_gather(MkComm c, MkProxy p, const char* in, char* out, mk_u64 shard, char* ws,
                    const mk_u64* __restrict__ peers, InterLayout Lo) {
  const IWs w = make_iws(c, ws, peers, Lo);
  const mk_u64 epoch = mk_epoch_begin(w.st());
  const int L = Lo.L, N = Lo.N, P = w.P;
  if (!inter_open(c, w, p, epoch)) return;
  // 1. our shard into our own slot (all blocks), then a grid barrier
  {
    const mk_u64 per = mk_div_up(mk_div_up(shard, 16) , gridDim.x) * 16;
    const mk_u64 off = per * blockIdx.x;
    if (off < shard) mk_block_copy(w.slot(w.me) + off, in + off, mk_min(per, shard - off));
  }
  if (!grid_sync(c, w, epoch, 1, 1)) return;
  // 2a. across nodes: our shard to every rail peer (block 0, one thread)
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    for (int k = 1; k < N; ++k) {
      const int dst = w.world((w.n + k) % N, w.l);
      if (net_put(c, w, p, epoch, dst, w.slot_off(w.me), w.slot_off(w.me), shard, w.me) == MK_PROXY_NO_FLAG) break;
    }
  }
  // items: [L-1 pushes of our shard] [N-1 forwards of rail shards] [P copies out]
  const int n_push = L - 1, n_fwd = N - 1, n_items = n_push + n_fwd + P;
  for (int it = blockIdx.x; it < n_items; it += gridDim.x) {
    if (mk_failed(c)) return;
    if (it < n_push) {
      const int j = (w.l + 1 + it) % L;
      if (!nvl_push(c, w, epoch, j, w.slot(w.me), w.slot_off(w.me), shard, w.me)) return;
    } else if (it < n_push + n_fwd) {
      const int s = w.world((w.n + N - 1 - (it - n_push)) % N, w.l);  // rail peer's shard, via the proxy
      if (!inter_wait_from(c, w, epoch, w.ready(s), s, s)) return;
      for (int k = 1; k < L; ++k)
        if (!nvl_push(c, w, epoch, (w.l + k) % L, w.slot(s), w.slot_off(s), shard, s)) return;
    } else {
      const int r = (w.me + (it - n_push - n_fwd)) % P;
      // slot r's writer: r itself (our node, or our rail through the proxy), else r's rail peer on our
      // node, which forwarded it after checking r's call
      const int lr = r % L, writer = (r / L == w.n || lr == w.l) ? r : w.world(w.n, lr);
      if (r != w.me && !inter_wait_from(c, w, epoch, w.ready(r), writer, r)) return;
      mk_block_copy(out + (mk_u64)r * shard, w.slot(r), shard);
    }
  }
  inter_finish(c, w, p, epoch);
}

// ---------------------------------------------------------------------------------------------
// reduce-scatter over every world rank: out[0..n) = sum over world ranks q of x_q[me*n ...].
// Slots: A(j, m) = [j*N + m] for j < L, m < N: local peer j's x chunk for rail rank (m, l);
//        S(m)    = [L*N + m]: our node's partial for rail rank (m, l) (sent through the proxy);
//        B(m)    = [L*N + N + m]: node m's partial for us (received through the proxy).
// Flags: A(j, m) -> j*N + m;  B(m) -> L*N + m.
extern "C" __global__ void __launch_bounds__(512, 1)
mk_inter_reduce_scatter(MkComm c, MkProxy p, const T* x, T* out, mk_u64 n, char* ws,
                        const mk_u64* __restrict__ peers, InterLayout Lo) {
  const IWs w = make_iws(c, ws, peers, Lo);
  const mk_u64 epoch = mk_epoch_begin(w.st());
  const int L = Lo.L, N = Lo.N;
  const mk_u64 bytes = n * sizeof(T);
  const bool xal = ((((mk_u64)x) | bytes) & 15) == 0;
  auto A = [&](int j, int m) { return j * N + m; };
  auto S = [&](int m) { return L * N + m; };
  auto B = [&](int m) { return L * N + N + m; };
  if (!inter_open(c, w, p, epoch)) return;
  // items: [(L-1)*N NVLink pushes] [N-1 node partials sent to rail peers] [1: our own partial + final sum]
  const int n_push = (L - 1) * N, n_items = n_push + N;
  for (int it = blockIdx.x; it < n_items; it += gridDim.x) {
    if (mk_failed(c)) return;
    if (it < n_push) {
      const int j = (w.l + 1 + it / N) % L, m = it % N;
      if (!nvl_push(c, w, epoch, j, (const char*)(x + (mk_u64)w.world(m, j) * n), w.slot_off(A(w.l, m)), bytes,
                    A(w.l, m)))
        return;
      continue;
    }
    const int k = it - n_push;                      // 0 .. N-1; the last one is our own node
    const int m = (w.n + 1 + k) % N;                // k = N-1 -> m = our node
    for (int j = 0; j < L; ++j)
      if (j != w.l && !inter_wait_from(c, w, epoch, w.ready(A(j, m)), w.world(w.n, j), A(j, m))) return;
    const T* own = x + (mk_u64)w.world(m, w.l) * n;
    mk_sum_sources((T*)w.slot(S(m)), L,
                [&](int j) { return j == w.l ? own : (const T*)w.slot(A(j, m)); }, n, xal);
    __syncthreads();
    if (m != w.n) {
      int ok = 1;
      if (threadIdx.x == 0)
        ok = net_put(c, w, p, epoch, w.world(m, w.l), w.slot_off(S(m)), w.slot_off(B(w.n)), bytes, B(w.n)) !=
             MK_PROXY_NO_FLAG;
      if (!__syncthreads_and(ok)) return;
      continue;
    }
    // our own node: wait for every other node's partial, then the final sum in node order
    for (int q = 1; q < N; ++q) {
      const int mm = (w.n + q) % N;
      if (!inter_wait_from(c, w, epoch, w.ready(B(mm)), w.world(mm, w.l), B(mm))) return;
    }
    mk_sum_sources(out, N, [&](int mm) { return (const T*)w.slot(mm == w.n ? S(mm) : B(mm)); }, n,
                ((((mk_u64)out) | bytes) & 15) == 0);
  }
  inter_finish(c, w, p, epoch);
}
