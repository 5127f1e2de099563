// mk_gemm_configs.cuh - the tile configurations every GEMM-based kernel (gemm.cu, ag_gemm.cu, ...)
// selects from, and the specialization defines they share.
//
// Specialization (preprocessor defines, set by mkernel/gemm_engine.py):
//   MK_GEMM_IN, MK_GEMM_OUT  input / output dtype codes (mk_gemm_dtypes.cuh)
//   MK_GEMM_CONFIG  tile configuration (S = TMA-store staging boxes per consumer warpgroup, see below):
//                     0  debug: BM=64  (1 consumer WG), BN=128, 2 stages, every wgmma batch waited on
//                     1  BM=64  (1 consumer WG), BN=128, 8 stages, S=2   (small M / few tiles)
//                     2  BM=128 (2 consumer WGs), BN=128, 6 stages, S=2
//                     3  BM=128 (2 consumer WGs), BN=256, 4 stages, S=2  (large problems)
//                     4  BM=128 (2 consumer WGs), BN=192, 4 stages, S=2  (wave quantization: N = 1536, ...)
//                     5  BM=128 (2 consumer WGs), BN=224, 4 stages, S=2 with B "nk" (N = 7168, 57344,
//                        ...); with B "kn" (MN-major tiles need whole 64-column chunks) config 3's tile
//                     6  ping-pong: 2 consumer WGs on alternate 64x256 tiles, 5 stages (small K: the
//                        epilogue of one WG hides under the other's main loop); register epilogue
//                     8  config 2's tile in clusters of 2 blocks along N sharing A by TMA multicast
//                        (launch with cluster dims (2, 1, 1), even grid; the misaligned-row pick, entry 64)
//                     9  128x192, 4 stages, register epilogue, split-K inside clusters of 2 (the blocks
//                        of a cluster add their partials through distributed shared memory)
//                    10  idem, 3 stages, clusters of 4 (experiments, forced only)
//                    11  config 3's 128x256 tile in clusters of 2 along N sharing A by TMA multicast
//                        (less L2 -> SMEM traffic; a heuristic candidate on misaligned rows, entry 64)
//                18  BM=64 (1 consumer WG), BN=256, 5 stages, S=2: one warpgroup issuing n256 wgmmas (a
//                    warpgroup's wgmma cost ~the same time for any N <= 128 with the old consumer loop: entries 27, 34)
//                24  BM=128 (2 consumer WGs), BN=144 with B "nk" (config 4's 192 with "kn"), 4 stages, S=2:
//                    wave quantization (N = 36864 -> 256 tiles at M <= 128: 1.94 waves; cuBLAS's tile there)
//                29  BM=64, BN=128, 8 stages, S=1, TWO consumer WGs side by side along N (each 64x64 of
//                    the tile: both multiply the same A slab, each by its half of B) -- the structure of
//                    cuBLAS's 64-row kernels (384 threads; Nsight Compute, docs/gemm.md entry 37)
//                30  idem in clusters of 2 along M sharing B (cuBLAS's llama o M=128 kernel)
//                31  idem 64x96 with B "nk" (two WGs of 48 columns; "kn": 64x128), clusters of 2 along
//                    M (cuBLAS's dsv3.q_a M=512 kernel, 8 stages instead of 10)
//                32  31 without clusters
//                36  BM=128 (2 consumer WGs), BN=96 with B "nk" (128 with "kn"), 6 stages, register epilogue:
//                    split-K inside clusters of 2 (config 9's mechanism; dsv3.q_a M=512 as 64 tiles x 2)
//                40  BM=192 (THREE consumer WGs, 512 threads), BN=192, 4 stages, S=1: one wave of 192-row tiles
//                    (cuBLAS's tile for dsv3.kv_a M=8192: 129 tiles where 128x192 makes 192)
//                42  BM=128 (2 consumer WGs), BN=320 with B "nk" (two n160 wgmmas per k16 slice, B as two 160-row
//                    TMA boxes; "kn": config 3's 128x256), 3 stages, S=2 (cuBLAS's tile for llama qkv M=512)
//                46  config 2's 128x128 tile in 2 x 2 clusters: A multicast to the row pair, B to the column
//                    pair (half the L2 -> SMEM traffic for both; experiment, forced only)
//                47  idem on config 3's 128x256 tile
//                48  config 4's 128x192 tile ("kn": 128x128, 4 stages) in clusters of 2 along M sharing B
//                49  config 3's 128x256 tile in clusters of 2 along M sharing B
//                50  config 4's 128x192 tile in clusters of 2 along N sharing A
//                    (48-50 and 8, 11: the heuristic's picks on misaligned rows, docs/gemm.md entry 64)
//                53  BM=64 (1 consumer WG), BN=16 with B "nk" (64 with "kn"), 16 stages ("kn": 8), register epilogue:
//                    N <= 16 -- a decode call computed transposed (C^T = B A^T: the weights as the 64-row side,
//                    the tokens as 16 columns; cuBLAS's 64 x 16 "v" kernels, 16 stages)
//                54  idem BN=32, 16 stages ("kn": 64, 8 stages): N <= 32
//                19  config 1's 64x128 tile in clusters of 2 blocks along M sharing B by TMA multicast (each
//                    block loads half of the B tile; cuBLAS's kernel for llama o M=128): the M <= 128 pick
//   Configs with S > 0 write C through shared memory and TMA stores (MkEpilogueTmaStore) when the
//   kernel's C map is usable (c_tma); every kernel takes that map (unused by configs 0 and 6).
#pragma once
#include "gemm/mk_gemm.cuh"
#include "gemm/mk_gemm_dtypes.cuh"

