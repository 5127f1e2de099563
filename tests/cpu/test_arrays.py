"""CPU tests of mkernel.arrays: dtypes, bf16 conversion, CAI and DLPack interop, validation.

No GPU is needed: arrays are built on fake device pointers and nothing dereferences them.
"""
from __future__ import annotations

import ctypes
import gc
import pickle
import re
import weakref
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from mkernel.core import arrays as A

from mkernel.core import dlpack as DL

from mkernel.core import dtypes as DT
from mkernel.core.arrays import DeviceArray
from mkernel.core import interop as IO
from mkernel.core.interop import as_device_array, from_dlpack_capsule, require
from mkernel.core.dtypes import bf16_to_f32, bfloat16, dtype_of, f32_to_bf16, float16, float32, int32, int64

ROOT = Path(__file__).resolve().parents[2]


def fake(shape=(3, 4), dtype=bfloat16, ptr=0x1000, device=0, strides=None, **kw):
    return DeviceArray(ptr=ptr, shape=shape, dtype=dtype, strides=strides, device=device, owner=None, **kw)


class CAIObject:
    """A foreign GPU array exposing only a CUDA array interface dict."""

    def __init__(self, cai, dlpack_device=None):
        self.__cuda_array_interface__ = cai
        if dlpack_device is not None:
            self.__dlpack_device__ = lambda: dlpack_device


class DLPackWrapper:
    """A foreign GPU array exposing DLPack through a producer's capsule."""

    def __init__(self, producer, device=None, new_protocol=True):
        self.producer, self.device, self.new_protocol, self.calls = producer, device, new_protocol, []

    def __dlpack_device__(self):
        return self.device if self.device is not None else self.producer.__dlpack_device__()

    def __dlpack__(self, stream=None, **kw):
        self.calls.append(dict(stream=stream, **kw))
        if not self.new_protocol and kw:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        return self.producer.__dlpack__(**kw)


def capsule_name(cap) -> str:
    get = ctypes.pythonapi.PyCapsule_GetName
    get.restype, get.argtypes = ctypes.c_char_p, [ctypes.py_object]
    return get(cap).decode()


# --------------------------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------------------------
def test_dtype_codes_match_cuda_header():
    text = (ROOT / "cuda_src" / "core" / "mk_common.cuh").read_text()
    codes = {m[0]: int(m[1]) for m in re.findall(r"#define MK_DTYPE_(\w+) (\d+)", text)}
    assert codes == {"BF16": bfloat16.code, "F16": float16.code, "F32": float32.code, "I32": int32.code,
                     "I64": int64.code}
    assert [d.code for d in DT.DTYPES] == [0, 1, 2, 3, 4]


def test_dtype_properties():
    assert [d.name for d in DT.DTYPES] == ["bfloat16", "float16", "float32", "int32", "int64"]
    assert [d.itemsize for d in DT.DTYPES] == [2, 2, 4, 4, 8]
    assert [d.typestr for d in DT.DTYPES] == ["<V2", "<f2", "<f4", "<i4", "<i8"]
    assert [d.dlpack for d in DT.DTYPES] == [(4, 16), (2, 16), (2, 32), (0, 32), (0, 64)]
    assert [d.numpy_dtype for d in DT.DTYPES] == [np.uint16, np.float16, np.float32, np.int32, np.int64]
    assert bfloat16.is_float and float16.is_float and not int32.is_float
    assert repr(bfloat16) == "mkernel.bfloat16" and str(float32) == "float32"
    assert pickle.loads(pickle.dumps(bfloat16)) is bfloat16
    assert {bfloat16: 1}[dtype_of("bf16")] == 1


@pytest.mark.parametrize("spec, expect", [
    ("bfloat16", bfloat16), ("bf16", bfloat16), ("BF16", bfloat16), ("torch.bfloat16", bfloat16),
    ("jnp.bfloat16", bfloat16), ("<V2", bfloat16),
    ("float16", float16), ("fp16", float16), ("half", float16), ("torch.float16", float16), ("<f2", float16),
    ("float32", float32), ("fp32", float32), ("f32", float32), ("numpy.float32", float32), ("<f4", float32),
    ("int32", int32), ("i4", int32), ("<i4", int32), ("torch.int32", int32),
    ("int64", int64), ("<i8", int64), ("torch.int64", int64),
    (np.float16, float16), (np.float32, float32), (np.int32, int32), (np.int64, int64),
    (np.dtype("float32"), float32), (np.dtype("<i8"), int64), ("<class 'numpy.float32'>", float32),
    (float32, float32),
])
def test_dtype_of(spec, expect):
    assert dtype_of(spec) is expect


