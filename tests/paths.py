"""Where the tests find the repository: ``TESTS`` (tests/: conftest.py, the shared helpers and the data
folders badmodels/, formula_models/, golden/, plan_models/, validate_models/) and ``ROOT`` (the
repository: docs/, models/, benchmarks/), whichever folder of tests/ a test file sits in."""
from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
