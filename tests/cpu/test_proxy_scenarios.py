"""Multi-process proxy scenarios, run by every rank (not collected as tests: no test_ functions).

Started by tests/cpu/test_proxy_tcp.py (under mpirun, or as plain processes rendezvousing through
a SocketExchanger) and by tests/rdma/test_verbs.py inside the soft-RoCE VM:

    python tests/cpu/test_proxy_scenarios.py --transport tcp [--socket RANK SIZE PORT] SCENARIO...

(``--socket``: every rank needs the same ``MKERNEL_EXCHANGE_TOKEN`` in its environment.)

Each scenario builds a Proxy over host windows (window 0: data, window 1: flags), drives it with a
HostProducer standing in for GPU blocks, checks what arrived, prints ``OK <scenario>`` and closes.
Exit status 0 only if every scenario passed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from mkernel.errors import CommError, CommTimeout  # noqa: E402
from mkernel.proxy import OP_BARRIER, OP_FLAG, OP_WRITE, Proxy  # noqa: E402
from mkernel.proxy.engine import STOP_GRACE, HostProducer  # noqa: E402
from mkernel.proxy.transport import HostWindow, SocketExchanger, as_exchanger  # noqa: E402

SMALL = os.environ.get("MK_TEST_SMALL") == "1"  # soft-RoCE VM under emulation: smaller runs
DATA_BYTES = (4 << 20) if SMALL else (24 << 20)
FLAG_BYTES = 64 << 10
TIMEOUT = 60.0


def pattern(src: int, dst: int, idx: int, n: int, epoch: int = 1) -> np.ndarray:
    k = np.arange(n, dtype=np.uint64)
    return ((k * 7 + src * 31 + dst * 17 + idx * 131 + epoch * 3) & 0xFF).astype(np.uint8)


def wait_flag(win: HostWindow, off: int, value: int, what: str, timeout: float = TIMEOUT, proxy=None) -> int:
    t0 = time.monotonic()
    while True:
        v = win.read_u64(off)
        if v >= value:
            return v
        if proxy is not None:
            proxy.check()
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"flag {what} at {off} stuck at {v}, wanted {value}")
        time.sleep(0)


class Env:
    def __init__(self, ex, transport, opts):
        self.ex, self.transport, self.opts = ex, transport, opts
        self.rank, self.size = ex.rank, ex.size

    def proxy(self, ring_capacity=256, data_bytes=DATA_BYTES, **kw):
        data, flags = HostWindow(data_bytes), HostWindow(FLAG_BYTES)
        p = Proxy(self.ex, [data, flags], transport=self.transport, ring_capacity=ring_capacity,
                  transport_options=dict(self.opts), **kw)
        return p, data, flags


def layout(n_cmds, sizes, size, rank_stride):
    """Offsets: rank s writes its commands to every destination at s * rank_stride + prefix sums."""
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    assert offs[-1] + sizes[-1] <= rank_stride
    return offs


def _exchange_all(env, sizes, ring_capacity=256, start_first=True, epoch=1):
    """Every rank writes len(sizes) chunks to every other rank, one flag per (source, chunk)."""
    me, n = env.rank, env.size
    stride = DATA_BYTES // n
    offs = layout(len(sizes), sizes, n, stride)
    p, data, flags = env.proxy(ring_capacity)
    src = np.zeros(DATA_BYTES, np.uint8)  # what we send lives in our window at our own slot
    prod = p.producer(TIMEOUT)
    if start_first:
        p.start()
    for d in range(n):
        if d == me:
            continue
        for i, (o, sz) in enumerate(zip(offs, sizes)):
            # per destination the source range differs: stage it in our window's slot for d
            base = me * stride + int(o)
            data.array[base:base + sz] = pattern(me, d, i, sz, epoch)
            prod.push(OP_WRITE, d, 0, base, base, int(sz), 1, 8 * (me * len(sizes) + i), epoch)
            prod.wait_done(prod.head - 1)  # source reused for the next destination
    if not start_first:
        p.start()
    for s in range(n):
        if s == me:
            continue
        for i, (o, sz) in enumerate(zip(offs, sizes)):
            wait_flag(flags, 8 * (s * len(sizes) + i), epoch, f"from {s} chunk {i}", proxy=p)
            base = s * stride + int(o)
            got = data.array[base:base + sz]
            want = pattern(s, me, i, sz, epoch)
            if not np.array_equal(got, want):
                bad = int(np.argmax(got != want))
                raise AssertionError(f"rank {me}: chunk {i} from {s} wrong at byte {bad}")
    del src
    return p, prod


def sc_many(env):
    rng = np.random.default_rng(7)
    sizes = rng.integers(1, 3000, size=60 if SMALL else 300)  # odd sizes
    sizes[::17] = 0  # flag-only writes mixed in
    sizes[0] = 1
    p, _ = _exchange_all(env, sizes.tolist())
    p.close()


def sc_large(env):
    n = env.size
    stride = DATA_BYTES // n
    sizes = [stride // 2 + 13, stride // 4 - 7, 4093]
    p, _ = _exchange_all(env, sizes)
    p.close()


def sc_backpressure(env):
    sizes = [64 + (i % 5) for i in range(50 if SMALL else 400)]
    p, prod = _exchange_all(env, sizes, ring_capacity=4)
    p.close()
    # wait_done after every push keeps the ring nearly empty; a burst fills the 4 slots
    q, data, flags = env.proxy(ring_capacity=4)
    prod = q.producer(TIMEOUT)
    q.start()
    dst = (env.rank + 1) % env.size
    nburst = 300 if SMALL else 2000
    for i in range(nburst):
        prod.push(OP_FLAG, dst, flag_win=1, flag_offset=8 * (4000 + env.rank), flag_value=i + 1)
    src = (env.rank - 1) % env.size
    wait_flag(flags, 8 * (4000 + src), nburst, "burst", proxy=q)
    assert prod.full_waits > 0, "the 4-slot ring never filled: no backpressure exercised"
    q.close()


def sc_flag_batching(env):
    """Commands queued before the proxy starts are drained in one batch: one flag write per flag."""
    me, n = env.rank, env.size
    p, data, flags = env.proxy(ring_capacity=1024)
    prod = p.producer(TIMEOUT)
    dst = (me + 1) % n
    ncmd = 60 if SMALL else 200
    for i in range(ncmd):
        off = me * 65536 + i * 64
        data.array[off:off + 64] = pattern(me, dst, i, 64)
        prod.push(OP_WRITE, dst, 0, off, off, 64, 1, 8 * me, i + 1)  # same flag, growing value
    p.start()
    src = (me - 1) % n
    wait_flag(flags, 8 * src, ncmd, "batched", proxy=p)
    for i in range(ncmd):
        off = src * 65536 + i * 64
        assert np.array_equal(data.array[off:off + 64], pattern(src, me, i, 64)), f"chunk {i} wrong"
    p.flush()
    fw = p.stats["flag_writes"]
    assert fw < ncmd // 4, f"expected coalesced flag writes, got {fw} for {ncmd} commands"
    p.close()
    return fw


def sc_ordering(env):
    """A reader that sees flag value v must see complete data of every epoch <= v."""
    me, n = env.rank, env.size
    p, data, flags = env.proxy(ring_capacity=64)
    prod = p.producer(TIMEOUT)
    p.start()
    dst, src = (me + 1) % n, (me - 1) % n
    E, SZ = (50, 20000) if SMALL else (200, 20000)
    half = DATA_BYTES // 2
    assert E * SZ <= half
    sent = checked = 0
    while checked < E or sent < E:
        if sent < E:  # epoch `sent` goes to its own region [sent*SZ, +SZ) of the first half
            off = sent * SZ
            data.array[half + off:half + off + SZ] = pattern(me, dst, sent, SZ)
            prod.push(OP_WRITE, dst, 0, half + off, off, SZ, 1, 8 * (100 + me), sent + 1)
            prod.wait_done(prod.head - 1)
            sent += 1
        v = flags.read_u64(8 * (100 + src))
        while checked < v:
            off = checked * SZ
            assert np.array_equal(data.array[off:off + SZ], pattern(src, me, checked, SZ)), \
                f"flag {v} visible but epoch {checked} data incomplete"
            checked += 1
        if sent >= E and checked < E:
            wait_flag(flags, 8 * (100 + src), checked + 1, "ordering", proxy=p)
    p.close()


def sc_barrier(env):
    me, n = env.rank, env.size
    p, data, flags = env.proxy()
    prod = p.producer(TIMEOUT)
    p.start()
    for ep in (1, 2, 3):
        prod.push(OP_BARRIER, -1, flag_win=1, flag_offset=8 * (200 + me), flag_value=ep)
        for r in range(n):
            if r != me:
                wait_flag(flags, 8 * (200 + r), ep, f"barrier {ep} from {r}", proxy=p)
    p.close()


def sc_shutdown(env):
    p, data, flags = env.proxy()
    p.start()
    t = p._thread
    p.close()
    assert not t.is_alive(), "proxy thread still running after close"
    assert p.error is None
    p.close()  # idempotent


def sc_dead_peer(env):
    """Rank 1 dies without closing; rank 0 must get CommError (not hang) within the timeout."""
    me = env.rank
    p, data, flags = env.proxy(ring_capacity=16)
    prod = p.producer(20.0)
    p.start()
    env.ex.barrier()
    if me == 1:
        os._exit(0)  # simulated crash: no close, no bye
    t0 = time.monotonic()
    err = None
    try:
        for i in range(1_000_000):
            prod.push(OP_WRITE, 1, 0, 0, 0, 4096, 1, 0, i + 1)
            if p.error is not None:
                break
            if time.monotonic() - t0 > 30:
                break
        p.flush(20.0)
        p.check()
    except CommError as exc:
        err = exc
    dt = time.monotonic() - t0
    assert err is not None or p.error is not None, "no error although the peer died"
    print(f"dead peer detected after {dt:.2f} s: {err or p.error}", flush=True)
    t1 = time.monotonic()
    try:
        p.close(timeout=5.0)
    except CommError:
        pass
    assert time.monotonic() - t1 < 15, "close hung after a peer died"


FAULT_TIMEOUT, FAULT_SLACK = 10.0, 3.0  # s: the proxy timeout of the verbs fault scenarios, and the slack
FAULT_AFTER = 32  # commands rank 1 sees land before it breaks its side (the fault comes mid-stream)


def _verbs_fault(env, inject):
    """Verbs only, 2 ranks.  Rank 0 streams WRITE + flag commands to rank 1; once rank 1 saw
    FAULT_AFTER of them land it breaks its side with ``inject(transport)`` and keeps it open until
    rank 0 is done.  Rank 0's proxy must fail with a CommError naming rank 1 (record["peer"] == 1),
    from the failed work completion (not a timeout), within FAULT_TIMEOUT + FAULT_SLACK of the
    fault, raised by the producer and by check(); then
    both ranks' close() must return within 5 s.  Rank 1's own error is printed, not required."""
    me = env.rank
    p, data, flags = env.proxy(ring_capacity=64, timeout=FAULT_TIMEOUT)
    p.start()
    env.ex.barrier()
    t_inject = t_seen = err = None
    if me == 1:
        t0 = time.monotonic()
        while int(flags.array[:8 * 64].view(np.uint64).max()) < FAULT_AFTER:
            p.check()
            assert time.monotonic() - t0 < TIMEOUT, "rank 0's stream never arrived"
            time.sleep(1e-3)
        inject(p.transport)
        t_inject = time.monotonic()
    else:
        prod = p.producer(FAULT_TIMEOUT + FAULT_SLACK + TIMEOUT)  # the transport must fail first
        t0, i = time.monotonic(), 0
        try:
            while time.monotonic() - t0 < TIMEOUT + FAULT_TIMEOUT:
                prod.push(OP_WRITE, 1, 0, 4096 * (i % 64), 4096 * (i % 64), 4096, 1, 8 * (i % 64), i + 1)
                i += 1
        except CommError as exc:
            err = exc
        t_seen = time.monotonic()
        try:
            p.check()
        except CommError as exc:
            assert exc is err, f"check() raised {exc!r}, the producer {err!r}"
    # rank 1 waits here (its broken QP / MR kept) until rank 0 is done; CLOCK_MONOTONIC: one host
    t_inject, t_seen = env.ex.allgather((t_inject, t_seen))[1][0], t_seen or time.monotonic()
    err = err if me == 0 else p.error
    t1 = time.monotonic()
    try:
        p.close(timeout=5.0)
    except CommError:
        pass
    dt_close = time.monotonic() - t1
    print(f"rank {me}: {'error' if err else 'no error'} {t_seen - t_inject:.2f} s after the fault: "
          f"{err!r}; close {dt_close:.2f} s", flush=True)
    assert dt_close < 5.0 + STOP_GRACE, f"close took {dt_close:.2f} s after the fault"
    if me == 0:
        assert err is not None and p.error is err, f"no transport error on rank 0 (got {err!r}, proxy {p.error!r})"
        assert not isinstance(err, CommTimeout), f"the producer timed out instead of the transport failing: {err}"
        assert err.record.get("peer") == 1 and "rank 1" in str(err), err
        assert "work completion error" in str(err), f"not failed by the completion error: {err}"
        assert t_seen - t_inject < FAULT_TIMEOUT + FAULT_SLACK, f"detected {t_seen - t_inject:.2f} s after the fault"


def _qp_to_error(tr):
    import pyverbs.enums as e
    from pyverbs.qp import QPAttr

    tr.qps[0].modify(QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)


def sc_verbs_peer_qp_error(env):
    """Rank 1 moves its QP to rank 0 into the error state (IBV_QPS_ERR) mid-stream."""
    _verbs_fault(env, _qp_to_error)


def sc_verbs_peer_mr_gone(env):
    """Rank 1 deregisters its data window's MR mid-stream: rank 0's next WRITE meets a bad rkey."""
    _verbs_fault(env, lambda tr: tr.regs[0].mr.close())


# ---- GPU end to end (sc_gpu) and its CPU model (sc_gpu_model) -----------------------------------
# One shape for both.  Rank 0 runs proxy_test.cu's mk_proxy_test_push (sc_gpu) or the Python model of
# it below (sc_gpu_model, host windows): chunk g of window GPU_DATA_WIN goes to rank 1 at the same
# offset, then raises the u64 at GPU_FLAG_BASE + 8 * g of window GPU_FLAG_WIN to GPU_EPOCH.  Rank 1
# waits for every flag, then checks the data.
GPU_BLOCKS, GPU_PER_BLOCK, GPU_CHUNK, GPU_EPOCH = 8, 16, 4096 + 36, 1
GPU_NCHUNKS = GPU_BLOCKS * GPU_PER_BLOCK
GPU_DATA_WIN, GPU_FLAG_WIN, GPU_FLAG_BASE = 0, 1, 0
GPU_DATA_BYTES, GPU_FLAG_BYTES = GPU_NCHUNKS * GPU_CHUNK + 4096, 8 * GPU_NCHUNKS
GPU_KERNEL_TIMEOUT_S = 10.0  # the kernel's per-wait timeout (MkComm.timeout_ns)
# how long rank 1 waits for the flags: well inside the GPU test's subprocess timeout (tests/gpu/test_proxy_gpu.py)
GPU_WAIT_S = float(os.environ.get("MK_TEST_GPU_WAIT", "20"))


def gpu_pattern(nchunks: int = GPU_NCHUNKS, chunk: int = GPU_CHUNK, epoch: int = GPU_EPOCH) -> np.ndarray:
    """What mk_proxy_test_push writes: byte k of chunk g is (g * 131 + k * 7 + epoch) & 0xff."""
    g = np.arange(nchunks, dtype=np.uint64)[:, None]
    k = np.arange(chunk, dtype=np.uint64)[None, :]
    return ((g * 131 + k * 7 + epoch) & 0xFF).astype(np.uint8)


def gpu_kernel_args(comm, proxy_struct, data_ptr: int, dst_rank: int = 1) -> list:
    """mk_proxy_test_push's arguments, in its parameter order (cuda_src/testing/proxy_test.cu;
    tests/cpu/test_proxy_layout.py checks the sizes against the kernel's PTX parameter list)."""
    import ctypes

    return [comm, proxy_struct, ctypes.c_uint64(data_ptr), ctypes.c_int32(GPU_PER_BLOCK), ctypes.c_int32(dst_rank),
            ctypes.c_uint64(GPU_CHUNK), ctypes.c_int32(GPU_FLAG_WIN), ctypes.c_uint64(GPU_FLAG_BASE),
            ctypes.c_uint64(GPU_EPOCH), ctypes.c_int32(1)]


