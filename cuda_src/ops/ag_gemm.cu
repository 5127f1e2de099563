// ag_gemm.cu - AllGather + GEMM in one persistent kernel: C = AllGather_rows(A) @ B on every local rank,
// each A shard multiplied as soon as it lands.  Host side: mkernel/ops/ag_gemm/op.py; design: docs/ag_gemm.md.
//
// Local rank j holds A_j [M_j, K] (row-major, dense); the gathered A [M_total, K] lives in this op's
// symmetric workspace, rows of rank j at row offs[j].  Workspace layout (same on every local rank;
// every offset before data_off depends on P only -- nch_stride is MAX_CHUNKS of mkernel/ops/ag_gemm/op.py for
// every call -- so no control word ever sits on bytes an earlier call of another shape wrote as data):
//
//   [0]             MkEpochState      this rank's call counter
//   [consumed_off]  u64[P]            consumed[j] = last call whose gathered rows local rank j finished
//                                     reading (written by j into our memory)
//                   u64[P], u64[P][2] entered[j], sig[j][e & 1]: local rank j's announcement of its call
//                                     e and its signature (mk_signal.cuh, "call signatures")
//   [flags_off]     u64[P][nch_stride] ready[src][chunk] = call that delivered rows
//                                     [chunk*CR, chunk*CR + CR) of rank src into our gathered buffer
//   [ce_value_off]  u64[AG_CE_VALUES] copy-engine path: the current call number, AG_CE_VALUES times: the
//                                     source of the copy engine's flag writes (one copy raises the
//                                     flags of up to AG_CE_VALUES consecutive chunks)
//   [ce_go_off]     u32               copy-engine path: 1 = the call is open, the side stream's copies may
//                                     start (raised by the GEMM kernel, re-zeroed by the side stream)
//   [data_off]      gathered A        M_total rows of row_bytes (16-byte multiple)
//
// Kernel mk_ag_gemm_{kn,nk} (cooperative, grid <= #SMs, one block per SM, Cfg::THREADS threads,
// Cfg::SMEM_BYTES dynamic shared memory):
//   blocks [0, n_comm)   communication: (1) copy this rank's shard into its own gathered buffer
//                        (and into `gathered_out` if given), chunk by chunk, raising ready[me][c];
//                        (2) push it into every peer's gathered buffer, destination-major in
//                        rank-rotated order (me+1 first: every rank receives first from me-1, which
//                        is the order its GEMM consumes), each chunk followed by ready[me][c] on the
//                        destination; before the first write into peer p's buffer for call e, wait
//                        for consumed[p] >= e-1; (3) if `gathered_out`, copy every peer's chunks
//                        out of the workspace as they arrive.  Never waits on compute.
//   blocks [n_comm, grid) GEMM workers (mk_gemm.cuh): tiles of rank me's rows first, then me-1,
//                        me-2, ... (tiles never straddle two shards: a shard's last tile is
//                        partial); before the first K block of a tile (or of a split-K unit: the
//                        last, partial wave's tiles may be split along K) the producer waits for the
//                        ready flags of every chunk its rows overlap.  Epilogue: store to C (split-K aware).
//   The last block to finish tells every peer it consumed its data, then commits the epoch.
// Deadlock freedom: comm blocks wait only for peers' consumed flags of the previous call (or for
// peers' pushes in step 3, which depend on nothing of ours); workers wait only for pushes; every block
// is resident (cooperative launch).
// Same call everywhere: every rank announces its call's signature (MkComm.sig, the host's digest of
// the agreed call) to the peers at the start (block 0's first warp; on the copy-engine path worker 0's
// producer warp 1, ag_ce_open), and no ready flag of this call is raised for a peer before its
// announcement matched ours (SM path: nothing is pushed; copy-engine path: the copies run but the flag
// value stays at e-1). A mismatch is MK_ERR_MISMATCH, and the waits of both ranks stop on the error
// record: no rank ever reads rows a peer sent for another call.
//
// Copy-engine path (mkernel/ops/ag_gemm/op.py, path "fused_ce"): mk_ag_gemm_* runs with n_comm = 0 (every
// block a GEMM worker, one per SM) while a side stream moves the rows with the copy engines.  The
// side stream waits (cuStreamWaitValue32) for the word at ce_go_off, which worker 0's otherwise idle
// producer warp 1 raises once it has opened the call (ag_ce_open: the call number e, every peer's
// announcement of e and its consumption of e-1, e written into the flag-value slot); the side stream
// re-zeroes the word, then runs cuMemcpyAsync of the local shard into every peer's gathered buffer
// (and into ours first when the GEMM cannot read it in place) in groups of consecutive chunks (the
// planner's copy groups: large early, single chunks at the end), each group followed by one
// copy-engine copy of e from the flag-value slots into its chunks' ready flags.  No SM is spent on
// communication, and none is left idle.
//
// Kernel mk_ag_gather (the unfused fallback's gather; cooperative, blockDim 512, no dynamic smem):
// every block is a communication block and also waits for every peer's rows; the epoch is left open
// (gather_only = 1) because the gathered buffer is read afterwards by a separate GEMM launch.  mk_ag_release (1 block) then tells
// the peers and commits the epoch.
//
// Specialization: MK_GEMM_IN (bf16 | f16), MK_GEMM_OUT (output dtype), MK_GEMM_CONFIG (1..5, 0 = debug)
// and its MK_CFG_* parameters, exactly as gemm.cu (mkernel/ops/gemm/configs.py: defines()).
#include "core/mk_copy.cuh"
#include "gemm/mk_gemm_configs.cuh"
#include "core/mk_signal.cuh"

