"""Record what the zoo's tiny models compute fused under Triton's interpreter.

Run to re-record after an intended numeric change::

    python tests/record_zoo_outputs.py

It rewrites ``tests/data/zoo_outputs.json``, which ``tests/integration/test_zoo_outputs.py``
compares the current code against. For each case of ``CASES`` (a zoo model at
its tiny configuration, with the plugins named there on top of the bundled
ones) it builds the model with a fixed seed in eval mode, fuses it
(``autofuser.fuse(model, progress=False)``), runs it without gradients on the
tiny test batch of ``tests/_models.tiny_input`` and records:

- ``fused`` and ``eager``: a summary of the output (``summarize``): shape, dtype
  and, up to ``SMALL`` elements, the values themselves; past that, the sum, the
  sum of absolute values, the largest magnitude and ``SAMPLES`` elements at
  fixed, evenly spaced positions;
- ``groups``: the fused groups of the report, in order, each as its strategy
  and its ops, with the largest error verification measured against eager
  (``max_error``: not compared, it only points at the group to look at when
  an output changes).

Values are written with 9 significant digits, enough to give back every fp32
value exactly. Kernels run on the CPU: the interpreter is switched on here
(before Triton is imported) and only the bundled plugins load unless a case
names more.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("AUTOFUSER_DISABLE_PLUGIN_AUTOLOAD", "1")
if "AUTOFUSER_CACHE_DIR" not in os.environ:  # a new one, removed at exit: the record starts cold
    os.environ["AUTOFUSER_CACHE_DIR"] = tempfile.mkdtemp(prefix="autofuser-zoo-record-")
    atexit.register(shutil.rmtree, os.environ["AUTOFUSER_CACHE_DIR"], ignore_errors=True)

import torch  # noqa: E402

import autofuser  # noqa: E402
from autofuser_core.plugins import load_plugins  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import MODELS, tiny_input  # noqa: E402  (the zoo's registry, wherever the zoo lives)

RECORD = Path(__file__).resolve().parent / "data" / "zoo_outputs.json"

#: (case name, zoo model, plugins loaded on top of the bundled ones).
CASES: list[tuple[str, str, tuple[str, ...]]] = [
    ("galerkin", "galerkin", ()),
    ("transformer", "transformer", ()),
    ("transolver", "transolver", ()),
    ("gnot", "gnot", ()),
    ("factformer", "factformer", ()),
    ("fno", "fno", ()),
    ("fno+fft", "fno", ("fft",)),
    ("ffno", "ffno", ()),
    ("unet", "unet", ()),
    ("lsm", "lsm", ()),
    ("ufno", "ufno", ()),
    ("upt", "upt", ()),
]

SMALL = 2000  # outputs with fewer elements are recorded whole
SAMPLES = 64  # elements recorded from larger outputs
DIGITS = 9  # significant digits: every fp32 value round-trips
SEED = 0


def _round(value: float) -> float:
    return float(f"{value:.{DIGITS}g}")


def summarize(out: torch.Tensor) -> dict:
    """Shape, dtype and the values (or, past ``SMALL`` elements, sums and samples) of ``out``."""
    flat = out.detach().reshape(-1).double().cpu()
    summary = {"shape": list(out.shape), "dtype": str(out.dtype).removeprefix("torch.")}
    if flat.numel() < SMALL:
        summary["values"] = [_round(v) for v in flat.tolist()]
        return summary
    positions = torch.linspace(0, flat.numel() - 1, SAMPLES).round().long()
    summary.update(
        sum=_round(flat.sum().item()),
        abs_sum=_round(flat.abs().sum().item()),
        max_abs=_round(flat.abs().max().item()),
        positions=positions.tolist(),
        samples=[_round(v) for v in flat[positions].tolist()],
    )
    return summary


def _plugins(extra: tuple[str, ...]):
    """``None`` (the default plugin set) or the default plugins' names followed by ``extra``."""
    if not extra:
        return None
    with torch.random.fork_rng(devices=[]):
        return load_plugins(None).names + list(extra)


def compute(case: str) -> dict:
    """Everything recorded for case ``case`` of ``CASES``, computed with the current code."""
    _, name, extra = next(c for c in CASES if c[0] == case)
    torch.manual_seed(SEED)
    model = MODELS[name].make("tiny").eval()
    x = tiny_input(name, seed=SEED)
    with torch.no_grad():
        eager = model(x)
        fused = autofuser.fuse(model, plugins=_plugins(extra), progress=False)
        got = fused(x)
    return {
        "model": name,
        "plugins": list(extra),
        "fused": summarize(got),
        "eager": summarize(eager),
        "groups": [
            {
                "strategy": g.strategy,
                "ops": list(g.ops),
                "max_error": None if g.max_error is None else _round(g.max_error),
            }
            for g in fused.report().fused
        ],
    }


def _dumps(record: dict) -> str:
    """``record`` as JSON, one line per group and per list of values."""
    lines = ["{"]
    for i, (case, entry) in enumerate(record.items()):
        lines.append(f" {json.dumps(case)}: {{")
        fields = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in entry.items() if k != "groups"]
        groups = ",\n".join(f"   {json.dumps(g)}" for g in entry["groups"])
        fields.append(f'  "groups": [\n{groups}\n  ]' if groups else '  "groups": []')
        lines.append(",\n".join(fields))
        lines.append(" }" + ("," if i < len(record) - 1 else ""))
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    cases = argv or [c[0] for c in CASES]
    record = json.loads(RECORD.read_text()) if argv and RECORD.exists() else {}
    for case in cases:
        start = time.perf_counter()
        record[case] = compute(case)
        print(f"{case}: {len(record[case]['groups'])} fused groups, {time.perf_counter() - start:.1f} s", flush=True)
    order = [c[0] for c in CASES]
    record = {case: record[case] for case in sorted(record, key=order.index)}
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(_dumps(record))
    print(f"wrote {RECORD} ({RECORD.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main(sys.argv[1:])
