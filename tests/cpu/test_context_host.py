"""Context on the CPU: the kernel-argument structs it hands out (no GPU: only the fields they read)."""
from __future__ import annotations

import pytest


def test_context_timeout_updates_cached_comm_args():
    """ops keep the MkComm structs comm_args hands out; a new timeout must reach them."""
    from mkernel.context import Context

    ctx = object.__new__(Context)  # no GPU: only the fields comm_args reads
    ctx._timeout, ctx._comm_cache, ctx._err_dev = 5.0, {}, 0x1000
    ctx.rank = ctx.local_rank = ctx.node = 0
    ctx.size = ctx.local_size = 2
    ctx.num_nodes = 1
    c = ctx.comm_args("ag_gemm")
    assert ctx.comm_args("ag_gemm") is c and c.timeout_ns == 5_000_000_000 and c.local_size == 2
    ctx.timeout = 0.25
    assert c.timeout_ns == 250_000_000 and ctx.timeout == 0.25
    with pytest.raises(ValueError, match="timeout"):
        ctx.timeout = 0
