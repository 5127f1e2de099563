"""Who is where: nodes from a shared-memory split of the communicator, optionally emulated.

Needs MPI only (no GPU), so it is tested on the CPU.  Every wait is bounded
(:mod:`mkernel.dist.hostwait`, :func:`~mkernel.dist.timeouts.host_wait_limit` of the timeout): the
duplicate of the communicator is an ``Idup`` and the exchanges non-blocking allgathers.  MPI has no
non-blocking communicator split, so each of the two splits runs right after a bounded collective that
every rank completed: a rank that is missing is found by the bounded wait, and only a rank dying in
between can still hold the others in a split.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core import env
from . import hostwait
from .timeouts import DEFAULT_TIMEOUT_S, host_wait_limit

__all__ = ["Topology"]


@dataclass
class Topology:
    """The rank's place in the job.

    ``node``/``num_nodes`` index the (possibly emulated) nodes; ``local_rank``/``local_size`` are the
    rank's index and count within its node (the ranks joined by NVLink); ``host_rank``/``host_size``
    are the same on the physical host (they choose the GPU); ``local_world_ranks[i]`` is the world
    rank of local rank ``i``; ``node_of_rank[r]`` the node of world rank ``r``.
    """

    rank: int
    size: int
    node: int
    num_nodes: int
    local_rank: int
    local_size: int
    host_rank: int
    host_size: int
    emulated: bool
    local_world_ranks: list
    node_of_rank: list
    world: object = None
    node_comm: object = None
    host_comm: object = None

    @classmethod
    def from_comm(cls, comm=None, ranks_per_node: int | None = None, timeout: float | None = None) -> "Topology":
        """Collective over ``comm``.  ``ranks_per_node`` (or env ``MKERNEL_RANKS_PER_NODE``) groups each
        host's ranks, in host order, into emulated nodes of that many ranks.  ``world`` is a private
        duplicate of ``comm`` (mkernel's exchanges never match the application's messages).  ``timeout``
        (seconds, default 5) bounds every wait: a rank that does not join within
        ``host_wait_limit(timeout)`` gives :class:`~mkernel.CommTimeout`."""
        from mpi4py import MPI

        if ranks_per_node is None:
            ranks_per_node = env.get("MKERNEL_RANKS_PER_NODE")
        if ranks_per_node is not None and ranks_per_node <= 0:
            raise ValueError(f"mkernel: ranks_per_node must be positive, got {ranks_per_node}")
        parent = comm if comm is not None else MPI.COMM_WORLD
        limit = host_wait_limit(DEFAULT_TIMEOUT_S if timeout is None else timeout)
        me = parent.Get_rank()
        world = hostwait.idup(parent, limit, "mkernel.init (duplicating the communicator)", me)
        rank, size = world.Get_rank(), world.Get_size()
        host_comm = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        host_rank, host_size = host_comm.Get_rank(), host_comm.Get_size()
        host_leader = host_comm.Get_group().Translate_ranks([0], world.Get_group())[0]
        sub = host_rank // ranks_per_node if ranks_per_node else 0
        keys = [tuple(k) for k in hostwait.iallgather(world, np.array([host_leader, sub], np.int64), limit,
                                                      "mkernel.init (the topology exchange)", rank).tolist()]
        uniq = sorted(set(keys))
        node = uniq.index((host_leader, sub))
        node_comm = world.Split(color=node, key=rank)
        local_world_ranks = node_comm.Get_group().Translate_ranks(list(range(node_comm.Get_size())),
                                                                  world.Get_group())
        return cls(rank=rank, size=size, node=node, num_nodes=len(uniq), local_rank=node_comm.Get_rank(),
                   local_size=node_comm.Get_size(), host_rank=host_rank, host_size=host_size,
                   emulated=bool(ranks_per_node and ranks_per_node < host_size),
                   local_world_ranks=[int(r) for r in local_world_ranks], node_of_rank=[uniq.index(k) for k in keys],
                   world=world, node_comm=node_comm, host_comm=host_comm)
