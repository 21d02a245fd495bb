"""The ``autofuser`` command.

    autofuser bench --models fno,transolver --device cuda --dtype bf16 --out results/
    autofuser models [--config tiny]

``bench`` runs the model zoo under eager PyTorch, torch.compile and AutoFuser
(``autofuser_zoo.harness``); ``models`` lists the zoo.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Optional


def _import_zoo():
    """``autofuser_zoo``; from a source checkout's ``zoo/`` when the installed
    package predates it (an editable install made before zoo/ was mapped)."""
    try:
        return importlib.import_module("autofuser_zoo")
    except ModuleNotFoundError as err:
        if err.name != "autofuser_zoo":
            raise
        source = Path(__file__).resolve().parent.parent / "zoo" / "__init__.py"
        if not source.exists():
            raise ModuleNotFoundError("autofuser_zoo is not installed: run `pip install -e .` in the "
                                      "AutoFuser checkout", name="autofuser_zoo") from None
        spec = importlib.util.spec_from_file_location("autofuser_zoo", source,
                                                      submodule_search_locations=[str(source.parent)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["autofuser_zoo"] = module
        spec.loader.exec_module(module)
        return module


def _list_models(args: argparse.Namespace) -> int:
    _import_zoo()
    from autofuser_zoo.models import MESHES, MODELS, parameter_count

    mesh = MESHES[args.config]
    print(f"{'name':<12}{'model':<34}{'family':<17}{'layout':<8}{'batch':>6}{'params':>12}  config ({args.config}, "
          f"mesh {mesh[0]} x {mesh[1]})")
    for name, entry in MODELS.items():
        params = parameter_count(entry.make(args.config))
        settings = ", ".join(f"{k}={v}" for k, v in entry.configs[args.config].items())
        print(f"{name:<12}{entry.title:<34}{entry.family:<17}{entry.layout:<8}{entry.batch(args.config):>6}"
              f"{params:>12,}  {settings}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    _import_zoo()
    from autofuser_zoo import harness

    parser = argparse.ArgumentParser(prog="autofuser", description="AutoFuser: fuse PyTorch models into Triton kernels.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = commands.add_parser("bench", help="benchmark the model zoo: eager vs torch.compile vs AutoFuser",
                                description=harness.__doc__.split("\n\n")[0])
    harness.add_arguments(bench)
    bench.set_defaults(run=harness.run_from_args)
    models = commands.add_parser("models", help="list the model zoo")
    models.add_argument("--config", choices=("airfoil", "tiny"), default="airfoil")
    models.set_defaults(run=_list_models)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
