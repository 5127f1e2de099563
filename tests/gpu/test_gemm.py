"""GPU tests of mkernel.gemm / grouped_gemm against a float64 numpy reference.

Inputs are fresh random data rounded to the input dtype (the reference uses those exact values);
outputs are NaN-poisoned first, so an unwritten element fails.  Error metric: relative Frobenius
error ||C - C_ref||_F / ||C_ref||_F < 1e-2 (bf16/fp16 output rounding alone is ~2e-3 / 3e-4).
Shapes cover M, N, K in {1, 7, 64, 129, 1000, 4097}, both B layouts, every dtype combination, every
tile config, strided/offset views, and large problems (checked on a random subset of rows/columns).
Skipped without a Hopper GPU.  The whole file takes well under a minute on an H200 once the kernels
are compiled; `precompile` compiles them in parallel processes first.
"""
from __future__ import annotations

import numpy as np
import pytest

from mkernel.ops import gemm as G
from mkernel.ops import base as BASE
from mkernel.ops.gemm import configs as GC, kernels as GK
from mkernel.core.arrays import DeviceArray

from _util import corner, download, poisoned, rel_fro, upload, written_outside

pytestmark = pytest.mark.gpu  # skipped by tests/conftest.py without a Hopper GPU

SEED = int(np.random.SeedSequence().entropy % (1 << 32))
TOL = 1e-2


@pytest.fixture(scope="module", autouse=True)
def compiled():
    G.precompile()  # every registered specialization, in parallel, into the disk cache
    yield


@pytest.fixture
def rng(request):
    seed = (SEED + sum(map(ord, request.node.name))) % (1 << 32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


# ---- helpers ---------------------------------------------------------------------------------
def rand(rng, shape, dtype):
    """(DeviceArray, float64 values) of N(0,1) data rounded to dtype."""
    return upload(rng.standard_normal(shape, dtype=np.float32), dtype)


def check(got, ref, what):
    e = rel_fro(got, ref)
    assert e < TOL, f"{what}: relative Frobenius error {e:.3e}"


def run_gemm(rng, M, N, K, layout, in_dt="bfloat16", out_dt="bfloat16", config=None, sample=None, splits=None,
             swap=None):
    a, av = rand(rng, (M, K), in_dt)
    b, bv = rand(rng, (K, N) if layout == "kn" else (N, K), in_dt)
    out = poisoned((M, N), out_dt)
    G.gemm(a, b, out, b_layout=layout, config=config, splits=splits, swap=swap)
    got = download(out)
    bmat = bv if layout == "kn" else bv.T
    if sample is None:
        ref = av @ bmat
        check(got, ref, f"gemm {M}x{N}x{K} {layout} {in_dt}->{out_dt} cfg={config}")
    else:
        assert not np.isnan(got).any(), "NaN in output (unwritten tile?)"
        rows = np.unique(np.r_[rng.choice(M, size=min(M, sample), replace=False), 0, M - 1])
        cols = np.unique(np.r_[rng.choice(N, size=min(N, sample), replace=False), 0, N - 1])
        ref = av[rows] @ bmat[:, cols]
        check(got[np.ix_(rows, cols)], ref, f"gemm {M}x{N}x{K} {layout} (sampled)")


# ---- shapes ----------------------------------------------------------------------------------
SHAPES = [  # (M, N, K)
    (1, 1, 1), (1, 7, 64), (7, 1, 129), (7, 7, 7), (64, 64, 64), (129, 129, 129), (64, 129, 7),
    (1000, 7, 1000), (7, 1000, 7), (129, 4097, 64), (4097, 129, 7), (1000, 1000, 1000), (64, 4097, 1000),
    (4097, 64, 129), (1, 4097, 4097), (4097, 1, 1000), (1000, 129, 4097), (129, 1000, 1), (4097, 7, 64),
    (257, 385, 520), (128, 256, 64), (256, 512, 4096),
]


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("M,N,K", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_shapes(rng, M, N, K, layout):
    run_gemm(rng, M, N, K, layout)


CONFIG_SHAPES = [(129, 1000, 257), (1000, 4097, 129), (64, 64, 1000), (300, 520, 4097)]


@pytest.mark.parametrize("config", sorted(G.CONFIGS))
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("M,N,K", CONFIG_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in CONFIG_SHAPES])
def test_every_config(rng, M, N, K, layout, config):
    run_gemm(rng, M, N, K, layout, config=config)


DT = [(i, o) for i in G.IN_DTYPES for o in G.OUT_DTYPES]


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("in_dt,out_dt", DT, ids=[f"{i}-{o}" for i, o in DT])
@pytest.mark.parametrize("M,N,K", [(129, 1000, 264), (1000, 520, 1000)], ids=["small", "medium"])
def test_dtypes(rng, M, N, K, layout, in_dt, out_dt):
    run_gemm(rng, M, N, K, layout, in_dt, out_dt)


@pytest.mark.parametrize("layout,config", [("kn", 3), ("nk", 3), ("kn", 2), ("nk", 1)])
def test_big_square(rng, layout, config):
    run_gemm(rng, 4096, 4096, 4096, layout, config=config, sample=256)


# configs 4, 5: 128x192 / 128x224 tiles (n192 / n224 wgmma, 224-row "nk" B box); 29 / 31: two
# warpgroups side by side along N (n64 / n48 halves of one 64-row tile); 46 / 47: 2 x 2 clusters (a
# quad's members past M or N still load and multicast); 48 / 49 / 50: 128-row tiles in pairs along M
# (B shared) / N (A shared); many tiles per block so ring positions are
# reused across tiles and warpgroups; ragged K so nkb is not a multiple of the stage count.
RING_SHAPES = [(2100, 4100, 328), (4100, 2100, 520), (300, 7168, 2048)]


@pytest.mark.parametrize("config", [4, 5, 29, 31, 40, 42, 46, 47, 48, 49, 50])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("M,N,K", RING_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in RING_SHAPES])
def test_new_configs_many_tiles(rng, M, N, K, layout, config):
    run_gemm(rng, M, N, K, layout, config=config, sample=None if M * N <= 4100 * 2100 else 256)


