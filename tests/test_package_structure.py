"""The package's shape, checked by reading its source (no imports run): the import graph of ``opensora`` has no
cycle, imports inside functions included (a function-level import only hides a cycle until the function runs);
no module is over 600 lines; the product names no issue number or dated work log."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "opensora"
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str, path: Path, modules: dict) -> set:
    """The ``opensora`` modules that ``name`` imports anywhere in its source. ``from package import x`` counts as an
    import of ``package.x`` when that is a module, else of ``package``; a parent package's ``__init__`` run on the
    way is not counted (it only registers or re-exports)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def import_cycles(graph: dict) -> list:
    """Every strongly connected component with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_import_graph_has_no_cycle():
    modules = package_modules()
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert import_cycles(graph) == []


def test_the_cycle_finder_sees_function_level_and_relative_imports(tmp_path):
    modules = {"opensora.a": tmp_path / "a.py", "opensora.b": tmp_path / "b.py"}
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from opensora.a import thing\n")
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert graph == {"opensora.a": {"opensora.b"}, "opensora.b": {"opensora.a"}}
    assert import_cycles(graph) == [["opensora.a", "opensora.b"]]


def test_no_module_is_over_600_lines():
    long = {
        name: n for name, path in package_modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


# an issue reference ("issue 12", "#12"), a work log ("session 9", "the first look") or a spec file outside the
# repository ("seeds/...")
WORK_LOG = re.compile(
    r"\bissues? #?\d+|(?<![\w/&])#\d{1,4}\b|\bsession ?\d+|\b(first|second|third|fourth) look\b|\bseeds/", re.I
)


def test_the_product_cites_no_issue_or_work_log():
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if WORK_LOG.search(line)
    ]
    assert hits == []
