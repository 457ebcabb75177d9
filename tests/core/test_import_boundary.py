"""The core must import only the standard library and numpy."""

import json
import pkgutil
import subprocess
import sys

import rhyme_sglang.core as core

FORBIDDEN = ("torch", "sglang", "ray")


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
