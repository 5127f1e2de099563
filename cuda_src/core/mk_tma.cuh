// mk_tma.cuh - Hopper (sm_90a) asynchronous-copy primitives: mbarriers, TMA tensor loads/stores,
// proxy fences, named barriers and register reallocation.
//
// Tensor maps (CUtensorMap, 128 opaque bytes, 64-byte aligned) are encoded on the host with
// cuTensorMapEncodeTiled (mkernel/core/tensormap.py) and passed by value as
// `const __grid_constant__ MkTensorMap` kernel parameters; device code takes their address (a
// generic address of the parameter) and hands it to cp.async.bulk.tensor.
//
// mbarrier phase parity: a barrier starts in phase 0.  `mk_mbar_wait(bar, p)` returns once the
// phase with parity p has completed, i.e. a fresh barrier satisfies a wait for parity 1 at once
// (the "previous" phase counts as complete).  A producer waiting for a free slot therefore waits
// on parity (phase ^ 1) and a consumer waiting for data on parity (phase), both starting at 0.
#pragma once
#include "core/mk_common.cuh"

// Same size and alignment as CUtensorMap (cuda.h is not needed on the device side).
struct alignas(64) MkTensorMap {
  mk_u64 opaque[16];
};

MK_DEVICE mk_u32 mk_smem_addr(const void* p) { return (mk_u32)__cvta_generic_to_shared(p); }

// ---- mbarriers ------------------------------------------------------------------------------
MK_DEVICE void mk_mbar_init(mk_u64* bar, mk_u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(mk_smem_addr(bar)), "r"(count) : "memory");
}

// Make barrier initialisation visible to the async proxy (TMA) and the other threads; follow with
// a __syncthreads().
MK_DEVICE void mk_mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// One arrival that also announces `bytes` of TMA transactions for the current phase.
MK_DEVICE void mk_mbar_arrive_expect_tx(mk_u64* bar, mk_u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(mk_smem_addr(bar)), "r"(bytes)
               : "memory");
}

// Plain arrival (release semantics at CTA scope).
MK_DEVICE void mk_mbar_arrive(mk_u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(mk_smem_addr(bar)) : "memory");
}

MK_DEVICE bool mk_mbar_try_wait(mk_u64* bar, mk_u32 parity) {
  mk_u32 ok;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(ok)
      : "r"(mk_smem_addr(bar)), "r"(parity)
      : "memory");
  return ok != 0;
}

// Wait (acquire at CTA scope) until the phase of parity `parity` has completed.
MK_DEVICE void mk_mbar_wait(mk_u64* bar, mk_u32 parity) {
  while (!mk_mbar_try_wait(bar, parity)) {
  }
}

// ---- clusters ------------------------------------------------------------------------------
// This block's rank in its cluster (0 .. cluster size - 1).
MK_DEVICE mk_u32 mk_cluster_ctarank() {
  mk_u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Every thread of every block of the cluster: arrive (release), then wait (acquire).
MK_DEVICE void mk_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Arrive on the mbarrier at the same shared-memory offset as `bar` in block `cta` of the cluster (cta
// may be this block).  Default semantics (release at CTA scope): a consumer releasing a ring slot
// only orders its own (already completed, wgmma-waited) shared-memory reads; ".release.cluster"
// compiled to MEMBAR.ALL.GPU + ERRBAR per arrive, which capped the cluster GEMM at ~200 TFLOP/s.
MK_DEVICE void mk_mbar_arrive_cluster(mk_u64* bar, mk_u32 cta) {
  asm volatile(
      "{\n\t.reg .b32 remote;\n\t"
      "mapa.shared::cluster.u32 remote, %0, %1;\n\t"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n\t}" ::"r"(mk_smem_addr(bar)),
      "r"(cta)
      : "memory");
}

// This block's shared-memory address `p` mapped into block `cta` of the cluster (same offset there).
MK_DEVICE mk_u32 mk_cluster_map(const void* p, mk_u32 cta) {
  mk_u32 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(mk_smem_addr(p)), "r"(cta));
  return r;
}
// Asynchronous 16-byte store into another block's shared memory (`dst`, `bar`: mk_cluster_map
// addresses), counted as 16 transaction bytes on that block's mbarrier `bar` when it lands.
MK_DEVICE void mk_st_async_v4(mk_u32 dst, float a, float b, float c, float d, mk_u32 bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(dst),
               "f"(a), "f"(b), "f"(c), "f"(d), "r"(bar)
               : "memory");
}