def model_test_push(prod: HostProducer, data: HostWindow, dst_rank: int = 1, flag_win: int = GPU_FLAG_WIN) -> None:
    """Host model of mk_proxy_test_push (wait_done=1): the same commands, block by block."""
    pat = gpu_pattern()
    for b in range(GPU_BLOCKS):
        last = None
        for i in range(GPU_PER_BLOCK):
            g = b * GPU_PER_BLOCK + i
            off = g * GPU_CHUNK
            data.array[off:off + GPU_CHUNK] = pat[g]
            last = prod.push(OP_WRITE, dst_rank, GPU_DATA_WIN, off, off, GPU_CHUNK, flag_win,
                             GPU_FLAG_BASE + 8 * g, GPU_EPOCH)
        prod.wait_done(last)


def gpu_receive_check(read_flags, read_data, proxy, wait_s: float = GPU_WAIT_S) -> None:
    """Rank 1: wait (at most wait_s) until every flag reached GPU_EPOCH, then check the data."""
    t0, last_print = time.monotonic(), 0.0
    while True:
        f = read_flags().view(np.uint64)
        n_ok = int((f >= GPU_EPOCH).sum())
        if n_ok == GPU_NCHUNKS:
            break
        proxy.check()
        dt = time.monotonic() - t0
        if dt - last_print >= 5.0:
            print(f"rank 1: {n_ok}/{GPU_NCHUNKS} flags after {dt:.1f} s", flush=True)
            last_print = dt
        if dt > wait_s:
            in_data = int((read_data()[:8 * GPU_NCHUNKS].view(np.uint64) == GPU_EPOCH).sum())
            hint = (f" -- yet {in_data} of the data window's first {GPU_NCHUNKS} u64 hold the flag value: "
                    "were the flags written into the data window (the kernel's flag_win)?") if n_ok == 0 and in_data else ""
            raise AssertionError(f"rank 1: flags stuck at {n_ok}/{GPU_NCHUNKS} after {wait_s} s "
                                 f"(proxy stats {dict(proxy.stats)}){hint}")
        time.sleep(1e-3)
    got = read_data().reshape(GPU_NCHUNKS, GPU_CHUNK)
    want = gpu_pattern()
    assert np.array_equal(got, want), f"rank 1: data wrong in {int((got != want).any(1).sum())} chunks"


