"""The benchmarks' host-side helpers on the CPU: the GPU-side delay that keeps the host's submission
out of a timed interval, and the AllGather+GEMM report's table (no GPU, no torch)."""
from __future__ import annotations

import importlib
import json
import statistics
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
EXPERIMENTS = ROOT / "experiments"  # the probes and plan tables (gemm_plan_table, gemm_heuristic_replay)


@pytest.fixture()
def bench_path(monkeypatch):
    """bench/ and experiments/ importable; the environment the benches set at import restored afterwards."""
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    monkeypatch.syspath_prepend(str(BENCH))
    for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):
        monkeypatch.setenv(var, os.environ.get(var, ""))


@pytest.fixture()
def bench_modules(bench_path):
    common = importlib.import_module("_common")
    ag = importlib.import_module("ag_gemm")
    yield common, ag
    sys.modules.pop("ag_gemm", None)


def test_gpu_lead_outlasts_the_submission(bench_modules):
    common, _ = bench_modules
    # 2x the batch's submission time, at least 50 us, in cycles of a 2 GHz clock
    assert common.gpu_lead_cycles(0.0) == 100_000
    assert common.gpu_lead_cycles(0.07) == 280_000
    assert common.gpu_lead_cycles(1.0, clock_ghz=1.5) == 3_000_000


