"""Proxy benchmark: commands/s sustained, latency added per command, and the GIL cost to the app.

Two ranks (mpirun -np 2, or plain processes: --socket RANK 2 PORT, with the same
MKERNEL_EXCHANGE_TOKEN in both environments):

    mpirun -np 2 python bench/proxy.py [--transport tcp|verbs] [--bytes 512] [--n 200000]
    export MKERNEL_EXCHANGE_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(16))')
    python bench/proxy.py --socket 0 2 PORT & python bench/proxy.py --socket 1 2 PORT

* throughput: rank 0 pushes N WRITE commands (B bytes each, distinct non-contiguous ranges so
  nothing coalesces; a flag per command, value = index+1) in bursts (HostProducer.push_many models
  many GPU blocks); rate = N / (time until the last command completed locally); rank 1 checks the
  last flag.  Reported for every flag on one slot (coalescible) and every command its own flag.
* latency: ping-pong of one 8-byte WRITE+flag; half round trip = push -> flag seen by the peer.
* gil: rank 0's main thread times a pure-Python loop with no proxy, an idle proxy, and a busy
  proxy (rank 1 streams commands to rank 0 and rank 0's producer thread streams to rank 1).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
from mkernel.proxy import NO_FLAG, OP_WRITE, Proxy  # noqa: E402
from mkernel.proxy.transport import HostWindow, SocketExchanger, as_exchanger  # noqa: E402


def cpu_loop(n=3_000_000):
    t = time.perf_counter()
    s = 0
    for i in range(n):
        s += i
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", default=None)
    ap.add_argument("--socket", nargs=3, type=int)
    ap.add_argument("--bytes", type=int, default=512)
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--ring", type=int, default=4096)
    ap.add_argument("--skip-gil", action="store_true")
    a = ap.parse_args()
    if a.socket:
        ex = SocketExchanger(a.socket[0], a.socket[1], "127.0.0.1", a.socket[2])
    else:
        from mpi4py import MPI

        ex = as_exchanger(MPI.COMM_WORLD)
    me, peer = ex.rank, 1 - ex.rank
    stride = max(a.bytes * 2, 64)
    slots = 8192
    data, flags = HostWindow(stride * slots), HostWindow(8 * (slots + 64))
    ref = min(cpu_loop() for _ in range(3)) if me == 0 else 0.0  # app loop with no proxy at all
    ex.barrier()
    p = Proxy(ex, [data, flags], transport=a.transport, ring_capacity=a.ring).start()
    prod = p.producer(120)
    tname = p.transport.name
    res = {}
    # ---- throughput
    for label, per_cmd_flag in (("one flag slot", False), ("flag per command", True)):
        ex.barrier()
        base = int(flags.read_u64(8 * slots)) if not per_cmd_flag else 0
        n = a.n
        if me == 0:
            idx = np.arange(n, dtype=np.uint64)
            off = (idx % slots) * stride
            foff = 8 * (idx % slots) if per_cmd_flag else np.full(n, 8 * slots, np.uint64)
            t0 = time.perf_counter()
            last = prod.push_many(n, op=OP_WRITE, dst_rank=peer, win=0, flag_win=1, src_offset=off, dst_offset=off,
                                  bytes=a.bytes, flag_offset=foff, flag_value=idx + 1 + base)
            prod.wait_done(last)
            dt = time.perf_counter() - t0
            res[label] = n / dt
        else:
            want = n + base
            off = 8 * ((n - 1) % slots) if per_cmd_flag else 8 * slots
            while flags.read_u64(off) < want:
                p.check()
                time.sleep(1e-4)
        ex.barrier()
    # ---- latency (ping-pong, 8 B + flag)
    ex.barrier()
    iters = 2000 if tname == "tcp" else 300
    lat_off = 8 * (slots + 8)
    t0 = time.perf_counter()
    for i in range(1, iters + 1):
        if me == 0:
            prod.push(OP_WRITE, peer, 0, 0, 0, 8, 1, lat_off, i)
            while flags.read_u64(lat_off) < i:
                time.sleep(0)  # a real app waits in a GIL-free call (stream sync); spinning here would starve the proxy
        else:
            while flags.read_u64(lat_off) < i:
                time.sleep(0)
            prod.push(OP_WRITE, peer, 0, 0, 0, 8, 1, lat_off, i)
    half_rtt = (time.perf_counter() - t0) / iters / 2
    # ---- GIL cost to an application thread on rank 0
    gil = {}
    if not a.skip_gil:
        ex.barrier()
        if me == 0:
            gil["idle"] = min(cpu_loop() for _ in range(3))
        ex.barrier()
        stop = threading.Event()

        def stream():
            i = 0
            while not stop.is_set():
                idx = np.arange(i, i + 256, dtype=np.uint64)
                prod.push_many(256, op=OP_WRITE, dst_rank=peer, win=0, flag_win=1, src_offset=(idx % slots) * stride,
                               dst_offset=(idx % slots) * stride, bytes=a.bytes, flag_offset=NO_FLAG, flag_value=0)
                i += 256
                time.sleep(1e-4)
        th = threading.Thread(target=stream, daemon=True)
        th.start()
        if me == 0:
            gil["busy"] = min(cpu_loop() for _ in range(3))
            t0 = time.perf_counter()
            c0 = p.stats["commands"]
            time.sleep(0.5)
            gil["busy_cmds_per_s"] = (p.stats["commands"] - c0) / (time.perf_counter() - t0)
        ex.barrier()
        stop.set()
        th.join()
    p.close()
    if me == 0:
        print(f"transport={tname} bytes={a.bytes} n={a.n} ring={a.ring}")
        for k, v in res.items():
            print(f"  throughput ({k}): {v:,.0f} commands/s")
        print(f"  latency: {half_rtt * 1e6:.1f} us half round trip (push -> flag seen by peer)")
        if gil:
            print(f"  app-thread CPU loop: no proxy {ref * 1e3:.0f} ms, proxy idle {gil['idle'] * 1e3:.0f} ms "
                  f"({gil['idle'] / ref - 1:+.0%}), proxy busy {gil['busy'] * 1e3:.0f} ms ({gil['busy'] / ref - 1:+.0%}; "
                  f"{gil['busy_cmds_per_s']:,.0f} cmds/s meanwhile)")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
