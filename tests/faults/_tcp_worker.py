"""One rank of the TCP proxy kill scenario, a plain process joined by a SocketExchanger (not collected).

    python tests/faults/_tcp_worker.py RANK SIZE PORT OUTDIR

Started by tests/faults/test_tcp_faults.py (every rank needs the same ``MKERNEL_EXCHANGE_TOKEN``).  Every
rank drives its proxy over the TCP transport with a HostProducer standing in for the GPU: each round it
writes a 64 KiB chunk and raises a flag on every other rank, then waits for every other rank's flag of
that round.  A flag wait stands for a kernel's device-side wait: it ends with CommTimeout naming the peer
after TIMEOUT s.  Rank 1 writes ``OUTDIR/victim.pid`` after round 20 and goes on; the harness kills it
with SIGKILL in the middle of the transfers.  Every other rank writes ``OUTDIR/rank<r>.json``: when and
how it failed (wall clock), and how long closing its proxy took.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mkernel.errors import CommError, CommTimeout  # noqa: E402
from mkernel.proxy import OP_WRITE, Proxy  # noqa: E402
from mkernel.proxy.transport import HostWindow, SocketExchanger  # noqa: E402

TIMEOUT = 2.0
CHUNK = 64 << 10


def main():
    rank, size, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    ex = SocketExchanger(rank, size, "127.0.0.1", port, timeout=30.0)
    data, flags = HostWindow(size * CHUNK), HostWindow(4096)
    p = Proxy(ex, [data, flags], transport="tcp", ring_capacity=256, timeout=TIMEOUT).start()
    prod = p.producer()
    res = {"rank": rank}
    ep = 0
    try:
        while True:
            ep += 1
            for d in range(size):
                if d != rank:
                    prod.push(OP_WRITE, d, 0, rank * CHUNK, rank * CHUNK, CHUNK, 1, 8 * rank, ep)
            for s in range(size):
                if s == rank:
                    continue
                t0 = time.monotonic()
                while flags.read_u64(8 * s) < ep:
                    p.check()
                    if time.monotonic() - t0 > TIMEOUT:
                        raise CommTimeout(f"rank {rank} waited {TIMEOUT} s for rank {s}'s flag {ep}", {"peer": s})
                    time.sleep(50e-6)
            if rank == 1 and ep == 20:
                (out / "victim.pid.tmp").write_text(str(os.getpid()))
                os.replace(out / "victim.pid.tmp", out / "victim.pid")
            if ep > 200_000:
                raise RuntimeError("never failed")
    except CommError as exc:
        res.update(t=time.time(), type=type(exc).__name__, msg=str(exc), peer=exc.record.get("peer"), rounds=ep)
    t0 = time.monotonic()
    try:
        p.close()
    except CommError as exc:
        res["close_error"] = str(exc)
    res["close_s"] = time.monotonic() - t0
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    os._exit(0)


if __name__ == "__main__":
    main()
