"""GEMM and grouped GEMM on Hopper (TMA + wgmma, warp-specialized, persistent): ``cuda_src/gemm.cu``.

``gemm(a, b)``: ``C[M, N] = A[M, K] @ B`` with A row-major ``[M, K]`` and B either row-major
``[K, N]`` (``b_layout="kn"``) or ``[N, K]`` (``b_layout="nk"``, weights as frameworks store them,
i.e. ``C = A @ B.T``).  ``grouped_gemm(a, b, group_offsets)``: for every group g,
``C[o[g]:o[g+1]] = A[o[g]:o[g+1]] @ B[g]`` with B ``[G, K, N]`` ("kn") or ``[G, N, K]`` ("nk")
(MoE experts; groups may be empty and uneven).

Inputs are bf16 or fp16 (A and B alike), accumulation is fp32, the output is bf16, fp16 or fp32
(default: the input dtype; pass ``out=`` or ``out_dtype=``).  Arrays are anything with
``__cuda_array_interface__`` or DLPack on the current device.  Any M, N, K works: tiles at the edges
are masked (TMA zero-fills out-of-bounds loads, the epilogue masks stores); K == 0 writes zeros.

TMA needs 16-byte-aligned base addresses and row strides.  An operand that violates this (e.g. K = 7
for row-major A, N odd for a "kn" B, a misaligned view, a non-unit inner stride) is first staged on
the device into a dense zero-padded copy (``mk_pad_copy_u16``, one extra pass over that operand),
so every shape works; aligned operands are read in place.  The output needs a unit column stride
(any row stride): with a 16-byte aligned base and row stride it is written through shared memory
and TMA stores (clipped at M and N), otherwise with masked stores from registers.

Few output tiles (small M or N): K is split (``splits``); every split adds its fp32 partial into
one running sum per tile and the tile's last split to finish stores it, in the same kernel; with a
partial last wave only its tiles may be split.

Launch cost: a per-shape plan (compiled kernel, grid, tensor maps, packed arguments, staging and
split-K buffers) is cached in a bounded LRU keyed by the operands' pointers, shapes, strides and
dtypes, the output's layout (not its address: another output of that layout re-points the launch)
and the stream, so a repeated call re-encodes nothing.  Those buffers live in the plan, which only
serves calls on one stream.  A plan with buffers that runs while its stream is being captured into a
CUDA graph is kept for the life of the process (the graph replays its buffers even after the LRU
evicts the plan).
"""
from __future__ import annotations

import ctypes
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np
from cuda.bindings import driver as cu

from ...core.arrays import DeviceArray
from ...core.compiler import compile_module, kernel, precompile_source, register_specialization
from ...core.device import on_device as _on_device
from ...core.driver import check, device_attribute
from ...core.interop import as_device_array
from ...core.streams import is_capturing, stream_handle
from ...core.tensormap import encode_tiled
from ...core.util import round_up

__all__ = ["gemm", "grouped_gemm", "TileConfig", "CONFIGS", "choose_config", "config_cost", "describe",
           "AUTO_CANDIDATES", "GROUPED_CANDIDATES", "LEGACY_CANDIDATES", "check_operands", "c_map", "b_operand"]

SOURCE = "gemm/gemm.cu"
_CODE = {"bfloat16": 0, "float16": 1, "float32": 2}
IN_DTYPES = ("bfloat16", "float16")
OUT_DTYPES = ("bfloat16", "float16", "float32")
LAYOUTS = ("kn", "nk")


@dataclass(frozen=True)
class TileConfig:
    """One tile configuration of cuda_src/gemm.cu (MK_GEMM_CONFIG).

    ``bm x bn`` is the tile with B "nk"; ``bn_kn`` (if set) the tile width with B "kn" (MN-major B
    tiles are whole 64-column chunks, so config 5's 224 becomes 256 there).  ``pingpong``: the two
    consumer warpgroups compute different ``bm x bn`` tiles at once (a block holds 2 tiles).
    """

    id: int
    bm: int
    bn: int
    stages: int
    # consumer warpgroups; block = 128 * (consumers + 1) threads.  One per 64-row slab of the tile, except
    # ping-pong (one per tile) and 64-row tiles with two (side by side along N on bn / 2 columns each)
    consumers: int
    efficiency: float  # relative per-tile main-loop throughput used by the heuristic
    debug: bool = False
    pingpong: bool = False
    bn_kn: int | None = None
    staging_boxes: int = 0  # TMA-store epilogue: 8 KiB shared-memory boxes per consumer warpgroup
    # the heuristic's efficiency when M <= SMALL_M (None: as above): one band of rows streams B, and
    # the B stream, not the MMA rate, bounds every config there
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

    @property
    def epilogue_k(self) -> int:
        """The epilogue's exposed cost in K-equivalents (see EPILOGUE_K)."""
        return EPILOGUE_K_TMA if self.tma_store else EPILOGUE_K

    @property
    def smem(self) -> int:  # must match MkGemmConfig::SMEM_BYTES (B reserved in whole 8 KiB chunks)
        # B: whole 8 KiB chunks (the "nk" tile's count fits the "kn" one's in every config), or an "nk"
        # tile narrower than 64 rows in whole 1 KiB swizzle atoms (its "kn" variant: fewer stages)
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


