"""Helpers every benchmark script shares."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path, report: dict) -> None:
    """Write a benchmark report as indented JSON (no-op without a path; parents created)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2, default=str))
