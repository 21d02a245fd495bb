"""Whether this process can run Triton kernels, and Triton's CPU interpreter.

Triton decides between the GPU backend and its CPU interpreter once per kernel,
when ``@triton.jit`` decorates it, from ``TRITON_INTERPRET`` as it is at that
moment. Triton's own library functions (``tl.sum``, ``tl.sigmoid``, ...) are
decorated when Triton is imported, a plugin's kernels when the plugin is, the
kernels AutoFuser writes when a group is compiled; if the variable changed in
between (set after Triton was imported), the two kinds can't call each other
and every group fails. Without a GPU and without the interpreter nothing can
run at all. Either way every group would stay eager; this module says so once,
loudly, with the fix (``check_kernels_can_run``), and turns the interpreter on
by itself where that is still safe (``arrange_interpreter``).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Iterable, Optional

import torch

from .errors import NoKernelsWarning
from .rounding import interpreting

#: The fix, as a user applies it: the variable is read when kernels are decorated.
FIX = (
    "set TRITON_INTERPRET=1 before Triton is imported - in the shell (`TRITON_INTERPRET=1 python "
    "your_script.py`) or as the first lines of the script (`import os; os.environ['TRITON_INTERPRET'] "
    "= '1'` before any `import autofuser`, `import triton` or library that imports Triton)"
)

#: Where ``cache.load_kernel_module`` files the kernel modules it imports.
KERNEL_PACKAGE = "autofuser_kernels"

_warned: set[str] = set()


def arrange_interpreter() -> bool:
    """Turn Triton's interpreter on for this process when it has no CUDA device, the user
    left ``TRITON_INTERPRET`` unset and no kernel has been decorated yet (in practice:
    Triton is not imported yet, since importing it decorates its library). True if it did."""
    if "TRITON_INTERPRET" in os.environ or torch.cuda.is_available():
        return False
    if kernels_decorated():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True


def kernels_decorated() -> bool:
    """Whether any imported module holds a ``@triton.jit`` kernel (for either backend):
    from then on, changing ``TRITON_INTERPRET`` splits kernels between the two."""
    return any(_jit_kinds(None))


def _jit_kinds(modules: Optional[Iterable[object]]) -> tuple[bool, bool]:
    """(any interpreted kernel, any GPU kernel) among the globals of ``modules`` (modules or
    their names) and of their submodules already imported; of every imported module where
    ``modules`` is None."""
    if "triton" not in sys.modules:
        return False, False
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    names = None if modules is None else {m if isinstance(m, str) else getattr(m, "__name__", "") for m in modules}
    names = None if names is None else names - {""}
    interpreted = gpu = False
    with warnings.catch_warnings():
        # Looking at every global touches deprecated aliases (torch.distributed.reduce_op).
        warnings.simplefilter("ignore")
        for module_name, module in list(sys.modules.items()):
            if module is None:
                continue
            if names is not None and not any(module_name == n or module_name.startswith(f"{n}.") for n in names):
                continue
            for value in list(getattr(module, "__dict__", {}).values()):
                interpreted = interpreted or isinstance(value, InterpretedFunction)
                gpu = gpu or isinstance(value, JITFunction)
            if interpreted and gpu:
                break
    return interpreted, gpu


def kernels_cannot_run(device: torch.device, plugin_modules: Iterable[object]) -> Optional[tuple[str, str]]:
    """``(reason_code, message)`` when no kernel of a group on ``device`` could run in this
    process, else None: no CUDA device and no interpreter (``no_device``), or the plugins'
    kernels decorated for the other backend than the one kernels get now
    (``interpreter_mismatch``)."""
    if device.type != "cuda" and not interpreting():
        return (
            "no_device",
            f"no CUDA device for the model's {device.type} tensors and TRITON_INTERPRET is not 1, so "
            f"Triton can't run AutoFuser's kernels and nothing is fused. To run them on the CPU under "
            f"Triton's interpreter, {FIX}",
        )
    # Triton's library, the plugins' own kernels, and those AutoFuser wrote and imported
    # earlier in this process (kept under KERNEL_PACKAGE and reused for the same source).
    interpreted, gpu = _jit_kinds(["triton.language", *plugin_modules, KERNEL_PACKAGE])
    if interpreting() and gpu:
        return (
            "interpreter_mismatch",
            "TRITON_INTERPRET=1 was set after Triton was imported: the plugins' kernels were built "
            "for the GPU and the new ones would be interpreted, so they can't call each other and "
            f"nothing is fused. {FIX[0].upper()}{FIX[1:]}",
        )
    if not interpreting() and interpreted:
        return (
            "interpreter_mismatch",
            "TRITON_INTERPRET was 1 when the plugins were imported and is not now: their kernels are "
            "interpreted and the new ones would not be, so nothing is fused. Keep TRITON_INTERPRET as "
            "it was when Triton was first imported (set it once, before any import)",
        )
    return None


def warn_once(message: str) -> None:
    """``message`` as a ``NoKernelsWarning``, the first time it comes in this process."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(f"AutoFuser: {message}", NoKernelsWarning, stacklevel=2)
