"""``python -m mkernel precompile``: compile every specialization the chosen ops can launch into the disk
cache, one progress line per finished specialization.  With ``--arch`` it needs no GPU (a login node, an
image build); without, it compiles for GPU 0 of this machine."""
from __future__ import annotations

import sys
import time

__all__ = ["OPS", "sources_for", "add_parser", "run"]

_GEMM = ("gemm/gemm.cu", "gemm/gemv.cu")
_COLLECTIVES = ("ops/collectives.cu", "ops/internode.cu")
# op -> the kernel sources it may launch (the unfused paths of the fused ops run gemm and the collectives)
_ATTENTION = ("ops/attention_fwd.cu", "ops/attention_bwd.cu")
OPS = {
    "gemm": _GEMM,
    "collectives": _COLLECTIVES,
    "ag_gemm": ("ops/ag_gemm.cu",) + _GEMM,
    "gemm_rs": ("ops/gemm_rs.cu",) + _GEMM + _COLLECTIVES,
    "gemm_ar": ("ops/gemm_ar.cu",) + _GEMM + _COLLECTIVES,
    "moe": ("ops/moe.cu", "ops/moe_gemm.cu", "ops/moe_internode.cu", "gemm/gemm_swiglu.cu",
            "ops/moe_gemm_combine.cu", "ops/moe_layer.cu") + _GEMM,
    "attention": _ATTENTION,
    "ring_attention": ("ops/ring_attention.cu", "ops/ring_attention_x.cu", "ops/ring_attention_fused.cu") + _ATTENTION,
}
_HOPPER_ONLY = ("gemm/gemm.cu", "gemm/gemv.cu", "ops/ag_gemm.cu", "ops/gemm_rs.cu", "ops/gemm_ar.cu",
                "ops/moe_gemm.cu", "gemm/gemm_swiglu.cu", "ops/moe_gemm_combine.cu", "ops/moe_layer.cu") + _ATTENTION
_ALIASES = {"grouped_gemm": "gemm", "all_gather": "collectives", "reduce_scatter": "collectives",
            "all_reduce": "collectives", "gemm_reduce_scatter": "gemm_rs", "gemm_all_reduce": "gemm_ar",
            "moe_route": "moe", "moe_dispatch": "moe", "moe_combine": "moe", "moe_dispatch_gemm": "moe",
            "moe_gemm_combine": "moe", "moe_layer": "moe", "grouped_gemm_swiglu": "moe", "attention_backward": "attention",
            "ring_attention_backward": "ring_attention"}


def sources_for(ops) -> list[str]:
    """The kernel sources of ``ops`` (names of :data:`OPS` or the public op names), in a stable order;
    ValueError for an unknown name."""
    out: list[str] = []
    for op in ops:
        key = _ALIASES.get(op, op)
        if key not in OPS:
            raise ValueError(f"unknown op {op!r}: choose from {', '.join(sorted(set(OPS) | set(_ALIASES)))}")
        out += [s for s in OPS[key] if s not in out]
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("precompile", help="compile kernels into the disk cache",
                       description="Compile the kernels of the chosen ops into the disk cache "
                                   "($MKERNEL_CACHE_DIR, default ~/.cache/mkernel).")
    p.add_argument("--ops", default=",".join(OPS),
                   help=f"comma-separated ops (default: all: {','.join(OPS)})")
    p.add_argument("--arch", default=None, help="target architecture, e.g. sm_90a (default: GPU 0's; no GPU needed "
                                                "when given)")
    p.add_argument("--workers", type=int, default=None, help="parallel compile processes (default: one per CPU)")
    p.set_defaults(run=run)


def _arch(arch):
    if arch is not None:
        return arch
    from ..core.device import on_device
    from ..core.driver import current_arch

    with on_device(0):
        return current_arch()


def run(args) -> int:
    import mkernel  # noqa: F401 -- the ops register their specializations at import
    from ..core.archs import arch_runs_gemm
    from ..core.compiler import cache_dir, precompile, registered_specializations
    from ..core.log import define_summary
    from ..errors import MkernelError

    try:
        sources = sources_for([o.strip() for o in args.ops.split(",") if o.strip()])
        arch = _arch(args.arch)
    except (ValueError, MkernelError) as exc:
        hint = "" if args.arch else " (pass --arch sm_90a to compile without a GPU)"
        print(f"mkernel precompile: {exc}{hint}", file=sys.stderr)
        return 2
    gemm_sources = [s for s in sources if s in _HOPPER_ONLY]
    if gemm_sources and not arch_runs_gemm(arch):
        print(f"mkernel precompile: {', '.join(gemm_sources)} run on Hopper only (sm_90a), not {arch}; for {arch} "
              "precompile --ops collectives", file=sys.stderr)
        return 2
    d = cache_dir()
    if d is None:
        print("mkernel precompile: the disk cache is off (see the warning above): nothing would be kept",
              file=sys.stderr)
        return 1
    specs = [(s, dict(defs)) for s in sources for src, defs in registered_specializations() if src == s]
    print(f"mkernel precompile: {len(specs)} specializations of {', '.join(sources)} for {arch} into {d}",
          flush=True)
    width = len(str(len(specs)))

    def progress(done, total, source, defines, seconds):
        took = f"{seconds:.1f} s" if seconds > 0 else "cached"
        print(f"[{done:{width}}/{total}] {source} {define_summary(defines)}: {took}", flush=True)

    t0 = time.perf_counter()
    try:
        nvrtc_s = precompile(specs, arch=arch, workers=args.workers, progress=progress)
    except MkernelError as exc:
        print(f"mkernel precompile: {exc}", file=sys.stderr)
        return 1
    print(f"mkernel precompile: done in {time.perf_counter() - t0:.1f} s ({nvrtc_s:.1f} s of NVRTC)", flush=True)
    return 0
