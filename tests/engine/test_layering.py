"""The package's layering, read from the source: each subpackage of cpuserve
imports only those below it (lazy imports inside functions included), module-
level imports form no cycle, and the shared topology reader depends on neither
the engine nor the operator. docs/architecture.md draws the same layers."""
from __future__ import annotations

import ast
from pathlib import Path

import cpuserve

PKG = Path(cpuserve.__file__).parent
# Lowest first. `config` and the native `_C` sit below every subpackage.
LAYERS = ["config", "_C", "platform", "loading", "structured", "model_executor", "core", "worker", "engine", "entrypoints"]
FACADES = {"cpuserve", "cpuserve.__main__"}  # the public names and `python -m cpuserve`: above everything


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported cpuserve module, at module level?) for every import in the file."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:  # `from cpuserve.x import y` may name a module y
                sub = f"{node.module}.{a.name}"
                known = (PKG.parent / (sub.replace(".", "/") + ".py")).exists() or \
                    (PKG.parent / sub.replace(".", "/")).is_dir()
                out.append((sub if known else node.module, id(node) in top))
    return [(m, t) for m, t in out if m == "cpuserve" or m.startswith("cpuserve.")]


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else len(LAYERS)


def graph() -> dict[str, list[tuple[str, bool]]]:
    return {module_name(p): imports(p) for p in PKG.rglob("*.py")}


GRAPH = graph()


def test_every_module_is_in_a_layer():
    strays = [m for m in GRAPH if m not in FACADES and layer(m) == len(LAYERS)]
    assert not strays, f"modules outside the layers {LAYERS}: {strays}"


def test_subpackages_import_only_those_below():
    upward = [f"{m} imports {dep}" for m, deps in GRAPH.items() if m not in FACADES
              for dep, _ in deps if dep != "cpuserve" and layer(dep) > layer(m)]
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_no_import_cycles():
    g = {m: sorted({d for d, top in deps if top and d in GRAPH}) for m, deps in GRAPH.items()}
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for d in g.get(m, []):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in g:
        if m not in state:
            visit(m, [m])


def test_topology_reader_stands_alone():
    import cpuserve_topology

    src = Path(cpuserve_topology.__file__).read_text()
    names = {n.module or "" for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom)} | \
            {a.name for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Import) for a in n.names}
    assert not {n for n in names if n.split(".")[0] in ("cpuserve", "cpuserve_operator", "torch", "numpy")}
