"""Ring attention's schedule, pure index math (no GPU): zigzag sharding, the classification of (query chunk,
key chunk) pairs, and the kernel launches of every ring step.  docs/ring_attention.md, "Schedule"."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["zigzag_chunks", "zigzag_indices", "classify", "source_rank", "Launch", "RingPlan", "make_plan",
           "step_pairs", "partial_step", "partial_rows"]


def zigzag_chunks(rank: int, P: int) -> tuple[int, int]:
    """The two chunks (of the sequence cut into 2P equal chunks) local rank ``rank`` of ``P`` holds, in
    local order: ``(rank, 2P - 1 - rank)``."""
    if not 0 <= rank < P:
        raise ValueError(f"zigzag: rank {rank} out of range for {P} ranks")
    return rank, 2 * P - 1 - rank


def zigzag_indices(seq_len: int, P: int, rank: int) -> np.ndarray:
    """Global sequence positions of local rank ``rank``'s rows under zigzag sharding (int64, ``seq_len / P``
    of them: chunk ``rank`` then chunk ``2P - 1 - rank``).  ``seq_len`` must be a multiple of ``2P``."""
    if P < 1 or seq_len % (2 * P):
        raise ValueError(f"zigzag: the sequence length {seq_len} must be a multiple of 2 * P = {2 * P}")
    c = seq_len // (2 * P)
    lo, hi = zigzag_chunks(rank, P)
    return np.concatenate([np.arange(lo * c, lo * c + c), np.arange(hi * c, hi * c + c)]).astype(np.int64)


def classify(q_chunk: int, k_chunk: int) -> str:
    """Causal attention of global query chunk ``q_chunk`` to key chunk ``k_chunk`` (equal chunk lengths):
    "full" (every key is visible: an earlier chunk), "diag" (the chunk itself: causal mask), "skip" (a later
    chunk: nothing visible)."""
    return "full" if k_chunk < q_chunk else "diag" if k_chunk == q_chunk else "skip"


def source_rank(rank: int, step: int, P: int) -> int:
    """The rank whose K/V block rank ``rank`` attends to at ring step ``step``: ``(rank - step) mod P``."""
    return (rank - step) % P


def step_pairs(rank: int, step: int, P: int) -> list[tuple[int, int, str]]:
    """Causal zigzag, step ``step`` of ``rank``: ``(local q chunk, local k chunk of the source, kind)`` for the
    four pairs (local chunk 0 = the low global chunk, 1 = the high one)."""
    qs, ks = zigzag_chunks(rank, P), zigzag_chunks(source_rank(rank, step, P), P)
    return [(a, b, classify(qs[a], ks[b])) for a in (0, 1) for b in (0, 1)]


@dataclass(frozen=True)
class Launch:
    """One attention kernel launch of a ring step: query rows ``[q0, q1)`` of the local shard against key rows
    ``[0, kv_rows)`` of the step's K/V block (``step`` 0: the local k, v), ``causal`` (bottom-right aligned),
    ``first``: the running result starts here; rows ``[final_lo, final_hi)`` (launch-relative) end here and
    are written to ``out`` in the dtype."""

    step: int
    q0: int
    q1: int
    kv_rows: int
    causal: bool
    first: bool
    final_lo: int
    final_hi: int


@dataclass(frozen=True)
class RingPlan:
    """What a ring attention call runs (``ctx.last_plan("ring_attention")``): ``P`` ranks, this rank's
    ``launches``, the pull sources per step (``sources[s]``: local rank whose block step s reads; s = 0 is this
    rank), the bytes of one K/V block, whether the K/V rotation is on the copy engines (always, P > 1),
    whether one persistent kernel runs the whole call (``RingAttentionOptions.persistent``; ``launches`` then
    describe the pairs it computes, not its launches); for the backward, its steps' main kernel
    (``backward_kernel``: "wgmma" or "mma"; "" in the forward's plan) and, where "mma" runs although
    ``RingAttentionOptions.backward_kernel`` is "auto", why (``backward_fallback``)."""

    P: int
    rank: int
    seq_local: int
    causal: bool
    launches: tuple
    sources: tuple
    kv_block_bytes: int = 0
    copy_engines: bool = True
    persistent: bool = False
    backward_kernel: str = ""
    backward_fallback: str = ""

    @property
    def work(self) -> float:
        """Query-key pairs computed, in units of seq_local**2 (causal diagonal blocks count half)."""
        S = self.seq_local
        return sum((l.q1 - l.q0) * l.kv_rows * (0.5 if l.causal else 1.0) for l in self.launches) / (S * S)


def _finals(raw: list) -> tuple:
    """Launches from ``(step, q0, q1, kv_rows, causal)``, each with its final rows: those whose last launch it
    is (a contiguous range: the row ranges are the whole shard or its high half)."""
    cuts = sorted({x for _, q0, q1, _, _ in raw for x in (q0, q1)})
    last = {}  # elementary row segment -> index of the last launch covering it
    for i, (_, q0, q1, _, _) in enumerate(raw):
        for a, b in zip(cuts, cuts[1:]):
            if q0 <= a and b <= q1:
                last[(a, b)] = i
    out = []
    for i, (s, q0, q1, kv, c) in enumerate(raw):
        mine = sorted(seg for seg, j in last.items() if j == i)
        flo, fhi = (mine[0][0] - q0, mine[-1][1] - q0) if mine else (0, 0)
        if mine and any(x[1] != y[0] for x, y in zip(mine, mine[1:])):
            raise AssertionError(f"ring_attention: launch {i} ends rows that are not contiguous: {mine}")
        out.append(Launch(s, q0, q1, kv, c, s == 0, flo, fhi))
    return tuple(out)


def make_plan(rank: int, P: int, seq_local: int, causal: bool, kv_block_bytes: int = 0) -> RingPlan:
    """This rank's launches.  Non-causal: every step, all rows against the whole block.  Causal (zigzag,
    ``seq_local = 2C``): step 0 is causal attention of the local 2C rows to themselves (its mask is exactly
    the pairs diag / full / diag / skip); at step s >= 1 with source j: j < rank -> all 2C rows against the
    source's low chunk (pairs full, full, skip, skip: keys [0, C)); j > rank -> the high chunk's C rows
    against all 2C keys (skip, skip, full, full).  Either is C x 2C key pairs: every rank and step costs the
    same (docs/ring_attention.md, "Work balance")."""
    if P < 1 or not 0 <= rank < P:
        raise ValueError(f"ring_attention: rank {rank} out of range for {P} ranks")
    S = seq_local
    raw = []
    if not causal:
        for s in range(P):
            raw.append((s, 0, S, S, False))
    else:
        if S % 2:
            raise ValueError(f"ring_attention: causal (zigzag) needs an even local sequence length, got {S}")
        C = S // 2
        raw.append((0, 0, S, S, True))
        for s in range(1, P):
            j = source_rank(rank, s, P)
            raw.append((s, 0, S, C, False) if j < rank else (s, C, S, S, False))
    sources = tuple(source_rank(rank, s, P) for s in range(P))
    return RingPlan(P, rank, S, causal, _finals(raw), sources, kv_block_bytes, P > 1)


def partial_step(owner: int, src: int, P: int) -> int:
    """The ring step at which rank ``src`` computes its partial of ``owner``'s K/V block (ranks of the ring:
    a node's local ranks, or the world ranks across nodes)."""
    s = (src - owner) % P
    assert source_rank(src, s, P) == owner
    return s


def partial_rows(owner: int, src: int, P: int, seq_local: int, causal: bool) -> int:
    """Rows of ``owner``'s block that ``src``'s partial covers (a prefix; the rest is zero): the whole block,
    except causal with owner < src (src sees the owner's low chunk only: :func:`make_plan`)."""
    if causal and src != owner and owner < src:
        return seq_local // 2
    return seq_local
