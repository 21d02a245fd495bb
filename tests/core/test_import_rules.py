"""The import rules the architecture rests on, read from the source (no import runs):

- a bundled plugin is written as a third party's would be: it imports ``autofuser``
  and ``autofuser.kernel``, never ``autofuser_core`` and never another plugin (and
  the third-party fft example keeps to the same API);
- the core imports no plugin;
- the core's modules (and the public package over them) import one another without
  a cycle at module level, so each can be read, and loaded, after what it uses.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "plugins"


def _module_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports run when the module loads: its top level and ``try``/``if`` blocks at
    that level, without ``if TYPE_CHECKING:`` blocks (never run) and without imports
    inside functions (run later, when called)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(body):
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If):
                test = node.test
                if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
                    walk(node.orelse)
                    continue
                walk(node.body)
                walk(node.orelse)
            elif isinstance(node, ast.Try):
                for part in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                    walk(part)

    walk(tree.body)
    return found


def _all_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


EXAMPLE = ROOT / "examples" / "autofuser-plugin-fft" / "autofuser_plugin_fft"


def _plugin_files() -> list[Path]:
    return sorted(PLUGINS.rglob("*.py"))


def _absolute(node: ast.ImportFrom, path: Path, package_root: Path, package: str) -> str:
    """The absolute module name of a relative ``from`` import in ``path``."""
    parts = [package, *path.relative_to(package_root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    else:
        parts.pop()  # a module's own package
    if node.level > 1:
        parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _imported_names(path: Path, package_root: Path, package: str) -> list[str]:
    """Every module ``path`` imports, anywhere in it, as absolute names."""
    names = []
    for node in _all_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            names.append(_absolute(node, path, package_root, package))
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
        else:
            names += [a.name for a in node.names]
    return names


def _outside_public_api(path: Path, package_root: Path, package: str, plugin: str | None) -> list[str]:
    """What ``path``, a file of ``plugin``, imports that a plugin may not."""
    where = path.relative_to(ROOT)
    wrong = [f"{where} names autofuser_core"] if "autofuser_core" in path.read_text() else []
    for name in _imported_names(path, package_root, package):
        parts = name.split(".")
        if parts[0] == "autofuser_core" or (parts[0] == "autofuser" and parts[1:2] not in ([], ["kernel"])):
            wrong.append(f"{where} imports {name}")
        if parts[0] == "autofuser_plugins" and len(parts) > 1 and parts[1] != plugin:
            wrong.append(f"{where} (plugin {plugin}) imports {name}")
    return wrong


def test_the_bundled_plugins_use_only_the_public_api():
    assert _plugin_files(), "no plugin sources found"
    wrong = []
    for path in _plugin_files():
        plugin = path.relative_to(PLUGINS).parts[0] if len(path.relative_to(PLUGINS).parts) > 1 else None
        wrong += _outside_public_api(path, PLUGINS, "autofuser_plugins", plugin)
    assert not wrong, "bundled plugins import only autofuser and autofuser.kernel:\n" + "\n".join(wrong)


def test_the_third_party_example_uses_only_the_public_api():
    files = sorted(EXAMPLE.glob("*.py"))
    assert files, f"no sources under {EXAMPLE.relative_to(ROOT)}"
    wrong = [w for path in files for w in _outside_public_api(path, EXAMPLE, "autofuser_plugin_fft", None)]
    assert not wrong, "the fft example imports only autofuser and autofuser.kernel:\n" + "\n".join(wrong)


def test_the_core_imports_no_plugin():
    wrong = [
        f"{path.relative_to(ROOT)} imports {name}"
        for package in ("autofuser_core", "autofuser")
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in _imported_names(path, ROOT / package, package)
        if name.split(".")[0] in ("autofuser_plugins", "autofuser_plugin_fft")
    ]
    assert not wrong, "the core knows plugins only through entry points and fuse(plugins=...):\n" + "\n".join(wrong)


def _core_graph() -> dict[str, set[str]]:
    modules = {}
    for package in ("autofuser_core", "autofuser"):
        for path in sorted((ROOT / package).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name.split(".")[0]
        for node in _module_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = _absolute(node, path, ROOT / package, package) if node.level else (node.module or "")
                candidates = [target] + [f"{target}.{a.name}" for a in node.names]
            else:
                candidates = [a.name for a in node.names]
            for candidate in candidates:
                if candidate in modules and candidate != name:
                    graph[name].add(candidate)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        stack.pop()
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_the_core_imports_without_a_cycle():
    graph = _core_graph()
    assert "autofuser_core.group" in graph and graph["autofuser_core.tiles"], "the core's modules were not read"
    cycle = _cycle(graph)
    assert not cycle, "module-level import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize(
    "graph, cycle",
    [({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]), ({"a": {"b"}, "b": {"c"}, "c": set()}, [])],
)
def test_the_cycle_finder_finds_cycles(graph, cycle):
    assert _cycle(graph) == cycle
