#!/usr/bin/env python
"""Replay mkernel.gemm's heuristic on measured plan tables (experiments/gemm_plan_table.py --json): no GPU.

    python experiments/gemm_heuristic_replay.py TABLE.json [TABLE.json ...] [-v]

For every shape of the tables: the plan the heuristic picks today (mkernel.ops.gemm.auto_plan, with the
shape's operand-row alignment), its measured time where the table has that plan, the best measured plan,
and the ratio of the two (the pick's regret).  Prints the geometric-mean regret, the worst one, the
geometric mean of cuBLAS time / the pick's, and how many shapes the table could not judge (a pick it has
no measurement of, e.g. a last-wave split).  A change to the heuristic's model can be checked here against
every plan of every measured shape before any device time is spent (docs/journal/gemm.md entry 62).
"""
from __future__ import annotations

import json
import sys
from statistics import geometric_mean
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _clean(label: str) -> str:
    return label.split(" ")[0].rstrip("p")


def replay(rows, sms: int = 132):
    """Per shape: (row, pick label, pick us or None, best label, best us)."""
    from mkernel.ops import gemm as G

    out = []
    for r in rows:
        mis = G.misaligned_rows(r["M"], r["N"], r["K"], r["layout"], pad=r["pad"])
        cfg, sp, sf = G.auto_plan(r["M"], r["N"], r["K"], r["layout"], sms, None, mis)
        pick = f"c{cfg.id}x{sp}" + (f"f{sf}" if sp != 1 and sf else "")
        measured = {}
        for _, (label, us) in r["plans"].items():
            if " ERR" not in label:
                measured.setdefault(_clean(label), []).append(us)
        times = {k: min(v) for k, v in measured.items()}
        best = min(times, key=times.get)
        out.append((r, pick, times.get(pick), best, times[best]))
    return out


def main(argv):
    verbose = "-v" in argv
    rows = [r for f in argv if f != "-v" for r in json.loads(Path(f).read_text())["rows"]]
    res = replay(rows)
    judged = [x for x in res if x[2] is not None]
    for r, pick, t, best, tb in res:
        if verbose or t is None or t / tb > 1.1:
            shape = f"{r['M']}x{r['N']}x{r['K']}:{r['layout']}+{r['pad']}"
            got = f"{t:.1f} us, regret {t / tb:.2f}" if t is not None else "not in the table"
            print(f"{shape:<24} pick {pick:<10} {got}; best {best} {tb:.1f}; cuBLAS {r['cublas']:.1f}")
    regrets = [t / tb for _, _, t, _, tb in judged]
    print(f"{len(judged)} of {len(res)} shapes judged: regret geometric mean {geometric_mean(regrets):.3f}, max "
          f"{max(regrets):.2f}; cuBLAS / pick geometric mean {geometric_mean([r['cublas'] / t for r, _, t, _, _ in judged]):.3f}")
    return 0


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        sys.exit(print(__doc__))
    sys.exit(main(sys.argv[1:]))
