"""The ring backward's per-step main kernel on the CPU (docs/ring_attention.md, "Backward"): which kernel a
call runs (``common.backward_kernel``: the wgmma one, the mma one where TMA cannot map the arrays or the
options ask for it) and what the plan reports; the launches of a one-node bound call in order on driver
fakes (tensor maps of each step's query window and key rows, re-pointed per call); and a float64 emulation
of both kernels' index math -- grid, query blocks per KV block, causal start and mask, TMA windows (rows past
a map's extent read as zeros), Dsum / dQ at acc_pitch, the partial epilogue -- run from the arguments and
tensor maps the host passes at every step, which gives the full-attention gradients for P = 1..4 (causal
zigzag and not, both layouts, strided q / dout) and covers the same (query row, key row) pairs with either
kernel at every step."""
from __future__ import annotations

import contextlib
import itertools
import math
import struct
from dataclasses import replace

import numpy as np
import pytest

import mkernel
from mkernel.core import tensormap as TM
from mkernel.core.arrays import DeviceArray
from mkernel.ops.attention_bwd import kernels as BK
from mkernel.ops.ring_attention import RingAttentionOptions, make_plan, zigzag_indices
from mkernel.ops.ring_attention import backward as RB
from mkernel.ops.ring_attention import common as RC
from mkernel.ops.ring_attention.plan import partial_rows, partial_step

from test_ring_attention_host import _Ctx, _FakeWs, _arr, _bwd_args, _fake_driver

# ------------------------------------------------------------------ fakes: tensor maps and kernels
_MAP = struct.Struct("<Q4Q3Q4I")  # ptr, dims {D, S, H, B}, byte strides (S, H, B), box


def _fake_encode(ptr, dtype, dims, strides, box, **kw):
    assert dtype in ("bfloat16", "float16") and kw.get("swizzle", 128) == 128
    raw = _MAP.pack(int(ptr), *dims, *strides, *box)
    return raw + bytes(128 - len(raw))


def _decode(buf) -> dict:
    v = _MAP.unpack_from(bytes(buf.raw))
    return dict(ptr=v[0], dims=v[1:5], strides=v[5:8], box=v[8:12])


class _Launch:
    def __init__(self, log, name, defines, grid, block, args, smem):
        self.log, self.name, self.defines = log, name, defines
        self.grid, self.block, self.args, self.smem = grid, block, args, smem

    def __call__(self):
        """A snapshot of the arguments at launch time: structs copied, tensor maps decoded."""
        a = self.args[-1]
        grid = self.grid if isinstance(self.grid, int) else tuple(self.grid)
        snap = dict(name=self.name, defines=self.defines, grid=grid, block=self.block, smem=self.smem,
                    args=type(a).from_buffer_copy(a), maps=[_decode(m) for m in self.args[:-1]])
        self.log.append(snap)


@pytest.fixture
def fakes(monkeypatch):
    """Compiled kernels and tensor-map encoding faked: every launch is logged (a snapshot); returns the log."""
    log = []

    class Kernel:
        def __init__(self, defines, name):
            self.defines, self.name = dict(defines), name

        def prepare(self, grid, block, args, *, stream=None, smem=0, **kw):
            return _Launch(log, self.name, self.defines, grid, block, list(args), smem)

    monkeypatch.setattr(BK, "kernel", lambda src, defines, name: Kernel(defines, name))
    monkeypatch.setattr(TM, "encode_tiled", _fake_encode)
    monkeypatch.setattr(TM, "_codec", False)
    return log


class _Call:
    """What BackwardLaunches reads of a call."""

    def __init__(self, q, k, v, o, lse, do, dq, dk, dv, *, dims, layout, causal, scale=0.5, options=None):
        self.q, self.k, self.v, self.o, self.lse, self.do, self.dq, self.dk, self.dv = q, k, v, o, lse, do, dq, dk, dv
        self.dims, self.layout, self.causal, self.scale, self.stream = dims, layout, causal, scale, 5
        self.options = options or RingAttentionOptions()