#define MK_AG_MAXP 16  // local ranks; tile_m carries the source rank in its low 4 bits
#define AG_CE_VALUES 64  // copy-engine path: flag-value slots (mkernel/ops/ag_gemm/op.py CE_VALUES)
#ifndef MK_AG_ERR_CHECK_SPINS
#define MK_AG_ERR_CHECK_SPINS 2048  // a power of two: at MK_POLL_SLEEP_MAX_NS = 512, ~1 ms of polling
#endif

// Passed by value; mirrored by mkernel/ops/ag_gemm/op.py:AgArgs (same order, natural alignment, 232 bytes).
struct AgArgs {
  const char* a_shard;   // this rank's rows, dense [M_me, K]
  char* ws;              // this rank's workspace
  const mk_u64* peers;   // local rank -> its workspace base, as mapped here
  void* c;               // output [M_total, N], row stride ldc elements
  char* gathered_out;    // optional dense [M_total, K] copy of the gathered A (nullptr: none)
  mk_u64 row_bytes;      // K * itemsize (multiple of 16)
  mk_u64 data_off, flags_off, consumed_off;
  long long ldc;
  int M_total, N, K;
  int chunk_rows;        // CR: rows per ready flag (power of two)
  int nch_stride;        // flags per source rank
  int n_comm;            // communication blocks (blocks [0, n_comm))
  int group_m;           // rasterization super-row height
  int c_vec_ok;
  int gather_only;       // 1: leave the epoch open for mk_ag_release (mk_ag_gather: also wait for every peer's rows; copy-engine path: the gathered_a copy follows)
  int P, me;             // local_size, local_rank
  int ce_value_off;      // copy-engine path: byte offset of the u64 flag value in the workspace
  int local_map;         // 1: the GEMM reads this rank's rows in place through tmA_local (a_shard is
                         // 16-byte aligned), so they are not copied into the workspace and not waited for
  int offs[MK_AG_MAXP + 1];  // row offsets of local ranks in the gathered A; offs[P] = M_total
  int c_tma;             // 1: tmC is a map over C (see mk_gemm_run_store)
  float* partials;       // split-K of the last wave (splits > 1): fp32 running sums [split tiles][BM*BN], zero between calls
  int* counters;         // split-K: [split tiles], zero between calls
  int splits;            // K splits of the tiles from split_from on (1: none)
  int split_from;        // tiles (in the workers' order) before this one are whole (no split: the tile count)
  int ce_go_off;         // copy-engine path: byte offset of the u32 "copies may start" word (0: other paths)
};
static_assert(sizeof(AgArgs) == 240, "AgArgs layout changed: update mkernel/ag_gemm.py");

