"""The per-rank CPU proxy: GPU blocks push fixed-size commands into a ring, a host thread posts them.

Ring (mirrors ``cuda_src/mk_proxy.cuh``, checked by tests/cpu/test_proxy_layout.py):

* ``cmds``: ``capacity`` (power of two) 64-byte :data:`CMD_DTYPE` records; ticket ``t`` lives in
  slot ``t & (capacity-1)`` and is valid once its ``seq`` reads ``t+1`` (written last, release).
* ``head`` (device memory, GPU side only): next ticket, claimed with atomicAdd.
* ``tail`` (u64, host-written): tickets ``< tail`` were taken out of the ring (slots free).
* ``done`` (u64, host-written): tickets ``< done`` completed locally (source bytes may be reused).

With a GPU the ring, tail and done live in host-mapped pinned memory (:meth:`Ring.mapped`); for CPU
tests in numpy memory (:meth:`Ring.host`) with :class:`HostProducer` standing in for the GPU.

Proxy loop, per poll: take every visible command (up to ``max_batch``) out of the ring at once and
advance ``tail``; group them by destination; for each destination post all data first, then one
flag write per distinct flag holding the highest value asked for (flags only grow, so a lower value
is implied), coalescing adjacent contiguous ranges into one transfer; track completion per batch and
advance ``done`` over the completed prefix.  Idle: spin briefly, then sleep with growing intervals
(capped by ``idle_sleep``) so the application's Python thread keeps the GIL (docs/internode.md
has the measurements).  A transport error stops the loop and is kept in :attr:`Proxy.error`
(:class:`mkernel.CommError`); :meth:`Proxy.check` raises it; ``on_error`` (e.g. writing
MK_ERR_PROXY into the host-mapped error record so device waits stop) is called once.
"""
from __future__ import annotations

import collections
import ctypes
import threading
import time

import numpy as np

from ..core.driver import ignore_other_threads_captures
from ..dist.timeouts import validate_timeout
from ..errors import CommError, CommTimeout
from .transport import PeerBatch, Transport, as_exchanger, as_window, select_transport

__all__ = ["CMD_DTYPE", "CMD_BYTES", "OP_NOP", "OP_WRITE", "OP_FLAG", "OP_BARRIER", "NO_FLAG", "LAYOUT",
           "MkProxyStruct", "Ring", "HostProducer", "Proxy"]

OP_NOP, OP_WRITE, OP_FLAG, OP_BARRIER = 0, 1, 2, 3
NO_FLAG = (1 << 64) - 1
CMD_BYTES = 64
STOP_GRACE = 2.0  # s Proxy.close gives its own thread to stop, beyond the timeout for the peers
DEFAULT_TIMEOUT_S = 30.0  # a Proxy's timeout when none is given (a context passes its own)

# name -> (byte offset, numpy type); the single source of truth on the Python side
LAYOUT = {
    "op": (0, np.uint8), "win": (1, np.uint8), "flag_win": (2, np.uint8), "reserved": (3, np.uint8),
    "dst_rank": (4, np.int32), "src_offset": (8, np.uint64), "dst_offset": (16, np.uint64),
    "bytes": (24, np.uint64), "flag_offset": (32, np.uint64), "flag_value": (40, np.uint64),
    "user": (48, np.uint64), "seq": (56, np.uint64),
}
CMD_DTYPE = np.dtype({"names": list(LAYOUT), "formats": [t for _, t in LAYOUT.values()],
                      "offsets": [o for o, _ in LAYOUT.values()], "itemsize": CMD_BYTES, "aligned": True})


class MkProxyStruct(ctypes.Structure):
    """``struct MkProxy`` of mk_proxy.cuh, passed by value to kernels that push commands."""

    _fields_ = [("ring", ctypes.c_uint64), ("head", ctypes.c_uint64), ("tail", ctypes.c_uint64),
                ("done", ctypes.c_uint64), ("capacity", ctypes.c_uint64), ("rank", ctypes.c_int32),
                ("pad", ctypes.c_int32)]


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


