"""The import graph of the project's own modules stays clean (STYLE.md, "Packages by role").

Built from the source with `ast` (nothing is imported): one node per file, an edge per import of another project
module (and of the packages above it, whose `__init__.py` runs first), whether at the top of the file or inside a
function. Imports under `if TYPE_CHECKING:` are annotations only
(a callback's `job: Job`, a job's `callbacks: Callbacks`): they never run, so they form no loop and are left out, as
OLMo-core's callbacks import their Trainer. Proves, for every package (trainer, model, data, optim, kernels):
- no import loop between files;
- the packages import downward only: kernels/ nothing of the project, model/ only kernels/, data/ and optim/
  nothing, trainer/ any of them (so the model never depends on the trainer);
- no library module imports an entry point (trainer/cli/, or the old command paths that forward to it);
- the generation engine imports nothing of the trainer but itself and checkpoint loading;

The rest of what it proves: docs/testing.md#the-import-graph
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "model", "data", "optim", "kernels")
TOP_MODULES = ("config_checks",)
CHECKED = PACKAGES  # every package is held to the rules below
# The old `python -m trainer.<app>` paths: each forwards to its trainer.cli module (entry points, not library).
SHIMS = frozenset({"trainer.main", "trainer.generate", "trainer.export_hf", "trainer.import_hf", "trainer.plan",
                   "trainer.preflight", "trainer.pipeline"})
MAX_IN_FUNCTION = 20
# package -> the project packages it may import (besides itself and config_checks)
LAYERS = {"kernels": set(), "model": {"kernels"}, "data": set(), "optim": set(),
          "trainer": {"model", "data", "optim", "kernels"}}


@dataclass
class Import:
    source: str  # the importing module
    target: str  # the imported project module
    names: list[str]  # the names taken from it (`from target import a, b`); [] for a module import
    line: int
    in_function: bool
    type_checking: bool
    text: str  # the source line


@dataclass
class Graph:
    modules: dict[str, Path]
    imports: list[Import] = field(default_factory=list)

    def edges(self) -> dict[str, set[str]]:
        """Each import's target and the packages above it that the importer is not in (importing `a.b.c` runs
        `a/__init__.py` and `a/b/__init__.py` first)."""
        out = {m: set() for m in self.modules}
        for i in self.imports:
            if i.type_checking:
                continue
            parts = i.target.split(".")
            for k in range(1, len(parts) + 1):
                target = ".".join(parts[:k])
                own_package = i.source.startswith(target + ".")  # already running when the source runs
                if target in self.modules and target != i.source and (k == len(parts) or not own_package):
                    out[i.source].add(target)
        return out


def project_modules(root: Path = REPO) -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    for name in TOP_MODULES:
        modules[name] = root / f"{name}.py"
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` is, or lies in (the longest prefix that is a module)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in modules:
            return ".".join(parts[:i])
    return None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _file_imports(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    source = path.read_text()
    lines = source.splitlines()
    is_package = path.name == "__init__.py"
    found = []

    def add(target, names, node, in_function, type_checking):
        if target is not None:
            found.append(Import(module, target, names, node.lineno, in_function, type_checking,
                                lines[node.lineno - 1]))

    def visit(node, in_function, type_checking):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(_resolve(alias.name, modules), [], child, in_function, type_checking)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".")[: None if is_package else -1]
                    base = base[: len(base) - (child.level - 1)]
                    full = ".".join(base + ([child.module] if child.module else []))
                else:
                    full = child.module or ""
                if full.split(".")[0] not in PACKAGES + TOP_MODULES:
                    continue
                for alias in child.names:
                    if f"{full}.{alias.name}" in modules:  # `from package import submodule`
                        add(f"{full}.{alias.name}", [], child, in_function, type_checking)
                    else:
                        add(_resolve(full, modules), [alias.name], child, in_function, type_checking)
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner, type_checking or (isinstance(child, ast.If) and _is_type_checking(child)))

    visit(ast.parse(source), False, False)
    return found


def build_graph(root: Path = REPO) -> Graph:
    modules = project_modules(root)
    graph = Graph(modules)
    for module, path in modules.items():
        graph.imports += _file_imports(module, path, modules)
    return graph


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges)))
    try:
        for v in sorted(edges):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def _checked(module: str) -> bool:
    return module.split(".")[0] in CHECKED


def _entry_point(module: str) -> bool:
    return module == "trainer.cli" or module.startswith("trainer.cli.") or module in SHIMS


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


GRAPH = build_graph()


def test_no_import_loop():
    edges = GRAPH.edges()
    loops = [c for c in cycles(edges) if any(_checked(m) for m in c)]
    assert loops == [], f"import loops between files: {loops}"


def test_packages_import_downward_only():
    bad = [f"{i.source}:{i.line} imports {i.target}" for i in GRAPH.imports
           if _checked(i.source) and not i.type_checking and i.target.split(".")[0] in PACKAGES
           and i.target.split(".")[0] != i.source.split(".")[0]
           and i.target.split(".")[0] not in LAYERS[i.source.split(".")[0]]]
    assert bad == []


def test_no_library_module_imports_an_entry_point():
    bad = [f"{i.source}:{i.line} imports {i.target}" for i in GRAPH.imports
           if _checked(i.source) and not _entry_point(i.source) and _entry_point(i.target)]
    assert bad == []


def test_the_engine_depends_on_the_model_not_on_the_training_loop():
    allowed = ("trainer.engine", "trainer.checkpoint")
    bad = [f"{i.source}:{i.line} imports {i.target}" for i in GRAPH.imports
           if i.source.startswith("trainer.engine") and not i.type_checking and i.target.startswith("trainer")
           and not i.target.startswith(allowed)]
    assert bad == []


def test_no_private_name_crosses_modules():
    bad = [f"{i.source}:{i.line} takes {n} from {i.target}" for i in GRAPH.imports if _checked(i.source)
           for n in i.names if _private(n) and i.target != i.source]
    assert bad == []


def test_imports_inside_functions_are_few_and_say_why():
    inside = [i for i in GRAPH.imports if _checked(i.source) and i.in_function and not i.type_checking]
    assert len(inside) <= MAX_IN_FUNCTION, "\n".join(f"{i.source}:{i.line}: {i.text.strip()}" for i in inside)
    unexplained = [f"{i.source}:{i.line}: {i.text.strip()}" for i in inside if "#" not in i.text]
    assert unexplained == [], "an import inside a function says why on its line"


def report(graph: Graph) -> str:
    """The numbers of the whole project's graph, package by package."""
    out = []
    loops = cycles(graph.edges())
    out.append(f"modules: {len(graph.modules)}; import loops: {len(loops)}")
    out += [f"  {len(c)}: {' '.join(c)}" for c in loops]
    inside = [i for i in graph.imports if i.in_function and not i.type_checking]
    by_package = Counter(i.source.split(".")[0] for i in inside)
    out.append(f"imports inside functions: {len(inside)} ({dict(sorted(by_package.items()))})")
    out += [f"  {m}: {n}" for m, n in Counter(i.source for i in inside).most_common()]
    private = [(i.source, n, i.target) for i in graph.imports for n in i.names if _private(n) and i.target != i.source]
    out.append(f"private names imported across modules: {len(private)}")
    out += [f"  {s} takes {n} from {t}" for s, n, t in private]
    up = [(i.source, i.target) for i in graph.imports if not _entry_point(i.source) and _entry_point(i.target)]
    out.append(f"library -> entry point imports: {len(up)}")
    out += [f"  {s} -> {t}" for s, t in up]
    return "\n".join(out)


if __name__ == "__main__":
    print(report(build_graph(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else REPO)))
