"""The per-rank CPU proxy that carries inter-node traffic, and its transports (verbs, TCP)."""
from .engine import (CMD_BYTES, CMD_DTYPE, LAYOUT, NO_FLAG, OP_BARRIER, OP_FLAG, OP_NOP, OP_WRITE, HostProducer,
                     MkProxyStruct, Proxy, Ring)

__all__ = ["CMD_DTYPE", "CMD_BYTES", "OP_NOP", "OP_WRITE", "OP_FLAG", "OP_BARRIER", "NO_FLAG", "LAYOUT",
           "MkProxyStruct", "Ring", "HostProducer", "Proxy"]
