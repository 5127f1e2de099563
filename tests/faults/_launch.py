"""Launch a fault scenario under mpirun and read what every rank saw (tests/faults/test_mpi_faults.py,
test_gpu_kill.py; the workers log through ``_mpi_worker.Log``)."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(worker: Path, scenario: str, n: int, tmp_path: Path, mpirun: list, kill: bool = False, timeout: float = 60.0,
        env_extra: dict | None = None, ready_within: float = 30.0):
    """Run ``scenario`` on ``n`` ranks; returns ({rank: events}, kill time or None, output).  With ``kill``
    the last rank is the victim: it runs under a shell that outlives it (the launcher must not learn of
    the death: the others find out through their bounded waits), which is ended once every other rank
    has reported.  ``mpirun``: the launcher and its options; ``env_extra``: variables set (None: removed)
    for the ranks; ``ready_within``: seconds the victim may take to get ready (a GPU warm-up compiles)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(HERE.parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MKERNEL_TIMEOUT", None)
    for k, v in (env_extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    rank_cmd = [sys.executable, str(worker), scenario, str(tmp_path)]
    cmd = [*mpirun, "-np", str(n), *rank_cmd]
    if kill:
        victim = " ".join(shlex.quote(c) for c in rank_cmd) + "; sleep 60"
        cmd = [*mpirun, "-np", str(n - 1), *rank_cmd, ":", "-np", "1", "sh", "-c", victim]
    shm_before = _mpi_shm_segments()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    t_kill = None
    try:
        if kill:
            pid_file = tmp_path / "victim.pid"
            t0 = time.monotonic()
            while not pid_file.exists():
                # the job ends early when a rank leaves with an error (its log says why: _logged)
                assert p.poll() is None, "the victim never got ready: the job ended first"
                assert time.monotonic() - t0 < ready_within, f"the victim never got ready within {ready_within} s"
                time.sleep(0.005)
            pid, shell = (int(x) for x in pid_file.read_text().split())
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            while not all((tmp_path / f"exit{r}").exists() for r in range(n - 1)):
                assert time.monotonic() - t0 < timeout, "the other ranks never reported"
                time.sleep(0.01)
            time.sleep(0.2)
            try:
                os.kill(shell, signal.SIGKILL)  # the victim's shell: the job may end now
            except ProcessLookupError:  # (the launcher ended it when the others left)
                pass
        out, _ = p.communicate(timeout=timeout)
    except BaseException as exc:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the session this test started
        except ProcessLookupError:  # every process of it has ended already
            pass
        out, _ = p.communicate()
        if isinstance(exc, AssertionError):  # with what the ranks logged (a crash's traceback) and the output
            raise AssertionError(f"{exc}\n{_logged(tmp_path)}\n{out[-3000:]}") from None
        raise
    finally:
        _remove_unmapped(_mpi_shm_segments() - shm_before)
    ranks = _ranks(tmp_path)
    for r, ev in ranks.items():
        assert "crashed" not in ev, f"rank {r} crashed: {ev['crashed'].get('tb')}\n{out[-3000:]}"
    return ranks, t_kill, out


def _mpi_shm_segments() -> set:
    """MPICH's shared-memory segments (/dev/shm/mpich_shm_*): a killed rank never unlinks its job's."""
    return set(Path("/dev/shm").glob("mpich_shm_*"))


def _remove_unmapped(segments: set) -> None:
    """Unlink the segments of ``segments`` that no live process maps (those of this test's ended job; a
    segment some process still maps belongs to a running job and stays)."""
    if not segments:
        return
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split(None, 5)[5].strip() for line in maps.read_text().splitlines()
                          if "/dev/shm/mpich_shm_" in line)
        except (OSError, IndexError):  # (a process that ended meanwhile, or one we may not read)
            pass
    for seg in segments:
        if str(seg) not in mapped:
            seg.unlink(missing_ok=True)


def _ranks(tmp_path: Path) -> dict:
    ranks = {}
    for f in tmp_path.glob("rank*.json"):
        d = json.loads(f.read_text())
        ranks[d["rank"]] = {e["event"]: e for e in d["events"]}
    return ranks


def _logged(tmp_path: Path) -> str:
    """Every rank's events, a crash's traceback in full (for a failure before the ranks reported)."""
    try:
        ranks = _ranks(tmp_path)
    except (OSError, ValueError) as exc:  # (a rank killed while writing its log)
        return f"(the ranks' logs: {exc!r})"
    lines = []
    for r, ev in sorted(ranks.items()):
        tb = ev.get("crashed", {}).get("tb")
        lines.append(f"rank {r}: {[{k: v for k, v in e.items() if k != 'tb'} for e in ev.values()]}")
        if tb:
            lines.append(tb)
    return "\n".join(lines) or "(no rank logged anything)"