def test_dtype_of_objects_with_name_or_str():
    class Named:
        name = "bfloat16"

    class Printed:
        def __str__(self):
            return "torch.float16"

    assert dtype_of(Named()) is bfloat16
    assert dtype_of(Printed()) is float16
    assert float32 == "fp32" and float32 == np.float32 and bfloat16 != float16 and float32 != "nonsense"


def test_dtype_of_ml_dtypes():
    ml = pytest.importorskip("ml_dtypes")
    assert dtype_of(ml.bfloat16) is bfloat16
    assert dtype_of(np.dtype(ml.bfloat16)) is bfloat16


@pytest.mark.parametrize("bad", ["float64", np.float64, np.dtype("complex64"), "int8", 3.5, "float", None])
def test_dtype_of_rejects(bad):
    with pytest.raises(TypeError, match="unsupported dtype"):
        dtype_of(bad)


def test_dtype_of_uint16_hints_bf16():
    with pytest.raises(TypeError, match="bfloat16"):
        dtype_of(np.uint16)


# --------------------------------------------------------------------------------------------
# bf16 conversion
# --------------------------------------------------------------------------------------------
def bf16_reference(x: float) -> int:
    """Correct RNE float -> bf16 bits via exact rationals (finite x), independent of the bit tricks."""
    if x != x:
        raise ValueError
    sign = 0x8000 if np.signbit(x) else 0
    ax = abs(Fraction(x))
    if ax == 0:
        return sign
    # all finite positive bf16 values and the value just past the largest (2^128, i.e. inf)
    best = None
    e = max(min(ax.numerator.bit_length() - ax.denominator.bit_length(), 127), -126)
    for bits in range(max(0, ((e + 127 - 2) << 7)), min(0x7F81, ((e + 127 + 2) << 7))):
        v = Fraction(bf16_to_f32(np.uint16(bits)).item()) if bits < 0x7F80 else Fraction(2) ** 128
        d = abs(v - ax)
        if best is None or d < best[0] or (d == best[0] and bits % 2 == 0):
            best = (d, bits)
    return sign | best[1]


def test_bf16_to_f32_exact_and_shapes():
    bits = np.array([[0x3F80, 0xBF80], [0x7F80, 0x0001]], np.uint16)
    out = bf16_to_f32(bits)
    assert out.dtype == np.float32 and out.shape == (2, 2)
    assert out[0, 0] == 1.0 and out[0, 1] == -1.0 and np.isposinf(out[1, 0])
    assert out[1, 1] == np.float32(2.0 ** -133)
    assert bf16_to_f32(bits.view(np.int16)).tolist() == out.tolist()
    with pytest.raises(TypeError, match="uint16"):
        bf16_to_f32(np.zeros(3, np.float32))


def test_bf16_all_patterns_round_trip():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    f = bf16_to_f32(bits)
    back = f32_to_bf16(f)
    nan = np.isnan(f)
    assert np.array_equal(back[~nan], bits[~nan])
    assert np.isnan(bf16_to_f32(back[nan])).all()  # NaNs stay NaNs (quieted) ...
    assert np.array_equal(back[nan] & 0x8000, bits[nan] & 0x8000)  # ... with their sign


def test_f32_to_bf16_rne_random_against_exact_reference():
    rng = np.random.default_rng(1234)
    u = rng.integers(0, 1 << 32, size=400, dtype=np.uint64).astype(np.uint32)
    f = u.view(np.float32)
    f = f[np.isfinite(f)]
    got = f32_to_bf16(f)
    want = [bf16_reference(float(v)) for v in f]
    assert got.tolist() == want


