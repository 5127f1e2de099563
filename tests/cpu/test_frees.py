"""mkernel/core/frees.py: a free made while a launch marked as waiting on the proxy is unfinished is
deferred, and done (in order, with the new one) once none is -- never while one is (the driver's events
are faked here: the GPU tests run the real thing, tests/gpu/test_internode.py and test_moe.py)."""
from __future__ import annotations

import time

import pytest

from mkernel.core import frees


@pytest.fixture
def fake_events(monkeypatch):
    state = {"next": 0, "done": set()}

    def record(stream):
        ev = state["next"] = state["next"] + 1
        frees._marks.append(ev)

    monkeypatch.setattr(frees, "_record", record)
    monkeypatch.setattr(frees, "_done", lambda ev: ev in state["done"])
    monkeypatch.setattr(frees, "_marks", [])
    monkeypatch.setattr(frees, "_pool", [])
    monkeypatch.setattr(frees, "_graph_marks", [])
    monkeypatch.setattr(frees, "_deferred", [])
    state["modes"] = []
    monkeypatch.setattr(frees, "_exchange_mode", lambda m: state["modes"].append(m) or "caller's")
    return state


def test_free_waits_for_marked_launches_then_runs_in_order(fake_events):
    freed = []
    free = lambda ctx, ptr: freed.append(ptr)  # noqa: E731
    frees.release(free, 1, 0xA)
    assert freed == [0xA]  # nothing marked: at once
    frees.mark_proxy_launch(0)
    frees.mark_proxy_launch(7)
    frees.release(free, 1, 0xB)
    frees.release(free, 1, 0xC)
    frees.drain()
    assert freed == [0xA] and frees.pending() == 2
    fake_events["done"].add(1)  # one of two marked launches finished: still deferred
    frees.release(free, 1, 0xD)
    assert freed == [0xA] and frees.pending() == 3
    fake_events["done"].add(2)
    frees.release(free, 1, 0xE)
    assert freed == [0xA, 0xB, 0xC, 0xD, 0xE] and frees.pending() == 0
    assert frees._pool == [1, 2]  # finished events are reused


def test_drain_after_the_marks_finish(fake_events):
    freed = []
    frees.mark_proxy_launch(0)
    frees.release(lambda c, p: freed.append(p), 1, 0x10)
    fake_events["done"].add(1)
    frees.drain()
    assert freed == [0x10] and frees.pending() == 0


def test_a_captured_mark_is_checked_at_every_free(fake_events):
    """A mark recorded inside a graph capture stays: each replay records it again."""
    freed = []
    frees._graph_marks.append(99)
    frees.release(lambda c, p: freed.append(p), 1, 0x20)
    assert freed == [] and frees.pending() == 1
    fake_events["done"].add(99)
    frees.drain()
    assert freed == [0x20] and frees._graph_marks == [99]


def test_a_free_inside_the_locked_code_is_deferred(fake_events, monkeypatch):
    """A finalizer run by the garbage collector while frees' own code holds the lock only defers."""
    freed = []
    free = lambda c, p: freed.append(p)  # noqa: E731

    def record(stream):  # a collection inside the record: a finalizer frees an array
        frees.release(free, 1, 0x30)
        frees._marks.append(1)

    monkeypatch.setattr(frees, "_record", record)
    frees.mark_proxy_launch(0)
    assert freed == [] and frees.pending() == 1
    fake_events["done"].add(1)
    frees.release(free, 1, 0x31)
    assert freed == [0x30, 0x31] and frees.pending() == 0


def test_marks_do_not_pile_up_without_frees(fake_events):
    """Many marked launches and no free: the finished marks are dropped (their events reused) at each mark."""
    for i in range(1000):
        fake_events["done"].add(i)  # every earlier launch has finished by the next one
        frees.mark_proxy_launch(0)
    assert len(frees._marks) == 1 and frees.pending() == 0


def test_event_queries_run_in_relaxed_capture_mode(fake_events):
    """A query during the caller's stream capture would invalidate it: _busy switches this thread to the
    relaxed capture mode around its queries and puts the caller's mode back."""
    frees.mark_proxy_launch(0)
    assert fake_events["modes"] == [frees._RELAXED, "caller's"]


def test_wait_marked_returns_once_the_marks_finish(fake_events, monkeypatch):
    """frees.wait_marked polls (sleeping, no driver lock held) until no marked launch is unfinished."""
    frees.wait_marked()  # nothing marked: at once
    frees.mark_proxy_launch(0)
    naps = []

    def sleep(s):  # the marked kernel finishes while the caller sleeps (its proxy served it meanwhile)
        naps.append(s)
        if len(naps) == 3:
            fake_events["done"].add(1)
    monkeypatch.setattr(time, "sleep", sleep)
    frees.wait_marked()
    assert len(naps) == 3


def test_a_kernel_loads_only_once_no_marked_launch_is_unfinished(fake_events, monkeypatch):
    """A kernel's first load (its module, then its code: CUDA's lazy loading) may synchronize the context
    holding the driver lock, which the TCP proxy's copies wait behind: made while a kernel waits on this
    process's proxy, neither finishes until that kernel times out -- the first node-path combine (a kernel
    never loaded before) right after the node-path dispatch's launch in test_internode_back_to_back_changing_
    routings[switching] (CommTimeout in moe_dispatch on both ranks).  So Kernel._func waits for the marks
    first, loads the code at once (cuFuncLoad), and a later use makes no driver load at all."""
    from mkernel.core import launch

    calls = []

    class Cu:
        @staticmethod
        def cuCtxGetCurrent():
            return (0, 7)

        @staticmethod
        def cuModuleGetFunction(h, name):
            calls.append(("get", name, 1 in fake_events["done"]))
            return (0, "f")

        @staticmethod
        def cuFuncLoad(f):
            calls.append(("load", f, 1 in fake_events["done"]))
            return (0,)

    class Module:
        def _module_handle(self):
            calls.append(("module", 1 in fake_events["done"]))
            return "h"

    monkeypatch.setattr(launch, "cu", Cu)
    monkeypatch.setattr(launch, "check", lambda r: r[1] if len(r) > 1 else None)
    monkeypatch.setattr(time, "sleep", lambda s: fake_events["done"].add(1))
    frees.mark_proxy_launch(0)  # e.g. the node dispatch, in flight
    k = launch.Kernel(Module(), "mk_moe_n_combine")
    assert k._func() == (7, "f")
    assert calls == [("module", True), ("get", b"mk_moe_n_combine", True), ("load", "f", True)], calls
    frees.mark_proxy_launch(0)  # another one in flight: the loaded kernel is a lookup, no wait, no driver load
    monkeypatch.setattr(time, "sleep", lambda s: pytest.fail("waited for a loaded kernel"))
    calls.clear()
    assert k._func() == (7, "f") and calls == []
