"""A fake ``pyverbs`` for CPU tests of the verbs transport's own logic (no RDMA device).

:func:`install` puts modules named ``pyverbs.*`` into ``sys.modules`` (through a pytest
monkeypatch) and returns a :class:`Fabric`: a software "NIC" shared by every transport of the
process.  Memory is the process's own, so an RDMA WRITE is a memmove and a SEND a copy into the
peer QP's next posted receive.  What it models (and checks):

* work requests execute in post order per QP, later than they were posted: at most
  ``per_run`` of them each time some CQ is polled (a slow NIC);
* the NIC reads a request's source bytes when it executes it (inline data: when it is posted), and
  ``stale`` records every SEND or WRITE whose source bytes changed in between (a staging slot
  reused too early);
* a WRITE needs an MR with IBV_ACCESS_REMOTE_WRITE covering the target (else a remote access error
  completion); a SEND with no receive posted is an RNR: retried at each run, an error completion
  (IBV_WC_RNR_RETRY_EXC_ERR) after ``rnr_retry`` retries, forever with 7; ``rnr_events`` counts
  them;
* a failed QP flushes its later requests (IBV_WC_WR_FLUSH_ERR), every one with a completion;
  ``QP.modify`` to IBV_QPS_ERR fails a QP and flushes its posted receives too;
* a QP that sends to a failed (or destroyed) QP gets IBV_WC_RETRY_EXC_ERR: a responder in the error
  state drops what it receives, so the requester's retries run out.
"""
from __future__ import annotations

import ctypes
import itertools
import sys
import threading
import types
from collections import deque

IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE, IBV_ACCESS_REMOTE_READ = 1, 2, 4
IBV_QPT_RC = 2
IBV_QPS_ERR, IBV_QP_STATE = 6, 1
IBV_WR_RDMA_WRITE, IBV_WR_SEND = 0, 2
IBV_SEND_SIGNALED, IBV_SEND_INLINE = 2, 8
IBV_WC_SUCCESS, IBV_WC_WR_FLUSH_ERR, IBV_WC_REM_ACCESS_ERR = 0, 5, 10
IBV_WC_RETRY_EXC_ERR, IBV_WC_RNR_RETRY_EXC_ERR = 12, 13


class PyverbsError(Exception):
    pass


class WC:
    def __init__(self, qp_num, status=0, wr_id=0, byte_len=0):
        self.qp_num, self.status, self.wr_id, self.byte_len, self.vendor_err = qp_num, status, wr_id, byte_len, 0


class Fabric:
    def __init__(self):
        self.lock = threading.RLock()
        self.qps: dict[int, "QP"] = {}
        self.mrs: list["MR"] = []
        self.per_run = 4
        self.no_inline = False
        self.stale: list[str] = []
        self.rnr_events = 0
        self._ids = itertools.count(17)

    def new_id(self) -> int:
        return next(self._ids)

    def mr_for(self, key: int, addr: int, n: int, remote: bool):
        for mr in self.mrs:
            if (mr.rkey if remote else mr.lkey) == key and not mr.closed:
                if mr.address <= addr and addr + n <= mr.address + mr.length:
                    return mr
        return None

    def run(self) -> None:
        with self.lock:
            for qp in list(self.qps.values()):
                done = 0
                while qp.sq and done < self.per_run:
                    if not qp.execute(self, qp.sq[0]):
                        break
                    qp.sq.popleft()
                    done += 1


class CQ:
    def __init__(self, ctx, n, *a, **k):
        self.fabric, self.q = ctx.fabric, deque()

    def poll(self, n=1):
        self.fabric.run()
        with self.fabric.lock:
            out = [self.q.popleft() for _ in range(min(n, len(self.q)))]
        return len(out), out

    def close(self):
        pass


class Context:
    def __init__(self, name=None, **k):
        self.name, self.fabric = name, FABRIC

    def query_port(self, port):
        return types.SimpleNamespace(state=4, lid=0, active_mtu=5, gid_tbl_len=4, link_layer=2)

    def query_gid(self, port, index):
        return types.SimpleNamespace(gid="fe80:0000:0000:0000:0000:0000:0000:0001")

    def close(self):
        pass


def port_state_to_str(state):
    return str(state)


class PD:
    def __init__(self, ctx):
        self.ctx, self.fabric = ctx, ctx.fabric

    def close(self):
        pass


class MR:
    def __init__(self, pd, length, access, address=None, **k):
        self.fabric, self.length, self.access, self.address = pd.fabric, int(length), int(access), int(address)
        self.lkey = self.rkey = pd.fabric.new_id()
        self.closed = False
        with pd.fabric.lock:
            pd.fabric.mrs.append(self)

    def close(self):
        self.closed = True


class SGE:
    def __init__(self, addr, length, lkey):
        self.addr, self.length, self.lkey = int(addr), int(length), int(lkey)


class SendWR:
    def __init__(self, wr_id=0, opcode=IBV_WR_SEND, num_sge=1, sg=(), send_flags=0):
        self.wr_id, self.opcode, self.sg, self.send_flags = wr_id, opcode, list(sg), send_flags
        self.next_wr = None
        self.rkey = self.remote_addr = None

    def set_wr_rdma(self, rkey, addr):
        self.rkey, self.remote_addr = int(rkey), int(addr)


class RecvWR:
    def __init__(self, wr_id=0, num_sge=1, sg=()):
        self.wr_id, self.sg = wr_id, list(sg)


class QPCap:
    def __init__(self, **k):
        self.__dict__.update(k)


class QPInitAttr:
    def __init__(self, **k):
        self.__dict__.update(k)


class QPAttr:
    def __init__(self, **k):
        self.__dict__.update(k)


class GID:
    def __init__(self, s):
        self.gid = s