# ------------------------------------------------------------------ which kernel
def _call(S=64, Hq=4, Hkv=2, D=128, q_strides=None, options=None, causal=True):
    q, k, v, o, lse, do = _bwd_args(S=S, Hq=Hq, Hkv=Hkv, D=D)
    if q_strides is not None:
        q = _arr(q.shape, strides=q_strides)
    dq, dk, dv = _arr(q.shape), _arr(k.shape), _arr(v.shape)
    return _Call(q, k, v, o, lse, do, dq, dk, dv, dims=(1, S, S, Hq, Hkv, D), layout="bshd", causal=causal,
                 options=options)


def test_backward_kernel_choice_and_plan():
    """wgmma by default; mma when asked, or (reported in the plan) when TMA cannot map an array: a zero stride
    (a broadcast head) is no TMA stride."""
    assert RC.backward_kernel(_call()) == ("wgmma", "")
    assert RC.backward_kernel(_call(options=RingAttentionOptions(backward_kernel="mma"))) == ("mma", "")
    kern, why = RC.backward_kernel(_call(q_strides=(64 * 128, 128, 0, 1)))  # (every head reads one row)
    assert kern == "mma" and "TMA cannot map q" in why
    ctx = _Ctx()
    plan = RB._RING_BWD.plan(ctx, _call(q_strides=(64 * 128, 128, 0, 1)), 0)
    assert plan.backward_kernel == "mma" and "TMA cannot map q" in plan.backward_fallback
    plan = RB._RING_BWD.plan(ctx, _call(), 0)
    assert (plan.backward_kernel, plan.backward_fallback, plan.P, plan.launches) == (
        "wgmma", "", 2, make_plan(0, 2, 64, True).launches)
    with pytest.raises(ValueError, match="backward_kernel"):
        RingAttentionOptions(backward_kernel="tma").checked()


def test_forced_wgmma_on_untileable_arrays_raises_before_launch(monkeypatch):
    monkeypatch.setattr(RB, "require_gemm_device", lambda what, device: None)
    monkeypatch.setattr(RB._RingAttentionBwd, "compile", lambda self, ctx, call: pytest.fail("compiled bad input"))
    monkeypatch.setattr(DeviceArray, "empty", staticmethod(lambda shape, dtype, device=None: _arr(shape, dtype)))
    q, k, v, o, lse, do = _bwd_args()
    qb = _arr(q.shape, strides=(64 * 128, 128, 0, 1))
    with pytest.raises(ValueError, match="backward_kernel='wgmma' needs TMA-readable arrays: TMA cannot map q"):
        mkernel.ring_attention_backward(_Ctx(), qb, k, v, o, lse, do,
                                        options=RingAttentionOptions(backward_kernel="wgmma"))