def test_ag_gemm_report_shows_host_time(bench_modules, tmp_path):
    _, ag = bench_modules
    rec = {"name": "sweep M=K", "M": 16384, "N_per_rank": 1024, "K": 16384, "nccl_ms": 1.8, "symm_ms": 1.5,
           "gemm_ms": 0.76, "allgather_ms": 0.83, "floor_ms": 0.83, "ours_ms": 0.87, "ours_tflops": 630.0,
           "speedup_vs_nccl": 2.07, "speedup_vs_symm": 1.72, "overlap_eff": 0.954, "nccl_host_ms": 0.021,
           "ours_host_ms": 0.068, "forced_ms": 1.7, "forced_path": "unfused",
           "plan": {"path": "fused_ce", "comm_sms": 0, "pred_fused_ms": 0.86}}
    meta = {"P": 2, "gpu": "GPU", "date": "today", "torch": "t", "nccl": "n", "quick": False, "elapsed_s": 1.0}
    text = ag.report([rec], meta, tmp_path)
    row = next(line for line in text.splitlines() if line.startswith("| sweep M=K"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-1] == "21 / 68"  # host us per call, (a) / (d)
    assert "0.95" in cells and "fused_ce (0)" in cells
    assert "GPU-side delay" in text
    assert (tmp_path / "ag_gemm_bench.json").exists()


def test_time_interleaved_agrees_on_the_lead(bench_modules, monkeypatch):
    """Collective methods: every rank sleeps the agreed delay (here the max a fake allgather sees),
    not its own, so no rank's first timed call waits for a peer that started later."""
    common, _ = bench_modules
    slept = []

    class Event:
        def __init__(self, **kw):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 1.0

    class Cuda:
        @staticmethod
        def synchronize():
            pass

        @staticmethod
        def _sleep(cycles):
            slept.append(cycles)

    fake = type(sys)("torch")
    fake.cuda = Cuda
    Cuda.Event = Event
    monkeypatch.setitem(sys.modules, "torch", fake)
    seen = []

    def agree(v):
        seen.append(v)
        return max(v, 7_000_000)  # a slower peer's delay
    out = common.time_interleaved({"a": lambda: None, "b": lambda: None}, warmup=1, rounds=2, batch=4,
                                  host_lead=True, agree=agree)
    assert len(seen) == 2 and all(v < 7_000_000 for v in seen)  # each method's own delay, offered once
    assert slept == [7_000_000] * 4 and out["a"]["median_ms"] == 0.25


def test_round_order(bench_modules):
    """rotate: round r starts at method r; shuffle: a permutation of every method, the same for a round on
    every call (ranks agree), not the same in every round."""
    common, _ = bench_modules
    assert common.round_order(4, 1) == [1, 2, 3, 0] and common.round_order(4, 5) == [1, 2, 3, 0]
    orders = [common.round_order(30, r, "shuffle") for r in range(5)]
    assert all(sorted(o) == list(range(30)) for o in orders)
    assert orders[2] == common.round_order(30, 2, "shuffle") and len({tuple(o) for o in orders}) == 5


def test_ag_gemm_paths_option(bench_modules):
    _, ag = bench_modules
    paths = ("fused", "fused_ce", "unfused")
    assert ag.path_kwargs("fused_ce", paths) == {"path": "fused_ce"}
    assert ag.path_kwargs("fused@16", paths) == {"comm_sms": 16}
    for bad in ("fused@", "fused@x", "ce", "fused@-1"):
        with pytest.raises(ValueError, match="--paths"):
            ag.path_kwargs(bad, paths)


def test_gemm_bench_decode_rows_summarized_apart(monkeypatch):
    """bench/gemm.py's full run: the 70 target shapes (5 squares, 13 weights x 5 M) plus decode rows
    (M 1/4/8/16 x six weights); the report's target line ignores the decode rows, which get a line of
    their own naming the weakest."""
    monkeypatch.syspath_prepend(str(BENCH))
    gb = importlib.import_module("gemm")
    try:
        full = gb.shapes(False)
        dec = [s for s in full if gb.is_decode(s[0])]
        assert len(full) - len(dec) == 70 and len(dec) == len(gb.DECODE_MS) * len(gb.DECODE_WEIGHTS) == 24
        assert all(s[1] <= 16 and s[4] == "nk" for s in dec)
        assert not any(gb.is_decode(s[0]) for s in gb.shapes(True))
        rows = [dict(name="square4096", M=4096, ratio=1.02), dict(name="dsv3.q_a", M=512, ratio=0.91),
                dict(name="decode:dsv3.o", M=1, ratio=0.5), dict(name="decode:llama70b.o", M=16, ratio=1.2)]
        lines = gb.summary(rows)
        assert lines[0].startswith("Ratio to cuBLAS:") and "min 0.91" in lines[0] and "squares >= 4096: min 1.02" in lines[0]
        assert "Decode-shaped rows (M <= 16" in lines[1] and "min 0.50 (dsv3.o M=1)" in lines[1]
        assert gb.summary(rows[:2])[1:] == []
        assert gb.tile_label(dict(config="gemv", bm=16, bn=16)) == "gemv 16x16"
        assert gb.tile_label(dict(config=3, bm=128, bn=256, stages=4, pingpong=False, splits=2)) == "128x256x64/4st split 2"
        assert gb.tile_label(dict(config=53, bm=64, bn=16, stages=16, pingpong=False, splits=1,
                                  swapped=True)) == "T 64x16x64/16st"
    finally:
        sys.modules.pop("gemm", None)


def test_gemm_random_shapes_and_report(bench_path, tmp_path):
    """bench/gemm_random.py: the same seed gives the same shapes (bf16 rows of N and K a 16-byte multiple),
    misaligned rows are told apart, and --replot writes the table (and the plot, where matplotlib is)."""
    gr = importlib.import_module("gemm_random")
    a, b = gr.shapes(5, 30), gr.shapes(5, 30)
    assert a == b and a != gr.shapes(6, 30)
    assert all(n % 8 == 0 and k % 8 == 0 and lay in ("kn", "nk") and pad % 8 == 0 for _, n, k, lay, pad in a)
    row = dict(M=64, N=64, K=72, layout="kn", pad=0)
    assert gr.misaligned(row) and not gr.misaligned(dict(row, K=64)) and gr.misaligned(dict(row, K=64, pad=8))
    assert gr.misaligned(dict(row, K=64, N=72)) and not gr.misaligned(dict(row, K=64, N=72, layout="nk"))
    rows = [dict(M=m, N=n, K=k, layout=lay, pad=p, plan="c3x1", err=1e-4, ours_us=10.0, cublas_us=9.0, ratio=0.9)
            for m, n, k, lay, p in a[:4]]
    pytest.importorskip("matplotlib")
    gr.write(tmp_path, 5, rows, "test GPU")
    md = (tmp_path / "gemm_random_5.md").read_text()
    assert "seed 5: 4 shapes, geometric mean 0.90x cuBLAS" in md and md.count("| c3x1 |") == 4
    assert (tmp_path / "gemm_random_5.png").stat().st_size > 0
    assert gr.main(["--replot", str(tmp_path / "gemm_random_5.json"), "--out", str(tmp_path / "re")]) == 0
    assert (tmp_path / "re" / "gemm_random_5.md").read_text() == md


@pytest.mark.parametrize("name,shapes,min_judged", [("gemm_plans_20261201.json", 37, 24),
                                                   ("gemm_plans_20261202.json", 58, 54)])
def test_heuristic_replay_on_the_measured_plan_table(bench_path, name, shapes, min_judged):
    """experiments/gemm_heuristic_replay.py on the measured plan tables in docs/journal/results/ (every plan of each shape, timed
    on an H200): today's heuristic picks within 3.5 % of the best measured plan in geometric mean.
    20261201 (37 shapes, no cluster pairs measured): 1.045 before entry 62, 1.020 after, 1.019 with entry
    64's pairs (a pick the table has no time for is not judged); 20261202 (the pairs and quads
    measured, 58 shapes): 1.073 / 1.081 before entry 64 on its first 44 / last 14, 1.023 / 1.037 after.  A model change that loses this fails."""
    replay = importlib.import_module("gemm_heuristic_replay")
    table = json.loads((ROOT / "docs" / "journal" / "results" / name).read_text())
    res = replay.replay(table["rows"])
    judged = [(t, tb) for _, _, t, _, tb in res if t is not None]
    assert len(res) == shapes and len(judged) >= min_judged
    regret = statistics.geometric_mean([t / tb for t, tb in judged])
    assert regret <= 1.035, f"geometric-mean regret {regret:.3f}"
    from mkernel.ops.gemm import misaligned_rows
    assert misaligned_rows(8, 64, 4120, "nk") == (True, True) and misaligned_rows(8, 4120, 64, "kn") == (False, True)
    assert misaligned_rows(8, 72, 64, "kn", pad=8) == (True, False) and misaligned_rows(8, 64, 64, "nk") == (False, False)
    # an operand of one row has no row stride (as row_misaligned: rows > 1)
    assert misaligned_rows(1, 64, 4120, "nk") == (False, True) and misaligned_rows(8, 1, 4120, "nk") == (True, False)
    assert misaligned_rows(1, 72, 1, "kn") == (False, False)


def test_plan_table_shape_specs(bench_path):
    pt = importlib.import_module("gemm_plan_table")
    assert pt.parse_shape("325x4584x4184") == (325, 4584, 4184, "nk", 0)
    assert pt.parse_shape("9916x216x6512:kn+64") == (9916, 216, 6512, "kn", 64)

    class P:  # a GemmPlan's fields plan_label reads
        kind, config, splits, split_from, dependent, swapped = "tiles", 18, 5, 132, True, False
    assert pt.plan_label(P()) == "c18x5f132p"
    P.splits, P.dependent = 1, False
    assert pt.plan_label(P()) == "c18x1"
    P.swapped = True
    assert pt.plan_label(P()) == "s18x1"
    P.kind = "gemv"
    assert pt.plan_label(P()) == "gemv"
