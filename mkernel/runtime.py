"""Run-time compilation of ``cuda_src/`` with NVRTC, an on-disk cubin cache, and kernel launch.

Kernels are compiled on first use for the architecture of the current device (``sm_90a`` on
Hopper), with C++17, the CUDA headers taken from the installed ``nvidia-cuda-runtime`` wheel (or a
CUDA toolkit), and specializations passed as preprocessor defines.  A cubin is cached on disk under
``$MKERNEL_CACHE_DIR`` (default ``~/.cache/mkernel``), keyed by the source text of the kernel and
every header it includes, the options, the architecture and the NVRTC version: a second process
start compiles nothing.

Launches go through the driver API on the caller's stream (any object with ``__cuda_stream__``, a
``.cuda_stream``/``.ptr``/``.handle`` attribute, or a raw ``CUstream`` handle as an int).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from cuda.bindings import driver as cu
from cuda.bindings import nvrtc

from .errors import CompileError, CudaError

__all__ = [
    "check", "cuda_src_dir", "include_dirs", "nvrtc_version", "compile_module", "Module", "Kernel",
    "stream_handle", "current_arch", "register_specialization", "registered_specializations",
    "device_attribute", "precompile", "precompile_source", "round_up", "copy_async", "Events", "ForkedCopies",
]


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------
def check(result):
    """Unwrap a cuda.bindings ``(err, *values)`` result, raising :class:`CudaError` on failure."""
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if isinstance(err, cu.CUresult):
        if err != cu.CUresult.CUDA_SUCCESS:
            _, name = cu.cuGetErrorName(err)
            _, text = cu.cuGetErrorString(err)
            raise CudaError(int(err), f"{name.decode() if name else err}: {text.decode() if text else ''}")
    elif isinstance(err, nvrtc.nvrtcResult):
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CudaError(int(err), f"NVRTC error {err}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def is_capturing(stream) -> bool:
    """True while ``stream`` is being captured into a CUDA graph (an error, e.g. no context: False)."""
    err, status = cu.cuStreamIsCapturing(cu.CUstream(stream_handle(stream)))
    return (err == cu.CUresult.CUDA_SUCCESS
            and status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE)


@contextmanager
def capture_relaxed():
    """Let this thread call what a CUDA-graph capture in global mode forbids (cuMemAlloc, cuMemFree,
    module loads) while some stream is being captured: the library allocates a plan's workspace,
    frees an evicted plan's and loads modules lazily, possibly inside the caller's capture, and
    none of that is (or needs to be) part of the captured work.  Without it such a call fails with
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the caller's capture."""
    try:
        err, prev = cu.cuThreadExchangeStreamCaptureMode(cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    except Exception:  # no driver at all (CPU machines): nothing is being captured
        err, prev = None, None
    try:
        yield
    finally:
        if err == cu.CUresult.CUDA_SUCCESS:
            cu.cuThreadExchangeStreamCaptureMode(prev)


# --------------------------------------------------------------------------------------------
# where things are
# --------------------------------------------------------------------------------------------
def cuda_src_dir() -> Path:
    """The kernel sources: ``cuda_src/`` beside the package in a source tree, else the installed copy."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "cuda_src", here / "cuda_src"):
        if (cand / "mk_common.cuh").is_file():
            return cand
    try:
        import mkernel.cuda_src as pkg  # installed: setuptools maps cuda_src/ to mkernel.cuda_src

        return Path(pkg.__file__).resolve().parent
    except ImportError as exc:  # pragma: no cover - broken install
        raise FileNotFoundError("mkernel: cannot find the cuda_src/ kernel sources") from exc


_include_cache: list[str] | None = None


def include_dirs() -> list[str]:
    """CUDA header directories for NVRTC: $MKERNEL_CUDA_INCLUDE, the nvidia-cuda-runtime wheel, CUDA_HOME."""
    global _include_cache
    if _include_cache is not None:
        return _include_cache
    dirs: list[str] = []
    env = os.environ.get("MKERNEL_CUDA_INCLUDE")
    if env:
        dirs += [d for d in env.split(os.pathsep) if d]
    try:
        from cuda import pathfinder

        d = pathfinder.find_nvidia_header_directory("cudart")
        if d:
            dirs.append(str(d))
    except Exception:  # pragma: no cover - older pathfinder
        pass
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "include" / "cuda_bf16.h").is_file():
            dirs.append(str(Path(home) / "include"))
    dirs = [d for i, d in enumerate(dirs) if d not in dirs[:i]]
    if not any((Path(d) / "cuda_bf16.h").is_file() for d in dirs):
        raise FileNotFoundError(
            "mkernel: no CUDA headers found for NVRTC; `pip install nvidia-cuda-runtime` or set "
            "MKERNEL_CUDA_INCLUDE to a directory holding cuda_bf16.h")
    _include_cache = dirs
    return dirs


def nvrtc_version() -> tuple[int, int]:
    major, minor = check(nvrtc.nvrtcVersion())
    return int(major), int(minor)


def cache_dir() -> Path:
    d = Path(os.environ.get("MKERNEL_CACHE_DIR", Path.home() / ".cache" / "mkernel"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def round_up(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m`` (workspace layouts, strides, paddings)."""
    return (x + m - 1) // m * m


# --------------------------------------------------------------------------------------------
# devices
# --------------------------------------------------------------------------------------------
def current_device() -> int:
    return int(check(cu.cuCtxGetDevice()))


def device_attribute(attr: cu.CUdevice_attribute, device: int | None = None) -> int:
    """A device attribute (None: the current context's device), queried once per (attribute, device):
    they never change while the process runs."""
    dev = current_device() if device is None else device
    return _device_attribute(attr, dev)


@functools.lru_cache(maxsize=None)
def _device_attribute(attr: cu.CUdevice_attribute, device: int) -> int:
    return int(check(cu.cuDeviceGetAttribute(attr, device)))


def current_arch() -> str:
    """``sm_XYa`` for the current device (the ``a`` variant where wgmma/setmaxnreg need it)."""
    A = cu.CUdevice_attribute
    major = device_attribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
    minor = device_attribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
    suffix = "a" if major >= 9 else ""
    return f"sm_{major}{minor}{suffix}"


# --------------------------------------------------------------------------------------------
# compilation
# --------------------------------------------------------------------------------------------
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def _collect_sources(name: str, root: Path, seen: dict[str, str]) -> None:
    if name in seen:
        return
    path = root / name
    text = path.read_text()
    seen[name] = text
    for inc in _INCLUDE_RE.findall(text):
        rel = (Path(name).parent / inc).as_posix() if (root / Path(name).parent / inc).is_file() else inc
        if (root / rel).is_file():
            _collect_sources(rel, root, seen)


_PTXAS_FUNC_RE = re.compile(r"Function properties for (\S+)")
_PTXAS_SPILL_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS_RE = re.compile(r"Used (\d+) registers")


def parse_ptxas_log(log: str) -> dict[str, dict[str, int]]:
    """Per-kernel registers / stack / spills from ``--ptxas-options=-v`` output."""
    usage: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = _PTXAS_FUNC_RE.search(line)
        if m:
            current = m.group(1)
            usage[current] = {}
            continue
        if current is None:
            continue
        m = _PTXAS_SPILL_RE.search(line)
        if m:
            usage[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = _PTXAS_REGS_RE.search(line)
        if m:
            usage[current]["registers"] = int(m.group(1))
    return usage


@dataclass
class Module:
    """A compiled cubin; functions are loaded into the current context on first use."""

    source: str
    defines: dict
    arch: str
    cubin: bytes
    log: str
    compile_seconds: float
    cached: bool
    _handles: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def resource_usage(self) -> dict[str, dict[str, int]]:
        return parse_ptxas_log(self.log)

    def _module_handle(self):
        ctx = check(cu.cuCtxGetCurrent())
        key = int(ctx)
        with self._lock:
            h = self._handles.get(key)
            if h is None:
                with capture_relaxed():
                    h = check(cu.cuModuleLoadData(self.cubin))
                self._handles[key] = h
            return h

    def function(self, name: str) -> "Kernel":
        return Kernel(self, name)


def _define_flags(defines: Mapping[str, object]) -> list[str]:
    out = []
    for k in sorted(defines):
        v = defines[k]
        if v is True:
            out.append(f"-D{k}")
        elif v is False or v is None:
            continue
        else:
            out.append(f"-D{k}={v}")
    return out


def _env_defines() -> dict:
    """Extra defines for every module from ``MKERNEL_DEFINES`` (``"A=1,B"``): experiments only
    (e.g. timing-only switches documented in docs/); they enter the cache key like any define."""
    out: dict = {}
    for item in os.environ.get("MKERNEL_DEFINES", "").split(","):
        item = item.strip()
        if not item:
            continue
        name, eq, value = item.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name.strip()):
            raise ValueError(f"MKERNEL_DEFINES: bad define {item!r} (expected NAME or NAME=VALUE, comma-separated)")
        out[name.strip()] = value.strip() if eq else True
    return out


_module_cache: dict[tuple, Module] = {}
_module_cache_lock = threading.Lock()


def compile_module(source: str, defines: Mapping[str, object] | None = None, *, arch: str | None = None,
                   extra_options: Sequence[str] = (), use_disk_cache: bool = True) -> Module:
    """Compile ``cuda_src/<source>`` (memoized in-process and on disk).

    ``defines`` become ``-DNAME=VALUE`` flags (specializations); ``arch`` defaults to the current
    device's (``sm_90a`` on Hopper).  Raises :class:`CompileError` with the NVRTC log on failure.
    """
    defines = dict(defines or {})
    defines.update(_env_defines())
    arch = arch or current_arch()
    root = cuda_src_dir()
    sources: dict[str, str] = {}
    _collect_sources(source, root, sources)
    ver = nvrtc_version()
    # NVRTC >= 12.9 keeps a compile cache of its own: a hit returns no ptxas report (the registers and
    # spills Module.resource_usage and the CPU compile tests read) and makes a "fresh" compile's time
    # (bench/gemm.py) a cache lookup.  mkernel's disk cache, keyed by sources and options, keeps the log.
    options = ["-std=c++17", f"--gpu-architecture={arch}", "--ptxas-options=-v", "-default-device",
               "--no-cache" if ver >= (12, 9) else "",
               "--use_fast_math" if defines.pop("MK_FAST_MATH", False) else "",
               *(f"-I{d}" for d in [str(root), *include_dirs()]), *_define_flags(defines), *extra_options]
    options = [o for o in options if o]
    h = hashlib.sha256()
    for k in sorted(sources):
        h.update(k.encode() + b"\0" + sources[k].encode() + b"\0")
    # include paths are machine-specific; hash only the options that change the code
    h.update(repr([o for o in options if not o.startswith("-I")]).encode())
    h.update(repr(ver).encode())
    key = h.hexdigest()[:32]
    mem_key = (source, key)
    with _module_cache_lock:
        mod = _module_cache.get(mem_key)
    if mod is not None:
        return mod
    stem = f"{Path(source).stem}-{arch}-{key}"
    cubin_path = cache_dir() / f"{stem}.cubin"
    log_path = cache_dir() / f"{stem}.log"
    if use_disk_cache and cubin_path.is_file() and log_path.is_file():
        mod = Module(source, defines, arch, cubin_path.read_bytes(), log_path.read_text(), 0.0, True)
    else:
        t0 = time.perf_counter()
        prog = check(nvrtc.nvrtcCreateProgram(sources[source].encode(), source.encode(), 0, [], []))
        try:
            opts = [o.encode() for o in options]
            err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
            size = check(nvrtc.nvrtcGetProgramLogSize(prog))
            buf = b" " * size
            check(nvrtc.nvrtcGetProgramLog(prog, buf))
            log = buf.decode(errors="replace").rstrip("\0 \n")
            if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
                raise CompileError(source, defines, arch, log)
            size = check(nvrtc.nvrtcGetCUBINSize(prog))
            cubin = b" " * size
            check(nvrtc.nvrtcGetCUBIN(prog, cubin))
        finally:
            nvrtc.nvrtcDestroyProgram(prog)
        dt = time.perf_counter() - t0
        mod = Module(source, defines, arch, cubin, log, dt, False)
        if use_disk_cache:
            tmp = cubin_path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(cubin)
            os.replace(tmp, cubin_path)
            tmp = log_path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(log)
            os.replace(tmp, log_path)
    with _module_cache_lock:
        _module_cache[mem_key] = mod
    return mod


_kernels: dict[tuple, "Kernel"] = {}


def kernel(source: str, defines: Mapping[str, object], name: str) -> "Kernel":
    """The ``__global__`` function ``name`` of ``cuda_src/<source>`` compiled with ``defines``,
    memoized per process (ops call this on every launch: the first call compiles or loads the cubin,
    later ones are a dict lookup; the architecture and ``MKERNEL_DEFINES`` are those of that first
    call)."""
    key = (source, tuple(sorted(defines.items())), name)
    k = _kernels.get(key)
    if k is None:
        k = _kernels.setdefault(key, compile_module(source, defines).function(name))
    return k


# Every op module registers the specializations it can launch, so CI compiles all of them.
_specializations: list[tuple[str, dict]] = []


def register_specialization(source: str, defines: Mapping[str, object] | None = None) -> None:
    item = (source, dict(defines or {}))
    if item not in _specializations:
        _specializations.append(item)


def registered_specializations() -> list[tuple[str, dict]]:
    return list(_specializations)


def _compile_one(item) -> float:
    source, defines, arch = item
    return compile_module(source, defines, arch=arch).compile_seconds


def precompile_source(source: str, specs=None, *, arch: str | None = None, workers: int | None = None) -> float:
    """:func:`precompile` for one source: ``specs`` are define dicts (default: every registered
    specialization of ``source``), ``arch`` defaults to the current device's (the first device's
    primary context when none is current)."""
    if arch is None:
        from .arrays import _on_device

        with _on_device(None):
            arch = current_arch()
    if specs is None:
        specs = [d for src, d in registered_specializations() if src == source]
    return precompile([(source, d) for d in specs], arch=arch, workers=workers)


def precompile(specs, *, arch: str, workers: int | None = None) -> float:
    """Compile ``(source, defines)`` pairs for ``arch`` into the disk cache, in parallel worker
    processes (NVRTC is single-threaded per program); returns the summed NVRTC seconds (0 for cubins
    already cached).  Later ``compile_module`` calls load them from disk.  The workers are spawned
    and import the main module: a script calling this must do so under ``if __name__ ==
    "__main__":``; where the workers die anyway, it warns and compiles in this process."""
    import concurrent.futures as cf
    import multiprocessing as mp

    items = [(src, dict(d), arch) for src, d in specs]
    workers = workers or max(1, min(len(items), (os.cpu_count() or 2)))
    if workers == 1 or len(items) <= 1:
        return sum(_compile_one(it) for it in items)
    try:
        with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            return sum(ex.map(_compile_one, items))
    except cf.process.BrokenProcessPool:
        import warnings

        warnings.warn("mkernel.precompile: the compile worker processes died (spawned workers import the main "
                      "module: call precompile under `if __name__ == '__main__':`); compiling in this process",
                      RuntimeWarning, stacklevel=2)
        return sum(_compile_one(it) for it in items)


# --------------------------------------------------------------------------------------------
# launch
# --------------------------------------------------------------------------------------------
def stream_handle(stream) -> int:
    """A raw ``CUstream`` handle (int) from any stream-like object; ``None`` is the legacy default stream."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        val = proto() if callable(proto) else proto
        if isinstance(val, tuple):
            return int(val[1])
        return int(val)
    for attr in ("cuda_stream", "ptr", "handle"):
        if hasattr(stream, attr):
            v = getattr(stream, attr)
            return int(v() if callable(v) else v)
    if isinstance(stream, cu.CUstream):
        return int(stream)
    raise TypeError(f"mkernel: cannot get a CUDA stream handle from {type(stream).__name__}; pass an "
                    "object with __cuda_stream__ or a raw CUstream handle (int)")


class Events:
    """Named CUDA events without timing (``Events("fork", "join").fork``), for fork/join between a
    caller's stream and a side stream; destroyed with the object (captured graphs keep no reference
    to them: inside a capture a record/wait pair becomes a graph dependency)."""

    def __init__(self, *names: str):
        flags = cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._names = names
        for n in names:
            setattr(self, n, check(cu.cuEventCreate(flags)))

    def __del__(self):
        try:
            for n in self._names:
                cu.cuEventDestroy(getattr(self, n))
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


# ---- eager fast paths --------------------------------------------------------------------------------
# An op called again with the same mkernel DeviceArrays (DeviceArray.call_key), stream and settings
# replays what its first call prepared: small calls are bound by host time in eager mode.  Each op
# builds its key (None: take the full path -- foreign arrays, whose memory may move under the same
# object) with its name first and the context's workspace generation in it (a reallocated workspace
# invalidates every prepared call); the entries live on the context, at most FAST_MAX of them.
FAST_MAX = 256


def fast_get(ctx, key):
    """What an op stored for ``key`` on context ``ctx`` (None: nothing, or ``key`` is None)."""
    return None if key is None else ctx.__dict__.get("_fast_calls", {}).get(key)


def fast_put(ctx, key, value) -> None:
    """Store ``value`` for ``key`` on ``ctx`` (nothing when ``key`` is None; all entries are dropped when
    there are FAST_MAX)."""
    if key is None:
        return
    cache = ctx.__dict__.setdefault("_fast_calls", {})
    if len(cache) >= FAST_MAX:
        cache.clear()
    cache[key] = value


def copy_async(copies, stream) -> None:
    """``cuMemcpyAsync`` of every ``(dst, src, bytes)`` of ``copies``, in order, on ``stream`` (a
    ``CUstream`` or anything stream_handle takes); a stream's copies run in that order, which the
    copy-engine paths rely on (data, then its flag)."""
    s = stream if isinstance(stream, cu.CUstream) else cu.CUstream(stream_handle(stream))
    memcpy = cu.cuMemcpyDtoDAsync
    for d, src, n in copies:
        r, = memcpy(d, src, n, s)
        if r != cu.CUresult.CUDA_SUCCESS:
            check((r,))


class ForkedCopies:
    """Copies forked from a caller's stream onto a side stream and joined back to it (the copy-engine
    paths of the collectives and AllGather+GEMM).  ``fork(s, begin)``: the side stream starts after
    ``s``'s work so far, first ``begin(side)`` (work enqueued on the side stream: a launch, or a stream
    wait for a word the caller's kernel raises), then the copies of ``copies(list)`` in order
    (a flag copied after its data lands after it).  ``resume(s)``: later copies start after ``s``'s work
    so far too.  ``join(s)``: ``s`` waits for the side stream.  Inside a graph capture the events
    become dependencies."""

    def __init__(self, side):
        self.side = cu.CUstream(int(side))
        self._ev = Events("fork", "join")

    def fork(self, s, begin=None) -> None:
        self.resume(s)
        if begin is not None:
            begin(self.side)

    def resume(self, s) -> None:
        check(cu.cuEventRecord(self._ev.fork, s))
        check(cu.cuStreamWaitEvent(self.side, self._ev.fork, 0))

    def copies(self, copies) -> None:
        copy_async(copies, self.side)

    def join(self, s) -> None:
        check(cu.cuEventRecord(self._ev.join, self.side))
        check(cu.cuStreamWaitEvent(s, self._ev.join, 0))


def _launch_config(grid, block, smem: int, hstream: int, cooperative: bool, cluster,
                   dependent: bool = False) -> "cu.CUlaunchConfig":
    grid = tuple(grid) + (1,) * (3 - len(grid)) if isinstance(grid, tuple) else (int(grid), 1, 1)
    block = tuple(block) + (1,) * (3 - len(block)) if isinstance(block, tuple) else (int(block), 1, 1)
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
    cfg.sharedMemBytes = smem
    cfg.hStream = cu.CUstream(hstream)
    attrs = []
    if cooperative:
        at = cu.CUlaunchAttribute()
        at.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        at.value.cooperative = 1
        attrs.append(at)
    if cluster is not None:
        at = cu.CUlaunchAttribute()
        at.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        cx, cy, cz = tuple(cluster) + (1,) * (3 - len(cluster))
        at.value.clusterDim.x, at.value.clusterDim.y, at.value.clusterDim.z = cx, cy, cz
        attrs.append(at)
    if dependent:  # programmatic dependent launch (the kernel waits: griddepcontrol.wait)
        at = cu.CUlaunchAttribute()
        at.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        at.value.programmaticStreamSerializationAllowed = 1
        attrs.append(at)
    cfg.attrs = attrs
    cfg.numAttrs = len(attrs)
    return cfg


class Kernel:
    """One ``__global__`` function of a :class:`Module`, launched through the driver API."""

    def __init__(self, module: Module, name: str):
        self.module = module
        self.name = name
        self._funcs: dict[int, object] = {}
        self._smem_set: dict[int, int] = {}
        self._configs: dict[tuple, object] = {}

    def _func(self):
        ctx = int(check(cu.cuCtxGetCurrent()))
        f = self._funcs.get(ctx)
        if f is None:
            f = check(cu.cuModuleGetFunction(self.module._module_handle(), self.name.encode()))
            self._funcs[ctx] = f
        return ctx, f

    def attribute(self, attr: cu.CUfunction_attribute) -> int:
        return int(check(cu.cuFuncGetAttribute(attr, self._func()[1])))

    def max_active_blocks_per_sm(self, block: int, smem: int = 0) -> int:
        ctx, f = self._func()
        self._ensure_smem(ctx, f, smem)
        return int(check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, block, smem)))

    def max_active_clusters(self, grid: int, block: int, smem: int, cluster: int) -> int:
        """How many clusters of ``cluster`` blocks (1-D) can be resident at once (cuOccupancyMaxActiveClusters):
        a persistent kernel launched in clusters must not ask for more, or the rest wait for the first
        ones to finish."""
        ctx, f = self._func()
        self._ensure_smem(ctx, f, smem)
        cfg = _launch_config(grid, block, smem, 0, False, (cluster, 1, 1))
        return int(check(cu.cuOccupancyMaxActiveClusters(f, cfg)))

    def _ensure_smem(self, ctx, f, smem):
        if smem > 48 * 1024 and self._smem_set.get(ctx, 0) < smem:
            check(cu.cuFuncSetAttribute(
                f, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
            self._smem_set[ctx] = smem

    def launch(self, grid, block, args: Iterable, *, stream=None, smem: int = 0,
               cooperative: bool = False, cluster: tuple | None = None, dependent: bool = False) -> None:
        """Launch on ``stream``.  ``args`` are ctypes scalars/structures or bytes (structs by value).
        ``dependent``: a programmatic dependent launch -- the kernel may start before the previous
        kernel in the stream completes, and must itself wait (``griddepcontrol.wait``) before it
        touches memory that kernel writes."""
        self.prepare(grid, block, args, stream=stream, smem=smem, cooperative=cooperative, cluster=cluster,
                     dependent=dependent).submit()

    def prepare(self, grid, block, args: Iterable, *, stream=None, smem: int = 0,
                cooperative: bool = False, cluster: tuple | None = None, dependent: bool = False) -> "PreparedLaunch":
        """The launch of :meth:`launch`, its configuration and parameter pointers packed once: calling
        the result launches (again and again, with the argument objects' current values)."""
        ctx, f = self._func()
        self._ensure_smem(ctx, f, smem)
        hstream = stream_handle(stream)
        key = (ctx, grid if isinstance(grid, int) else tuple(grid), block if isinstance(block, int) else tuple(block),
               smem, hstream, cooperative, None if cluster is None else tuple(cluster), bool(dependent))
        cfg = self._configs.get(key)
        if cfg is None:  # launch configurations are reused: ops launch the same shapes over and over
            cfg = _launch_config(grid, block, smem, hstream, cooperative, cluster, dependent)
            if len(self._configs) >= 64:
                self._configs.clear()
            self._configs[key] = cfg
        holders = []
        for a in args:
            if isinstance(a, (bytes, bytearray)):
                a = ctypes.create_string_buffer(bytes(a), len(a))
            elif not isinstance(a, (ctypes._SimpleCData, ctypes.Structure, ctypes.Array)):
                raise TypeError(f"kernel {self.name}: argument {a!r} must be a ctypes value or bytes")
            holders.append(a)
        ptrs = (ctypes.c_void_p * max(1, len(holders)))(*[ctypes.addressof(h) for h in holders])
        return PreparedLaunch(self.name, ctx, f, cfg, holders, ptrs)


class PreparedLaunch:
    """One kernel launch, packed (Kernel.prepare): calling it submits it.  It keeps its argument objects
    alive and reads their values at each call (a ctypes struct changed in place, e.g. a new timeout in
    an MkComm, is seen).  Raises if another CUDA context is current than the one it was prepared in."""

    __slots__ = ("name", "ctx", "f", "cfg", "holders", "ptrs", "_addr")

    def __init__(self, name, ctx, f, cfg, holders, ptrs):
        self.name, self.ctx, self.f, self.cfg, self.holders, self.ptrs = name, ctx, f, cfg, holders, ptrs
        self._addr = ctypes.addressof(ptrs)

    def __call__(self) -> None:
        err, cur = cu.cuCtxGetCurrent()
        if err != cu.CUresult.CUDA_SUCCESS or int(cur) != self.ctx:
            raise RuntimeError(f"kernel {self.name}: prepared in another CUDA context than the current one")
        self.submit()

    def submit(self) -> None:
        """Launch (the context it was prepared in must be current: Kernel.launch just made sure)."""
        r, = cu.cuLaunchKernelEx(self.cfg, self.f, self._addr, 0)
        if r != cu.CUresult.CUDA_SUCCESS:
            check((r,))
