"""Host side of GEMM+ReduceScatter on the CPU: bad input raises before any launch (and before any
agreement), the plan that runs is the planner's on the exchanged K_r of every rank, the agreed digest
reaches the kernel, a repeated call re-points its bound launch (operand maps, output fields) instead of
planning again, and the unfused / plain-GEMM paths call mkernel.gemm and mkernel.reduce_scatter as they
should.  The context is a stand-in, arrays carry fake device pointers, kernels and tensor maps are fakes:
nothing touches a GPU."""
from __future__ import annotations

import pytest

from _comm_fakes import FakeCtx, FakeKernel, FakeMap, arr, launches
from mkernel.core.arrays import DeviceArray
from mkernel.ops import base as BASE
from mkernel.ops.gemm_rs import GemmRsOptions
from mkernel.ops.gemm_rs import op as OPM


@pytest.fixture
def env(monkeypatch):
    log = []
    monkeypatch.setattr(OPM, "fused_kernel", lambda ctx, p: FakeKernel(log, f"mk_gemm_rs_{p.b_layout}:{p.config}"))
    monkeypatch.setattr(OPM, "TensorMapArg", FakeMap)
    monkeypatch.setattr(OPM, "copy_2d", lambda *a: log.append(dict(copy_2d=a)))
    monkeypatch.setattr(OPM, "gemm", lambda a, b, o, *, b_layout, stream, options=None: log.append(
        dict(gemm=(a.ptr, a.shape, b.ptr, o.ptr, o.shape, b_layout, stream), **({"options": options} if options else {}))))
    monkeypatch.setattr(OPM, "reduce_scatter", lambda ctx, x, o, *, stream: log.append(
        dict(rs=(x.ptr, x.shape, o.ptr, o.shape, stream))))
    monkeypatch.setattr(DeviceArray, "empty", classmethod(lambda cls, shape, dtype, device=None: arr(shape, dtype)))
    monkeypatch.setattr(BASE, "is_capturing", lambda stream: False)
    monkeypatch.setattr(OPM, "require_gemm_device", lambda what, device: None)  # (a Hopper, as far as the op asks)
    monkeypatch.setattr(OPM, "_OP", OPM.GemmReduceScatter())  # (options seen by other tests' op object)
    yield FakeCtx(), log


def call(ctx, a, b, out=None, **kw):
    return OPM._OP(ctx, a, b, out, kw.pop("b_layout", "kn"), kw.pop("out_dtype", None), kw.pop("deterministic", False),
                   kw.pop("stream", None), kw.pop("options", None))


