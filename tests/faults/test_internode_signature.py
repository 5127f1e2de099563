"""The inter-node collectives' call-signature words on the real proxy over TCP (CPU, loopback; docs/internode.md,
"Call signatures").

Each rank plays its kernel by hand: at the start of call e it pushes the proxy FLAG command the kernel pushes
(``inter_announce``: flag offset ``call_offset(Lo, me, e)``, value ``call_word(e, sig)``, window 0), then checks
the peer's word the way ``inter_same_call`` does before a slot is read.  Ranks repeating differently sized,
already-agreed calls (different digests) must disagree at exactly that call, seeing each other's digest, with
the parity words of earlier calls intact; matching calls must pass.  The device half (the kernel reading
these words) is tests/gpu/test_internode.py::test_internode_mismatched_sizes_raise_comm_mismatch.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _threads import run_ranks  # noqa: E402

from mkernel.ops.collectives import internode as I  # noqa: E402
from mkernel.proxy import OP_FLAG, Proxy  # noqa: E402
from mkernel.proxy.transport import HostWindow  # noqa: E402

pytestmark = pytest.mark.faults

T = 5.0


def _same_call(win, Lo, s, e, sig):
    """Python mirror of internode.cu's inter_same_call: (ok, the peer's signature)."""
    off = I.call_offset(Lo, s, e)
    t0 = time.monotonic()
    while win.read_u64(off) < e << 32:
        assert time.monotonic() - t0 < T, f"no announcement of call {e} from rank {s}"
        time.sleep(1e-4)
    word = win.read_u64(off)
    assert word >> 32 == e, f"rank {s}'s word for call {e} holds call {word >> 32}"
    return word == I.call_word(e, sig), word & 0xFFFFFFFF


def _run(sigs_per_rank):
    """Every rank makes len(sigs) calls with its own signatures; returns each rank's [(ok, theirs)]."""
    Lo, total = I.layout(1, 2, 2, 2, 4096)  # 2 nodes x 1 rank: every peer is a rail peer (the proxy)

    def body(ex, r):
        win = HostWindow(total)
        p = Proxy(ex, [win], transport="tcp", ring_capacity=16, timeout=T).start()
        try:
            prod, out = p.producer(), []
            for e, sig in enumerate(sigs_per_rank[r], start=1):
                prod.push(OP_FLAG, 1 - r, 0, 0, 0, 0, 0, I.call_offset(Lo, r, e), I.call_word(e, sig))
                out.append(_same_call(win, Lo, 1 - r, e, sig))
            prod.wait_done(prod.head - 1)
            ex.barrier()  # (nothing in flight when the proxies close)
            return out
        finally:
            p.close()

    results, errors = run_ranks(2, body)
    assert errors == [None, None], errors
    return results


def test_matching_calls_pass_and_parity_words_hold_each_call():
    sigs = [0x1111, 0x2222, 0xFFFFFFFF, 0x1111, 0x2222]
    assert _run([sigs, sigs]) == [[(True, s) for s in sigs]] * 2


def test_ranks_repeating_different_agreed_calls_disagree_at_that_call():
    a, b = 0xA5A5A5A5, 0x5A5A5A5A  # two digests every rank agreed before (sizes n and 2n)
    res = _run([[a, b, a], [a, b, b]])
    assert res[0][:2] == [(True, a), (True, b)] and res[1][:2] == [(True, a), (True, b)]
    assert res[0][2] == (False, b) and res[1][2] == (False, a)  # each sees the other's digest


def test_call_words_order_and_wrap():
    assert I.call_word(3, 0xDEADBEEF) == (3 << 32) | 0xDEADBEEF
    assert I.call_word(5, 0) >= 5 << 32 > I.call_word(4, 0xFFFFFFFF)  # a later call's word is larger
    Lo, _ = I.layout(2, 3, 1, 1, 16)
    offs = {I.call_offset(Lo, r, e) for r in range(6) for e in (1, 2)}
    assert len(offs) == 12 and min(offs) >= Lo.calls_off and max(offs) + 8 <= Lo.ready_off
    assert Lo.calls_off >= Lo.consumed_off + 8 * 6  # after consumed[P]
    # control words never move with the slot size
    assert (I.layout(2, 3, 5, 9, 16)[0].calls_off, I.layout(2, 3, 5, 9, 1 << 20)[0].ready_off) == \
        (Lo.calls_off, I.layout(2, 3, 5, 9, 16)[0].ready_off)


def test_layout_struct_matches_the_kernel():
    import ctypes

    assert ctypes.sizeof(I.InterLayout) == 48  # internode.cu: u64 consumed_off, calls_off, ready_off, data_off,
    assert [f[0] for f in I.InterLayout._fields_][:2] == ["consumed_off", "calls_off"]  # slot_bytes; int L, N
    src = (Path(__file__).resolve().parents[2] / "cuda_src/ops/internode.cu").read_text()
    assert "mk_u64 consumed_off, calls_off, ready_off, data_off;" in src
