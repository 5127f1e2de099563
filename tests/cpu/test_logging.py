"""The ``mkernel`` logger: compiles (announced before NVRTC runs, timed after), new plans (DEBUG, fallbacks at
INFO), workspace growth, and the stderr handler MKERNEL_LOG turns on."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from mkernel.core import compiler, log as L
from mkernel.ops.base import BoundCall, Op, OpState


@pytest.fixture
def records(caplog):
    caplog.set_level(logging.DEBUG, logger="mkernel")
    return lambda level=logging.DEBUG: [r for r in caplog.records if r.name == "mkernel" and r.levelno >= level]


def test_compile_is_announced_before_nvrtc_and_timed_after(records, tmp_path, monkeypatch):
    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiler, "_module_cache", {})
    seen_at_compile = []
    real = compiler.nvrtc.nvrtcCompileProgram

    def spy(*a):
        seen_at_compile.append([r.getMessage() for r in records(logging.INFO)])
        return real(*a)

    monkeypatch.setattr(compiler.nvrtc, "nvrtcCompileProgram", spy)
    compiler.compile_module("ops/internode.cu", {"MK_DTYPE": 2}, arch="sm_90a")
    before = f"compiling ops/internode.cu dtype=2 for sm_90a (cached in {tmp_path})"
    assert seen_at_compile == [[before]]
    msgs = [r.getMessage() for r in records(logging.INFO)]
    assert msgs[0] == before and msgs[1].startswith("compiled ops/internode.cu dtype=2 for sm_90a in ")
    assert msgs[1].endswith(" s") and len(msgs) == 2
    # a second process start (the in-memory memo dropped) loads it: DEBUG only, NVRTC not run
    monkeypatch.setattr(compiler, "_module_cache", {})
    n = len(records())
    compiler.compile_module("ops/internode.cu", {"MK_DTYPE": 2}, arch="sm_90a")
    [rec] = records()[n:]
    assert rec.levelno == logging.DEBUG and rec.getMessage().startswith("loaded ops/internode.cu dtype=2 for sm_90a from")
    assert len(seen_at_compile) == 1


def test_define_summary():
    assert L.define_summary({"MK_GEMM_CONFIG": 18, "MK_CFG_NC": 2, "MK_GEMM_IN": 0, "X": 1}) == \
        "gemm_config=18 gemm_in=0 X=1"
    assert L.define_summary({f"MK_D{i}": i for i in range(50)}, limit=20).endswith("...")


class _Plan:
    def __init__(self, fallback=""):
        self.fallback = fallback

    def describe(self):
        return "path=fast"


class _Bound(BoundCall):
    def __init__(self, plan):
        self.plan = plan

    def run(self, stream, call):
        pass


class _Op(Op):
    name = "toy"

    def __init__(self, plan):
        self._plan = plan

    def describe_call(self, call):
        return f"n={call.n}"

    def plan(self, ctx, call, digest):
        return self._plan

    def bind(self, ctx, call, plan):
        return _Bound(plan)


class _Call:
    def __init__(self, n):
        self.key, self.stream, self.n = ("k", n), 0, n


def test_a_new_plan_is_one_debug_line_and_a_hit_none(records):
    op, st = _Op(_Plan()), OpState("toy")
    ctx = type("Ctx", (), {"rank": 3})()
    op.invoke(st, _Call(5), ctx)
    [rec] = records()
    assert rec.levelno == logging.DEBUG and rec.getMessage() == "toy [rank 3]: n=5: path=fast"
    op.invoke(st, _Call(5), ctx)  # same key: bound already
    assert len(records()) == 1
    op.invoke(st, _Call(6))       # a single-GPU op: no rank
    assert records()[-1].getMessage() == "toy: n=6: path=fast"


def test_a_fallback_plan_is_logged_at_info(records):
    op = _Op(_Plan("staged copies"))
    op.invoke(OpState("toy"), _Call(1))
    [rec] = records()
    assert rec.levelno == logging.INFO and rec.getMessage() == "toy: n=1: path=fast -- fallback: staged copies"


def test_plans_say_when_they_fall_back():
    from mkernel.ops.gemm.bound import GemmPlan
    from mkernel.ops.gemm_rs.planner import RsPlan

    assert GemmPlan("tiles", 3).fallback == ""
    assert GemmPlan("tiles", 3, staged=("a",)).fallback.startswith("a staged into padded copies")
    rs = dict(reason="predicted fused slower", me=0, m_sizes=(4, 4), N=8, Ks=(8, 8), b_layout="kn",
              in_dtype="bfloat16", out_dtype="bfloat16", partial_dtype="bfloat16", deterministic=False)
    assert RsPlan("unfused", P=2, **rs).fallback == "GEMM, then reduce-scatter (predicted fused slower)"
    assert RsPlan("fused", P=2, **rs).fallback == "" and RsPlan("unfused", P=1, **rs).fallback == ""


def test_workspace_growth_is_logged(records, monkeypatch):
    from mkernel.dist import context as X

    ctx = object.__new__(X.Context)
    ctx._workspaces, ctx._ws_gen, ctx.rank = {}, 0, 1

    class WS:
        def __init__(self, n):
            self.nbytes = n

        def free(self):
            pass

    ctx.alloc_symmetric = lambda n, comm=None: WS(n)
    ctx.synchronize = lambda: None
    ctx.workspace(("collective", "all_reduce"), 4096, what="mkernel.all_reduce")
    ctx.workspace(("collective", "all_reduce"), 4096, what="mkernel.all_reduce")  # fits: nothing to say
    ctx.workspace(("collective", "all_reduce"), 5000, what="mkernel.all_reduce")
    assert [r.getMessage() for r in records(logging.INFO)] == [
        "mkernel.all_reduce [rank 1]: communication workspace ('collective', 'all_reduce') created with 4096 bytes",
        "mkernel.all_reduce [rank 1]: communication workspace ('collective', 'all_reduce') grows from 4096 to 6144 bytes"]


@pytest.mark.parametrize("value, shown", [("1", ["INFO"]), ("debug", ["INFO", "DEBUG"]), ("0", []), (None, [])])
def test_mkernel_log_adds_a_stderr_handler(value, shown):
    env = {k: v for k, v in os.environ.items() if k != "MKERNEL_LOG"}
    if value is not None:
        env["MKERNEL_LOG"] = value
    code = ("import logging, mkernel; lg = logging.getLogger('mkernel'); lg.info('hello info'); "
            "lg.debug('hello debug')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert [ln.split()[1] for ln in lines] == shown
    assert all(ln.startswith("mkernel[") for ln in lines)


def test_configure_replaces_its_handler(mkenv):
    mkenv("MKERNEL_LOG", "1")
    L.configure()
    L.configure()
    assert sum(isinstance(h, L._EnvHandler) for h in L.log.handlers) == 1
    mkenv("MKERNEL_LOG", None)
    L.configure()
    assert not any(isinstance(h, L._EnvHandler) for h in L.log.handlers)
    mkenv("MKERNEL_LOG", "loud")
    with pytest.raises(ValueError, match="MKERNEL_LOG"):
        L.configure()
    mkenv("MKERNEL_LOG", None)
