"""RDMA transport through pyverbs: one RC queue pair per peer, RDMA WRITE for data and flags.

Set-up (collective, through the exchanger's ``allgather``): open the NIC chosen for this GPU (or
``$MKERNEL_IB_DEVICE`` = ``name`` or ``name:port``), pick the GID (``$MKERNEL_IB_GID_INDEX``, else
the first RoCE v2 IPv4-mapped GID, else 0), create one PD, one send CQ, one receive CQ and one RC
QP per peer, register every window, exchange (QP number, PSN, LID, GID, window addresses/rkeys),
and move the QPs INIT -> RTR -> RTS.

Memory registration of a window:
* host window: ``ibv_reg_mr`` on its address;
* GPU window: DMA-BUF (``cuMemGetHandleForAddressRange`` -> ``ibv_reg_dmabuf_mr``; remote
  addresses are then offsets into the dma-buf), else ``ibv_reg_mr`` on the device pointer (works
  with nvidia-peermem), else a pinned host *bounce* buffer of the same size (the sender copies
  DtoH before posting; the receiver copies HtoD when told so).

Notification (``notify=``, default ``"auto"``; env ``MKERNEL_VERBS_NOTIFY``):
* ``"write"``: after a destination's data WRITEs, one 8-byte RDMA WRITE per flag on the same QP.
  What this relies on: (1) an RC QP executes its requests at the responder in order (PSN order),
  so the flag WRITE's data is placed after every byte of the earlier WRITEs was placed; (2) the
  memory regions are NOT registered with IBV_ACCESS_RELAXED_ORDERING, so the NIC's PCIe posted
  writes reach memory in order; (3) for a GPU window, the GPU reports
  CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING >= OWNER, i.e. a kernel on that GPU that
  observes the flag also observes the NIC's earlier writes.  The InfiniBand spec itself only
  promises the data of a WRITE is defined once a *later* SEND / WRITE-with-immediate / atomic has
  *completed at the responder*; (1)-(3) are the platform guarantees polling a flag rests on.  A
  fence (IBV_SEND_FENCE) is not needed: it only orders after earlier RDMA READs/atomics.
* ``"send"``: the spec-sanctioned path: after the data WRITEs the sender SENDs a notice
  (ranges + flags); the receiver's proxy sees the receive completion (all earlier WRITEs of the QP
  are then placed), copies bounce ranges HtoD, and raises the flags itself.  Chosen automatically
  when a window uses a bounce buffer or the GPU's RDMA write ordering is NONE.

Notices (and the *bye* at close, in both modes) are SENDs that consume the receiver's posted
receives, so they are credit-controlled: each rank posts ``_N_RECV`` receives per peer and, every
``_CREDIT_EVERY`` re-posts, RDMA-WRITEs its cumulative re-post count into the sender's credit word;
a sender never has more notices unconsumed than the receiver has receives.  A receiver therefore
never runs dry in normal operation, the RNR retry count is bounded (``_RNR_RETRY``) and an RNR
failure is a CommError.  Only memory peers write is registered remote-writable: the windows (or
their bounce buffers) and the credit words; the staging of flag values and notices (the NIC reads
it) and the receive buffers are local-only.
"""
from __future__ import annotations

import collections
import ctypes
import glob
import os
import random
import struct
import time

import numpy as np

from ...errors import CommError
from . import PeerBatch, Transport

__all__ = ["VerbsTransport", "require_pyverbs", "available", "list_ports", "choose_device", "choose_gid_index"]

_SYS = "/sys/class/infiniband"


def require_pyverbs():
    try:
        import pyverbs.device  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "mkernel: the 'verbs' transport needs pyverbs (rdma-core's Python bindings), which this Python "
            "cannot import. Install it (Debian/Ubuntu: apt install python3-pyverbs) and make it visible to this "
            "interpreter (for a venv: a .pth file naming /usr/lib/python3/dist-packages, or PYTHONPATH to a "
            "directory holding only a 'pyverbs' symlink), or choose MKERNEL_TRANSPORT=tcp.") from exc


def list_ports(sysfs: str = _SYS) -> list[dict]:
    """RDMA ports from sysfs: name, port, state ('ACTIVE', ...), link_layer, numa node, pci path."""
    out = []
    for dev in sorted(glob.glob(os.path.join(sysfs, "*"))):
        name = os.path.basename(dev)
        try:
            pci = os.path.realpath(os.path.join(dev, "device"))
        except OSError:
            pci = ""
        numa = _read(os.path.join(dev, "device", "numa_node"), "-1")
        for p in sorted(glob.glob(os.path.join(dev, "ports", "*"))):
            state = _read(os.path.join(p, "state"), "0: ?").split(":")[-1].strip()
            out.append({"name": name, "port": int(os.path.basename(p)), "state": state,
                        "link_layer": _read(os.path.join(p, "link_layer"), "?"), "numa": int(numa or -1),
                        "pci": pci})
    return out


