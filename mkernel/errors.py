"""Exceptions raised by mkernel."""
from __future__ import annotations

__all__ = ["MkernelError", "CudaError", "DeviceError", "CompileError", "CommTimeout", "CommError", "CommMismatch"]


class MkernelError(RuntimeError):
    """Base class of every error mkernel raises on purpose."""


class CudaError(MkernelError):
    """A CUDA driver or NVRTC call failed."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class DeviceError(MkernelError):
    """No usable GPU for what was asked: no NVIDIA driver, a driver too old for CUDA 13, no visible GPU,
    or a GPU whose architecture the op does not run on (the message names the op, the device's compute
    capability and what is supported).  Raised before any kernel is compiled or launched."""


class CompileError(MkernelError):
    """NVRTC rejected a kernel; ``log`` holds the compiler's output."""

    def __init__(self, source: str, defines: dict, arch: str, log: str):
        super().__init__(f"NVRTC failed to compile {source} for {arch} with {defines}:\n{log}")
        self.source, self.defines, self.arch, self.log = source, defines, arch, log


class CommError(MkernelError):
    """A communication kernel reported a failure (see ``record``)."""

    def __init__(self, message: str, record: dict | None = None):
        super().__init__(message)
        self.record = record or {}


class CommTimeout(CommError):
    """A device-side wait expired: a peer never raised the flag this rank waited on.

    ``record`` holds what the kernel wrote: ``rank`` (who waited), ``op``, ``peer`` (whom it waited
    for), ``flag_index``, ``expected`` and ``seen`` flag values and ``waited_ns``.
    """


class CommMismatch(CommError):
    """A peer made a different call in the same position of the call sequence (op, dtype or sizes):
    caught on the device, from the call signature every rank announces to its peers before any data
    is read.  ``record``: ``rank``, ``op``, ``peer``, ``expected`` (this rank's signature) and ``seen``
    (the peer's).  The communicator is no longer usable."""