#ifndef MK_GEMM_CONFIG
#define MK_GEMM_CONFIG 3
#endif

template <int CONFIG, bool KN> struct MkCfgSel;
template <bool KN> struct MkCfgSel<0, KN> { typedef MkGemmConfig<1, 128, 2, false, MK_GEMM_IN, KN> T; };
template <bool KN> struct MkCfgSel<1, KN> { typedef MkGemmConfig<1, 128, 8, true, MK_GEMM_IN, KN, false, 2> T; };
template <bool KN> struct MkCfgSel<2, KN> { typedef MkGemmConfig<2, 128, 6, true, MK_GEMM_IN, KN, false, 2> T; };
template <bool KN> struct MkCfgSel<3, KN> { typedef MkGemmConfig<2, 256, 4, true, MK_GEMM_IN, KN, false, 2> T; };
template <bool KN> struct MkCfgSel<4, KN> { typedef MkGemmConfig<2, 192, 4, true, MK_GEMM_IN, KN, false, 2> T; };
template <bool KN> struct MkCfgSel<5, KN> { typedef MkGemmConfig<2, KN ? 256 : 224, 4, true, MK_GEMM_IN, KN, false, 2> T; };
template <bool KN> struct MkCfgSel<6, KN> { typedef MkGemmConfig<2, 256, 5, true, MK_GEMM_IN, KN, true> T; };
template <bool KN> struct MkCfgSel<8, KN> { typedef MkGemmConfig<2, 128, 6, true, MK_GEMM_IN, KN, false, 2, 2> T; };
template <bool KN> struct MkCfgSel<9, KN> { typedef MkGemmConfig<2, 192, 4, true, MK_GEMM_IN, KN, false, 0, 1, 2> T; };
template <bool KN> struct MkCfgSel<10, KN> { typedef MkGemmConfig<2, 192, 3, true, MK_GEMM_IN, KN, false, 0, 1, 4> T; };
template <bool KN> struct MkCfgSel<11, KN> { typedef MkGemmConfig<2, 256, 4, true, MK_GEMM_IN, KN, false, 2, 2> T; };
template <bool KN> struct MkCfgSel<18, KN> { typedef MkGemmConfig<1, 256, 5, true, MK_GEMM_IN, KN, false, 2> T; };
template <bool KN> struct MkCfgSel<24, KN> { typedef MkGemmConfig<2, KN ? 192 : 144, 4, true, MK_GEMM_IN, KN, false, 2> T; };
template <bool KN> struct MkCfgSel<29, KN> { typedef MkGemmConfig<2, 128, 8, true, MK_GEMM_IN, KN, false, 1, 1, 1, 1, 2> T; };
template <bool KN> struct MkCfgSel<30, KN> { typedef MkGemmConfig<2, 128, 8, true, MK_GEMM_IN, KN, false, 1, 1, 1, 2, 2> T; };
template <bool KN> struct MkCfgSel<31, KN> { typedef MkGemmConfig<2, KN ? 128 : 96, 8, true, MK_GEMM_IN, KN, false, 1, 1, 1, 2, 2> T; };
template <bool KN> struct MkCfgSel<32, KN> { typedef MkGemmConfig<2, KN ? 128 : 96, 8, true, MK_GEMM_IN, KN, false, 1, 1, 1, 1, 2> T; };
template <bool KN> struct MkCfgSel<36, KN> { typedef MkGemmConfig<2, KN ? 128 : 96, 6, true, MK_GEMM_IN, KN, false, 0, 1, 2> T; };
template <bool KN> struct MkCfgSel<40, KN> { typedef MkGemmConfig<3, 192, 4, true, MK_GEMM_IN, KN, false, 1> T; };
template <bool KN> struct MkCfgSel<42, KN> { typedef MkGemmConfig<2, KN ? 256 : 320, 3, true, MK_GEMM_IN, KN, false, 2> T; };
template <bool KN> struct MkCfgSel<46, KN> { typedef MkGemmConfig<2, 128, 6, true, MK_GEMM_IN, KN, false, 2, 2, 1, 2> T; };
template <bool KN> struct MkCfgSel<47, KN> { typedef MkGemmConfig<2, 256, 4, true, MK_GEMM_IN, KN, false, 2, 2, 1, 2> T; };
template <bool KN> struct MkCfgSel<48, KN> { typedef MkGemmConfig<2, KN ? 128 : 192, 4, true, MK_GEMM_IN, KN, false, 2, 1, 1, 2> T; };
template <bool KN> struct MkCfgSel<49, KN> { typedef MkGemmConfig<2, 256, 4, true, MK_GEMM_IN, KN, false, 2, 1, 1, 2> T; };
template <bool KN> struct MkCfgSel<50, KN> { typedef MkGemmConfig<2, 192, 4, true, MK_GEMM_IN, KN, false, 2, 2> T; };
template <bool KN> struct MkCfgSel<53, KN> { typedef MkGemmConfig<1, KN ? 64 : 16, KN ? 8 : 16, true, MK_GEMM_IN, KN> T; };
template <bool KN> struct MkCfgSel<54, KN> { typedef MkGemmConfig<1, KN ? 64 : 32, KN ? 8 : 16, true, MK_GEMM_IN, KN> T; };
template <bool KN> struct MkCfgSel<19, KN> { typedef MkGemmConfig<1, 128, 8, true, MK_GEMM_IN, KN, false, 2, 1, 1, 2> T; };
// (config 42's "kn" tile, config 3's, needs less shared memory than its 320-column "nk" one: launched with the latter)
static_assert(MkCfgSel<MK_GEMM_CONFIG, false>::T::SMEM_BYTES >= MkCfgSel<MK_GEMM_CONFIG, true>::T::SMEM_BYTES &&
                  MkCfgSel<MK_GEMM_CONFIG, false>::T::THREADS == MkCfgSel<MK_GEMM_CONFIG, true>::T::THREADS,
              "one launch geometry per config (mkernel/gemm_engine.py: TileConfig.smem / threads)");

#ifdef MK_EXPECT_SMEM  // (CPU tests: mkernel/gemm_engine.py's TileConfig.smem / threads / tile for this config)
static_assert(MkCfgSel<MK_GEMM_CONFIG, false>::T::SMEM_BYTES == MK_EXPECT_SMEM, "TileConfig.smem != SMEM_BYTES");
static_assert(MkCfgSel<MK_GEMM_CONFIG, false>::T::THREADS == MK_EXPECT_THREADS, "TileConfig.threads != THREADS");
static_assert(MkCfgSel<MK_GEMM_CONFIG, false>::T::BM == MK_EXPECT_BM && MkCfgSel<MK_GEMM_CONFIG, true>::T::BM == MK_EXPECT_BM,
              "TileConfig.bm != BM");
static_assert(MkCfgSel<MK_GEMM_CONFIG, false>::T::BN == MK_EXPECT_BN_NK && MkCfgSel<MK_GEMM_CONFIG, true>::T::BN == MK_EXPECT_BN_KN,
              "TileConfig.tile_n(layout) != BN");
#endif

#define MK_THREADS (MkCfgSel<MK_GEMM_CONFIG, false>::T::THREADS)

