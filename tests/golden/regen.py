"""Rewrite the golden files from graphmem's own output, on the machine it runs on (never by hand).

    python tests/golden/regen.py                      # every golden report, AVX-512 and AVX2 rules
    python tests/golden/regen.py acc_timm_resnet18    # the named cases (both ISAs where they differ)
    python tests/golden/regen.py --text               # also the text views (tests/render/test_render.py,
                                                      # tests/render/test_report_views.py)

The reports are made as tests/render/test_report_golden.py checks them (tests/golden_reports.py: a named
oneDNN ISA, two threads), so one run gives the files every machine checks. Each written file whose
content changed is listed, with how many fields moved beyond storage-id numbering: look at the diff
(``git diff tests/golden``) before committing it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
TEXT_TESTS = ("tests/render/test_render.py", "tests/render/test_report_views.py")


def _reports(names: list[str]) -> int:
    sys.path.insert(0, str(TESTS))
    from golden_reports import analyze_case, canonical, differences, golden_cases, golden_path, write_golden

    cases = [(n, k) for n, k in golden_cases() if not names or n in names]
    unknown = set(names) - {n for n, _ in cases}
    if unknown:
        print(f"regen: no golden case {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    for name, kernels in cases:
        path = golden_path(name, kernels)
        old = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
        _, got = analyze_case(name, kernels)
        write_golden(name, kernels, got)
        if old is None:
            print(f"{path.relative_to(TESTS.parent)}: new")
        elif old != got:
            moved = len(differences(canonical(got), canonical(old)))
            print(f"{path.relative_to(TESTS.parent)}: rewritten, {moved} field(s) moved beyond storage ids")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help="golden report cases (default: all)")
    parser.add_argument("--text", action="store_true", help="also rewrite the text views' golden files")
    args = parser.parse_args(argv)
    status = _reports(args.cases)
    if args.text and status == 0:
        env = dict(os.environ, GRAPHMEM_UPDATE_GOLDEN="1")
        status = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", *TEXT_TESTS],
                                 cwd=TESTS.parent, env=env)
    return status


if __name__ == "__main__":
    sys.exit(main())
