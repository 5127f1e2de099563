// ring_attention_x.cu - the control kernels of ring attention across nodes (docs/ring_attention.md, "Across
// nodes").  World ranks are node-major (world rank = node * L + local rank); at step s world rank r attends
// to world rank (r - s) mod P's K/V block.  A block from this node is pulled by the copy engines as on one
// node (ring_attention.cu's mk_ring_begin / mk_ring_wait gate those pulls); a block from another node is
// pushed by its owner through the owner's CPU proxy (mk_proxy.cuh: WRITE of the owner's home into the
// reader's receive buffer s % 2, then a FLAG -- "flag visible => data complete", docs/internode.md).
// One-thread kernels on the context's side stream; every wait is bounded (mk_wait_geq, MkComm.timeout_ns)
// and names the world rank waited on.
//
// Workspace (the op's proxy window 0; symmetric inside a node; the same layout on every rank):
//   [0, 64)        MkEpochState, the value slot (ring_attention.cu: MK_RING_VALUE_OFF)
//   consumed_off   MkCallHeader of the L local ranks, flags_off: ready[L] (ring_attention.cu)
//   grant_off      u64 grant[P]: world rank t's receive buffer for our block of call e is free (value e,
//                  a FLAG from t; one block per (sender, reader) pair and call, so e names it)
//   ready_off      u64 ready[P]: world rank j's block of call e is in our receive buffer (value e, the FLAG
//                  of j's WRITE, raised after its data)
//   calls_off      u64 calls[P]: (e << 32) | sig, world rank j's announcement of its call e (a FLAG before
//                  its WRITE); one word per sender: j cannot announce e + 1 to us before our grant of e + 1,
//                  which follows our read of word e
//   home_off       this rank's K then V of the current call, then the two receive buffers (buf_stride apart)
// The backward (mkernel/ops/ring_attention/internode_bwd.py) adds, after calls[P], pready[P] (world rank j's
// dK / dV partial of our block of call e is in our inbox: value e, the FLAG of j's mk_ring_x_send) and,
// after the receive buffers, its partial buffers and the inbox; its partial waits are mk_ring_x_wait on a
// layout whose ready_off is pready's.
#include "core/mk_proxy.cuh"
#include "core/mk_signal.cuh"

struct MkRingXLayout {
  mk_u64 grant_off, ready_off, calls_off;  // u64[P] each
  mk_u64 home_off, buf_off, buf_stride;    // data (offsets in the workspace)
  mk_u64 bytes;                            // bytes of one K/V block (K then V)
};

MK_DEVICE mk_u64 mk_ring_x_epoch(const char* ws) {
  return *(volatile const mk_u64*)&((const MkEpochState*)ws)->epoch;
}

// Before this call's home copy (after mk_ring_begin took the epoch): every command this rank's proxy got
// so far (the previous call's WRITEs read our home) completed locally, so the home may be overwritten.
extern "C" __global__ void __launch_bounds__(32, 1) mk_ring_x_drain(MkComm c, MkProxy p) {
  if (threadIdx.x != 0 || mk_failed(c)) return;
  const mk_u64 head = *(volatile const mk_u64*)p.head;
  if (head > 0) mk_proxy_wait_done(c, p, head - 1);
}

// Step s, reader side, before its data wait (and after the step s - 2 launches stopped reading buffer s % 2,
// an event on the stream): tell world rank `src` (another node) our buffer for its block of this call is free.
extern "C" __global__ void __launch_bounds__(32, 1) mk_ring_x_grant(MkComm c, MkProxy p, const char* ws,
                                                                    MkRingXLayout X, int src) {
  if (threadIdx.x != 0 || mk_failed(c)) return;
  const mk_u64 e = mk_ring_x_epoch(ws);
  mk_proxy_push(c, p, MK_PROXY_OP_FLAG, src, 0, 0, 0, 0, 0, X.grant_off + 8ull * c.rank, e);
}

// Step s, owner side (after this step's grant on our stream: a push never waits before our own grant of
// the step is out, so the waits cannot close a cycle around the ring): once world rank `dst` granted its
// buffer `slot`, announce the call to it, then WRITE our home into that buffer with the FLAG ready[me] = e.
// A failed rank stops sending: the reader times out naming it.
extern "C" __global__ void __launch_bounds__(32, 1) mk_ring_x_push(MkComm c, MkProxy p, const char* ws,
                                                                   MkRingXLayout X, int dst, int slot) {
  if (threadIdx.x != 0 || mk_failed(c)) return;
  const mk_u64 e = mk_ring_x_epoch(ws);
  if (!mk_wait_geq(c, (const mk_u64*)(ws + X.grant_off) + dst, e, dst, -2000 - dst)) return;
  const mk_u64 word = (e << 32) | (mk_u64)c.sig;
  if (mk_proxy_push(c, p, MK_PROXY_OP_FLAG, dst, 0, 0, 0, 0, 0, X.calls_off + 8ull * c.rank, word) ==
      MK_PROXY_NO_FLAG)
    return;
  mk_proxy_push(c, p, MK_PROXY_OP_WRITE, dst, 0, X.home_off, X.buf_off + (mk_u64)slot * X.buf_stride, X.bytes, 0,
                X.ready_off + 8ull * c.rank, e);
}

// Step s, reader side: world rank `src`'s block of this call is in our buffer and src made this very call
// (its announced signature is ours, else MK_ERR_MISMATCH naming it).  On a failure the step's launch still
// runs on stale data; the host raises at ctx.check() / ctx.synchronize().
extern "C" __global__ void __launch_bounds__(32, 1) mk_ring_x_wait(MkComm c, const char* ws, MkRingXLayout X,
                                                                   int src) {
  if (threadIdx.x != 0) return;
  const mk_u64 e = mk_ring_x_epoch(ws);
  if (!mk_wait_geq(c, (const mk_u64*)(ws + X.ready_off) + src, e, src, src)) return;
  const mk_u64* call = (const mk_u64*)(ws + X.calls_off) + src;
  const int fi = -1000 - src;
  if (!mk_wait_geq(c, call, e << 32, src, fi)) return;
  const mk_u64 got = mk_ld_acquire(call);
  if (got != ((e << 32) | (mk_u64)c.sig)) mk_report(c, MK_ERR_MISMATCH, src, fi, c.sig, got & 0xffffffffull, 0);
}

// Backward, step s, source side (after the step's launches wrote our fp32 dK / dV partial of world rank
// `dst`'s block: an event on the stream): WRITE the partial [src_off, +bytes) into dst's inbox slot at
// dst_off, with the FLAG pready[me] = e at flag_off ("flag visible => data complete").  No grant: dst summed
// its inbox of call e - 1 before it pushed us its block of call e, which this partial needed
// (docs/ring_attention.md, "Backward across nodes").
extern "C" __global__ void __launch_bounds__(32, 1) mk_ring_x_send(MkComm c, MkProxy p, const char* ws, int dst,
                                                                   mk_u64 src_off, mk_u64 dst_off, mk_u64 bytes,
                                                                   mk_u64 flag_off) {
  if (threadIdx.x != 0 || mk_failed(c)) return;
  mk_proxy_push(c, p, MK_PROXY_OP_WRITE, dst, 0, src_off, dst_off, bytes, 0, flag_off, mk_ring_x_epoch(ws));
}
