"""``python -m mkernel info``: what this machine offers mkernel -- versions, the driver, the GPUs and their
peers, NVRTC, the kernel cache, MPI, the inter-node transports, the ``MKERNEL_*`` variables set.  Every
item that cannot be found says why on its line; the command always exits 0."""
from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["add_parser", "run", "lines"]


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="what this machine offers mkernel",
                       description="Versions, driver, GPUs, NVRTC, the kernel cache, MPI, transports, MKERNEL_* set.")
    p.set_defaults(run=run)


def _guard(fn):
    """``fn()``'s lines, or one line with the exception."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 -- info reports whatever is missing and goes on
        return [f"unavailable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"]


def _versions():
    import mkernel

    out = [f"mkernel {mkernel.__version__} ({Path(mkernel.__file__).parent}), Python {sys.version.split()[0]}"]
    for dist in ("cuda-bindings", "cuda-core", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "numpy", "mpi4py"):
        out.append(f"{dist} {_dist_version(dist)}")
    return out


def _dist_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _driver():
    from ..core.driver import NO_DRIVER, driver_version, init_driver
    from ..errors import DeviceError

    ver = driver_version()
    if ver is None:
        return [f"driver: {NO_DRIVER}"]
    try:
        init_driver()
    except DeviceError as exc:
        return [f"driver: supports CUDA {ver[0]}.{ver[1]}; {exc}"]
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [f"driver: supports CUDA {ver[0]}.{ver[1]}" + (f" (CUDA_VISIBLE_DEVICES={vis})" if vis is not None else "")]


def _devices():
    from cuda.bindings import driver as cu

    from ..core.archs import GEMM_CAPABILITIES, capability
    from ..core.driver import check, device_name, driver_version
    from ..dist.sharing import gpu_identity

    if driver_version() is None:
        return []
    n = check(cu.cuDeviceGetCount())
    out = [f"GPUs: {n}"]
    for d in range(n):
        cc = capability(d)
        mem = check(cu.cuDeviceTotalMem(check(cu.cuDeviceGet(d))))
        peers = [p for p in range(n) if p != d and check(cu.cuDeviceCanAccessPeer(d, p))]
        ops = "every op" if cc in GEMM_CAPABILITIES else "collectives only (the GEMM ops need compute capability 9.0)"
        out.append(f"  cuda:{d} {device_name(d)}, compute capability {cc[0]}.{cc[1]}, {mem / 2**30:.0f} GiB, "
                   f"{gpu_identity(d)}, peer access to {peers or 'none'}: {ops}")
    return out


def _nvrtc():
    from ..core.archs import nvrtc_archs
    from ..core.compiler import include_dirs, nvrtc_version

    major, minor = nvrtc_version()
    archs = nvrtc_archs()
    out = [f"NVRTC {major}.{minor}: sm_{archs[0]} to sm_{archs[-1]}"]
    try:
        out.append(f"CUDA headers: {os.pathsep.join(include_dirs())}")
    except FileNotFoundError as exc:
        out.append(f"CUDA headers: {exc}")
    return out


def _cache():
    from ..core.compiler import cache_path

    d = cache_path()
    if not d.is_dir():
        return [f"kernel cache: {d} (not created yet)"]
    files = [p for p in d.iterdir() if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    cubins = sum(p.suffix == ".cubin" for p in files)
    mode = d.stat().st_mode & 0o777
    private = "" if mode & 0o022 == 0 else f"; mode {mode:o} is writable by others: the cache is off"
    return [f"kernel cache: {d}: {cubins} cubins, {size / 2**20:.1f} MiB{private}"]


def _mpi():
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:  # report the library without starting MPI
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
    from mpi4py import MPI

    lib = MPI.Get_library_version().strip().splitlines()[0]
    return [f"MPI (mpi4py {mpi4py.__version__}): {lib}"]


def _transports():
    import importlib.util

    out = ["transports: tcp (always)"]
    verbs = importlib.util.find_spec("pyverbs") is not None
    ib = Path("/sys/class/infiniband")
    nics = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
    out.append(f"  verbs: pyverbs {'importable' if verbs else 'not importable (apt install python3-pyverbs)'}; "
               f"RDMA devices: {', '.join(nics) if nics else 'none'}")
    return out


def _variables():
    from ..core import env

    try:
        set_ = [(name, value) for name, _, value in env.describe() if value is not None]
    except ValueError as exc:
        return [f"MKERNEL_* variables: {exc}"]
    if not set_:
        return ["MKERNEL_* variables: none set"]
    return ["MKERNEL_* variables:"] + [f"  {name}={value!r}" for name, value in set_]


def lines() -> list[str]:
    """Every line ``info`` prints."""
    out = []
    for part in (_versions, _driver, _devices, _nvrtc, _cache, _mpi, _transports, _variables):
        out += _guard(part)
    return out


def run(args) -> int:
    for line in lines():
        print(line)
    return 0
