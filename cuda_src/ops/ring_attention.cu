// ring_attention.cu - the control kernels of ring attention's K/V rotation (docs/ring_attention.md,
// "Synchronisation").  The attention itself is attention_fwd.cu (MK_ATTN_MERGE); the K/V blocks move by
// copy-engine pulls (cuMemcpyAsync from a peer's workspace) on the context's side stream.  These one-warp
// kernels, also on the side stream, open a call and gate each pull on the owner's flag; every wait is
// bounded by MkComm.timeout_ns and reports rank / op / peer.
//
// Workspace of local rank r (symmetric; offsets from mkernel.dist.signals.workspace_control(P, 1)):
//   [0, 16)       MkEpochState (epoch = the last call begun)
//   [32, 40)      value: this call's number, the source of the copy engine's flag writes
//   consumed_off  MkCallHeader: consumed[j] = the last call whose K/V j finished pulling from r's home,
//                 entered[j] / sig[j][2] = j's announcement of its call
//   flags_off     ready[j] = the last call whose K/V j's home holds (written by j's copy engine)
//   data_off      home: this rank's K then V for the current call; then the two receive buffers
#include "core/mk_signal.cuh"

#define MK_RING_VALUE_OFF 32  // mirrored in mkernel/ops/ring_attention/op.py

struct MkRingLayout {
  int consumed_off;  // MkCallHeader
  int flags_off;     // ready[P]
};

MK_DEVICE MkCallHeader mk_ring_header(char* base, const MkComm& c, const MkRingLayout& L) {
  return MkCallHeader{(mk_u64*)(base + L.consumed_off), c.local_size};
}

// Open call e = epoch + 1 (one warp, side stream, before this rank's home copy): announce the call's
// signature to every peer; wait until every peer finished pulling our home of call e-1 (it is about to
// be overwritten); write e into the value slot.  The epoch is taken even on a timeout, so the pull gates
// of this call wait for e (and time out too) instead of pulling a stale home.
extern "C" __global__ void __launch_bounds__(32, 1)
mk_ring_begin(MkComm c, char* ws, const mk_u64* __restrict__ peers, MkRingLayout L) {
  MkEpochState* es = (MkEpochState*)ws;
  const mk_u64 e = mk_epoch_begin(es);
  mk_announce_call(c, [&](int j) { return mk_ring_header((char*)peers[j], c, L); }, e, threadIdx.x, 32);
  const MkCallHeader h = mk_ring_header(ws, c, L);
  bool ok = true;
  for (int j = threadIdx.x; j < c.local_size; j += 32)
    if (j != c.local_rank) ok = ok && mk_wait_geq(c, h.consumed(j), e - 1, MK_LOCAL_PEER(j), -1 - j);
  ok = __all_sync(0xffffffffu, ok);
  if (threadIdx.x == 0) {
    if (ok) *(volatile mk_u64*)(ws + MK_RING_VALUE_OFF) = e;
    __threadfence();
    *((volatile mk_u64*)&es->epoch) = e;
  }
}

// Gate of the pull from local peer `src` (one thread; side stream, after mk_ring_begin): src made this call
// with our signature (else MK_ERR_MISMATCH: nothing is pulled from a peer making another call) and its
// home holds this call's K/V (ready[src] >= e).  On a failure the pull still runs (the stream goes on) but
// its data is never used: the host raises at ctx.check() / ctx.synchronize().
extern "C" __global__ void __launch_bounds__(32, 1)
mk_ring_wait(MkComm c, char* ws, MkRingLayout L, int src) {
  if (threadIdx.x != 0) return;
  const mk_u64 e = *(volatile const mk_u64*)&((const MkEpochState*)ws)->epoch;
  const MkCallHeader h = mk_ring_header(ws, c, L);
  if (!mk_same_call(c, h, e, src)) return;
  mk_wait_geq(c, (const mk_u64*)(ws + L.flags_off) + src, e, MK_LOCAL_PEER(src), src);
}
