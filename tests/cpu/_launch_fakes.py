"""A fake of mkernel.core.launch's compiled kernel for host-plan tests: every submitted launch is logged."""
from __future__ import annotations


class LoggedKernel:
    """Stands in for ``kernel(source, defines, name)``: ``prepare(...).submit()`` appends
    ``dict(kind="launch", defines, name, grid, block, args, **kw)`` to ``log``; one block per SM fits."""

    def __init__(self, log: list, defines, name: str):
        self.log, self.defines, self.name = log, defines, name

    def max_active_blocks_per_sm(self, threads, smem=0):
        return 1

    def prepare(self, grid, block, args, **kw):
        log, defines, name = self.log, self.defines, self.name

        class Launch:
            def submit(self):
                log.append(dict(kind="launch", defines=defines, name=name, grid=grid, block=block, args=list(args),
                                **kw))
        return Launch()