def test_f32_to_bf16_special_values_and_ties():
    one = 1.0
    cases = [  # a list: 0.0 and -0.0 are equal dict keys
        (one, 0x3F80), (-one, 0xBF80), (0.0, 0x0000), (-0.0, 0x8000),
        (one + 2.0 ** -8, 0x3F80),  # exact tie, even below -> down
        (one + 3 * 2.0 ** -8, 0x3F82),  # exact tie, odd below -> up
        (one + 2.0 ** -8 + 2.0 ** -20, 0x3F81),  # just above the tie -> up
        (-(one + 3 * 2.0 ** -8), 0xBF82),
        (float(np.finfo(np.float32).max), 0x7F80),  # past bf16 max -> inf
        (3.3895313892515355e38, 0x7F7F),  # bf16 max stays
        (float("inf"), 0x7F80), (float("-inf"), 0xFF80),
        (2.0 ** -133, 0x0001), (2.0 ** -134, 0x0000), (3 * 2.0 ** -134, 0x0002),  # denormal ties
    ]
    x = np.array([c[0] for c in cases], dtype=np.float32)
    assert [hex(v) for v in f32_to_bf16(x).tolist()] == [hex(c[1]) for c in cases]
    nan = f32_to_bf16(np.array([np.nan, -np.nan, np.float32(np.uint32(0x7F800001).view(np.float32))],
                               np.float32))
    assert np.isnan(bf16_to_f32(nan)).all()  # a payload only in the low bits must not become inf
    assert f32_to_bf16(np.float32(1.0)).shape == ()


def test_f32_to_bf16_from_float64_rounds_once():
    x = 1.0 + 2.0 ** -8 + 2.0 ** -40  # above the bf16 tie, but float32 rounds it onto the tie
    assert f32_to_bf16(np.array([x]))[0] == 0x3F81
    assert f32_to_bf16(np.array([np.float32(x)]))[0] == 0x3F80  # what double rounding would give
    rng = np.random.default_rng(7)
    xs = rng.standard_normal(300) * np.exp2(rng.integers(-60, 60, 300))
    assert f32_to_bf16(xs).tolist() == [bf16_reference(float(v)) for v in xs]
    assert f32_to_bf16(np.array([1e300, -1e300, np.nan])).tolist()[:2] == [0x7F80, 0xFF80]


def test_f32_to_bf16_matches_ml_dtypes():
    ml = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(5)
    f = (rng.standard_normal(10000) * 100).astype(np.float32)
    assert np.array_equal(f32_to_bf16(f), f.astype(ml.bfloat16).view(np.uint16))
    assert np.array_equal(bf16_to_f32(f.astype(ml.bfloat16)), f.astype(ml.bfloat16).astype(np.float32))


# --------------------------------------------------------------------------------------------
# DeviceArray: geometry and views
# --------------------------------------------------------------------------------------------
def test_device_array_basics():
    a = fake((3, 4), float32)
    assert (a.size, a.ndim, a.nbytes, a.itemsize, len(a)) == (12, 2, 48, 4, 3)
    assert a.strides == (4, 1) and a.is_contiguous() and a.device == 0 and a.owner is None
    assert "shape=(3, 4)" in repr(a) and "float32" in repr(a)
    assert fake((), int64).size == 1 and fake((), int64).strides == ()
    assert fake((0, 5)).is_contiguous() and fake((0, 5)).nbytes == 0
    with pytest.raises(ValueError):
        fake((3, 4), strides=(1,))
    with pytest.raises(ValueError):
        fake((-1, 4))


def test_contiguity_rules():
    assert fake((3, 1, 4), strides=(4, 99, 1)).is_contiguous()  # extent-1 dims may have any stride
    assert fake((1, 4), strides=(7, 1)).is_contiguous()
    assert not fake((3, 4), strides=(8, 1)).is_contiguous()  # row pitch
    assert not fake((3, 4), strides=(1, 3)).is_contiguous()  # column major
    assert A.contiguous_strides((2, 3, 4)) == (12, 4, 1)
    assert A.contiguous_strides((2, 0, 4)) == (4, 4, 1)


