"""Kernel chains: several ``@triton.jit`` kernels run one after the other as one fused group.

Public as part of the kernel-writing API (``autofuser.kernel``): the attention
chains (``plugins/attention/``) and the split reduction (``plugins/reduction/``)
write their stages with it.

A group's kernel module names one entry point, which the core launches as
``entry[grid](*inputs, *outputs, **config)`` - exactly how a ``@triton.jit``
function is launched. For a chain, the entry is a small host-side launcher
with that interface (and ``warmup``, to be compiled ahead of its first launch): it allocates the chain's
scratch buffers (partial
results or split operands, a few KiB to MiB), launches each stage with its own grid and ignores
the grid it is given. Tuning times the whole chain, and verification checks
its outputs, like any kernel's.

``stages(config)`` lists each stage's kernel with its argument types and
compile-time constants, so the chain can be compiled ahead of time for a GPU
without one (``tests/integration/test_gpu_compile.py``).
"""

from __future__ import annotations

import hashlib
import re
from typing import Optional, Sequence

import torch

from .codegen import cdiv_text

POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.bool: "*i1",
    torch.int32: "*i32",
}


def jit_function(name: str, params: list[str], blocks: list[str], lines: list[str]) -> str:
    signature = ", ".join(params + [f"{b}: tl.constexpr" for b in blocks])
    return f"@triton.jit\ndef {name}({signature}):\n" + "\n".join(lines) + "\n"


def chain_stages(
    names: list[str], sources, types: dict[str, str], sizes: Sequence[str] = ()
) -> tuple[list[str], list[dict]]:
    """A chain's ``@triton.jit`` functions and its stage descriptions (for ``chain_module``):
    ``sources`` is one ``(params, blocks, lines)`` per stage, ``types`` each pointer argument's type.
    ``sizes``: the chain's run-time sizes (``autofuser.kernel.sized``); each stage takes, after
    its pointers, those its lines use, and its description lists them (``sizes``)."""
    functions, stages = [], []
    for name, (params, blocks, lines) in zip(names, sources):
        text = "\n".join(lines)
        used = [s for s in sizes if re.search(rf"\b{s}\b", text)]
        functions.append(jit_function(name, params + used, blocks, lines))
        stage = {"name": name, "pointers": {p: types[p] for p in params}, "constexprs": {b: b for b in blocks}}
        if used:  # only then: a chain without run-time sizes keeps its text
            stage["sizes"] = used
        stages.append(stage)
    return functions, stages


def split_chunk(points: int, splits: str = "SPLITS", block: str = "BLOCK_N") -> str:
    """The points each of ``splits`` splits covers, in whole blocks: an expression over the
    launcher's arguments (or, with other names, over a config)."""
    return f"{cdiv_text(cdiv_text(str(points), splits), block)} * {block}"


def chain_digest(*parts: str) -> str:
    """A short stable hash of a chain's parts, for its name: a process reuses a loaded
    module by its name, so everything the launcher runs must go into it."""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:10]


def chain_module(
    header: str,
    helper_text: str,
    functions: list[str],
    entry: str,
    launch_lines: list[str],
    signature: str,
    stages: list[dict],
    derived: Optional[dict[str, str]] = None,
    tensor_names: tuple[str, ...] = (),
) -> str:
    """The module text: the kernels, then the launcher ``entry``.

    ``launch_lines`` is the body of ``launch(self, <signature>)``; ``stages``
    (one dict per kernel: ``name``, ``pointers`` {argument: type}, ``constexprs``
    {name: the name of a config key}) becomes ``stages(config)``; ``derived``
    adds keys computed from the config (Python expressions over ``config``).
    ``tensor_names``: the entry's tensor arguments in call order (inputs, then
    outputs), for ``warmup``; a scratch buffer's type is its stage's pointer type (``_DTYPES``).
    """
    derive = "".join(f"        config[{k!r}] = {v}\n" for k, v in (derived or {}).items())
    body = "\n".join("        " + line for line in launch_lines)
    return (
        f"{header}\nimport torch\nimport triton\nimport triton.language as tl\n\n"
        + f"_DTYPES = {{{', '.join(f'{kind!r}: {dtype}' for dtype, kind in POINTER_TYPES.items())}}}"
        + "  # for warmup\n\n\n"
        + (helper_text + "\n\n\n" if helper_text else "")
        + "\n\n".join(functions)
        + "\n\nclass _Chain:\n"
        + f'    """Launches the chain {", ".join(s["name"] for s in stages)}; '
        f'indexed like a kernel, the grid unused."""\n\n'
        + "    def __getitem__(self, grid):\n        return self.launch\n\n"
        + f"    def launch(self, {signature}):\n{body}\n\n"
        + "    def stages(self, config):\n"
        + "        config = dict(config)\n"
        + derive
        + f"        stages = {stages!r}\n"
        + "        return [dict(s, constexprs={k: config[v] for k, v in s['constexprs'].items()}) for s in stages]\n\n"
        + "    def warmup(self, *dtypes, grid, **config):\n"
        + '        """Compile every stage without launching it (the precompile step)."""\n'
        + "        names = "
        + repr(tensor_names)
        + "\n"
        + "        given = dict(zip(names, dtypes))\n"
        + "        for stage in self.stages(config):\n"
        + "            fn = globals()[stage['name']]\n"
        + "            args = [given.get(name) or _DTYPES[kind] for name, kind in stage['pointers'].items()]\n"
        + (
            "            args += [config[name] for name in stage.get('sizes', ())]  # run-time sizes\n"
            if any("sizes" in s for s in stages)
            else ""
        )
        + "            fn.warmup(*args, grid=(1,), num_warps=config.get('num_warps', 4),\n"
        + "                      num_stages=config.get('num_stages', 2), **stage['constexprs'])\n\n\n"
        + f"{entry} = _Chain()\n"
    )
