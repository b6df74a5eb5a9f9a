"""Where the time of one ``graphmem analyze`` command goes: interpreter and imports, the
analysis, rendering, and the whole command as a user runs it (a fresh process), measured in one
run. ``graphmem --help`` is timed too: it must not import torch.

    python benchmarks/bench_startup.py [--model gpt2-xl] [--shape 32x1024]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

PHASES = r"""
import time, sys
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import graphmem.cli.main, graphmem.api, graphmem.render
t2 = time.perf_counter()
report = graphmem.api.analyze(sys.argv[1], input_shape=sys.argv[2])
t3 = time.perf_counter()
text = graphmem.render.render_text(report)
t4 = time.perf_counter()
print(t1 - t0, t2 - t1, t3 - t2, t4 - t3)
"""


def _wall(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-xl")
    ap.add_argument("--shape", default="32x1024")
    args = ap.parse_args()
    help_s = _wall([sys.executable, "-m", "graphmem.cli", "--help"])
    python_s = _wall([sys.executable, "-c", "pass"])
    out = subprocess.run([sys.executable, "-c", PHASES, args.model, args.shape], check=True, capture_output=True,
                         text=True).stdout.split()
    torch_s, graphmem_s, analyze_s, render_s = map(float, out)
    total = _wall([sys.executable, "-m", "graphmem.cli", "analyze", args.model, "--input-shape", args.shape])
    print(f"graphmem analyze {args.model} --input-shape {args.shape}: {total:.2f} s end to end")
    for name, s in (("python start", python_s), ("import torch", torch_s), ("import graphmem", graphmem_s),
                    ("analysis", analyze_s), ("render text", render_s)):
        print(f"  {name:16s} {s:6.2f} s  {100 * s / total:5.1f} %")
    print(f"graphmem --help: {help_s:.2f} s (python start {python_s:.2f} s)")


if __name__ == "__main__":
    main()
