#!/usr/bin/env python
"""Host time per eager call, what frameworks that call eagerly see: ours against torch's, same run.

    mpirun --allow-run-as-root -np N python bench/host_overhead.py [--out DIR] [--no-torch]

Every call gets other arrays than the last (a rotating pool of 16 distinct torch tensors per operand:
the pointers change every call, as with fresh tensors), so no cache keyed by pointers can help; the
weights stay.  Per op: the median over rounds of (host seconds to submit N back-to-back calls) / N,
synchronized between rounds only.  Rows:

* gemm (torch tensors and mkernel DeviceArrays) vs ``torch.matmul(a, w.t(), out=o)`` -- target: torch
  tensors <= 1.5x torch's, DeviceArrays <= 10 us;
* each collective (torch tensors) vs torch.distributed (NCCL) on the same tensors -- target: <= NCCL's
  (with one rank NCCL still runs its launch path);
* attention (torch tensors, B=1 S=1024 H=32/8 D=128 causal) vs ``torch.nn.functional.scaled_dot_product_attention``;
* ag_gemm with torch tensors (several ranks) -- target: <= 40 us;
* eager wall time per call of the decode shapes (M = 1, 3, 8, 24, weights [N, K]): N back-to-back calls
  then one synchronize, ours and cuBLAS's (host and GPU both count).

Writes host_overhead.json and host_overhead.md under --out (default: docs/ when run from the repo).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import _common as C  # noqa: E402

N_CALLS, ROUNDS, POOL = 300, 7, 16


def per_call_us(fn, comm, n=N_CALLS, rounds=ROUNDS) -> float:
    """Median over rounds of host microseconds per call of ``fn(i)`` (i = the call's index)."""
    import torch

    for i in range(10):
        fn(i)
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        comm.Barrier()
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        out.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def wall_us(fn, comm, n=200, rounds=5) -> float:
    """Median over rounds of (N back-to-back calls + one synchronize) / N, microseconds."""
    import torch

    for i in range(10):
        fn(i)
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        comm.Barrier()
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE.parent / "docs"))
    ap.add_argument("--no-torch", action="store_true",
                    help="ours only (ranks sharing one GPU: NCCL refuses them): no torch baselines, no gemm rows")
    args = ap.parse_args()
    ctx = C.bootstrap(nccl=not args.no_torch)
    import torch
    import torch.distributed as dist

    import mkernel

    comm = ctx.world
    s = torch.cuda.current_stream()
    dev = torch.device("cuda", ctx.device)
    P = ctx.size
    rows, decode = [], []

    def pool(shape, dtype=torch.bfloat16):
        return [torch.randn(*shape, device=dev, dtype=dtype) for _ in range(POOL)]

    def record(op, ours, theirs, target, note=""):
        us = C.max_over_ranks(ours, comm)[0]
        them = C.max_over_ranks(theirs, comm)[0] if theirs is not None else None
        rows.append(dict(op=op, ours_us=us, torch_us=them, ratio=(us / them) if them else None, target=target,
                         note=note))

    # ---- gemm
    for M, N, K in [] if args.no_torch else [(1, 8192, 8192), (3, 8192, 8192), (8, 8192, 8192), (24, 8192, 8192), (128, 8192, 8192),
                    (4096, 4096, 4096)]:
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
        a, o = pool((M, K)), pool((M, N))
        mk = per_call_us(lambda i: mkernel.gemm(a[i % POOL], w, o[i % POOL], b_layout="nk", stream=s), comm)
        th = per_call_us(lambda i: torch.matmul(a[i % POOL], w.t(), out=o[i % POOL]), comm)
        record(f"gemm {M}x{N}x{K} nk (torch tensors)", mk, th, "<= 1.5x torch")
        A = [mkernel.as_device_array(x) for x in a]
        O = [mkernel.as_device_array(x) for x in o]
        W = mkernel.as_device_array(w)
        mkd = per_call_us(lambda i: mkernel.gemm(A[i % POOL], W, O[i % POOL], b_layout="nk", stream=s), comm)
        record(f"gemm {M}x{N}x{K} nk (DeviceArrays)", mkd, th, "<= 10 us")
        if M in (1, 3, 8, 24):
            ew = wall_us(lambda i: mkernel.gemm(a[i % POOL], w, o[i % POOL], b_layout="nk", stream=s), comm)
            tw = wall_us(lambda i: torch.matmul(a[i % POOL], w.t(), out=o[i % POOL]), comm)
            decode.append(dict(shape=f"{M}x{N}x{K}", ours_us=C.max_over_ranks(ew, comm)[0],
                               cublas_us=C.max_over_ranks(tw, comm)[0]))
        del w, a, o, A, O, W

    # ---- collectives
    for nbytes in (64 << 10, 1 << 20, 4 << 20):
        n = nbytes // 2
        x, out = pool((n,)), pool((n,))
        mk = per_call_us(lambda i: mkernel.all_reduce(ctx, x[i % POOL], out[i % POOL], stream=s), comm)
        th = None if args.no_torch else per_call_us(lambda i: dist.all_reduce(x[i % POOL]), comm)
        record(f"all_reduce {C.fmt_bytes(nbytes)}", mk, th, "<= NCCL")
        g = pool((P * n,))
        mk = per_call_us(lambda i: mkernel.all_gather(ctx, x[i % POOL], g[i % POOL], stream=s), comm)
        th = None if args.no_torch else per_call_us(
            lambda i: dist.all_gather_into_tensor(g[i % POOL], x[i % POOL]), comm)
        record(f"all_gather {C.fmt_bytes(nbytes)}", mk, th, "<= NCCL")
        r = pool((n // P,))
        xs = pool((n - n % P,))
        mk = per_call_us(lambda i: mkernel.reduce_scatter(ctx, xs[i % POOL], r[i % POOL], stream=s), comm)
        th = None if args.no_torch else per_call_us(
            lambda i: dist.reduce_scatter_tensor(r[i % POOL], xs[i % POOL]), comm)
        record(f"reduce_scatter {C.fmt_bytes(nbytes)}", mk, th, "<= NCCL")
        del x, out, g, r, xs

    # ---- attention (one GPU's op; torch's SDPA allocates its output, ours writes given out / lse)
    if not args.no_torch:
        import torch.nn.functional as F

        B, S, Hq, Hkv, D = 1, 1024, 32, 8, 128
        q, k, v = pool((B, S, Hq, D)), pool((B, S, Hkv, D)), pool((B, S, Hkv, D))
        o, lse = pool((B, S, Hq, D)), pool((B, Hq, S), torch.float32)
        mk = per_call_us(lambda i: mkernel.attention(q[i % POOL], k[i % POOL], v[i % POOL], o[i % POOL],
                                                     lse=lse[i % POOL], causal=True, stream=s), comm)
        th = per_call_us(lambda i: F.scaled_dot_product_attention(
            q[i % POOL].transpose(1, 2), k[i % POOL].transpose(1, 2), v[i % POOL].transpose(1, 2), is_causal=True,
            enable_gqa=True), comm)
        record(f"attention B={B} S={S} H={Hq}/{Hkv} D={D} causal (torch tensors)", mk, th, "<= torch SDPA")
        del q, k, v, o, lse

    # ---- ag_gemm (several local ranks)
    if ctx.local_size > 1:
        for m_r, N, K in [(128, 5120, 8192), (1024, 5120, 8192)]:
            w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
            a, o = pool((m_r, K)), pool((m_r * ctx.local_size, N))
            mk = per_call_us(lambda i: mkernel.ag_gemm(ctx, a[i % POOL], w, o[i % POOL], b_layout="nk", stream=s),
                             comm)
            record(f"ag_gemm M_r={m_r} N={N} K={K} nk", mk, None, "<= 40 us")

    ctx.check()
    if ctx.rank == 0:
        table = C.markdown_table(["op", "ours us/call", "torch us/call", "ours / torch", "target"],
                                 [[r["op"], f"{r['ours_us']:.1f}", C.fmt_or_na(r["torch_us"], ".1f"),
                                   C.fmt_or_na(r["ratio"], ".2f"), r["target"]] for r in rows])
        dtable = C.markdown_table(["decode shape (M x N x K, B [N, K])", "ours us/call", "cuBLAS us/call",
                                   "cuBLAS / ours"],
                                  [[d["shape"], f"{d['ours_us']:.1f}", f"{d['cublas_us']:.1f}",
                                    f"{d['cublas_us'] / d['ours_us']:.2f}"] for d in decode])
        print(table)
        print()
        print(dtable)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        C.write_json(out / "host_overhead.json", dict(ranks=P, rows=rows, decode_eager=decode,
                                                      device=torch.cuda.get_device_name(dev)))
        md = out / "host_overhead.md"
        notes = ""  # (the hand-written "## Notes" section of an earlier report is kept)
        if md.exists() and "\n## Notes" in md.read_text():
            notes = "\n" + md.read_text()[md.read_text().index("\n## Notes") + 1:]
        md.write_text(
            f"# Host time per eager call ({P} rank(s), {torch.cuda.get_device_name(dev)})\n\n"
            "Made by `bench/host_overhead.py`: host microseconds to submit one call, every call with other "
            "arrays than the last (16 distinct torch tensors per operand in rotation), median of 7 rounds of "
            f"{N_CALLS} calls; the max over ranks.\n\n" + table +
            "\n\nEager wall time per call of the decode shapes (200 back-to-back calls + one synchronize):\n\n"
            + dtable + "\n" + notes)
    C.shutdown(ctx)


if __name__ == "__main__":
    main()
