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


def test_workspace_setup_inside_a_capture_raises_clearly(monkeypatch):
    """Creating or growing an op's workspace (a collective allocation that synchronizes the device)
    while the op's stream is being captured raises a RuntimeError naming the op -- before any driver
    call could invalidate the caller's capture; a workspace that already fits is returned as usual."""
    from mkernel import context as X

    ctx = object.__new__(X.Context)
    ctx._workspaces = {}

    class WS:
        nbytes = 1 << 20

    def no_alloc(nbytes, comm=None):
        raise AssertionError("allocated inside a capture")

    ctx.alloc_symmetric = no_alloc
    monkeypatch.setattr(X, "is_capturing", lambda stream: True)
    with pytest.raises(RuntimeError, match=r"mkernel.all_reduce: .*before capturing"):
        ctx.workspace(("collective", "all_reduce"), 4096, stream=7, what="mkernel.all_reduce")
    ctx._workspaces[("collective", "all_reduce")] = ws = WS()
    assert ctx.workspace(("collective", "all_reduce"), 4096, stream=7) is ws  # fits: no setup, no error
    with pytest.raises(RuntimeError, match="larger communication workspace"):
        ctx.workspace(("collective", "all_reduce"), 2 << 20, stream=7)
