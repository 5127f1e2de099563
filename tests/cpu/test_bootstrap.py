"""A bootstrap that is not MPI: topology and the bounded agreement over an in-process bootstrap whose ranks
are threads (each rank its own host name, or several ranks per host, emulated nodes too)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from mkernel import CommTimeout
from mkernel.dist.agreement import Agreement
from mkernel.dist.bootstrap import Bootstrap, MpiBootstrap, check_bootstrap, is_mpi_comm
from mkernel.dist.group import BootstrapGroup, Group
from mkernel.dist.localgroup import LocalGroup
from mkernel.dist.topology import Topology


class Hub:
    """The shared state of one job of thread ranks."""

    def __init__(self, n: int):
        self.n, self.slots = n, [None] * n
        self.arrive, self.leave = threading.Barrier(n), threading.Barrier(n)


class ThreadBootstrap:
    """The Bootstrap protocol for ranks that are threads of this process."""

    def __init__(self, hub: Hub, rank: int):
        self.hub, self.rank, self.size = hub, rank, hub.n

    def allgather(self, data: bytes) -> list[bytes]:
        assert isinstance(data, bytes)
        self.hub.slots[self.rank] = data
        self.hub.arrive.wait(60)
        out = list(self.hub.slots)
        self.hub.leave.wait(60)
        return out

    def barrier(self) -> None:
        self.hub.arrive.wait(60)


def run_ranks(n: int, fn):
    """``[fn(rank, bootstrap) for every rank]``, each on its own thread (an exception is re-raised)."""
    hub = Hub(n)
    out, errs = [None] * n, [None] * n

    def body(r):
        try:
            out[r] = fn(r, ThreadBootstrap(hub, r))
        except BaseException as exc:  # noqa: BLE001
            errs[r] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for e in errs:
        if e is not None:
            raise e
    return out


def _topo(hosts, rpn=None):
    def fn(r, bs):
        t = Topology.from_bootstrap(bs, rpn, hostname=hosts[r])
        # the node and host communicators work, in local-rank order
        row = dict(node=t.node, num_nodes=t.num_nodes, local_rank=t.local_rank, local_size=t.local_size,
                   host_rank=t.host_rank, host_size=t.host_size, emulated=t.emulated,
                   local_world_ranks=t.local_world_ranks, node_of_rank=t.node_of_rank,
                   node_gather=t.node_comm.allgather(("rank", t.rank, b"\x00\xff")),
                   host_gather=t.host_comm.allgather(t.rank), same=t.node_comm is t.host_comm,
                   root=t.world.bcast(f"from {t.rank}", root=1 % t.size))
        t.node_comm.Barrier()
        t.close()
        return row
    return run_ranks(len(hosts), fn)


def test_two_hosts_two_ranks_each():
    rows = _topo(["a", "a", "b", "b"])
    assert [r["node"] for r in rows] == [0, 0, 1, 1] and all(r["num_nodes"] == 2 for r in rows)
    assert [r["local_rank"] for r in rows] == [0, 1, 0, 1] and all(r["local_size"] == 2 for r in rows)
    assert [r["host_rank"] for r in rows] == [0, 1, 0, 1] and not any(r["emulated"] for r in rows)
    assert rows[2]["local_world_ranks"] == [2, 3] and rows[0]["node_of_rank"] == [0, 0, 1, 1]
    assert rows[3]["node_gather"] == [("rank", 2, b"\x00\xff"), ("rank", 3, b"\x00\xff")]
    assert rows[1]["host_gather"] == [0, 1] and all(r["same"] for r in rows)
    assert all(r["root"] == "from 1" for r in rows)


def test_interleaved_hosts_keep_world_rank_order():
    rows = _topo(["b", "a", "b", "a"])
    assert [r["node"] for r in rows] == [0, 1, 0, 1]  # nodes numbered by their first world rank
    assert rows[0]["local_world_ranks"] == [0, 2] and rows[1]["local_world_ranks"] == [1, 3]
    assert rows[3]["host_gather"] == [1, 3]


def test_emulated_nodes_on_one_host():
    rows = _topo(["h"] * 3, rpn=2)
    assert [r["node"] for r in rows] == [0, 0, 1] and [r["local_size"] for r in rows] == [2, 2, 1]
    assert [r["host_rank"] for r in rows] == [0, 1, 2] and all(r["host_size"] == 3 for r in rows)
    assert all(r["emulated"] and not r["same"] for r in rows)
    assert rows[2]["node_gather"] == [("rank", 2, b"\x00\xff")] and rows[2]["host_gather"] == [0, 1, 2]


def test_one_rank_per_node_by_environment(mkenv):
    mkenv("MKERNEL_RANKS_PER_NODE", 1)
    rows = _topo(["h", "h"])
    assert [r["node"] for r in rows] == [0, 1] and all(r["local_size"] == 1 and r["emulated"] for r in rows)


def test_from_comm_takes_a_bootstrap(monkeypatch):
    """init(comm=...) goes through Topology.from_comm: a bootstrap object is not mistaken for MPI."""
    def fn(r, bs):
        t = Topology.from_comm(bs)
        assert isinstance(t.world, BootstrapGroup) and isinstance(t.node_comm, LocalGroup)
        t.close()
        return t.local_size
    assert run_ranks(2, fn) == [2, 2]


def test_agreement_over_a_bootstrap():
    """agree / exchange run over the world (the bootstrap) and over a node group, bounded; ranks that
    disagree are named."""
    def fn(r, bs):
        t = Topology.from_bootstrap(bs, hostname="h")
        ag = Agreement(r, lambda: 5.0)
        d = ag.agree("mkernel.all_reduce", ("bfloat16", (8,), False), t.world)
        rows = ag.exchange("mkernel.ag_gemm", np.array([10 * r, r]), t.node_comm)
        try:
            ag.agree("mkernel.all_reduce", ("bfloat16", (16 + (r == 2),), False), t.world)
            err = None
        except ValueError as exc:
            err = str(exc)
        t.close()
        return d, rows.tolist(), err
    out = run_ranks(3, fn)
    assert len({d for d, _, _ in out}) == 1
    assert all(rows == [[0, 0], [10, 1], [20, 2]] for _, rows, _ in out)
    assert "ranks [2] have [('bfloat16', (17,), False)]" in out[0][2]
    assert "ranks [0, 1] have" in out[2][2]


def test_a_rank_that_never_joins_times_out_and_breaks_the_agreement():
    hub = Hub(2)
    late = threading.Event()
    result = {}

    def rank1():
        late.wait(30)
        BootstrapGroup(ThreadBootstrap(hub, 1)).allgather([7])  # releases rank 0's pending allgather

    t = threading.Thread(target=rank1)
    t.start()
    ag = Agreement(0, lambda: 0.05)  # bounded by 4 x max(timeout, 1 s)
    t0 = time.monotonic()
    with pytest.raises(CommTimeout, match="rank 0 waited 4.0 s"):
        ag.exchange("mkernel.test", [1], BootstrapGroup(ThreadBootstrap(hub, 0)))
    result["waited"] = time.monotonic() - t0
    with pytest.raises(CommTimeout, match="agreement is broken"):
        ag.exchange("mkernel.test", [1], BootstrapGroup(ThreadBootstrap(hub, 0)))
    late.set()
    t.join(30)
    assert 3.9 < result["waited"] < 6


def test_bad_bootstraps_are_named():
    with pytest.raises(TypeError, match="has no allgather, barrier"):
        check_bootstrap(type("B", (), {"rank": 0, "size": 1})())
    with pytest.raises(ValueError, match="0 <= rank < size"):
        check_bootstrap(type("B", (), {"rank": 2, "size": 2, "allgather": None, "barrier": None})())

    class Short:
        rank, size = 0, 2

        def allgather(self, data):
            return [data]

        def barrier(self):
            pass

    with pytest.raises(TypeError, match="expected a list of 2 bytes objects"):
        BootstrapGroup(Short()).allgather(1)
    assert isinstance(Short(), Bootstrap) and not is_mpi_comm(Short())


def test_mpi_bootstrap_speaks_the_protocol():
    class Comm:  # the mpi4py methods MpiBootstrap uses
        def Get_rank(self):
            return 0

        def Get_size(self):
            return 1

        def allgather(self, obj):
            return [obj]

        def Barrier(self):
            pass

    b = MpiBootstrap(Comm())
    assert isinstance(b, Bootstrap) and (b.rank, b.size) == (0, 1) and b.allgather(b"x") == [b"x"]


def test_group_allgather_within_raises_at_the_deadline():
    class Stuck(Group):
        size = 2

        def allgather_bytes(self, data):
            time.sleep(2)
            return [data, data]

    from mkernel.dist.group import GroupTimeout

    with pytest.raises(GroupTimeout):
        Stuck().allgather_within(1, 0.1)
    assert Stuck().allgather_within(1, 5) == [1, 1]
