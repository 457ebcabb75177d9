"""Import circles among the project's packages, read from the source (nothing is imported).

Every ``import`` and ``from ... import`` statement counts, at module level or inside a function
(a lazy import still ties the two modules together); imports under ``if TYPE_CHECKING:`` do not.
``from pkg import name`` points at the submodule ``pkg.name`` when there is one, at ``pkg`` when
its ``__init__`` defines ``name``, and nowhere else (a compiled extension not built yet).
Importing ``a.b`` is not counted as importing the package ``a``. Prints each circle (a strongly
connected component of the module graph) on one line and exits 1 if there is any.

    python scripts/import_cycles.py [--root DIR] [PACKAGE ...]
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Sequence, Set

PACKAGES = ("rhyme_sglang", "rl_driver", "benchmarks")


def module_files(root: Path, packages: Iterable[str]) -> Dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file and compiled extension (``.so``,
    ``.pyd``: a module that imports nothing of the project) under each package."""
    out: Dict[str, Path] = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*")):
            if path.suffix not in (".py", ".so", ".pyd") or ".venv" in path.parts:
                continue
            parts = list(path.relative_to(root).parts)
            parts[-1] = parts[-1].split(".")[0]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterable[ast.stmt]:
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def defined_names(path: Path) -> Set[str]:
    """Names a module defines at top level (assigned, def, class or imported)."""
    names: Set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8"), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def imported_modules(name: str, path: Path, known: Dict[str, Path],
                     package_names: Dict[str, Set[str]]) -> Set[str]:
    """The project modules that module `name` (source at `path`) imports; `known` maps every
    project module to its file, `package_names` caches each package's `defined_names`."""
    if path.suffix != ".py":
        return set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: Set[str] = set()
    for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            targets = [_from_target(base, alias.name, known, package_names)
                       for alias in node.names]
        found.update(t for t in targets if t in known and t != name)
    return found


def _from_target(base: str, name: str, known: Dict[str, Path],
                 package_names: Dict[str, Set[str]]) -> str:
    """What ``from base import name`` imports: the submodule, the package, or '' (neither)."""
    if f"{base}.{name}" in known:
        return f"{base}.{name}"
    init = known.get(base)
    if init is None or init.name != "__init__.py" or name == "*":
        return base
    if base not in package_names:
        package_names[base] = defined_names(init)
    # not defined by the package: a submodule without source here (an extension not built)
    return base if name in package_names[base] else ""


def import_graph(root: Path, packages: Iterable[str] = PACKAGES) -> Dict[str, Set[str]]:
    files = module_files(root, packages)
    package_names: Dict[str, Set[str]] = {}
    return {name: imported_modules(name, path, files, package_names) for name, path in files.items()}


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module, each sorted, in sorted order
    (Tarjan's algorithm, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    out: List[List[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def main(argv: Sequence[str] = ()) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("packages", nargs="*", default=list(PACKAGES))
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    args = ap.parse_args(list(argv))
    graph = import_graph(Path(args.root), args.packages)
    found = cycles(graph)
    for comp in found:
        print("cycle: " + " <-> ".join(comp))
    print(f"{len(graph)} modules, {len(found)} import circle(s)")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