def sc_gpu_model(env, flag_win: int = GPU_FLAG_WIN):
    """CPU model of sc_gpu: host windows of the same sizes, rank 0 pushes what the kernel pushes."""
    data, flags = HostWindow(GPU_DATA_BYTES), HostWindow(GPU_FLAG_BYTES)
    p = Proxy(env.ex, [data, flags], transport=env.transport, ring_capacity=16,
              transport_options=dict(env.opts)).start()
    if env.rank == 0:
        model_test_push(p.producer(GPU_KERNEL_TIMEOUT_S), data, flag_win=flag_win)
        assert int(p.ring.done[0]) >= GPU_NCHUNKS
    elif env.rank == 1:
        gpu_receive_check(lambda: flags.array.copy(), lambda: data.array[:GPU_NCHUNKS * GPU_CHUNK].copy(), p)
    env.ex.barrier()
    p.close()


def sc_gpu_model_flag_win0(env):
    """sc_gpu_model as the kernel was before it took flag_win (flags into window 0): rank 1 must fail
    within MK_TEST_GPU_WAIT naming the cause, not hang (the test sets a short wait)."""
    sc_gpu_model(env, flag_win=0)


def sc_gpu(env):
    """GPU end to end (needs a GPU; 2 ranks may share one): rank 0's kernel (proxy_test.cu) pushes
    WRITE commands through the host-mapped ring; rank 1 checks data + flags in its device window."""
    import ctypes

    from cuda.bindings import driver as cu

    from mkernel.core.compiler import compile_module
    from mkernel.core.driver import check, current_arch
    from mkernel.dist.signals import MkComm, MkErrorRecord
    from mkernel.proxy.transport import GpuWindow

    def say(msg):
        print(f"rank {env.rank}: {msg} ({time.monotonic() - t_start:.2f} s)", flush=True)

    t_start = time.monotonic()
    check(cu.cuInit(0))
    ndev = check(cu.cuDeviceGetCount())
    dev = check(cu.cuDeviceGet(env.rank % ndev))
    ctx = check(cu.cuDevicePrimaryCtxRetain(dev))
    check(cu.cuCtxSetCurrent(ctx))
    data_d = int(check(cu.cuMemAlloc(GPU_DATA_BYTES)))
    flag_d = int(check(cu.cuMemAlloc(GPU_FLAG_BYTES)))
    check(cu.cuMemsetD8(data_d, 0xEE, GPU_DATA_BYTES))
    check(cu.cuMemsetD8(flag_d, 0, GPU_FLAG_BYTES))
    err_h = int(check(cu.cuMemHostAlloc(64, cu.CU_MEMHOSTALLOC_DEVICEMAP)))
    ctypes.memset(err_h, 0, 64)
    err_d = int(check(cu.cuMemHostGetDevicePointer(err_h, 0)))
    check(cu.cuCtxSynchronize())  # (the memsets are done before the peer's proxy can write)
    dw, fw = GpuWindow(data_d, GPU_DATA_BYTES), GpuWindow(flag_d, GPU_FLAG_BYTES)
    windows = [None, None]
    windows[GPU_DATA_WIN], windows[GPU_FLAG_WIN] = dw, fw
    p = Proxy(env.ex, windows, transport=env.transport, ring_capacity=16,
              transport_options=dict(env.opts)).start()
    say(f"proxy up on device {env.rank % ndev} of {ndev}")

    if env.rank == 0:
        k = compile_module("testing/proxy_test.cu", arch=current_arch()).function("mk_proxy_test_push")
        say("compiled")
        comm = MkComm(err=err_d, timeout_ns=int(GPU_KERNEL_TIMEOUT_S * 1e9), rank=0, world_size=env.size,
                      local_rank=0, local_size=1, node=0, num_nodes=env.size, op=0, sig=0)
        k.launch(GPU_BLOCKS, 128, gpu_kernel_args(comm, p.ring_device_struct(), data_d))
        say("launched")
        check(cu.cuCtxSynchronize())
        rec = MkErrorRecord.from_address(err_h)
        say(f"kernel done: error code {rec.code}, ring done {int(p.ring.done[0])}, proxy stats {dict(p.stats)}")
        assert rec.code == 0, (f"kernel reported error code {rec.code} (peer {rec.peer}, block {rec.block}, "
                               f"expected {rec.expected}, seen {rec.seen}, waited {rec.waited_ns / 1e9:.2f} s)")
        assert int(p.ring.done[0]) >= GPU_NCHUNKS
    elif env.rank == 1:
        gpu_receive_check(lambda: fw.read(0, GPU_FLAG_BYTES), lambda: dw.read(0, GPU_NCHUNKS * GPU_CHUNK), p)
        say("data and flags checked")
    env.ex.barrier()
    p.close()
    dw.close(), fw.close()
    cu.cuMemFree(data_d), cu.cuMemFree(flag_d), cu.cuMemFreeHost(err_h)


