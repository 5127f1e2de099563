"""How the collectives run: the options object (``options=``) and its defaults.

Every field's default is the measured choice on 2x H200 (docs/collectives.md); the environment
overrides of :mod:`mkernel.core.env` apply to the default object only.  Every rank must pass equal
options: the path they select is part of the agreed call signature.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ...core import env
from ..base import options_hash

__all__ = ["CollectiveOptions"]

MiB = 1 << 20


@dataclass(frozen=True)
class CollectiveOptions:
    """Options of :func:`mkernel.all_gather`, :func:`mkernel.reduce_scatter`, :func:`mkernel.all_reduce`.

    ``copy_engines``: carry the data with the copy engines (True), with SM stores (False), or decide by
    size (None: from ``ce_min_bytes_*`` per-peer bytes up, where the copy engines' higher peer bandwidth
    pays for their ~50 us of extra latency).  ``ce_max_chunks``: copy-engine chunks per peer slot (each a
    copy and a flag copy; the last one's local work is exposed); ``ce_tail_pieces``: pieces of the last
    chunk; ``ce_blocks``: receiving blocks (0: all SMs but one).  ``one_shot_max_bytes``: all-reduce
    buffers up to this size are reduced by every rank in full (one flag hop; None: 256 KiB, 32 MiB with
    2 local ranks, where it moves no more bytes per link direction than reduce-scatter + all-gather).
    ``min_chunk``: smallest chunk of the SM path; ``max_blocks``: blocks of the SM path (0: one per SM).
    """

    copy_engines: bool | None = None
    ce_min_bytes_all_gather: int = 256 * MiB
    ce_min_bytes_reduce_scatter: int = 64 * MiB
    ce_min_bytes_all_reduce: int = 64 * MiB
    ce_max_chunks: int = 8
    ce_tail_pieces: int = 4
    ce_blocks: int = 0
    one_shot_max_bytes: int | None = None
    min_chunk: int = 32 * 1024
    max_blocks: int = 0

    def ce_min_bytes(self, op: str) -> int:
        return getattr(self, "ce_min_bytes_" + op)

    def one_shot_limit(self, local_size: int) -> int:
        if self.one_shot_max_bytes is not None:
            return self.one_shot_max_bytes
        return 32 * MiB if local_size == 2 else 256 * 1024

    __hash__ = options_hash  # (hashed once: part of every bound-call key)

    @classmethod
    def default(cls) -> "CollectiveOptions":
        """The defaults with the environment's overrides (cached until :func:`mkernel.core.env.reload`)."""
        gen = env.generation()
        if _default[0] != gen:
            o = cls()
            ce_min = env.get("MKERNEL_COLL_CE_MIN_BYTES")
            kw = dict(copy_engines=env.get("MKERNEL_COLL_CE"),
                      ce_max_chunks=env.get("MKERNEL_COLL_CE_MAX_CHUNKS", o.ce_max_chunks),
                      ce_tail_pieces=env.get("MKERNEL_COLL_CE_TAIL_PIECES", o.ce_tail_pieces),
                      ce_blocks=env.get("MKERNEL_COLL_CE_BLOCKS", o.ce_blocks),
                      one_shot_max_bytes=env.get("MKERNEL_COLL_ONE_SHOT_MAX_BYTES"),
                      min_chunk=env.get("MKERNEL_COLL_MIN_CHUNK", o.min_chunk),
                      max_blocks=env.get("MKERNEL_COLL_MAX_BLOCKS", o.max_blocks))
            if ce_min is not None:
                kw.update(ce_min_bytes_all_gather=ce_min, ce_min_bytes_reduce_scatter=ce_min,
                          ce_min_bytes_all_reduce=ce_min)
            _default[:] = [gen, replace(o, **kw).checked()]
        return _default[1]

    def checked(self) -> "CollectiveOptions":
        """Self, or a ValueError naming the first field out of range."""
        from ...dist.signals import MAX_CHUNKS

        if self.copy_engines not in (None, True, False):
            raise ValueError(f"CollectiveOptions.copy_engines must be None, True or False, got {self.copy_engines!r}")
        for name, lo, hi in (("ce_max_chunks", 1, MAX_CHUNKS // 2), ("ce_tail_pieces", 0, MAX_CHUNKS // 2),
                             ("ce_blocks", 0, 1 << 16), ("min_chunk", 16, 1 << 40), ("max_blocks", 0, 1 << 16),
                             ("ce_min_bytes_all_gather", 0, 1 << 62), ("ce_min_bytes_reduce_scatter", 0, 1 << 62),
                             ("ce_min_bytes_all_reduce", 0, 1 << 62)):
            v = getattr(self, name)
            if not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"CollectiveOptions.{name} must be an int in [{lo}, {hi}], got {v!r}")
        if self.one_shot_max_bytes is not None and (not isinstance(self.one_shot_max_bytes, int)
                                                    or self.one_shot_max_bytes < 0):
            raise ValueError(f"CollectiveOptions.one_shot_max_bytes must be None or an int >= 0, "
                             f"got {self.one_shot_max_bytes!r}")
        return self


_default: list = [None, None]
