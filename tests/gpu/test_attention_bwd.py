"""mkernel.attention_backward on one GPU against a float64 numpy reference of the gradients.

The forward (O and LSE) is computed here in float64 and fed rounded to the dtype (O) and to float32 (LSE),
so these tests do not depend on the forward kernel.  Fresh random data per test (seed printed), outputs
NaN-poisoned beforehand, sequence lengths that are not multiples of the tiles (1, 77, 1000, 2049), head dim
64 / 128, GQA group sizes 1 / 4 / 8, causal with S_q == S_k and S_q != S_k (bottom-right aligned, incl.
fully masked rows), both layouts, the deterministic mode (bit-identical over 20 runs), CUDA-graph replay;
the correctness cases for both main kernels (AttentionBwdOptions.kernel "mma" and "wgmma").

Tolerance: relative Frobenius error of each gradient <= 2e-2 (bf16) / 4e-3 (fp16), and the largest
elementwise error <= 8x that times the largest |reference| element.  P and dS are rounded to the dtype
before their GEMMs (as in every flash-attention backward): errors of a few 2^-8 (bf16) or 2^-11 (fp16)
relative per product; a masking or indexing bug gives errors of order 1.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from mkernel.core.arrays import DeviceArray
from mkernel.core.compiler import precompile_source
from mkernel.ops.attention.reference import attention_reference
from mkernel.ops.attention_bwd import AttentionBwdOptions, attention_backward, last_plan
from mkernel.ops.attention_bwd import kernels as K

from _util import download, poisoned, seeded_rng, upload

pytestmark = pytest.mark.gpu

SEED = int(np.random.SeedSequence().entropy % (1 << 32))
TOL = {"bfloat16": 2e-2, "float16": 4e-3}


@pytest.fixture(scope="module", autouse=True)
def compiled():
    precompile_source(K.SOURCE)  # every registered specialization, in parallel, into the disk cache


@pytest.fixture
def rng(request):
    return seeded_rng(request, SEED)


def _to_layout(x: np.ndarray, layout: str) -> np.ndarray:
    """[B, S, H, D] -> the layout's order."""
    return x if layout == "bshd" else np.ascontiguousarray(x.transpose(0, 2, 1, 3))


class Problem:
    """Random inputs on the device in ``layout`` with their float64 values and the reference gradients."""

    def __init__(self, rng, dtype, D, B, Sq, Sk, Hq, Hkv, causal, layout, scale=None):
        self.dtype, self.layout, self.causal = dtype, layout, causal
        self.scale = 1.0 / math.sqrt(D) if scale is None else scale
        self.dev, vals = {}, {}
        for n, (S, H) in (("q", (Sq, Hq)), ("k", (Sk, Hkv)), ("v", (Sk, Hkv)), ("do", (Sq, Hq))):
            arr, exact = upload(_to_layout(rng.standard_normal((B, S, H, D)), layout), dtype)
            self.dev[n], vals[n] = arr, (exact if layout == "bshd" else exact.transpose(0, 2, 1, 3))
        out, lse, self.dq, self.dk, self.dv = attention_reference(vals["q"], vals["k"], vals["v"], causal,
                                                                   self.scale, vals["do"])
        self.dev["out"], _ = upload(_to_layout(out, layout), dtype)
        self.dev["lse"] = DeviceArray.from_numpy(lse.astype(np.float32))
        self.shapes = {"dq": self.dev["q"].shape, "dk": self.dev["k"].shape, "dv": self.dev["v"].shape}

    def run(self, stream=None, **kw):
        outs = {n: poisoned(s, self.dtype) for n, s in self.shapes.items()}
        d = self.dev
        got = attention_backward(d["q"], d["k"], d["v"], d["out"], d["lse"], d["do"], outs["dq"], outs["dk"],
                                 outs["dv"], causal=self.causal, softmax_scale=self.scale, layout=self.layout,
                                 stream=stream, **kw)
        assert got[0] is outs["dq"] and got[1] is outs["dk"] and got[2] is outs["dv"]
        return outs

    def check(self, outs, what=""):
        for n, ref in (("dq", self.dq), ("dk", self.dk), ("dv", self.dv)):
            g = download(outs[n])
            if self.layout == "bhsd":
                g = g.transpose(0, 2, 1, 3)
            assert not np.isnan(g).any(), f"{what} {n}: NaN (unwritten) at {np.argwhere(np.isnan(g))[:4].tolist()}"
            scale_ref = max(np.linalg.norm(ref), 1e-30)
            err = np.linalg.norm(g - ref) / scale_ref
            tol = TOL[self.dtype]
            if not np.any(ref):
                # (e.g. one key: dS = P (dP - D) is 0 in exact arithmetic, but dP = dO.V and D = dO.O are fp32
                # sums in different orders, so a rounding-sized residue is right; bound it by the gradients' scale)
                big = max(np.abs(self.dv).max(), np.abs(self.dk).max(), np.abs(self.dq).max(), 1.0)
                assert np.abs(g).max() <= 1e-2 * tol * big, \
                    f"{what} {n}: reference is 0, got max |{n}| = {np.abs(g).max()} > {1e-2 * tol * big}"
                continue
            assert err <= tol, f"{what} {n}: relative Frobenius error {err:.3e} > {tol}"
            worst = np.abs(g - ref).max() / np.abs(ref).max()
            assert worst <= 8 * tol, f"{what} {n}: max error {worst:.3e} of max |ref| > {8 * tol}"


