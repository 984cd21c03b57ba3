"""The package's layers: each module imports only from its own layer or the ones below it, the decoding core
imports no transformers, and no modules import each other in a circle (CONTRIBUTING.md's layer map)."""

from __future__ import annotations

import ast
from pathlib import Path

import recguide_hf

# lowest first; a module may import from its own layer and any earlier one
LAYERS = ["core", "models", "integrations", "serving", "tools", "testing"]
# what the core may not import at all (it is maths over tensors; the adapters know the outside libraries)
CORE_FORBIDDEN = {"transformers", "peft", "lm_eval", "fastapi", "uvicorn", "accelerate"}
# the top-level package's own names a module of any layer may read (constants, not code)
PACKAGE_CONSTANTS = {"BUNDLED_MODEL", "__version__"}


def _modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file for every module of the package (the bundled model's shims are data, not package)."""
    out = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        if "bundled" in rel.parts:
            continue
        parts = rel.parts[:-1] if rel.parts[-1] == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import statement of a module, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.append((target, [alias.name for alias in node.names], node.lineno))
    return found


def _layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def layer_violations(root: Path) -> list[str]:
    """Every upward import, every outside library the core imports, and every import circle, as messages."""
    modules = _modules(root)
    top = root.name
    problems, edges = [], {m: set() for m in modules}
    for name, path in modules.items():
        layer = _layer(name)
        for target, names, line in _imports(name, path):
            where = f"{path.relative_to(root.parent)}:{line}"
            if layer == "core" and target.split(".")[0] in CORE_FORBIDDEN:
                problems.append(f"{where}: the core imports {target}")
            if target.split(".")[0] != top:
                continue
            # `from pkg import sub` imports the submodule pkg.sub
            targets = [f"{target}.{n}" if f"{target}.{n}" in modules else target for n in names] or [target]
            for t in targets:
                if t == top:
                    if layer is not None and not set(names) <= PACKAGE_CONSTANTS:
                        problems.append(f"{where}: {name} imports the package's public names {names}")
                    continue
                edges[name].add(t)
                if layer is None or name.endswith("__main__"):
                    continue
                if _layer(t) is None or LAYERS.index(_layer(t)) > LAYERS.index(layer):
                    problems.append(f"{where}: {name} ({layer}) imports {t} ({_layer(t)}), a layer above it")
    problems += [f"import circle: {' -> '.join(c)}" for c in _circles(edges)]
    return problems


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of modules (Tarjan's algorithm, iterative depth-first search)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        out.append(sorted(group))
            elif child not in edges:
                continue
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def test_imports_go_only_downward_and_in_no_circle():
    root = Path(recguide_hf.__file__).parent
    assert set(LAYERS) <= {p.name for p in root.iterdir() if p.is_dir()}
    assert layer_violations(root) == []


def test_the_check_finds_an_upward_import_a_core_library_and_a_circle(tmp_path):
    pkg = tmp_path / "pkg"
    for layer in ("core", "models", "tools"):
        (pkg / layer).mkdir(parents=True)
        (pkg / layer / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("BUNDLED_MODEL = None\n")
    upward_and_outside = "from ..tools import cli\nimport transformers\nfrom .. import BUNDLED_MODEL\n"
    (pkg / "core" / "engine.py").write_text(upward_and_outside)
    (pkg / "core" / "a.py").write_text("from . import b\n")
    (pkg / "core" / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "models" / "m.py").write_text("from ..core.engine import Engine\n")  # downward: fine
    (pkg / "tools" / "cli.py").write_text("")
    problems = layer_violations(pkg)
    assert any("pkg.core.engine (core) imports pkg.tools.cli (tools)" in p for p in problems), problems
    assert any("the core imports transformers" in p for p in problems), problems
    assert "import circle: pkg.core.a -> pkg.core.b" in problems, problems
    assert len(problems) == 3, problems
