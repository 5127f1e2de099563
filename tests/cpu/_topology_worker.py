"""Run under mpirun by test_topology.py: prints this rank's topology as JSON."""
import json
import sys

from mkernel.dist.topology import Topology

rpn = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] != "none" else None
t = Topology.from_comm(ranks_per_node=rpn)
rows = t.world.gather({"rank": t.rank, "size": t.size, "node": t.node, "num_nodes": t.num_nodes,
                       "local_rank": t.local_rank, "local_size": t.local_size, "host_rank": t.host_rank,
                       "emulated": t.emulated, "local_world_ranks": t.local_world_ranks,
                       "node_of_rank": t.node_of_rank}, root=0)
if t.rank == 0:
    print("TOPOLOGY " + json.dumps(rows))
