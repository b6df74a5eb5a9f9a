"""Shared test set-up: golden-file checks. The ``slow`` marker is declared in pyproject.toml
(CI runs slow tests too; ``-m "not slow"`` skips them locally); the shared tiny models live in
tests/cases.py."""
from __future__ import annotations

import os
from pathlib import Path

UPDATE_GOLDEN = os.environ.get("GRAPHMEM_UPDATE_GOLDEN") == "1"


def check_golden(text: str, path: Path) -> None:
    """``text`` must equal the golden file; ``GRAPHMEM_UPDATE_GOLDEN=1`` rewrites it (check the diff)."""
    if UPDATE_GOLDEN:
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"{path} is missing; create it with GRAPHMEM_UPDATE_GOLDEN=1"
    assert text == path.read_text(encoding="utf-8"), f"output differs from {path}; GRAPHMEM_UPDATE_GOLDEN=1 if intended"

