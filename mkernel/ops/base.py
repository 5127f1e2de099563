"""The op pipeline: the one entry path every op goes through.

    prepare -> key lookup -> (miss: validate -> agree -> plan -> bind) -> run

* **prepare** (every call): the arguments become DeviceArrays through :mod:`mkernel.core.interop` (the
  cheapest route per Python type) and the stream a raw handle, once, at the entry; checks that depend
  on this call's pointers (overlaps) run here; the result is an op-specific *call* object whose ``key``
  holds everything the plan depends on except the pointers: shapes, strides, dtypes, alignment,
  devices, the options, the stream (and, for ops with workspaces, the context's workspace generation).
* **validate** (first call of a key): every check of the arguments; a clear exception before any launch.
* **compile** (first call of a key): the kernels the call will launch are compiled (or loaded from the
  disk cache) *before* the ranks agree, so a rank compiling for seconds delays the host exchange, which
  waits for it, and never a peer's device-side wait, which would time out.
* **agree** (first call of a key, ops across ranks): :class:`mkernel.dist.agreement.Agreement` -> the
  digest the kernels announce and compare on the device for every later call.
* **plan**: the op's decisions (path, tile config, chunking), inspectable as ``last_plan``.
* **bind**: a :class:`BoundCall` -- prepared launches, the buffers they use, zeroing before first use;
  its plan is logged (:func:`mkernel.core.log.plan_line`: DEBUG, INFO for a fallback).
* **run** (every call): the bound call is re-pointed at this call's arrays (tensor maps patched in
  place, pointer fields set) and submitted.

Bound calls live in the op's :class:`OpState`: a context's (``ctx.op_state(name)``) for ops across
ranks, a device's (:func:`device_state`) for single-GPU ops.  A bound call whose launches use buffers
of its own (staging copies, split-K sums) and that runs while its stream is being captured into a
CUDA graph is kept for the life of the process: the graph replays those buffers after the LRU may
have dropped the bound call.
"""
from __future__ import annotations

import threading

from ..core.log import plan_line
from ..core.streams import is_capturing, stream_handle
from ..dist.opstate import STATE_CAPACITY, OpState

__all__ = ["Op", "OpState", "BoundCall", "device_state", "pinned_calls", "STATE_CAPACITY", "as_stream",
           "options_hash", "checked_once", "byte_span", "check_no_overlap"]

_pinned: list = []
_pinned_lock = threading.Lock()


def pinned_calls() -> list:
    """Bound calls captured into CUDA graphs (kept for the life of the process)."""
    return list(_pinned)


class BoundCall:
    """An op call bound to one layout of its arguments.  Subclasses implement :meth:`run` (re-point at
    ``call``'s arrays and submit on ``stream``) and set ``plan`` (what ``last_plan`` reports),
    ``buffers`` (device memory the launches use) and ``clears`` (callables ``(stream, capturing)`` that
    zero some of it before first use)."""

    plan = None
    buffers: tuple = ()
    clears: tuple = ()
    pinned = False

    def run(self, stream: int, call) -> None:
        raise NotImplementedError

    def __call__(self, stream: int, call) -> None:
        if self.clears or (self.buffers and not self.pinned):
            capturing = is_capturing(stream)
            if capturing and self.buffers and not self.pinned:
                self.pinned = True
                with _pinned_lock:
                    _pinned.append(self)
            for clear in self.clears:
                clear(stream, capturing)
        self.run(stream, call)


_device_states: dict = {}
_device_states_lock = threading.Lock()


def device_state(name: str, device: int) -> OpState:
    """The state of single-GPU op ``name`` on ``device`` (created on first use)."""
    key = (name, device)
    st = _device_states.get(key)
    if st is None:
        with _device_states_lock:
            st = _device_states.setdefault(key, OpState(name))
    return st


