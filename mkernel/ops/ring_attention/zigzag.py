"""Zigzag sharding of a sequence for causal ring attention: rank r of P holds chunks r and 2P-1-r of the
2P equal chunks, so every rank has the same causal work (docs/ring_attention.md, "Zigzag sharding").
Host index math (:func:`mkernel.ops.ring_attention.plan.zigzag_indices`) and strided device copies."""
from __future__ import annotations

import numpy as np

from ...core.arrays import DeviceArray
from ...core.device import on_device
from ...core.interop import as_device_array
from ..base import as_stream
from ..gemm_comm import copy_2d
from .plan import zigzag_chunks, zigzag_indices

__all__ = ["zigzag_shard", "zigzag_unshard"]


def _rank_p(where) -> tuple[int, int]:
    if isinstance(where, tuple):
        rank, P = where
    elif where.num_nodes > 1:  # a Context across nodes: the ring runs over the world's ranks
        rank, P = where.rank, where.size
    else:  # a Context of one node: over the node's ranks
        rank, P = where.local_rank, where.local_size
    rank, P = int(rank), int(P)
    if P < 1 or not 0 <= rank < P:
        raise ValueError(f"zigzag: rank {rank} out of range for {P} ranks")
    return rank, P


def _geometry(shape, seq_dim: int, P: int, what: str) -> tuple[int, int, int, int]:
    """(seq_dim normalized, outer count, sequence length, chunk length)."""
    nd = len(shape)
    if not -nd <= seq_dim < nd:
        raise ValueError(f"{what}: seq_dim {seq_dim} out of range for a {nd}-D array")
    d = seq_dim % nd
    S = shape[d]
    if S % (2 * P):
        raise ValueError(f"{what}: the sequence length {S} (dim {d}) must be a multiple of 2 * P = {2 * P}")
    return d, int(np.prod(shape[:d], dtype=np.int64)), S, S // (2 * P)


def _device_move(x: DeviceArray, d: int, outer: int, S: int, c: int, pieces, out_len: int, stream) -> DeviceArray:
    """Copy chunk pieces ``(src chunk, dst chunk)`` along dim d of the C-contiguous ``x`` into a new array whose
    dim d has ``out_len`` rows."""
    if not x.is_contiguous():
        raise ValueError("zigzag: the device array must be C-contiguous")
    shape = list(x.shape)
    shape[d] = out_len
    out = DeviceArray.empty(tuple(shape), x.dtype, device=x.device)
    row = int(np.prod(x.shape[d + 1:], dtype=np.int64)) * x.dtype.itemsize  # bytes of one sequence position
    with on_device(x.device):
        for src_chunk, dst_chunk in pieces:
            copy_2d(out.ptr + dst_chunk * c * row, out_len * row, x.ptr + src_chunk * c * row, S * row,
                       c * row, outer, stream)
    return out


def zigzag_shard(x, where, seq_dim: int = 1, *, stream=None):
    """This rank's zigzag shard of the full sequence ``x``: positions of chunk ``r`` then chunk ``2P - 1 - r``
    along ``seq_dim`` (the sequence cut into 2P equal chunks; its length must be a multiple of 2P).

    ``where``: a :class:`mkernel.Context` (local rank and size; world rank and size when it spans several
    nodes) or ``(rank, P)``.  ``x``: a numpy array
    (returns numpy) or any CUDA array, C-contiguous (returns a new :class:`mkernel.DeviceArray` filled by
    copies on ``stream``, asynchronous).  ``seq_dim``: 1 for ``[B, S, H, D]``, 2 for ``[B, H, S, D]``."""
    rank, P = _rank_p(where)
    if isinstance(x, np.ndarray):
        d, _, S, _ = _geometry(x.shape, seq_dim, P, "zigzag_shard")
        return np.take(x, zigzag_indices(S, P, rank), axis=d)
    s = as_stream(stream)
    X = as_device_array(x, name="zigzag_shard: x", stream=s)
    d, outer, S, c = _geometry(X.shape, seq_dim, P, "zigzag_shard")
    lo, hi = zigzag_chunks(rank, P)
    return _device_move(X, d, outer, S, c, ((lo, 0), (hi, 1)), 2 * c, s)


def zigzag_unshard(x, P: int, seq_dim: int = 1, *, stream=None):
    """The natural-order sequence from ``x``, the P ranks' zigzag shards concatenated in rank order along
    ``seq_dim`` (what an all-gather of the shards gives).  numpy in, numpy out; a CUDA array in (C-contiguous),
    a new :class:`mkernel.DeviceArray` out (copies on ``stream``)."""
    P = int(P)
    if P < 1:
        raise ValueError(f"zigzag_unshard: P must be >= 1, got {P}")
    if isinstance(x, np.ndarray):
        d, _, S, _ = _geometry(x.shape, seq_dim, P, "zigzag_unshard")

        order = np.concatenate([zigzag_indices(S, P, r) for r in range(P)])
        return np.take(x, np.argsort(order, kind="stable"), axis=d)
    s = as_stream(stream)
    X = as_device_array(x, name="zigzag_unshard: x", stream=s)
    d, outer, S, c = _geometry(X.shape, seq_dim, P, "zigzag_unshard")
    pieces = []
    for r in range(P):
        lo, hi = zigzag_chunks(r, P)
        pieces += [(2 * r, lo), (2 * r + 1, hi)]
    return _device_move(X, d, outer, S, c, pieces, S, s)
