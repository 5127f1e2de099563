"""Host side of GEMM+AllReduce on the CPU: bad input raises before any launch (and before any agreement), the
plan that runs is the planner's on the exchanged K_r of every rank, the agreed digest reaches the kernel, the
fused launch gets the right maps and fields for each path (latency plain and transposed, bandwidth), a
repeated call re-points its bound launch instead of planning again, and the unfused / plain-GEMM paths call
mkernel.gemm and mkernel.all_reduce as they should.  The context is a stand-in, arrays carry fake device
pointers, kernels and tensor maps are fakes (tests/cpu/_comm_fakes.py): nothing touches a GPU."""
from __future__ import annotations

import pytest

from _comm_fakes import FakeCtx, FakeKernel, FakeMap, arr, launches
from mkernel.core.arrays import DeviceArray
from mkernel.ops import base as BASE
from mkernel.ops.gemm_ar import GemmArOptions
from mkernel.ops.gemm_ar import layout as LY
from mkernel.ops.gemm_ar import op as OPM
from mkernel.ops.gemm_comm import row_offsets


@pytest.fixture
def env(monkeypatch):
    log = []
    monkeypatch.setattr(OPM, "fused_kernel", lambda ctx, p: FakeKernel(
        log, f"mk_gemm_ar_{p.b_layout}:{p.path}:{p.config}{':T' if p.transposed else ''}"))
    monkeypatch.setattr(OPM, "TensorMapArg", FakeMap)
    monkeypatch.setattr(OPM, "copy_2d", lambda *a: log.append(dict(copy_2d=a)))
    monkeypatch.setattr(OPM, "gemm", lambda a, b, o, *, b_layout, stream, options=None: log.append(
        dict(gemm=(a.ptr, a.shape, b.ptr, o.ptr, o.shape, b_layout, stream), **({"options": options} if options else {}))))
    monkeypatch.setattr(OPM, "all_reduce", lambda ctx, x, o, *, stream: log.append(
        dict(ar=(x.ptr, x.shape, o.ptr, o.shape, stream))))
    monkeypatch.setattr(DeviceArray, "empty", classmethod(lambda cls, shape, dtype, device=None: arr(shape, dtype)))
    monkeypatch.setattr(BASE, "is_capturing", lambda stream: False)
    monkeypatch.setattr(OPM, "require_gemm_device", lambda what, device: None)  # (a Hopper, as far as the op asks)
    monkeypatch.setattr(OPM, "_OP", OPM.GemmAllReduce())  # (options seen by other tests' op object)
    yield FakeCtx(), log


def call(ctx, a, b, out=None, **kw):
    return OPM._OP(ctx, a, b, out, kw.pop("b_layout", "kn"), kw.pop("out_dtype", None), kw.pop("deterministic", False),
                   kw.pop("stream", None), kw.pop("options", None))


def prepared(log):
    return [e for e in log if "prepared" in e]