def sc_sleep(env):
    """Sleeps MK_TEST_SLEEP s (tests of the runner's timeout handling)."""
    time.sleep(float(os.environ.get("MK_TEST_SLEEP", "60")))


SCENARIOS = {k[3:]: v for k, v in globals().items() if k.startswith("sc_")}


def main(argv=None):
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ.get("MK_TEST_DUMP_AFTER", "1e9")), exit=False)
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--socket", nargs=3, type=int, metavar=("RANK", "SIZE", "PORT"))
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--opt", action="append", default=[], help="transport option k=v")
    ap.add_argument("scenarios", nargs="+")
    a = ap.parse_args(argv)
    if a.socket:
        ex = SocketExchanger(a.socket[0], a.socket[1], a.host, a.socket[2])
    else:
        from mpi4py import MPI

        ex = as_exchanger(MPI.COMM_WORLD)
    opts = {}
    for kv in a.opt:
        k, v = kv.split("=", 1)
        opts[k] = int(v) if v.lstrip("-").isdigit() else v
    env = Env(ex, a.transport, opts)
    rc = 0
    for name in a.scenarios:
        t0 = time.perf_counter()
        try:
            SCENARIOS[name](env)
            print(f"OK {name} rank {ex.rank} {time.perf_counter() - t0:.2f}s", flush=True)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            print(f"FAIL {name} rank {ex.rank}", flush=True)
            rc = 1
            break
        if name != "dead_peer":
            ex.barrier()
    sys.stdout.flush()
    if rc == 0 and not a.socket and "dead_peer" not in a.scenarios:
        # every rank passed the last barrier, so MPI_Finalize cannot wait on a dead peer; without it
        # Open MPI's mpirun reports the job as exiting improperly and returns non-zero
        from mpi4py import MPI

        MPI.Finalize()
    os._exit(rc)  # skip interpreter teardown (daemon threads) for a prompt, clean exit code


if __name__ == "__main__":
    main()
