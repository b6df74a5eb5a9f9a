"""graphmem's CUDA figures against a real GPU, in one command (graphmem issue 27).

```sh
python benchmarks/gpu_truth.py                  # on a GPU host: <= 8 min on one H100 (time guard 390 s)
python benchmarks/gpu_truth.py --dry            # anywhere: graphmem's side only (fake tensors), no GPU
python benchmarks/gpu_truth.py --dry --models hf_llama,timm_resnet18 --variants fp32,compiled --anchors quick
```

1. Anchors (benchmarks/gpu_truth_anchors.py): the figures PyTorch's own GPU tests assert
   (test/functorch/test_ac.py's activation memory budgets, test/distributed/fsdp/test_fsdp_memory.py's
   340 / 51 MiB after forward), reproduced by graphmem's CUDA target on fake tensors (also in
   ``--dry``), and on a GPU re-measured the way test_ac.py measures them (the FSDP test needs 2 GPUs).
2. The zoo (benchmarks/gpu_truth_zoo.py: 18 models from transformers, peft, timm, torchvision,
   torch.nn) on each target (fp32, bf16, autocast bf16; eager and compiled; SDPA flash, efficient,
   math for the models with attention): graphmem's prediction beside a real CUDA step of the same
   model and batch: saved bytes, the step's rise of max_memory_allocated and max_memory_reserved
   (benchmarks/gpu_truth_steps.py says how each is read).
3. The table is printed and written into docs/validation.md between markers of its kind (dry or
   gpu), with the date, the GPU and torch's version; the real anchor checks run last, if time is left.

On a lent device machine (its image has torch, transformers, timm, peft and torchvision but not
graphmem, and no network), one command, ``timeout_s`` 540 (the run itself stays under 8 minutes)::

    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . && PYTHONUNBUFFERED=1 python3 benchmarks/gpu_truth.py 2>&1 | tee $OUT/log; cp docs/validation.md $OUT/

Every real step is small (the point is the rules, not scale). ``--timeout`` (default 390 s) is a
guard over the whole run: no row starts after it, and an alarm 45 s later stops a row that hangs;
rows not run are listed as skipped. graphmem's side runs in ``--jobs`` spawned processes (default
half the CPUs, at most 8) while this one runs the real steps.
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_truth_anchors as anchors  # noqa: E402
import gpu_truth_zoo as zoo  # noqa: E402
from gpu_truth_report import SKIPPED, AnchorRow, Run, ZooRow, markdown, write_section  # noqa: E402
from gpu_truth_steps import error_line, measure_cuda, predict_row  # noqa: E402

ALARM_AFTER = 45  # seconds after the guard: a row still running then is stopped
DOCS = Path(__file__).resolve().parent.parent / "docs" / "validation.md"


class _Timeout(BaseException):
    """The alarm: not an Exception, so no row's error handling swallows it."""