class GlobalRoute:
    def __init__(self, **k):
        self.__dict__.update(k)


class AHAttr:
    def __init__(self, **k):
        self.__dict__.update(k)


class _Posted:
    __slots__ = ("wr", "data", "signaled")


class QP:
    def __init__(self, pd, init, attr):
        f = pd.fabric
        if f.no_inline and getattr(init.cap, "max_inline_data", 0):
            raise PyverbsError("no inline data on this device")
        self.fabric, self.scq, self.rcq = f, init.scq, init.rcq
        self.qp_num = f.new_id()
        self.sq, self.rq = deque(), deque()
        self.dest, self.rnr_retry, self.rnr_count, self.failed = None, 7, 0, False
        self.rts_attr = None
        with f.lock:
            f.qps[self.qp_num] = self

    def to_rts(self, attr):
        self.rts_attr, self.dest, self.rnr_retry = attr, attr.dest_qp_num, attr.rnr_retry

    def modify(self, attr, mask):
        if mask & IBV_QP_STATE and getattr(attr, "qp_state", None) == IBV_QPS_ERR:
            with self.fabric.lock:
                self.failed = True
                while self.rq:
                    self.rcq.q.append(WC(self.qp_num, IBV_WC_WR_FLUSH_ERR, self.rq.popleft().wr_id))

    def post_recv(self, wr):
        with self.fabric.lock:
            self.rq.append(wr)

    def post_send(self, wr):
        with self.fabric.lock:
            while wr is not None:
                p = _Posted()
                p.wr, p.signaled = wr, bool(wr.send_flags & IBV_SEND_SIGNALED)
                # what the NIC would read now (inline: it does read it now)
                p.data = b"".join(ctypes.string_at(s.addr, s.length) for s in wr.sg)
                self.sq.append(p)
                wr = wr.next_wr

    def _complete(self, p, status=0):
        if p.signaled or status:
            self.scq.q.append(WC(self.qp_num, status, p.wr.wr_id))

    def execute(self, f: Fabric, p: _Posted) -> bool:
        """Run one request; False: not now (RNR, retried later)."""
        wr = p.wr
        if self.failed:
            self._complete(p, IBV_WC_WR_FLUSH_ERR)
            return True
        if wr.send_flags & IBV_SEND_INLINE:
            data = p.data
        else:
            data = b"".join(ctypes.string_at(s.addr, s.length) for s in wr.sg)
            if data != p.data:
                f.stale.append(f"qp {self.qp_num} opcode {wr.opcode}: source changed between post and execution")
        for s in wr.sg:
            if f.mr_for(s.lkey, s.addr, s.length, remote=False) is None:
                self.failed = True
                self._complete(p, 4)  # IBV_WC_LOC_PROT_ERR
                return True
        peer = f.qps.get(self.dest)
        if peer is None or peer.failed:
            self.failed = True
            self._complete(p, IBV_WC_RETRY_EXC_ERR)
            return True
        if wr.opcode == IBV_WR_RDMA_WRITE:
            mr = f.mr_for(wr.rkey, wr.remote_addr, len(data), remote=True)
            if mr is None or not mr.access & IBV_ACCESS_REMOTE_WRITE:
                self.failed = True
                self._complete(p, IBV_WC_REM_ACCESS_ERR)
                return True
            ctypes.memmove(wr.remote_addr, data, len(data))
        else:
            if not peer.rq:
                f.rnr_events += 1
                self.rnr_count += 1
                if self.rnr_retry != 7 and self.rnr_count > self.rnr_retry:
                    self.failed = True
                    self._complete(p, IBV_WC_RNR_RETRY_EXC_ERR)
                    return True
                return False
            self.rnr_count = 0
            rwr = peer.rq.popleft()
            if len(data) > rwr.sg[0].length:
                raise AssertionError("receive buffer too small")
            ctypes.memmove(rwr.sg[0].addr, data, len(data))
            peer.rcq.q.append(WC(peer.qp_num, 0, rwr.wr_id, len(data)))
        self._complete(p)
        return True

    def close(self):
        with self.fabric.lock:
            self.fabric.qps.pop(self.qp_num, None)


FABRIC: Fabric | None = None


def install(monkeypatch) -> Fabric:
    """Fake pyverbs modules in sys.modules for the test (undone by the monkeypatch); a new Fabric."""
    global FABRIC
    FABRIC = Fabric()
    me = sys.modules[__name__]
    enums = types.ModuleType("pyverbs.enums")
    for k, v in globals().items():
        if k.startswith("IBV_"):
            setattr(enums, k, v)
    mods = {
        "pyverbs": types.ModuleType("pyverbs"),
        "pyverbs.enums": enums,
        "pyverbs.device": types.SimpleNamespace(Context=Context, port_state_to_str=port_state_to_str),
        "pyverbs.pyverbs_error": types.SimpleNamespace(PyverbsError=PyverbsError),
        "pyverbs.pd": types.SimpleNamespace(PD=PD),
        "pyverbs.cq": types.SimpleNamespace(CQ=CQ),
        "pyverbs.mr": types.SimpleNamespace(MR=MR),
        "pyverbs.qp": types.SimpleNamespace(QP=QP, QPAttr=QPAttr, QPCap=QPCap, QPInitAttr=QPInitAttr),
        "pyverbs.addr": types.SimpleNamespace(GID=GID, AHAttr=AHAttr, GlobalRoute=GlobalRoute),
        "pyverbs.wr": types.SimpleNamespace(SGE=SGE, SendWR=SendWR, RecvWR=RecvWR),
    }
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
        if name != "pyverbs":
            setattr(mods["pyverbs"], name.split(".")[1], mod)
    mods["pyverbs"].__path__ = []
    assert me.FABRIC is FABRIC
    return FABRIC
