"""Proxy + TCP transport end to end on host memory, 2 and 3 processes (CPU only).

The ranks run tests/cpu/test_proxy_scenarios.py under /work/venv/bin/mpirun (or the mpirun next
to this Python), or as plain processes joined by a SocketExchanger (dead-peer test: a rank that
dies must not take mpirun's job-abort path).  Every run has a hard timeout.
"""
from __future__ import annotations

import functools
import os
import secrets
import shutil
import signal
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


@functools.lru_cache(maxsize=None)
def _launch(n: int) -> tuple:
    """``mpirun -np n`` with the launcher's options.  MPICH's hydra gets ``-disable-auto-cleanup``: its
    end-of-job clean-up sometimes SIGKILLed a rank still leaving ``MPI_Finalize`` after every rank had
    passed (docs/reliability.md, "Launchers"); each run here has its own hard timeout instead."""
    mpirun = _mpirun()
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    return (mpirun, *(["-disable-auto-cleanup"] if "HYDRA" in out else []), "-np", str(n))


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
    res = subprocess.run([*_launch(n), sys.executable, str(SCRIPT), "--transport", "tcp", *ALL],
                         capture_output=True, text=True, timeout=240, env=_env())
    _check(res, n, ALL)


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def run_mpirun(n, args, timeout, env_extra=None):
    """``mpirun -np n python SCRIPT *args`` with a hard timeout: ``(returncode, output)`` (stdout and
    stderr of mpirun and every rank, merged).  On a timeout the whole process group -- mpirun and the
    ranks it started -- gets SIGTERM, then SIGKILL, and the output is what came so far (the ranks'
    faulthandler stack dumps among it when MK_TEST_DUMP_AFTER is below ``timeout``) plus a
    ``<TIMEOUT ...>`` line; returncode is None.  Never leaves the ranks running."""
    env = _env()
    env.update(env_extra or {})
    p = subprocess.Popen([*_launch(n), sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out.decode(errors="replace")
    except subprocess.TimeoutExpired as exc:
        out = exc.output or b""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            out, _ = p.communicate(timeout=5)
            break
        except subprocess.TimeoutExpired as exc:
            out = exc.output or out
    else:  # a rank outside the group still holds the pipe: give up reading
        p.kill()
        p.wait(5)
    return None, out.decode(errors="replace") + f"\n<TIMEOUT after {timeout} s: mpirun and its ranks killed>"


def run_socket_ranks(n, scenarios, transport="tcp", timeout=120, extra=(), env_extra=None):
    port, env = _free_port(), _env()
    env.update(env_extra or {})
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


def test_gpu_scenario_model_delivers_to_the_flag_window():
    """The CPU model of the GPU scenario (sc_gpu_model: host windows, rank 0 pushes exactly what
    proxy_test.cu's kernel pushes, flags into their own window): every flag and byte arrives."""
    rcs, outs = run_socket_ranks(2, ["gpu_model"], timeout=60, env_extra={"MK_TEST_GPU_WAIT": "20"})
    assert rcs == [0, 0] and all("OK gpu_model " in o for o in outs), "\n".join(outs)[-4000:]


def test_gpu_scenario_flags_in_the_wrong_window_fail_fast():
    """The GPU test's former hang, on the CPU: the kernel hard-coded flag window 0 while the scenario
    waits on window 1, so rank 1 waited its whole 60 s (past the GPU test's 35 s budget).  Now the wait
    is bounded by MK_TEST_GPU_WAIT and the failure says where the flags went."""
    rcs, outs = run_socket_ranks(2, ["gpu_model_flag_win0"], timeout=60, env_extra={"MK_TEST_GPU_WAIT": "2"})
    assert rcs[1] == 1, "\n".join(outs)[-4000:]
    assert "flags stuck at 0/128 after 2.0 s" in outs[1] and "flag_win" in outs[1], outs[1][-4000:]


def test_run_mpirun_kills_and_reports_on_timeout():
    """run_mpirun's timeout path (the GPU test's guard): the ranks' faulthandler dumps come back and
    nothing is left running."""
    mpirun = _mpirun()
    if mpirun is None:
        pytest.skip("no mpirun")
    pytest.importorskip("mpi4py")
    rc, out = run_mpirun(2, ["--transport", "tcp", "sleep"], timeout=12,
                         env_extra={"MK_TEST_DUMP_AFTER": "6", "MK_TEST_SLEEP": "60"})
    assert rc is None and "<TIMEOUT after 12 s" in out, out[-4000:]
    assert out.count("in sc_sleep") >= 2, out[-4000:]  # both ranks' stack dumps


def test_run_mpirun_clean_exit_returns_zero():
    """A run whose scenarios all pass exits 0 under mpirun (the GPU test asserts rc == 0): the runner
    finalizes MPI before its prompt exit."""
    mpirun = _mpirun()
    if mpirun is None:
        pytest.skip("no mpirun")
    pytest.importorskip("mpi4py")
    rc, out = run_mpirun(2, ["--transport", "tcp", "sleep"], timeout=30, env_extra={"MK_TEST_SLEEP": "0"})
    assert rc == 0 and out.count("OK sleep ") == 2, f"rc {rc}:\n{out[-4000:]}"