# Efficiencies (second session) and EPILOGUE_K_TMA (third session): checked against
# the `bench/gemm.py --sweep` run of 2026-11-30 (60 shapes x every config, split factors of the chosen
# config): the heuristic's pick is the measured best or within 4 % of it on every shape but one (docs/gemm.md).
CONFIGS = {
    0: TileConfig(0, 64, 128, 2, 1, 0.5, debug=True),  # simple: every wgmma batch waited on
    1: TileConfig(1, 64, 128, 8, 1, 0.65, staging_boxes=2, efficiency_small_m=0.85),
    2: TileConfig(2, 128, 128, 6, 2, 0.85, staging_boxes=2),
    3: TileConfig(3, 128, 256, 4, 2, 1.00, staging_boxes=2),
    4: TileConfig(4, 128, 192, 4, 2, 0.94, staging_boxes=2),  # fills 132 SMs where 256-wide tiles leave many idle
    5: TileConfig(5, 128, 224, 4, 2, 0.96, bn_kn=256, staging_boxes=2),  # idem, "nk" only (kn: config 3's tile)
    # ping-pong 64x256, register epilogue: measured never the fastest (docs/gemm.md), forced only
    6: TileConfig(6, 64, 256, 5, 2, 0.90, pingpong=True),
    # config 2's tile in clusters of 2 along N sharing A by TMA multicast: measured at config 2's speed
    # (docs/gemm.md entry 13) and forced only until entry 64 (0.76-0.91x config 2's time on misaligned
    # rows, 0.93-1.0x on most aligned ones: a candidate, planned as config 2 but for load_bound).
    8: TileConfig(8, 128, 128, 6, 2, 0.85, staging_boxes=2, cluster_n=2),
    # config 4's tile, split-K inside clusters of 2 / 4 (partials through distributed shared memory).
    # Sweep of 2026-11-30 (sixth session, docs/gemm.md entry 15): config 9 the fastest on llama qkv
    # M=128 (422 TFLOP/s vs 395 for the next config, 0.97x cuBLAS) and slower than the heuristic's
    # plan on the 13 other shapes; as a candidate only when its CK x tiles blocks fit in one wave
    # (two waves and more lost everywhere: kv_a M=8192 547 vs 611).  Config 10: never the fastest, forced only.
    9: TileConfig(9, 128, 192, 4, 2, 0.97, cluster_k=2),
    10: TileConfig(10, 128, 192, 3, 2, 0.88, cluster_k=4),
    # config 3's tile in clusters of 2 along N sharing A: never the fastest (631-650 TFLOP/s vs config 3's
    # 659-664 on squares 4096/8192 and llama down M=8192), forced only
    11: TileConfig(11, 128, 256, 4, 2, 1.00, staging_boxes=2, cluster_n=2),
    # one consumer warpgroup on 64 x 256 tiles: n256 wgmmas, twice config 1's work per instruction for
    # about the same issue time (docs/gemm.md entries 27-28; with no loads it runs at config 3's rate).
    # Efficiency fitted on dsv3.moe_gate_up M=512 (44.3 us vs config 2's 48.1: 0.85 x 1.086 = 0.92),
    # rounded down; it was the pick there only (128 tiles in one wave instead of config 2's 128).  0.85
    # above M = SMALL_M since entry 64: there it ties config 2 now (43.1 vs 43.9 us) and one-wave shapes
    # with long K lose badly on it (713x2576x10896: 108.7 vs 72.3 us for config 2; 1862x904x2152: 17.8
    # vs 16.1); at M <= SMALL_M (no measurement against it) 0.90 as before
    18: TileConfig(18, 64, 256, 5, 1, 0.85, staging_boxes=2, efficiency_small_m=0.90),
    # 128 x 144 "nk" tiles (with "kn": config 4's 128 x 192): wave quantization where N / 144 fills the SMs
    # (dsv3.dense_gate_up, N = 36864: 256 tiles of 128 rows, 1.94 waves; cuBLAS's nvjet 144x128 there).
    # A candidate at M <= SMALL_M only (efficiency 0.60 above): measured (docs/gemm.md entry 32) it beat
    # the pick at dense_gate_up M=128 (137.6-146.2 vs 149.4-150.8 us: an unsplit stream of B instead of
    # a last wave split 11 ways) and never at M >= 512 (kv_a M=8192 110 vs 102 us, dense_gate_up M=512
    # 465 vs 413); with its fitted 0.95 everywhere it would take kv_a M=512..16384 and q_a M=512
    24: TileConfig(24, 128, 144, 4, 2, 0.60, bn_kn=192, staging_boxes=2, efficiency_small_m=0.95),
    # config 1's tile in clusters of 2 along M sharing B by TMA multicast (each block loads its A tile
    # and half of B, multicast to both): cuBLAS's kernel for llama o M=128 (nvjet ..._128x64_64x8_1x2).
    # With the consumer loop of docs/gemm.md entry 33 it beats config 1 on the M = 128 shapes config 1
    # runs (entry 34: llama o 41.5-43.9 vs 43.5-46.2 us, kv_a 9.5 vs 10.0, q_a 12.7 vs 13.0; moe_gate_up
    # and moe_down within 1.5 %) and loses where two-warpgroup tiles run (dsv3.o, dense_down, llama
    # down / gate_up / qkv at M=128: 5-27 %): efficiency_small_m just above config 1's, so it replaces
    # config 1 and nothing else; a candidate only when M's 64-row tiles pair up (_auto_plan), and not
    # measured to win above M = 128 (efficiency 0.60 there).  Replaced by config 30 (the same tile and
    # clusters, two warpgroups side by side along N), forced only since.
    19: TileConfig(19, 64, 128, 8, 1, 0.60, staging_boxes=2, efficiency_small_m=0.87, cluster_m=2),
    # Two consumer warpgroups side by side along N on 64-row tiles (each multiplies the one A slab by its
    # half of B): the structure of cuBLAS's 64-row kernels (384 threads; Nsight Compute, docs/gemm.md
    # entry 37).  Config 30 = config 19's tile and clusters with that split: llama o M=128 steady 40.6-41.2
    # vs 43.8-44.5 us on config 19 (= cuBLAS's 40.3-41.3), moe_gate_up M=128 (x2) 22.4 vs 23.1, moe_down /
    # kv_b M=128 tied, the 5- and 13-way split plans of q_a / kv_a M=128 1.5-2 % slower (still 1.08 /
    # 1.15x cuBLAS): config 19's efficiency_small_m, so it replaces config 19 (which leaves
    # the candidates) and nothing else.  29 (no clusters), 31 / 32 (64 x 96, "kn" 64 x 128, with /
    # without clusters): forced only -- 31 on q_a M=512 24.6-25.0 us cool, 27-31 steady (the 4 x 4
    # split plan 24.6 / 26-27.6; cuBLAS 19.5-20.4), 29 ties config 1 at moe_down M=128.
    29: TileConfig(29, 64, 128, 8, 2, 0.60, staging_boxes=1),
    # Sixteenth session (docs/gemm.md entry 44): also up to M = 512 where its 64 x 128 tiles make one whole
    # wave (cuBLAS runs its 128x64_64x8_1x2 there, unsplit): cool us 256x4096x8192 30.9 vs 38.2 for config
    # 18 x 2 (cuBLAS 30.1-30.8), 512x2048x8192 31.1 vs 36.0 (28.9-30.1), 512x2048x2048 9.3 vs 10.1 on
    # config 1 (9.1); not at M = 1024 (1024x1024x8192 33.3 vs 32.0) nor half a wave (256x2048x8192 27.3 vs 24.1).
    30: TileConfig(30, 64, 128, 8, 2, 0.60, staging_boxes=1, efficiency_small_m=0.87, cluster_m=2,
                   full_wave_max_m=512),
    31: TileConfig(31, 64, 96, 8, 2, 0.60, bn_kn=128, staging_boxes=1, cluster_m=2),
    32: TileConfig(32, 64, 96, 8, 2, 0.60, bn_kn=128, staging_boxes=1),
    # 128 x 96 tiles ("kn": 128 x 128), K split in two inside clusters of 2, the partials added through
    # distributed shared memory (config 9's mechanism on a tile that fills 128 SMs at M = 512, N = 1536:
    # 64 tiles x 2).  Sixteenth session (docs/gemm.md entry 40), steady us vs the split plan picked
    # before: dsv3.q_a M=512 24.7 vs 25.7 (cuBLAS 20.0), q_a M=384 21.6 vs 22.6, 256x2048x2048 9.9 vs
    # 12.5, 384x1536x4096 14.0 vs 16.6, 640x1024x4096 15.1 vs 16.3; slower where the best plan is
    # unsplit (square512 6.0 vs 3.5, 512x1536x2048 11.0 vs 9.9): _auto_plan's rule below.
    36: TileConfig(36, 128, 96, 6, 2, 0.95, bn_kn=128, cluster_k=2),
    # 192 x 192 tiles on three consumer warpgroups (512 threads, setmaxnreg 40 / 152), 4 stages, one
    # TMA-store staging box per warpgroup: cuBLAS's tile for dsv3.kv_a M=8192 (nvjet ..._192x192_64x4_1x2,
    # docs/gemm.md entry 54), where 129 tiles make one wave instead of config 4's 192 (1.45 waves, the
    # last split).  Cool us vs the plan before (call 1-2 of the twentieth session): kv_a M=8192 95.9-100.2
    # vs 108.6 (cuBLAS 95.6-99.0), 3072x1536x4096 51.2 vs 59.2, 4096x1152x4096 54.0 vs 63.7,
    # 12288x1152x4096 172 vs 191, 24576x576x4096 175 vs 196, within 1-2 % of config 4 on its many-wave
    # shapes; its split plans lose (kv_a M=2048 x 4, 4096x576x4096 x 2): efficiency 0.97 takes the first
    # kind and not the second.  (A 128 x 176 tile on two warpgroups, cuBLAS's for N = 7168 at M = 2048,
    # measured no faster than config 5 there: docs/gemm.md entry 55, not kept.)
    40: TileConfig(40, 192, 192, 4, 3, 0.97, staging_boxes=1),
    # 128 x 320 "nk" tiles (two n160 wgmmas per k16 slice, B in two 160-row TMA boxes; "kn": config 3's
    # 128 x 256), 3 stages: cuBLAS's tile for llama qkv M=512 (nvjet ..._320x128_64x3_1x2, N = 10240 = 32 x
    # 320: 128 tiles, one wave, unsplit).  Cool us (twentieth session, call 4): llama qkv M=512 129.8 vs
    # 134.3 for config 3 split 4 (cuBLAS 120.8-127.7); ties config 3 on llama gate_up / qkv M=2048; slower
    # on N = 7168 (dsv3.o M=2048 733 vs 692).  Efficiency 0.94: the pick at qkv M=512 and nowhere else on
    # the bench's shapes.
    42: TileConfig(42, 128, 320, 3, 2, 0.94, bn_kn=256, staging_boxes=2),
    # (experiment, forced only) configs 2 / 3's tiles in 2 x 2 clusters sharing A along N and B along M by
    # TMA multicast: each block reads half of each operand tile from L2 (cuBLAS's 2 x 4 / 4 x 1 clusters on
    # the mid-size shapes where every SM's L2 stream binds: docs/gemm.md entry 63)
    46: TileConfig(46, 128, 128, 6, 2, 0.85, staging_boxes=2, cluster_n=2, cluster_m=2),
    47: TileConfig(47, 128, 256, 4, 2, 1.00, staging_boxes=2, cluster_n=2, cluster_m=2),
    # 128-row tiles in pairs sharing one operand by TMA multicast: configs 4 ("kn": 128 x 128, 4 stages) / 3's
    # tiles along M sharing B, config 4's along N sharing A.  Candidates since entry 64 (docs/gemm.md): at the
    # efficiency of their single-block config (which wins the tie on aligned rows), ahead of it on misaligned
    # rows through load_bound (e.g. 696x3704x8360 "kn" on 50: 84.7 vs 99.2 us on config 4)
    48: TileConfig(48, 128, 192, 4, 2, 0.94, bn_kn=128, staging_boxes=2, cluster_m=2),
    49: TileConfig(49, 128, 256, 4, 2, 1.00, staging_boxes=2, cluster_m=2),
    50: TileConfig(50, 128, 192, 4, 2, 0.94, staging_boxes=2, cluster_n=2),
    # 64 x 16 / 64 x 32 tiles ("kn": 64 x 64, 8 stages), 16 stages: the transposed decode plans' tiles (the
    # caller's M <= 16 / 32 rows as N; swap_candidates), forced only otherwise
    53: TileConfig(53, 64, 16, 16, 1, 0.60, bn_kn=64),
    54: TileConfig(54, 64, 32, 16, 1, 0.60, bn_kn=64),
}
# Configs the fused kernels' sources (cuda_src/ag_gemm.cu) also define; choose_config's default set.
LEGACY_CANDIDATES = (1, 2, 3)
# Configs mkernel.gemm / grouped_gemm choose among.
AUTO_CANDIDATES = (1, 2, 3, 4, 5, 9, 18, 24, 30, 36, 40, 42, 8, 49, 11, 48, 50)
# Swapped plans (B "nk" only: C^T = B A^T, the kernel's M x N x K problem is the caller's N x M x K with the
# operands' roles exchanged, stored transposed; docs/gemm.md entry 66): the 64 x 16 / 64 x 32 tiles for
# decode-shaped calls (the caller's few rows of A as the tile's columns), the 128-row tiles for tall-skinny
# ones (TALL_SWAP_CONFIGS, below).
DECODE_SWAP_CONFIGS = (53, 54)
# swap_candidates' rules (docs/gemm.md entries 66, 67).  Decode-shaped calls (M <= SWAP_MAX_M): the
# 64 x 16 / 64 x 32 tiles stream B's rows 64 at a time, 16 stages deep (cuBLAS's "v" kernels), ahead of
# mk_gemv_nk and the plain tiles wherever ceil(N / 64) tiles fill SWAP_FILL of the SMs -- whole waves
# (16x8192x8192 39.4 -> 32.6 us, cuBLAS 33.5) and, with only the partial last wave split, a wave and a
# fraction (16x10240x8192 49.3 -> 43.4, 32x10240x8192 50.3 -> 44.1; the one loss 1x14336x4096 31.8 ->
# 32.8) -- and where N is too small for both (1x576x7168 8.6 -> 6.1); behind only on the small calls
# mk_gemv_nk takes (4x2048x2048 3.9 vs 5.4).
SWAP_MAX_M = 32
SWAP_FILL = 0.75
# Tall-skinny calls: 128-row tiles along N's few columns, a long K hiding the transposed register
# stores (9008x248x5752 69.0 -> 61.3 us, 10755x104x5184 47.1 -> 40.9); at short K those stores lose
# (3750x80x3024 12.0 vs 15.7, 10980x208x232 8.3 vs 10.2).
# Only 128-row tiles, N filling 3/4 of them: 64-row ones (config 1) lost where the model put them ahead
# (8192x128x8192 45.0 -> 48.2 us, 6000x64x7000 32.6 -> 34.2).
SWAP_MAX_N = 256
SWAP_MIN_K = 4096
SWAP_GAIN = 0.95
SWAP_MIN_FILL = 0.75
TALL_SWAP_CONFIGS = (2, 3, 4, 9, 48, 49)
# Every config a swapped plan may use (compiled transposed; config 1: forced plans and the tests)
SWAP_CANDIDATES = DECODE_SWAP_CONFIGS + (1,) + TALL_SWAP_CONFIGS
# Configs grouped_gemm chooses among (no clusters: a cluster's blocks would straddle groups).
GROUPED_CANDIDATES = tuple(c for c in AUTO_CANDIDATES if CONFIGS[c].cluster == 1)
# Epilogue cost in K-equivalents.  Register epilogue: a 128 x 256 bf16 tile's stores take about as long
# as 256 more K of main loop (from the K = 512 kv_b measurement); ping-pong hides it except at the end.
# TMA-store epilogue: the consumers only write shared memory, the stores drain under the next tile.
EPILOGUE_K = 256
EPILOGUE_K_TMA = 32
# Split-K (plain GEMM): at most MAX_SPLITS splits, each of at least MIN_SPLIT_KBLOCKS K blocks, fp32
# running sums at most MAX_PARTIAL_BYTES per plan.  SPLIT_REDUCE_COST: a unit's share of the
# reduction, in fp32 tiles of traffic (its vector reductions into the tile's sum; the last unit's
# read-back and re-zeroing), independent of the split factor.
MAX_SPLITS = 16
MIN_SPLIT_KBLOCKS = 4
MAX_PARTIAL_BYTES = 64 << 20
SPLIT_REDUCE_COST = 4.0
# Operand rows an odd multiple of 16 bytes apart (e.g. K = 8 mod 16 for bf16): every 128-byte TMA box row
# starts mid 32-byte sector and moves 5 sectors instead of 4 (docs/gemm.md entries 60, 62).  The configs
# that load the most rows per multiply-accumulate then run bound by their load stream: a K block costs
# at least (rows of A + rows of B loaded per block, each x MISALIGNED_ROW_COST if its operand is
# misaligned) x LOAD_AREA_PER_ROW tile-area units instead of area / efficiency (load_bound; applied to
# misaligned problems only: aligned ones plan as before).  Rows a cluster multicasts count once per
# block that loads them (configs 8, 11, 50 share A along N; 30, 48, 49 share B along M), so on misaligned
# rows the pairs beat the single-block configs of the same tile: measured (docs/gemm.md entry 64) config
# 8 at 0.76-0.99x config 2's time on 26 of 27 shapes, 50 at 0.80-0.99x config 4's on 14 of 16, 49 at
# 0.80-0.99x config 3's.  LOAD_AREA_PER_ROW fitted on that table (docs/gemm_plans_20261202.json: 70-80
# all bring the geometric-mean regret from 1.07 to 1.02-1.03; the older table's is unchanged); 56 before
# the pairs were candidates (entry 62).
MISALIGNED_ROW_COST = 1.25
LOAD_AREA_PER_ROW = 75
# Split only the last wave's tiles when that is predicted to beat every other plan by this fraction
# (measured: on large problems predicted gains of a few % came out as 1-3 % losses; kv_a M=8192,
# predicted 16 %, gained 11 %).
TAIL_SPLIT_MIN_GAIN = 0.10
# TileConfig.full_wave_max_m: "one whole wave" = at least this fraction of the SMs get a tile, none a second
FULL_WAVE_FILL = 0.9
GROUP_M = 8  # rasterization super-row height (tiles)
# M at or below which TileConfig.efficiency_small_m applies (fitted on the sweep of 2026-11-30, fifth
# session: config 1's single consumer warpgroup costs little when one 128-row band streams B --
# moe_gate_up M=128 306 -> 337 TFLOP/s; docs/gemm.md)
SMALL_M = 128
# Programmatic dependent launch (see pdl_auto): on from this arithmetic intensity (flop per byte of A, B
# and C) up.  Every measured shape of intensity >= 260 gained or stayed within noise (docs/gemm.md entry
# 20); the M = 128 projections (HBM-bound, ~120) lost 2-3 us per call with it until the consumer loop of
# entry 33 -- now they gain (entry 35: moe_down M=128 11.8 -> 10.9 us, q_a M=128 12.8 -> 12.0,
# moe_gate_up M=128 22.1-22.5 -> 21.5-22.1, llama o M=128 unchanged).  Twenty-first session (entry 62):
# every plain GEMM below it measured gains too (the launch latency PDL hides is most of a small call:
# 160x120x96 3.1 -> 2.4 us = cuBLAS, 605x128x104 3.3 -> 2.6, 145x400x864 7.8 -> 6.8, 68x176x2432 7.1 ->
# 6.2, 66x4800x4224 32.0 -> 30.4), so the threshold now applies to cluster split-K and grouped GEMMs
# only.  Grouped GEMMs over many small weights (e.g. 64 experts of 1024 x 1024 at 4096 rows: ~57) stay
# off, unmeasured.
PDL_MIN_INTENSITY = 100
# Cluster split-K plans (configs 9, 36) take PDL only where their blocks fill the SMs (this fraction of
# them or more) or each block's K range is at most PDL_CK_MAX_K: measured (docs/gemm.md entry 45), PDL
# saves them 0.3-3.4 us per call there (dsv3.q_a M=512 24.6 -> 21.2 us cool; 640x1024x4096 15.2 -> 13.6)
# and costs 1.6-5.6 us on grids that leave SMs idle with long K ranges (512x1024x8192 22.2 -> 24.4,
# llama qkv M=128 on config 9 48.1 -> 53.7).
PDL_CK_MIN_FILL = 0.9
PDL_CK_MAX_K = 2048