def test_compile_takes_the_chosen_main_kernel(monkeypatch):
    got = []
    monkeypatch.setattr(BK, "kernel", lambda src, defines, name: got.append((dict(defines), name)))
    monkeypatch.setattr(RB, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(RB, "control", lambda name: None)  # (the control kernels: with peers)
    for opts, main in ((None, (BK.wgmma_partial_defines("bfloat16", 128), BK.WGMMA_KERNEL)),
                       (RingAttentionOptions(backward_kernel="mma"), (BK.partial_defines("bfloat16", 128),
                                                                      "mk_attn_bwd_main"))):
        got.clear()
        RB._RING_BWD.compile(_Ctx(), _call(options=opts))
        assert main in got and (BK.partial_defines("bfloat16", 128), "mk_attn_bwd_part_sum") in got
        assert len(got) == 4  # pre, convert, the main kernel, the partial sum


# ------------------------------------------------------------------ one-node bound call on driver fakes
class _WsCtx(_Ctx):
    local_rank, local_size = 1, 2

    def workspace(self, key, nbytes, stream, what):
        return _FakeWs()

    def side_stream(self):
        return 77

    def comm_args(self, op, digest):
        return ("comm", op, digest)


def _bound(monkeypatch, fakes, causal, layout="bshd", options=None):
    """A _RingBwdBound of local rank 1 of 2 on fakes: control kernels, copies and events logged as
    test_ring_attention_host's fakes do, compute launches as snapshots (``fakes``) in the same log."""
    log = fakes
    Kern, Cu, Ev, _ = _fake_driver(log)
    for mod in (RB, RC):
        monkeypatch.setattr(mod, "cu", Cu)
        monkeypatch.setattr(mod, "check", lambda r: r)
        monkeypatch.setattr(mod, "copy_async", lambda cps, s: log.append(("copy", tuple(cps))))
    monkeypatch.setattr(RB, "Events", Ev)
    monkeypatch.setattr(RC, "control", Kern)
    monkeypatch.setattr(DeviceArray, "empty", staticmethod(lambda shape, dtype, device=None: _arr(shape, dtype)))
    B, S, Hq, Hkv, D = 1, 64, 4, 2, 128
    shape = (lambda h: (B, S, h, D)) if layout == "bshd" else (lambda h: (B, h, S, D))
    q, k, v, o, do, dq, dk, dv = (_arr(shape(h)) for h in (Hq, Hkv, Hkv, Hq, Hq, Hq, Hkv, Hkv))
    c = _Call(q, k, v, o, _arr((B, Hq, S), "float32"), do, dq, dk, dv, dims=(B, S, S, Hq, Hkv, D), layout=layout,
              causal=causal, options=options)
    ctx = _WsCtx()
    plan = RB._RING_BWD.plan(ctx, c, 0)
    return RB._RingBwdBound(ctx, c, plan, 0), c


def _new_arrays(c) -> _Call:
    """Another call of the same layout (new addresses)."""
    n = [_arr(x.shape, x.dtype.name, x.strides) for x in (c.q, c.k, c.v, c.o, c.lse, c.do, c.dq, c.dk, c.dv)]
    return _Call(*n, dims=c.dims, layout=c.layout, causal=c.causal, options=c.options)


@pytest.mark.parametrize("causal,layout", [(False, "bshd"), (True, "bshd"), (True, "bhsd")])
def test_one_node_bound_launches_in_order(monkeypatch, fakes, causal, layout):
    """Rank 1 of 2: pre, step 0's wgmma launch on its own k, v (maps re-pointed per call), the pull of rank
    0's block, step 1's launch on receive buffer 1 (maps fixed), the partial sum, the conversion -- with the
    query window, key rows, pitch and partial buffer of each plan launch."""
    log = fakes
    bound, c = _bound(monkeypatch, fakes, causal, layout)
    B, S, _, Hq, Hkv, D = c.dims
    L = RB.backward_workspace_layout(2, 2 * c.k.nbytes, 2 * RC.BackwardLaunches.part_half(c))
    ws = _FakeWs()
    recv1 = ws.ptr + L.data_off + 2 * L.kv_stride
    part = [ws.ptr + L.part_off + s * L.part_stride for s in range(2)]
    for call in (c, _new_arrays(c)):
        log.clear()
        bound.run(5, call)
        names = [e["name"] if isinstance(e, dict) else e[0] for e in log]
        kern = [n for n in names if n.startswith("mk_attn")]
        assert kern == ["mk_attn_bwd_pre", BK.WGMMA_KERNEL, BK.WGMMA_KERNEL, "mk_attn_bwd_part_sum",
                        "mk_attn_bwd_convert"]
        # the pull of step 1 lands before step 1's launch, which runs after the wait for it
        i_pull = names.index("copy", names.index("mk_ring_wait"))
        i_main = [i for i, n in enumerate(names) if n == BK.WGMMA_KERNEL]
        assert i_main[0] < i_pull < names.index("wait", i_pull) < i_main[1]
        assert log[i_pull][1][0][0] == recv1
        s0, s1 = (log[i] for i in i_main)
        ss_q = (Hq * D if layout == "bshd" else D) * 2
        for snap, ln, kv in ((s0, bound.plan.launches[0], (call.k.ptr, call.v.ptr)),
                             (s1, bound.plan.launches[1], (recv1, recv1 + c.k.nbytes))):
            a, (mq, mk, mv, mg) = snap["args"], snap["maps"]
            assert snap["defines"] == BK.wgmma_partial_defines("bfloat16", D)
            assert snap["grid"] == (-(-ln.kv_rows // 128), Hkv, B) and snap["block"] == BK.WGMMA_THREADS
            assert snap["smem"] == BK.wgmma_smem(D)
            nq = ln.q1 - ln.q0
            assert (mq["ptr"], mg["ptr"]) == (call.q.ptr + ln.q0 * ss_q, call.do.ptr + ln.q0 * ss_q)
            assert mq["dims"] == mg["dims"] == (D, nq, Hq, B) and mq["box"] == (64, 64, 1, 1)
            assert (mk["ptr"], mv["ptr"]) == kv and mk["dims"] == mv["dims"] == (D, ln.kv_rows, Hkv, B)
            assert mk["box"] == (64, 128, 1, 1)
            assert (a.Sq, a.Sk, a.causal, a.acc_pitch) == (nq, ln.kv_rows, int(ln.causal), S)
            assert a.dsum == bound.compute.dsum.ptr + 4 * ln.q0 and a.dq_acc == bound.compute.acc.ptr + 4 * D * ln.q0
            assert a.lse == call.lse.ptr + 4 * ln.q0 and (a.part_k, a.part_v) == (
                part[ln.step], part[ln.step] + RC.BackwardLaunches.part_half(c))
        sa = log[names.index("mk_attn_bwd_part_sum")]["args"]
        # (rank 1 owns the top block: rank 0 sees all of it at its step 1, causal or not)
        assert (sa.dk, sa.dv, sa.P, tuple(sa.rows[:2])) == (call.dk.ptr, call.dv.ptr, 2, (S, S))


def test_one_node_bound_mma_fallback_launches(monkeypatch, fakes):
    log = fakes
    bound, c = _bound(monkeypatch, fakes, True, options=RingAttentionOptions(backward_kernel="mma"))
    bound.run(5, c)
    mains = [e for e in log if isinstance(e, dict) and e["name"] == "mk_attn_bwd_main"]
    assert len(mains) == 2 and not any(isinstance(e, dict) and e["name"] == BK.WGMMA_KERNEL for e in log)
    for snap, ln in zip(mains, bound.plan.launches):
        assert snap["defines"] == BK.partial_defines("bfloat16", 128) and snap["maps"] == []
        assert snap["grid"] == (-(-ln.kv_rows // 128), 2, 1) and snap["smem"] == BK.main_smem(128, 32)


# ------------------------------------------------------------------ float64 emulation of both kernels
class _Mem:
    """Fake device memory: regions of float64 values at byte addresses, each with its element size."""

    def __init__(self):
        self.next, self.regions = 1 << 32, {}

    def alloc(self, nelem: int, itemsize: int, fill=0.0) -> int:
        base = self.next
        self.next += -(-(nelem * itemsize) // (1 << 20)) * (1 << 20) + (1 << 20)
        self.regions[base] = (itemsize, np.full(max(nelem, 1), fill, np.float64))
        return base

    def _loc(self, addrs):
        addrs = np.asarray(addrs, np.int64)
        base = max(b for b in self.regions if b <= addrs.min())
        it, arr = self.regions[base]
        off = addrs - base
        assert (off % it == 0).all() and (off // it).max() < arr.size, "access outside its region"
        return arr, off // it

    def read(self, addrs):
        arr, i = self._loc(addrs)
        return arr[i]

    def write(self, addrs, vals):
        arr, i = self._loc(addrs)
        arr[i] = vals

    def add(self, addrs, vals):
        arr, i = self._loc(addrs)
        np.add.at(arr, i, vals)

    def array(self, x: DeviceArray, values):
        """Store ``values`` (x's shape) at x's address with x's strides."""
        nd = len(x.shape)
        off = sum(np.arange(n).reshape([-1 if i == d else 1 for i in range(nd)]) * s
                  for d, (n, s) in enumerate(zip(x.shape, x.strides)))
        self.write(x.ptr + off * x.dtype.itemsize, np.broadcast_to(values, x.shape))


class _Rows:
    """How a kernel reads the Q / dO / K / V rows of (head, batch): through its pointer and element strides
    (mma kernel: rows past ``valid`` read zeros) or a tensor map (wgmma: rows past the map's extent read
    zeros, TMA's out-of-bounds fill).  ``addr`` gives the row's byte address (the pair bookkeeping)."""

    def __init__(self, mem, D, *, ptr=None, strides=None, valid=None, tmap=None, box_rows=None):
        self.mem, self.D = mem, D
        if tmap is not None:
            assert tmap["box"] == (64, box_rows, 1, 1) and tmap["dims"][0] == D, tmap
            self.ptr, self.ss, self.sh, self.sb = tmap["ptr"], *tmap["strides"]
            self.valid = tmap["dims"][1]
            self.hb = tmap["dims"][2:]
        else:
            self.ptr, (self.sb, self.ss, self.sh), self.valid, self.hb = ptr, [2 * s for s in strides], valid, None

    def addr(self, r, h, b):
        return self.ptr + r * self.ss + h * self.sh + b * self.sb

    def load(self, rows, h, b):
        if self.hb is not None:
            assert h < self.hb[0] and b < self.hb[1]
        out = np.zeros((len(rows), self.D))
        ok = (rows >= 0) & (rows < self.valid)
        if ok.any():
            a = self.addr(rows[ok], h, b)[:, None] + 2 * np.arange(self.D)[None, :]
            out[ok] = self.mem.read(a)
        return out


def _emulate_main(mem, snap, D, pairs: list):
    """One launch of mk_attn_bwd_main (MKATT_PARTIAL) or mk_attn_bwd_wgmma (MKATT_WGMMA, MKATT_PARTIAL) in
    float64, index math as in attention_bwd.cu: the block's KV rows, its query blocks (causal: from the first
    that sees key j0), the mask where a warp's (mma: 16 rows) or warpgroup's (wgmma: 64 rows) tile crosses the
    diagonal or S_k, dQ added at acc_pitch for rows < S_q, the partial rows < S_k.  Appends the (query row
    addresses, key row addresses) of the pairs with an unmasked P to ``pairs``."""
    a, wg = snap["args"], snap["name"] == BK.WGMMA_KERNEL
    BC, BR, SUB = (128, 64, 64) if wg else (16 * BK.WARPS, BK.DEFAULT_BLOCK_Q[D], 16)
    if wg:
        q, k, v, g = (_Rows(mem, D, tmap=m, box_rows=r) for m, r in zip(snap["maps"], (BR, BC, BC, BR)))
    else:
        q, g = (_Rows(mem, D, ptr=p, strides=s, valid=a.Sq) for p, s in ((a.q, a.q_s), (a.dout, a.do_s)))
        k, v = (_Rows(mem, D, ptr=p, strides=s, valid=a.Sk) for p, s in ((a.k, a.k_s), (a.v, a.v_s)))
    group, off, nqb = a.Hq // a.Hkv, a.Sk - a.Sq, -(-a.Sq // BR)
    pitch = a.acc_pitch
    assert snap["grid"] == (-(-a.Sk // BC), a.Hkv, a.B)
    for bx, hk, b in itertools.product(*(range(n) for n in snap["grid"])):
        j0 = bx * BC
        m_begin = 0
        if a.causal:
            first = j0 - off
            m_begin = 0 if first <= 0 else (nqb if first >= a.Sq else first // BR)
        per_head = nqb - m_begin
        jr = j0 + np.arange(BC)
        K, V = k.load(jr, hk, b), v.load(jr, hk, b)
        dk, dv = np.zeros((BC, D)), np.zeros((BC, D))
        for it in range(per_head * group):
            h, i0 = hk * group + it // per_head, (m_begin + it % per_head) * BR
            ir = i0 + np.arange(BR)
            Q, G = q.load(ir, h, b), g.load(ir, h, b)
            ok = ir < a.Sq
            lse = np.full(BR, np.inf)
            dsum = np.zeros(BR)
            lse[ok] = mem.read(a.lse + 4 * (b * a.lse_s[0] + h * a.lse_s[1] + ir[ok] * a.lse_s[2]))
            dsum[ok] = mem.read(a.dsum + 4 * ((b * a.Hq + h) * pitch + ir[ok]))
            x = K @ Q.T * a.scale - lse[None, :]
            masked = np.zeros((BC, BR), bool)
            for w in range(BC // SUB):  # the kernel masks only tiles that cross the diagonal or S_k
                jw = j0 + SUB * w
                edge = (j0 + BC > a.Sk) if not wg else (jw + SUB > a.Sk)
                if edge or (a.causal and jw + SUB - 1 > i0 + off):
                    jj = jr[SUB * w:SUB * (w + 1), None]
                    masked[SUB * w:SUB * (w + 1)] = (jj >= a.Sk) | (bool(a.causal) & (jj > ir[None, :] + off))
            p = np.where(masked, 0.0, np.exp(x))  # (lse +inf: rows past S_q read P = 0)
            ds = p * (V @ G.T - dsum[None, :])
            dv += p @ G
            dk += ds @ Q
            if a.dq_acc:
                dq = ds.T @ K
                rows = ir[ok]
                addr = a.dq_acc + 4 * (((b * a.Hq + h) * pitch + rows)[:, None] * D + np.arange(D)[None, :])
                mem.add(addr, dq[ok])
            jl, il = np.nonzero(~masked & ok[None, :])
            assert (jr[jl] < a.Sk).all()
            pairs.append((q.addr(ir[il], h, b), k.addr(jr[jl], hk, b)))
        rows = jr[jr < a.Sk]
        idx = (((rows * a.B + b) * a.Hkv + hk) * D)[:, None] + np.arange(D)[None, :]
        mem.write(a.part_k + 4 * idx, a.scale * dk[:len(rows)])
        mem.write(a.part_v + 4 * idx, dv[:len(rows)])


def _emulate_part_sum(mem, snap, D):
    """mk_attn_bwd_part_sum: source i's first rows[i] rows, summed in source order; returns (dk, dv) fp64
    ``[S, B, H_kv, D]``."""
    sa = snap["args"]
    n = sa.B * sa.Hkv * D
    dk, dv = np.zeros(sa.S * n), np.zeros(sa.S * n)
    for i in range(sa.P):
        r = sa.rows[i] * n
        dk[:r] += mem.read(sa.part_k[i] + 4 * np.arange(r))
        dv[:r] += mem.read(sa.part_v[i] + 4 * np.arange(r))
    return dk.reshape(sa.S, sa.B, sa.Hkv, D), dv.reshape(sa.S, sa.B, sa.Hkv, D)


def _full_grads(q, k, v, do, scale, causal):
    """float64 attention (B, S, H, D) with GQA: (o, lse [B, Hq, S], dsum [B, Hq, S], dq, dk, dv)."""
    B, S, Hq, D = q.shape
    group = Hq // k.shape[2]
    o, dq = np.zeros_like(q), np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    lse, dsum = np.zeros((B, Hq, S)), np.zeros((B, Hq, S))
    mask = np.tril(np.ones((S, S), bool)) if causal else np.ones((S, S), bool)
    for b, h in itertools.product(range(B), range(Hq)):
        hk = h // group
        s = np.where(mask, q[b, :, h] @ k[b, :, hk].T * scale, -np.inf)
        m = s.max(1, keepdims=True)
        lse[b, h] = np.log(np.exp(s - m).sum(1)) + m[:, 0]
        p = np.exp(s - lse[b, h][:, None])
        o[b, :, h] = p @ v[b, :, hk]
        dsum[b, h] = (do[b, :, h] * o[b, :, h]).sum(1)
        ds = p * (do[b, :, h] @ v[b, :, hk].T - dsum[b, h][:, None])
        dq[b, :, h] += scale * ds @ k[b, :, hk]
        dk[b, :, hk] += scale * ds.T @ q[b, :, h]
        dv[b, :, hk] += p.T @ do[b, :, h]
    return o, lse, dsum, dq, dk, dv


def _layout(x, layout):
    return x if layout == "bshd" else x.transpose(0, 2, 1, 3)


def _device(mem, values, layout, dtype="bfloat16", seq_pad=1):
    """``values`` (B, S, H, D) stored in ``layout`` (``seq_pad`` > 1: rows that far apart, a strided view)."""
    shape = _layout(values, layout).shape
    B, S, H, D = values.shape
    if layout == "bshd":
        strides = (S * seq_pad * H * D, seq_pad * H * D, D, 1)
    else:
        strides = (H * S * seq_pad * D, S * seq_pad * D, seq_pad * D, 1)
    x = DeviceArray(mem.alloc(B * S * seq_pad * H * D, 2), shape, dtype, strides, device=0)
    mem.array(x, _layout(values, layout))
    return x


class _EmuRank:
    """One rank's arrays in fake memory and its BackwardLaunches (recv / part / srcs addresses of the fake
    memory; the kernel of ``kernel``)."""

    def __init__(self, mem, r, P, g, rows, dims, layout, causal, scale, kernel, seq_pad):
        B, S, _, Hq, Hkv, D = dims
        self.rows = rows[r]
        sel = lambda x: x[:, self.rows]  # noqa: E731
        q, k, v, do = (_device(mem, sel(g[n]), layout, seq_pad=seq_pad if n in ("q", "do") else 1)
                       for n in ("q", "k", "v", "do"))
        o = _device(mem, sel(g["o"]), layout)
        lse = DeviceArray(mem.alloc(B * Hq * S, 4), (B, Hq, S), "float32", None, 0)
        mem.array(lse, g["lse"][:, :, self.rows])
        dq, dk, dv = (DeviceArray(mem.alloc(x.size, 2), x.shape, "bfloat16", None, 0) for x in (q, k, v))
        opts = RingAttentionOptions(backward_kernel=kernel)
        self.c = _Call(q, k, v, o, lse, do, dq, dk, dv, dims=dims, layout=layout, causal=causal, scale=scale,
                       options=opts)
        half = RC.BackwardLaunches.part_half(self.c)
        self.recv = [mem.alloc(2 * k.size, 2) for _ in range(2)]
        self.part = [mem.alloc(2 * half // 4, 4, np.nan) for _ in range(P)]  # (unwritten rows: NaN)
        assert RC.backward_kernel(self.c) == (kernel, "")
        self.plan = replace(make_plan(r, P, S, causal), backward_kernel=kernel)

    def bind(self, ranks, r, P, mem, g):
        """BackwardLaunches with the partial sources of this rank's block; Dsum and the accumulator as
        mk_attn_bwd_pre leaves them."""
        srcs = [ranks[i].part[partial_step(r, i, P)] for i in range(P)]
        rows = [partial_rows(r, i, P, self.c.dims[1], self.c.causal) for i in range(P)]
        self.compute = RC.BackwardLaunches(_Ctx(), self.c, self.plan, self.recv, self.part[:], srcs, rows)
        mem.write(self.compute.dsum.ptr + 4 * np.arange(self.compute.dsum.size),
                  g["dsum"][:, :, self.rows].reshape(-1))


@pytest.mark.parametrize("P,causal,layout,D,seq_pad", [
    (1, False, "bshd", 64, 1), (1, True, "bshd", 128, 1), (2, False, "bhsd", 64, 1), (2, True, "bshd", 64, 2),
    (3, True, "bhsd", 128, 1), (3, False, "bshd", 128, 2), (4, True, "bshd", 64, 1), (4, False, "bhsd", 64, 1)])
def test_emulated_kernels_give_full_gradients_over_the_same_pairs(monkeypatch, fakes, P, causal, layout, D, seq_pad):
    """Every rank's launches (as the host passes them, step by step: its own k, v at step 0, the source's
    block in the receive buffer after) through the float64 emulation of the wgmma and the mma kernel: dq
    (scale x accumulator), dk, dv (the fixed-order partial sums) equal the full-attention gradients, and at
    every step both kernels cover the same (query row, key row) pairs.  S_local = 140 (two KV blocks, the
    last partial; causal chunks of 70 rows), GQA 4 / 2, B = 2; seq_pad 2: q and dout strided views."""
    mem = _Mem()
    monkeypatch.setattr(DeviceArray, "empty", staticmethod(
        lambda shape, dtype, device=None: DeviceArray(mem.alloc(math.prod(shape), 4), shape, dtype, None, 0)))
    B, S_loc, Hq, Hkv, scale = 2, 140, 4, 2, 0.375  # (exact in the fp32 argument)
    S = S_loc * P
    rng = np.random.default_rng(P * 100 + causal * 10 + D)
    g = {n: rng.standard_normal((B, S, h, D)) for n, h in (("q", Hq), ("k", Hkv), ("v", Hkv), ("do", Hq))}
    g["o"], g["lse"], g["dsum"], *want = _full_grads(g["q"], g["k"], g["v"], g["do"], scale, causal)
    rows = [zigzag_indices(S, P, r) if causal else np.arange(r * S_loc, (r + 1) * S_loc) for r in range(P)]
    dims = (B, S_loc, S_loc, Hq, Hkv, D)
    pairs = {}
    for kernel in ("wgmma", "mma"):
        ranks = [_EmuRank(mem, r, P, g, rows, dims, layout, causal, scale, kernel, seq_pad) for r in range(P)]
        for r, rk in enumerate(ranks):
            rk.bind(ranks, r, P, mem, g)
        for r, rk in enumerate(ranks):
            for step in range(P):
                if step > 0:  # the pull: the source's k then v into receive buffer step % 2
                    src = ranks[(r - step) % P]
                    nb = rk.c.k.nbytes
                    for x, base in ((src.c.k, rk.recv[step % 2]), (src.c.v, rk.recv[step % 2] + nb)):
                        mem.write(base + 2 * np.arange(x.size), mem.read(x.ptr + 2 * np.arange(x.size)))
                fakes.clear()
                rk.compute.step(step, rk.c)
                name = BK.WGMMA_KERNEL if kernel == "wgmma" else "mk_attn_bwd_main"
                assert [s["name"] for s in fakes] == [name] * len(rk.compute.steps[step])
                got = []
                for snap in fakes:
                    _emulate_main(mem, snap, D, got)
                pairs.setdefault((r, step), []).append(_pair_ids(rk, step, got))
        for r, rk in enumerate(ranks):
            fakes.clear()
            rk.compute.finish()
            assert [s["name"] for s in fakes] == ["mk_attn_bwd_part_sum", "mk_attn_bwd_convert"]
            dk, dv = _emulate_part_sum(mem, fakes[0], D)
            acc = mem.read(rk.compute.acc.ptr + 4 * np.arange(rk.compute.acc.size)).reshape(B, Hq, S_loc, D)
            sel = rk.rows
            np.testing.assert_allclose(scale * acc.transpose(0, 2, 1, 3), want[0][:, sel], rtol=1e-9, atol=1e-11)
            np.testing.assert_allclose(dk.transpose(1, 0, 2, 3), want[1][:, sel], rtol=1e-9, atol=1e-11)
            np.testing.assert_allclose(dv.transpose(1, 0, 2, 3), want[2][:, sel], rtol=1e-9, atol=1e-11)
    for key, (wg, mma) in pairs.items():
        assert len(wg) and np.array_equal(wg, mma), f"rank, step {key}: the kernels cover different pairs"


def _pair_ids(rk, step, got) -> np.ndarray:
    """The (query row, key row) pairs ``got`` (row addresses of rank ``rk``'s q and of the step's K: its own k
    at step 0, the receive buffer after) as sorted ids over (b, h, local row) x (b, h_kv, local row); each
    pair once."""
    def locate(x: DeviceArray, addr):
        sb, ss, sh = RC.layout_strides(x, rk.c.layout)
        b, rem = np.divmod((addr - x.ptr) // 2, sb)
        if rk.c.layout == "bshd":
            s, h = rem // ss, rem % ss // sh
        else:
            h, s = rem // sh, rem % sh // ss
        return (b * x.shape[2 if rk.c.layout == "bshd" else 1] + h) * rk.c.dims[1] + s

    kx = rk.c.k if step == 0 else DeviceArray(rk.recv[step % 2], rk.c.k.shape, rk.c.k.dtype, rk.c.k.strides, 0)
    qa, ka = (np.concatenate(x) for x in zip(*got))
    ids = np.sort(locate(rk.c.q, qa) * kx.size + locate(kx, ka))
    assert (np.diff(ids) > 0).all(), "a pair computed twice"
    return ids