def test_getitem_first_axis():
    a = fake((6, 4), bfloat16, ptr=0x1000)
    b = a[2:5]
    assert (b.ptr, b.shape, b.strides, b.owner) == (0x1000 + 2 * 4 * 2, (3, 4), (4, 1), a)
    assert b.is_contiguous()
    c = a[::2]
    assert (c.ptr, c.shape, c.strides) == (0x1000, (3, 4), (8, 1)) and not c.is_contiguous()
    d = a[-1]
    assert (d.ptr, d.shape, d.strides) == (0x1000 + 5 * 4 * 2, (4,), (1,))
    e = a[5:2:-1]
    assert (e.ptr, e.shape, e.strides) == (0x1000 + 5 * 8, (3, 4), (-4, 1))
    assert a[4:4].shape == (0, 4)
    with pytest.raises(IndexError):
        a[6]
    with pytest.raises(TypeError, match="first axis"):
        a[1, 2]
    with pytest.raises(TypeError, match="first axis"):
        a[...]


def test_reshape_and_view():
    a = fake((6, 4), float16)
    assert a.reshape(24).shape == (24,) and a.reshape((2, -1, 4)).shape == (2, 3, 4)
    assert a.reshape(4, 6).strides == (6, 1) and a.reshape(4, 6).owner is a
    with pytest.raises(ValueError, match="cannot reshape"):
        a.reshape(5, 5)
    with pytest.raises(ValueError, match="contiguous"):
        a[::2].reshape(12)
    v = a.view("bf16")
    assert v.dtype is bfloat16 and v.ptr == a.ptr and v.shape == a.shape
    assert fake((4,), float32).view(int32).dtype is int32
    with pytest.raises(ValueError, match="itemsize"):
        a.view(float32)


# --------------------------------------------------------------------------------------------
# __cuda_array_interface__
# --------------------------------------------------------------------------------------------
def test_cai_export():
    a = fake((3, 4), float32, ptr=0x2000)
    cai = a.__cuda_array_interface__
    assert cai == {"shape": (3, 4), "typestr": "<f4", "descr": [("", "<f4")], "data": (0x2000, False),
                   "strides": None, "version": 3, "stream": None}
    s = fake((6, 4), bfloat16)[::2].__cuda_array_interface__
    assert s["typestr"] == "<V2" and s["strides"] == (16, 2)


def test_cai_import_contiguous_and_strided():
    b = as_device_array(CAIObject({"shape": (5, 7), "typestr": "<f2", "data": (0xABC00, False), "version": 2}))
    assert (b.ptr, b.shape, b.strides, b.dtype, b.readonly) == (0xABC00, (5, 7), (7, 1), float16, False)
    obj = CAIObject({"shape": (4, 3), "typestr": "<i8", "data": (0x4000, True), "strides": (64, 8),
                     "version": 3, "stream": None}, dlpack_device=(2, 3))
    c = as_device_array(obj)
    assert (c.shape, c.strides, c.dtype, c.readonly, c.device, c.owner) == ((4, 3), (8, 1), int64, True, 3, obj)
    assert not c.is_contiguous()


@pytest.mark.parametrize("dtype", DT.DTYPES)
def test_cai_round_trip(dtype):
    a = fake((6, 5), dtype, ptr=0x10000, device=0)
    for x in (a, a[1:5], a[::3]):
        y = as_device_array(CAIObject(x.__cuda_array_interface__))
        assert (y.ptr, y.shape, y.strides, y.dtype) == (x.ptr, x.shape, x.strides, x.dtype)


def test_cai_import_errors():
    base = {"shape": (4,), "data": (0x1000, False), "version": 3}
    with pytest.raises(TypeError, match=r"gemm: a: unsupported __cuda_array_interface__ typestr '<u2'"):
        as_device_array(CAIObject(dict(base, typestr="<u2")), name="gemm: a")
    with pytest.raises(TypeError, match="'<f8'"):
        as_device_array(CAIObject(dict(base, typestr="<f8")), name="x")
    with pytest.raises(ValueError, match="x: masked"):
        as_device_array(CAIObject(dict(base, typestr="<f4", mask=object())), name="x")
    with pytest.raises(ValueError, match="not multiples"):
        as_device_array(CAIObject(dict(base, typestr="<f4", strides=(6,))), name="x")