class _GemmArgs(ctypes.Structure):
    """Mirror of MkGemmArgs in cuda_src/gemm.cu (80 bytes)."""

    _fields_ = [
        ("c", ctypes.c_void_p),
        ("group_offsets", ctypes.c_void_p),
        ("ldc", ctypes.c_int64),
        ("M", ctypes.c_int32),
        ("N", ctypes.c_int32),
        ("K", ctypes.c_int32),
        ("num_groups", ctypes.c_int32),
        ("group_m", ctypes.c_int32),
        ("c_vec_ok", ctypes.c_int32),
        ("offsets_i32", ctypes.c_int32),
        ("c_tma", ctypes.c_int32),
        ("partials", ctypes.c_void_p),
        ("counters", ctypes.c_void_p),
        ("splits", ctypes.c_int32),
        ("split_from", ctypes.c_int32),
    ]


assert ctypes.sizeof(_GemmArgs) == 80


# --------------------------------------------------------------------------------------------
# compiled kernels, device facts
# --------------------------------------------------------------------------------------------
def _defines(in_dtype: str, out_dtype: str, config: int, swap: bool = False) -> dict:
    d = dict(MK_GEMM_IN=_CODE[in_dtype], MK_GEMM_OUT=_CODE[out_dtype], MK_GEMM_CONFIG=config)
    if swap:  # the transposed problem, stored transposed (gemm.cu)
        d["MK_GEMM_SWAP"] = 1
    return d


for _i in IN_DTYPES:
    for _o in OUT_DTYPES:
        for _c in CONFIGS:
            register_specialization(SOURCE, _defines(_i, _o, _c))
        for _c in SWAP_CANDIDATES:
            register_specialization(SOURCE, _defines(_i, _o, _c, swap=True))


def _kernel(in_dtype: str, out_dtype: str, config: int, name: str, swap: bool = False):
    return kernel(SOURCE, _defines(in_dtype, out_dtype, config, swap), name)


def _num_sms(device: int) -> int:
    return device_attribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device)


def _env_candidates(candidates):
    env = os.environ.get("MKERNEL_GEMM_CANDIDATES")
    if not env:
        return tuple(candidates)
    allowed = {int(x) for x in env.replace(",", " ").split()}
    return tuple(c for c in candidates if c in allowed) or tuple(candidates)


def choose_config(num_tiles, num_sms: int, *, k: int | None = None, layout: str | None = None,
                  candidates=LEGACY_CANDIDATES) -> TileConfig:
    """Pick the tile config of least predicted time.

    ``num_tiles(cfg)`` gives the tile count of the problem under ``cfg``.  Cost per SM, in
    multiply-accumulates / efficiency: a cooperative config runs ``w = ceil(tiles / SMs)`` waves of
    ``bm*bn*(K + EPILOGUE_K)``; a ping-pong config runs ``2*w'`` half-tiles per block
    (``w' = ceil(tiles / (2 SMs))``) of ``bm*bn*K``, plus the last epilogue(s), which are exposed
    (both warpgroups' if each has a single tile).  Without ``k`` (callers that only compare tile
    shapes) the cost is ``waves * bm * bn / efficiency``.  ``layout`` ("kn" / "nk") drops configs
    whose tile differs by layout when the layout does not suit them (config 5 with "kn").

    ``candidates``: config ids to consider; the default is the set every fused kernel source also
    defines.  ``MKERNEL_GEMM_CONFIG=<id>`` forces ``id`` if it is 0 or among the candidates;
    ``MKERNEL_GEMM_CANDIDATES=1,2,3`` restricts the candidates (e.g. back to the original three).
    """
    candidates = _env_candidates(candidates)
    env = os.environ.get("MKERNEL_GEMM_CONFIG")
    if env and (int(env) == 0 or int(env) in candidates):
        return CONFIGS[int(env)]
    best, best_cost = None, None
    for cid in candidates:
        cfg = CONFIGS[cid]
        if cfg.debug or (layout == "kn" and cfg.bn_kn is not None):
            continue
        cost = config_cost(cfg, max(1, num_tiles(cfg)), num_sms, k, layout or "nk")
        if best_cost is None or cost < best_cost:
            best, best_cost = cfg, cost
    return best


