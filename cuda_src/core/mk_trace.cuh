// mk_trace.cuh - per-block phase timestamps for profiling the tile loop (experiments only).
//
// Compiled in only with -DMK_GEMM_TRACE (e.g. MKERNEL_DEFINES=MK_GEMM_TRACE=1); otherwise every macro
// is empty.  Recording is a store (a count, event 15, a read-modify-write of the block's own slot):
// nothing waits.  Block b's events live at mk_trace_buf[b * MK_TRACE_EVENTS + ev] (SM clock64 ticks
// unless noted; blocks >= MK_TRACE_BLOCKS are not recorded).  The host zeroes the buffer before a
// launch and reads it back (tools/gemm_trace.py).  Events (one designated thread each):
//   0 entry, 1 entry globaltimer (ns), 2 after barrier setup, 3 / 4 producer's first / last TMA issue,
//   5 / 13 consumer's first full barrier of its first / last unit, 6 / 14 end of that unit's main loop,
//   7 last split-K unit's running-sum additions fenced, 8 its count taken, 9 last store returned,
//   10 after drain, 11 exit globaltimer (ns), 12 units run, 15 split tiles this block finished.
#pragma once
#include "core/mk_common.cuh"

#ifdef MK_GEMM_TRACE
#define MK_TRACE_BLOCKS 264
#define MK_TRACE_EVENTS 16  // (tools/gemm_trace.py EVENTS)
__device__ mk_u64 mk_trace_buf[MK_TRACE_BLOCKS * MK_TRACE_EVENTS];
MK_DEVICE mk_u64 mk_clock64() {
  mk_u64 c;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(c));
  return c;
}
MK_DEVICE mk_u64* mk_trace_slot(int ev) {
  return blockIdx.x < MK_TRACE_BLOCKS ? mk_trace_buf + blockIdx.x * MK_TRACE_EVENTS + ev : nullptr;
}
MK_DEVICE void mk_trace_put(int ev, mk_u64 v, bool when) {
  mk_u64* p = mk_trace_slot(ev);
  if (p != nullptr && when) *p = v;
}
MK_DEVICE void mk_trace_count(int ev) {
  mk_u64* p = mk_trace_slot(ev);
  if (p != nullptr) *p += 1;
}
#define MK_TRACE(ev) mk_trace_put((ev), mk_clock64(), true)
#define MK_TRACE_IF(ev, cond) mk_trace_put((ev), mk_clock64(), (cond))
#define MK_TRACE_VAL(ev, v) mk_trace_put((ev), (mk_u64)(v), true)
#define MK_TRACE_NS(ev) mk_trace_put((ev), mk_globaltimer(), true)
#define MK_TRACE_COUNT(ev) mk_trace_count(ev)
#define MK_TRACE_STMT(stmt) stmt
#else
#define MK_TRACE(ev) ((void)0)
#define MK_TRACE_IF(ev, cond) ((void)sizeof(cond))  // not evaluated (no live counters without the trace)
#define MK_TRACE_VAL(ev, v) ((void)sizeof(v))
#define MK_TRACE_NS(ev) ((void)0)
#define MK_TRACE_COUNT(ev) ((void)0)
#define MK_TRACE_STMT(stmt) ((void)0)
#endif