def _read(path, default=""):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def available() -> bool:
    """pyverbs imports and some RDMA port is ACTIVE."""
    try:
        require_pyverbs()
    except ImportError:
        return False
    return any(p["state"] == "ACTIVE" for p in list_ports())


def _gpu_pci_path() -> str | None:
    try:
        from cuda.bindings import driver as cu

        from ...core.driver import check

        dev = int(check(cu.cuCtxGetDevice()))
        bus = check(cu.cuDeviceGetPCIBusId(32, dev))
        bus = (bus.decode() if isinstance(bus, bytes) else str(bus)).rstrip("\0").lower()
        return os.path.realpath(f"/sys/bus/pci/devices/{bus}")
    except Exception:
        return None


def choose_device(local_rank: int = 0) -> tuple[str, int]:
    """(device, port) for this rank: ``$MKERNEL_IB_DEVICE`` (``name[:port]``, or a comma list indexed
    by local rank), else the ACTIVE port whose PCI path shares the most with the GPU's (same switch),
    then same NUMA node, round-robin over ties by local rank."""
    env = os.environ.get("MKERNEL_IB_DEVICE", "").strip()
    ports = list_ports()
    if env:
        items = [x.strip() for x in env.split(",") if x.strip()]
        item = items[local_rank % len(items)]
        name, _, port = item.partition(":")
        cand = [p for p in ports if p["name"] == name and (not port or p["port"] == int(port))]
        if not cand:
            raise CommError(f"verbs: RDMA device {item!r} (MKERNEL_IB_DEVICE) not found; present: "
                            f"{sorted({p['name'] for p in ports}) or 'none'}")
        return name, cand[0]["port"]
    active = [p for p in ports if p["state"] == "ACTIVE"]
    if not active:
        raise CommError(f"verbs: no ACTIVE RDMA port (ports: {[(p['name'], p['port'], p['state']) for p in ports] or 'none'}); "
                        "use MKERNEL_TRANSPORT=tcp")
    gpu = _gpu_pci_path()
    gpu_numa = int(_read(os.path.join(gpu, "numa_node"), "-1")) if gpu else -1

    def score(p):
        common = len(os.path.commonpath([gpu, p["pci"]]).split("/")) if gpu and p["pci"] else 0
        return (common, p["numa"] == gpu_numa)

    best = max(score(p) for p in active)
    tied = [p for p in active if score(p) == best]
    p = tied[local_rank % len(tied)]
    return p["name"], p["port"]


def choose_gid_index(name: str, port: int) -> int:
    """``$MKERNEL_IB_GID_INDEX``, else the first RoCE v2 GID holding an IPv4-mapped address, else
    the first RoCE v2 GID, else 0 (InfiniBand)."""
    env = os.environ.get("MKERNEL_IB_GID_INDEX", "").strip()
    if env:
        return int(env)
    base = os.path.join(_SYS, name, "ports", str(port))
    if _read(os.path.join(base, "link_layer")) != "Ethernet":
        return 0
    v2 = []
    for g in sorted(glob.glob(os.path.join(base, "gids", "*")), key=lambda s: int(os.path.basename(s))):
        i = int(os.path.basename(g))
        gid = _read(g)
        if not gid or gid.replace(":", "").strip("0") == "":
            continue
        if "v2" in _read(os.path.join(base, "gid_attrs", "types", str(i))):
            v2.append((i, gid))
    for i, gid in v2:
        if gid.startswith("0000:0000:0000:0000:0000:ffff:"):
            return i
    return v2[0][0] if v2 else 0


_NOTICE_BYTES = 4096
_N_RECV = 128  # receives posted per peer: a sender has at most this many notices unconsumed (credits)
_MAX_NOTES_PER_CHAIN = _N_RECV // 2  # notices in one posted chain (a sender waits for credits per chain)
_CREDIT_EVERY = _N_RECV // 4  # a receiver returns credits once this many receives were re-posted
_RNR_RETRY = 6  # bounded (7 would retry forever); with credits a healthy receiver never runs dry
# transport retries before IBV_WC_RETRY_EXC_ERR: 6, not the spec's maximum 7, because rdma_rxe treats
# 7 as "retry forever" (like rnr_retry), so a dead or failed peer would never complete with an error
_RETRY_CNT = 6
_NOTE_HDR = struct.Struct("<IIII")  # kind (1 notice, 2 bye), n_ranges, n_flags, 0
_NOTE_REC = np.dtype([("win", "<u4"), ("pad", "<u4"), ("off", "<u8"), ("n", "<u8")])
_MAX_REC = (_NOTICE_BYTES - _NOTE_HDR.size) // _NOTE_REC.itemsize
_WC_RNR_RETRY_EXC_ERR, _WC_RETRY_EXC_ERR = 13, 12  # ibv_wc_status values (stable ABI)


