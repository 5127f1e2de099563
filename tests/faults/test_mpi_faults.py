"""Faults at the host-side collectives, with real MPI ranks (CPU only; docs/reliability.md has the table).

Each test starts ``mpirun -disable-auto-cleanup -np N`` on tests/faults/_mpi_worker.py (MPICH's hydra;
without that option it ends every rank as soon as one dies) and reads what every rank saw.  Kill
scenarios: the victim rank (the last) announces its pid when it is where it is to die, this process
sends it SIGKILL, and every other rank must raise within the host wait limit
(``host_wait_limit(timeout)``: 4 x the timeout, at least 4 s) + 2 s of the kill.  The victim runs under
a shell that outlives it, so the launcher does not learn of the death (as when a host dies silently):
the others can only find out through their own bounded waits.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _launch import run as launch  # noqa: E402

from mkernel.dist.timeouts import host_wait_limit

pytestmark = pytest.mark.faults

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_mpi_worker.py"
TIMEOUT = 0.5  # the workers' context timeout
LIMIT = host_wait_limit(TIMEOUT)
SLACK = 2.0


def _mpirun():
    cand = Path(sys.executable).with_name("mpirun")
    path = str(cand) if cand.exists() else None
    if path is None:
        pytest.skip("no mpirun next to this Python (pip install -e '.[mpich]')")
    ver = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    if "HYDRA" not in ver:
        pytest.skip("the fault scenarios need MPICH's hydra (-disable-auto-cleanup)")
    return path


def run(scenario: str, n: int, tmp_path: Path, kill: bool = False, timeout: float = 60.0):
    """Run ``scenario`` on ``n`` ranks under hydra (-disable-auto-cleanup): :func:`_launch.run`."""
    return launch(WORKER, scenario, n, tmp_path, [_mpirun(), "-disable-auto-cleanup"], kill=kill, timeout=timeout)


def test_kill_9_during_an_agreement_every_other_rank_raises_in_bound(tmp_path):
    ranks, t_kill, out = run("agree_kill", 3, tmp_path, kill=True)
    assert sorted(ranks) == [0, 1], out[-3000:]
    for r, ev in ranks.items():
        e = ev["agree"]
        assert e["type"] == "CommTimeout" and "join mkernel.all_reduce" in e["msg"], e
        assert e["t"] - t_kill <= LIMIT + SLACK, (r, e["t"] - t_kill)
        again = ev["agree_again"]  # broken: raises at once instead of pairing with the abandoned exchange
        assert again["type"] == "CommTimeout" and "agreement is broken" in again["msg"] and again["dt"] < 0.1


def test_kill_9_before_init_every_other_rank_raises_in_bound(tmp_path):
    ranks, t_kill, out = run("init_kill", 3, tmp_path, kill=True)
    assert sorted(ranks) == [0, 1], out[-3000:]
    for r, ev in ranks.items():
        e = ev["init"]
        assert e["type"] == "CommTimeout" and "mkernel.init" in e["msg"], e
        assert e["t"] - t_kill <= LIMIT + SLACK, (r, e["t"] - t_kill)


def test_kill_9_before_the_host_split_every_other_rank_raises_in_bound(tmp_path):
    """MPI has no non-blocking communicator split: init runs its splits on a helper thread bounded by the
    host wait limit (MPI_THREAD_MULTIPLE, mpi4py's default)."""
    ranks, t_kill, out = run("split_kill", 3, tmp_path, kill=True)
    assert sorted(ranks) == [0, 1], out[-3000:]
    for r, ev in ranks.items():
        assert ev["threads"]["multiple"], ev["threads"]
        e = ev["init"]
        assert e["type"] == "CommTimeout" and "mkernel.init (the host split)" in e["msg"], e
        assert e["t"] - t_kill <= LIMIT + SLACK, (r, e["t"] - t_kill)


def test_a_stalled_rank_times_the_others_out_and_every_rank_can_initialise_again(tmp_path):
    ranks, _, out = run("agree_stall", 3, tmp_path)
    assert sorted(ranks) == [0, 1, 2], out[-3000:]
    for r in (0, 2):
        e = ranks[r]["agree"]
        assert e["type"] == "CommTimeout" and LIMIT - 0.1 <= e["dt"] <= LIMIT + SLACK, e
    # the stalled rank joined late: whatever it saw, every rank's second init and agreement work
    for r, ev in ranks.items():
        for name in ("reinit", "agree_after_reinit", "barrier_after_reinit"):
            assert "type" not in ev[name], (r, name, ev[name])


def test_ranks_making_different_calls_raise_value_error_on_every_rank(tmp_path):
    ranks, _, out = run("mismatch", 3, tmp_path)
    assert sorted(ranks) == [0, 1, 2], out[-3000:]
    for r, ev in ranks.items():
        size, op = ev["other_size"], ev["other_op"]
        assert size["type"] == "ValueError" and "disagree" in size["msg"], size
        assert op["type"] == "ValueError" and "disagree" in op["msg"], op
        assert "type" not in ev["same_call_after"], ev["same_call_after"]  # still usable: nothing timed out
        for name in ("reinit", "agree_after_reinit"):
            assert "type" not in ev[name], (r, name, ev[name])
    assert "ranks [1] have [('bfloat16', (8192,), False)]" in ranks[0]["other_size"]["msg"]
    assert "ranks [0, 2] have" in ranks[1]["other_size"]["msg"]
    assert "ranks [2] have [mkernel.reduce_scatter(" in ranks[0]["other_op"]["msg"]
    # a call the others agreed before: only rank 1 exchanges, and it times out (never hangs)
    alone = ranks[1]["new_call_alone"]
    assert alone["type"] == "CommTimeout" and alone["dt"] <= LIMIT + SLACK, alone
    assert all("type" not in ranks[r]["agreed_call"] for r in (0, 2))


def test_out_of_memory_on_one_rank_raises_memory_error_on_every_rank(tmp_path):
    ranks, _, out = run("symmetric_oom", 3, tmp_path)
    assert sorted(ranks) == [0, 1, 2], out[-3000:]
    for r, ev in ranks.items():
        e = ev["alloc_oom"]
        assert e["type"] == "MemoryError" and "out of device memory on rank 1" in e["msg"], e
        assert e["dt"] < LIMIT, e  # told by the failing rank, not timed out
        assert (ev["held_after_oom"]["live"], ev["held_after_oom"]["mapped"]) == (0, 0)
        assert "type" not in ev["alloc_retry"] and "type" not in ev["free"], ev
        assert (ev["held_at_end"]["live"], ev["held_at_end"]["mapped"]) == (0, 0)


def test_kill_9_during_a_symmetric_allocation_and_a_local_close(tmp_path):
    ranks, t_kill, out = run("symmetric_kill", 3, tmp_path, kill=True)
    assert sorted(ranks) == [0, 1], out[-3000:]
    for r, ev in ranks.items():
        e = ev["alloc"]
        assert e["type"] == "CommTimeout" and "symmetric allocation" in e["msg"], e
        assert e["t"] - t_kill <= LIMIT + SLACK, (r, e["t"] - t_kill)
        assert ev["failure"]["reason"] and "type" not in ev["close"] and ev["close"]["dt"] < 0.5, ev
        held = ev["held_after_close"]
        # nothing freed: the first buffer (its copy, its peer table, both peers' copies mapped) and the
        # second one's copy, whose handle may have reached a peer, are leaked
        assert held["leaked"] and held["live"] == 3 and held["mapped"] == 2, held
