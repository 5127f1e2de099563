// mk_moe_gemm.cuh - what the MoE kernels built on the GEMM component share (moe_gemm.cu: dispatch + gate/up
// GEMM; moe_gemm_combine.cu: down GEMM + combine): the end of a call whose GEMM blocks finish with their
// consumer warpgroups only (docs/moe.md, "Signals, waits, reuse").
#pragma once
#include "gemm/mk_gemm.cuh"
#include "ops/mk_moe.cuh"

// End of call for `nthreads` threads from `tid0` (a multiple of 32): the last block to arrive tells every
// peer we consumed its rows and commits the epoch.  Named barrier 7: in GEMM blocks only the consumer
// warpgroups get here (the producer warpgroup has exited).
MK_DEVICE void moe_gemm_finish(const MoeWs& w, mk_u64 ep, int tid0, int nthreads) {
  __shared__ int last;
  MkEpochState* st = w.epoch_state();
  const int t = (int)threadIdx.x - tid0;
  mk_named_barrier_sync(7, nthreads);
  if (t == 0) {
    __threadfence();
    last = atomicAdd(&st->arrived, 1u) == gridDim.x - 1;
  }
  mk_named_barrier_sync(7, nthreads);
  if (!last) return;
  for (int j = t; j < w.P; j += nthreads)
    if (j != w.me) mk_signal_set(w.peer_header(j).consumed(w.me), ep);
  mk_named_barrier_sync(7, nthreads);
  if (t == 0) {
    st->arrived = 0;
    __threadfence();
    *((volatile mk_u64*)&st->epoch) = ep;
  }
}