class _SlotPool:
    """Fixed staging slots (flag values, notices) that the NIC reads some time after the post: a
    slot is taken when its work request is posted and given back only once that request completed
    (its chain's signaled completion was polled), never round-robin."""

    def __init__(self, n: int):
        self.n = n
        self.free = collections.deque(range(n))

    def take(self) -> int:
        if not self.free:  # the pool covers every request the send queues can hold
            raise CommError("verbs: internal error: no free staging slot")
        return self.free.popleft()

    def give(self, slots) -> None:
        self.free.extend(slots)


class _Reg:
    """How one window is reachable: lkey/rkey, address the NIC uses, optional bounce buffer."""

    def __init__(self, mr, base_addr, mode, bounce=None):
        self.mr, self.base, self.mode, self.bounce = mr, base_addr, mode, bounce
        self.lkey, self.rkey = mr.lkey, mr.rkey


class VerbsTransport(Transport):
    """``VerbsTransport(exchanger, windows, device=None, port=None, gid_index=None, notify="auto",
    sq_depth=512, local_rank=None, timeout=30.0)``."""

    name = "verbs"

    def __init__(self, exchanger, windows, device=None, port=None, gid_index=None, notify=None,
                 sq_depth: int = 512, local_rank: int | None = None, timeout: float = 30.0, qp_timeout: int = 14,
                 **options):
        require_pyverbs()
        super().__init__(exchanger, windows, **options)
        self.device, self.port, self.gid_index = device, port, gid_index
        self.notify = (notify or os.environ.get("MKERNEL_VERBS_NOTIFY") or "auto").lower()
        self.sq_depth, self.timeout = sq_depth, timeout
        self.qp_timeout = qp_timeout  # ACK timeout 4.096 us * 2**qp_timeout (14: 67 ms), _RETRY_CNT retries
        self.local_rank = local_rank if local_rank is not None else int(
            os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("MPI_LOCALRANKID", "0")))
        self.error: CommError | None = None
        self._objs = []

    # ---- set-up -----------------------------------------------------------------------------------
    def _open(self):
        from pyverbs.device import Context
        from pyverbs.pyverbs_error import PyverbsError

        names = {p["name"] for p in list_ports()}
        if self.device is None:
            self.device, p = choose_device(self.local_rank)
            self.port = self.port or p
        elif self.device not in names:
            raise CommError(f"verbs: RDMA device {self.device!r} not found; present: {sorted(names) or 'none'}")
        self.port = self.port or 1
        try:
            self.ctx = Context(name=self.device)
        except PyverbsError as exc:
            raise CommError(f"verbs: cannot open RDMA device {self.device!r}: {exc}") from exc
        pa = self.ctx.query_port(self.port)
        if pa.state != 4:  # IBV_PORT_ACTIVE
            from pyverbs.device import port_state_to_str

            raise CommError(f"verbs: port {self.port} of {self.device} is not ACTIVE "
                            f"(state {port_state_to_str(pa.state)}); check the link / `ibv_devinfo`")
        self.lid, self.mtu = pa.lid, pa.active_mtu
        if self.gid_index is None:
            self.gid_index = choose_gid_index(self.device, self.port)
        if not 0 <= self.gid_index < pa.gid_tbl_len:
            raise CommError(f"verbs: GID index {self.gid_index} out of range for {self.device} port {self.port} "
                            f"(table has {pa.gid_tbl_len} entries; MKERNEL_IB_GID_INDEX)")
        try:
            gid = self.ctx.query_gid(self.port, self.gid_index)
        except PyverbsError as exc:
            raise CommError(f"verbs: GID index {self.gid_index} of {self.device} port {self.port} is unusable: {exc}") from exc
        if gid.gid.replace(":", "").strip("0") == "" and pa.link_layer != 1:  # empty GID on RoCE
            raise CommError(f"verbs: GID index {self.gid_index} of {self.device} port {self.port} is empty "
                            "(MKERNEL_IB_GID_INDEX); see `show_gids` / /sys/class/infiniband/*/ports/*/gids")
        self.gid = gid.gid

    def _register(self, i, win):
        import pyverbs.enums as e
        from pyverbs.mr import MR
        from pyverbs.pyverbs_error import PyverbsError

        acc = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE  # never RELAXED_ORDERING (see module doc)
        if win.kind == "host":
            try:
                return _Reg(MR(self.pd, win.nbytes, acc, address=win.ptr), win.ptr, "host")
            except PyverbsError as exc:
                raise CommError(f"verbs: cannot register host window {i} ({win.nbytes} bytes at {win.ptr:#x}) with "
                                f"{self.device}: {exc} (ulimit -l / memlock?)") from exc
        errors = []
        if os.environ.get("MKERNEL_VERBS_BOUNCE", "0") != "1":
            try:
                return self._register_dmabuf(win, acc)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"dma-buf: {exc}")
            try:
                return _Reg(MR(self.pd, win.nbytes, acc, address=win.ptr), win.ptr, "peermem")
            except PyverbsError as exc:
                errors.append(f"ibv_reg_mr on device memory (nvidia-peermem): {exc}")
        # bounce: pinned host mirror of the window
        from cuda.bindings import driver as cu

        from ...core.driver import check

        hp = int(check(cu.cuMemHostAlloc(win.nbytes, cu.CU_MEMHOSTALLOC_PORTABLE)))
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * win.nbytes).from_address(hp))
        self._objs.append(("hostfree", hp))
        try:
            mr = MR(self.pd, win.nbytes, acc, address=hp)
        except PyverbsError as exc:
            raise CommError(f"verbs: cannot register GPU window {i} ({win.nbytes} bytes) directly "
                            f"({'; '.join(errors)}) nor its host bounce buffer: {exc}") from exc
        self.bounce_reasons.append(f"window {i}: " + "; ".join(errors))
        return _Reg(mr, hp, "bounce", bounce=arr)

    def _register_dmabuf(self, win, acc):
        from cuda.bindings import driver as cu
        from pyverbs.mr import DmaBufMR

        from ...core.driver import check

        page = os.sysconf("SC_PAGE_SIZE")
        base = win.ptr - win.ptr % page
        end = -(-(win.ptr + win.nbytes) // page) * page
        fd = int(check(cu.cuMemGetHandleForAddressRange(
            base, end - base, cu.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)))
        self._objs.append(("fd", fd))
        off = win.ptr - base
        mr = DmaBufMR(self.pd, win.nbytes, acc, dmabuf=fd, offset=off)
        return _Reg(mr, off, "dmabuf")  # iova == offset into the dma-buf

    def _gpu_ordering_ok(self) -> bool:
        try:
            from cuda.bindings import driver as cu

            from ...core.driver import device_attribute

            return device_attribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING) >= 100
        except Exception:
            return False

    def connect(self) -> None:
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        try:
            self._open()
        except CommError as exc:
            # everyone must learn about a failure, or peers hang in the exchange below
            self.ex.allgather(("error", str(exc)))
            raise
        self.pd = PD(self.ctx)
        self.bounce_reasons: list[str] = []
        self.regs = [self._register(i, w) for i, w in enumerate(self.windows)]
        if self.notify == "auto":
            gpu_direct = [r for r, w in zip(self.regs, self.windows) if w.kind == "gpu" and r.mode != "bounce"]
            bounce = any(r.mode == "bounce" for r in self.regs)
            self.notify = "send" if bounce or (gpu_direct and not self._gpu_ordering_ok()) else "write"
        if self.notify not in ("write", "send"):
            raise ValueError(f"verbs: notify must be 'write', 'send' or 'auto', got {self.notify!r}")
        if self.notify == "write" and any(r.mode == "bounce" for r in self.regs):
            raise CommError("verbs: notify='write' needs every window registered directly; a GPU window uses a "
                            f"bounce buffer ({self.bounce_reasons})")
        peers = [r for r in range(self.size) if r != self.rank]
        ncq = self.sq_depth * max(1, len(peers)) + 16
        self.scq = CQ(self.ctx, ncq)
        self.rcq = CQ(self.ctx, _N_RECV * max(1, len(peers)) + 16)
        acc = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE  # the QPs: peers write the windows
        local = e.IBV_ACCESS_LOCAL_WRITE  # memory only this rank's NIC reads or fills
        # staging the NIC reads (flag values: 8 B slots, notices: 4 KiB slots), one slot per request the
        # send queues can hold, recycled on completion; receive slots; the credit words peers write
        nslots = self.sq_depth * max(1, len(peers))
        self.flag_buf = np.zeros(nslots, np.uint64)
        self.flag_mr = MR(self.pd, self.flag_buf.nbytes, local, address=self.flag_buf.ctypes.data)
        self.note_buf = np.zeros((nslots, _NOTICE_BYTES), np.uint8)
        self.note_mr = MR(self.pd, self.note_buf.nbytes, local, address=self.note_buf.ctypes.data)
        self.recv_buf = np.zeros((max(1, len(peers)) * _N_RECV, _NOTICE_BYTES), np.uint8)
        self.recv_mr = MR(self.pd, self.recv_buf.nbytes, local, address=self.recv_buf.ctypes.data)
        self.credit_buf = np.zeros(max(1, self.size), np.uint64)  # [p]: my notices p consumed and re-posted
        self.credit_mr = MR(self.pd, self.credit_buf.nbytes, acc, address=self.credit_buf.ctypes.data)
        self._flag_slots, self._note_slots = _SlotPool(nslots), _SlotPool(nslots)
        self.qps, self.qp_peer, self.psn = {}, {}, {}
        inline = 64
        for r in peers:
            cap = QPCap(max_send_wr=self.sq_depth, max_recv_wr=_N_RECV, max_send_sge=1, max_recv_sge=1,
                        max_inline_data=inline)
            init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.scq, rcq=self.rcq, cap=cap, sq_sig_all=0)
            attr = QPAttr(port_num=self.port)
            attr.qp_access_flags = acc
            try:
                qp = QP(self.pd, init, attr)
            except Exception:  # noqa: BLE001 - device without inline data
                inline = 0
                cap.max_inline_data = 0
                qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.scq, rcq=self.rcq, cap=cap, sq_sig_all=0), attr)
            self.qps[r] = qp
            self.qp_peer[qp.qp_num] = r
            self.psn[r] = random.randrange(1 << 24)
        self.inline = inline >= 8
        info = {"qpn": {r: q.qp_num for r, q in self.qps.items()}, "psn": self.psn, "lid": self.lid,
                "gid": self.gid, "mtu": int(self.mtu), "notify": self.notify,
                "win": [(reg.base, reg.rkey, w.nbytes) for reg, w in zip(self.regs, self.windows)],
                "credit": (self.credit_buf.ctypes.data, self.credit_mr.rkey)}
        table = self.ex.allgather(info)
        bad = [(r, t[1]) for r, t in enumerate(table) if isinstance(t, tuple) and t and t[0] == "error"]
        if bad:
            raise CommError(f"verbs: set-up failed on ranks {[r for r, _ in bad]}: {bad[0][1]}")
        if len({t["notify"] for t in table}) != 1:
            raise CommError(f"verbs: ranks disagree on the notify mode: {[t['notify'] for t in table]}")
        self.remote = table
        # post receives, then INIT -> RTR -> RTS; a failure still joins the status exchange at the end
        error = None
        try:
            self._to_rts(table, peers, acc)
        except Exception as exc:  # noqa: BLE001 - handed to every rank below
            error = exc
        # completion bookkeeping
        # (token or None, n_wr, flag slots, notice slots, credit?) per posted chain, per QP
        self._outstanding = {r: collections.deque() for r in peers}
        self._in_sq = {r: 0 for r in peers}
        self._credit_in_sq = {r: 0 for r in peers}  # of _in_sq: credit WRITEs (close does not wait for them)
        self._gone: set[int] = set()  # peers that said bye and whose QP failed after: ignored
        self._notes_sent = {r: 0 for r in peers}    # notices (SENDs) posted to r
        self._reposted = {r: 0 for r in peers}      # receives re-posted for r's notices
        self._credit_told = {r: 0 for r in peers}   # the last re-post count written into r's credit word
        self._token_left: dict[int, int] = {}
        self._done: list[int] = []
        self._byes: set[int] = set()
        # every rank learns whether every rank connected (a rank that failed does not leave the others
        # waiting for it)
        status = self.ex.allgather(None if error is None else str(error))
        failed = [r for r, m in enumerate(status) if m is not None]
        if failed:
            if error is not None:
                raise error
            raise CommError(f"verbs: set-up failed on ranks {failed}: {status[failed[0]]}", {"peer": failed[0]})

    def _to_rts(self, table, peers, acc) -> None:
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        self._recv_slot = {}
        for k, r in enumerate(peers):
            for j in range(_N_RECV):
                self._post_recv(r, k * _N_RECV + j)
        for r in peers:
            t = table[r]
            a = QPAttr(port_num=self.port)
            a.qp_access_flags = acc
            a.path_mtu = min(int(self.mtu), t["mtu"])
            a.dest_qp_num = t["qpn"][self.rank]
            a.rq_psn = t["psn"][self.rank]
            a.sq_psn = self.psn[r]
            a.max_dest_rd_atomic = 1
            a.max_rd_atomic = 1
            a.min_rnr_timer = 12
            a.timeout = self.qp_timeout
            a.retry_cnt = _RETRY_CNT
            a.rnr_retry = _RNR_RETRY
            gr = GlobalRoute(dgid=GID(t["gid"]), sgid_index=self.gid_index)
            a.ah_attr = AHAttr(port_num=self.port, is_global=1, gr=gr, dlid=t["lid"])
            try:
                self.qps[r].to_rts(a)
            except Exception as exc:  # noqa: BLE001
                raise CommError(f"verbs: connecting the QP to rank {r} failed (GID index {self.gid_index}, "
                                f"remote GID {t['gid']}): {exc}") from exc

    # ---- posting ------------------------------------------------------------------------------------
    def _post_recv(self, peer, slot):
        from pyverbs.wr import SGE, RecvWR

        sge = SGE(self.recv_buf[slot].ctypes.data, _NOTICE_BYTES, self.recv_mr.lkey)
        self.qps[peer].post_recv(RecvWR(wr_id=slot, num_sge=1, sg=[sge]))

    def _check(self):
        if self.error is not None:
            raise self.error

    def _wait_room(self, dst, n):
        t0 = time.monotonic()
        while self._in_sq[dst] + n > self.sq_depth:
            if not self._poll_send():
                if time.monotonic() - t0 > self.timeout:
                    self.error = CommError(f"verbs rank {self.rank}: send queue to rank {dst} stuck for "
                                           f"{self.timeout} s", {"peer": dst})
                    raise self.error
                time.sleep(0)

    def _credits(self, dst) -> int:
        """Receives rank ``dst`` has posted for notices from this rank and not yet consumed."""
        return _N_RECV - (self._notes_sent[dst] - int(self.credit_buf[dst]))

    def _wait_credits(self, dst, n):
        """Wait until ``dst`` has ``n`` receives free for our notices, receiving meanwhile (the peer
        may be waiting for our credits just as well)."""
        t0 = time.monotonic()
        while self._credits(dst) < n:
            busy = self._poll_send() + self._poll_recv()
            if not busy:
                if time.monotonic() - t0 > self.timeout:
                    self.error = CommError(f"verbs rank {self.rank}: rank {dst} re-posted no receives for "
                                           f"{self.timeout} s (its proxy stopped?)", {"peer": dst})
                    raise self.error
                time.sleep(0)

    def _post_chain(self, dst, items, token, credit=False):
        """Post work to dst's QP as chains of at most sq_depth/2 requests (and _MAX_NOTES_PER_CHAIN
        notices), the last one signaled.  ``items``: ``("wr", SendWR)`` (a data WRITE), ``("flag",
        rkey, remote_addr, value)`` (an 8-byte WRITE of ``value``), ``("note", payload)`` (a SEND).
        Flag values and notices are copied into staging slots only here, after the send queue has
        room, and the slots are given back when the chain completed."""
        import pyverbs.enums as e
        from pyverbs.wr import SGE, SendWR

        qp = self.qps[dst]
        step = max(1, self.sq_depth // 2)
        i = 0
        while i < len(items):
            j, notes = i, 0
            while j < len(items) and j - i < step and (items[j][0] != "note" or notes < _MAX_NOTES_PER_CHAIN):
                notes += items[j][0] == "note"
                j += 1
            part, i = items[i:j], j
            if notes:
                self._wait_credits(dst, notes)
            self._wait_room(dst, len(part))
            wrs, fslots, nslots = [], [], []
            for it in part:
                if it[0] == "wr":
                    wrs.append(it[1])
                elif it[0] == "flag":
                    _, rkey, raddr, value = it
                    k = self._flag_slots.take()
                    fslots.append(k)
                    self.flag_buf[k] = value
                    wr = SendWR(opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                                sg=[SGE(self.flag_buf.ctypes.data + 8 * k, 8, self.flag_mr.lkey)],
                                send_flags=e.IBV_SEND_INLINE if self.inline else 0)
                    wr.set_wr_rdma(rkey, raddr)
                    wrs.append(wr)
                else:
                    payload = it[1]
                    k = self._note_slots.take()
                    nslots.append(k)
                    self.note_buf[k, :len(payload)] = np.frombuffer(payload, np.uint8)
                    wrs.append(SendWR(opcode=e.IBV_WR_SEND, num_sge=1,
                                      sg=[SGE(self.note_buf[k].ctypes.data, len(payload), self.note_mr.lkey)],
                                      send_flags=0))
            wrs[-1].send_flags = wrs[-1].send_flags | e.IBV_SEND_SIGNALED
            for a, b in zip(wrs, wrs[1:]):
                a.next_wr = b
            self._outstanding[dst].append((token, len(wrs), fslots, nslots, credit))
            self._in_sq[dst] += len(wrs)
            self._credit_in_sq[dst] += len(wrs) if credit else 0
            self._notes_sent[dst] += notes
            if token is not None:
                self._token_left[token] = self._token_left.get(token, 0) + 1
            try:
                qp.post_send(wrs[0])
            except Exception as exc:  # noqa: BLE001
                self.error = CommError(f"verbs rank {self.rank}: post_send to rank {dst} failed: {exc}", {"peer": dst})
                raise self.error from exc

    @staticmethod
    def _notices(kind, ranges, flags) -> list:
        """``("note", payload)`` items carrying ``ranges`` then ``flags`` (several when they do not fit)."""
        out = []
        ranges, flags = list(ranges), list(flags)
        while True:
            nr = min(len(ranges), _MAX_REC)
            nf = min(len(flags), _MAX_REC - nr)
            rec = np.zeros(nr + nf, _NOTE_REC)
            for j, (w, off, n) in enumerate(ranges[:nr]):
                rec[j] = (w, 0, off, n)
            for j, (w, off, v) in enumerate(flags[:nf]):
                rec[nr + j] = (w, 0, off, v)
            out.append(("note", _NOTE_HDR.pack(kind, nr, nf, 0) + rec.tobytes()))
            ranges, flags = ranges[nr:], flags[nf:]
            if not ranges and not flags:
                return out

    def post(self, batches: list[PeerBatch]) -> int:
        import pyverbs.enums as e
        from pyverbs.wr import SGE, SendWR

        self._check()
        token = self.next_token()
        for b in batches:
            t = self.remote[b.dst]
            wrs = []
            bounce_ranges = []
            for w, src, dst_off, n in b.data:
                reg = self.regs[w]
                win = self.windows[w]
                win.check_range(src, n)
                rbase, rkey, rsize = t["win"][w]
                if dst_off + n > rsize:
                    raise CommError(f"verbs rank {self.rank}: write to rank {b.dst} window {w} "
                                    f"[{dst_off}, {dst_off + n}) beyond its {rsize} bytes")
                if reg.mode == "bounce":
                    win.read(src, n, reg.bounce[src:src + n])  # DtoH into the mirror, synchronized
                    bounce_ranges.append((w, dst_off, n))
                laddr = (reg.bounce.ctypes.data if reg.mode == "bounce" else reg.base) + src
                wr = SendWR(opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[SGE(laddr, n, reg.lkey)], send_flags=0)
                wr.set_wr_rdma(rkey, rbase + dst_off)
                wrs.append(("wr", wr))
            if self.notify == "write":
                for w, off, v in b.flags:
                    rbase, rkey, rsize = t["win"][w]
                    if off % 8 or off + 8 > rsize:
                        raise CommError(f"verbs rank {self.rank}: bad flag offset {off} in window {w} of rank {b.dst}")
                    wrs.append(("flag", rkey, rbase + off, v))
            elif b.flags or bounce_ranges:
                wrs += self._notices(1, bounce_ranges, b.flags)
            if wrs:
                self._post_chain(b.dst, wrs, token)
        if token not in self._token_left:
            self._done.append(token)
        return token

    # ---- completions ------------------------------------------------------------------------------
    def _poll_send(self) -> int:
        n, wcs = self.scq.poll(64)
        for wc in wcs[:n]:
            peer = self.qp_peer.get(wc.qp_num, -1)
            if peer in self._gone:
                continue
            if (wc.status != 0 and self._bye_sent and peer in self._byes and self._outstanding[peer]
                    and self._outstanding[peer][0][4]):
                # the peer finished and closed its QP while a credit WRITE to it was in flight: harmless
                self._gone.add(peer)
                for ent in self._outstanding[peer]:
                    self._flag_slots.give(ent[2])
                    self._note_slots.give(ent[3])
                self._outstanding[peer].clear()
                self._in_sq[peer] = self._credit_in_sq[peer] = 0
                continue
            if wc.status != 0:
                if wc.status == _WC_RNR_RETRY_EXC_ERR:
                    why = (f"receiver not ready: rank {peer} had no receive posted through {_RNR_RETRY} retries "
                           "(its proxy stopped receiving?)")
                elif wc.status == _WC_RETRY_EXC_ERR:
                    why = f"rank {peer} stopped acknowledging (peer dead or unreachable)"
                else:
                    why = "peer dead or remote access error"
                self.error = CommError(f"verbs rank {self.rank}: work completion error to rank {peer}: "
                                       f"{_wc_status(wc.status)} (vendor err {wc.vendor_err}); {why}", {"peer": peer})
                raise self.error
            token, nwr, fslots, nslots, credit = self._outstanding[peer].popleft()
            self._in_sq[peer] -= nwr
            self._credit_in_sq[peer] -= nwr if credit else 0
            self._flag_slots.give(fslots)
            self._note_slots.give(nslots)
            if token is not None:
                self._token_left[token] -= 1
                if self._token_left[token] == 0:
                    del self._token_left[token]
                    self._done.append(token)
        return n

    def _poll_recv(self) -> int:
        n, wcs = self.rcq.poll(32)
        for wc in wcs[:n]:
            peer = self.qp_peer.get(wc.qp_num, -1)
            if wc.status != 0:
                if self._closing and wc.status == 5:  # flushed at teardown
                    continue
                self.error = CommError(f"verbs rank {self.rank}: receive error from rank {peer}: "
                                       f"{_wc_status(wc.status)}", {"peer": peer})
                raise self.error
            slot = wc.wr_id
            buf = self.recv_buf[slot]
            kind, nr, nf, _ = _NOTE_HDR.unpack(buf[:_NOTE_HDR.size].tobytes())
            if kind not in (1, 2) or nr + nf > _MAX_REC or wc.byte_len < _NOTE_HDR.size + (nr + nf) * _NOTE_REC.itemsize:
                self.error = CommError(f"verbs rank {self.rank}: malformed notice from rank {peer} (kind {kind}, "
                                       f"{nr} ranges, {nf} flags, {wc.byte_len} bytes)", {"peer": peer})
                raise self.error
            rec = buf[_NOTE_HDR.size:_NOTE_HDR.size + (nr + nf) * _NOTE_REC.itemsize].view(_NOTE_REC)
            ranges = rec[:nr][["win", "off", "n"]].tolist()
            flags = rec[nr:][["win", "off", "n"]].tolist()
            for w, off, nb in ranges + [(w, off, 8) for w, off, _ in flags]:
                if w >= len(self.windows) or off + nb > self.windows[w].nbytes:
                    self.error = CommError(f"verbs rank {self.rank}: notice from rank {peer} names [{off}, {off + nb}) "
                                           f"of window {w}, outside this rank's windows", {"peer": peer})
                    raise self.error
            for w, off, nb in ranges:  # bounce ranges: HtoD
                reg = self.regs[w]
                if reg.bounce is None:
                    self.error = CommError(f"verbs rank {self.rank}: notice from rank {peer} names a bounce range "
                                           f"of window {w}, which has no bounce buffer", {"peer": peer})
                    raise self.error
                self.windows[w].write(off, reg.bounce[off:off + nb])
            for w, off, v in flags:
                self.windows[w].write_u64(off, v)
            if kind == 2:
                self._byes.add(peer)
            if not self._closing:
                self._post_recv(peer, slot)
                self._reposted[peer] += 1
        for peer, k in self._reposted.items():  # credits back (not to a peer that said bye: it is done)
            if k - self._credit_told[peer] >= _CREDIT_EVERY and not self._closing and peer not in self._byes:
                self._credit_told[peer] = k
                caddr, crkey = self.remote[peer]["credit"]
                self._post_chain(peer, [("flag", crkey, caddr + 8 * self.rank, k)], None, credit=True)
        return n

    def progress(self) -> list[int]:
        self._check()
        self._poll_send()
        self._poll_recv()
        out, self._done = self._done, []
        return out

    _closing = False
    _bye_sent = False

    def close(self, timeout: float = 10.0) -> None:
        """Wait for our sends, say bye to every peer, wait for theirs (bounded), free everything."""
        if not hasattr(self, "qps"):
            return
        t0 = time.monotonic()
        try:
            if self.error is None:
                for r in self.qps:
                    self._post_chain(r, self._notices(2, [], []), None)
                self._bye_sent = True
                while time.monotonic() - t0 < timeout and (len(self._byes) < len(self.qps) or any(
                        self._in_sq[r] - self._credit_in_sq[r] for r in self.qps)):
                    self._poll_send()
                    self._poll_recv()
                    time.sleep(0)
                if len(self._byes) < len(self.qps):
                    self.error = CommError(f"verbs rank {self.rank}: close timed out waiting for ranks "
                                           f"{sorted(set(self.qps) - self._byes)}")
        except CommError:
            pass
        finally:
            self._closing = True
            for q in self.qps.values():
                q.close()
            for obj in (self.scq, self.rcq, self.flag_mr, self.note_mr, self.recv_mr, self.credit_mr,
                        *[r.mr for r in self.regs]):
                obj.close()
            self.pd.close()
            self.ctx.close()
            for kind, v in self._objs:
                if kind == "fd":
                    os.close(v)
                elif kind == "hostfree":
                    from cuda.bindings import driver as cu

                    cu.cuMemFreeHost(v)
            del self.qps


def _wc_status(status: int) -> str:
    try:
        import pyverbs.enums as e

        for k in dir(e):
            if k.startswith("IBV_WC_") and getattr(e, k) == status and "ERR" in k or k == "IBV_WC_SUCCESS" and status == 0:
                return k
    except Exception:  # noqa: BLE001
        pass
    return f"status {status}"
