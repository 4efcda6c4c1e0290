"""The package's layers point one way (DESIGN.md "Layers of the package"): the product never
imports its tooling, and no module imports itself back through others. Read from the source
with `ast`, lazy imports inside functions included, so a new import cannot slip past."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "fluxtp"
PRODUCT = ("fluxtp.ops", "fluxtp.backends", "fluxtp.kernels", "fluxtp.configs", "fluxtp.symm", "fluxtp.nn",
           "fluxtp.inference", "fluxtp._dist", "fluxtp.fp8")  # fmt: skip
TOOLING = ("fluxtp.tune", "fluxtp.bench", "fluxtp.cli")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _resolve(name: str) -> str | None:
    """The fluxtp module an imported name is (a submodule where one exists), else None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """Every fluxtp module `module` imports explicitly, at its top or inside a function."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names = [f"{base}.{alias.name}" for alias in node.names] or [base]
            names = [n if n in MODULES else base for n in names]  # `from pkg import sub` is the submodule
        else:
            continue
        for name in names:
            target = _resolve(name) if name.startswith("fluxtp") else None
            if target is not None and target != module:
                found.add(target)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def test_the_walk_sees_the_imports_it_should():
    assert "fluxtp.configs" in GRAPH["fluxtp.backends.fused"]
    assert "fluxtp.backends.fused._all_gather_matmul" in GRAPH["fluxtp.backends.fused"]  # a lazy import
    assert any(_within(m, ["fluxtp.configs"]) for m in GRAPH["fluxtp.tune"])


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _within(m, PRODUCT)))
def test_the_product_never_imports_its_tooling(module):
    tooling = sorted(t for t in GRAPH[module] if _within(t, TOOLING))
    assert not tooling, f"{module} imports {tooling}: tooling imports the product, never the other way"


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for t in sorted(GRAPH[m]):
            if state.get(t) == 1:
                cycle = path[path.index(t) :] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