class Ring:
    """Command ring memory.  ``cmds`` (structured array), ``tail``/``done`` (uint64[1] views)."""

    def __init__(self, capacity: int, cmds: np.ndarray, ctrl: np.ndarray, device: dict | None = None,
                 owner=None):
        if not _is_pow2(capacity):
            raise ValueError(f"ring capacity must be a power of two, got {capacity}")
        self.capacity, self.mask = capacity, capacity - 1
        self.cmds, self.ctrl = cmds, ctrl
        self.tail, self.done = ctrl[0:1], ctrl[8:9]  # separate 64-byte lines
        self.seq = cmds["seq"]
        self.device = device  # {"ring", "head", "tail", "done"} device pointers, or None
        self._owner = owner

    @classmethod
    def host(cls, capacity: int) -> "Ring":
        raw = np.zeros(capacity * CMD_BYTES + 64, np.uint8)
        start = (-raw.ctypes.data) % 64
        cmds = raw[start:start + capacity * CMD_BYTES].view(CMD_DTYPE)
        return cls(capacity, cmds, np.zeros(16, np.uint64), owner=raw)

    @classmethod
    def mapped(cls, capacity: int) -> "Ring":
        """Ring in host-mapped pinned memory (cuMemHostAlloc DEVICEMAP) + a device head counter.
        Needs a current CUDA context."""
        from cuda.bindings import driver as cu

        from ..core.driver import check

        nb = capacity * CMD_BYTES + 128
        flags = cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE
        hp = int(check(cu.cuMemHostAlloc(nb, flags)))
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * nb).from_address(hp))
        raw[:] = 0
        dp = int(check(cu.cuMemHostGetDevicePointer(hp, 0)))
        head = int(check(cu.cuMemAlloc(8)))
        check(cu.cuMemsetD8(head, 0, 8))
        cmds = raw[:capacity * CMD_BYTES].view(CMD_DTYPE)
        ctrl = raw[capacity * CMD_BYTES:].view(np.uint64)
        dev = {"ring": dp, "head": head, "tail": dp + capacity * CMD_BYTES,
               "done": dp + capacity * CMD_BYTES + 64, "host": hp}
        return cls(capacity, cmds, ctrl, device=dev)

    def device_struct(self, rank: int) -> MkProxyStruct:
        if self.device is None:
            raise RuntimeError("this ring lives in plain host memory (Ring.host); use Ring.mapped for kernels")
        d = self.device
        return MkProxyStruct(d["ring"], d["head"], d["tail"], d["done"], self.capacity, rank, 0)

    def free(self) -> None:
        if self.device is not None:
            from cuda.bindings import driver as cu

            cu.cuMemFree(self.device["head"])
            cu.cuMemFreeHost(self.device["host"])
            self.device = None


class HostProducer:
    """Host stand-in for ``mk_proxy_push`` (tests, benchmarks): same claim/wait/write/publish steps.

    Thread-safe; ``push`` blocks while the ring is full (backpressure) and raises
    :class:`CommTimeout` after ``timeout`` s, or the proxy's error if it died."""

    def __init__(self, ring: Ring, proxy: "Proxy | None" = None, timeout: float = 30.0):
        self.ring, self.proxy, self.timeout = ring, proxy, timeout
        self.head = 0
        self._lock = threading.Lock()
        self.full_waits = 0  # how many pushes found the ring full

    def _wait(self, cond, what):
        if cond():
            return
        t0 = time.monotonic()
        while not cond():
            if self.proxy is not None and self.proxy.error is not None:
                raise self.proxy.error
            if time.monotonic() - t0 > self.timeout:
                raise CommTimeout(f"host producer: {what} after {self.timeout} s")
            time.sleep(20e-6)

    def push(self, op=OP_WRITE, dst_rank=0, win=0, src_offset=0, dst_offset=0, nbytes=0, flag_win=0,
             flag_offset=NO_FLAG, flag_value=0, user=0) -> int:
        with self._lock:
            t = self.head
            self.head += 1
            r = self.ring
            self.full_waits += int(t - int(r.tail[0]) >= r.capacity)
            self._wait(lambda: t - int(r.tail[0]) < r.capacity, f"ring full (ticket {t}, dst {dst_rank})")
            s = r.cmds[t & r.mask]
            s["op"], s["win"], s["flag_win"], s["dst_rank"] = op, win, flag_win, dst_rank
            s["src_offset"], s["dst_offset"], s["bytes"] = src_offset, dst_offset, nbytes
            s["flag_offset"], s["flag_value"], s["user"] = flag_offset, flag_value, user
            r.seq[t & r.mask] = t + 1  # publish last (x86: stores are not reordered with stores)
            return t

    def push_many(self, n: int, **fields) -> int:
        """Push ``n`` commands at once (vectorized; fields are scalars or length-n arrays, named as
        in CMD_DTYPE, ``bytes`` for the size).  Models many GPU blocks pushing; returns the last ticket."""
        with self._lock:
            r, pos = self.ring, 0
            while pos < n:
                t = self.head
                self._wait(lambda: t - int(r.tail[0]) < r.capacity, f"ring full (ticket {t})")
                room = r.capacity - (t - int(r.tail[0]))
                k = min(room, n - pos, r.capacity - (t & r.mask))  # no wrap inside one write
                sl = slice(t & r.mask, (t & r.mask) + k)
                for name, v in fields.items():
                    r.cmds[name][sl] = v[pos:pos + k] if isinstance(v, np.ndarray) else v
                r.seq[sl] = np.arange(t + 1, t + 1 + k, dtype=np.uint64)
                self.head += k
                pos += k
            return self.head - 1

    def wait_done(self, ticket: int) -> None:
        self._wait(lambda: int(self.ring.done[0]) > ticket, f"command {ticket} never completed")


def _coalesce(data: list) -> list:
    """Merge (win, src, dst, n) ranges that continue the previous one on both ends."""
    out = []
    for w, s, d, n in data:
        if out:
            pw, ps, pd, pn = out[-1]
            if pw == w and ps + pn == s and pd + pn == d:
                out[-1] = (w, ps, pd, pn + n)
                continue
        if n:
            out.append((w, s, d, n))
    return out


class Proxy:
    """One rank's proxy: ``Proxy(comm, windows, transport=None, ring_capacity=1024, ...)``.

    * ``comm``: an mpi4py communicator or a :class:`mkernel.transport.Exchanger` (collective set-up,
      every exchange bounded: :mod:`mkernel.proxy.transport.exchange`).
    * ``windows``: list of memory windows (``Window``, numpy arrays, device arrays); window ``i``
      must be the same logical buffer on every rank.  Flags live in these windows too.
    * ``transport``: a name (``"tcp"``, ``"verbs"``), a Transport class or instance, or None (auto).
    * ``ring="mapped"`` (GPU, default when a CUDA context is current) or ``"host"`` (tests).
    * ``timeout``: seconds (validated); bounds the transport's set-up and its waits (passed as the
      transport's ``timeout`` option unless ``transport_options`` names one) and is the default of
      :meth:`producer`, :meth:`flush` and :meth:`close`.  A context passes its own; None: 30 s.
    Construction is collective (connects every pair of ranks); so is :meth:`close`.
    """

    def __init__(self, comm, windows, transport=None, ring_capacity: int = 1024, ring: str | None = None,
                 max_batch: int = 1024, spin_s: float = 200e-6, idle_sleep: float = 200e-6,
                 on_error=None, transport_options: dict | None = None, timeout: float | None = None):
        self.timeout = DEFAULT_TIMEOUT_S if timeout is None else validate_timeout(timeout, "Proxy timeout")
        self.ex = as_exchanger(comm, self.timeout)
        self.rank, self.size = self.ex.rank, self.ex.size
        self.windows = [as_window(w) for w in windows]
        for w in self.windows:  # copy streams and staging now: made in the proxy's threads while a kernel
            w.prepare()         # waits on them, they could stall it (docs/internode.md, "Frees while ...")
        if ring is None:
            ring = "mapped" if any(w.kind == "gpu" for w in self.windows) else "host"
        self.ring = Ring.mapped(ring_capacity) if ring == "mapped" else Ring.host(ring_capacity)
        if isinstance(transport, Transport):
            self.transport = transport
        else:
            cls = transport if isinstance(transport, type) else select_transport(transport)
            opts = dict(transport_options or {})
            if timeout is not None:
                opts.setdefault("timeout", self.timeout)
            self.transport = cls(self.ex, self.windows, **opts)
        self.transport.connect()
        self.max_batch = min(max_batch, ring_capacity)
        self.spin_s, self.idle_sleep = spin_s, idle_sleep
        self.on_error = on_error
        self.error: CommError | None = None
        self._tail = 0
        self._pending = collections.deque()  # (token, end_ticket) in post order
        self._completed: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        # statistics
        self.stats = collections.Counter()

    # ---- device side ------------------------------------------------------------------------
    def ring_device_struct(self) -> MkProxyStruct:
        """``MkProxy`` by value for kernels (ring, head, tail, done device pointers)."""
        return self.ring.device_struct(self.rank)

    def producer(self, timeout: float | None = None) -> HostProducer:
        return HostProducer(self.ring, self, self.timeout if timeout is None else timeout)

    # ---- life cycle ---------------------------------------------------------------------------
    def start(self) -> "Proxy":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"mkernel-proxy-{self.rank}", daemon=True)
            self._thread.start()
        return self

    def check(self) -> None:
        """Raise the transport error (CommError) if the proxy failed."""
        if self.error is not None:
            raise self.error

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every command pushed so far (per the ring's seq words) completed locally
        (at most ``timeout`` s, default the proxy's)."""
        timeout = self.timeout if timeout is None else timeout
        t0 = time.monotonic()
        while True:
            self.check()
            nxt = self.ring.seq[self._tail & self.ring.mask] == self._tail + 1
            if not nxt and not self._pending and int(self.ring.done[0]) >= self._tail:
                return
            if time.monotonic() - t0 > timeout:
                raise CommTimeout(f"proxy rank {self.rank}: flush timed out")
            time.sleep(50e-6)

    def close(self, timeout: float | None = None) -> None:
        """Drain the ring, stop the thread, shut the transport down (collective).  Idempotent.
        ``timeout`` (default the proxy's) bounds the waits for peers as a whole (the drain and the transport's goodbyes share
        it), so a dead peer costs at most that long here; stopping this rank's own proxy thread may
        take up to STOP_GRACE more.  A thread that does not stop keeps the transport and the ring (it
        may be inside a transport call: freeing them under it would crash the process) and is
        reported as a CommError."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)

        def left() -> float:
            return max(0.0, deadline - time.monotonic())
        if self._thread is not None and self.error is None:
            try:
                self.flush(left())
            except CommError:
                pass
        self._stop.set()
        if self._thread is not None:
            self._thread.join(max(left(), STOP_GRACE))
            if self._thread.is_alive():
                self._fail(CommError(f"proxy rank {self.rank}: the proxy thread did not stop within "
                                     f"{STOP_GRACE} s of close(); its transport and ring are left allocated"))
                self.check()
        try:
            self.transport.close(timeout=left())
        finally:
            self.ring.free()
        self.check()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # ---- loop ------------------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc if isinstance(exc, CommError) else CommError(
                f"proxy rank {self.rank}: transport {self.transport.name} failed: {exc!r}")
            if exc is not self.error:
                self.error.__cause__ = exc
            if self.on_error is not None:
                try:
                    self.on_error(self.error)
                except Exception:
                    pass

    def _run(self) -> None:
        # the transport's copies from GPU windows run here, maybe while the application captures a CUDA
        # graph in global mode (a peer's late message): they must neither fail nor invalidate its capture
        ignore_other_threads_captures()
        last_work = time.perf_counter()
        sleep = 0.0
        try:
            tr = self.transport
            while not self._stop.is_set():
                if getattr(tr, "error", None) is not None:  # e.g. a receiver thread failed
                    raise tr.error
                n = self._poll_once()
                n += self._progress()
                if n:
                    last_work = time.perf_counter()
                    sleep = 0.0
                    continue
                self.stats["idle_polls"] += 1
                if time.perf_counter() - last_work < self.spin_s:
                    continue
                # idle: sleep (releases the GIL), growing to idle_sleep
                sleep = min(self.idle_sleep, max(20e-6, sleep * 2))
                time.sleep(sleep)
        except BaseException as exc:  # noqa: BLE001 - surfaced through .error
            self._fail(exc)

    def _progress(self) -> int:
        # always: a transport may have receive-side work (verbs notify="send" notices, re-posting
        # receive buffers) even when this rank has nothing of its own in flight
        self._completed.update(self.transport.progress())
        n = 0
        while self._pending and self._pending[0][0] in self._completed:
            tok, end = self._pending.popleft()
            self._completed.discard(tok)
            self.ring.done[0] = end
            n += 1
        return n

    def _take(self) -> np.ndarray | None:
        """Copy every visible command (in ticket order, up to max_batch) out of the ring."""
        r, t = self.ring, self._tail
        if r.seq[t & r.mask] != t + 1:
            return None
        start = t & r.mask
        k = min(self.max_batch, r.capacity - start)
        seg = r.seq[start:start + k]
        ok = seg == np.arange(t + 1, t + 1 + k, dtype=np.uint64)
        n = k if ok.all() else int(np.argmin(ok))
        cmds = r.cmds[start:start + n].copy()
        if n == k and start + k == r.capacity and n < self.max_batch:  # wrapped: continue at slot 0
            k2 = min(self.max_batch - n, start)
            seg = r.seq[:k2]
            ok = seg == np.arange(t + 1 + n, t + 1 + n + k2, dtype=np.uint64)
            n2 = k2 if ok.all() else int(np.argmin(ok))
            if n2:
                cmds = np.concatenate([cmds, r.cmds[:n2].copy()])
        self._tail = t + len(cmds)
        r.tail[0] = self._tail  # slots are free: the GPU may refill them
        return cmds

    def _poll_once(self) -> int:
        cmds = self._take()
        if cmds is None:
            return 0
        first = self._tail - len(cmds)
        batches = self._group(cmds)
        if batches:
            tok = self.transport.post(batches)
            self._pending.append((tok, self._tail))
        elif not self._pending:
            self.ring.done[0] = self._tail
        else:  # only NOPs: complete in order behind the pending posts
            self._pending.append((-first - 1, self._tail))
            self._completed.add(-first - 1)
        self.stats["commands"] += len(cmds)
        self.stats["batches"] += 1
        return len(cmds)

    def _group(self, cmds: np.ndarray) -> list[PeerBatch]:
        data: dict[int, list] = {}
        flags: dict[int, dict] = {}
        me, size = self.rank, self.size
        for op, win, fwin, dst, src, doff, nb, foff, fval in zip(
                cmds["op"].tolist(), cmds["win"].tolist(), cmds["flag_win"].tolist(), cmds["dst_rank"].tolist(),
                cmds["src_offset"].tolist(), cmds["dst_offset"].tolist(), cmds["bytes"].tolist(),
                cmds["flag_offset"].tolist(), cmds["flag_value"].tolist()):
            if op == OP_WRITE:
                if not 0 <= dst < size or dst == me:
                    raise CommError(f"proxy rank {me}: WRITE command to rank {dst} (world of {size}; "
                                    "the proxy only serves other ranks)")
                if nb:
                    data.setdefault(dst, []).append((win, src, doff, nb))
                if foff != NO_FLAG:
                    f = flags.setdefault(dst, {})
                    k = (fwin, foff)
                    if f.get(k, -1) < fval:
                        f[k] = fval
            elif op == OP_FLAG or op == OP_BARRIER:
                targets = [dst] if op == OP_FLAG else [r for r in range(size) if r != me]
                for d in targets:
                    if not 0 <= d < size or d == me:
                        raise CommError(f"proxy rank {me}: command to rank {d} outside world of {size}")
                    f = flags.setdefault(d, {})
                    k = (fwin, foff)
                    if f.get(k, -1) < fval:
                        f[k] = fval
            elif op != OP_NOP:
                raise CommError(f"proxy rank {me}: unknown command op {op}")
        out = []
        for d in sorted(set(data) | set(flags)):
            fl = [(w, o, v) for (w, o), v in flags.get(d, {}).items()]
            self.stats["flag_writes"] += len(fl)
            out.append(PeerBatch(d, _coalesce(data.get(d, [])), fl))
        return out