struct AgWs {
  const AgArgs* a;
  int P, me;
  MK_DEVICE AgWs(const MkComm& c, const AgArgs& args) : a(&args), P(c.local_size), me(c.local_rank) {}
  MK_DEVICE MkEpochState* epoch_state() const { return (MkEpochState*)a->ws; }
  MK_DEVICE char* data() const { return a->ws + a->data_off; }
  MK_DEVICE char* peer_data(int j) const { return (char*)a->peers[j] + a->data_off; }
  // the per-call header (mk_signal.cuh MkCallHeader), ours and local rank `owner`'s
  MK_DEVICE MkCallHeader header() const { return {(mk_u64*)(a->ws + a->consumed_off), P}; }
  MK_DEVICE MkCallHeader peer_header(int owner) const { return {(mk_u64*)((char*)a->peers[owner] + a->consumed_off), P}; }
  // Announce call `epoch` to every peer (threads `lane` of `nlanes`).
  MK_DEVICE void announce(const MkComm& c, mk_u64 epoch, int lane, int nlanes) const {
    mk_announce_call(c, [&](int j) { return peer_header(j); }, epoch, lane, nlanes);
  }
  MK_DEVICE int flag_idx(int src, int ch) const { return src * a->nch_stride + ch; }
  MK_DEVICE mk_u64* ready(int src, int ch) const { return (mk_u64*)(a->ws + a->flags_off) + flag_idx(src, ch); }
  MK_DEVICE mk_u64* peer_ready(int owner, int src, int ch) const {
    return (mk_u64*)((char*)a->peers[owner] + a->flags_off) + flag_idx(src, ch);
  }
  MK_DEVICE int rows_of(int r) const { return a->offs[r + 1] - a->offs[r]; }
  MK_DEVICE int chunks_of(int r) const { return (rows_of(r) + a->chunk_rows - 1) / a->chunk_rows; }
  // byte range of chunk ch of rank r inside the gathered buffer, and its length
  MK_DEVICE mk_u64 chunk_off(int r, int ch) const { return ((mk_u64)a->offs[r] + (mk_u64)ch * a->chunk_rows) * a->row_bytes; }
  MK_DEVICE mk_u64 chunk_len(int r, int ch) const {
    const int r0 = ch * a->chunk_rows;
    return (mk_u64)min(a->chunk_rows, rows_of(r) - r0) * a->row_bytes;
  }
};

// Opens call `epoch` of the copy-engine path (one warp): announces the call to the peers, waits (with
// the timeout) until each announced the same call and consumed our previous one, writes the call
// number into the flag-value slot the copy engines copy into ready flags (left at epoch-1 on a timeout
// or a mismatch, so the peers' GEMMs stop instead of reading rows that were never meant for them), then
// raises the u32 at ce_go_off, on which the side stream waits (cuStreamWaitValue32) before its first
// copy -- raised in every case, so the side stream never hangs.
MK_DEVICE void ag_ce_open(const MkComm& c, const AgWs& w, mk_u64 epoch) {
  const int lane = threadIdx.x & 31;
  w.announce(c, epoch, lane, 32);
  mk_ce_begin(c, epoch, w.header(), (mk_u64*)(w.a->ws + w.a->ce_value_off), true, AG_CE_VALUES);
  __syncwarp();
  if (lane == 0) {
    __threadfence_system();
    *(volatile unsigned*)(w.a->ws + w.a->ce_go_off) = 1u;
  }
}

