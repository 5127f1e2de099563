"""Host side of the device signals: the error record kernels write on a timeout, op ids, MkComm.

Layouts match ``cuda_src/mk_signal.cuh`` (``MkErrorRecord``, ``MkComm``).
"""
from __future__ import annotations

import ctypes

from ..errors import CommError, CommMismatch, CommTimeout

__all__ = ["OPS", "op_name", "MkComm", "MkErrorRecord", "ErrorRecordView", "MK_OK", "MK_ERR_TIMEOUT",
           "MK_ERR_MISMATCH", "MK_ERR_PROXY", "call_header_bytes", "MAX_CHUNKS", "workspace_control"]

MK_OK, MK_ERR_TIMEOUT, MK_ERR_MISMATCH, MK_ERR_PROXY = 0, 1, 2, 3
LOCAL_PEER_BIT = 0x40000000  # MK_LOCAL_PEER(j): the kernel named a peer by local rank

# Op ids written into error records.
OPS = {
    "all_gather": 1,
    "reduce_scatter": 2,
    "all_reduce": 3,
    "barrier": 4,
    "ag_gemm": 10,
    "gemm_rs": 11,
    "gemm_ar": 12,
    "moe_route": 13,
    "moe_dispatch": 14,
    "moe_combine": 15,
    "ring_attention": 16,
    "ring_attention_backward": 17,
    "moe_dispatch_gemm": 18,
    "moe_dispatch_ll": 19,
    "proxy": 20,
    "internode_all_gather": 21,
    "internode_reduce_scatter": 22,
    "internode_all_reduce": 23,
    "moe_gemm_combine": 24,
    "moe_ffn_fused": 25,
}
_OP_NAMES = {v: k for k, v in OPS.items()}


def op_name(op_id: int) -> str:
    return _OP_NAMES.get(op_id, f"op#{op_id}")


class MkErrorRecord(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int32), ("rank", ctypes.c_int32), ("op", ctypes.c_int32),
                ("peer", ctypes.c_int32), ("flag_index", ctypes.c_int32), ("block", ctypes.c_int32),
                ("expected", ctypes.c_uint64), ("seen", ctypes.c_uint64), ("waited_ns", ctypes.c_uint64)]


class MkComm(ctypes.Structure):
    """Passed by value to every communicating kernel (``struct MkComm`` in mk_signal.cuh).  ``sig``: the
    call's signature (``Context.agree``'s digest) for kernels that check it against their peers'."""

    _fields_ = [("err", ctypes.c_uint64), ("timeout_ns", ctypes.c_uint64),
                ("rank", ctypes.c_int32), ("world_size", ctypes.c_int32),
                ("local_rank", ctypes.c_int32), ("local_size", ctypes.c_int32),
                ("node", ctypes.c_int32), ("num_nodes", ctypes.c_int32),
                ("op", ctypes.c_int32), ("sig", ctypes.c_uint32)]


assert ctypes.sizeof(MkErrorRecord) == 48 and ctypes.sizeof(MkComm) == 48


def call_header_bytes(P: int) -> int:
    """Bytes of a communicating op's per-call workspace header for P local ranks: u64 consumed[P],
    entered[P], sig[P][2], written by the peers (mk_signal.cuh MkCallHeader, which the collectives'
    and AllGather+GEMM's workspaces both use)."""
    return 4 * 8 * P


# Ready flags per (source, phase) row in an op workspace, whatever the call: no op cuts a slot or a
# shard into more chunks than this.
MAX_CHUNKS = 1024


def workspace_control(P: int, flag_rows: int) -> tuple[int, int, int]:
    """``(consumed_off, flags_off, end)`` of an op workspace's control region: epoch state (and any
    op-specific words) in the first 64 bytes, the per-call header (call_header_bytes) at consumed_off,
    then ``flag_rows`` rows of MAX_CHUNKS u64 ready flags at flags_off (256-byte aligned), up to end.
    Every offset depends on P and the op's row count only, never on a call's size: the workspace is
    shared by all the op's calls, and a control word that moved with the size could sit on bytes an
    earlier call left in its data region (read as a raised flag).  An op places its own fixed words
    from ``end`` on, then its data."""
    consumed_off = 64
    flags_off = -(-(consumed_off + call_header_bytes(P)) // 256) * 256
    return consumed_off, flags_off, flags_off + 8 * flag_rows * MAX_CHUNKS


class ErrorRecordView:
    """Reads the host-mapped error record; ``raise_if_set`` turns it into a Python exception."""

    def __init__(self, host_ptr: int, world_ranks_of_local: list[int] | None = None):
        self._rec = MkErrorRecord.from_address(host_ptr)
        self._local = list(world_ranks_of_local or [])

    def as_dict(self) -> dict:
        r = self._rec
        peer = r.peer
        if peer >= 0 and peer & LOCAL_PEER_BIT:
            j = peer & ~LOCAL_PEER_BIT
            peer = self._local[j] if j < len(self._local) else -1
        return {"code": r.code, "rank": r.rank, "op": op_name(r.op), "peer": peer, "flag_index": r.flag_index,
                "block": r.block, "expected": r.expected, "seen": r.seen, "waited_ns": r.waited_ns}

    @property
    def code(self) -> int:
        return ctypes.c_int32.from_address(ctypes.addressof(self._rec)).value

    def raise_if_set(self) -> None:
        code = self.code
        if code == MK_OK:
            return
        rec = self.as_dict()
        if code == -1:  # a writer is mid-way; the record is complete once code is final
            return
        if code == MK_ERR_MISMATCH:
            raise CommMismatch(
                f"mkernel: rank {rec['rank']} in {rec['op']}: peer rank {rec['peer']} made a different call at "
                f"this point of the call sequence (call signature 0x{rec['expected']:08x} here, 0x{rec['seen']:08x} "
                "there: another op, dtype or size); every rank must make the same calls in the same order. "
                "This communicator is no longer usable.", rec)
        where = (f"rank {rec['rank']} in {rec['op']} waited {rec['waited_ns'] / 1e9:.3f} s for peer rank "
                 f"{rec['peer']} (flag {rec['flag_index']}: expected >= {rec['expected']}, saw {rec['seen']}; "
                 f"block {rec['block']})")
        if code == MK_ERR_TIMEOUT:
            raise CommTimeout(f"mkernel: communication timeout: {where}. The peer is dead, stuck, or did not "
                              "make the same call; this communicator is no longer usable.", rec)
        raise CommError(f"mkernel: communication error code {code}: {where}", rec)