def test_cai_stream_is_waited_on(monkeypatch):
    seen = []
    monkeypatch.setattr(IO, "stream_wait", lambda producer, consumer: seen.append((producer, consumer)))
    cai = {"shape": (4,), "typestr": "<f4", "data": (0x1000, False), "version": 3, "stream": 77}
    as_device_array(CAIObject(cai), stream=5)
    as_device_array(CAIObject(dict(cai, stream=None)), stream=5)
    assert seen == [(77, 5)]


# --------------------------------------------------------------------------------------------
# DLPack
# --------------------------------------------------------------------------------------------
def test_dlpack_struct_layout():
    assert ctypes.sizeof(DL.DLTensor) == 48
    assert ctypes.sizeof(DL.DLManagedTensor) == 64
    assert ctypes.sizeof(DL.DLManagedTensorVersioned) == 80
    assert DL.DLManagedTensorVersioned.dl_tensor.offset == 32


def test_dlpack_device():
    assert fake(device=3).__dlpack_device__() == (2, 3)


@pytest.mark.parametrize("max_version, name", [(None, "dltensor"), ((0, 8), "dltensor"),
                                               ((1, 0), "dltensor_versioned"), ((1, 3), "dltensor_versioned")])
def test_dlpack_capsule_names(max_version, name):
    cap = fake().__dlpack__(max_version=max_version)
    assert capsule_name(cap) == name


@pytest.mark.parametrize("new_protocol", [True, False])
@pytest.mark.parametrize("dtype", DT.DTYPES)
def test_dlpack_round_trip(dtype, new_protocol):
    a = DeviceArray(ptr=0x1000, shape=(3, 4), dtype=dtype, device=0, owner=None)
    for x in (a, a[1:3], a[::2], a[1]):
        w = DLPackWrapper(x, new_protocol=new_protocol)
        y = as_device_array(w, name="x")
        assert (y.ptr, y.shape, y.strides, y.dtype, y.device) == (x.ptr, x.shape, x.strides, x.dtype, 0)
        assert isinstance(y.owner, DL.DLPackOwner) and y.owner.versioned == new_protocol
        assert w.calls[-1]["stream"] == 1  # None -> the legacy default stream, never 0
        assert y.is_contiguous() == x.is_contiguous()


def test_dlpack_passes_consumer_stream_and_device():
    w = DLPackWrapper(fake(device=2))
    y = as_device_array(w, stream=0xBEEF)
    assert w.calls == [{"stream": 0xBEEF, "max_version": (1, 0)}] and y.device == 2


def test_dlpack_lifetime_consumed():
    a = fake((4, 4), float32)
    ref = weakref.ref(a)
    y = as_device_array(DLPackWrapper(a))
    del a
    gc.collect()
    assert ref() is not None  # the consumer's view keeps the producer alive ...
    v = y[1:3]
    del y
    gc.collect()
    assert ref() is not None  # ... including through views of it
    del v
    gc.collect()
    assert ref() is None and not DL._exports  # the deleter ran


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_dlpack_lifetime_unconsumed(max_version):
    a = fake((4, 4), float32)
    ref = weakref.ref(a)
    cap = a.__dlpack__(max_version=max_version)
    del a
    gc.collect()
    assert ref() is not None and len(DL._exports) == 1
    del cap  # capsule destructor frees the never-consumed manager
    gc.collect()
    assert ref() is None and not DL._exports


def test_dlpack_capsule_consumed_once():
    cap = fake().__dlpack__()
    from_dlpack_capsule(cap)
    assert capsule_name(cap) == "used_dltensor"
    with pytest.raises(ValueError, match="already consumed"):
        from_dlpack_capsule(cap)
    capv = fake().__dlpack__(max_version=(1, 0))
    from_dlpack_capsule(capv)
    assert capsule_name(capv) == "used_dltensor_versioned"
    with pytest.raises(TypeError, match="expected a DLPack capsule"):
        from_dlpack_capsule(object())


