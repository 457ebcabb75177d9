"""No import circles among rhyme_sglang, rl_driver and benchmarks (`scripts/import_cycles.py`)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "scripts" / "import_cycles.py")
import_cycles = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_cycles)

def test_no_import_circles():
    graph = import_cycles.import_graph(ROOT)
    assert "rhyme_sglang.core.store" in graph and "benchmarks.bench_rollout" in graph
    found = import_cycles.cycles(graph)
    assert found == []


def test_cycles_finds_lazy_relative_and_attribute_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from pkg import a\nfrom typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    from pkg import c\n")
    (pkg / "c.py").write_text("import pkg.sub.b\n")
    graph = import_cycles.import_graph(tmp_path, ["pkg"])
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert import_cycles.cycles(graph) == [["pkg.a", "pkg.sub.b"]]  # c -> b is one way


def test_a_package_attribute_counts_and_an_unbuilt_extension_does_not(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .m import f\nVALUE = 1\n")
    (pkg / "m.py").write_text("from . import _native_not_built\n"
                              "def f():\n    from pkg import VALUE\n")
    graph = import_cycles.import_graph(tmp_path, ["pkg"])
    assert graph == {"pkg": {"pkg.m"}, "pkg.m": {"pkg"}}
    (pkg / "m.py").write_text("from . import _native_not_built\n")
    assert import_cycles.cycles(import_cycles.import_graph(tmp_path, ["pkg"])) == []


def test_the_command_exits_1_on_a_circle_and_0_without(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("import pkg.a\n")
    script = str(ROOT / "scripts" / "import_cycles.py")
    run = subprocess.run([sys.executable, script, "--root", str(tmp_path), "pkg"],
                         capture_output=True, text=True)
    assert run.returncode == 1 and "cycle: pkg.a <-> pkg.b" in run.stdout
    (pkg / "b.py").write_text("")
    run = subprocess.run([sys.executable, script, "--root", str(tmp_path), "pkg"],
                         capture_output=True, text=True)
    assert run.returncode == 0 and "0 import circle(s)" in run.stdout
