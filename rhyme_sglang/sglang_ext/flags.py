"""The ``--rhyme-*`` flags as ``--help`` lines and markdown table rows, made from
:class:`RhymeConfig`'s fields (their ``help`` metadata): the one source of both.

``docs/flags.md`` holds every flag's row, ``README.md`` the rows of :data:`MAIN`;
``tests/sglang/test_flags_help.py`` compares both with :func:`markdown_rows`."""

from __future__ import annotations

import argparse
import dataclasses
from typing import List

from rhyme_sglang.sglang_ext.config import RhymeConfig

GROUP = "RHYME speculative decoding"

MAIN = ("schedule_policy", "memory_mb", "snapshot_dir", "adaptive", "widths", "group_prefill",
        "cost_cache")
"""The fields whose rows README.md shows (rows come in RhymeConfig's field order)."""


def user_fields() -> List[dataclasses.Field]:
    """RhymeConfig's fields a user sets with a flag (``internal`` ones are set by code)."""
    return [f for f in dataclasses.fields(RhymeConfig) if not f.metadata.get("internal")]


def flag(f: dataclasses.Field) -> str:
    return "--rhyme-" + f.name.replace("_", "-")


def metavar(f: dataclasses.Field) -> str:
    """The value's name; a bool flag takes ``1`` or ``0``, its default first."""
    if isinstance(f.default, bool):
        return "{1,0}" if f.default else "{0,1}"
    return f.metadata.get("metavar") or f.name.upper()


def default_text(f: dataclasses.Field) -> str:
    if f.default is None:
        return f.metadata.get("shown") or "none"
    return str(int(f.default)) if isinstance(f.default, bool) else str(f.default)


def add_help_group(parser: argparse.ArgumentParser) -> None:
    """Add the flags to ``parser`` as one argument group, for its ``--help`` only: the flags
    themselves are parsed by :meth:`RhymeConfig.pop_from_argv`."""
    group = parser.add_argument_group(
        GROUP, "RHYME's own flags (with --speculative-algorithm RHYME); each takes a value")
    for f in user_fields():
        text = f"{f.metadata.get('help', '')} (default: {default_text(f)})"
        group.add_argument(flag(f), metavar=metavar(f), help=text.replace("%", "%%"))


def markdown_rows(main_only: bool = False) -> List[str]:
    """Table rows of the flags, ``| `flag VALUE` | default | meaning |``: every user flag
    (``docs/flags.md``), or with ``main_only`` those of :data:`MAIN` (``README.md``)."""
    return [f"| `{flag(f)} {metavar(f)}` | {default_text(f)} | {f.metadata.get('help', '')} |"
            for f in user_fields() if not main_only or f.name in MAIN]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Print the --rhyme-* flags' markdown table rows.")
    parser.add_argument("--main", action="store_true", help="only README.md's rows (MAIN)")
    print("\n".join(markdown_rows(main_only=parser.parse_args().main)))
