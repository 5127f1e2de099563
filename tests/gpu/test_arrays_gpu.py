"""GPU tests of mkernel.arrays: allocation, host copies, poison, views, and zero-copy interop with
torch / CuPy / JAX when they are installed.  Skipped without a CUDA GPU.

Every round trip uses fresh random data (seed printed on failure) and lands in a NaN-poisoned
buffer first, so a copy that did nothing cannot pass.
"""
from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from mkernel.core import arrays as A

from mkernel.core import dtypes as DT
from mkernel.core.arrays import DeviceArray
from mkernel.core.interop import as_device_array
from mkernel.core.dtypes import bf16_to_f32, f32_to_bf16


def _gpu_count() -> int:
    try:
        from cuda.bindings import driver as cu

        err, = cu.cuInit(0)
        if err != cu.CUresult.CUDA_SUCCESS:
            return 0
        err, n = cu.cuDeviceGetCount()
        return n if err == cu.CUresult.CUDA_SUCCESS else 0
    except Exception:
        return 0


pytestmark = pytest.mark.gpu
if _gpu_count() == 0:
    pytest.skip("no CUDA GPU", allow_module_level=True)

from cuda.bindings import driver as cu  # noqa: E402

from mkernel.core.driver import check  # noqa: E402

from _util import poisoned  # noqa: E402

SEED = int(np.random.SeedSequence().entropy % (1 << 32))


@pytest.fixture
def rng(request):
    seed = (SEED + hash(request.node.name)) % (1 << 32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def host_data(dtype, shape, rng) -> np.ndarray:
    """Fresh random host data in the dtype's host storage (uint16 bits for bf16)."""
    d = DT.dtype_of(dtype)
    if d is DT.bfloat16:
        return f32_to_bf16(rng.standard_normal(shape).astype(np.float32) * 3)
    if d.is_float:
        return (rng.standard_normal(shape) * 3).astype(d.numpy_dtype)
    info = np.iinfo(d.numpy_dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=d.numpy_dtype, endpoint=True)


def bits(a: np.ndarray) -> np.ndarray:
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])


def assert_bits_equal(got: np.ndarray, want: np.ndarray):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.array_equal(bits(got), bits(want))


def sync():
    check(cu.cuCtxSynchronize())


# --------------------------------------------------------------------------------------------
# allocation, copies, poison
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1000,), (37, 129), (3, 5, 7)])
@pytest.mark.parametrize("dtype", DT.DTYPES, ids=lambda d: d.name)
def test_round_trip(dtype, shape, rng):
    h = host_data(dtype, shape, rng)
    a = DeviceArray.from_numpy(h, dtype=dtype)
    assert (a.shape, a.dtype, a.strides) == (shape, dtype, A.contiguous_strides(shape))
    assert_bits_equal(a.to_numpy(), h)
    out = poisoned(shape, dtype)
    out.copy_from(a)
    assert_bits_equal(out.to_numpy(), h)


@pytest.mark.parametrize("dtype", DT.DTYPES, ids=lambda d: d.name)
def test_fill_nan(dtype, rng):
    a = DeviceArray.from_numpy(host_data(dtype, (513,), rng), dtype=dtype)
    r = a.fill_nan().to_numpy()
    if dtype is DT.bfloat16:
        assert np.isnan(bf16_to_f32(r)).all()
    elif dtype.is_float:
        assert np.isnan(r).all()
    else:
        assert (r == {"int32": 0x7FFFFFFF, "int64": 0x7FFFFFFF7FFFFFFF}[dtype.name]).all()


def test_from_numpy_bf16_conversions(rng):
    f = rng.standard_normal((64, 33)).astype(np.float32)
    assert_bits_equal(DeviceArray.from_numpy(f, dtype="bf16").to_numpy(), f32_to_bf16(f))
    d = rng.standard_normal(100)
    assert_bits_equal(DeviceArray.from_numpy(d, dtype="bfloat16").to_numpy(), f32_to_bf16(d))
    assert_bits_equal(DeviceArray.from_numpy(d, dtype="float32").to_numpy(), d.astype(np.float32))


def test_from_numpy_ml_dtypes(rng):
    ml = pytest.importorskip("ml_dtypes")
    x = rng.standard_normal(77).astype(ml.bfloat16)
    a = DeviceArray.from_numpy(x)
    assert a.dtype is DT.bfloat16
    assert_bits_equal(a.to_numpy(), x.view(np.uint16))


