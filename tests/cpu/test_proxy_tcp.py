"""Proxy + TCP transport end to end on host memory, 2 and 3 processes (CPU only).

The ranks run tests/cpu/test_proxy_scenarios.py under /work/venv/bin/mpirun (or the mpirun next
to this Python), or as plain processes joined by a SocketExchanger (dead-peer test: a rank that
dies must not take mpirun's job-abort path).  Every run has a hard timeout.
"""
from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "test_proxy_scenarios.py"
ALL = ["shutdown", "many", "large", "backpressure", "flag_batching", "ordering", "barrier"]


def _mpirun():
    cand = [Path(sys.executable).parent / "mpirun", Path("/work/venv/bin/mpirun")]
    for c in cand:
        if c.is_file():
            return str(c)
    return shutil.which("mpirun")


def _env():
    env = dict(os.environ)
    env["MKERNEL_TRANSPORT"] = "tcp"
    env.pop("MKERNEL_TCP_ADDR", None)
    env["MKERNEL_EXCHANGE_TOKEN"] = secrets.token_hex(16)  # the socket rendezvous's shared secret
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")  # (Open MPI's mpirun refuses root otherwise: GPU images)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def _check(res, n, scenarios):
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    for sc in scenarios:
        assert out.count(f"OK {sc} ") == n, f"{sc}: not OK on every rank\n{out[-4000:]}"


@pytest.mark.parametrize("n", [2, 3])
def test_proxy_tcp_mpirun(n):
    mpirun = _mpirun()
    if mpirun is None:
        pytest.skip("no mpirun")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip("no mpi4py")
    res = subprocess.run([mpirun, "-np", str(n), sys.executable, str(SCRIPT), "--transport", "tcp", *ALL],
                         capture_output=True, text=True, timeout=240, env=_env())
    _check(res, n, ALL)


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def run_socket_ranks(n, scenarios, transport="tcp", timeout=120, extra=()):
    port, env = _free_port(), _env()
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), "--transport", transport, "--socket", str(r), str(n),
                               str(port), *extra, *scenarios], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env) for r in range(n)]
    outs, rcs = [], []
    for p in procs:
        try:
            o, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            o, _ = p.communicate()
            o += "\n<TIMEOUT>"
        outs.append(o)
        rcs.append(p.returncode)
    return rcs, outs


def test_proxy_tcp_socket_exchange():
    rcs, outs = run_socket_ranks(2, ["many", "flag_batching", "ordering"])
    assert rcs == [0, 0], "\n".join(outs)[-4000:]


def test_proxy_tcp_dead_peer_errors_not_hangs():
    rcs, outs = run_socket_ranks(2, ["dead_peer"], timeout=90)
    assert rcs[0] == 0 and "dead peer detected" in outs[0], "\n".join(outs)[-4000:]
