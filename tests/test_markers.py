"""Markers say what a test needs: derived from its module's imports and fixtures
(``tests/conftest.py``), so ``make test-fast`` runs where sglang and Ray are not installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.markers import derived_markers

ROOT = Path(__file__).resolve().parent.parent

# hides the packages from every import finder, as if they were not installed
_HIDE = textwrap.dedent("""
    import importlib.machinery as m
    HIDDEN = ("sglang", "ray", "sgl_kernel", "sglang_router")
    find = m.PathFinder.find_spec.__func__
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] in HIDDEN else find(cls, name, path, target)
    m.PathFinder.find_spec = classmethod(find_spec)
""")


def test_a_module_that_imports_torch_anywhere_is_marked_torch(request):
    import torch  # noqa: F401  (inside the test: the module's imports decide, wherever they are)

    assert request.node.get_closest_marker("torch") is not None
    assert request.node.get_closest_marker("sglang") is None


def test_the_engines_fixture_marks_an_engine_test():
    class Item:  # what derived_markers reads of a pytest item
        path = Path(__file__)
        fixturenames = ["engines", "tmp_path"]
        keywords = {}

    assert {"engine", "sglang", "torch"} <= derived_markers(Item())
    Item.fixturenames = ["tmp_path"]
    assert "engine" not in derived_markers(Item())


def test_fast_lane_collects_without_sglang_and_ray(tmp_path):
    """``make test-fast``'s selection collects with sglang and Ray hidden: no module imports
    them at collection time, and every test that needs them is deselected by its marker."""
    (tmp_path / "sitecustomize.py").write_text(_HIDE)
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
           "SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                        "no:cacheprovider", "-m", "not slow and not sglang and not ray"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    collected = [line for line in r.stdout.splitlines() if "::" in line]
    assert collected and not any(line.startswith("tests/sglang/test_engine_tiny.py")
                                 for line in collected)
    assert not any(line.startswith("tests/driver/test_loop.py") for line in collected)