def config_cost(cfg: TileConfig, tiles: int, num_sms: int, k: int | None, layout: str = "nk",
                splits: int = 1) -> float:
    """Predicted per-SM time of ``tiles`` tiles under ``cfg`` (arbitrary units; see choose_config).

    ``splits`` > 1 (split-K, cooperative configs): ``tiles * splits`` units of ``ceil(K/64/splits)``
    K blocks each, plus, per unit, ``SPLIT_REDUCE_COST`` fp32 tiles of ``bm*bn*4`` bytes (its additions
    into the tile's sum; the last unit's read-back), counted in K-equivalents of operand loads
    (``bm*bn*4 / ((bm+bn)*2)``)."""
    area = cfg.bm * cfg.tile_n(layout)
    if k is None:
        return math.ceil(tiles / (num_sms * cfg.tiles_per_block)) * cfg.tiles_per_block * area / cfg.efficiency
    if cfg.cluster_k > 1:  # CK blocks per tile, each 1/CK of K; partials added through shared memory
        unit_k = math.ceil(math.ceil(k / 64) / cfg.cluster_k) * 64
        return math.ceil(tiles * cfg.cluster_k / num_sms) * area * (unit_k + cfg.epilogue_k) / cfg.efficiency
    if not cfg.pingpong:
        if splits > 1:
            bn = cfg.tile_n(layout)
            unit_k = math.ceil(math.ceil(k / 64) / splits) * 64
            partial_k = cfg.bm * bn * 4 / ((cfg.bm + bn) * 2)
            unit_k += SPLIT_REDUCE_COST * partial_k
            return math.ceil(tiles * splits / num_sms) * area * (unit_k + cfg.epilogue_k) / cfg.efficiency
        return math.ceil(tiles / num_sms) * area * (k + cfg.epilogue_k) / cfg.efficiency
    w = math.ceil(tiles / (2 * num_sms))
    exposed = (2 if w == 1 else 1) * area * EPILOGUE_K
    return 2 * w * area * k / cfg.efficiency + exposed


# Clusters of four blocks fit 120 of an H200's 132 SMs (cuOccupancyMaxActiveClusters: a GPC's SMs do not all
# group up); pairs fit every SM (the two SMs of a TPC).  The planning model's share for clusters of four or
# more; the launch caps its grid by the driver's answer (_plan_gemm).
CLUSTER4_FIT = 120 / 132