// ---- communication blocks -------------------------------------------------------------------------
// Block `cb` of `ncb` handles chunks cb, cb+ncb, ... of this rank's shard.  All threads call it; the
// verdict is block-uniform (false: a wait failed, the caller returns).
MK_DEVICE bool ag_comm(const MkComm& c, const AgWs& w, mk_u64 epoch, int cb, int ncb) {
  const AgArgs& a = *w.a;
  const int P = w.P, me = w.me;
  const int nch = w.chunks_of(me);
  const mk_u64 base = (mk_u64)a.offs[me] * a.row_bytes;  // my rows in any gathered buffer
  // (1) local copy: the GEMM starts on these rows (unless it reads them in place: local_map)
  for (int ch = cb; ch < nch && (!a.local_map || a.gathered_out); ch += ncb) {
    const mk_u64 off = (mk_u64)ch * a.chunk_rows * a.row_bytes, len = w.chunk_len(me, ch);
    if (!a.local_map) mk_block_copy(w.data() + base + off, a.a_shard + off, len);
    if (a.gathered_out) mk_block_copy(a.gathered_out + base + off, a.a_shard + off, len);
    __syncthreads();
    if (threadIdx.x == 0 && !a.local_map) mk_signal_set(w.ready(me, ch), epoch);
  }
  // (2) pushes, destination-major, rank-rotated
  for (int j = 1; j < P; ++j) {
    const int dst = (me + j) % P;
    if (cb < nch) {  // dst announced this very call (same signature) and consumed our previous one
      int ok = 1;
      if (threadIdx.x == 0)
        ok = mk_same_call(c, w.header(), epoch, dst) &&
             mk_wait_geq(c, w.header().consumed(dst), epoch - 1, MK_LOCAL_PEER(dst), -1 - dst);
      if (!__syncthreads_and(ok)) return false;
    }
    for (int ch = cb; ch < nch; ch += ncb) {
      const mk_u64 off = (mk_u64)ch * a.chunk_rows * a.row_bytes;
      mk_block_copy(w.peer_data(dst) + base + off, a.a_shard + off, w.chunk_len(me, ch));
      __syncthreads();
      if (threadIdx.x == 0) mk_signal_set(w.peer_ready(dst, me, ch), epoch);
    }
  }
  // (3) gather only: wait until every peer's rows are here (a separate GEMM reads them next); and
  // the caller's copy of the gathered A: peers' rows, in arrival order
  if (a.gathered_out || a.gather_only) {
    for (int j = 1; j < P; ++j) {
      const int src = (me + P - j) % P;
      const int n = w.chunks_of(src);
      for (int ch = cb; ch < n; ch += ncb) {
        if (!mk_block_wait_geq(c, w.ready(src, ch), epoch, MK_LOCAL_PEER(src), w.flag_idx(src, ch))) return false;
        if (a.gathered_out) {
          const mk_u64 off = w.chunk_off(src, ch);
          mk_block_copy(a.gathered_out + off, w.data() + off, w.chunk_len(src, ch));
        }
      }
    }
  }
  return true;
}

// End of call, run by `nthreads` threads (a multiple of 32) starting at thread `tid0`: the block
// arrives; the last block to arrive tells every peer that we are done with its rows, then commits the
// epoch (with gather_only both are left to mk_ag_release, launched after the GEMM that reads them).
// Named barrier 7 (not __syncthreads: in GEMM blocks only the consumer warpgroups get here, the
// producer warpgroup has exited, so no code runs under both register budgets of setmaxnreg).
MK_DEVICE void ag_finish(const AgWs& w, mk_u64 epoch, int tid0, int nthreads) {
  __shared__ int last;
  MkEpochState* s = w.epoch_state();
  const int t = (int)threadIdx.x - tid0;
  mk_named_barrier_sync(7, nthreads);  // every thread of the group is done with the call's data
  if (t == 0) {
    __threadfence();
    last = atomicAdd(&s->arrived, 1u) == gridDim.x - 1;
  }
  mk_named_barrier_sync(7, nthreads);
  if (!last) return;
  if (w.a->gather_only) {
    if (t == 0) s->arrived = 0;
    return;
  }
  for (int j = t; j < w.P; j += nthreads)
    if (j != w.me) mk_signal_set(w.peer_header(j).consumed(w.me), epoch);
  mk_named_barrier_sync(7, nthreads);
  if (t == 0) {
    s->arrived = 0;
    __threadfence();
    *((volatile mk_u64*)&s->epoch) = epoch;
  }
}