// ---- TMA -----------------------------------------------------------------------------------
MK_DEVICE void mk_tma_prefetch_desc(const MkTensorMap* tm) {
  asm volatile("prefetch.tensormap [%0];" ::"l"((mk_u64)tm) : "memory");
}

// Global -> shared tile load; completion (the box's bytes, zero-filled where out of bounds) is
// counted on `bar`.  Coordinates are in elements, innermost dimension first.
MK_DEVICE void mk_tma_load_2d(void* dst, const MkTensorMap* tm, mk_u64* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(mk_smem_addr(dst)),
      "l"((mk_u64)tm), "r"(mk_smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}

MK_DEVICE void mk_tma_load_3d(void* dst, const MkTensorMap* tm, mk_u64* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(mk_smem_addr(dst)),
      "l"((mk_u64)tm), "r"(mk_smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

MK_DEVICE void mk_tma_load_5d(void* dst, const MkTensorMap* tm, mk_u64* bar, int c0, int c1, int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];" ::"r"(mk_smem_addr(dst)),
      "l"((mk_u64)tm), "r"(mk_smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

// Global -> shared tile load delivered to every block of `cta_mask` in the cluster, each at the same
// shared-memory offset as `dst`, and counted on the mbarrier at `bar`'s offset in each of them.
MK_DEVICE void mk_tma_load_2d_multicast(void* dst, const MkTensorMap* tm, mk_u64* bar, int c0, int c1,
                                        unsigned short cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(mk_smem_addr(dst)),
      "l"((mk_u64)tm), "r"(mk_smem_addr(bar)), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}

MK_DEVICE void mk_tma_load_3d_multicast(void* dst, const MkTensorMap* tm, mk_u64* bar, int c0, int c1, int c2,
                                        unsigned short cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(mk_smem_addr(dst)),
      "l"((mk_u64)tm), "r"(mk_smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "h"(cta_mask)
      : "memory");
}

// Shared -> global tile store (out-of-bounds parts of the box are not written).  Issue after a
// fence.proxy.async so the generic-proxy smem writes are visible to the TMA unit.
MK_DEVICE void mk_tma_store_2d(const MkTensorMap* tm, const void* src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"((mk_u64)tm),
               "r"(mk_smem_addr(src)), "r"(c0), "r"(c1)
               : "memory");
}
MK_DEVICE void mk_tma_store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Wait until at most N committed store groups still read their shared-memory source.
template <int N> MK_DEVICE void mk_tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
template <int N> MK_DEVICE void mk_tma_store_wait() { asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory"); }

// Generic-proxy shared-memory writes -> visible to the async proxy (TMA store, wgmma operands).
MK_DEVICE void mk_fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// ---- named barriers, register reallocation ---------------------------------------------------
// Barrier `id` (1..15; 0 is __syncthreads) among `nthreads` threads (a multiple of 32).
MK_DEVICE void mk_named_barrier_sync(int id, int nthreads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(nthreads) : "memory");
}
// Arrive on barrier `id` without waiting (the threads that bar.sync on it wait for these arrivals too).
MK_DEVICE void mk_named_barrier_arrive(int id, int nthreads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(nthreads) : "memory");
}

// Every thread of the warpgroup executes these (sync.aligned).
template <int REGS> MK_DEVICE void mk_setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS)); }
template <int REGS> MK_DEVICE void mk_setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS)); }