@pytest.mark.parametrize("versioned", [False, True])
def test_dlpack_byte_offset_and_flags(versioned):
    cap = fake((8,), float32, ptr=0x1000, readonly=True).__dlpack__(max_version=(1, 0) if versioned else None)
    name = DL._NAME_V if versioned else DL._NAME
    addr = DL._Capsule_GetPointer(cap, name)
    mt = (DL.DLManagedTensorVersioned if versioned else DL.DLManagedTensor).from_address(addr)
    mt.dl_tensor.byte_offset = 64
    y = from_dlpack_capsule(cap)
    assert y.ptr == 0x1000 + 64 and y.shape == (8,)
    assert y.readonly == versioned  # only DLPack 1.x carries the read-only flag


def test_dlpack_export_options():
    a = fake(device=1)
    with pytest.raises(BufferError, match="copy"):
        a.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="dl_device"):
        a.__dlpack__(dl_device=(1, 0))
    assert capsule_name(a.__dlpack__(dl_device=(2, 1), copy=False, stream=5)) == "dltensor"


def test_dlpack_unsupported_dtype_and_version():
    cap = fake((4,), float32).__dlpack__()
    mt = DL.DLManagedTensor.from_address(DL._Capsule_GetPointer(cap, DL._NAME))
    mt.dl_tensor.dtype.code, mt.dl_tensor.dtype.bits = 2, 64
    with pytest.raises(TypeError, match=r"w: unsupported DLPack dtype \(code=2, bits=64"):
        from_dlpack_capsule(cap, name="w")
    assert capsule_name(cap) == "dltensor"  # refused before consuming: the producer still frees it
    capv = fake((4,), float32).__dlpack__(max_version=(1, 0))
    DL.DLManagedTensorVersioned.from_address(DL._Capsule_GetPointer(capv, DL._NAME_V)).version.major = 2
    with pytest.raises(BufferError, match="version 2.0"):
        from_dlpack_capsule(capv)
    del cap, capv
    gc.collect()
    assert not DL._exports


def test_numpy_dlpack_is_rejected():
    x = np.arange(6, dtype=np.float32)
    with pytest.raises(TypeError, match=r"^w is a host array .*mkernel takes GPU memory"):
        as_device_array(x, name="w")
    with pytest.raises(TypeError, match=r"^w is a host array .*DLPack device type 1"):
        as_device_array(DLPackWrapper(x), name="w")
    # a producer lying about its device is caught at the capsule
    for mv in (None, (1, 0)):
        with pytest.raises(TypeError, match=r"^w is a host array \(DLPack device type 1\)"):
            as_device_array(DLPackWrapper(x, device=(2, 0)) if mv else _Legacy(x), name="w")
    cap = x.__dlpack__()
    with pytest.raises(TypeError, match="host array"):
        from_dlpack_capsule(cap)
    assert capsule_name(cap) == "dltensor"  # not consumed: numpy still owns it
    assert np.from_dlpack(x).sum() == 15


class _Legacy:
    """Claims CUDA but hands out numpy's legacy capsule."""

    def __init__(self, x):
        self.x = x

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None):
        return self.x.__dlpack__()


def test_host_objects_rejected():
    with pytest.raises(TypeError, match="b is a host array"):
        as_device_array(np.float32(3.0), name="b")

    class ArrayLike:
        def __array__(self, dtype=None, copy=None):
            return np.zeros(3)

    with pytest.raises(TypeError, match="c is a host array"):
        as_device_array(ArrayLike(), name="c")
    with pytest.raises(TypeError, match=r"^d: expected a GPU array .* got list"):
        as_device_array([1, 2, 3], name="d")


def test_raw_pointer_tuples():
    a = as_device_array((0x3000, (2, 8), "bf16", 1), name="raw")
    assert (a.ptr, a.shape, a.strides, a.dtype, a.device, a.owner) == (0x3000, (2, 8), (8, 1), bfloat16, 1, None)
    assert as_device_array((0x3000, 16, np.float32, 0)).shape == (16,)
    with pytest.raises(TypeError, match=r"raw: a raw array is \(ptr, shape, dtype\)"):
        as_device_array((1, 2), name="raw")
    with pytest.raises(TypeError, match="raw: unsupported dtype"):
        as_device_array((0x3000, (2,), "float64", 0), name="raw")


def test_device_array_passes_through():
    a = fake()
    assert as_device_array(a) is a