CASES = [  # dtype, D, B, Sq, Sk, Hq, Hkv, causal, layout, block_q
    ("bfloat16", 64, 2, 77, 77, 4, 1, False, "bshd", None),
    ("bfloat16", 128, 1, 1000, 1000, 8, 2, True, "bshd", None),
    ("float16", 64, 1, 2049, 2049, 2, 2, True, "bhsd", None),
    ("float16", 128, 2, 1, 1, 8, 1, False, "bshd", None),
    ("bfloat16", 64, 1, 77, 1000, 8, 1, True, "bhsd", None),
    ("bfloat16", 128, 1, 1000, 77, 4, 4, True, "bshd", None),      # rows i < 923 see no key
    ("float16", 128, 1, 2049, 1000, 2, 1, False, "bhsd", 64),
    ("bfloat16", 64, 2, 1, 77, 4, 2, True, "bshd", 32),
    ("bfloat16", 128, 1, 1000, 2049, 8, 8, False, "bhsd", None),
    ("float16", 64, 1, 1000, 1000, 8, 2, False, "bshd", 32),
]


KERNELS = ("mma", "wgmma")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", CASES, ids=[
    f"{c[0][:4]}-d{c[1]}-b{c[2]}-q{c[3]}-k{c[4]}-h{c[5]}x{c[6]}-{'causal' if c[7] else 'full'}-{c[8]}"
    f"{'-bq%d' % c[9] if c[9] else ''}" for c in CASES])
def test_gradients(rng, case, kernel):
    dtype, D, B, Sq, Sk, Hq, Hkv, causal, layout, bq = case
    p = Problem(rng, dtype, D, B, Sq, Sk, Hq, Hkv, causal, layout)
    for det in (False, True):
        outs = p.run(options=AttentionBwdOptions(deterministic=det, block_q=bq if kernel == "mma" else None,
                                                 kernel=kernel))
        p.check(outs, f"kernel={kernel} deterministic={det}")
        assert last_plan().deterministic is det
        assert (K.WGMMA_KERNEL in last_plan().kernels) is (kernel == "wgmma" and Sk > 0)


def test_wgmma_new_arrays_same_layout(rng):
    """A second call of the same layout re-points the bound tensor maps at the new arrays."""
    for rep in range(2):
        p = Problem(rng, "bfloat16", 128, 2, 300, 517, 8, 2, True, "bshd")
        p.check(p.run(options=AttentionBwdOptions(kernel="wgmma")), f"wgmma call {rep}")


