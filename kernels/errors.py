"""The error the kernel sets raise, so ``kernels/`` imports nothing from the layers above it."""

from __future__ import annotations


class KernelError(ValueError):
    """A kernel cannot run what it was given: arguments of the wrong shape, dtype or device,
    or (Metal) a shader that does not compile for the dtype asked for.

    A ``ValueError`` because it is nearly always the arguments that are wrong. The backends
    that run a kernel set turn it into their ``BackendError`` where a step crosses into
    the kernels (``backends.cuda.backend.DeviceRunner.forward``), so callers of a backend
    see one error type whatever kernel set it runs.
    """
