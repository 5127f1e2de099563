"""One op's state in one place: what a context (or, for single-GPU ops, a device) keeps for an op --
its bound calls, the plan of its latest call, and whatever else the op owns.  mkernel/ops/base.py's
pipeline fills it; the context only holds and clears it."""
from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["OpState", "STATE_CAPACITY"]

STATE_CAPACITY = 64  # bound calls kept per op state (least recently used dropped first)


class OpState:
    """One op's state in one place.  ``calls``: bound calls by key (LRU of ``capacity``); ``last_plan``:
    the plan of the latest call; ``data``: whatever else the op keeps (workspaces, agreed signatures,
    side structures), owned by the op."""

    __slots__ = ("name", "calls", "capacity", "last_plan", "data", "lock")

    def __init__(self, name: str, capacity: int = STATE_CAPACITY):
        self.name, self.capacity = name, capacity
        self.calls: OrderedDict = OrderedDict()
        self.last_plan = None
        self.data: dict = {}
        self.lock = threading.Lock()

    def get(self, key):
        b = self.calls.get(key)
        if b is not None:
            self.calls.move_to_end(key)
        return b

    def put(self, key, bound) -> None:
        with self.lock:
            self.calls[key] = bound
            while len(self.calls) > self.capacity:
                self.calls.popitem(last=False)

    def clear(self) -> None:
        with self.lock:
            self.calls.clear()
            self.data.clear()
            self.last_plan = None
