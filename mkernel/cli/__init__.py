"""The command line, ``python -m mkernel``:

* ``precompile [--ops gemm,collectives,...] [--arch sm_90a] [--workers N]``: compile the kernels the ops
  can launch into the disk cache (:mod:`.precompile`), for cluster prologues and images;
* ``info``: what this machine offers mkernel (:mod:`.info`).
"""
from __future__ import annotations

import argparse

__all__ = ["main"]


def main(argv=None) -> int:
    from . import info, precompile

    parser = argparse.ArgumentParser(prog="python -m mkernel", description="mkernel's command line")
    sub = parser.add_subparsers(dest="command", required=True)
    precompile.add_parser(sub)
    info.add_parser(sub)
    args = parser.parse_args(argv)
    return args.run(args)