def test_softmax_scale_and_allocated_outputs(rng):
    p = Problem(rng, "bfloat16", 64, 1, 300, 300, 4, 2, True, "bshd", scale=0.3)
    d = p.dev
    dq, dk, dv = attention_backward(d["q"], d["k"], d["v"], d["out"], d["lse"], d["do"], causal=True,
                                    softmax_scale=0.3)
    assert dq.shape == d["q"].shape and dk.shape == d["k"].shape
    p.check({"dq": dq, "dk": dk, "dv": dv}, "allocated outputs")


@pytest.mark.parametrize("kernel", KERNELS)
def test_strided_views(rng, kernel):
    """Inputs and outputs as views into larger buffers (padded heads): strides pass through, nothing is
    written outside the views."""
    B, S, H, D = 1, 333, 4, 64
    p = Problem(rng, "bfloat16", D, B, S, S, H, H, False, "bshd")
    bufs, views = {}, {}
    for n, shape in p.shapes.items():
        full = poisoned((B, S, H + 2, D), "bfloat16")
        bufs[n] = full
        views[n] = DeviceArray(full.ptr, shape, "bfloat16", full.strides, full.device, full)
    d = p.dev
    ins = {}
    for n in ("q", "k", "v", "out", "do"):  # inputs as views too (TMA reads them with their strides)
        full_h = np.full((B, S, H + 2, D), np.nan)  # heads 0 and H + 1: NaN padding a wrong stride would read
        full_h[:, :, 1:H + 1] = download(d[n])
        full, _ = upload(full_h, "bfloat16")
        ins[n] = DeviceArray(full.ptr + D * 2, d[n].shape, "bfloat16", full.strides, full.device, full)
    attention_backward(ins["q"], ins["k"], ins["v"], ins["out"], d["lse"], ins["do"], views["dq"], views["dk"],
                       views["dv"], options=AttentionBwdOptions(kernel=kernel))
    p.check(views, f"strided outputs, kernel={kernel}")
    for n in bufs:
        h = download(bufs[n])
        assert np.isnan(h[:, :, H:]).all(), f"{n}: written outside its view"


def test_deterministic_bit_identical(rng):
    p = Problem(rng, "bfloat16", 128, 1, 1000, 1000, 8, 2, True, "bshd")
    first = None
    for rep in range(20):
        outs = p.run(deterministic=True)
        host = {n: outs[n].to_numpy() for n in outs}
        if first is None:
            p.check(outs, "deterministic")
            first = host
        for n in host:
            assert np.array_equal(host[n], first[n]), f"deterministic {n} differs on run {rep}"


@pytest.mark.parametrize("kernel", KERNELS)
def test_graph_replay(rng, kernel):
    """Both modes captured into a CUDA graph, replayed with new data each time."""
    from cuda.bindings import driver as cu

    from mkernel.core.driver import check as ok

    for det in (False, True):
        p = Problem(rng, "float16", 64, 2, 200, 333, 4, 1, True, "bhsd")
        stream = ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
        opts = AttentionBwdOptions(deterministic=det, kernel=kernel)
        outs = p.run(stream=int(stream), options=opts)  # bind outside the capture
        ok(cu.cuStreamSynchronize(stream))
        ok(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        d = p.dev
        attention_backward(d["q"], d["k"], d["v"], d["out"], d["lse"], d["do"], outs["dq"], outs["dk"],
                           outs["dv"], causal=True, layout="bhsd", options=opts, stream=int(stream))
        graph = ok(cu.cuStreamEndCapture(stream))
        gexec = ok(cu.cuGraphInstantiate(graph, 0))
        for rep in range(3):
            q2 = Problem(rng, "float16", 64, 2, 200, 333, 4, 1, True, "bhsd")
            for n in ("q", "k", "v", "out", "lse", "do"):
                d[n].copy_from(q2.dev[n], stream=int(stream))
            for o in outs.values():
                o.fill_nan(stream=int(stream))
            ok(cu.cuGraphLaunch(gexec, stream))
            ok(cu.cuStreamSynchronize(stream))
            q2.check(outs, f"graph replay {rep} deterministic={det}")
        ok(cu.cuGraphExecDestroy(gexec))
        ok(cu.cuGraphDestroy(graph))
        ok(cu.cuStreamDestroy(stream))
