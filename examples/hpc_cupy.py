"""mkernel the way an HPC code uses it: MPI ranks, CuPy arrays (mkernel DeviceArrays where CuPy is not
installed), numpy checks, no torch anywhere in the process.

    mpirun -np 2 python examples/hpc_cupy.py [--elements N] [--m M --n N --k K]

Each rank all-reduces a float32 vector (checked against MPI's own float64 Allreduce of the same data) and
multiplies two fp16 matrices into fp32 with mkernel.gemm (checked against numpy in float64).  Exits 1 if a
result is wrong on any rank.
"""
import argparse
import sys

import numpy as np
from mpi4py import MPI

import mkernel
from mkernel import DeviceArray

try:
    import cupy as cp
except ImportError:  # DeviceArrays do the same job: any CUDA array works
    cp = None


def upload(host: np.ndarray):
    """A device copy of ``host``: a CuPy array, or an mkernel DeviceArray without CuPy."""
    return cp.asarray(host) if cp is not None else DeviceArray.from_numpy(host)


def download(dev) -> np.ndarray:
    return cp.asnumpy(dev) if cp is not None else dev.to_numpy()


def empty(shape, dtype):
    return cp.empty(shape, dtype=dtype) if cp is not None else DeviceArray.empty(shape, dtype)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=1 << 22)
    ap.add_argument("--m", type=int, default=1000)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=1536)
    args = ap.parse_args()

    comm = MPI.COMM_WORLD
    ctx = mkernel.init(comm)
    if cp is not None:
        cp.cuda.Device(ctx.device).use()
    stream = cp.cuda.get_current_stream().ptr if cp is not None else None  # (None: the legacy default stream)
    rng = np.random.default_rng(1000 + ctx.rank)

    # all-reduce: sum over every rank, fp32 accumulation, bit-identical on every rank
    host = rng.standard_normal(args.elements).astype(np.float32)
    x, y = upload(host), empty(host.shape, np.float32)
    mkernel.all_reduce(ctx, x, y, stream=stream)
    ctx.synchronize()
    ref = np.empty(host.shape, np.float64)
    comm.Allreduce(host.astype(np.float64), ref, op=MPI.SUM)
    scale = np.empty_like(ref)
    comm.Allreduce(np.abs(host).astype(np.float64), scale, op=MPI.SUM)
    err_ar = float(np.max(np.abs(download(y) - ref) / (scale + 1e-30)))
    ok_ar = err_ar <= 2 ** -20

    # GEMM: fp16 in, fp32 out
    a = rng.standard_normal((args.m, args.k)).astype(np.float16)
    b = rng.standard_normal((args.k, args.n)).astype(np.float16)
    c = mkernel.gemm(upload(a), upload(b), out_dtype="float32", stream=stream)  # a new DeviceArray
    ctx.synchronize()
    exact = a.astype(np.float64) @ b.astype(np.float64)
    bound = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    err_mm = float(np.max(np.abs(c.to_numpy() - exact) / (bound + 1e-30)))
    ok_mm = err_mm <= 2 ** -16

    oks = comm.allgather(ok_ar and ok_mm)
    if ctx.rank == 0:
        arrays = "CuPy arrays" if cp is not None else "mkernel DeviceArrays"
        print(f"{ctx.size} ranks, {arrays}, no torch loaded: {'torch' not in sys.modules}")
        print(f"all_reduce of {args.elements} float32: {'correct' if ok_ar else 'WRONG'} "
              f"(max err / sum|x| {err_ar:.1e})")
        print(f"gemm {args.m}x{args.n}x{args.k} fp16 -> fp32: {'correct' if ok_mm else 'WRONG'} "
              f"(max err / (|a| @ |b|) {err_mm:.1e}; plan {mkernel.ops.gemm.last_plan()})")
    ctx.close()
    return 0 if all(oks) and "torch" not in sys.modules else 1


if __name__ == "__main__":
    sys.exit(main())