def test_bad_inputs_raise_before_anything_runs(env):
    ctx, log = env
    M, K, N = 64, 512, 384
    a, b, o = arr((M, K)), arr((K, N)), arr((M, N))
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
    with pytest.raises(ValueError, match=r"out must have shape \(64, 384\) \(the whole 64 x 384 sum"):
        call(ctx, a, b, arr((M // 2, N)))
    with pytest.raises(TypeError, match="out must be bfloat16, float16 or float32, got int32"):
        call(ctx, a, b, arr((M, N), "int32"))
    with pytest.raises(TypeError, match="out is bfloat16 but out_dtype=float32"):
        call(ctx, a, b, o, out_dtype="float32")
    with pytest.raises(TypeError, match="out_dtype must be one of"):
        call(ctx, a, b, out_dtype="int8")
    with pytest.raises(ValueError, match="out overlaps a"):
        call(ctx, a, b, DeviceArray(a.ptr + 1024, (M, N), "bfloat16", None, 0, None))
    with pytest.raises(ValueError, match="out overlaps b"):
        call(ctx, a, b, DeviceArray(b.ptr + b.nbytes - 2, (M, N), "bfloat16", None, 0, None))
    with pytest.raises(ValueError, match="out is read-only"):
        call(ctx, a, b, arr((M, N), readonly=True))
    with pytest.raises(ValueError, match="GemmArOptions.path"):
        call(ctx, a, b, o, options=GemmArOptions(path="fast"))
    with pytest.raises(ValueError, match="GemmArOptions.config"):
        call(ctx, a, b, o, options=GemmArOptions(config=7))
    with pytest.raises(TypeError, match="options must be a GemmArOptions"):
        call(ctx, a, b, o, options=dict(path="latency"))
    with pytest.raises(ValueError, match="unit stride along its last axis"):
        call(ctx, arr((M, K), strides=(2 * K, 2)), b, o)
    with pytest.raises(ValueError, match="unit column stride"):
        call(ctx, a, b, arr((M, N), strides=(2 * N, 2)))
    with pytest.raises(ValueError, match="is on cuda:1"):
        call(ctx, a, arr((K, N), device=1), o)
    ctx.num_nodes = 2
    with pytest.raises(ValueError, match="one node"):
        call(ctx, a, b, o)
    ctx.num_nodes = 1
    with pytest.raises(ValueError, match="not possible"):  # (raised by the planner, before any agreement)
        call(ctx, a, b, o, options=GemmArOptions(path="latency", config=2))
    assert log == [] and ctx.agreed == [] and ctx.workspaces == []


def test_ranks_disagreeing_raise_naming_them(env):
    ctx, log = env
    ctx.peer_sig = ("another call",)
    with pytest.raises(ValueError, match=r"local ranks \[1\] have"):
        call(ctx, arr((8, 512)), arr((512, 384)))
    assert launches(log) == [] and ctx.agreed == []


def test_latency_plain_call_and_repointing(env):
    """A decode call with B "kn": one exchange, one agreement, one cooperative launch of the one-shot kernel
    on plain tiles (maps over a and b, out's TMA-store map); new arrays of the same layout re-point it."""
    ctx, log = env
    M, K, N = 8, 4096, 8192
    a, b, o = arr((M, K)), arr((K, N)), arr((M, N))
    assert call(ctx, a, b, o) is o
    p = ctx.last_plan("gemm_ar")
    assert p.path == "latency" and not p.transposed and p.config == 53 and p.digest == 0x7001
    (prep,) = prepared(log)
    assert prep["cooperative"] and prep["grid"] == p.grid == 128 and prep["prepared"] == "mk_gemm_ar_kn:latency:53"
    tma_a, tma_b, tma_c = prep["maps"]
    assert tma_a == ("bfloat16", (K, M), (2 * K,), (64, 64)) and tma_b == ("bfloat16", (N, K, 1), (2 * N, 2 * N * K),
                                                                           (64, 64, 1))
    assert tma_c is None  # (config 53 has no TMA-store staging: register stores)
    ma, mb, mc, comm, args = launches(log)[-1]["values"]
    assert (ma, mb) == (a.ptr, b.ptr) and comm == dict(sig=0x7001)
    assert args["M"] == M and args["N"] == N and args["K"] == K and args["P"] == 2 and args["me"] == 0
    assert args["c"] == o.ptr and args["c_tma"] == 0 and args["ldc"] == N and args["group_m"] == 8
    assert (args["flags_off"], args["data_off"], args["slot_bytes"]) == (p.ws.flags_off, p.ws.data_off,
                                                                        p.ws.slot_bytes)
    assert ctx.workspaces == [(("gemm_ar",), p.ws.total)] and args["ws"] == (1 << 40)
    a2, b2, o2 = arr((M, K)), arr((K, N)), arr((M, N))
    call(ctx, a2, b2, o2)
    assert len(prepared(log)) == 1 and len(ctx.agreed) == 1 and len(ctx.exchanges) == 1
    ma, mb, mc, _, args = launches(log)[-1]["values"]
    assert (ma, mb, args["c"]) == (a2.ptr, b2.ptr, o2.ptr)
    r1, r2 = call(ctx, a, b), call(ctx, a, b)  # out=None: a fresh output each call, same bound launch
    assert r1.shape == (M, N) and r1.ptr != r2.ptr and launches(log)[-1]["values"][4]["c"] == r2.ptr
    ctx.workspace_generation = 1  # a workspace grew: the bound launch takes the op's workspace anew
    call(ctx, a, b, o)
    assert launches(log)[-1]["values"][4]["ws"] == (1 << 40) + (1 << 36) and len(prepared(log)) == 1
    call(ctx, a, b, o, stream=5)  # anything else of the key binds anew
    call(ctx, a, b, o, options=GemmArOptions(config=1))
    assert len(prepared(log)) == 3 and ctx.last_plan("gemm_ar").config == 1
    assert prepared(log)[-1]["maps"][2] == ("bfloat16", (N, M), (2 * N,), (64, 64))  # config 1: TMA stores
    assert launches(log)[-1]["values"][2] == o.ptr and launches(log)[-1]["values"][4]["c_tma"] == 1


def test_latency_transposed_maps(env):
    """B "nk" decode call: the kernel computes C^T = B A^T -- tmA maps B [N, K] (64-row boxes), tmB maps A
    [M, K] as an "nk" operand (16-row boxes of config 53), no TMA store (transposed register stores); the
    kernel's rows are N and its columns M."""
    ctx, log = env
    M, K, N = 3, 2048, 8192
    a, b, o = arr((M, K)), arr((N, K)), arr((M, N), "float32")
    call(ctx, a, b, o, b_layout="nk")
    p = ctx.last_plan("gemm_ar")
    assert p.path == "latency" and p.transposed and p.config == 53 and p.units == N // 64
    (prep,) = prepared(log)
    assert prep["prepared"] == "mk_gemm_ar_nk:latency:53:T"
    tma_a, tma_b, tma_c = prep["maps"]
    assert tma_a == ("bfloat16", (K, N), (2 * K,), (64, 64)) and tma_b == ("bfloat16", (K, M, 1), (2 * K, 2 * K * M),
                                                                           (64, 16, 1))
    assert tma_c is None
    ma, mb, mc, _, args = launches(log)[-1]["values"]
    assert (ma, mb) == (b.ptr, a.ptr) and args["c_tma"] == 0 and args["M"] == N and args["N"] == M
    assert args["c"] == o.ptr and args["ldc"] == N


def test_bandwidth_call(env):
    ctx, log = env
    ctx.local_size = ctx.size = 4
    M, K, N = 8000, 2048, 8192
    a, b, o = arr((M, K)), arr((N, K)), arr((M, N))
    call(ctx, a, b, o, b_layout="nk")
    p = ctx.last_plan("gemm_ar")
    assert p.path == "bandwidth" and sum(p.m_sizes) == M and len(p.m_sizes) == 4
    (prep,) = prepared(log)
    assert prep["prepared"] == f"mk_gemm_ar_nk:bandwidth:{p.config}" and prep["grid"] == min(132, p.units)
    *_, args = launches(log)[-1]["values"]
    assert args["offs"] == list(row_offsets(p.m_sizes)) and args["c_tma"] == 1 and args["N"] == N
    assert (args["gflags_off"], args["gdata_off"], args["gslot_bytes"]) == (p.ws.gflags_off, p.ws.gdata_off,
                                                                           p.ws.gslot_bytes)
    assert args["gdata_off"] > args["data_off"] > args["gflags_off"] > args["flags_off"]


def test_exchanged_k_feeds_the_plan_and_the_agreement(env):
    ctx, log = env
    ctx.ks = [4096, 2048]
    call(ctx, arr((2048, 4096)), arr((4096, 4096)), arr((2048, 4096)))
    p = ctx.last_plan("gemm_ar")
    assert p.Ks == (4096, 2048)
    sig = ctx.agreed[0][1]
    assert sig[1:] == ((4096, 2048), p.path, p.config, p.transposed, p.partial_dtype)
    assert launches(log)[-1]["values"][4]["K"] == 4096  # this rank's own K_r
    call(ctx, arr((2048, 4096)), arr((4096, 4096)), arr((2048, 4096)))
    assert len(ctx.exchanges) == 1 and len(ctx.agreed) == 1


def test_misaligned_operands_are_staged_each_call(env):
    """An operand TMA cannot address in place (rows 2040 bytes apart) is copied, each call, into a staging
    buffer of 16-byte rows that its map covers."""
    ctx, log = env
    M, K, N = 16, 1020, 2048
    a, b = arr((M, K)), arr((N, K))
    call(ctx, a, b, arr((M, N)), b_layout="nk")
    p = ctx.last_plan("gemm_ar")
    assert p.path == "latency" and p.transposed
    copies = [e["copy_2d"] for e in log if "copy_2d" in e]
    assert {(c[2], c[3], c[4], c[5], c[1]) for c in copies} == {(a.ptr, 2 * K, 2 * K, M, 2048),
                                                                (b.ptr, 2 * K, 2 * K, N, 2048)}
    ma, mb = launches(log)[-1]["values"][:2]
    dst = {c[2]: c[0] for c in copies}
    assert (ma, mb) == (dst[b.ptr], dst[a.ptr])  # (transposed: b is the kernel's A)


def test_output_without_tma(env):
    ctx, log = env
    N = 1000
    o = arr((4096, N), strides=(N + 4, 1))  # 2008-byte rows
    call(ctx, arr((4096, 2048)), arr((2048, N)), o, options=GemmArOptions(path="bandwidth"))
    args = launches(log)[-1]["values"][4]
    assert args["c_tma"] == 0 and args["ldc"] == N + 4 and args["c_vec_ok"] == 1


def test_unfused_path(env):
    """A dense out: mkernel.gemm into out, then mkernel.all_reduce of out in place; a strided out: both on a
    dense buffer, then copied into out."""
    ctx, log = env
    M, K, N = 1024, 512, 768
    a, b, o = arr((M, K)), arr((K, N)), arr((M, N), "float32")
    call(ctx, a, b, o, options=GemmArOptions(path="unfused"), stream=9)
    p = ctx.last_plan("gemm_ar")
    assert p.path == "unfused" and p.partial_dtype == "float32"
    assert [e["gemm"] for e in log if "gemm" in e] == [(a.ptr, (M, K), b.ptr, o.ptr, (M, N), "kn", 9)]
    assert [e["ar"] for e in log if "ar" in e] == [(o.ptr, (M, N), o.ptr, (M, N), 9)]
    assert launches(log) == [] and not any("copy_2d" in e for e in log)
    log.clear()
    o2 = arr((M, N), strides=(N + 8, 1))
    call(ctx, a, b, o2, options=GemmArOptions(path="unfused"))
    (g,) = [e["gemm"] for e in log if "gemm" in e]
    (r,) = [e["ar"] for e in log if "ar" in e]
    (c,) = [e["copy_2d"] for e in log if "copy_2d" in e]
    assert g[3] == r[0] == r[2] != o2.ptr and c[:6] == (o2.ptr, 2 * (N + 8), g[3], 2 * N, 2 * N, M)


def test_one_rank_is_the_gemm(env):
    ctx, log = env
    ctx.local_size = ctx.size = 1
    a, b, o = arr((100, 64)), arr((64, 48)), arr((100, 48))
    call(ctx, a, b, o)
    assert ctx.last_plan("gemm_ar").path == "gemm" and ctx.exchanges == []
    assert [e["gemm"][:4] for e in log if "gemm" in e] == [(a.ptr, (100, 64), b.ptr, o.ptr)]


def test_empty_and_zero_k(env):
    ctx, log = env
    call(ctx, arr((0, 64)), arr((64, 48)), arr((0, 48)))
    assert ctx.last_plan("gemm_ar").path == "empty" and log == []
    call(ctx, arr((32, 0)), arr((0, 48)), arr((32, 48)))  # K_r = 0: a zero fill by mkernel.gemm, then the sum
    p = ctx.last_plan("gemm_ar")
    assert p.path == "unfused" and "K_r = 0" in p.reason
    assert len([e for e in log if "gemm" in e]) == 1 and len([e for e in log if "ar" in e]) == 1


def test_deterministic_is_part_of_the_call(env):
    ctx, log = env
    a, b, o = arr((8, 256)), arr((256, 256)), arr((8, 256))
    call(ctx, a, b, o)
    call(ctx, a, b, o, deterministic=True)
    assert ctx.last_plan("gemm_ar").deterministic is True
    assert ctx.agreed[0][1][0] != ctx.agreed[1][1][0]  # another agreed signature


def test_specialization_of_each_plan_is_registered_or_compiles_lazily():
    """The kernel a plan asks for: its defines carry the path and orientation (a transposed plan's module has
    the "nk" entry only)."""
    d = LY.kernel_defines("bfloat16", "bfloat16", 54, "latency", None, True)
    assert d["MK_GEMM_SWAP"] == 1 and d["MK_AR_PATH"] == 0 and d["MK_GEMM_CONFIG"] == 54


def test_deterministic_plain_gemm(env):
    """deterministic=True reaches the plain GEMM of the one-rank and unfused paths (no split-K there)."""
    ctx, log = env
    ctx.local_size = ctx.size = 1
    a, b, o = arr((100, 64)), arr((64, 48)), arr((100, 48))
    call(ctx, a, b, o, deterministic=True)
    call(ctx, a, b, o)
    opts = [e.get("options") for e in log if "gemm" in e]
    assert len(opts) == 2 and opts[0].deterministic and opts[1] is None
