"""Every ``MKERNEL_*`` environment variable, read in one place.

Behaviour is chosen with options objects (``GemmOptions``, ``CollectiveOptions``, ``AgGemmOptions``)
passed as ``options=``; the variables below are documented overrides for deployment (where ranks find
GPUs, NICs, the cache) and for experiments (forcing a path or a tile config without editing code).
They are read once, at import, into a snapshot: :func:`reload` re-reads them (tests, benchmarks that
change the environment in-process).  An op's default options are derived from the snapshot, so the
variables enter every cache key through the options, never through ``os.environ`` on the hot path.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

__all__ = ["VARIABLES", "get", "reload", "generation", "describe"]


@dataclass(frozen=True)
class Variable:
    name: str
    parse: Callable[[str], object]
    doc: str


def _int(s: str) -> int:
    return int(s, 0)


def _str(s: str) -> str:
    return s.strip()


def _ints(s: str) -> tuple:
    return tuple(int(x) for x in s.replace(",", " ").split())


def _tristate(s: str):
    """``auto`` / empty -> None, ``0`` -> False, ``1`` -> True."""
    v = s.strip().lower()
    if v in ("", "auto"):
        return None
    if v in ("0", "1"):
        return v == "1"
    raise ValueError(f"expected auto, 0 or 1, got {s!r}")


VARIABLES = {v.name: v for v in [
    # deployment
    Variable("MKERNEL_DEVICE", _int, "GPU ordinal of this rank (default: the rank's index on its host)"),
    Variable("MKERNEL_RANKS_PER_NODE", _int, "emulated nodes of this many ranks (inter-node paths on one host)"),
    Variable("MKERNEL_TIMEOUT", float, "seconds every wait of a context may take (default 5)"),
    Variable("MKERNEL_CACHE_DIR", _str, "NVRTC cubin cache directory (default ~/.cache/mkernel)"),
    Variable("MKERNEL_CUDA_INCLUDE", _str, "extra CUDA header directories for NVRTC (os.pathsep-separated)"),
    Variable("MKERNEL_TRANSPORT", _str, "inter-node transport: verbs or tcp"),
    Variable("MKERNEL_TCP_ADDR", _str, "address this rank's TCP transport listens on and advertises"),
    Variable("MKERNEL_IB_DEVICE", _str, "RDMA device (and port: mlx5_0:1) for the verbs transport"),
    Variable("MKERNEL_IB_GID_INDEX", _int, "GID index for RoCE"),
    Variable("MKERNEL_VERBS_NOTIFY", _str, "verbs flag delivery: write or send"),
    Variable("MKERNEL_VERBS_BOUNCE", _tristate, "verbs: stage GPU payloads through host memory (1) or not (0)"),
    Variable("MKERNEL_LOG", _str, "stderr handler for the 'mkernel' logger: 1 or info (compiles, workspaces, "
                                  "fallbacks), 2 or debug (also every new plan)"),
    # experiments: compile-time switches
    Variable("MKERNEL_DEFINES", _str, "extra -D defines for every kernel (NAME or NAME=VALUE, comma-separated)"),
    # GEMM (GemmOptions)
    Variable("MKERNEL_GEMM_CONFIG", _int, "force a GEMM tile config id"),
    Variable("MKERNEL_GEMM_CANDIDATES", _ints, "restrict the heuristic's tile configs (comma-separated ids)"),
    Variable("MKERNEL_GEMM_PDL", _tristate, "programmatic dependent launch: auto, 0 or 1"),
    Variable("MKERNEL_GEMM_SWAP", _tristate, "transposed plans for B [N, K] calls: auto or 0"),
    Variable("MKERNEL_GEMM_GEMV", _tristate, "the decode kernel for M <= 16: auto or 0"),
    Variable("MKERNEL_GEMM_EPILOGUE", _str, "tma (default) or registers"),
    # collectives (CollectiveOptions)
    Variable("MKERNEL_COLL_CE", _tristate, "copy-engine path: auto, 0 or 1"),
    Variable("MKERNEL_COLL_CE_MIN_BYTES", _int, "per-peer bytes from which the copy engines carry a collective"),
    Variable("MKERNEL_COLL_CE_MAX_CHUNKS", _int, "copy-engine chunks per peer slot"),
    Variable("MKERNEL_COLL_CE_TAIL_PIECES", _int, "pieces of a copy-engine slot's last chunk"),
    Variable("MKERNEL_COLL_CE_BLOCKS", _int, "receiving blocks on the copy-engine path (0: all SMs but one)"),
    Variable("MKERNEL_COLL_ONE_SHOT_MAX_BYTES", _int, "all-reduce bytes up to which every rank reduces everything"),
    Variable("MKERNEL_COLL_MIN_CHUNK", _int, "smallest chunk of the SM path (bytes)"),
    Variable("MKERNEL_COLL_MAX_BLOCKS", _int, "blocks of the SM path (0: one per SM)"),
    # AllGather + GEMM (AgGemmOptions)
    Variable("MKERNEL_AG_GEMM_PATH", _str, "force fused_ce, fused or unfused"),
    Variable("MKERNEL_AG_GEMM_TAIL_SPLIT", _tristate, "split the fused kernel's last wave along K: auto, 0 or 1"),
    Variable("MKERNEL_AG_GEMM_MODEL", _str, "cost-model overrides: field=value,..."),
    Variable("MKERNEL_AG_GEMM_FUSED_AUTO", _tristate, "let the planner choose the SM-communication path (1)"),
]}

_snapshot: dict[str, object] = {}
_generation = 0
_error: ValueError | None = None  # a malformed variable, raised at first use rather than at import


def reload() -> None:
    """Re-read every variable (a malformed value raises ValueError naming the variable)."""
    global _snapshot, _generation, _error
    snap = {}
    _generation += 1
    for name, var in VARIABLES.items():
        raw = os.environ.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            snap[name] = var.parse(raw)
        except ValueError as exc:
            _error = ValueError(f"mkernel: environment variable {name}={raw!r}: {exc}")
            raise _error from None
    _snapshot, _error = snap, None


def get(name: str, default=None):
    """The parsed value of ``name`` in the snapshot, or ``default`` when unset."""
    if _error is not None:
        raise _error
    if name not in VARIABLES:
        raise KeyError(f"{name} is not an mkernel environment variable")
    return _snapshot.get(name, default)


def generation() -> int:
    """Bumped by every :func:`reload` (options derived from the snapshot are cached on it)."""
    return _generation


def describe() -> list[tuple[str, str, object]]:
    """``(name, doc, current value or None)`` of every variable (``python -m mkernel info``)."""
    return [(v.name, v.doc, _snapshot.get(v.name)) for v in VARIABLES.values()]


try:
    reload()
except ValueError:
    pass  # (kept in _error: raised by get)
