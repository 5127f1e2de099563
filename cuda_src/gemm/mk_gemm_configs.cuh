// mk_gemm_configs.cuh - the tile configuration a GEMM-based kernel (gemm.cu, ag_gemm.cu, ...) is compiled
// for: MkCfg<KN>, its MkGemmConfig (mk_gemm.cuh) with B "kn" (KN) or "nk".
//
// The configurations are written once, in mkernel/ops/gemm/configs.py (CONFIGS; docs/gemm.md, section
// "Configurations"): its defines() passes the chosen one's template parameters as preprocessor defines.
//   MK_GEMM_IN, MK_GEMM_OUT  input / output dtype codes (mk_gemm_dtypes.cuh)
//   MK_GEMM_CONFIG           the config id (names the specialization; not read here)
//   MK_CFG_NC                consumer warpgroups
//   MK_CFG_BN_NK, MK_CFG_BN_KN          tile width with B "nk" / "kn"
//   MK_CFG_STAGES_NK, MK_CFG_STAGES_KN  ring stages with B "nk" / "kn"
//   MK_CFG_PIPELINED         0: every wgmma batch waited on (the debug config)
//   MK_CFG_PINGPONG          1: the consumer warpgroups on alternate tiles
//   MK_CFG_STAGING           TMA-store staging boxes per consumer warpgroup (0: register epilogue)
//   MK_CFG_CLUSTER_N, MK_CFG_CLUSTER_K, MK_CFG_CLUSTER_M  clusters along N (A multicast), split-K inside
//                            clusters, clusters along M (B multicast)
//   MK_CFG_WG_N              2: the consumer warpgroups side by side along N on a 64-row tile
// Configs with staging write C through shared memory and TMA stores (MkEpilogueTmaStore) when the kernel's
// C map is usable (c_tma); every kernel takes that map.
#pragma once
#include "gemm/mk_gemm.cuh"
#include "gemm/mk_gemm_dtypes.cuh"

#if !defined(MK_CFG_NC) || !defined(MK_CFG_BN_NK) || !defined(MK_CFG_BN_KN) || !defined(MK_CFG_STAGES_NK) ||     \
    !defined(MK_CFG_STAGES_KN) || !defined(MK_CFG_PIPELINED) || !defined(MK_CFG_PINGPONG) ||                     \
    !defined(MK_CFG_STAGING) || !defined(MK_CFG_CLUSTER_N) || !defined(MK_CFG_CLUSTER_K) ||                      \
    !defined(MK_CFG_CLUSTER_M) || !defined(MK_CFG_WG_N)
#error "the MK_CFG_* defines of a tile config are missing (mkernel/ops/gemm/configs.py: defines())"
#endif

template <bool KN>
using MkCfg = MkGemmConfig<MK_CFG_NC, KN ? MK_CFG_BN_KN : MK_CFG_BN_NK, KN ? MK_CFG_STAGES_KN : MK_CFG_STAGES_NK,
                           MK_CFG_PIPELINED != 0, MK_GEMM_IN, KN, MK_CFG_PINGPONG != 0, MK_CFG_STAGING,
                           MK_CFG_CLUSTER_N, MK_CFG_CLUSTER_K, MK_CFG_CLUSTER_M, MK_CFG_WG_N>;

// One launch geometry per config, whatever the layout (the host launches with TileConfig.smem / threads):
// the "kn" variant may need less shared memory, never more.
static_assert(MkCfg<false>::SMEM_BYTES >= MkCfg<true>::SMEM_BYTES && MkCfg<false>::THREADS == MkCfg<true>::THREADS,
              "one launch geometry per config (mkernel/ops/gemm/configs.py: TileConfig.smem / threads)");

#ifdef MK_EXPECT_SMEM  // (CPU tests: configs.py's TileConfig.smem / threads / tile against the kernel's)
static_assert(MkCfg<false>::SMEM_BYTES == MK_EXPECT_SMEM, "TileConfig.smem != SMEM_BYTES");
static_assert(MkCfg<false>::THREADS == MK_EXPECT_THREADS, "TileConfig.threads != THREADS");
static_assert(MkCfg<false>::BM == MK_EXPECT_BM && MkCfg<true>::BM == MK_EXPECT_BM, "TileConfig.bm != BM");
static_assert(MkCfg<false>::BN == MK_EXPECT_BN_NK && MkCfg<true>::BN == MK_EXPECT_BN_KN,
              "TileConfig.tile_n(layout) != BN");
#endif

#define MK_THREADS (MkCfg<false>::THREADS)