class Op:
    """One op's stages.  Subclasses define ``name`` and the stage methods; ``invoke(state, call, ctx)``
    runs the pipeline for a prepared call (whose ``key`` and ``stream`` attributes it reads)."""

    name = "op"
    #: the call's key ends with ``ctx.workspace_generation`` (bound calls keep workspace pointers): a bind that
    #: grows a workspace files its bound call under the new generation, so the next call finds it
    generation_keyed = False

    def validate(self, ctx, call) -> None:
        """Every check of the arguments (first call of a key)."""

    def compile(self, ctx, call) -> None:
        """Compile (or load) the kernels the call will launch (first call of a key, before agree)."""

    def agree(self, ctx, call) -> int:
        """The call's digest across ranks (0 for single-GPU ops)."""
        return 0

    def plan(self, ctx, call, digest: int):
        raise NotImplementedError

    def bind(self, ctx, call, plan) -> BoundCall:
        raise NotImplementedError

    def describe_call(self, call) -> str:
        """The call's shapes and dtypes for the plan log line ("" when the plan says it all)."""
        return ""

    def invoke_bound(self, state: OpState, call) -> BoundCall | None:
        """Run the bound call of ``call.key`` on ``call`` and return it, or None where the key has none yet (an
        op's entry may try this before its checks: a key names a layout that was checked when it was bound)."""
        bound = state.get(call.key)
        return None if bound is None else _run(state, bound, call)

    def invoke(self, state: OpState, call, ctx=None) -> BoundCall:
        bound = state.get(call.key)
        if bound is None:
            self.validate(ctx, call)
            self.compile(ctx, call)
            digest = self.agree(ctx, call)
            bound = self.bind(ctx, call, self.plan(ctx, call, digest))
            key = call.key
            if self.generation_keyed:
                key = key[:-1] + (ctx.workspace_generation,)
            state.put(key, bound)
            plan_line(self.name, getattr(ctx, "rank", None), lambda: self.describe_call(call), bound.plan)
        return _run(state, bound, call)


def _run(state: OpState, bound: BoundCall, call) -> BoundCall:
    state.last_plan = bound.plan
    bound(call.stream, call)
    return bound


def as_stream(stream) -> int:
    """The raw handle of ``stream`` (converted once per call, at the entry)."""
    return stream if type(stream) is int else stream_handle(stream)


def options_hash(self) -> int:
    """``__hash__`` of an op's frozen options dataclass: its fields' hash, computed once (the options are
    part of every bound-call key).  A class opts in with ``__hash__ = options_hash``."""
    h = self.__dict__.get("_hash")
    if h is None:
        h = hash(tuple(getattr(self, f) for f in self.__dataclass_fields__))
        object.__setattr__(self, "_hash", h)
    return h


_checked: set = set()


def checked_once(options):
    """``options.checked()`` the first time options equal to these are seen (ValueError / TypeError naming
    the bad field), then free; returns ``options``."""
    try:
        if options in _checked:
            return options
    except TypeError:  # (an unhashable field: checked() names it)
        pass
    options.checked()
    if len(_checked) >= 1024:
        _checked.clear()
    _checked.add(options)
    return options


_extents: dict = {}


def byte_span(x) -> tuple[int, int]:
    """``[first byte, last byte + 1)`` that array ``x`` touches (a layout's offsets are computed once)."""
    key = (x.shape, x.strides, x.dtype.itemsize)
    ext = _extents.get(key)
    if ext is None:
        if 0 in x.shape:
            ext = (0, 0)
        else:
            lo = sum(min(0, (n - 1) * s) for n, s in zip(x.shape, x.strides))
            hi = sum(max(0, (n - 1) * s) for n, s in zip(x.shape, x.strides))
            ext = (lo * x.dtype.itemsize, (hi + 1) * x.dtype.itemsize)
        if len(_extents) < 4096:
            _extents[key] = ext
    return x.ptr + ext[0], x.ptr + ext[1]


def check_no_overlap(what: str, pairs) -> None:
    """Raise ValueError for the first ``(written, name, read, name)`` of ``pairs`` whose arrays share memory
    (None entries are skipped): a kernel reads its inputs while it writes its outputs."""
    spans: dict = {}  # (each array's span once: an array takes part in several pairs)
    for w, wn, r, rn in pairs:
        if w is None or r is None:
            continue
        sw = spans.get(id(w))
        if sw is None:
            sw = spans[id(w)] = byte_span(w)
        sr = spans.get(id(r))
        if sr is None:
            sr = spans[id(r)] = byte_span(r)
        (w0, w1), (r0, r1) = sw, sr
        if w0 < r1 and r0 < w1 and w0 < w1 and r0 < r1:  # (an empty array touches no byte)
            raise ValueError(f"{what}: {wn} overlaps {rn} (bytes 0x{w0:x}-0x{w1:x} and 0x{r0:x}-0x{r1:x}); the "
                             "kernel reads its inputs while it writes its outputs")
