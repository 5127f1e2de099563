"""Run-time compilation of ``cuda_src/`` with NVRTC and an on-disk cubin cache.

Kernels are compiled on first use for the architecture of the current device (``sm_90a`` on
Hopper), with C++17, the CUDA headers taken from the installed ``nvidia-cuda-runtime`` wheel (or a
CUDA toolkit), and specializations passed as preprocessor defines.  A cubin is cached on disk under
``$MKERNEL_CACHE_DIR`` (default ``~/.cache/mkernel``, mode 0700), keyed by the source text of the
kernel and every header it includes, the content of the CUDA headers the compile reads, the
options, the architecture and the NVRTC version: a second process start compiles nothing.  A cubin
is loaded only if it matches the SHA-256 recorded with it (else it is recompiled and overwritten);
a cache directory that cannot be created or written, or that others can write, turns the disk
cache off with one warning per process.  Every op registers the specializations it can launch
(:func:`register_specialization`), so CI and :func:`precompile` can compile all of them.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from cuda.bindings import driver as cu
from cuda.bindings import nvrtc

from ..errors import CompileError
from .archs import require_nvrtc_arch
from .device import on_device
from .driver import capture_relaxed, check, current_arch
from .launch import Kernel
from .log import define_summary, log

__all__ = ["cuda_src_dir", "include_dirs", "nvrtc_version", "cache_path", "cache_dir", "compile_module", "Module",
           "kernel", "register_specialization", "registered_specializations", "precompile", "precompile_source",
           "parse_ptxas_log"]


def cuda_src_dir() -> Path:
    """The kernel sources: ``cuda_src/`` beside the package in a source tree, else the installed copy."""
    package = Path(__file__).resolve().parent.parent  # mkernel/
    for cand in (package.parent / "cuda_src", package / "cuda_src"):
        if (cand / "core" / "mk_common.cuh").is_file():
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


_cache_warned = False


def _warn_cache(msg: str) -> None:
    """One warning per process: the disk cache is off, modules compile in memory."""
    global _cache_warned
    if not _cache_warned:
        _cache_warned = True
        warnings.warn(f"mkernel: {msg}; kernels compile in memory, without the disk cache", RuntimeWarning,
                      stacklevel=4)


def cache_path() -> Path:
    """Where the cubin cache is (``$MKERNEL_CACHE_DIR``, default ``~/.cache/mkernel``), created or not."""
    return Path(os.environ.get("MKERNEL_CACHE_DIR") or Path.home() / ".cache" / "mkernel")


def cache_dir() -> Path | None:
    """The cubin cache: ``$MKERNEL_CACHE_DIR`` (default ``~/.cache/mkernel``), created with mode
    0700 (an existing directory's mode is left alone).  None, after one warning per process, when
    it cannot be created or is not private: owned by another user, or writable by group or others
    (whoever can write there can make this process load their code)."""
    try:
        d = cache_path()
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = d.stat()
    except (OSError, RuntimeError) as exc:
        _warn_cache(f"cannot create the kernel cache directory ({exc})")
        return None
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        _warn_cache(f"the kernel cache directory {d} belongs to uid {st.st_uid}, not to this user")
        return None
    if st.st_mode & 0o022:
        _warn_cache(f"the kernel cache directory {d} is writable by group or others "
                    f"(mode {stat.S_IMODE(st.st_mode):o}; chmod 700 it)")
        return None
    return d


_CUBIN_DIGEST = "mkernel-cubin-sha256 "  # first line of a cache entry's .log: the cubin's SHA-256


def _load_cached(cubin_path: Path, log_path: Path) -> tuple[bytes, str] | None:
    """(cubin, log) of a cache entry whose cubin matches the SHA-256 its log file records; None for
    a missing, unreadable, truncated or altered entry (the caller recompiles and overwrites it)."""
    try:
        cubin = cubin_path.read_bytes()
        head, _, text = log_path.read_text().partition("\n")
    except (OSError, UnicodeDecodeError):
        return None
    want = head[len(_CUBIN_DIGEST):] if head.startswith(_CUBIN_DIGEST) else ""
    if not hmac.compare_digest(want, hashlib.sha256(cubin).hexdigest()):
        log.warning("mkernel: cache entry %s failed its integrity check; recompiling", cubin_path)
        return None
    return cubin, text


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (mode 0600) through a fresh temporary file and a rename, so that a
    reader sees the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _store_cached(d: Path, cubin_path: Path, log_path: Path, cubin: bytes, log: str) -> None:
    """Cubin first, then the log that carries its digest (a reader between the two sees a mismatch
    and recompiles).  A write failure turns the disk cache off for this process (one warning)."""
    try:
        _write_atomic(cubin_path, cubin)
        _write_atomic(log_path, (_CUBIN_DIGEST + hashlib.sha256(cubin).hexdigest() + "\n" + log).encode())
    except OSError as exc:
        _warn_cache(f"cannot write to the kernel cache directory {d} ({exc})")


_HEADER_RE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
_SYSTEM_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*<([^>]+)>', re.M)
_header_digests: dict[tuple, str] = {}


def _cuda_headers_digest(roots) -> str:
    """SHA-256 over the CUDA headers a compile reads from :func:`include_dirs`: the ``<...>``
    headers ``roots`` names and every header they include, transitively (conditional includes
    too), each resolved like the preprocessor (the including file's directory for a quoted name,
    then the include directories in order).  So an upgrade of the CUDA headers (the
    nvidia-cuda-runtime wheel or a toolkit) is a new cache key.  Headers found in none of the
    directories (NVRTC's built-in standard headers) are keyed by the NVRTC version instead."""
    dirs = [Path(d) for d in include_dirs()]
    key = (tuple(sorted(roots)), tuple(dirs))
    digest = _header_digests.get(key)
    if digest is not None:
        return digest
    h = hashlib.sha256()
    seen: set[str] = set()
    todo = [(name, None) for name in sorted(roots)]
    while todo:
        name, parent = todo.pop()
        cands = ([parent / name] if parent is not None else []) + [d / name for d in dirs]
        path = next((p for p in cands if p.is_file()), None)
        ident = str(path) if path is not None else name
        if ident in seen:
            continue
        seen.add(ident)
        if path is None:
            h.update(b"missing\0" + name.encode() + b"\0")
            continue
        data = path.read_bytes()
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
        todo += [(inc, path.parent) for inc in _HEADER_RE.findall(data.decode("latin-1"))]
    digest = _header_digests[key] = h.hexdigest()
    return digest


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
    require_nvrtc_arch(arch)
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
    roots = {inc for text in sources.values() for inc in _SYSTEM_INCLUDE_RE.findall(text)}
    h.update(_cuda_headers_digest(roots).encode())
    key = h.hexdigest()[:32]
    mem_key = (source, key)
    with _module_cache_lock:
        mod = _module_cache.get(mem_key)
    if mod is not None:
        return mod
    stem = f"{Path(source).stem}-{arch}-{key}"
    d = cache_dir() if use_disk_cache else None
    cubin_path = d / f"{stem}.cubin" if d is not None else None
    log_path = d / f"{stem}.log" if d is not None else None
    hit = _load_cached(cubin_path, log_path) if d is not None else None
    what = f"{source} {define_summary(defines)}".rstrip()
    if hit is not None:
        mod = Module(source, defines, arch, hit[0], hit[1], 0.0, True)
        log.debug("loaded %s for %s from the disk cache (%s)", what, arch, d)
    else:
        log.info("compiling %s for %s (%s)", what, arch, f"cached in {d}" if d is not None else "disk cache off")
        t0 = time.perf_counter()
        prog = check(nvrtc.nvrtcCreateProgram(sources[source].encode(), source.encode(), 0, [], []))
        try:
            opts = [o.encode() for o in options]
            err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
            size = check(nvrtc.nvrtcGetProgramLogSize(prog))
            buf = b" " * size
            check(nvrtc.nvrtcGetProgramLog(prog, buf))
            nvrtc_log = buf.decode(errors="replace").rstrip("\0 \n")
            if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
                raise CompileError(source, defines, arch, nvrtc_log)
            size = check(nvrtc.nvrtcGetCUBINSize(prog))
            cubin = b" " * size
            check(nvrtc.nvrtcGetCUBIN(prog, cubin))
        finally:
            nvrtc.nvrtcDestroyProgram(prog)
        dt = time.perf_counter() - t0
        log.info("compiled %s for %s in %.1f s", what, arch, dt)
        mod = Module(source, defines, arch, cubin, nvrtc_log, dt, False)
        if d is not None:
            _store_cached(d, cubin_path, log_path, cubin, nvrtc_log)
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
        with on_device(None):
            arch = current_arch()
    if specs is None:
        specs = [d for src, d in registered_specializations() if src == source]
    return precompile([(source, d) for d in specs], arch=arch, workers=workers)


def precompile(specs, *, arch: str, workers: int | None = None, progress=None) -> float:
    """Compile ``(source, defines)`` pairs for ``arch`` into the disk cache, in parallel worker
    processes (NVRTC is single-threaded per program); returns the summed NVRTC seconds (0 for cubins
    already cached).  Later ``compile_module`` calls load them from disk.  ``progress(done, total,
    source, defines, seconds)`` is called as results arrive, in the order of ``specs`` (``seconds`` 0:
    it was cached).  The workers are spawned and import the main module: a script calling this must do
    so under ``if __name__ == "__main__":``; where the workers die anyway, it warns and compiles in
    this process."""
    import concurrent.futures as cf
    import multiprocessing as mp

    items = [(src, dict(d), arch) for src, d in specs]
    workers = workers or max(1, min(len(items), (os.cpu_count() or 2)))

    def collect(seconds) -> float:
        total = 0.0
        for done, (item, dt) in enumerate(zip(items, seconds), 1):
            total += dt
            if progress is not None:
                progress(done, len(items), item[0], item[1], dt)
        return total

    if workers == 1 or len(items) <= 1:
        return collect(_compile_one(it) for it in items)
    try:
        with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            return collect(ex.map(_compile_one, items))
    except cf.process.BrokenProcessPool:
        import warnings

        warnings.warn("mkernel.precompile: the compile worker processes died (spawned workers import the main "
                      "module: call precompile under `if __name__ == '__main__':`); compiling in this process",
                      RuntimeWarning, stacklevel=2)
        return collect(_compile_one(it) for it in items)
