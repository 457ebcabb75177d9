"""What a test needs, derived in one place so no module can forget a marker: the packages its
module imports (anywhere in it, functions included), and the engine fixtures it uses. Markers
written on a test add to these. ``tests/conftest.py`` applies them at collection."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

# imported module (or a dotted prefix of it) -> marker; rhyme_sglang.sglang_ext is the sglang
# integration, whose modules import sglang (some inside their functions)
IMPORT_MARKERS = {"sglang": "sglang", "sgl_kernel": "sglang", "sglang_router": "sglang",
                  "rhyme_sglang.sglang_ext": "sglang", "ray": "ray", "torch": "torch",
                  "transformers": "torch"}
ENGINE_FIXTURES = {"engines"}  # every in-process engine comes from the session's EnginePool


@functools.lru_cache(maxsize=None)
def imported_modules(path: str) -> frozenset:
    """The modules a test module imports, at module level or inside functions (``from P
    import m`` counts as ``P`` and ``P.m``)."""
    tree = ast.parse(Path(path).read_text(), filename=path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return frozenset(names)


def _marker_of(module: str):
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        marker = IMPORT_MARKERS.get(".".join(parts[:i]))
        if marker:
            return marker
    return None


def derived_markers(item) -> set:
    """Markers a test gets from its module's imports and its fixtures."""
    found = {_marker_of(name) for name in imported_modules(str(item.path))} - {None}
    if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
        found |= {"engine", "sglang", "torch"}
    if "engine" in item.keywords or "server" in item.keywords:
        found |= {"engine", "sglang", "torch"}
    if "sglang" in found or "sglang" in item.keywords:
        found.add("torch")  # sglang needs torch
    return found