# the projection shapes the heuristic sends to configs 4, 5, 6, 36, 40 (dsv3 q_a, moe_down, kv_b, kv_a; gate_up)
AUTO_SHAPES = [(2048, 1536, 7168), (512, 7168, 2048), (8192, 32768, 512), (128, 57344, 8192),
               (512, 1536, 7168), (257, 2000, 4000),  # (config 36: cluster split-K on 128 x 96 tiles)
               (8192, 576, 7168), (4097, 1100, 7168)]  # (config 40: 192 x 192 tiles, one wave)


@pytest.mark.parametrize("M,N,K", AUTO_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in AUTO_SHAPES])
def test_auto_projection_shapes(rng, M, N, K):
    run_gemm(rng, M, N, K, "nk", sample=256)


def test_big_rect(rng):
    run_gemm(rng, 8192, 8192, 4096, "nk", sample=192)


def test_big_auto(rng):
    run_gemm(rng, 4096, 8192, 1000, "kn", in_dt="float16", out_dt="float32", sample=192)


# ---- swapped plans: C^T = B A^T ------------------------------------------------------------------
# B "nk" computed transposed (the kernel's rows run along B's rows, A's rows are its columns) and stored
# transposed from registers: a few rows of A (the 64 x 16 / 64 x 32 decode tiles, M = 1 among them),
# tall-skinny shapes, forced splits (the running-sum epilogue around the transposed store), cluster
# split-K (config 9), pairs along M / N (48 / 49, 8), ragged edges on both sides, every dtype pair.
SWAP_CASES = [  # (M, N, K, config, splits, in_dt, out_dt)
    (16, 8192, 8192, 53, None, "bfloat16", "bfloat16"), (1, 1000, 4097, 53, None, "bfloat16", "bfloat16"),
    (7, 1543, 40, 53, 3, "float16", "float32"), (13, 300, 1000, 53, None, "float16", "float16"),
    (30, 7168, 2048, 54, None, "bfloat16", "bfloat16"), (32, 300, 777, 54, 2, "float16", "float32"),
    (17, 65, 129, 54, None, "bfloat16", "float16"), (3573, 168, 1584, 1, None, "bfloat16", "bfloat16"),
    (2000, 129, 1000, 2, 3, "bfloat16", "float32"), (1000, 250, 520, 3, None, "float16", "bfloat16"),
    (1000, 250, 520, 4, 2, "bfloat16", "bfloat16"), (10755, 104, 5184, 9, None, "bfloat16", "bfloat16"),
    (9008, 248, 5752, 48, None, "bfloat16", "bfloat16"), (600, 130, 700, 49, None, "bfloat16", "float32"),
    (129, 1000, 4097, 48, 2, "bfloat16", "bfloat16"), (77, 1000, 1000, 8, None, "bfloat16", "bfloat16"),
]


@pytest.mark.parametrize("M,N,K,config,splits,in_dt,out_dt", SWAP_CASES,
                         ids=[f"{m}x{n}x{k}-c{c}-s{s}-{i}-{o}" for m, n, k, c, s, i, o in SWAP_CASES])
def test_swapped(rng, M, N, K, config, splits, in_dt, out_dt):
    run_gemm(rng, M, N, K, "nk", in_dt, out_dt, config=config, splits=splits, swap=True,
             sample=256 if M * N * K > 1 << 32 else None)
    plan = G.last_plan()
    assert plan.swapped and plan.config == config


@pytest.mark.parametrize("M,N,K", [(16, 10240, 8192), (5, 9000, 3000), (11, 14343, 1032), (32, 10240, 8192),
                                   (23, 9001, 2056)])
def test_swapped_decode_wave_and_a_fraction(rng, M, N, K, monkeypatch, mkenv):
    """The automatic route of a decode call whose 64-row tiles make a wave and a fraction: transposed on
    config 53 / 54, only the partial last wave split (N = 10240: 160 tiles, the last 28 in 4 K ranges)."""
    mkenv("MKERNEL_GEMM_SWAP", None)
    mkenv("MKERNEL_GEMM_GEMV", None)
    run_gemm(rng, M, N, K, "nk")
    plan = G.last_plan()
    assert plan.swapped and plan.config == (53 if M <= 16 else 54), (plan.swapped, plan.config)
    if N == 10240 and GK.num_sms(0) == 132:
        assert (plan.splits, plan.split_from) == (4, 132), (plan.splits, plan.split_from)


