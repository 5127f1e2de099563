"""mkernel in a job launched by torchrun: a bootstrap object over torch.distributed, no MPI in the process.

    torchrun --nproc-per-node 2 examples/torchrun_bootstrap.py [--elements N]

``mkernel.init(comm)`` takes an mpi4py communicator or any object with ``rank``, ``size``,
``allgather(bytes) -> list[bytes]`` and ``barrier()`` (mkernel/dist/bootstrap.py).  Here they run on a
gloo process group: host-side, and callable from the helper thread on which mkernel bounds its
first-call agreement by the timeout.  mkernel uses it only while setting up the context, allocating
symmetric memory and on the first call of each new call signature; the ranks of one host talk over
Unix sockets among themselves.  torch is used by this example only: the library never imports it.

Every rank draws every rank's input from seeded generators, so the check needs no communication:
the all-reduced bf16 tensor is compared with the float64 sum of the (bf16-rounded) inputs.
"""
import argparse
import os

import torch
import torch.distributed as dist

import mkernel


class TorchBootstrap:
    """The mkernel bootstrap protocol on a torch.distributed process group (default: a new gloo group)."""

    def __init__(self, group=None):
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def allgather(self, data: bytes) -> list:
        out = [None] * self.size
        dist.all_gather_object(out, bytes(data), group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=1 << 22)
    args = ap.parse_args()

    dist.init_process_group(backend="gloo")
    ctx = mkernel.init(TorchBootstrap(), device=int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(ctx.device)
    inputs = [torch.randn(args.elements, generator=torch.Generator().manual_seed(1000 + r)).to(torch.bfloat16)
              for r in range(ctx.size)]
    x = inputs[ctx.rank].to(f"cuda:{ctx.device}")
    y = torch.empty_like(x)
    mkernel.all_reduce(ctx, x, y, stream=torch.cuda.current_stream())
    ctx.synchronize()

    exact = torch.stack([t.double() for t in inputs]).sum(0)
    scale = torch.stack([t.double().abs() for t in inputs]).sum(0)
    err = ((y.cpu().double() - exact).abs() / (exact.abs() + 1e-3 * scale)).max().item()
    ok = err <= 2 ** -8
    print(f"rank {ctx.rank}/{ctx.size} (node {ctx.node}, cuda:{ctx.device}): all_reduce of {args.elements} bf16 "
          f"{'correct' if ok else 'WRONG'} (max rel err {err:.2e}); plan {ctx.last_plan('all_reduce')}", flush=True)
    ctx.close()
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