def test_bad_inputs_raise_before_anything_runs(env):
    ctx, log = env
    M, K, N = 256, 512, 384
    a, b, o = arr((M, K)), arr((K, N)), arr((M // 2, N))
    with pytest.raises(TypeError, match="a must be bfloat16 or float16, got float32"):
        call(ctx, arr((M, K), "float32"), b)
    with pytest.raises(TypeError, match="a must be bfloat16 or float16, got float32"):
        call(ctx, arr((M, K), "float32"), arr((K, N), "float32"), o)
    with pytest.raises(TypeError, match="a is bfloat16 but b is float16"):
        call(ctx, a, arr((K, N), "float16"), o)
    with pytest.raises(ValueError, match="must be 2-D"):
        call(ctx, arr((M * K,)), b, o)
    with pytest.raises(ValueError, match="K differs"):
        call(ctx, a, arr((K + 8, N)), o)
    with pytest.raises(ValueError, match="K differs"):
        call(ctx, a, arr((N, K + 8)), o, b_layout="nk")
    with pytest.raises(ValueError, match="b_layout"):
        call(ctx, a, b, o, b_layout="mk")
    with pytest.raises(ValueError, match=r"out must have shape \(128, 384\)"):
        call(ctx, a, b, arr((M, N)))
    with pytest.raises(TypeError, match="out must be bfloat16, float16 or float32, got int32"):
        call(ctx, a, b, arr((M // 2, N), "int32"))
    with pytest.raises(TypeError, match="out is bfloat16 but out_dtype=float32"):
        call(ctx, a, b, o, out_dtype="float32")
    with pytest.raises(TypeError, match="out_dtype must be one of"):
        call(ctx, a, b, out_dtype="int8")
    with pytest.raises(ValueError, match="out overlaps a"):
        call(ctx, a, b, DeviceArray(a.ptr + 1024, (M // 2, N), "bfloat16", None, 0, None))
    with pytest.raises(ValueError, match="out overlaps b"):
        call(ctx, a, b, DeviceArray(b.ptr + b.nbytes - 2, (M // 2, N), "bfloat16", None, 0, None))
    with pytest.raises(ValueError, match="out is read-only"):
        call(ctx, a, b, arr((M // 2, N), readonly=True))
    with pytest.raises(ValueError, match="m_sizes has 3 entries"):
        call(ctx, a, b, options=GemmRsOptions(m_sizes=(100, 100, 56)))
    with pytest.raises(ValueError, match="sum to a's rows"):
        call(ctx, a, b, options=GemmRsOptions(m_sizes=(100, 100)))
    with pytest.raises(ValueError, match="tuple of ints >= 0"):
        call(ctx, a, b, options=GemmRsOptions(m_sizes=(300, -44)))
    with pytest.raises(ValueError, match=r"out must have shape \(200, 384\)"):
        call(ctx, a, b, o, options=GemmRsOptions(m_sizes=(200, 56)))
    with pytest.raises(ValueError, match="GemmRsOptions.path"):
        call(ctx, a, b, o, options=GemmRsOptions(path="fast"))
    with pytest.raises(TypeError, match="options must be a GemmRsOptions"):
        call(ctx, a, b, o, options=dict(path="fused"))
    with pytest.raises(ValueError, match="unit stride along its last axis"):
        call(ctx, arr((M, K), strides=(2 * K, 2)), b, o)
    with pytest.raises(ValueError, match="unit column stride"):
        call(ctx, a, b, arr((M // 2, N), strides=(2 * N, 2)))
    with pytest.raises(ValueError, match="is on cuda:1"):
        call(ctx, a, arr((K, N), device=1), o)
    ctx.num_nodes = 2
    with pytest.raises(ValueError, match="one node"):
        call(ctx, a, b, o)
    ctx.num_nodes = 1
    assert log == [] and ctx.agreed == [] and ctx.exchanges == [] and ctx.workspaces == []


def test_ranks_disagreeing_raise_naming_them(env):
    ctx, log = env
    ctx.peer_sig = ("another call",)
    with pytest.raises(ValueError, match=r"local ranks \[1\] have"):
        call(ctx, arr((256, 512)), arr((512, 384)))
    assert launches(log) == [] and ctx.agreed == []


def test_fused_call_and_repointing(env):
    """The first call binds (one exchange of K_r, one agreement, one prepared launch); a call with new arrays
    of the same layout re-points A's, B's and out's maps and the output field of the same launch."""
    ctx, log = env
    M, K, N = 4096, 4096, 8192
    a, b, o = arr((M, K)), arr((N, K)), arr((M // 2, N))
    r = call(ctx, a, b, o, b_layout="nk")
    assert r is o
    p = ctx.last_plan("gemm_rs")
    assert p.path == "fused" and p.m_sizes == (2048, 2048) and p.Ks == (K, K) and p.digest == 0x7001
    prepared = [e for e in log if "prepared" in e]
    assert len(prepared) == 1 and prepared[0]["cooperative"] and prepared[0]["grid"] == min(132, p.units)
    run = launches(log)[-1]["values"]
    tma_a, tma_b, tma_c, comm, args = run
    assert (tma_a, tma_b, tma_c) == (a.ptr, b.ptr, o.ptr)
    assert comm == dict(sig=0x7001)  # the agreed digest reaches the kernel (MkComm.sig)
    assert args["c"] == o.ptr and args["K"] == K and args["P"] == 2 and args["me"] == 0 and args["N"] == N
    assert args["offs"] == [0, 2048, 4096] and args["c_tma"] == 1 and args["c_vec_ok"] == 1
    assert (args["flags_off"], args["data_off"], args["slot_bytes"]) == (p.ws.flags_off, p.ws.data_off,
                                                                        p.ws.slot_bytes)
    assert ctx.workspaces == [(("gemm_rs",), p.ws.total)]
    assert args["ws"] == (1 << 40) and args["peers"] == (1 << 41)
    a2, b2, o2 = arr((M, K)), arr((N, K)), arr((M // 2, N))
    call(ctx, a2, b2, o2, b_layout="nk")
    assert len([e for e in log if "prepared" in e]) == 1 and len(ctx.agreed) == 1 and len(ctx.exchanges) == 1
    tma_a, tma_b, tma_c, comm, args = launches(log)[-1]["values"]
    assert (tma_a, tma_b, tma_c, args["c"]) == (a2.ptr, b2.ptr, o2.ptr, o2.ptr)
    # out=None: a fresh output each call, same bound launch
    r1, r2 = call(ctx, a, b, b_layout="nk"), call(ctx, a, b, b_layout="nk")
    assert r1.shape == (M // 2, N) and r1.dtype.name == "bfloat16" and r1.ptr != r2.ptr
    assert len([e for e in log if "prepared" in e]) == 1
    assert launches(log)[-1]["values"][4]["c"] == r2.ptr
    # another workspace generation (a workspace grew): the bound launch takes the op's workspace anew
    ctx.workspace_generation = 1
    call(ctx, a, b, o, b_layout="nk")
    assert launches(log)[-1]["values"][4]["ws"] == (1 << 40) + (1 << 36)
    assert len([e for e in log if "prepared" in e]) == 1
    # anything else of the key binds anew: stream, options, layout of an argument
    call(ctx, a, b, o, b_layout="nk", stream=5)
    call(ctx, a, b, o, b_layout="nk", options=GemmRsOptions(config=2))
    assert len([e for e in log if "prepared" in e]) == 3
    assert ctx.last_plan("gemm_rs").config == 2


def test_exchanged_k_feeds_the_plan_and_the_agreement(env):
    ctx, log = env
    ctx.ks = [4096, 2048]
    call(ctx, arr((2048, 4096)), arr((4096, 4096)), arr((1024, 4096)))
    p = ctx.last_plan("gemm_rs")
    assert p.Ks == (4096, 2048)
    sig = ctx.agreed[0][1]
    assert sig[1:] == ((4096, 2048), p.path, p.config, p.partial_dtype)
    assert launches(log)[-1]["values"][4]["K"] == 4096  # this rank's own K_r
    # a second call with the same local signature: no exchange, no agreement (cached), no bind
    call(ctx, arr((2048, 4096)), arr((4096, 4096)), arr((1024, 4096)))
    assert len(ctx.exchanges) == 1 and len(ctx.agreed) == 1


def test_misaligned_operands_are_staged_each_call(env):
    """An operand TMA cannot address in place (row stride not a 16-byte multiple) goes through a staging
    buffer of 16-byte rows, copied on the stream at every call; the map covers the buffer."""
    ctx, log = env
    M, K, N = 1024, 1020, 2048  # a's rows: 2040 bytes
    a = arr((M, K))
    b = arr((K, N))
    call(ctx, a, b, arr((M // 2, N)), options=GemmRsOptions(path="fused"))
    copies = [e["copy_2d"] for e in log if "copy_2d" in e]
    assert len(copies) == 1
    dst, dpitch, src, spitch, width, height, stream = copies[0]
    assert (src, spitch, width, height, dpitch) == (a.ptr, 2 * K, 2 * K, M, 2048)
    assert launches(log)[-1]["values"][0] == dst  # A's map covers the staging buffer
    a2 = arr((M, K))
    call(ctx, a2, b, arr((M // 2, N)), options=GemmRsOptions(path="fused"))
    assert [e["copy_2d"][2] for e in log if "copy_2d" in e] == [a.ptr, a2.ptr]
    assert len([e for e in log if "prepared" in e]) == 1
    assert ctx.last_plan("gemm_rs").path == "fused"


def test_output_without_tma(env):
    """An output whose rows are not 16-byte multiples apart is stored from registers (c_tma = 0)."""
    ctx, log = env
    N = 1000
    o = arr((512, N), strides=(N + 4, 1))  # 2008-byte rows
    call(ctx, arr((1024, 2048)), arr((2048, N)), o, options=GemmRsOptions(path="fused"))
    args = launches(log)[-1]["values"][4]
    assert args["c_tma"] == 0 and args["ldc"] == N + 4 and args["c_vec_ok"] == 1


def test_unfused_path_equal_split(env):
    ctx, log = env
    M, K, N = 1024, 512, 768
    a, b, o = arr((M, K)), arr((K, N)), arr((M // 2, N), "float32")
    call(ctx, a, b, o, options=GemmRsOptions(path="unfused"), stream=9)
    p = ctx.last_plan("gemm_rs")
    assert p.path == "unfused" and p.partial_dtype == "float32"
    gemms = [e["gemm"] for e in log if "gemm" in e]
    rss = [e["rs"] for e in log if "rs" in e]
    assert len(gemms) == 1 and gemms[0][:2] == (a.ptr, (M, K)) and gemms[0][4] == (M, N) and gemms[0][5:] == ("kn", 9)
    assert rss == [(gemms[0][3], (M, N), o.ptr, (M // 2, N), 9)]  # reduce-scatter straight into out
    assert not any("copy_2d" in e for e in log) and launches(log) == []


def test_unfused_path_uneven_split(env):
    """Uneven rows: one GEMM per owner into equal shares of max(m_j) rows, the reduce-scatter into a
    buffer, this rank's rows copied into out."""
    ctx, log = env
    ctx.local_size = ctx.size = 3
    M, K, N = 10, 64, 32
    a, b = arr((M, K)), arr((N, K))
    o = call(ctx, a, b, b_layout="nk", options=GemmRsOptions(path="unfused", m_sizes=(5, 0, 5)))
    gemms = [e["gemm"] for e in log if "gemm" in e]
    assert [(g[0] - a.ptr) // (2 * K) for g in gemms] == [0, 5] and [g[1] for g in gemms] == [(5, K), (5, K)]
    tmp = gemms[0][3]
    assert gemms[1][3] == tmp + 2 * 5 * N * 2  # owner 2's share: rows 10..14 of the [15, N] buffer
    (rs,) = [e["rs"] for e in log if "rs" in e]
    assert rs[:2] == (tmp, (15, N)) and rs[3] == (5, N) and rs[2] != o.ptr
    (cp,) = [e["copy_2d"] for e in log if "copy_2d" in e]
    assert cp[:6] == (o.ptr, 2 * N, rs[2], 2 * N, 2 * N, 5)


def test_one_rank_is_the_gemm(env):
    ctx, log = env
    ctx.local_size = ctx.size = 1
    a, b, o = arr((100, 64)), arr((64, 48)), arr((100, 48))
    call(ctx, a, b, o)
    assert ctx.last_plan("gemm_rs").path == "gemm" and ctx.exchanges == []
    assert [e["gemm"][:4] for e in log if "gemm" in e] == [(a.ptr, (100, 64), b.ptr, o.ptr)]


def test_empty_and_zero_k(env):
    ctx, log = env
    call(ctx, arr((0, 64)), arr((64, 48)), arr((0, 48)))
    assert ctx.last_plan("gemm_rs").path == "empty" and log == []
    call(ctx, arr((64, 0)), arr((0, 48)), arr((32, 48)))  # K_r = 0: a zero fill by mkernel.gemm
    p = ctx.last_plan("gemm_rs")
    assert p.path == "unfused" and "K_r = 0" in p.reason and len([e for e in log if "gemm" in e]) == 1


def test_deterministic_is_part_of_the_call(env):
    ctx, log = env
    a, b, o = arr((512, 256)), arr((256, 256)), arr((256, 256))
    call(ctx, a, b, o)
    call(ctx, a, b, o, deterministic=True)
    assert ctx.last_plan("gemm_rs").deterministic is True
    assert ctx.agreed[0][1][0] != ctx.agreed[1][1][0]  # another agreed signature


def test_deterministic_plain_gemm(env):
    """deterministic=True reaches the plain GEMM of the one-rank and unfused paths (no split-K there)."""
    ctx, log = env
    ctx.local_size = ctx.size = 1
    a, b, o = arr((100, 64)), arr((64, 48)), arr((100, 48))
    call(ctx, a, b, o, deterministic=True)
    call(ctx, a, b, o)
    opts = [e.get("options") for e in log if "gemm" in e]
    assert len(opts) == 2 and opts[0].deterministic and opts[1] is None