class Clock:
    """The run's time guard: ``left()`` seconds before no new row may start."""

    def __init__(self, limit: float) -> None:
        self.start, self.limit = time.perf_counter(), limit

    def left(self) -> float:
        return self.limit - (time.perf_counter() - self.start)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def _guarded(fn: Callable[[], Any]) -> Any:
    """``fn()``, or its error's first line (a row that fails is a row of the table, not a crash)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the table names every failure
        return error_line(e)


def real_anchors(rows: list[AnchorRow], clock: Clock) -> None:
    """On a GPU: each test_ac row measured as the test does (aot_eager_decomp_partition)."""
    cases = {c.name: c for c in anchors.ac_cases()}
    for row in rows:
        if row.source != anchors.TEST_AC or row.setting == "all":
            continue
        if clock.left() <= 0:
            row.real = f"{SKIPPED} (time guard)"
            continue
        row.real = _guarded(lambda: anchors.real_act_mib(cases[row.case], row.budget))


def run_zoo(rows: list[ZooRow], real: bool, gpu: str, clock: Clock, pool: Optional[ProcessPoolExecutor]) -> None:
    """Both sides of each row, filled in place (a row not reached keeps ``predicted=None``). With a
    ``pool``, graphmem's side (CPU only) runs in its processes while this one runs the real steps
    on the GPU, row by row."""
    futures = [pool.submit(predict_row, row.model, row.variant, gpu) for row in rows] if pool else [None] * len(rows)
    for row, future in zip(rows, futures):
        if clock.left() <= 0 and future is None:
            row.predicted = f"{SKIPPED} (time guard at {clock.limit:.0f} s)"
            continue
        t = time.perf_counter()
        if future is None:
            row.predicted = predict_row(row.model, row.variant, gpu)
        if real and clock.left() > 0:
            row.real = _guarded(lambda: measure_cuda(*zoo.build(row.model), zoo.VARIANTS[row.variant]))
        if future is not None:
            try:
                row.predicted = future.result(timeout=max(clock.left(), 0.01))
            except FutureTimeout:
                row.predicted = f"{SKIPPED} (time guard at {clock.limit:.0f} s)"
        print(f"  {row.model} {row.variant}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)


def _shut(pool: Optional[ProcessPoolExecutor]) -> None:
    """Stop the pool's workers (this run's own processes) without waiting for a row in progress."""
    if pool is None:
        return
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in processes:
        p.terminate()


def _run(args: argparse.Namespace, result: Run, real: bool, gpu: str, clock: Clock) -> None:
    cpus = os.cpu_count() or 1
    jobs = args.jobs or (1 if cpus <= 4 else min(8, cpus // 2))
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=torch.set_num_threads,
                               initargs=(1,)) if jobs > 1 else None  # fake tensors compute nothing: 1 thread each
    try:
        later = None
        if args.anchors != "none":
            if pool is not None:  # alongside the zoo
                later = pool.submit(anchors.graphmem_rows, args.anchors, clock.left())
            else:
                rows, seconds = anchors.graphmem_rows(args.anchors, clock.left())
                result.anchors += rows
                result.timings.append(f"anchors, graphmem side {seconds:.1f} s")
        t = clock.elapsed()
        run_zoo(result.zoo, real, gpu, clock, pool)
        result.timings.append(f"zoo ({len(result.zoo)} rows, {jobs} process(es) for graphmem's side) "
                              f"{clock.elapsed() - t:.1f} s")
        if later is not None:
            try:
                rows, seconds = later.result(timeout=max(clock.left(), 0.01))
                result.anchors += rows
                result.timings.append(f"anchors, graphmem side {seconds:.1f} s (alongside the zoo)")
            except FutureTimeout:
                result.timings.append("anchors not done by the time guard")
        if real and result.anchors:
            t = clock.elapsed()
            real_anchors(result.anchors, clock)
            result.timings.append(f"anchors, real side {clock.elapsed() - t:.1f} s")
    finally:
        _shut(pool)


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--dry", action="store_true", help="graphmem's side only, on the CPU (no GPU needed)")
    p.add_argument("--models", default="", help=f"comma-separated subset of: {', '.join(zoo.ZOO)}")
    p.add_argument("--variants", default="", help=f"comma-separated subset of: {', '.join(zoo.VARIANTS)}")
    p.add_argument("--anchors", choices=("all", "quick", "none"), default="all")
    p.add_argument("--timeout", type=float, default=390.0,
                   help="seconds after which no new row starts (the whole run stays under 8 minutes)")
    p.add_argument("--jobs", type=int, default=None,
                   help="processes for graphmem's side (default: half the CPUs, at most 8; 1 on 4 CPUs or fewer)")
    p.add_argument("--docs", type=Path, default=DOCS, help="the Markdown file the section is written into")
    p.add_argument("--no-docs", action="store_true", help="print only")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> Run:
    args = _parse(argv)
    split: Callable[[str], list[str]] = lambda s: [x for x in s.split(",") if x]
    pairs = zoo.rows(split(args.models), split(args.variants))
    real = not args.dry
    if real and not torch.cuda.is_available():
        raise SystemExit("no GPU here: run with --dry for graphmem's side only")
    gpu_name, gpu = ("none (dry run: graphmem's side only)", "h100")
    if real:
        from graphmem.validation.validate import _target

        gpu_name, gpu = torch.cuda.get_device_name(), _target(torch.device("cuda", 0))["gpu"]
    clock = Clock(args.timeout)
    title = (f"### {'Dry run' if args.dry else 'GPU run'} · {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
             f"UTC · GPU: {gpu_name} · graphmem target gpu={gpu} · torch {torch.__version__}")
    result = Run(title, zoo=[ZooRow(name, variant.name) for name, variant in pairs])

    def alarm(signum: int, frame: Any) -> None:
        raise _Timeout()

    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(int(args.timeout) + ALARM_AFTER)
    try:
        _run(args, result, real, gpu, clock)
    except _Timeout:
        result.timings.append(f"stopped by the alarm at {clock.elapsed():.0f} s")
        for row in result.zoo:
            row.predicted = row.predicted or f"{SKIPPED} (alarm)"
    finally:
        signal.alarm(0)
    result.timings.append(f"total {clock.elapsed():.1f} s (guard {args.timeout:.0f} s)")
    text = markdown(result)
    print(text)
    if not args.no_docs:
        write_section(args.docs, "dry" if args.dry else "gpu", text)
    return result


if __name__ == "__main__":
    main()
