"""NVRTC compiles for the CPU tests (no GPU needed): one translation unit with the project's include paths."""
from __future__ import annotations

from mkernel.core import compiler as CP


def nvrtc_compile(src: str, name: str, arch: str = "sm_90a", extra=()) -> tuple[bool, str, str]:
    """Compile ``src`` (file name ``name``) for ``arch`` with -std=c++17, cuda_src/ and the include
    directories on the path, and the ``extra`` options: ``(ok, NVRTC's log, PTX)``; the PTX only for a
    virtual ``arch`` (``compute_90a``) that compiled, else ''."""
    from cuda.bindings import nvrtc

    opts = ["-std=c++17", f"--gpu-architecture={arch}", *(f"-I{d}" for d in [str(CP.cuda_src_dir()), *CP.include_dirs()]),
            *extra]
    prog = nvrtc.nvrtcCreateProgram(src.encode(), name.encode(), 0, [], [])[1]
    try:
        err, = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        ok = err == nvrtc.nvrtcResult.NVRTC_SUCCESS
        log = b" " * nvrtc.nvrtcGetProgramLogSize(prog)[1]
        nvrtc.nvrtcGetProgramLog(prog, log)
        ptx = b""
        if ok and arch.startswith("compute_"):
            ptx = b" " * nvrtc.nvrtcGetPTXSize(prog)[1]
            nvrtc.nvrtcGetPTX(prog, ptx)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return ok, log.decode(errors="replace"), ptx.decode(errors="replace")