# --------------------------------------------------------------------------------------------
# from_numpy's host side
# --------------------------------------------------------------------------------------------
def test_host_payload_conversions():
    f = np.array([[1.0, 1 + 2 ** -8], [1 + 3 * 2 ** -8, -2.5]], np.float32)
    bits, d = A._host_payload(f, "bfloat16")
    assert d is bfloat16 and bits.dtype == np.uint16 and bits.tolist() == [[0x3F80, 0x3F80], [0x3F82, 0xC020]]
    same, d = A._host_payload(bits, "bf16")
    assert d is bfloat16 and np.array_equal(same, bits)
    h, d = A._host_payload(np.arange(6, dtype=np.int64).reshape(2, 3)[:, ::2], None)
    assert d is int64 and h.flags.c_contiguous and h.tolist() == [[0, 2], [3, 5]]
    h, d = A._host_payload(np.ones(3, np.float64), "float32")
    assert d is float32 and h.dtype == np.float32
    with pytest.raises(TypeError, match="ambiguous"):
        A._host_payload(bits, None)
    with pytest.raises(TypeError, match="float64"):
        A._host_payload(np.ones(3), None)
    with pytest.raises(TypeError, match="as_device_array"):
        A._host_payload(fake(), None)


def test_host_payload_ml_dtypes():
    ml = pytest.importorskip("ml_dtypes")
    x = np.array([1.5, -2.0, 3.25], dtype=ml.bfloat16)
    bits, d = A._host_payload(x, None)
    assert d is bfloat16 and np.array_equal(bits, x.view(np.uint16))
    h, d = A._host_payload(x, "float32")
    assert d is float32 and h.tolist() == [1.5, -2.0, 3.25]


# --------------------------------------------------------------------------------------------
# require
# --------------------------------------------------------------------------------------------
def test_require_ok_and_converts():
    a = fake((128, 64), bfloat16, ptr=0x10000)
    assert require(a, "gemm: a", dtypes=(bfloat16, float16), ndim=2, shape=(128, None), align=16, device=0) is a
    b = require(CAIObject(a.__cuda_array_interface__), "gemm: a", dtypes="bf16")
    assert isinstance(b, DeviceArray) and b.ptr == a.ptr


@pytest.mark.parametrize("kwargs, exc, msg", [
    (dict(dtypes=("bfloat16", "float16")), TypeError, "gemm: b must be bfloat16 or float16, got float32"),
    (dict(dtypes=(bfloat16, float16, int32)), TypeError, "gemm: b must be bfloat16, float16 or int32, got float32"),
    (dict(dtypes=bfloat16), TypeError, "gemm: b must be bfloat16, got float32"),
    (dict(ndim=3), ValueError, "gemm: b must be 3-D, got 2-D with shape (64, 32)"),
    (dict(ndim=(1, 3)), ValueError, "gemm: b must be 1-D or 3-D, got 2-D"),
    (dict(shape=(64, 16)), ValueError, "gemm: b must have shape (64, 16), got (64, 32)"),
    (dict(shape=(None, 16)), ValueError, "gemm: b must have shape (*, 16), got (64, 32)"),
    (dict(shape=(64,)), ValueError, "gemm: b must have shape (64,), got (64, 32)"),
    (dict(align=256), ValueError, "gemm: b must be 256-byte aligned, got ptr 0x1080"),
    (dict(device=1), ValueError, "gemm: b is on cuda:0, expected cuda:1"),
])
def test_require_messages(kwargs, exc, msg):
    b = fake((64, 32), float32, ptr=0x1080)
    with pytest.raises(exc) as info:
        require(b, "gemm: b", **kwargs)
    assert str(info.value).startswith(msg)


def test_require_contiguous_and_writable():
    a = fake((64, 32), float32)[::2]
    with pytest.raises(ValueError, match=r"gemm: c must be contiguous \(row-major\), got strides \(64, 1\)"):
        require(a, "gemm: c")
    assert require(a, "gemm: c", contiguous=False) is a
    ro = fake(readonly=True)
    assert require(ro, "x") is ro
    with pytest.raises(ValueError, match="x is read-only"):
        require(ro, "x", writable=True)
    with pytest.raises(TypeError, match="y is a host array"):
        require(np.zeros(3), "y")