@pytest.mark.parametrize("config", GC.SWAP_CANDIDATES)
def test_swapped_every_candidate_ragged(rng, config):
    for M, N, K in [(77, 1000, 1000), (1000, 77, 200)]:
        run_gemm(rng, M, N, K, "nk", config=config, swap=True)


@pytest.mark.parametrize("out_dt,pad", [("bfloat16", 8), ("float32", 3), ("float16", 1)])
def test_swapped_output_view_and_reuse(rng, out_dt, pad):
    """A swapped plan writes only its output view (rows of ldc = N + pad), and re-pointed at another
    output of the same layout (the plan's with_out) writes that one."""
    M, N, K = 20, 1100, 520
    a, av = rand(rng, (M, K), "bfloat16")
    b, bv = rand(rng, (N, K), "bfloat16")
    ref = av @ bv.T
    for _ in range(2):
        buf = poisoned((M + 1, N + pad), out_dt)
        G.gemm(a, b, corner(buf, M, N), b_layout="nk", config=53, swap=True)
        h = download(buf)
        check(h[:M, :N], ref, f"swapped strided out {out_dt} pad={pad}")
        assert not written_outside(h, M, N), "swapped gemm wrote outside the output view"


def test_swap_needs_nk(rng):
    a, _ = rand(rng, (16, 64), "bfloat16")
    b, _ = rand(rng, (64, 128), "bfloat16")
    with pytest.raises(ValueError, match="swap"):
        G.gemm(a, b, b_layout="kn", swap=True)


# ---- split-K ---------------------------------------------------------------------------------
# configs 9 / 10: split-K inside clusters of 2 / 4 (partials through distributed shared memory): many
# tiles per cluster (the receive buffers' phases), K ranges that leave a block no K block at all
# (K = 64: one K block for 2 or 4 blocks), ragged tiles, both layouts, fp32 out.
CLUSTER_K_CASES = [(1000, 4100, 2000, "nk", "bfloat16"), (512, 1536, 7168, "nk", "bfloat16"),
                   (300, 1000, 4097, "kn", "float32"), (70, 200, 64, "nk", "bfloat16"),
                   (4096, 4096, 512, "kn", "bfloat16")]


@pytest.mark.parametrize("config", [9, 10])
@pytest.mark.parametrize("M,N,K,layout,out_dt", CLUSTER_K_CASES,
                         ids=[f"{m}x{n}x{k}-{l}-{o}" for m, n, k, l, o in CLUSTER_K_CASES])
def test_cluster_k_split(rng, M, N, K, layout, out_dt, config):
    run_gemm(rng, M, N, K, layout, out_dt=out_dt, config=config, sample=None if M * N <= 1 << 22 else 256)


def test_cluster_k_split_chosen_by_the_heuristic(rng):
    """llama qkv at M=128 (54 tiles of 128x192, two blocks each: one wave): the heuristic's plan is
    config 9, and right."""
    assert G.describe(128, 10240, 8192, b_layout="nk")["config"] == 9
    run_gemm(rng, 128, 10240, 8192, "nk", sample=None)


def test_cluster_k_split_is_deterministic(rng):
    """The cluster's partials are added in block order: the same bits on every call."""
    a = rand(rng, (512, 7168), "bfloat16")[0]
    b = rand(rng, (1536, 7168), "bfloat16")[0]
    outs = []
    for _ in range(3):
        out = poisoned((512, 1536), "float32")
        G.gemm(a, b, out, b_layout="nk", config=10)
        outs.append(download(out))
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])


SPLIT_CASES = [  # (M, N, K, layout, config, splits): ragged tiles, uneven K splits, every cooperative config
    (129, 1000, 4097, "kn", 3, 4), (7, 7, 4000, "nk", 1, 15), (300, 520, 2048, "kn", 2, 3),
    (64, 576, 7168, "nk", 4, 7), (1000, 224, 640, "nk", 5, 2), (200, 264, 1300, "kn", 1, 5),
    (300, 520, 2048, "nk", 8, 3), (64, 576, 7168, "nk", 24, 5), (300, 520, 2048, "kn", 24, 3),
    (129, 1000, 4097, "nk", 19, 3), (300, 520, 2048, "kn", 19, 3), (7, 7, 4000, "nk", 19, 5),
    (200, 264, 1300, "nk", 29, 5), (300, 520, 2048, "kn", 30, 3), (129, 1000, 4097, "nk", 31, 3),
    (7, 7, 4000, "kn", 32, 4), (130, 100, 2000, "nk", 32, 2), (300, 520, 2048, "kn", 40, 3),
    (400, 1000, 4097, "nk", 40, 2), (129, 700, 4097, "nk", 42, 2),
    (300, 520, 2048, "kn", 42, 3), (300, 520, 2048, "nk", 46, 3), (129, 1000, 4097, "kn", 47, 2),
    (300, 520, 2048, "nk", 48, 3), (129, 1000, 4097, "kn", 48, 2), (300, 520, 2048, "kn", 49, 3),
    (129, 1000, 4097, "nk", 50, 2), (1000, 16, 4097, "nk", 53, 3), (300, 30, 2048, "kn", 54, 2),
    (2000, 32, 1000, "nk", 54, 4),
]


