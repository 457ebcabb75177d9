"""The ``--rhyme-*`` flags have one source, RhymeConfig's fields: ``launch_server --help``
lists every one in its own group, and the flag tables of docs/flags.md (every flag) and
README.md (the main ones) are made from the same help."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rhyme_sglang.sglang_ext.config import RhymeConfig
from rhyme_sglang.sglang_ext.flags import (
    GROUP, MAIN, default_text, flag, markdown_rows, user_fields)

ROOT = Path(__file__).resolve().parents[2]


def test_every_field_has_help_text():
    missing = [f.name for f in dataclasses.fields(RhymeConfig) if not f.metadata.get("help")]
    assert not missing, f"RhymeConfig fields without help metadata (config._opt): {missing}"


def test_user_flags_are_the_fields_but_the_control_address():
    assert [f.name for f in user_fields()] == [
        f.name for f in dataclasses.fields(RhymeConfig) if f.name != "control_addr"]


def flag_rows(path: str):
    return [line for line in (ROOT / path).read_text().splitlines()
            if line.startswith("| `--rhyme-")]


def test_docs_flag_table_is_made_from_the_help():
    assert flag_rows("docs/flags.md") == markdown_rows(), (
        "docs/flags.md's --rhyme-* rows differ from RhymeConfig's help; paste the output of "
        "`python -m rhyme_sglang.sglang_ext.flags` over them")


def test_readme_flag_table_is_made_from_the_help():
    assert set(MAIN) <= {f.name for f in user_fields()}, "flags.MAIN names a field that is gone"
    assert flag_rows("README.md") == markdown_rows(main_only=True), (
        "README.md's --rhyme-* rows differ from RhymeConfig's help; paste the output of "
        "`python -m rhyme_sglang.sglang_ext.flags --main` over them")


@pytest.mark.sglang
def test_launch_server_help_lists_every_flag_in_its_group():
    env = dict(os.environ, COLUMNS="2000")  # argparse wraps help at the terminal's width
    run = subprocess.run([sys.executable, "-m", "rhyme_sglang.launch_server", "--help"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    text = run.stdout
    assert "--speculative-algorithm" in text  # SGLang's flags are there too
    group = text.split(f"\n{GROUP}:\n", 1)[1].split("\n\n", 2)[1]  # title, description, flags
    entries, name = {}, ""
    for line in group.splitlines():  # "  --flag VALUE  help", the help maybe on the next line
        if line.startswith("  --"):
            name = line.split()[0]
        entries[name] = entries.get(name, "") + " " + line.strip()
    for f in user_fields():
        assert flag(f) in entries, f"{flag(f)} is not in the {GROUP!r} group of --help"
        assert entries[flag(f)].endswith(f" (default: {default_text(f)})"), entries[flag(f)]
        assert f.metadata["help"] in entries[flag(f)]
    assert "--rhyme-control-addr" not in text