def workers(cfg: TileConfig, sms: int) -> int:
    """Blocks of ``cfg`` resident at once on ``sms`` SMs (the planning model's wave width)."""
    c = cfg.cluster
    if c < 4:
        return sms
    return max(c, int(sms * CLUSTER4_FIT) // c * c)


def _grid(cfg: TileConfig, tiles: int, sms: int) -> int:
    if cfg.pairs > 1:  # whole clusters (units come in pairs: see _tiles)
        return max(cfg.pairs, min(tiles, sms) // cfg.pairs * cfg.pairs)
    if cfg.cluster_k > 1:  # CK blocks per tile, whole clusters
        return max(cfg.cluster_k, min(tiles * cfg.cluster_k, sms) // cfg.cluster_k * cfg.cluster_k)
    return max(1, min(math.ceil(tiles / cfg.tiles_per_block), sms))


# --------------------------------------------------------------------------------------------
# operands
# --------------------------------------------------------------------------------------------
@dataclass
class _Operand:
    """A TMA-ready view: ptr, dims (innermost first) and byte strides of dims[1:]."""

    ptr: int
    dims: tuple
    strides: tuple
    staging: object = None  # DeviceArray holding the padded copy, or None
    copy: tuple | None = None  # (batch, rows, cols, cols_p, dst_ld, sb, sr, sc, src_ptr)


def _tma_operand(x: DeviceArray, batch: int, rows: int, cols: int, sb: int, sr: int, sc: int) -> _Operand:
    """View of x as [batch, rows, cols] (element strides sb, sr, sc) with `cols` contiguous.

    Read in place when TMA allows (16-byte aligned base and strides, unit inner stride), else staged
    into a dense [batch, rows, roundup(cols, 16)] zero-padded copy.
    """
    isz = x.dtype.itemsize
    row_b, bat_b = _row_bytes(x, batch, rows, cols, sb, sr)
    if _in_place(x, batch, rows, cols, sb, sr, sc):
        return _Operand(x.ptr, (cols, rows, batch), (row_b, bat_b))
    cols_p = round_up(cols, 16)  # (rows a multiple of 32 bytes: see row_misaligned)
    buf = DeviceArray.empty((batch, rows, cols_p), x.dtype.name, device=x.device)
    row_b = cols_p * isz
    return _Operand(buf.ptr, (cols, rows, batch), (row_b, row_b * rows), buf,
                    (batch, rows, cols, cols_p, cols_p, sb, sr, sc, x.ptr))


def _row_bytes(x: DeviceArray, batch: int, rows: int, cols: int, sb: int, sr: int) -> tuple[int, int]:
    isz = x.dtype.itemsize
    row_b = sr * isz if rows > 1 else round_up(cols * isz, 16)
    return row_b, (sb * isz if batch > 1 else row_b * rows)


def _in_place(x: DeviceArray, batch: int, rows: int, cols: int, sb: int, sr: int, sc: int) -> bool:
    """Whether TMA can read x as [batch, rows, cols] (element strides sb, sr, sc) in place."""
    row_b, bat_b = _row_bytes(x, batch, rows, cols, sb, sr)
    return ((sc == 1 or cols == 1) and x.ptr % 16 == 0 and row_b > 0 and bat_b > 0 and row_b % 16 == 0
            and bat_b % 16 == 0 and (rows == 1 or sr >= cols) and (batch == 1 or sb >= rows * sr))


def misaligned_rows(M: int, N: int, K: int, b_layout: str, itemsize: int = 2, pad: int = 0) -> tuple[bool, bool]:
    """(A, B): whether dense operands of an M x N x K GEMM, each row padded by ``pad`` elements, have rows
    an odd multiple of 16 bytes apart (load_bound; row_misaligned for the shape alone: A is M rows of K
    elements, B K rows of N ("kn") or N rows of K ("nk"); an operand of one row has no row stride)."""
    b_rows, b_cols = (K, N) if b_layout == "kn" else (N, K)
    return tuple(rows > 1 and ((cols + pad) * itemsize) % 32 == 16 for rows, cols in ((M, K), (b_rows, b_cols)))


def row_misaligned(x: DeviceArray, rows: int, cols: int) -> bool:
    """Whether TMA reads 2-D operand x ([rows, cols], cols contiguous) in place from rows an odd multiple
    of 16 bytes apart (load_bound; a staged copy's rows are 32-byte multiples)."""
    sr, sc = x.strides
    return rows > 1 and _in_place(x, 1, rows, cols, 0, sr, sc) and (sr * x.dtype.itemsize) % 32 == 16


def _pad_launch(op: _Operand, in_dtype: str, out_dtype: str, device: int):
    batch, rows, cols, cols_p, dst_ld, sb, sr, sc, src = op.copy
    k = _kernel(in_dtype, out_dtype, 1, "mk_pad_copy_u16")
    total = batch * rows * cols_p
    grid = max(1, min((total + 255) // 256, 8 * _num_sms(device)))
    args = [ctypes.c_void_p(op.ptr), ctypes.c_void_p(src)] + [ctypes.c_int64(v) for v in
                                                             (batch, rows, cols, cols_p, dst_ld, sb, sr, sc)]
    return (k, grid, 256, args)


def _zero_fill_launch(out: DeviceArray, M: int, N: int, ldc: int, in_dtype: str, device: int):
    name = "mk_pad_copy_u32" if out.dtype.itemsize == 4 else "mk_pad_copy_u16"
    k = _kernel(in_dtype, out.dtype.name, 1, name)
    grid = max(1, min((M * N + 255) // 256, 8 * _num_sms(device)))
    args = [ctypes.c_void_p(out.ptr), ctypes.c_void_p(0)] + [ctypes.c_int64(v) for v in (1, M, N, N, ldc, 0, 0, 0)]
    return (k, grid, 256, args)


def check_operands(a, b, b_layout: str, *, what: str, a_name: str = "a", grouped: bool = False, stream=None):
    """The checks every GEMM-based op makes of its operands, before any launch.

    ``a``: 2-D ``[M, K]``; ``b``: ``[K, N]`` / ``[N, K]`` ("kn" / "nk"), or ``[G, K, N]`` / ``[G, N, K]``
    when ``grouped``; both bf16 or both fp16; dimensions below 2**31.  ``what`` prefixes every message
    (e.g. ``"mkernel.gemm"``).  Returns ``(A, B, M, K, N, G)`` (``G`` = 1 when not grouped)."""
    if b_layout not in LAYOUTS:
        raise ValueError(f"{what}: b_layout must be 'kn' or 'nk', got {b_layout!r}")
    short = what.rsplit(".", 1)[-1]
    A = as_device_array(a, name=f"{short}: {a_name}", stream=stream)
    B = as_device_array(b, name=f"{short}: b", stream=stream)
    b_nd = 3 if grouped else 2
    if A.ndim != 2 or B.ndim != b_nd:
        raise ValueError(f"{what}: {a_name} must be 2-D and b {b_nd}-D, got shapes {tuple(A.shape)} and "
                         f"{tuple(B.shape)}")
    for x, name in ((A, a_name), (B, "b")):
        if x.dtype.name not in IN_DTYPES:
            raise TypeError(f"{what}: {name} has dtype {x.dtype.name}; expected one of {', '.join(IN_DTYPES)}")
    if B.dtype != A.dtype:
        raise TypeError(f"{what}: {a_name} is {A.dtype.name} but b is {B.dtype.name}; they must match")
    M, K = A.shape
    G = B.shape[0] if grouped else 1
    Kb, N = B.shape[-2:] if b_layout == "kn" else B.shape[-2:][::-1]
    if Kb != K:
        raise ValueError(f"{what}: inner dimensions differ: {a_name} is {tuple(A.shape)}, b is {tuple(B.shape)} "
                         f"(b_layout={b_layout!r})")
    if max(M, N, K, G) >= 2**31:
        raise ValueError(f"{what}: dimensions must be below 2**31")
    return A, B, M, K, N, G


def _check_device(arrays, names) -> int:
    dev = arrays[0].device
    for x, n in zip(arrays, names):
        if x.device != dev:
            raise ValueError(f"mkernel.gemm: {n} is on cuda:{x.device}, {names[0]} on cuda:{dev}")
    return dev


def _prepare_out(out, out_dtype, in_dtype: str, shape, device: int):
    if out is None:
        od = out_dtype or in_dtype
        if od not in OUT_DTYPES:
            raise TypeError(f"mkernel.gemm: out_dtype {od} not in {OUT_DTYPES}")
        return DeviceArray.empty(shape, od, device=device)
    o = out
    if o.dtype.name not in OUT_DTYPES:
        raise TypeError(f"mkernel.gemm: out has dtype {o.dtype.name}; expected one of {', '.join(OUT_DTYPES)}")
    if out_dtype is not None and o.dtype.name != out_dtype:
        raise TypeError(f"mkernel.gemm: out has dtype {o.dtype.name} but out_dtype={out_dtype}")
    if tuple(o.shape) != tuple(shape):
        raise ValueError(f"mkernel.gemm: out has shape {tuple(o.shape)}, expected {tuple(shape)}")
    if shape[1] > 1 and o.strides[1] != 1:
        raise ValueError("mkernel.gemm: out must have a unit column stride (row-major rows)")
    if shape[0] > 1 and o.strides[0] < shape[1]:
        raise ValueError(f"mkernel.gemm: out row stride {o.strides[0]} is smaller than N={shape[1]}")
    return o


# --------------------------------------------------------------------------------------------
# plans
# --------------------------------------------------------------------------------------------
@dataclass
class _Plan:
    cfg: TileConfig
    kernel: object
    grid: int
    args: list
    pre: list  # staging launches: (kernel, grid, block, args)
    keep: list  # device buffers the launches use
    splits: int = 1  # split-K factor of the split tiles (plain GEMM)
    split_from: int = 0  # tiles before this one (rasterized order) are not split
    pinned: bool = False  # captured into a CUDA graph: never freed (see run)
    zero: "ClearBeforeFirstUse | None" = None  # split-K sums and counters
    with_out: object = None  # plain GEMM: O -> the launch arguments for another output of the same layout
    dependent: bool = False  # a programmatic dependent launch (_pdl; MKERNEL_GEMM_PDL is in the plan key)
    swapped: bool = False  # plain GEMM computed transposed (C^T = B A^T; _plan_gemm)

    def run(self, stream, out=None):
        if self.keep and (not self.pinned or (self.zero is not None and self.zero.pending)):
            capturing = is_capturing(stream)
            if capturing and not self.pinned:
                # A graph replays this plan's buffers (staging copies, split-K partials and counters,
                # group offsets) long after the LRU may have evicted the plan: keep it, and them, for good.
                self.pinned = True
                with _plans_lock:
                    _pinned.append(self)
            if self.zero is not None:
                self.zero(stream, capturing)
        for k, g, b, a in self.pre:
            k.launch(g, b, a, stream=stream)
        if self.kernel is not None:
            args = self.args if out is None or self.with_out is None else self.with_out(out)
            self.kernel.launch(self.grid, self.cfg.threads, args, stream=stream, smem=self.cfg.smem,
                               cluster=(self.cfg.cluster, 1, 1) if self.cfg.cluster > 1 else None,
                               dependent=self.dependent)


_plans: "OrderedDict[tuple, _Plan]" = OrderedDict()
_plans_lock = threading.Lock()
_PLANS_MAX = 64
_pinned: list = []  # plans with buffers that were captured into a CUDA graph (kept for the process's life)


def pdl_auto(M: int, N: int, K: int, groups: int = 1, cfg: TileConfig | None = None,
             blocks: int | None = None, sms: int | None = None) -> bool:
    """The automatic choice of a programmatic dependent launch for an M x N x K GEMM (grouped: M rows
    in all over ``groups`` weights of N x K) on tile config ``cfg`` launched as ``blocks`` blocks on
    ``sms`` SMs: on for every plain GEMM on a config without cluster split-K; for grouped GEMMs and
    cluster split-K configs where its arithmetic intensity ``2MNK / (2(MK + groups NK + MN))`` is at
    least PDL_MIN_INTENSITY flop per byte, and for the latter only where, besides, the blocks fill
    PDL_CK_MIN_FILL of the SMs or a block's K range is at most PDL_CK_MAX_K (off if ``blocks`` or
    ``sms`` is not given).  Measured (docs/gemm.md entries 20, 35, 45, 62): PDL saves 0.6-1.6 us on
    small calls of any intensity (the launch latency it hides), 1-2 us per call on
    the short compute-bound calls (square1024 0.80 -> 0.91x cuBLAS, dsv3.kv_a M=512 0.87 -> 0.92), up
    to 1 us on the M = 128 projections (HBM-bound B streams, intensity ~120) since the consumer loop of
    entry 33, and up to 3.4 us on cluster split-K grids that fill the SMs (dsv3.q_a M=512); cluster
    split-K grids that leave SMs idle lose 2-6 us with it over long K ranges (llama qkv M=128 on config
    9, 512x1024x8192 on config 36)."""
    ck = cfg is not None and cfg.cluster_k > 1
    if (groups > 1 or ck) and 2.0 * M * N * K < PDL_MIN_INTENSITY * 2.0 * (M * K + groups * N * K + M * N):
        return False
    if ck:
        if not blocks or not sms:
            return False
        k_range = -(-K // (64 * cfg.cluster_k)) * 64
        return blocks >= PDL_CK_MIN_FILL * sms or k_range <= PDL_CK_MAX_K
    return True


def _pdl(auto: bool) -> bool:
    """Whether a plan launches its GEMM as a programmatic dependent (``MKERNEL_GEMM_PDL``: ``1``
    always, ``0`` never, unset / ``auto``: ``auto``, its pdl_auto; decided when the plan is built,
    the variable is part of the plan key): the GEMM may start launching while the previous kernel in
    its stream (e.g. the previous GEMM, which lets dependents launch once it has issued its last
    loads) finishes; its blocks initialise their barriers, then wait for that kernel to complete
    (griddepcontrol.wait) before anything else.  Kernels after a GEMM that are not launched this way
    wait for it to complete as usual."""
    env = os.environ.get("MKERNEL_GEMM_PDL", "auto")
    if env in ("0", "1"):
        return env == "1"
    return auto


def _clear_i32(ptr: int, n: int, stream) -> None:
    check(cu.cuMemsetD32Async(ptr, 0, n, cu.CUstream(stream_handle(stream))))


class ClearBeforeFirstUse:
    """A buffer of ``n`` 32-bit words at ``ptr`` that must be zero before a kernel first uses it (split-K
    sums and counters: the kernels leave them zero after every call).  Calling it clears it on the
    stream (ordered, no host sync) until a call outside a CUDA-graph capture has done so -- a captured
    clear only happens when the graph is launched."""

    def __init__(self, ptr: int, n: int):
        self.ptr, self.n, self.pending = ptr, n, True

    def __call__(self, stream, capturing: bool | None = None) -> None:
        if self.pending:
            _clear_i32(self.ptr, self.n, stream)
            self.pending = is_capturing(stream) if capturing is None else capturing



def _cached_plan(key, build):
    with _plans_lock:
        p = _plans.get(key)
        if p is not None:
            _plans.move_to_end(key)
            return p
    p = build()
    with _plans_lock:
        _plans[key] = p
        while len(_plans) > _PLANS_MAX:
            _plans.popitem(last=False)
    return p


def _akey(x: DeviceArray):
    return (x.ptr, tuple(x.shape), tuple(x.strides), x.dtype.name)


def b_operand(B: DeviceArray, K: int, N: int, b_layout: str, cfg: TileConfig, in_dtype: str, out_dtype: str,
              device: int):
    """B (``[K, N]`` / ``[N, K]``, or ``[G, ...]`` for grouped problems) as every GEMM kernel reads it:
    ``(tensor map, staging launches, buffers to keep)`` (staged when TMA cannot read it in place)."""
    sb = tuple(B.strides) if B.ndim == 3 else (0,) + tuple(B.strides)
    G = B.shape[0] if B.ndim == 3 else 1
    if b_layout == "kn":  # [G, K, N]: N contiguous, 64 x 64 boxes
        op = _tma_operand(B, G, K, N, *sb)
        box = (64, 64, 1)
    else:  # [G, N, K]: K contiguous, 64 x BN boxes
        op = _tma_operand(B, G, N, K, *sb)
        box = (64, cfg.b_box_rows, 1)
    tmb = encode_tiled(op.ptr, in_dtype, op.dims, op.strides, box)
    return tmb, *_staging(op, in_dtype, out_dtype, device)


def _a_operand(A: DeviceArray, rows: int, K: int, cfg: TileConfig, in_dtype: str, out_dtype: str, device: int):
    """A ``[rows, K]``: ``(tensor map, staging launches, buffers to keep)``."""
    sa = A.strides
    op = _tma_operand(A, 1, rows, K, 0, sa[0], sa[1])
    # with clusters along N each block loads (and multicasts) one 64-row slab of the A tile
    tma = encode_tiled(op.ptr, in_dtype, op.dims[:2], op.strides[:1], (64, cfg.bm // cfg.cluster_n))
    return tma, *_staging(op, in_dtype, out_dtype, device)


def _staging(op: _Operand, in_dtype: str, out_dtype: str, device: int):
    if op.copy is None:
        return [], []
    return [_pad_launch(op, in_dtype, out_dtype, device)], [op.staging]


# --------------------------------------------------------------------------------------------
# public ops
# --------------------------------------------------------------------------------------------
def gemm(a, b, out=None, *, b_layout: str = "kn", out_dtype: str | None = None, stream=None,
         config: int | None = None, splits: int | None = None, swap: bool | None = None):
    """``out[M, N] = a[M, K] @ b`` (``b`` is ``[K, N]`` for ``b_layout="kn"``, ``[N, K]`` for "nk").

    a, b: bf16 or fp16 (same dtype), 2-D, on the current device, any strides (staged if TMA cannot
    read them in place, see module doc).  out: ``[M, N]`` bf16/fp16/fp32 with unit column stride, or
    None to allocate one of ``out_dtype`` (default a's dtype).  stream: any stream-like object (None:
    the legacy default stream).  config: force a tile config id (``CONFIGS``; debugging and
    benchmarks).  splits: force the split-K factor (1 = none; clamped to what the config allows,
    ``max_splits``); by default the heuristic splits K when the output tiles cannot fill the SMs (the
    splits of a tile add into one fp32 sum, the last to finish stores it, in the same kernel).  swap:
    force (True) or forbid (False) computing B "nk" calls transposed, ``C^T = B A^T`` (the kernel's tiles
    run along B's rows, A's few rows as their columns; stored transposed); None: the heuristic.  Returns
    ``out``.  Asynchronous with respect to the host.
    """
    A, B, M, K, N, _ = check_operands(a, b, b_layout, what="mkernel.gemm", stream=stream)
    in_dtype = A.dtype.name
    O_in = None if out is None else as_device_array(out, name="gemm: out", stream=stream)
    if config is not None and config not in CONFIGS:
        raise ValueError(f"mkernel.gemm: unknown config {config}; known: {sorted(CONFIGS)}")
    if swap and b_layout != "nk":
        raise ValueError('mkernel.gemm: swap=True needs b_layout="nk" (B [N, K] as the transposed '
                         "problem's K-major A operand)")
    if swap and config is not None and CONFIGS[config].pingpong:
        raise ValueError(f"mkernel.gemm: config {config} (ping-pong) has no swapped kernel")
    dev = _check_device([A, B] + ([O_in] if O_in is not None else []), ["a", "b", "out"])
    with _on_device(dev):
        O = _prepare_out(O_in, out_dtype, in_dtype, (M, N), dev)
        if M == 0 or N == 0:
            return out if out is not None else O
        # One plan per (operands, output layout, stream), its launch re-pointed at each call's output:
        # a fresh output every call (out=None) or a rotating set of buffers must not cost a new plan
        # (tensor maps, split-K workspace, LRU eviction freeing memory) per call.  Per stream: a plan's
        # workspace is never used by two calls that may run concurrently.
        okey = out_layout_key(O) if K > 0 else _akey(O)  # K = 0: the plan is a fill of O itself
        key = ("gemm", dev, b_layout, config, splits, swap, _env_key(), _akey(A), _akey(B), okey,
               stream_handle(stream))
        plan = _cached_plan(key, lambda: _plan_gemm(A, B, O, M, N, K, in_dtype, b_layout, dev, config, splits,
                                                          swap))
        plan.run(stream, out=O)
    return out if out is not None else O


def out_layout_key(O: DeviceArray) -> tuple:
    """What a GEMM plan depends on of its output besides the address: shape, strides, dtype, and
    whether the address allows 16-byte vectors / a TMA map (a plan re-pointed at another output of
    the same key launches the same code)."""
    return (tuple(O.shape), tuple(O.strides), O.dtype.name, O.ptr % 16 == 0)


def _plan_gemm(A, B, O, M, N, K, in_dtype, b_layout, dev, config, splits=None, swap=None) -> _Plan:
    out_dtype = O.dtype.name
    ldc = O.strides[0] if M > 1 else N
    sms = _num_sms(dev)
    if K == 0:
        pre = [_zero_fill_launch(O, M, N, ldc, in_dtype, dev)]
        return _Plan(CONFIGS[1], None, 0, [], pre, [])
    from . import gemv  # (imports this module's dtype tables: not at the top)
    mis = (row_misaligned(A, M, K), row_misaligned(B, *((K, N) if b_layout == "kn" else (N, K))))
    gemv_ok = gemv.supported(A, B, M, N, K, b_layout) and gemv.worthwhile(N, sms)
    choice = _orient_and_plan(M, N, K, b_layout, sms, config, splits, swap, mis, gemv_ok)
    if choice is None:  # decode-shaped (M <= 16): a stream of B (mkernel/gemv.py)
        return gemv.plan(A, B, O, M, N, K)
    swap, cfg, sp, split_from = choice
    # the kernel's problem: M x N x K of A [M, K] and B, or swapped N x M x K of B [N, K] and A ("nk")
    KA, KB, KM, KN = (B, A, N, M) if swap else (A, B, M, N)
    tma, pre, keep = _a_operand(KA, KM, K, cfg, in_dtype, out_dtype, dev)
    tmb, pre_b, keep_b = b_operand(KB, K, KN, b_layout, cfg, in_dtype, out_dtype, dev)
    pre, keep = pre + pre_b, keep + keep_b
    if swap:  # stored transposed from registers (no C map: any valid map goes in its place)
        tmc, c_tma, vec = tma, 0, 0
    else:
        tmc, c_tma = c_map(O, M, N, ldc, cfg, tma)
        vec = _vec_ok(O, ldc, M)
    args = _GemmArgs(O.ptr, None, ldc, KM, KN, K, 1, GROUP_M, vec, 0, c_tma)
    tiles = _tiles(cfg, KM, KN, b_layout)
    if sp > 1:  # split-K workspace: fp32 running sums and counters per split tile (zero; the kernel keeps them so)
        n_split = tiles - split_from
        ws, partials, counters = split_workspace(n_split, cfg.bm * cfg.tile_n(b_layout), dev)
        keep += [ws]
        args.partials, args.counters, args.splits, args.split_from = partials, counters, sp, split_from
    else:
        args.splits, args.split_from, split_from = 1, tiles, tiles
    maps = [tma, tmb, tmc]
    kernel = _kernel(in_dtype, out_dtype, cfg.id, f"mk_gemm_{b_layout}", swap)
    grid = _grid(cfg, _units(tiles, sp, split_from), sms)
    if cfg.cluster > 1:  # no more clusters than fit at once (a GPC's SMs may not all group up)
        fit = kernel.max_active_clusters(grid, cfg.threads, cfg.smem, cfg.cluster)
        grid = max(cfg.cluster, min(grid, fit * cfg.cluster))
    # (swapped plans in clusters without PDL: 9008x248x5752 on config 48 63.6 us with, 57.0 without)
    dependent = _pdl(pdl_auto(KM, KN, K, cfg=cfg, blocks=grid, sms=sms) and not (swap and cfg.cluster > 1))
    plan = _Plan(cfg, kernel, grid, [*maps, args], pre, keep, sp, split_from, dependent=dependent, swapped=swap)
    if sp > 1:
        plan.zero = ClearBeforeFirstUse(ws.ptr, ws.size)

    o_ptr = O.ptr  # not O: a cached plan must not keep the caller's output alive

    def with_out(O2: DeviceArray) -> list:
        """The launch arguments for output O2 (same shape, dtype and strides as O; any base address)."""
        if O2.ptr == o_ptr:
            return plan.args
        a2 = _GemmArgs.from_buffer_copy(args)
        if swap:
            a2.c = O2.ptr
            return [tma, tmb, tmc, a2]
        return [tma, tmb, point_out(a2, O2, M, N, ldc, cfg, tma), a2]
    plan.with_out = with_out
    return plan


def point_out(args, O: DeviceArray, M: int, N: int, ldc: int, cfg: TileConfig, tma_a) -> object:
    """Point a launch-argument struct's output fields (``c``, ``c_vec_ok``, ``c_tma``: the plain GEMM's
    and the fused kernels' alike) at ``O`` (in place); returns O's C tensor map."""
    args.c, args.c_vec_ok = O.ptr, _vec_ok(O, ldc, M)
    tmc, args.c_tma = c_map(O, M, N, ldc, cfg, tma_a)
    return tmc


def _units(tiles: int, splits: int, split_from: int) -> int:
    """Scheduler units of a split plan: the whole tiles before split_from, then ``splits`` per tile."""
    return split_from + (tiles - split_from) * splits if splits > 1 else tiles


def split_workspace(n_split: int, tile_elems: int, device: int):
    """(buffer, sums ptr, counters ptr) of split-K over ``n_split`` tiles of ``tile_elems`` outputs: fp32
    running sums then int32 counters, in one buffer so one memset of ``buffer.size`` 32-bit words
    clears both (before the first call; the kernels leave them zero)."""
    ws = DeviceArray.empty((n_split * tile_elems + n_split,), "int32", device=device)
    return ws, ws.ptr, ws.ptr + 4 * n_split * tile_elems


def _env_key():
    return (os.environ.get("MKERNEL_GEMM_CONFIG"), os.environ.get("MKERNEL_GEMM_CANDIDATES"),
            os.environ.get("MKERNEL_GEMM_EPILOGUE"), os.environ.get("MKERNEL_GEMM_PDL"),
            os.environ.get("MKERNEL_GEMM_GEMV"), os.environ.get("MKERNEL_GEMM_SWAP"))


def c_map(O: DeviceArray, M: int, N: int, ldc: int, cfg: TileConfig, fallback: bytes):
    """The C tensor map every GEMM kernel takes, and c_tma (1: the epilogue stores through it).

    A config with TMA-store staging uses it when C's base and row stride are 16-byte multiples
    (``MKERNEL_GEMM_EPILOGUE=registers`` turns it off: benchmarks compare both epilogues); otherwise
    the kernel gets ``fallback`` (any valid map) and stores from registers."""
    isz = O.dtype.itemsize
    # A TMA store writes whole 16-byte pieces of a row: the map ends at N rounded down to 16 bytes
    # (n16) and the epilogue stores the columns past it from registers (MkEpilogueTmaStore), so a
    # padded output row is never written past N.
    n16 = N - N % (16 // isz)
    ok = (cfg.tma_store and O.ptr % 16 == 0 and (ldc * isz) % 16 == 0 and n16 > 0
          and os.environ.get("MKERNEL_GEMM_EPILOGUE", "tma") != "registers")
    if not ok:
        return fallback, 0
    return encode_tiled(O.ptr, O.dtype.name, (n16, M), (ldc * isz,), (128 // isz, 64)), 1


def _auto_config(M: int, N: int, K: int, b_layout: str, sms: int) -> TileConfig:
    return _auto_plan(M, N, K, b_layout, sms)[0]


def _tiles(cfg: TileConfig, M: int, N: int, b_layout: str) -> int:
    """Output tiles (with clusters along N or M: that dimension's tiles rounded up to whole clusters,
    the scheduler's units and split-K slots)."""
    num_n = math.ceil(N / cfg.tile_n(b_layout))
    num_m = math.ceil(M / cfg.bm)
    return (-(-num_m // cfg.cluster_m) * cfg.cluster_m) * (-(-num_n // cfg.cluster_n) * cfg.cluster_n)


def max_splits(cfg: TileConfig, M: int, N: int, K: int, b_layout: str, split_tiles: int | None = None) -> int:
    """The most K splits a plain GEMM may use with ``cfg`` for ``split_tiles`` split tiles (default:
    every tile); 1: none (ping-pong and debug configs never split)."""
    tiles = _tiles(cfg, M, N, b_layout) if split_tiles is None else split_tiles
    return _max_splits(cfg, tiles, K, b_layout)


def _max_splits(cfg: TileConfig, split_tiles: int, K: int, b_layout: str) -> int:
    if (cfg.pingpong or cfg.debug or cfg.cluster_k > 1
            or split_tiles * cfg.bm * cfg.tile_n(b_layout) * 4 > MAX_PARTIAL_BYTES):
        return 1
    return max(1, min(MAX_SPLITS, math.ceil(K / 64) // MIN_SPLIT_KBLOCKS))


def choose_splits(cfg: TileConfig, M: int, N: int, K: int, b_layout: str, sms: int) -> tuple[int, int]:
    """``(splits, split_from)`` of least predicted time for ``cfg`` (config_cost): fewer tiles than SMs
    -> every tile split (``split_from = 0``); otherwise whole waves of whole tiles and, when the last
    wave is partial, its ``r`` tiles split up to ``sms // r`` ways (``split_from = tiles - r``), so it
    takes a fraction of a tile's time instead of a whole one.  ``(1, tiles)``: no split."""
    return split_plan(cfg, _tiles(cfg, M, N, b_layout), K, b_layout, sms)


def split_plan(cfg: TileConfig, tiles: int, K: int, b_layout: str, workers: int,
               tail_margin: float = 0.0) -> tuple[int, int]:
    """choose_splits for ``tiles`` tiles on ``workers`` blocks (fused kernels pass their own tile
    count and worker count).  A last-wave split must save ``tail_margin`` of the unsplit cost."""
    best, best_cost = (1, tiles), config_cost(cfg, tiles, workers, K, b_layout)
    if tiles < workers:
        for sp in range(2, _max_splits(cfg, tiles, K, b_layout) + 1):
            c = config_cost(cfg, tiles, workers, K, b_layout, sp)
            if c < best_cost:
                best, best_cost = (sp, 0), c
        return best
    q, r = divmod(tiles, workers)
    if r == 0 or cfg.pairs > 1:  # (clusters: the pair scheduler's split_from would count pairs)
        return best
    whole = q * config_cost(cfg, workers, workers, K, b_layout)
    unsplit = best_cost
    for sp in range(2, min(_max_splits(cfg, r, K, b_layout), workers // r) + 1):
        c = whole + config_cost(cfg, r, workers, K, b_layout, sp)
        if c < best_cost and c < (1 - tail_margin) * unsplit:
            best, best_cost = (sp, tiles - r), c
    return best


def split_cost(cfg: TileConfig, tiles: int, K: int, b_layout: str, workers: int, splits: int, split_from: int) -> float:
    """config_cost of a split plan (``splits`` = 1: the unsplit cost)."""
    if splits <= 1:
        return config_cost(cfg, tiles, workers, K, b_layout)
    if split_from == 0:
        return config_cost(cfg, tiles, workers, K, b_layout, splits)
    return (split_from // workers) * config_cost(cfg, workers, workers, K, b_layout) + config_cost(
        cfg, tiles - split_from, workers, K, b_layout, splits)


def _pick_plan(plans: list) -> tuple:
    """The least-cost (cost, config, splits, split_from); a last-wave split must beat every other plan by
    TAIL_SPLIT_MIN_GAIN."""
    best = min(plans, key=lambda p: p[0])
    if best[2] > 1 and best[3] > 0:
        rest = [p for p in plans if not (p[2] > 1 and p[3] > 0)]
        if rest and best[0] > (1 - TAIL_SPLIT_MIN_GAIN) * min(p[0] for p in rest):
            best = min(rest, key=lambda p: p[0])
    return best


def phantom_row_half(cfg: TileConfig, M: int) -> bool:
    """Whether M's row tiles leave a pair along M with a half below M (one SM idle): the heuristic never
    offers such a plan (a forced config still runs it)."""
    return math.ceil(M / cfg.bm) % cfg.cluster_m != 0


def load_bound(cfg: TileConfig, misaligned: tuple[bool, bool], b_layout: str = "nk") -> TileConfig:
    """``cfg`` with its efficiencies capped by what its load stream allows when A's and / or B's rows
    (``misaligned``) are an odd multiple of 16 bytes apart (MISALIGNED_ROW_COST, LOAD_AREA_PER_ROW);
    ``cfg`` itself when neither is."""
    if not any(misaligned):
        return cfg
    bn = cfg.tile_n(b_layout)
    rows_a = cfg.bm // cfg.cluster_n  # rows each block loads per K block (clusters multicast the rest)
    rows_b = bn // cfg.cluster_m
    rows = sum(r * (MISALIGNED_ROW_COST if m else 1.0) for r, m in zip((rows_a, rows_b), misaligned))
    cap = cfg.bm * bn / (rows * LOAD_AREA_PER_ROW)
    small = None if cfg.efficiency_small_m is None else min(cfg.efficiency_small_m, cap)
    return replace(cfg, efficiency=min(cfg.efficiency, cap), efficiency_small_m=small)


def _auto_plan(M: int, N: int, K: int, b_layout: str, sms: int, config: int | None = None,
               misaligned: tuple[bool, bool] = (False, False), candidates=AUTO_CANDIDATES, with_cost: bool = False):
    """(config, splits, split_from) for a plain GEMM: the heuristic's config and split-K plan (a
    forced config still gets its best split plan).  ``misaligned``: whether A's / B's rows are an odd
    multiple of 16 bytes apart (load_bound).  ``with_cost``: the pick's predicted cost as a fourth value
    (not with a forced config)."""
    if config is not None:
        cfg = CONFIGS[config]
        return (cfg, *choose_splits(cfg, M, N, K, b_layout, workers(cfg, sms)))
    cands = _env_candidates(candidates)
    env = os.environ.get("MKERNEL_GEMM_CONFIG")
    if env and (int(env) == 0 or int(env) in cands):
        cfg = CONFIGS[int(env)]
        return (cfg, *choose_splits(cfg, M, N, K, b_layout, workers(cfg, sms)))
    plans = []  # (cost, config, splits, split_from)
    for cid in cands:
        cfg = load_bound(CONFIGS[cid], misaligned, b_layout)
        if cfg.debug or (b_layout == "kn" and cfg.bn_kn is not None):
            continue
        if phantom_row_half(cfg, M):
            continue
        tiles = max(1, _tiles(cfg, M, N, b_layout))
        # one band of rows streaming B, or (up to full_wave_max_m) one whole wave of tiles: the small-M
        # efficiency (a uniform factor: splits unchanged)
        if cfg.efficiency_small_m is not None and (
                M <= SMALL_M or (M <= cfg.full_wave_max_m and FULL_WAVE_FILL * sms <= tiles <= sms)):
            cfg = replace(cfg, efficiency=cfg.efficiency_small_m)
        w = workers(cfg, sms)
        if cfg.cluster_k > 1 and tiles * cfg.cluster_k > w:  # measured: loses beyond one wave
            continue
        sp, sf = choose_splits(cfg, M, N, K, b_layout, w)
        plans.append((split_cost(cfg, tiles, K, b_layout, w, sp, sf), cid, sp, sf))
        if sp > 1 and sf > 0:  # last-wave split: also keep this config's unsplit plan as a candidate
            plans.append((config_cost(cfg, tiles, w, K, b_layout), cid, 1, tiles))
    best = _pick_plan(plans)
    # Cluster split-K (configs 9, 36) replaces a split plan, never an unsplit one: where whole tiles
    # already fill the SMs, halving K per block only adds the exchange and the register epilogue
    # (measured: square512 / 768, 512x1536x2048 on config 36; docs/gemm.md entry 40).
    if CONFIGS[best[1]].cluster_k > 1:
        rest = [p for p in plans if CONFIGS[p[1]].cluster_k == 1]
        alt = _pick_plan(rest) if rest else None
        if alt is not None and alt[2] == 1:
            best = alt
    if with_cost:
        return CONFIGS[best[1]], best[2], best[3], best[0]
    return CONFIGS[best[1]], best[2], best[3]


def _orient_and_plan(M: int, N: int, K: int, b_layout: str, sms: int, config, splits, swap, misaligned,
                     gemv_ok: bool):
    """``(swap, config, splits, split_from)`` of a plain GEMM's plan, or None where mkernel/gemv.py takes the
    call (``gemv_ok``).  Unless a config, a split factor or ``swap`` is forced, swap_candidates decides the
    orientation; a transposed plan is the N x M x K problem's (``misaligned`` exchanged too), a decode one's
    split as _decode_swap_splits says.  ``splits``: forced on every tile."""
    cands = SWAP_CANDIDATES  # (swap forced)
    if config is None and splits is None and swap is None:
        cands = swap_candidates(M, N, K, b_layout, sms, misaligned, gemv_ok)
        if cands is None and gemv_ok:
            return None
        swap = cands is not None
    swap = bool(swap)
    if swap:
        M, N, misaligned = N, M, misaligned[::-1]
    cfg, sp, sf = _auto_plan(M, N, K, b_layout, sms, config, misaligned, cands if swap else AUTO_CANDIDATES)
    if swap:
        sp, sf = _decode_swap_splits(cfg, M, N, b_layout, sms, sp, sf)
    if splits is not None:  # forced: every tile split
        sp, sf = max(1, min(int(splits), max_splits(cfg, M, N, K, b_layout))), 0
    return swap, cfg, sp, sf


def _decode_swap_splits(cfg: TileConfig, M: int, N: int, b_layout: str, sms: int, sp: int, sf: int):
    """A transposed decode plan's (configs 53 / 54) split: none where its tiles make one whole wave -- B's
    rows stream once either way, splits only cut the stream (16x7168x16384: 59.5 us unsplit, 67.1 in 7
    splits); other plans keep (sp, sf)."""
    if cfg.id in DECODE_SWAP_CONFIGS and SWAP_FILL * sms <= _tiles(cfg, M, N, b_layout) <= sms:
        return 1, 0
    return sp, sf


def swap_candidates(M: int, N: int, K: int, b_layout: str, sms: int, misaligned=(False, False),
                    gemv_ok: bool = False):
    """The configs a transposed plan (C^T = B A^T, computed as the N x M x K problem) of an M x N x K call
    chooses among, or None for a plain plan (docs/gemm.md entry 66; ``MKERNEL_GEMM_SWAP=0`` or a config
    forced by ``MKERNEL_GEMM_CONFIG``: never).
    ``misaligned``: A's / B's rows (load_bound); ``gemv_ok``: mkernel/gemv.py would take the call.

    Decode-shaped calls (B "nk", M <= SWAP_MAX_M): config 53 (M <= 16) / 54, but for the calls the decode
    kernel takes (``gemv_ok``) whose ceil(N / 64) tiles would not fill SWAP_FILL of the SMs.  Tall-skinny
    calls (B "nk", N <= SWAP_MAX_N, K >= SWAP_MIN_K, M >= 8 N, N filling SWAP_MIN_FILL of its 128-row
    tiles): TALL_SWAP_CONFIGS where the cost model puts the transposed plan at most SWAP_GAIN of the plain
    one."""
    if b_layout != "nk" or os.environ.get("MKERNEL_GEMM_SWAP") == "0" or os.environ.get("MKERNEL_GEMM_CONFIG"):
        return None
    if M <= SWAP_MAX_M:
        if gemv_ok and -(-N // 64) < SWAP_FILL * sms:
            return None
        return (53,) if M <= 16 else (54,)
    if N <= SWAP_MAX_N and K >= SWAP_MIN_K and M >= 8 * N and N >= SWAP_MIN_FILL * 128 * -(-N // 128):
        plain = _auto_plan(M, N, K, b_layout, sms, None, misaligned, with_cost=True)[3]
        cands = TALL_SWAP_CONFIGS
        swapped = _auto_plan(N, M, K, b_layout, sms, None, misaligned[::-1], cands, with_cost=True)[3]
        if swapped <= SWAP_GAIN * plain:
            return cands
    return None


def _vec_ok(O: DeviceArray, ldc: int, M: int) -> int:
    return int(O.ptr % (2 * O.dtype.itemsize) == 0 and (ldc % 2 == 0 or M == 1))


def _is_host_sequence(x) -> bool:
    return isinstance(x, (list, tuple, np.ndarray))


def grouped_gemm(a, b, group_offsets, out=None, *, b_layout: str = "kn", out_dtype: str | None = None,
                 stream=None, config: int | None = None):
    """Grouped GEMM: ``out[o[g]:o[g+1]] = a[o[g]:o[g+1]] @ b[g]`` for g in range(G).

    a: ``[T, K]`` (T = total rows, e.g. tokens sorted by expert).  b: ``[G, K, N]`` ("kn") or
    ``[G, N, K]`` ("nk").  group_offsets o: G+1 nondecreasing row offsets with 0 <= o[0] and
    o[G] <= T; a host sequence (validated, uploaded once per distinct value) or a device array of
    int64/int32 (trusted, never read on the host: no synchronization).  Groups may be empty; rows of
    out outside [o[0], o[G]) are not written.  out: ``[T, N]`` or None (allocated, dtype ``out_dtype``
    or a's).  Returns out.
    """
    A, B, T, K, N, G = check_operands(a, b, b_layout, what="mkernel.grouped_gemm", grouped=True, stream=stream)
    in_dtype = A.dtype.name
    O_in = None if out is None else as_device_array(out, name="grouped_gemm: out", stream=stream)
    dev = _check_device([A, B] + ([O_in] if O_in is not None else []), ["a", "b", "out"])
    host_offs = None
    dev_offs = None
    if _is_host_sequence(group_offsets):
        host_offs = np.asarray(group_offsets, dtype=np.int64).reshape(-1)
        if host_offs.shape[0] != G + 1:
            raise ValueError(f"mkernel.grouped_gemm: group_offsets has {host_offs.shape[0]} entries; b has G={G} "
                             f"groups, so G+1={G + 1} are needed")
        if G and (host_offs[0] < 0 or host_offs[-1] > T or np.any(np.diff(host_offs) < 0)):
            raise ValueError(f"mkernel.grouped_gemm: group_offsets must be nondecreasing within [0, {T}]")
        offs_key = ("host", host_offs.tobytes())
    else:
        D = dev_offs = as_device_array(group_offsets, name="grouped_gemm: group_offsets", stream=stream)
        if D.dtype.name not in ("int64", "int32"):
            raise TypeError(f"mkernel.grouped_gemm: device group_offsets must be int64 or int32, got {D.dtype.name}")
        if tuple(D.shape) != (G + 1,) or (G + 1 > 1 and D.strides[0] != 1):
            raise ValueError(f"mkernel.grouped_gemm: device group_offsets must be a contiguous [{G + 1}] array")
        _check_device([A, D], ["a", "group_offsets"])
        offs_key = ("dev", D.ptr, D.dtype.name)
    if config is not None and config not in CONFIGS:
        raise ValueError(f"mkernel.grouped_gemm: unknown config {config}; known: {sorted(CONFIGS)}")
    if config is not None and CONFIGS[config].cluster > 1:
        raise ValueError(f"mkernel.grouped_gemm: config {config} runs in clusters of blocks; grouped problems "
                         "do not (choose another config)")
    with _on_device(dev):
        O = _prepare_out(O_in, out_dtype, in_dtype, (T, N), dev)
        if T == 0 or N == 0 or G == 0:
            return out if out is not None else O
        key = ("grouped", dev, b_layout, config, _env_key(), _akey(A), _akey(B), _akey(O), offs_key)
        plan = _cached_plan(key, lambda: _plan_grouped(A, B, O, T, N, K, G, host_offs, dev_offs, in_dtype,
                                                       b_layout, dev, config))
        plan.run(stream)
    return out if out is not None else O


def _plan_grouped(A, B, O, T, N, K, G, host_offs, dev_offs, in_dtype, b_layout, dev, config) -> _Plan:
    out_dtype = O.dtype.name
    ldc = O.strides[0] if T > 1 else N
    sms = _num_sms(dev)
    keep = []
    if host_offs is not None:
        sizes = np.diff(host_offs)

        def num_tiles(c):
            return int(np.sum((sizes + c.bm - 1) // c.bm)) * math.ceil(N / c.tile_n(b_layout))

        offs_buf = DeviceArray.from_numpy(host_offs.astype(np.int64))
        keep.append(offs_buf)
        offs_ptr, offs_i32 = offs_buf.ptr, 0
    else:
        def num_tiles(c):  # upper bound without reading the offsets
            return (math.ceil(T / c.bm) + G) * math.ceil(N / c.tile_n(b_layout))

        offs_ptr, offs_i32 = dev_offs.ptr, int(dev_offs.dtype.name == "int32")
    if K == 0:
        # rows [o[0], o[G]) must become zero; without host offsets we zero every row (documented).
        if host_offs is not None:
            r0, r1 = int(host_offs[0]), int(host_offs[-1])
        else:
            r0, r1 = 0, T
        pre = []
        if r1 > r0:
            sub = _Sub(O.ptr + r0 * ldc * O.dtype.itemsize, O.dtype)
            pre = [_zero_fill_launch(sub, r1 - r0, N, ldc, in_dtype, dev)]
        return _Plan(CONFIGS[1], None, 0, [], pre, keep)
    cfg = CONFIGS[config] if config is not None else choose_config(
        num_tiles, sms, k=K, layout=b_layout, candidates=GROUPED_CANDIDATES)
    tma, pre, keep_a = _a_operand(A, T, K, cfg, in_dtype, out_dtype, dev)
    tmb, pre_b, keep_b = b_operand(B, K, N, b_layout, cfg, in_dtype, out_dtype, dev)
    pre, keep = pre + pre_b, keep + keep_a + keep_b
    tmc, c_tma = c_map(O, T, N, ldc, cfg, tma)
    args = _GemmArgs(O.ptr, offs_ptr, ldc, T, N, K, G, GROUP_M, _vec_ok(O, ldc, T), offs_i32, c_tma, None, None, 1, 0)
    maps = [tma, tmb, tmc]
    grid = _grid(cfg, num_tiles(cfg), sms)
    kernel = _kernel(in_dtype, out_dtype, cfg.id, f"mk_grouped_gemm_{b_layout}")
    return _Plan(cfg, kernel, grid, [*maps, args], pre, keep, dependent=_pdl(pdl_auto(T, N, K, G, cfg)))


@dataclass
class _Sub:
    """A bare (ptr, dtype) view for the zero-fill launch."""

    ptr: int
    dtype: object


def describe(M: int, N: int, K: int, *, in_dtype: str = "bfloat16", out_dtype: str | None = None,
             b_layout: str = "kn", config: int | None = None, device: int | None = None) -> dict:
    """What ``gemm`` would launch for this shape (dense operands): config, tile, split-K factor, grid, threads, shared
    memory, registers per thread (ptxas; from the driver where NVRTC returned no ptxas report, as the
    NVRTC 13.0 of the H200 image does), spilled bytes (None without that report), the NVRTC compile
    time of the module (0 if it came from cache) and whether it is computed transposed (``swapped``: the
    tile, tiles and grid are then the N x M x K problem's)."""
    out_dtype = out_dtype or in_dtype
    with _on_device(device) as (_, dev):
        sms = _num_sms(dev)
        from . import gemv
        gemv_ok = gemv.shape_ok(M, N, K, b_layout) and gemv.worthwhile(N, sms)
        choice = _orient_and_plan(M, N, K, b_layout, sms, config, None, None, misaligned_rows(M, N, K, b_layout),
                                  gemv_ok)
        if choice is None:
            return gemv.describe(M, N, K, in_dtype, out_dtype)  # (aligned, contiguous operands assumed)
        swapped, cfg, sp, sf = choice
        if swapped:
            M, N = N, M
        mod = compile_module(SOURCE, _defines(in_dtype, out_dtype, cfg.id, swapped))
        usage = _usage(mod, f"mk_gemm_{b_layout}")
    tiles = _tiles(cfg, M, N, b_layout)
    return dict(config=cfg.id, swapped=swapped, bm=cfg.bm, bn=cfg.tile_n(b_layout), stages=cfg.stages, threads=cfg.threads,
                smem=cfg.smem, pingpong=cfg.pingpong, tma_store=cfg.tma_store, splits=sp,
                split_tiles=(tiles - sf) if sp > 1 else 0,
                registers=usage.get("registers"),
                spills=usage["spill_stores"] + usage["spill_loads"] if "spill_stores" in usage else None,
                compile_seconds=mod.compile_seconds, cached=mod.cached, tiles=tiles,
                grid=_grid(cfg, _units(tiles, sp, sf), sms))


def _usage(mod, name: str) -> dict:
    """ptxas's resource report of kernel ``name`` of ``mod``; registers from the driver where NVRTC
    returned no report."""
    usage = dict(mod.resource_usage.get(name, {}))
    if "registers" not in usage:
        usage["registers"] = mod.function(name).attribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS)
    return usage


def precompile(specs=None, *, arch: str | None = None, workers: int | None = None) -> float:
    """Compile GEMM specializations into the disk cache in parallel worker processes.

    specs: iterable of define dicts (default: every registered gemm.cu specialization).  Returns the
    summed NVRTC seconds.  Later ``compile_module`` calls of this process load the cubins from disk.
    """
    return precompile_source(SOURCE, specs, arch=arch, workers=workers)