// ---- GEMM policies ----------------------------------------------------------------------------------
// Tiles of the gathered problem in arrival order: shard me, me-1, ..., each rasterized like a plain
// GEMM (super-rows of group_m tile-rows).  A shard's tiles start at its own first row, so no tile
// straddles two shards.  t.tile_m = (tile row within the shard << 4) | source rank (read by the hook);
// t.group = 0 (B has one group).  With a->splits > 1 the tiles from a->split_from on (the last,
// partial wave) are a->splits units each, one per K range (MkLinearScheduler's scheme).
// Deterministic; stateless apart from the next unit id (everything else is re-read from the
// kernel-parameter struct: the producer warp runs on 40 registers).
template <int BM, int BN> struct AgScheduler {
  const AgArgs* a;
  int next_i;
  MK_DEVICE explicit AgScheduler(const AgArgs* a_) : a(a_), next_i(0) {}
  // Workers are the blocks past the communication blocks; the id is re-derived here (blockIdx and the
  // kernel parameters) rather than carried across the role split, where it would cost a register.
  MK_DEVICE void init(int, int) { next_i = (int)blockIdx.x - a->n_comm; }
  MK_DEVICE bool next(MkTile& t) {
    int i = mk_split_unit(next_i, a->splits, a->split_from, t);
    next_i += (int)gridDim.x - a->n_comm;
    const int P = a->P, me = a->me, N = a->N;
    const int num_n = (N + BN - 1) / BN;
    for (int k = 0; k < P; ++k) {
      const int src = me - k < 0 ? me - k + P : me - k;
      const int row0 = a->offs[src], rows = a->offs[src + 1] - row0;
      const int num_m = (rows + BM - 1) / BM;
      const int cnt = num_m * num_n;
      if (i < cnt) {
        int tm, tn;
        mk_raster(i, num_m, num_n, a->group_m, tm, tn);
        t.group = 0;
        t.tile_m = (tm << 4) | src;
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

// Producer hook: before a tile's first K block, wait until every chunk its rows overlap has landed in
// our gathered buffer (ready[src][chunk] >= epoch), then order those generic-proxy writes before the
// TMA (async proxy) reads.  Lane l of the producer warp watches chunk first+l (a tile overlaps at most
// BM / chunk_rows + 1 <= 32 chunks: the host keeps chunk_rows >= 8), so the wait costs the 40-register
// producer one flag per lane instead of a loop.  Times out like mk_wait_geq (error record, false).
// Copy-engine path (n_comm = 0): a sender's chunks land in order (one copy-engine queue), so when the
// wait finds the shard's last chunk landed too, every later tile of that shard skips the wait (and its
// proxy fence): `landed` has bit src set (this producer warp's own state).
template <int BM> struct AgWaitRows {
  const MkComm* c;
  const AgArgs* a;
  const MkTensorMap* tm_local;  // this rank's a_shard (used when a->local_map)
  mk_u64 epoch;
  mutable unsigned landed = 0;  // sources whose whole shard this warp saw landed (copy-engine path)
  // Copy-engine path: worker 0's idle producer warp 1 opens the call for the side stream's copies
  // (ag_ce_open) while the GEMM runs -- no block or SM is set aside for it.
  static constexpr bool kSideWork = true;
  MK_DEVICE void side_work(int warp, int worker) const {
    if (warp == 1 && worker == 0 && a->ce_go_off != 0) ag_ce_open(*c, AgWs(*c, *a), epoch);
  }
  // This rank's rows come straight from a_shard when it has a tensor map; the others from the workspace.
  MK_DEVICE const MkTensorMap* a_map(const MkTile& t, const MkTensorMap* tmA, int& a_row) const {
    const int me = a->me;
    if (a->local_map && (t.tile_m & 15) == me) {
      a_row = t.row0 - a->offs[me];
      return tm_local;
    }
    a_row = t.row0;
    return tmA;
  }
  MK_DEVICE bool before_load(int, int tile_m, int, int, bool unit_start) const {
    if (!unit_start) return true;  // the unit's first K block waits for the rows; its later ones find them
    if (a->local_map && (tile_m & 15) == a->me) return true;  // read in place: nothing to wait for
#ifdef MK_AG_TIMING_NO_WAIT
    return true;  // timing experiment only (docs/journal/ag_gemm.md): the GEMM without its waits; wrong output
#endif
    const int src = tile_m & 15;
    if ((landed >> src) & 1u) return true;  // (fenced when it was seen)
    const int lane = threadIdx.x & 31;
    const int r0 = (tile_m >> 4) * BM;
    const int rows = a->offs[src + 1] - a->offs[src];
    const int r1 = min(r0 + BM, rows);  // exclusive, > r0
    const int CR = a->chunk_rows;
    const int first = r0 / CR, n = (r1 - 1) / CR - first + 1;
    // lanes [0, n) watch the tile's chunks; on the copy-engine path lane 31 (n <= 31 there: chunk_rows
    // >= 128 >= BM) also peeks at the shard's last chunk, without waiting for it
    const bool peek = a->n_comm == 0 && lane == 31;
    const int idx = src * a->nch_stride + (peek ? (rows - 1) / CR : first + (lane < n ? lane : 0));
    const mk_u64* flag = (const mk_u64*)(a->ws + a->flags_off) + idx;
    bool whole = false;
    // Polls like mk_wait_geq (mk_signal.cuh: back-off, the error record read about every millisecond,
    // 64-bit time), written out with lane 0's clock so it fits the producer's register budget.
    mk_u64 t0 = 0;  // globaltimer (ns) at the first clock read
    unsigned spins = 0;
    while (true) {
      const mk_u64 v = mk_ld_acquire(flag);
      const bool ready = (mk_i64)(v - epoch) >= 0;
      whole = __shfl_sync(0xffffffffu, ready, 31);
      if (__all_sync(0xffffffffu, ready || peek)) break;
#if MK_POLL_SLEEP_MAX_NS > 0
      __nanosleep(MK_POLL_SLEEP_MAX_NS);
#endif
      if ((++spins & 7u) == 0) {
        const mk_u64 now = __shfl_sync(0xffffffffu, mk_globaltimer(), 0);  // warp-uniform
        if (t0 == 0) {  // the first clock read (keyed on t0: the spin count wraps in a wait of ~37 min)
          t0 = now;
        } else if (now - t0 > c->timeout_ns) {
          const unsigned late = __ballot_sync(0xffffffffu, !ready && !peek);
          if (lane == __ffs(late) - 1)
            mk_report(*c, MK_ERR_TIMEOUT, MK_LOCAL_PEER(src), idx, epoch, v, now - t0);
          return false;
        }
        // the error record (PCIe): every MK_AG_ERR_CHECK_SPINS polls, about a millisecond apart
        if ((spins & (MK_AG_ERR_CHECK_SPINS - 1)) == 0 && __any_sync(0xffffffffu, lane == 0 && mk_failed(*c)))
          return false;
      }
    }
    __syncwarp();  // memory ordering among the lanes: every lane's acquire precedes lane 0's loads
    asm volatile("fence.proxy.async.global;" ::: "memory");
    if (a->n_comm == 0 && whole) landed |= 1u << src;
    return true;
  }
};

// ---- kernels ------------------------------------------------------------------------------------------
template <bool KN>
MK_DEVICE void ag_gemm_body(const MkTensorMap* tmA, const MkTensorMap* tmB, const MkTensorMap* tmAl,
                            const MkTensorMap* tmC, const MkComm& c, const AgArgs& a) {
  // the producer runs AgScheduler (split-K units) and the row waits: 48 registers, not 40
  typedef MkWithRegs<MkCfg<KN>, 48, 224> Cfg;
  extern __shared__ unsigned char mk_smem[];
  const AgWs w(c, a);
  const mk_u64 epoch = mk_epoch_begin(w.epoch_state());
  const int n_comm = a.n_comm;
  if (n_comm > 0 && blockIdx.x == 0 && threadIdx.x < 32) w.announce(c, epoch, threadIdx.x, 32);
  bool ok = true;
  if ((int)blockIdx.x < n_comm) {
    ok = ag_comm(c, w, epoch, blockIdx.x, n_comm);
  } else {
    AgScheduler<Cfg::BM, Cfg::BN> sched(&a);
    AgWaitRows<Cfg::BM> hook;
    hook.c = &c;
    hook.a = &a;
    hook.tm_local = tmAl;
    hook.epoch = epoch;
    MkEpilogueStore<MkOut> epi;
    epi.c = reinterpret_cast<MkOut*>(a.c);
    epi.ldc = a.ldc;
    epi.vec_ok = a.c_vec_ok;
    // a shard's last tile may end inside C (the next shard's rows follow): clip_rows = 0
    const bool r = mk_with_store_epilogue<Cfg>(epi, tmC, a.c_tma, 0, mk_smem, [&](auto& inner) {
      auto sk = mk_split_k_epilogue<Cfg::NC>(inner, a.partials, a.counters);
      return mk_gemm_run<Cfg>(tmA, tmB, a.K, sched, hook, sk, mk_smem, (int)blockIdx.x - n_comm,
                              (int)gridDim.x - n_comm);
    });
    // The producer warpgroup is done (every load it issued was consumed); the consumers finish the
    // call.  Their verdict is uniform: all of them see the abort flag at the same K block.
    if (threadIdx.x < 128 || !r) return;
    ag_finish(w, epoch, 128, 128 * Cfg::NC);
    return;
  }
  if (!ok) return;  // a wait timed out (recorded) or a peer failed: leave the epoch open
  ag_finish(w, epoch, 0, blockDim.x);
}

// tmA: the gathered A in the workspace; tmAl: this rank's a_shard (read when a.local_map); tmC: C (stored
// through when a.c_tma and the config has TMA-store staging).
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
    mk_ag_gemm_kn(const __grid_constant__ MkTensorMap tmA, const __grid_constant__ MkTensorMap tmB,
                  const __grid_constant__ MkTensorMap tmAl, const __grid_constant__ MkTensorMap tmC,
                  const __grid_constant__ MkComm c, const __grid_constant__ AgArgs a) {
  ag_gemm_body<true>(&tmA, &tmB, &tmAl, &tmC, c, a);
}
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
    mk_ag_gemm_nk(const __grid_constant__ MkTensorMap tmA, const __grid_constant__ MkTensorMap tmB,
                  const __grid_constant__ MkTensorMap tmAl, const __grid_constant__ MkTensorMap tmC,
                  const __grid_constant__ MkComm c, const __grid_constant__ AgArgs a) {
  ag_gemm_body<false>(&tmA, &tmB, &tmAl, &tmC, c, a);
}

// Gather only (unfused path; a.gather_only = 1): every block is a communication block (a.n_comm unused).
extern "C" __global__ void __launch_bounds__(512, 1)
    mk_ag_gather(const __grid_constant__ MkComm c, const __grid_constant__ AgArgs a) {
  const AgWs w(c, a);
  const mk_u64 epoch = mk_epoch_begin(w.epoch_state());
  if (blockIdx.x == 0 && threadIdx.x < 32) w.announce(c, epoch, threadIdx.x, 32);
  if (!ag_comm(c, w, epoch, blockIdx.x, gridDim.x)) return;
  ag_finish(w, epoch, 0, blockDim.x);
}

// Closes a deferred call (after the GEMM that read the gathered buffer): tell every peer, commit.
// One block.
extern "C" __global__ void __launch_bounds__(128, 1)
    mk_ag_release(const __grid_constant__ MkComm c, const __grid_constant__ AgArgs a) {
  const AgWs w(c, a);
  const mk_u64 epoch = mk_epoch_begin(w.epoch_state());
  for (int j = threadIdx.x; j < w.P; j += blockDim.x)
    if (j != w.me) mk_signal_set(w.peer_header(j).consumed(w.me), epoch);
  __syncthreads();
  mk_epoch_commit(w.epoch_state(), epoch);
}