@pytest.mark.parametrize("out_dt", ["bfloat16", "float32"])
@pytest.mark.parametrize("M,N,K,layout,config,splits", SPLIT_CASES,
                         ids=[f"{m}x{n}x{k}-{l}-c{c}-s{s}" for m, n, k, l, c, s in SPLIT_CASES])
def test_split_k(rng, M, N, K, layout, config, splits, out_dt):
    run_gemm(rng, M, N, K, layout, out_dt=out_dt, config=config, splits=splits)
    plan = G.last_plan()
    assert plan.splits == splits, f"planned {plan.splits} splits"


@pytest.mark.parametrize("M,N,K,layout", [(6656, 576, 7168, "nk"), (1024, 4352, 7168, "kn"), (1024, 2240, 7168, "nk")])
def test_split_k_last_wave(rng, M, N, K, layout):
    """More tiles than SMs with a partial last wave: whole tiles first, the last wave's tiles split."""
    run_gemm(rng, M, N, K, layout)
    plan = G.last_plan()
    assert plan.splits > 1 and plan.split_from > 0, (plan.splits, plan.split_from)


def test_split_k_auto_and_repeated(rng):
    """Few output tiles (M = 128 projections): the heuristic splits K; the per-tile counters return to
    zero after every call, so repeated calls with new data stay right."""
    M, N, K = 128, 1536, 7168
    a, _ = rand(rng, (M, K), "bfloat16")
    b, _ = rand(rng, (N, K), "bfloat16")
    out = poisoned((M, N), "bfloat16")
    for it in range(4):
        a2, av = rand(rng, (M, K), "bfloat16")
        b2, bv = rand(rng, (N, K), "bfloat16")
        a.copy_from(a2), b.copy_from(b2), out.fill_nan()
        G.gemm(a, b, out, b_layout="nk")
        check(download(out), av @ bv.T, f"split-K auto, call {it}")
    plan = G.last_plan()
    assert plan.splits > 1, "the heuristic did not split K for a 24-tile problem"


