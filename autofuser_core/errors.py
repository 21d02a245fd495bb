"""Exceptions raised by AutoFuser.

Every error names what was wrong and how to fix it; the classes let callers
catch one family without parsing messages.
"""


class AutoFuserError(Exception):
    """Base class of every error AutoFuser raises on purpose."""


class PluginError(AutoFuserError):
    """A plugin could not be loaded, or broke a rule of the hook protocol."""


class SpecError(PluginError):
    """A plugin registered a spec that failed validation, or clashes with another."""


class CaptureError(AutoFuserError):
    """The model or its inputs cannot be captured (wrong arguments, not a module)."""


class OpaquePartError(CaptureError):
    """With ``fuse(..., fullgraph=True)``: a part of the model could not be traced and
    would run as it is, unfused. The message names each such part and why."""


class CacheError(AutoFuserError):
    """A cache entry is unusable (corrupt, foreign, or written for another key)."""


class CompileFailedWarning(UserWarning):
    """Compiling one input signature failed inside AutoFuser (a bug, or a device fault):
    that signature runs the original model. The test suite turns it into an error."""


class NoKernelsWarning(UserWarning):
    """No kernel can run in this process (no CUDA device and no Triton interpreter, or
    the interpreter switched on after Triton was imported): every group stays eager.
    Shown once per cause, with the fix."""