def test_views_to_numpy(rng):
    h = host_data("float32", (9, 6), rng)
    a = DeviceArray.from_numpy(h)
    for key in (slice(2, 6), slice(None, None, 3), slice(7, 1, -2), 4, -1):
        v = a[key]
        assert_bits_equal(v.to_numpy(), np.ascontiguousarray(h[key]))
    assert_bits_equal(a.reshape(3, 18).to_numpy(), h.reshape(3, 18))
    assert_bits_equal(a.view("int32").to_numpy(), h.view(np.int32))
    out = poisoned((4, 6), "float32")
    out.copy_from(a[3:7])
    assert_bits_equal(out.to_numpy(), h[3:7])


def test_streams(rng):
    s = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    try:
        h = host_data("bf16", (4096, 4096), rng)  # 32 MiB: the copies take a while
        a = DeviceArray.from_numpy(h, dtype="bf16", stream=s)
        out = poisoned(h.shape, "bf16")
        sync()
        out.copy_from(a, stream=s)
        assert_bits_equal(out.to_numpy(stream=s), h)
        out.fill_nan(stream=int(s))
        assert np.isnan(bf16_to_f32(out.to_numpy(stream=int(s)))).all()
    finally:
        check(cu.cuStreamDestroy(s))


def test_device_and_pointer_attributes():
    a = DeviceArray.empty((256,), "int64", device=0)
    assert a.device == 0 and a.ptr % 256 == 0
    dev = check(cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, a.ptr))
    assert int(dev) == 0
    raw = as_device_array((a.ptr, (16, 16), "int64"))
    assert raw.device == 0 and raw.owner is None
    z = DeviceArray.empty((0, 8), "float32")
    assert z.nbytes == 0 and z.to_numpy().shape == (0, 8)


