"""Who is where: the hosts, the (possibly emulated) nodes, this rank's place in them.

With MPI the hosts come from a shared-memory split of the communicator; with another bootstrap
(:mod:`.bootstrap`) from an allgather of the host names, and the node and host communicators are
Unix-socket groups (:mod:`.localgroup`).  Needs no GPU, so it is tested on the CPU.

Every wait is bounded (:mod:`mkernel.dist.hostwait`, :func:`~mkernel.dist.timeouts.host_wait_limit` of
the timeout): with MPI the duplicate of the communicator is an ``Idup`` and the exchange a non-blocking
allgather; MPI has no non-blocking communicator split, so the two splits run on a helper thread waited
for at most the limit (:func:`~mkernel.dist.hostwait.blocking`; with ``MPI_THREAD_MULTIPLE``, mpi4py's
default -- under a lower thread level they run inline, each right after a bounded collective every rank
completed, so only a rank dying in between can hold the others there).  With another bootstrap the allgathers run on a helper thread waited for at most the limit.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

import numpy as np

from ..core import env
from . import hostwait
from .bootstrap import MpiBootstrap, check_bootstrap, is_mpi_comm
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
        """Collective over ``comm``: an mpi4py communicator (default ``MPI.COMM_WORLD``) or a
        :class:`~mkernel.dist.bootstrap.Bootstrap` (:meth:`from_bootstrap`).  ``ranks_per_node`` (or env
        ``MKERNEL_RANKS_PER_NODE``) groups each host's ranks, in host order, into emulated nodes of that
        many ranks.  With MPI, ``world`` is a private duplicate of ``comm`` (mkernel's exchanges never
        match the application's messages).  ``timeout`` (seconds, default 5) bounds every wait: a rank
        that does not join within ``host_wait_limit(timeout)`` gives :class:`~mkernel.CommTimeout`."""
        if isinstance(comm, MpiBootstrap):
            comm = comm.comm
        if comm is not None and not is_mpi_comm(comm):
            return cls.from_bootstrap(comm, ranks_per_node, timeout=timeout)
        from mpi4py import MPI

        ranks_per_node = _ranks_per_node(ranks_per_node)
        parent = comm if comm is not None else MPI.COMM_WORLD
        limit = host_wait_limit(DEFAULT_TIMEOUT_S if timeout is None else timeout)
        me = parent.Get_rank()
        world = hostwait.idup(parent, limit, "mkernel.init (duplicating the communicator)", me)
        rank, size = world.Get_rank(), world.Get_size()
        threads_ok = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        host_comm = hostwait.blocking(lambda: world.Split_type(MPI.COMM_TYPE_SHARED, key=rank), limit,
                                      "mkernel.init (the host split)", rank, threads_ok)
        host_rank, host_size = host_comm.Get_rank(), host_comm.Get_size()
        host_leader = host_comm.Get_group().Translate_ranks([0], world.Get_group())[0]
        sub = host_rank // ranks_per_node if ranks_per_node else 0
        keys = [tuple(k) for k in hostwait.iallgather(world, np.array([host_leader, sub], np.int64), limit,
                                                      "mkernel.init (the topology exchange)", rank).tolist()]
        uniq = sorted(set(keys))
        node = uniq.index((host_leader, sub))
        node_comm = hostwait.blocking(lambda: world.Split(color=node, key=rank), limit,
                                      "mkernel.init (the node split)", rank, threads_ok)
        local_world_ranks = node_comm.Get_group().Translate_ranks(list(range(node_comm.Get_size())),
                                                                  world.Get_group())
        return cls(rank=rank, size=size, node=node, num_nodes=len(uniq), local_rank=node_comm.Get_rank(),
                   local_size=node_comm.Get_size(), host_rank=host_rank, host_size=host_size,
                   emulated=bool(ranks_per_node and ranks_per_node < host_size),
                   local_world_ranks=[int(r) for r in local_world_ranks], node_of_rank=[uniq.index(k) for k in keys],
                   world=world, node_comm=node_comm, host_comm=host_comm)

    @classmethod
    def from_bootstrap(cls, bootstrap, ranks_per_node: int | None = None, hostname: str | None = None,
                       timeout: float | None = None) -> "Topology":
        """Collective over a :class:`~mkernel.dist.bootstrap.Bootstrap`: hosts are the ranks that report the
        same ``hostname`` (default ``socket.gethostname()``), in world-rank order; the node and host
        communicators are Unix-socket groups (:func:`~mkernel.dist.localgroup.local_group`), ``world``
        the bootstrap itself (:class:`~mkernel.dist.group.BootstrapGroup`: not a private duplicate, so
        the application must not call it concurrently with mkernel).  The host names' allgather is
        bounded by ``host_wait_limit(timeout)``."""
        from .group import BootstrapGroup
        from .localgroup import local_group

        check_bootstrap(bootstrap)
        ranks_per_node = _ranks_per_node(ranks_per_node)
        world = BootstrapGroup(bootstrap)
        rank, size = world.rank, world.size
        limit = host_wait_limit(DEFAULT_TIMEOUT_S if timeout is None else timeout)
        hosts = hostwait.group_allgather(world, hostname or socket.gethostname(), limit,
                                         "mkernel.init (the host names)", rank)
        host_members = {h: [r for r in range(size) if hosts[r] == h] for h in hosts}
        keys = []
        for r in range(size):
            hm = host_members[hosts[r]]
            keys.append((hm[0], hm.index(r) // ranks_per_node if ranks_per_node else 0))
        uniq = sorted(set(keys))
        node = uniq.index(keys[rank])
        node_members = [r for r in range(size) if keys[r] == keys[rank]]
        mine = host_members[hosts[rank]]
        host_comm = local_group(world, mine)
        emulated = bool(ranks_per_node and ranks_per_node < len(mine))
        node_comm = local_group(world, node_members) if emulated else host_comm
        return cls(rank=rank, size=size, node=node, num_nodes=len(uniq), local_rank=node_members.index(rank),
                   local_size=len(node_members), host_rank=mine.index(rank), host_size=len(mine), emulated=emulated,
                   local_world_ranks=node_members, node_of_rank=[uniq.index(k) for k in keys],
                   world=world, node_comm=node_comm, host_comm=host_comm)

    def close(self) -> None:
        """Close the communicators that hold sockets (the non-MPI bootstrap's groups)."""
        from .group import Group

        for c in {id(c): c for c in (self.node_comm, self.host_comm)}.values():
            if isinstance(c, Group):
                c.close()


def _ranks_per_node(ranks_per_node):
    if ranks_per_node is None:
        ranks_per_node = env.get("MKERNEL_RANKS_PER_NODE")
    if ranks_per_node is not None and ranks_per_node <= 0:
        raise ValueError(f"mkernel: ranks_per_node must be positive, got {ranks_per_node}")
    return ranks_per_node