def test_graph_replay_after_plan_eviction(rng):
    """A split-K GEMM captured in a CUDA graph replays correctly (new data each time) after its plan
    was evicted from the plan cache: the plan and its workspace are kept once captured."""
    from cuda.bindings import driver as cu

    from mkernel.core.driver import check as ok

    M, N, K = 128, 1536, 7168
    a, _ = rand(rng, (M, K), "bfloat16")
    b, _ = rand(rng, (N, K), "bfloat16")
    out = poisoned((M, N), "bfloat16")
    stream = ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
    G.gemm(a, b, out, b_layout="nk", stream=int(stream))  # the plan, outside the capture
    ok(cu.cuStreamSynchronize(stream))
    ok(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
    G.gemm(a, b, out, b_layout="nk", stream=int(stream))
    graph = ok(cu.cuStreamEndCapture(stream))
    plan = next(p for p in BASE.pinned_calls() if p.plan.splits > 1)
    xs = [rand(rng, (64, 64 + 8 * i), "bfloat16")[0] for i in range(BASE.STATE_CAPACITY + 2)]
    for x in xs:  # evict it: distinct layouts make distinct bound calls
        G.gemm(x, rand(rng, (x.shape[1], 64), "bfloat16")[0], poisoned((64, 64), "bfloat16"))
    assert all(p is not plan for p in _bound_calls().values())
    del plan
    import gc

    gc.collect()

    def new_data():
        a2, av = rand(rng, (M, K), "bfloat16")
        b2, bv = rand(rng, (N, K), "bfloat16")
        a.copy_from(a2, stream=int(stream)), b.copy_from(b2, stream=int(stream))
        return av @ bv.T

    replay_and_check(stream, graph, out, 3, new_data, "graph replay after plan eviction")


def replay_and_check(stream, graph, out, reps, reference, what):
    """Instantiate ``graph``, then ``reps`` times: ``reference()`` (may refill the inputs on ``stream``;
    returns the float64 result), poison ``out``, launch, check; destroy the graph and the stream."""
    from cuda.bindings import driver as cu

    from mkernel.core.driver import check as ok

    gexec = ok(cu.cuGraphInstantiate(graph, 0))
    for rep in range(reps):
        ref = reference()
        out.fill_nan(stream=int(stream))
        ok(cu.cuGraphLaunch(gexec, stream))
        ok(cu.cuStreamSynchronize(stream))
        check(download(out), ref, f"{what} ({rep})")
    ok(cu.cuGraphExecDestroy(gexec))
    ok(cu.cuGraphDestroy(graph))
    ok(cu.cuStreamDestroy(stream))


def test_plan_built_and_evicted_inside_global_capture(rng):
    """A plan first met inside a global-mode CUDA-graph capture allocates its split-K workspace there,
    and the LRU frees an evicted plan's workspace there: neither may invalidate the capture (the
    library switches the thread to relaxed capture mode around those driver calls)."""
    import gc

    from cuda.bindings import driver as cu

    from mkernel.core.driver import check as ok

    y = rand(rng, (128, 512), "bfloat16")[0]
    fill = [rand(rng, (64 + i, 512), "bfloat16")[0] for i in range(BASE.STATE_CAPACITY)]
    for x in fill:  # a full cache of bound calls (distinct layouts) that own split-K workspaces
        G.gemm(x, y, poisoned((x.shape[0], 128), "bfloat16"), b_layout="nk", splits=2)
    del fill
    gc.collect()
    M, N, K = 100, 264, 3000
    a, av = rand(rng, (M, K), "bfloat16")
    b, bv = rand(rng, (N, K), "bfloat16")
    out = poisoned((M, N), "bfloat16")
    stream = ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
    ok(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
    G.gemm(a, b, out, b_layout="nk", stream=int(stream), splits=3)  # new plan: workspace + an eviction
    graph = ok(cu.cuStreamEndCapture(stream))
    replay_and_check(stream, graph, out, 2, lambda: av @ bv.T, "replay of a plan built inside a global capture")


# ---- views: strided output (masking), offset / strided / transposed inputs (staging) ---------
@pytest.mark.parametrize("out_dt,pad,layout,config,N", [
    ("float32", 24, "kn", None, 200),   # TMA-store epilogue, fp32 boxes of 32 columns
    ("bfloat16", 8, "nk", 5, 200),      # TMA stores + the 224-wide tile's last 32 columns from registers
    ("bfloat16", 3, "kn", 3, 200),      # row stride not a 16-byte multiple: register epilogue
    ("float16", 40, "nk", 1, 200),
    # a 16-byte row stride but N not a 16-byte multiple: a TMA store would write the rest of the last
    # 16 bytes into the padding (bench/recheck_tiles.py found it); columns past N16 go from registers
    ("bfloat16", 5, "nk", None, 203), ("float32", 1, "kn", None, 203), ("float16", 2, "nk", 40, 326),
    ("bfloat16", 2, "nk", 42, 646), ("bfloat16", 3, "kn", 3, 5), ("float32", 3, "nk", 5, 229),
])
def test_output_view_is_masked(rng, out_dt, pad, layout, config, N):
    M, K = 300, 136
    a, av = rand(rng, (M, K), "bfloat16")
    b, bv = rand(rng, (K, N) if layout == "kn" else (N, K), "bfloat16")
    buf = poisoned((M + 1, N + pad), out_dt)
    out = corner(buf, M, N)
    G.gemm(a, b, out, b_layout=layout, config=config)
    h = download(buf)
    check(h[:M, :N], av @ (bv if layout == "kn" else bv.T), f"strided out {out_dt} pad={pad} cfg={config}")
    assert not written_outside(h, M, N), "gemm wrote outside the output view"


@pytest.mark.parametrize("N,pad", [(264, 8), (261, 3)])
def test_grouped_output_rows_outside_groups_untouched(rng, N, pad):
    """Groups that end inside a tile (TMA stores must not spill into the next group's rows, nor
    outside [o[0], o[G])), with a padded output row stride (16-byte, N a 16-byte multiple or not)."""
    offs = [3, 70, 70, 200, 333]
    T, K = 340, 200
    a, av = rand(rng, (T, K), "bfloat16")
    b, bv = rand(rng, (4, N, K), "bfloat16")
    buf = poisoned((T, N + pad), "bfloat16")
    out = corner(buf, T, N)
    G.grouped_gemm(a, b, offs, out, b_layout="nk")
    h = download(buf)
    for g in range(4):
        r0, r1 = offs[g], offs[g + 1]
        if r1 > r0:
            check(h[r0:r1, :N], av[r0:r1] @ bv[g].T, f"group {g}")
    assert np.isnan(h[:offs[0]]).all() and np.isnan(h[offs[-1]:]).all() and np.isnan(h[:, N:]).all()


def test_input_views_staged(rng):
    M, N, K = 150, 90, 77
    big, bigv = rand(rng, (M + 3, K + 5), "bfloat16")
    # a: rows 1.. of a wider array: misaligned base and row stride K+5 -> staged
    a = DeviceArray(big.ptr + (1 * (K + 5) + 2) * 2, (M, K), "bfloat16", (K + 5, 1), big.device, big)
    av = bigv[1:M + 1, 2:K + 2]
    # b "kn" as a transposed view of an [N, K] array (non-unit inner stride) -> staged
    bt, btv = rand(rng, (N, K), "bfloat16")
    b = DeviceArray(bt.ptr, (K, N), "bfloat16", (1, K), bt.device, bt)
    out = poisoned((M, N), "bfloat16")
    G.gemm(a, b, out, b_layout="kn")
    check(download(out), av @ btv.T, "strided views")


@pytest.mark.parametrize("M,N,K,layout,pad", [(130, 200, 1001, "nk", 7), (70, 1001, 520, "kn", 7),
                                                (200, 300, 77, "nk", 3)])
def test_in_place_operands_with_a_partial_last_16_bytes(rng, M, N, K, layout, pad):
    """Operands read in place (16-byte aligned base and row stride) whose contiguous extent is not a
    16-byte multiple, with NaN in the row padding: TMA stores write whole 16-byte pieces of a row (see
    the masking tests); the loads must still zero-fill past the extent, or NaN reaches the products."""
    def padded(rows, cols):
        host = np.full((rows, cols + pad), np.nan, dtype=np.float32)
        host[:, :cols] = rng.standard_normal((rows, cols), dtype=np.float32)
        buf, vals = upload(host, "bfloat16")
        return corner(buf, rows, cols), vals[:, :cols]
    a, av = padded(M, K)
    b, bv = padded(K, N) if layout == "kn" else padded(N, K)
    out = poisoned((M, N), "float32")
    G.gemm(a, b, out, b_layout=layout)
    check(download(out), av @ (bv if layout == "kn" else bv.T), f"in-place partial-16-byte rows {layout}")


def test_k_zero_and_empty(rng):
    a, _ = rand(rng, (5, 1), "bfloat16")
    a0 = DeviceArray(a.ptr, (5, 0), "bfloat16", (1, 1), a.device, a)
    b0 = DeviceArray(a.ptr, (0, 3), "bfloat16", (3, 1), a.device, a)
    out = poisoned((5, 3), "float32")
    G.gemm(a0, b0, out)
    assert (out.to_numpy() == 0).all()
    e = G.gemm(DeviceArray.empty((0, 8), "bfloat16"), DeviceArray.empty((8, 4), "bfloat16"))
    assert e.shape == (0, 4)


def test_repeat_uses_plan(rng):
    a, av = rand(rng, (256, 512), "bfloat16")
    b, bv = rand(rng, (512, 384), "bfloat16")
    out = poisoned((256, 384), "bfloat16")
    G.gemm(a, b, out)
    n = len(_bound_calls())
    b2, bv2 = rand(rng, (512, 384), "bfloat16")
    b.copy_from(b2)  # same pointers, new data: the cached plan must see it
    out.fill_nan()
    G.gemm(a, b, out)
    assert len(_bound_calls()) == n
    check(download(out), av @ bv2, "repeat")


# ---- decode-shaped calls: mkernel/gemv.py ------------------------------------------------------
from mkernel.ops.gemm import gemv as GV  # noqa: E402

GEMV_SHAPES = [  # (M, N, K); the route's block-count threshold is lifted, so small N runs it too
    (1, 8192, 8192), (2, 1056, 8), (7, 1543, 40), (8, 4099, 2056), (9, 2048, 7168), (16, 1100, 1024),
    (13, 3000, 264), (1, 28672, 512), (16, 16384, 72), (3, 17, 64), (16, 1, 8),
]


@pytest.fixture
def gemv_route(monkeypatch, mkenv):
    """Every supported call routed to the kernel (up to its 16 rows, any N), whatever the measured
    routing thresholds say."""
    monkeypatch.setattr(GV, "MIN_BLOCK_FILL", 0.0)
    monkeypatch.setattr(GV, "ROUTE_MAX_TILE_FILL", float("inf"))
    mkenv("MKERNEL_GEMM_GEMV", None)
    mkenv("MKERNEL_GEMM_SWAP", "0")  # (not the transposed 64 x 16 tiles: test_swapped)


def last_plan():
    return G.last_plan()


def _bound_calls():
    """The current device's bound GEMM calls (LRU order)."""
    return BASE.device_state("gemm", GK.context()[1]).calls


@pytest.mark.parametrize("in_dt,out_dt", [("bfloat16", "bfloat16"), ("float16", "float32"),
                                          ("bfloat16", "float32"), ("float16", "float16")])
@pytest.mark.parametrize("M,N,K", GEMV_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in GEMV_SHAPES])
def test_gemv(rng, gemv_route, M, N, K, in_dt, out_dt):
    """C = A @ B^T on the decode-shaped kernel (asserted: the plan is gemv's), every dtype pair, odd M,
    N and K (K a multiple of 8: whole 16-byte pieces); fp32 outputs to 1e-4 (fp32 accumulation only)."""
    a, av = rand(rng, (M, K), in_dt)
    b, bv = rand(rng, (N, K), in_dt)
    out = poisoned((M, N), out_dt)
    G.gemm(a, b, out, b_layout="nk")
    assert last_plan().kind == "gemv", "not routed to the gemv kernel"
    e = rel_fro(download(out), av @ bv.T)
    assert e < (1e-4 if out_dt == "float32" else TOL), f"gemv {M}x{N}x{K} {in_dt}->{out_dt}: {e:.3e}"


def test_gemv_views_and_repeats(rng, gemv_route, monkeypatch, mkenv):
    """Strided A and B rows (16-byte multiples), an output view with padded rows (nothing written
    outside it), a re-pointed output, new data behind the same pointers, and the same call with the
    route off (the GEMM tiles) agreeing to 1e-4 in fp32."""
    M, N, K = 5, 2500, 1000
    abuf, abv = rand(rng, (M, K + 24), "bfloat16")
    bbuf, bbv = rand(rng, (N, K + 8), "bfloat16")
    a, b = corner(abuf, M, K), corner(bbuf, N, K)
    av, bv = abv[:, :K], bbv[:, :K]
    buf = poisoned((M + 1, N + 40), "float32")
    out = corner(buf, M, N)
    G.gemm(a, b, out, b_layout="nk")
    assert last_plan().kind == "gemv"
    h = download(buf)
    assert rel_fro(h[:M, :N], av @ bv.T) < 1e-4
    assert not written_outside(h, M, N), "gemv wrote outside the output view"
    plan = last_plan()
    buf2 = poisoned((M, N + 40), "float32")
    out2 = corner(buf2, M, N)  # out's layout
    G.gemm(a, b, out2, b_layout="nk")
    assert last_plan() is plan, "a new plan for an output of the same layout"
    assert rel_fro(download(buf2)[:, :N], av @ bv.T) < 1e-4
    a2, av2 = rand(rng, (M, K + 24), "bfloat16")
    abuf.copy_from(a2)
    buf2.fill_nan()
    G.gemm(a, b, out2, b_layout="nk")
    got = download(buf2)[:, :N]
    assert rel_fro(got, av2[:, :K] @ bv.T) < 1e-4
    mkenv("MKERNEL_GEMM_GEMV", "0")
    ref = poisoned((M, N), "float32")
    G.gemm(a, b, ref, b_layout="nk")
    assert not last_plan().kind == "gemv"
    assert rel_fro(got, download(ref)) < 1e-4


# ---- grouped ---------------------------------------------------------------------------------
def run_grouped(rng, sizes, N, K, layout, in_dt="bfloat16", out_dt="bfloat16", device_offsets=False,
                config=None):
    offs = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    T, Gn = int(offs[-1]), len(sizes)
    a, av = rand(rng, (max(T, 0), K), in_dt)
    b, bv = rand(rng, (Gn, K, N) if layout == "kn" else (Gn, N, K), in_dt)
    out = poisoned((T, N), out_dt)
    o = DeviceArray.from_numpy(offs) if device_offsets else offs.tolist()
    G.grouped_gemm(a, b, o, out, b_layout=layout, config=config)
    got = download(out)
    ref = np.empty((T, N))
    for g in range(Gn):
        bg = bv[g] if layout == "kn" else bv[g].T
        ref[offs[g]:offs[g + 1]] = av[offs[g]:offs[g + 1]] @ bg
    check(got, ref, f"grouped sizes={list(sizes)} N={N} K={K} {layout} dev_offs={device_offsets} cfg={config}")


GROUPS = [
    ([0, 300, 1, 0, 700, 129], 512, 256),
    ([64, 64, 64, 64], 128, 64),
    ([1, 0, 0, 7], 7, 7),
    ([1000, 0, 2, 129, 4097 - 1131], 264, 136),
]


@pytest.mark.parametrize("device_offsets", [False, True])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("sizes,N,K", GROUPS, ids=[f"g{i}" for i in range(len(GROUPS))])
def test_grouped(rng, sizes, N, K, layout, device_offsets):
    run_grouped(rng, sizes, N, K, layout, device_offsets=device_offsets)


@pytest.mark.parametrize("config", sorted(c for c in G.CONFIGS if G.CONFIGS[c].cluster == 1))
def test_grouped_configs(rng, config):
    run_grouped(rng, [0, 300, 1, 0, 700, 129], 520, 264, "nk", config=config)
    run_grouped(rng, [5, 0, 260], 384, 128, "kn", in_dt="float16", out_dt="float32", config=config)


@pytest.mark.parametrize("config", sorted(c for c in G.CONFIGS if G.CONFIGS[c].cluster > 1))
def test_grouped_rejects_cluster_configs(rng, config):
    a, _ = rand(rng, (64, 64), "bfloat16")
    b, _ = rand(rng, (2, 64, 32), "bfloat16")
    with pytest.raises(ValueError, match="clusters of blocks"):
        G.grouped_gemm(a, b, [0, 30, 64], config=config)


def test_grouped_all_empty(rng):
    a = DeviceArray.empty((0, 64), "bfloat16")
    b, _ = rand(rng, (3, 64, 32), "bfloat16")
    out = G.grouped_gemm(a, b, [0, 0, 0, 0])
    assert out.shape == (0, 32)


def test_grouped_moe_like(rng):
    sizes = rng.multinomial(4096, np.ones(16) / 16)
    sizes[3] = 0
    run_grouped(rng, sizes, 2048, 1024, "nk", device_offsets=True)


# ---- programmatic dependent launch -----------------------------------------------------------
def rerun_poisoned(chain, outs, graph: bool):
    """``chain(stream)`` once on a fresh non-blocking stream (its plans, outside any capture), then
    ``outs`` NaN-poisoned and the chain run again -- eagerly, or captured into a CUDA graph and
    launched -- with no host sync inside either run; returns the first run's result."""
    from cuda.bindings import driver as cu

    from mkernel.core.driver import check as ok

    stream = ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
    first = chain(int(stream))
    ok(cu.cuStreamSynchronize(stream))
    for x in outs:
        x.fill_nan()
    if graph:
        ok(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        chain(int(stream))
        g = ok(cu.cuStreamEndCapture(stream))
        ge = ok(cu.cuGraphInstantiate(g, 0))
        ok(cu.cuGraphLaunch(ge, stream))
    else:
        chain(int(stream))
    ok(cu.cuStreamSynchronize(stream))
    if graph:
        ok(cu.cuGraphExecDestroy(ge))
        ok(cu.cuGraphDestroy(g))
    ok(cu.cuStreamDestroy(stream))
    return first


@pytest.mark.parametrize("graph", [False, True])
def test_chained_gemms_read_the_previous_output(rng, graph, monkeypatch, mkenv):
    """GEMMs are programmatic dependent launches: each of a chain x_{i+1} = x_i @ W_i (back to back on
    one stream, no host sync; then the same chain captured in a CUDA graph and replayed) must read
    x_i only after the previous GEMM finished writing it (every x_i is NaN-poisoned beforehand), on
    plans with and without split-K."""
    mkenv("MKERNEL_GEMM_PDL", "1")  # every step a dependent launch (auto: only some)
    dims = [(512, 1536, 7168), (512, 7168, 1536), (128, 1536, 7168), (128, 4096, 1536), (128, 640, 4096)]
    x0, x0v = rand(rng, (dims[0][0], dims[0][2]), "bfloat16")
    # weights [N, K] scaled by 1/sqrt(K): every x_i stays O(1)
    ws = [upload(rng.standard_normal((n, k), dtype=np.float32) / np.float32(np.sqrt(k)), "bfloat16") for _, n, k in dims]
    rows = [d[0] for d in dims]
    xs = [x0]
    for (m, n, k) in dims:
        xs.append(poisoned((m, n), "bfloat16"))
    # the M = 128 steps read the first 128 rows of the previous output
    ins = [xs[0]] + [xs[i][:rows[i]] if rows[i] < xs[i].shape[0] else xs[i] for i in range(1, len(dims))]

    def chain(stream):
        for i in range(len(dims)):
            G.gemm(ins[i], ws[i][0], xs[i + 1], b_layout="nk", stream=stream)

    rerun_poisoned(chain, xs[1:], graph)
    prev = x0v
    for i, (m, n, k) in enumerate(dims):
        got = download(xs[i + 1])
        ref = prev[:m] @ ws[i][1].T
        check(got, ref, f"chain step {i} ({m}x{n}x{k}, graph={graph})")
        prev = got.astype(np.float64)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("M", [8, 13])
def test_gemv_chain_dependent_launches(rng, gemv_route, M, graph, monkeypatch, mkenv):
    """Decode steps are programmatic dependent launches too: a chain x_{i+1} = x_i @ W_i^T of decode
    calls (one and two MMA column tiles; K = 3000 and 1000 are not multiples of 32) with a GEMM-tile
    step forced in between (config 1; the gemv after it is a dependent of it), back to back on one stream and then
    captured in a CUDA graph: each step must read x_i only after the previous one wrote all of it
    (every x_i NaN-poisoned beforehand)."""
    mkenv("MKERNEL_GEMM_PDL", None)  # the default: decode launches are dependent
    dims = [(4096, 2048, None), (3000, 4096, None), (2048, 3000, 1), (1000, 2048, None), (6000, 1000, None)]
    x0, x0v = rand(rng, (M, dims[0][1]), "bfloat16")
    ws = [upload(rng.standard_normal((n, k), dtype=np.float32) / np.float32(np.sqrt(k)), "bfloat16")
          for n, k, _ in dims]
    xs = [x0] + [poisoned((M, n), "bfloat16") for n, _, _ in dims]

    def chain(stream):
        kinds = []
        for i, (_, _, cfg) in enumerate(dims):
            G.gemm(xs[i], ws[i][0], xs[i + 1], b_layout="nk", config=cfg, stream=stream)
            kinds.append(last_plan().kind == "gemv")
        return kinds

    kinds = rerun_poisoned(chain, xs[1:], graph)
    assert kinds == [cfg is None for _, _, cfg in dims], "decode steps not on the gemv kernel"
    assert last_plan().dependent
    prev = x0v
    for i, (n, k, cfg) in enumerate(dims):
        got = download(xs[i + 1])
        check(got, prev @ ws[i][1].T, f"decode chain step {i} ({M}x{n}x{k}, config={cfg}, graph={graph})")
        prev = got


@pytest.mark.parametrize("M,N,K,layout", [(128, 512, 16384, "kn"), (200, 1000, 12000, "nk")])
def test_deterministic_bits(rng, M, N, K, layout):
    """GemmOptions(deterministic=True) on shapes the heuristic splits along K: correct, and the same bits
    over 20 calls (the default split plan is checked for correctness only: its last bits may vary)."""
    a, av = rand(rng, (M, K), "bfloat16")
    b, bv = rand(rng, (K, N) if layout == "kn" else (N, K), "bfloat16")
    ref = av @ (bv if layout == "kn" else bv.T)
    opts = G.GemmOptions(deterministic=True)
    outs = [poisoned((M, N), "float32") for _ in range(20)]
    for o in outs:
        G.gemm(a, b, o, b_layout=layout, out_dtype="float32", options=opts)
    first = download(outs[0])
    check(first, ref, f"deterministic gemm {M}x{N}x{K} {layout}")
    for i, o in enumerate(outs[1:]):
        np.testing.assert_array_equal(download(o), first, err_msg=f"call {i + 1} differs")
    split = poisoned((M, N), "float32")
    G.gemm(a, b, split, b_layout=layout, out_dtype="float32")
    check(download(split), ref, f"default gemm {M}x{N}x{K} {layout}")