def test_memory_is_freed():
    free0, _ = check(cu.cuMemGetInfo())
    gib = 1 << 30
    for _ in range(160):  # 160 x 1 GiB: more than an H200 holds, so a leak fails
        a = DeviceArray.empty((gib // 4,), "int32")
        a.fill_nan()
        del a
    keep = [DeviceArray.empty((gib // 4,), "float32") for _ in range(4)]
    free1, _ = check(cu.cuMemGetInfo())
    assert free0 - free1 >= 4 * gib - (64 << 20)
    del keep
    gc.collect()
    free2, _ = check(cu.cuMemGetInfo())
    assert abs(free0 - free2) < (64 << 20)


def test_cai_import_of_real_pointer_finds_device(rng):
    h = host_data("float16", (10, 10), rng)
    a = DeviceArray.from_numpy(h)

    class Foreign:
        __cuda_array_interface__ = a[2:].__cuda_array_interface__

    b = as_device_array(Foreign())
    assert b.device == 0 and b.ptr == a.ptr + 2 * 10 * 2
    assert_bits_equal(b.to_numpy(), h[2:])


def test_dlpack_self_round_trip(rng):
    h = host_data("bf16", (12, 8), rng)
    a = DeviceArray.from_numpy(h, dtype="bf16")

    b = as_device_array(DLPackOnly(a[::2]))
    del a
    gc.collect()
    assert_bits_equal(b.to_numpy(), h[::2])


# --------------------------------------------------------------------------------------------
# torch
# --------------------------------------------------------------------------------------------
def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


TORCH_BITS = {2: "int16", 4: "int32", 8: "int64"}


def torch_bits(t) -> np.ndarray:
    import torch

    return t.contiguous().view(getattr(torch, TORCH_BITS[t.element_size()])).cpu().numpy().view(
        {2: np.uint16, 4: np.uint32, 8: np.uint64}[t.element_size()])


@pytest.mark.parametrize("dtype", DT.DTYPES, ids=lambda d: d.name)
def test_torch_from_dlpack(dtype, rng):
    torch = _torch()
    h = host_data(dtype, (33, 20), rng)
    a = DeviceArray.from_numpy(h, dtype=dtype)
    t = torch.from_dlpack(a)
    assert t.data_ptr() == a.ptr and tuple(t.shape) == (33, 20) and t.is_cuda
    assert t.dtype == getattr(torch, dtype.name)
    del a
    gc.collect()  # torch's tensor keeps the allocation alive
    torch.cuda.synchronize()
    assert np.array_equal(torch_bits(t), bits(h))
    src = DeviceArray.from_numpy(h, dtype=dtype)
    ts = torch.from_dlpack(src[1::3])
    assert ts.stride() == (60, 1) and not ts.is_contiguous()
    assert np.array_equal(torch_bits(ts), bits(np.ascontiguousarray(h[1::3])))


@pytest.mark.parametrize("dtype", DT.DTYPES, ids=lambda d: d.name)
def test_as_device_array_of_torch(dtype, rng):
    torch = _torch()
    h = host_data(dtype, (24, 16), rng)
    t = torch.from_numpy(h.view(np.int16) if dtype is DT.bfloat16 else h).cuda()
    if dtype is DT.bfloat16:
        t = t.view(torch.bfloat16)
    a = as_device_array(t, name="t")
    assert a.ptr == t.data_ptr() and a.dtype is dtype and a.shape == (24, 16) and a.is_contiguous()
    assert_bits_equal(a.to_numpy(), h)
    v = as_device_array(t[2:20:2, 3:11], name="v")  # non-contiguous view with an offset
    assert not v.is_contiguous() and v.strides == (32, 1) and v.shape == (9, 8)
    assert v.ptr == t[2:20:2, 3:11].data_ptr()
    assert_bits_equal(v.to_numpy(), np.ascontiguousarray(h[2:20:2, 3:11]))
    # lifetime: the DeviceArray keeps the tensor's memory alive
    del t
    gc.collect()
    torch.cuda.empty_cache()
    assert_bits_equal(v.to_numpy(), np.ascontiguousarray(h[2:20:2, 3:11]))


def test_torch_streams_and_writes(rng):
    torch = _torch()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
        a = as_device_array(t, stream=s.cuda_stream)
        out = torch.empty_like(t).fill_(float("nan"))
        as_device_array(out, stream=s.cuda_stream).copy_from(a, stream=s.cuda_stream)
    s.synchronize()
    assert torch.equal(out, t)


def test_torch_cpu_tensor_rejected():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="x is a host array"):
        as_device_array(torch.ones(3), name="x")


# --------------------------------------------------------------------------------------------
# CuPy
# --------------------------------------------------------------------------------------------
class DLPackOnly:
    def __init__(self, x):
        self.x = x

    def __dlpack__(self, **kw):
        return self.x.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.x.__dlpack_device__()


@pytest.mark.parametrize("dtype", [DT.float16, DT.float32, DT.int32, DT.int64], ids=lambda d: d.name)
def test_cupy(dtype, rng):
    cp = pytest.importorskip("cupy")
    h = host_data(dtype, (40, 24), rng)
    x = cp.asarray(h)
    for obj in (x, DLPackOnly(x)):  # CAI, then DLPack
        a = as_device_array(obj)
        assert a.ptr == x.data.ptr and a.dtype is dtype and a.shape == (40, 24)
        assert_bits_equal(a.to_numpy(), h)
        v = as_device_array(x[:, 4:20:2] if obj is x else DLPackOnly(x[:, 4:20:2]))
        assert v.strides == (24, 2) and not v.is_contiguous()
        assert_bits_equal(v.to_numpy(), np.ascontiguousarray(h[:, 4:20:2]))
    d = DeviceArray.from_numpy(h)
    y = cp.asarray(d)  # CAI
    assert y.data.ptr == d.ptr and np.array_equal(cp.asnumpy(y), h)
    z = cp.from_dlpack(d[5:])  # DLPack
    assert z.data.ptr == d[5:].ptr and np.array_equal(cp.asnumpy(z), h[5:])


# --------------------------------------------------------------------------------------------
# JAX
# --------------------------------------------------------------------------------------------
def test_jax(rng):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        pytest.skip("jax without a GPU backend")
    f = rng.standard_normal((32, 16)).astype(np.float32)
    x = jax.device_put(jnp.asarray(f).astype(jnp.bfloat16), gpus[0])
    a = as_device_array(x, name="x")
    assert a.dtype is DT.bfloat16 and a.shape == (32, 16)
    assert_bits_equal(a.to_numpy(), np.asarray(x).view(np.uint16))
    d = DeviceArray.from_numpy(f)
    y = jnp.from_dlpack(d)
    assert np.array_equal(np.asarray(y), f)
