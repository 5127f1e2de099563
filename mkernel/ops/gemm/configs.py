"""The GEMM's tile configurations: the one table (``CONFIGS``) the host plans with and every GEMM-based kernel
is compiled from, the candidate sets the heuristic chooses among, the dtype codes, the specialization
defines and the registered specializations of ``cuda_src/gemm/gemm.cu``.

``defines`` emits a config's template parameters as ``MK_CFG_*`` defines;
``cuda_src/gemm/mk_gemm_configs.cuh`` builds the kernel's ``MkGemmConfig`` from them, so a config is written
here only.  Reference: docs/gemm.md, section "Configurations".

``setting`` reads the ``MKERNEL_GEMM_*`` overrides (docs/gemm.md, "Configurations", overrides paragraph):
the only place the GEMM reads the environment.  Comments cite measurements as "entry N":
docs/journal/gemm.md entry N.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ...core.compiler import register_specialization
from ...core.util import round_up

__all__ = ["TileConfig", "CONFIGS", "DTYPE_CODES", "IN_DTYPES", "OUT_DTYPES", "LAYOUTS", "SOURCE", "GROUP_M",
           "LEGACY_CANDIDATES", "AUTO_CANDIDATES", "GROUPED_CANDIDATES", "DECODE_SWAP_CONFIGS",
           "TALL_SWAP_CONFIGS", "SWAP_CANDIDATES", "defines", "setting", "settings_key"]

SOURCE = "gemm/gemm.cu"
DTYPE_CODES = {"bfloat16": 0, "float16": 1, "float32": 2}  # MK_GEMM_IN / MK_GEMM_OUT (mk_gemm_dtypes.cuh)
IN_DTYPES = ("bfloat16", "float16")
OUT_DTYPES = ("bfloat16", "float16", "float32")
LAYOUTS = ("kn", "nk")
GROUP_M = 8  # rasterization super-row height in tiles, every GEMM kernel's (docs/journal/gemm.md entry 52)


@dataclass(frozen=True)
class TileConfig:
    """One tile configuration (``MK_GEMM_CONFIG``): the kernel's ``MkGemmConfig`` parameters and the
    heuristic's figures for it.

    ``bm x bn`` is the tile with B "nk"; ``bn_kn`` / ``stages_kn`` (if set) the tile width / ring depth with
    B "kn" (MN-major B tiles are whole 64-column chunks, so config 5's 224 becomes 256 there).
    """

    id: int
    bm: int
    bn: int
    stages: int
    # consumer warpgroups (MkGemmConfig's NC); block = 128 * (consumers + 1) threads
    consumers: int
    efficiency: float  # relative per-tile main-loop throughput used by the heuristic
    debug: bool = False  # never chosen by the heuristic, never split
    # the two consumer warpgroups compute different bm x bn tiles at once (a block holds 2 tiles)
    pingpong: bool = False
    bn_kn: int | None = None
    staging_boxes: int = 0  # TMA-store epilogue: 8 KiB shared-memory boxes per consumer warpgroup
    # the heuristic's efficiency when M <= SMALL_M (None: as above): one band of rows streams B, and the B
    # stream, not the MMA rate, bounds every config there (docs/journal/gemm.md entry 14)
    efficiency_small_m: float | None = None
    # up to this M (above SMALL_M), efficiency_small_m also applies when the tiles make one whole wave
    # (FULL_WAVE_FILL of the SMs or more, at most all): 0 = never
    full_wave_max_m: int = 0
    # 2: blocks in clusters of 2 along N sharing A by TMA multicast (MkClusterTileScheduler<..., 1, 2>)
    cluster_n: int = 1
    # 2 or 4: split-K inside clusters of that many blocks, partials added through distributed shared
    # memory (MkClusterKScheduler / MkClusterKEpilogue); no running-sum split-K
    cluster_k: int = 1
    # 2: blocks in clusters of 2 along M sharing B by TMA multicast (MkClusterTileScheduler<..., 2, 1>)
    cluster_m: int = 1
    stages_kn: int | None = None
    # False: every wgmma batch waited on before the next (the debug config)
    pipelined: bool = True
    # 2: the two consumer warpgroups side by side along N on a 64-row tile, each on bn / 2 columns
    wg_n: int = 1

    @property
    def cluster(self) -> int:
        """Blocks per cluster (1: no clusters)."""
        return self.cluster_n * self.cluster_k * self.cluster_m

    @property
    def pairs(self) -> int:
        """Blocks that share ring slots through multicast loads (clusters along N or M; 1: none)."""
        return self.cluster_n * self.cluster_m

    @property
    def b_box_rows(self) -> int:
        """Rows of an "nk" B tensor-map box: the tile's, half of it with clusters along M (each block of
        a pair loads half) or past TMA's 256-row box limit (two boxes a tile: MkGemmConfig::B_NK_BOXES)."""
        rows = self.tile_n("nk") // self.cluster_m
        return rows // 2 if rows > 256 else rows

    @property
    def tma_store(self) -> bool:
        return self.staging_boxes > 0

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    @property
    def tiles_per_block(self) -> int:
        return 2 if self.pingpong else 1

    def tile_n(self, layout: str = "nk") -> int:
        return self.bn_kn if (layout == "kn" and self.bn_kn is not None) else self.bn

    def stages_for(self, layout: str = "nk") -> int:
        return self.stages_kn if (layout == "kn" and self.stages_kn is not None) else self.stages

    @property
    def smem(self) -> int:
        """Dynamic shared memory per block: MkGemmConfig::SMEM_BYTES of the "nk" kernel, which the "kn" one
        never exceeds (static_asserts in mk_gemm_configs.cuh; the CPU tests check this against it)."""
        # B: whole 8 KiB chunks (the "nk" tile's count fits the "kn" one's in every config), or an "nk"
        # tile narrower than 64 rows in whole 1 KiB swizzle atoms
        b = -(-self.bn // 64) * 8192 if self.bn >= 64 else round_up(self.bn * 128, 1024)
        ring = self.stages * (self.bm * 64 * 2 + b)
        bars = 512 if self.stages > 12 else 256  # MkGemmConfig::BAR_BYTES
        if self.tma_store:  # 1024-aligned staging after the barriers
            return round_up(ring + bars, 1024) + self.consumers * self.staging_boxes * 8192 + 1024
        if self.cluster_k > 1:  # 1024-aligned receive buffers: (CK-1) x owned warps x one warp's fp32 fragment
            owned = 4 * self.consumers // self.cluster_k
            bn = max(self.bn, self.bn_kn or 0)  # (sized for the wider layout's fragment)
            return round_up(ring + bars, 1024) + (self.cluster_k - 1) * owned * 32 * (bn // 2) * 4 + 1024
        return ring + bars + 1024


# Efficiencies are fitted on bench/gemm.py --sweep (60 shapes x every config): the heuristic's pick is the
# measured best or within 4 % of it on all shapes but one (docs/journal/gemm.md entry 9); later entries
# fit the configs added since.  "Forced only": not among the heuristic's candidates (config= or
# MKERNEL_GEMM_CONFIG).
CONFIGS = {
    # debug: every wgmma batch waited on, no setmaxnreg; tells layout bugs from pipeline bugs.  Forced only
    0: TileConfig(0, 64, 128, 2, 1, 0.5, debug=True, pipelined=False),
    # few tiles (small M or N); at M <= SMALL_M, where one band of rows streams B, efficiency 0.85 (entry 14)
    1: TileConfig(1, 64, 128, 8, 1, 0.65, staging_boxes=2, efficiency_small_m=0.85),
    # medium problems
    2: TileConfig(2, 128, 128, 6, 2, 0.85, staging_boxes=2),
    # large problems
    3: TileConfig(3, 128, 256, 4, 2, 1.00, staging_boxes=2),
    # wave quantization: fills 132 SMs where 256-wide tiles leave many idle (N = 1536: 8 column tiles; entry 4)
    4: TileConfig(4, 128, 192, 4, 2, 0.94, staging_boxes=2),
    # wave quantization for N = 7168, 57344 (multiples of 224), "nk" only ("kn": config 3's tile; entry 4)
    5: TileConfig(5, 128, 224, 4, 2, 0.96, bn_kn=256, staging_boxes=2),
    # ping-pong 64 x 256, register epilogue: never the fastest, forced only (docs/gemm.md, "Ping-pong")
    6: TileConfig(6, 64, 256, 5, 2, 0.90, pingpong=True),
    # config 2's tile in clusters of 2 along N sharing A: ties config 2 on aligned rows (entry 13), ahead on
    # misaligned ones (load_bound: 0.76-0.91x its time, entry 64)
    8: TileConfig(8, 128, 128, 6, 2, 0.85, staging_boxes=2, cluster_n=2),
    # config 4's tile, split-K inside clusters of 2 (partials through distributed shared memory): a candidate
    # only where its blocks fit one wave (auto_plan); 0.97 fitted on llama qkv M=128, its one win (entry 15)
    9: TileConfig(9, 128, 192, 4, 2, 0.97, cluster_k=2),
    # idem in clusters of 4: never the fastest, forced only (entries 15, 58)
    10: TileConfig(10, 128, 192, 3, 2, 0.88, cluster_k=4),
    # config 3's tile in clusters of 2 along N sharing A: slower on aligned rows (entry 15), a candidate for
    # misaligned ones (entry 64)
    11: TileConfig(11, 128, 256, 4, 2, 1.00, staging_boxes=2, cluster_n=2),
    # one consumer warpgroup on 64 x 256 tiles (n256 wgmmas; entry 28): where these tiles fill the SMs best
    # (1024x1024x8192).  0.85 above SMALL_M, where it ties config 2 and loses at long K (entry 64)
    18: TileConfig(18, 64, 256, 5, 1, 0.85, staging_boxes=2, efficiency_small_m=0.90),
    # 128 x 144 "nk" tiles ("kn": config 4's 128 x 192): wave quantization at M <= SMALL_M only (N = 36864 in
    # 256 tiles, B streamed unsplit); never won at M >= 512, hence 0.60 there (entry 32)
    24: TileConfig(24, 128, 144, 4, 2, 0.60, bn_kn=192, staging_boxes=2, efficiency_small_m=0.95),
    # config 1's tile in clusters of 2 along M sharing B: replaced by config 30 (entry 37), forced only
    19: TileConfig(19, 64, 128, 8, 1, 0.60, staging_boxes=2, efficiency_small_m=0.87, cluster_m=2),
    # 64 x 128 tiles on two consumer warpgroups side by side along N (cuBLAS's 64-row kernels, entry 37):
    # ties config 1, forced only
    29: TileConfig(29, 64, 128, 8, 2, 0.60, staging_boxes=1, wg_n=2),
    # config 29 in clusters of 2 along M sharing B: replaces config 1 at M <= SMALL_M (efficiency just above
    # its 0.85; entries 34, 37) and up to M = 512 where its tiles make one whole wave (entry 44)
    30: TileConfig(30, 64, 128, 8, 2, 0.60, staging_boxes=1, efficiency_small_m=0.87, cluster_m=2,
                   full_wave_max_m=512, wg_n=2),
    # 64 x 96 "nk" tiles ("kn": 64 x 128) on warpgroups along N, with (31) / without (32) clusters along M:
    # slower than the split plan on dsv3.q_a M=512, forced only (entry 37)
    31: TileConfig(31, 64, 96, 8, 2, 0.60, bn_kn=128, staging_boxes=1, cluster_m=2, wg_n=2),
    32: TileConfig(32, 64, 96, 8, 2, 0.60, bn_kn=128, staging_boxes=1, wg_n=2),
    # 128 x 96 tiles ("kn": 128 x 128), split-K inside clusters of 2: replaces split plans where its blocks fit
    # one wave (auto_plan; dsv3.q_a M=512 24.7 vs 25.7 us, entry 40)
    36: TileConfig(36, 128, 96, 6, 2, 0.95, bn_kn=128, cluster_k=2),
    # 192 x 192 tiles on three consumer warpgroups: one wave where 128-row tiles make 1.45 (dsv3.kv_a M=8192
    # 96-100 vs 108.6 us); 0.97 keeps it off the split plans it loses (entry 54)
    40: TileConfig(40, 192, 192, 4, 3, 0.97, staging_boxes=1),
    # 128 x 320 "nk" tiles (two n160 wgmmas, B in two 160-row boxes; "kn": config 3's): one unsplit wave for
    # llama qkv M=512 (N = 10240); 0.94 makes it the pick there only (entry 56)
    42: TileConfig(42, 128, 320, 3, 2, 0.94, bn_kn=256, staging_boxes=2),
    # configs 2 / 3's tiles in 2 x 2 clusters (A multicast along N, B along M): forced only (entry 63)
    46: TileConfig(46, 128, 128, 6, 2, 0.85, staging_boxes=2, cluster_n=2, cluster_m=2),
    47: TileConfig(47, 128, 256, 4, 2, 1.00, staging_boxes=2, cluster_n=2, cluster_m=2),
    # configs 4 ("kn": 128 x 128) / 3's tiles in clusters of 2 along M sharing B (48, 49), config 4's along N
    # sharing A (50): at their single-block config's efficiency, which wins the tie on aligned rows; ahead on
    # misaligned rows through load_bound (entry 64)
    48: TileConfig(48, 128, 192, 4, 2, 0.94, bn_kn=128, staging_boxes=2, cluster_m=2),
    49: TileConfig(49, 128, 256, 4, 2, 1.00, staging_boxes=2, cluster_m=2),
    50: TileConfig(50, 128, 192, 4, 2, 0.94, staging_boxes=2, cluster_n=2),
    # 64 x 16 / 64 x 32 "nk" tiles, 16 stages ("kn": 64 x 64, 8 stages): the transposed decode plans (the
    # caller's M <= 16 / 32 rows as N; swap_candidates, entry 66), forced only otherwise
    53: TileConfig(53, 64, 16, 16, 1, 0.60, bn_kn=64, stages_kn=8),
    54: TileConfig(54, 64, 32, 16, 1, 0.60, bn_kn=64, stages_kn=8),
}
# choose_config's default set: the configs of the first fused kernels.
LEGACY_CANDIDATES = (1, 2, 3)
# The configs mkernel.gemm chooses among (a tie goes to the first).
AUTO_CANDIDATES = (1, 2, 3, 4, 5, 9, 18, 24, 30, 36, 40, 42, 8, 49, 11, 48, 50)
# grouped_gemm's: no clusters (a cluster's blocks would straddle groups).
GROUPED_CANDIDATES = tuple(c for c in AUTO_CANDIDATES if CONFIGS[c].cluster == 1)
# Transposed plans (B "nk": C^T = B A^T, the kernel's problem the caller's N x M x K; docs/gemm.md,
# "Transposed (swapped) plans"): the decode-shaped calls' tiles, the tall-skinny calls' tiles, and every
# config compiled transposed (config 1: forced plans and the tests).
DECODE_SWAP_CONFIGS = (53, 54)
TALL_SWAP_CONFIGS = (2, 3, 4, 9, 48, 49)
SWAP_CANDIDATES = DECODE_SWAP_CONFIGS + (1,) + TALL_SWAP_CONFIGS


def defines(in_dtype: str, out_dtype: str, cfg: TileConfig | int, swap: bool = False) -> dict:
    """The preprocessor defines of a GEMM-based kernel's specialization: dtype codes, the config id
    (``MK_GEMM_CONFIG``, which names it) and the config's ``MkGemmConfig`` parameters (``MK_CFG_*``, read by
    cuda_src/gemm/mk_gemm_configs.cuh); ``swap``: the transposed problem, stored transposed (gemm.cu)."""
    c = CONFIGS[cfg] if isinstance(cfg, int) else cfg
    d = dict(MK_GEMM_IN=DTYPE_CODES[in_dtype], MK_GEMM_OUT=DTYPE_CODES[out_dtype], MK_GEMM_CONFIG=c.id,
             MK_CFG_NC=c.consumers, MK_CFG_BN_NK=c.tile_n("nk"), MK_CFG_BN_KN=c.tile_n("kn"),
             MK_CFG_STAGES_NK=c.stages_for("nk"), MK_CFG_STAGES_KN=c.stages_for("kn"),
             MK_CFG_PIPELINED=int(c.pipelined), MK_CFG_PINGPONG=int(c.pingpong), MK_CFG_STAGING=c.staging_boxes,
             MK_CFG_CLUSTER_N=c.cluster_n, MK_CFG_CLUSTER_K=c.cluster_k, MK_CFG_CLUSTER_M=c.cluster_m,
             MK_CFG_WG_N=c.wg_n)
    if swap:
        d["MK_GEMM_SWAP"] = 1
    return d


for _i in IN_DTYPES:
    for _o in OUT_DTYPES:
        for _c in CONFIGS:
            register_specialization(SOURCE, defines(_i, _o, _c))
        for _c in SWAP_CANDIDATES:
            register_specialization(SOURCE, defines(_i, _o, _c, swap=True))


# The MKERNEL_GEMM_* overrides, all part of a plan's cache key (settings_key): CONFIG (force a config),
# CANDIDATES (restrict the heuristic's), EPILOGUE (``registers``: no TMA store), PDL (0 / 1 / auto),
# GEMV (0: no decode kernel), SWAP (0: no transposed plans).
SETTINGS = ("CONFIG", "CANDIDATES", "EPILOGUE", "PDL", "GEMV", "SWAP")


def setting(name: str, default: str | None = None) -> str | None:
    """The value of ``MKERNEL_GEMM_<name>`` (``name`` in SETTINGS), read at each call."""
    return os.environ.get("MKERNEL_GEMM_" + name, default)


def settings_key() -> tuple:
    """Every override's current value: plans depend on them."""
    return tuple(setting(n) for n in SETTINGS)
