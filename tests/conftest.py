"""Shared fixtures.  GPU tests are marked ``gpu`` and skip on machines without a usable CUDA GPU;
MPI tests (``mpi``) run on every rank of ``mpirun -np N python -m pytest ...``."""
from __future__ import annotations


import numpy as np
import pytest


def _gpu_reason() -> str | None:
    try:
        from cuda.bindings import driver as cu
    except Exception as exc:  # pragma: no cover
        return f"cuda-python not importable: {exc}"
    try:
        err, = cu.cuInit(0)
    except Exception as exc:  # no libcuda.so at all
        return f"no NVIDIA driver ({type(exc).__name__})"
    if err != cu.CUresult.CUDA_SUCCESS:
        return f"no usable CUDA driver/GPU (cuInit: {err.name})"
    err, n = cu.cuDeviceGetCount()
    if err != cu.CUresult.CUDA_SUCCESS or n == 0:
        return "no CUDA GPU"
    err, major = cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0)
    if major < 9:
        return f"needs a Hopper (sm_90) GPU, found compute capability {major}.x"
    return None


GPU_SKIP_REASON = _gpu_reason()


def pytest_collection_modifyitems(config, items):
    if GPU_SKIP_REASON is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {GPU_SKIP_REASON}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def _contexts():
    """Holds the session's current mkernel Context (collective: every rank of the mpirun job creates it)."""
    if GPU_SKIP_REASON is not None:
        pytest.skip(GPU_SKIP_REASON)
    import mkernel

    held = {"ctx": mkernel.init()}
    yield held
    held["ctx"].close()


@pytest.fixture
def ctx(_contexts):
    """The session's mkernel Context, replaced by a fresh one on every rank when any rank's has failed (a
    failed context must be discarded: README, "After a timeout"), so that one failing test does not fail
    every test after it.  The vote runs on MPI.COMM_WORLD, which mkernel never uses (each context works on
    its own duplicate, where a timed-out collective may have left a request behind)."""
    import mkernel
    from mpi4py import MPI

    c = _contexts["ctx"]
    if MPI.COMM_WORLD.allreduce(c.failure() is not None, op=MPI.LOR):
        c.close()  # (local for a failed context: nothing waits for a peer)
        c = _contexts["ctx"] = mkernel.init(timeout=c.timeout)  # (a module's raised timeout carries over)
    return c


@pytest.fixture
def shared_rng(ctx):
    """A generator seeded identically on every rank, freshly per test (seed from rank 0's entropy)."""
    seed = ctx.world.bcast(int(np.random.SeedSequence().entropy % (1 << 63)) if ctx.rank == 0 else None, root=0)
    return np.random.default_rng(seed)


@pytest.fixture
def mkenv(monkeypatch):
    """``mkenv(name, value)`` sets (``value=None``: unsets) an ``MKERNEL_*`` variable for one test.  The
    library reads them into a snapshot (mkernel.core.env), re-read here after every change and at the
    end of the test."""
    from mkernel.core import env

    def set_(name, value=None):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(value))
        env.reload()
    yield set_
    monkeypatch.undo()
    env.reload()
