"""The product's packages import each other without cycles, and no module reaches into another package's
private names: a module's ``_name`` is free to change with the package that holds it."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("engine", "kvcache", "server")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    return {module_name(p): p for root in PRODUCT for p in (REPO / root).rglob("*.py")}


def package_of(module: str, modules: dict[str, Path]) -> str:
    """The package a module belongs to: itself for a package's ``__init__``, else its parent."""
    return module if modules[module].name == "__init__.py" else module.rpartition(".")[0]


def imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, str | None]]:
    """(module, name) for every product import in a file, at any depth (a function's import is a dependency
    too); name is the imported name for ``from m import name`` when it is not a module itself."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] in PRODUCT]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in PRODUCT:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append((sub, None) if sub in modules else (node.module, alias.name))
    return found


def test_no_module_imports_another_package_private_name():
    modules = product_modules()
    reaching = []
    for name, path in modules.items():
        for target, imported in imports(path, modules):
            if target in modules and package_of(target, modules) != package_of(name, modules):
                private = [part for part in (target.split(".") + [imported or ""]) if part.startswith("_")
                           and not part.startswith("__")]
                if private:
                    reaching.append(f"{name} imports {target}{'.' + imported if imported else ''}")
    assert reaching == []


def test_the_product_modules_import_no_cycle():
    modules = product_modules()
    graph = {name: sorted({target for target, _ in imports(path, modules) if target in modules and target != name
                           and not (modules[target].name == "__init__.py" and name.startswith(target + "."))})
             for name, path in modules.items()}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []
