"""Import boundaries: the core imports only the standard library and numpy; sglang is imported
only by the packages that translate to it."""

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import rhyme_sglang.core as core

FORBIDDEN = ("torch", "sglang", "ray")
ROOT = Path(__file__).resolve().parents[2]
# The only importers of sglang: the translation layer, the CPU backend that patches sglang's
# model layers, the server entry point that starts sglang's HTTP server, and the benchmark
# wrapper around sglang's own NGRAM corpus (a peer measured against). rl_driver reaches sglang
# only through rhyme_sglang's Engine.
SGLANG_IMPORTERS = ("rhyme_sglang/sglang_ext/", "rhyme_sglang/cpu_backend/",
                    "rhyme_sglang/launch_server.py", "benchmarks/peers/ngram.py")


def _imports_sglang(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        if any(name.split(".")[0] == "sglang" for name in names):
            return True
    return False


def test_only_the_translation_packages_import_sglang():
    files = [p for pkg in ("rhyme_sglang", "rl_driver", "benchmarks", "scripts")
             for p in (ROOT / pkg).rglob("*.py")]
    importers = {p.relative_to(ROOT).as_posix() for p in files if _imports_sglang(p)}
    outside = sorted(f for f in importers if not f.startswith(SGLANG_IMPORTERS))
    assert outside == [], f"sglang imported outside {SGLANG_IMPORTERS}: {outside}"
    assert "rhyme_sglang/sglang_ext/worker.py" in importers  # the check sees real imports


def test_core_imports_no_engine_packages():
    names = ["rhyme_sglang.core"] + [f"rhyme_sglang.core.{m.name}"
                                     for m in pkgutil.iter_modules(core.__path__)]
    code = (
        "import importlib, json, sys\n"
        f"for n in {names!r}: importlib.import_module(n)\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    leaked = json.loads(out.stdout.strip().splitlines()[-1])
    assert leaked == [], f"engine-agnostic core imported {leaked}"
    assert "rhyme_sglang.core.store" in names and "rhyme_sglang.core.trace" in names


def test_missing_native_module_falls_back_with_a_warning():
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "sys.modules['rhyme_sglang.core._rhyme_native'] = None\n"
        "from rhyme_sglang.core import DraftStore\n"
        "s = DraftStore()\n"
        "s.add_response('p', [1, 2], [3, 4, 5], 0)\n"
        "print(s.backend)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "python"
    assert "not built" in out.stderr and "pure-Python" in out.stderr
