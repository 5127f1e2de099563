"""AllGather+GEMM's device-facing layout: the kernel source and its specializations, the argument struct
(``AgArgs``) and the symmetric workspace -- pure functions of the agreed call.

Workspace of local rank j (the same offsets on every local rank; cuda_src/ops/ag_gemm.cu has the picture)::

    [0]             epoch state                         (signals.workspace_control)
    [consumed_off]  call header: consumed[P], entered[P], sig[P][2]
    [flags_off]     ready[src][MAX_CHUNKS] u64          ready[src][c] = call that delivered src's chunk c
    [value_off]     u64[CE_VALUES]                      copy-engine path: the call number, copied into flags
    [go_off]        u32                                 copy-engine path: "the side stream's copies may start"
    [data_off]      the gathered A, [M_total, K]        rank j's rows at row offs[j]

Everything before ``data_off`` depends on P only (docs/design.md, "Control words never move"): a call of
another shape never finds its flags or its go word on bytes an earlier call left as data.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ...core.compiler import register_specialization
from ...core.util import round_up
from ...dist.signals import MAX_CHUNKS, workspace_control
from .. import gemm as G  # the GEMM package's public planning API

__all__ = ["SOURCE", "MAXP", "FUSED_CONFIGS", "CE_VALUES", "GATHER_THREADS", "RELEASE_THREADS", "AgArgs", "Layout",
           "workspace_layout", "kernel_defines", "MAX_CHUNKS"]

SOURCE = "ops/ag_gemm.cu"
MAXP = 16  # local ranks (the kernel keeps the source rank in 4 bits of the tile id)
GATHER_THREADS = 512
RELEASE_THREADS = 128
FUSED_CONFIGS = (1, 2, 3, 4, 5)  # 0 is the debug config (config=0 forces it); 5: 128x224 with B "nk" only
# Copy-engine path: flag-value slots in the workspace (cuda_src/ops/ag_gemm.cu AG_CE_VALUES): one flag copy
# raises up to this many consecutive ready flags, so a copy of that many chunks costs two operations.
CE_VALUES = 64


def kernel_defines(in_dtype: str, out_dtype: str, config: int) -> dict:
    """The specialization of ag_gemm.cu: the GEMM's defines of (in, out, config)."""
    return G.defines(in_dtype, out_dtype, config)


# CI compiles these (tests/cpu/test_runtime.py): every fused config and the debug config, bf16 / fp16 in,
# out of the input dtype or fp32.
for _i in G.IN_DTYPES:
    for _o in (_i, "float32"):
        for _c in (0,) + FUSED_CONFIGS:
            register_specialization(SOURCE, kernel_defines(_i, _o, _c))


class AgArgs(ctypes.Structure):
    """Mirror of ``struct AgArgs`` in cuda_src/ops/ag_gemm.cu (240 bytes)."""

    _fields_ = [
        ("a_shard", ctypes.c_void_p), ("ws", ctypes.c_void_p), ("peers", ctypes.c_void_p),
        ("c", ctypes.c_void_p), ("gathered_out", ctypes.c_void_p),
        ("row_bytes", ctypes.c_uint64), ("data_off", ctypes.c_uint64), ("flags_off", ctypes.c_uint64),
        ("consumed_off", ctypes.c_uint64), ("ldc", ctypes.c_int64),
        ("M_total", ctypes.c_int32), ("N", ctypes.c_int32), ("K", ctypes.c_int32),
        ("chunk_rows", ctypes.c_int32), ("nch_stride", ctypes.c_int32), ("n_comm", ctypes.c_int32),
        ("group_m", ctypes.c_int32), ("c_vec_ok", ctypes.c_int32), ("gather_only", ctypes.c_int32),
        ("P", ctypes.c_int32), ("me", ctypes.c_int32), ("ce_value_off", ctypes.c_int32),
        ("local_map", ctypes.c_int32),
        ("offs", ctypes.c_int32 * (MAXP + 1)),
        ("c_tma", ctypes.c_int32),
        ("partials", ctypes.c_void_p), ("counters", ctypes.c_void_p),
        ("splits", ctypes.c_int32), ("split_from", ctypes.c_int32),
        ("ce_go_off", ctypes.c_int32),
    ]


assert ctypes.sizeof(AgArgs) == 240


@dataclass(frozen=True)
class Layout:
    """The workspace of one agreed call (byte offsets; ``total``: bytes)."""

    consumed_off: int
    flags_off: int
    value_off: int  # copy-engine path: CE_VALUES u64, the call number the copy engines copy into ready flags
    go_off: int  # copy-engine path: the u32 the side stream waits on before its copies
    data_off: int
    nch_stride: int
    total: int


def workspace_layout(P: int, m_sizes, chunk_rows: int, row_bytes: int) -> Layout:
    """The workspace for P local ranks holding ``m_sizes`` rows of ``row_bytes``, cut into chunks of
    ``chunk_rows`` rows.  Every control word's offset depends on P only: the workspace is shared by every
    call of the op, and a word that moved with the call's shape could land on bytes an earlier call left
    in its data region -- rows read as a raised flag (a GEMM reading rows that have not arrived), or a
    stale 1 as the copy engines' go word."""
    nch = max([-(-m // chunk_rows) for m in m_sizes] + [1])
    if nch > MAX_CHUNKS:  # (the planner's chunkings never cut a shard into more)
        raise AssertionError(f"ag_gemm: {nch} chunks per shard, the workspace has flags for {MAX_CHUNKS}")
    consumed_off, flags_off, value_off = workspace_control(P, P)
    go_off = value_off + 8 * CE_VALUES
    data_off = round_up(go_off + 8, 4096)
    return Layout(consumed_off, flags_off, value_off, go_off, data_off, MAX_CHUNKS,
                  data_off + max(1, sum(m_sizes)) * row_bytes)
