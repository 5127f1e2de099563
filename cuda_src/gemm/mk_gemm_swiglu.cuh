// mk_gemm_swiglu.cuh - SwiGLU in the GEMM epilogue (docs/moe.md, "SwiGLU epilogue").
//
// act[r, f] = silu(h[r, f]) * h[r, F + f] for h = A @ W^T, W a gate/up weight [G, 2F, K] (B "nk": gate rows
// [0, F), up rows [F, 2F)), without writing h.  The kernel reads W through a paired view in which each
// consumer warpgroup's WN accumulator columns are PAIR = WN / 2 gate rows followed by the PAIR matching up
// rows; the epilogue turns every WN accumulator columns into PAIR act columns.  Users keep their layout.
//
// Why the thread holding gate column c also holds up column c + PAIR (the fragment of mk_wgmma.cuh):
// registers 4j .. 4j+3 of a thread are columns 8j + c0 and 8j + c0 + 1 of rows r0 and r0 + 8, so every
// thread holds the same two columns of each 8-column group.  With PAIR a multiple of 8, gate column
// 8j + c0 + i and up column 8(j + PAIR/8) + c0 + i are registers 4j + i' and 4(j + PAIR/8) + i' of one
// thread; the products act[4j + i'] (j < PAIR/8) are exactly the fragment of a PAIR-wide tile (pair j at
// column 8j + c0), which any store epilogue writes (MkEpilogueStore, MkEpilogueTmaStore).
//
// The view (host: mkernel/ops/gemm/swiglu.py): tmB is 5-D {K, PAIR, F / PAIR, 2, G} with byte strides
// {row, PAIR * row, F * row, expert} (increasing), box {64, PAIR, 1, 2, 1}: one load brings chunk n's PAIR
// gate rows then its PAIR up rows, 2 * PAIR consecutive 128-byte rows of shared memory (the K-major tile
// wgmma reads).  The scheduler's N is 2F: an N tile [col0, col0 + cols) is act columns [col0 / 2,
// (col0 + cols) / 2).  F must be a multiple of PAIR (else the host runs the separate SwiGLU kernel).
#pragma once
#include "gemm/mk_gemm.cuh"

// Config Base with B seen through the paired gate/up view (mk_gemm_load_b's B_GATE_UP branch).
template <class Base> struct MkGateUpB : Base {
  static constexpr bool B_GATE_UP = true;
  static constexpr int PAIR = Base::WN / 2;  // gate (and up) columns per warpgroup accumulator
  static_assert(!Base::B_KN && Base::CLUSTER_M == 1 && Base::CLUSTER_K == 1 && Base::WN % 16 == 0 && PAIR <= 256,
                "gate/up view: B \"nk\", whole B tiles per block, PAIR a multiple of 8 within a TMA box");
};

// silu(gate) * up (fp32, as mk_moe_swiglu) of a MkGateUpB tile, stored by Inner as a tile half as wide.
template <class Inner> struct MkEpilogueSwiGLU {
  Inner inner;
  static constexpr bool kTileDone = Inner::kTileDone;
  static constexpr bool kDrain = Inner::kDrain;
  MK_DEVICE void drain() const { inner.drain(); }
  // the act columns of N tile t
  static MK_DEVICE MkTile act_tile(const MkTile& t) {
    MkTile a = t;
    a.col0 = t.col0 / 2;
    a.cols = t.cols / 2;
    return a;
  }
  MK_DEVICE void tile_done(const MkTile& t) { inner.tile_done(act_tile(t)); }
  // (in place: act is the first P / 2 registers of acc, which the next tile's first K block overwrites)
  template <int BN> MK_DEVICE void store(const MkTile& t, int slab, float (&acc)[BN / 2]) {
    constexpr int P = BN / 2;  // BN: the accumulator's width (Cfg::WN); P: its gate columns
    static_assert(P % 8 == 0, "gate and up halves of whole 8-column fragment groups");
#pragma unroll
    for (int j = 0; j < P / 8; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float g = acc[4 * j + i], u = acc[4 * (j + P / 8) + i];
        acc[4 * j + i] = g / (1.f + __expf(-g)) * u;
      }
    }
    inner.template store<P>(act_tile(t), slab, reinterpret_cast<float(&)[P / 2]>(acc));
  }
};

template <class Inner> MK_DEVICE MkEpilogueSwiGLU<Inner> mk_swiglu_epilogue(const Inner& inner) {
  MkEpilogueSwiGLU<Inner> e;
  e.inner = inner;
  return e;
}
