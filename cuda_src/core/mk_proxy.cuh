// mk_proxy.cuh - GPU -> CPU proxy command ring: a kernel asks the host proxy of its rank to move
// data to another node ("write this chunk to rank R, then raise flag F to V").
//
// Memory (allocated by mkernel/proxy/engine.py, handed to kernels by value as `MkProxy`):
//   ring[capacity]  MkProxyCmd slots in host-mapped pinned memory (GPU writes, host reads)
//   head            u64 in device memory: next ticket; producers claim tickets with atomicAdd
//   tail            u64 in host-mapped memory: tickets < tail have been taken out of the ring by the
//                   host (their slots are free again); written only by the host
//   done            u64 in host-mapped memory: tickets < done have completed locally (their source
//                   bytes were read by the NIC / copied out, so the source may be overwritten)
// Ticket t lives in slot t & (capacity-1).  A slot holds ticket t once its `seq` word reads t+1;
// `seq` is written last with st.release.sys, so the host never sees a half-written command.  Slots
// are never cleared: tickets only grow, so a stale slot (seq = t+1-capacity) never looks valid.
//
// Visibility of the payload: the data a command names must be visible to the NIC / the proxy's
// copy engine before the command is.  Pattern (one block produced the chunk with ordinary stores):
//     ... all threads store the chunk ...
//     __syncthreads();                      // the block's stores happen-before thread 0's fence
//     if (threadIdx.x == 0) mk_proxy_push(...);   // does __threadfence_system() (fence.sc.sys),
//                                                 // then publishes seq with st.release.sys
// If the chunk was written by TMA (cp.async.bulk, the async proxy) first wait for the bulk group
// (cp.async.bulk.wait_group 0) and issue fence.proxy.async before the __syncthreads.
//
// The layout of MkProxyCmd / MkProxy is mirrored by mkernel/proxy/engine.py (CMD_DTYPE, MkProxyStruct);
// tests/cpu/test_proxy_layout.py checks that both agree.
#pragma once
#include "core/mk_signal.cuh"

// Command ops (mkernel/proxy/engine.py OP_*)
#define MK_PROXY_OP_NOP 0      // consumed and completed, nothing sent (padding / tests)
#define MK_PROXY_OP_WRITE 1    // copy bytes [src_offset, +bytes) of window `win` to dst_rank's window
                               // `win` at dst_offset, then (if flag_offset != MK_PROXY_NO_FLAG) set
                               // the u64 at flag_offset of dst_rank's window flag_win to flag_value
#define MK_PROXY_OP_FLAG 2     // only the flag part of WRITE (bytes ignored)
#define MK_PROXY_OP_BARRIER 3  // set the flag on EVERY other rank (dst_rank ignored); callers give
                               // each source its own slot (flag_offset = base + 8 * my_rank)

#define MK_PROXY_NO_FLAG 0xffffffffffffffffull
#define MK_PROXY_CMD_BYTES 64

// One command: 64 bytes, 64-byte aligned (two 32-byte sectors of one PCIe write burst).
struct __align__(64) MkProxyCmd {
  unsigned char op;        // 0   MK_PROXY_OP_*
  unsigned char win;       // 1   window index of the data (same index on both ends: symmetric)
  unsigned char flag_win;  // 2   window index holding the flag at the destination
  unsigned char reserved;  // 3
  int dst_rank;            // 4   world rank of the destination
  mk_u64 src_offset;       // 8   byte offset in this rank's window `win`
  mk_u64 dst_offset;       // 16  byte offset in dst_rank's window `win`
  mk_u64 bytes;            // 24  payload size (0 allowed)
  mk_u64 flag_offset;      // 32  byte offset (8-aligned) of the u64 flag, or MK_PROXY_NO_FLAG
  mk_u64 flag_value;       // 40  value the flag is set to (flags only grow: later == larger)
  mk_u64 user;             // 48  free for the caller (e.g. globaltimer stamp for latency)
  mk_u64 seq;              // 56  ticket + 1, written last (release .sys)
};
static_assert(sizeof(MkProxyCmd) == MK_PROXY_CMD_BYTES, "MkProxyCmd must be 64 bytes");

// Passed by value to kernels that push (mkernel/proxy/engine.py MkProxyStruct).
struct MkProxy {
  MkProxyCmd* ring;    // device pointer of the host-mapped ring
  mk_u64* head;        // device memory
  const mk_u64* tail;  // device pointer of host-mapped memory
  const mk_u64* done;  // device pointer of host-mapped memory
  mk_u64 capacity;     // power of two
  int rank;            // world rank owning this proxy
  int pad;
};

MK_DEVICE void mk_st_relaxed_u32(unsigned* p, unsigned v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Wait (one thread) until the host has freed the slot of `ticket`: tail > ticket - capacity.
// On timeout reports MK_ERR_PROXY (peer = dst_rank, flag_index = -1, expected/seen = tail values).
MK_DEVICE bool mk_proxy_wait_room(const MkComm& c, const MkProxy& p, mk_u64 ticket, int dst_rank) {
  const mk_u64 need = ticket + 1 - p.capacity;  // wraps for the first `capacity` tickets: fine
  return mk_wait_geq_or(c, p.tail, need, dst_rank, -1, MK_ERR_PROXY);
}

// Push one command (ONE thread calls it).  Returns the ticket, or MK_PROXY_NO_FLAG when the ring
// stayed full past the timeout or this rank already failed (the caller must stop).
// The fence makes everything the calling block wrote before a __syncthreads visible at system scope
// (NIC, host) before the command can be seen.
MK_DEVICE mk_u64 mk_proxy_push(const MkComm& c, const MkProxy& p, int op, int dst_rank, int win, mk_u64 src_offset,
                               mk_u64 dst_offset, mk_u64 bytes, int flag_win, mk_u64 flag_offset,
                               mk_u64 flag_value, mk_u64 user = 0) {
  __threadfence_system();
  const mk_u64 ticket = atomicAdd(p.head, 1ull);
  if (!mk_proxy_wait_room(c, p, ticket, dst_rank)) return MK_PROXY_NO_FLAG;
  MkProxyCmd* s = p.ring + (ticket & (p.capacity - 1));
  const unsigned w0 = (unsigned)(op & 0xff) | ((unsigned)(win & 0xff) << 8) | ((unsigned)(flag_win & 0xff) << 16);
  mk_st_relaxed_u32((unsigned*)&s->op, w0);
  mk_st_relaxed_u32((unsigned*)&s->dst_rank, (unsigned)dst_rank);
  mk_st_relaxed(&s->src_offset, src_offset);
  mk_st_relaxed(&s->dst_offset, dst_offset);
  mk_st_relaxed(&s->bytes, bytes);
  mk_st_relaxed(&s->flag_offset, flag_offset);
  mk_st_relaxed(&s->flag_value, flag_value);
  mk_st_relaxed(&s->user, user);
  mk_st_release(&s->seq, ticket + 1);  // publish: orders the stores above before it (release .sys)
  return ticket;
}

// Wait (one thread) until command `ticket` completed locally: its source bytes may be overwritten.
// Reports MK_ERR_PROXY (peer = -1) on timeout.
MK_DEVICE bool mk_proxy_wait_done(const MkComm& c, const MkProxy& p, mk_u64 ticket) {
  const mk_u64 need = ticket + 1;
  return mk_wait_geq_or(c, p.done, need, -1, -1, MK_ERR_PROXY);
}
