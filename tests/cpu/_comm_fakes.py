"""Stand-ins for the host tests of the fused comm-GEMM ops (test_gemm_rs_host.py, test_gemm_ar_host.py): a
context whose exchanges and agreements are recorded, arrays with fake device pointers, tensor maps, kernels
and launches that record what they would submit.  Nothing touches a GPU."""
from __future__ import annotations

import ctypes

import numpy as np

from mkernel.core.arrays import DeviceArray
from mkernel.dist.signals import MkComm
from mkernel.ops.base import OpState

_next = [1 << 20]


def arr(shape, dtype="bfloat16", device=0, ptr=None, strides=None, readonly=False):
    """A DeviceArray at a fresh fake address (or ``ptr``), 16 MiB apart at least."""
    p = ptr if ptr is not None else _next[0]
    a = DeviceArray(p, shape, dtype, strides, device, None, readonly=readonly)
    _next[0] += max(1 << 24, (a.nbytes + 4095) // 4096 * 4096)
    return a


class FakeWs:
    def __init__(self, nbytes, n):
        self.ptr, self.peer_table, self.nbytes = (1 << 40) + n * (1 << 36), (1 << 41) + n * (1 << 36), nbytes


class FakeComm:
    def __init__(self, ctx):
        self.ctx = ctx

    def allgather(self, x):
        return [x] + [self.ctx.peer_sig or x] * (self.ctx.local_size - 1)


class FakeCtx:
    device, rank, local_rank, num_nodes, sm_count, resident_sms = 0, 0, 0, 1, 132, 132

    def __init__(self, P=2, ks=None):
        self.size = self.local_size = P
        self.ks = ks  # K_r of every rank (None: this rank's everywhere)
        self.peer_sig = None  # a different signature on the other ranks
        self.agreed, self.exchanges, self.workspaces = [], [], []
        self.states = {}
        self.workspace_generation = 0
        self.node_comm = FakeComm(self)

    def check(self):
        pass

    def agree(self, what, signature, comm=None):
        self.agreed.append((what, signature))
        return 0x7000 + len(self.agreed)

    def bounded_allgather(self, vec, what, comm=None):
        self.exchanges.append((what, tuple(vec)))
        rows = np.tile(np.asarray(vec, dtype=np.int64), (self.local_size, 1))
        if self.ks is not None:
            rows[:, 1] = self.ks
        if self.peer_sig is not None:
            rows[1:, 0] += 1
        return rows

    def op_state(self, name):
        return self.states.setdefault(name, OpState(name))

    def last_plan(self, name):
        return self.states[name].last_plan

    def workspace(self, key, nbytes, stream=None, what=""):
        self.workspaces.append((key, nbytes))
        return FakeWs(nbytes, self.workspace_generation)

    def comm_args(self, op, sig=0):
        c = MkComm()
        c.sig = sig
        return c


class FakeMap:
    def __init__(self, ptr, dtype, dims, strides, box):
        self.ptr, self.spec = ptr, (dtype, tuple(dims), tuple(strides), tuple(box))
        self.buf = ctypes.create_string_buffer(ptr.to_bytes(8, "little"), 128)
        self.buf.spec = self.spec
        self.raw = self.buf.raw

    def point(self, ptr):
        self.ptr = ptr
        self.buf[0:8] = ptr.to_bytes(8, "little")


def value(a):
    """What a launch argument holds: a kernel argument struct's fields (dict), MkComm's sig, a tensor map's
    base address."""
    if isinstance(a, ctypes.Structure) and hasattr(a, "rows") and hasattr(a, "L"):
        d = dict(ws=a.ws, peers=a.peers, c=a.c, ldc=a.ldc, K=a.K, c_tma=a.c_tma, c_vec_ok=a.c_vec_ok, P=a.rows.P,
                 me=a.rows.me, N=a.rows.N, offs=list(a.rows.offs[:a.rows.P + 1]), flags_off=a.L.flags_off,
                 data_off=a.L.data_off, slot_bytes=a.L.slot_bytes, group_m=a.rows.group_m)
        if hasattr(a, "G"):
            d.update(M=a.M, gflags_off=a.G.flags_off, gdata_off=a.G.data_off, gslot_bytes=a.G.slot_bytes)
        return d
    if isinstance(a, MkComm):
        return dict(sig=a.sig)
    return int.from_bytes(a.raw[:8], "little")  # a tensor map: its base address


class FakeLaunch:
    def __init__(self, log, name, args):
        self.log, self.name, self.args = log, name, args

    def submit(self):
        self.log.append(dict(op=self.name, values=[value(a) for a in self.args]))


class FakeKernel:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def prepare(self, grid, block, args, *, stream=None, smem=0, cooperative=False, **kw):
        self.log.append(dict(prepared=self.name, grid=grid, block=block, smem=smem, cooperative=cooperative,
                             stream=stream, maps=[getattr(a, "spec", None) for a in args[:3]]))
        return FakeLaunch(self.log, self.name, list(args))


def launches(log):
    return [e for e in log if "values" in e]
