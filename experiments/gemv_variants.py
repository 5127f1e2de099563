#!/usr/bin/env python
"""Probe: decode-kernel variants against cuBLAS.  A variant is a mkernel/ops/gemm/gemv.py VARIANTS entry for the
shape's column-tile count written with dots (``4.3`` = 4 K chunks a run, registers for 3 blocks per
SM; ``default`` = the shipped entry).  Each shape is routed to the decode kernel whatever the routing
thresholds, each variant's plan built afresh, timed as CUDA graphs of bench/gemm.py's runners with ours
and cuBLAS alternating; one line per shape: median us of each variant, ours / cuBLAS, and the error.

    python experiments/gemv_variants.py 1x8192x8192,16x8192x8192 8 default,4.3,8.2

Shapes: MxNxK, or NAME@M of bench/gemm.py's tables (tools/gemm_profile.py's specs).

(docs/journal/gemm.md entries 48-51 ran it with the extra fields of their experimental kernels.)
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tools"), str(ROOT)]  # _common, gemm; gemm_profile; the package

from _common import setup_env, time_interleaved  # noqa: E402


def main(argv):
    shapes, rounds, variants = argv[0], int(argv[1]), argv[2]
    setup_env()
    import torch
    from gemm import GemmProblem
    from gemm_profile import parse

    from mkernel.ops import base as BASE
    from mkernel.ops import gemm as G
    from mkernel.ops.gemm import gemv as GV

    GV.MIN_BLOCK_FILL = 0.0
    GV.ROUTE_MAX_TILE_FILL = float("inf")
    shipped = dict(GV.VARIANTS)
    torch.empty(1, device="cuda")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for spec in shapes.split(","):
        _, M, N, K = parse(spec)
        prob = GemmProblem(M, N, K, l2)
        nt = GV.column_tiles(M)
        res = []
        for v in variants.split(","):
            GV.VARIANTS.clear()
            GV.VARIANTS.update(shipped)
            if v != "default":
                GV.VARIANTS[nt] = tuple(int(x) for x in v.split("."))
            BASE._device_states.clear()

            try:
                ro = prob.runner(lambda i: prob.ours(i, torch.cuda.current_stream()))
            except Exception as exc:  # a variant that does not compile or launch: say so, go on
                res.append(f"{v} ERR {exc!s:.80}")
                continue
            plan = G.last_plan()
            torch.cuda.synchronize()
            err = prob.error()
            time.sleep(0.2)
            st = time_interleaved({"ours": ro, "cublas": prob.cublas}, warmup=0, rounds=rounds)
            so = statistics.median(st["ours"]["samples"]) / prob.batch * 1e3
            sc = statistics.median(st["cublas"]["samples"]) / prob.batch * 1e3
            res.append(f"{v}{'' if isinstance(plan, GV.Plan) else ' (NOT gemv)'} {so:.1f}/{sc:.1f} e{err:.0e}")
        GV.VARIANTS.clear()
        GV.VARIANTS.update(shipped)
        print(spec, " | ".join(res), flush=True)
        del prob
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        sys.exit(print(__doc__))
    main(sys.argv[1:])
