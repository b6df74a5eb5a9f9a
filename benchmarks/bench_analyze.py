#!/usr/bin/env python
"""How long does graphmem take, next to the bare fake step it records and to PyTorch's MemTracker?

For each case (a bundled preset and an input shape), in one process, on the same model and
shape, this times:

  bare        the bare training step on fake tensors: the model is built inside
              ``FakeTensorMode`` (construction NOT timed), then only
              ``out = model(*inputs); loss = loss_fn(out, inputs); loss.backward()`` is timed.
              This is the floor any fake-tensor analysis of the step pays.
  graphmem    ``graphmem.analyze(module, input_shape=shape, loss=loss_fn)`` on a module built
              once under ``torch.device("meta")`` (construction NOT timed; graphmem's own fake
              parameter creation, capture and passes are). Used for the ratios.
  graphmem-all  the same with ``reuse=False``: every block of the chain captured (no copies of a
              captured block, see graphmem/capture/reuse.py); shown beside the default.
  graphmem+   ``graphmem.analyze(preset_name, input_shape=shape)`` end to end, including the
              meta construction of the preset (what the CLI pays).
  memtracker  ``torch.distributed._tools.mem_tracker.MemTracker`` tracking the same step on a
              model built inside ``FakeTensorMode`` like ``bare`` (construction NOT timed;
              creating the tracker, ``track_external`` and the tracked step are).
  compiled    (with ``--compiled``) ``graphmem.analyze(module, mode="compiled")``: torch.compile's
              step on fake tensors (dynamo, AOTAutograd, the min-cut partitioner; a deep chain
              compiled once at depth 6 and widened, graphmem/capture/reuse_compiled.py), with the
              eager capture beside it; printed next to the eager ``graphmem`` time (their ratio,
              wall and the process's CPU time: the machine may be shared) and the process's peak
              RSS after each.

Each method first runs once on a shallow copy of each family (one block) at a tiny shape, so the
one-time cost of the first ``FakeTensorMode`` use in a process (~1-2 s: decompositions, meta
kernels, dispatch caches) is not charged to whichever method happens to run first. The warm-up
uses a shallow model because the cost of a fake step is set by the number of ops, not by the
shape: the full gpt2-xl at 1x8 costs as much as at 32x1024.

Each method runs up to ``--repeat`` times per case and the best (minimum) time is reported; a
method stops repeating early once another run would take its total for the case past
``--budget`` seconds (MemTracker on gpt2-xl takes ~35 s a run, so it runs once by default).
``gc.collect()`` runs before every measurement, outside the timed region.

Run from the repository root with the venv active:

    python benchmarks/bench_analyze.py                       # gpt2-xl 32x1024, llama-2-7b 1x4096
    python benchmarks/bench_analyze.py --cases gpt2:2x128    # quick
    python benchmarks/bench_analyze.py --cases gpt2-xl:32x1024 llama-2-7b:1x4096 --repeat 5 --budget 60
    python benchmarks/bench_analyze.py --cases gpt2-xl:32x1024 --compiled   # + compiled mode vs eager, RSS
    python benchmarks/bench_analyze.py --cases gpt2-xl:32x1024 --compiled --phases   # + where it goes
    python benchmarks/bench_analyze.py --cases gpt2-xl:32x1024 --compiled --floor    # + torch.compile alone

Nothing is asserted: it is a benchmark. The goals are printed next to the ratios.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import platform
import resource
import sys
import time
import warnings
from typing import Any, Callable

import torch
from tabulate import tabulate
from torch._subclasses.fake_tensor import FakeTensorMode

import graphmem
import graphmem.models as models

GOAL_GRAPHMEM_OVER_BARE = 1.5  # graphmem <= 1.5x bare
GOAL_MEMTRACKER_OVER_GRAPHMEM = 10.0  # memtracker >= 10x graphmem
GOAL_LINE = "goal: graphmem <= 1.5x bare, memtracker >= 10x graphmem"

DEFAULT_CASES = ["gpt2-xl:32x1024", "llama-2-7b:1x4096"]

METHODS = ("bare", "graphmem", "graphmem-all", "graphmem+", "memtracker")
LABELS = {
    "bare": "bare fake fwd+loss+bwd (excl. construction)",
    "graphmem": "graphmem.analyze(module) (excl. construction)",
    "graphmem-all": "graphmem.analyze(module, reuse=False): every block captured",
    "graphmem+": "graphmem.analyze(preset name) (incl. meta construction)",
    "memtracker": "MemTracker under FakeTensorMode (excl. construction)",
    "compiled": "graphmem.analyze(module, mode=\"compiled\") (eager beside it included)",
}
GOAL_COMPILED_OVER_EAGER = 2.0  # compiled analysis <= 2x the eager one (issue 18)


# -- cases ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    preset: str
    shape: tuple[int, ...]

    @property
    def label(self) -> str:
        return f"{self.preset} {'x'.join(map(str, self.shape))}"


def parse_cases(specs: list[str]) -> list[Case]:
    cases = []
    for spec in (s for arg in specs for s in arg.split(",") if s.strip()):
        name, sep, shape = spec.strip().rpartition(":")
        if not sep or not name:
            raise SystemExit(f"bad case {spec!r}: expected PRESET:SHAPE, e.g. gpt2:2x128")
        if name not in models.PRESETS:
            raise SystemExit(f"unknown preset {name!r}; known: {', '.join(models.preset_names())}")
        try:
            cases.append(Case(name, graphmem.parse_shape(shape)))
        except graphmem.UsageError as e:
            raise SystemExit(str(e)) from None
    return cases


def shallow_field(config: Any) -> str:
    """The config field that sets the number of blocks of a transformer preset."""
    fields = {f.name for f in dataclasses.fields(config)}
    for name in ("n_layer", "n_layers"):
        if name in fields:
            return name
    raise SystemExit(f"{type(config).__name__} has no n_layer or n_layers field: --floor is for transformer presets")


def shallow_config(config: Any) -> Any:
    """The same family and widths with one block, so a warm-up sees the same kinds of ops fast."""
    fields = {f.name for f in dataclasses.fields(config)}
    for name in ("n_layer", "n_layers"):
        if name in fields:
            return dataclasses.replace(config, **{name: 1})
    if "layers" in fields and isinstance(config.layers, tuple):  # resnet: blocks per stage
        return dataclasses.replace(config, layers=tuple(1 for _ in config.layers))
    return config


def tiny_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    # batch <= 2 (BatchNorm in training needs 2 values per channel); the other dims are kept, they
    # may be fixed by the model (features, channels) and a fake step's cost hardly depends on them
    return (min(shape[0], 2),) + shape[1:]


# -- the measured methods ---------------------------------------------------------------------
# Each returns (seconds, extra); only the region between the two perf_counter() calls is timed.

def run_bare(family: Any, config: Any, shape: tuple[int, ...]) -> tuple[float, dict]:
    # Built directly inside a fresh FakeTensorMode with cpu as the default device: parameters
    # and inputs are fake from the start, and construction is outside the timed region.
    with FakeTensorMode(), torch.device("cpu"):
        model = family.build(config)
        model.train()
        inputs = family.example_inputs(shape, config)
        t0 = time.perf_counter()
        out = model(*inputs)
        loss = family.loss(out, inputs)
        loss.backward()
        seconds = time.perf_counter() - t0
    del model, inputs, out, loss
    return seconds, {}


def run_graphmem_module(module: torch.nn.Module, shape: tuple[int, ...], loss_fn: Callable,
                        reuse: bool = True) -> tuple[float, dict]:
    t0, c0 = time.perf_counter(), time.process_time()
    report = graphmem.analyze(module, input_shape=shape, loss=loss_fn, reuse=reuse)
    seconds = time.perf_counter() - t0
    _CPU.setdefault("graphmem" if reuse else "graphmem-all", []).append(time.process_time() - c0)
    return seconds, {"activation_bytes": report.activation_bytes, "peak_bytes": report.peak_bytes,
                     "baseline_bytes": report.baseline_bytes, "num_ops": report.num_ops}


def run_graphmem_compiled(module: torch.nn.Module, shape: tuple[int, ...], loss_fn: Callable) -> tuple[float, dict]:
    t0, c0 = time.perf_counter(), time.process_time()
    report = graphmem.analyze(module, input_shape=shape, loss=loss_fn, mode="compiled")
    seconds = time.perf_counter() - t0
    _CPU.setdefault("compiled", []).append(time.process_time() - c0)
    return seconds, {"activation_bytes": report.activation_bytes, "peak_bytes": report.peak_bytes,
                     "num_ops": report.num_ops, "notes": report.notes, "rss_mib": peak_rss_mib()}


def run_bare_compiled(family: Any, config: Any, shape: tuple[int, ...], blocks: int) -> tuple[float, dict]:
    """torch.compile's own step, no graphmem: the model cut to ``blocks`` blocks, built inside a
    FakeTensorMode as in run_bare, ``torch.compile(model, backend="aot_eager", dynamic=False)``,
    then forward, loss and backward (dynamo, AOTAutograd's joint graph, the min-cut partitioner,
    the backward compiled lazily as torch does by default). Timed: the compiled call and the
    backward. The floor of any compiled analysis that runs the engine on that many blocks."""
    config = dataclasses.replace(config, **{shallow_field(config): blocks})
    torch._dynamo.reset()  # nothing cached from an earlier run
    with FakeTensorMode(), torch.device("cpu"):
        model = family.build(config)
        model.train()
        inputs = family.example_inputs(shape, config)
        step = torch.compile(model, backend="aot_eager", dynamic=False)
        t0, c0 = time.perf_counter(), time.process_time()
        out = step(*inputs)
        family.loss(out, inputs).backward()
        seconds = time.perf_counter() - t0
        _CPU.setdefault(f"compiled-bare-{blocks}", []).append(time.process_time() - c0)
    del model, inputs, out, step
    torch._dynamo.reset()
    return seconds, {}


_CPU: dict[str, list[float]] = {}  # CPU seconds of this process per run, by method (the machine may be shared)


def run_graphmem_preset(preset: str, shape: tuple[int, ...]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    report = graphmem.analyze(preset, input_shape=shape)
    seconds = time.perf_counter() - t0
    return seconds, {"activation_bytes": report.activation_bytes, "peak_bytes": report.peak_bytes}


def run_memtracker(family: Any, config: Any, shape: tuple[int, ...]) -> tuple[float, dict]:
    # How MemTracker is run, from its source (torch/distributed/_tools/mem_tracker.py):
    # - It is a TorchDispatchMode plus module hooks (ModTracker); it needs NO process group and
    #   no torch.distributed.init_process_group: importing it only registers fake collectives.
    # - It must be ENTERED WHILE THE FakeTensorMode IS ACTIVE: __enter__ records
    #   active_fake_mode(), and __torch_dispatch__ only counts ops whose active fake mode is that
    #   same object (the check that skips DTensor's nested propagation modes). Entered outside
    #   the fake mode it would silently record nothing for our fake ops.
    # - Parameters, buffers and inputs made before entering are registered with
    #   track_external(model, *inputs) (as in its docstring); no optimizer: the step measured is
    #   forward + loss + backward only, as for graphmem.
    # The model is built inside the fake mode exactly as in run_bare (construction not timed);
    # creating the tracker, track_external and the tracked step are timed.
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode(), torch.device("cpu"):
        model = family.build(config)
        model.train()
        inputs = family.example_inputs(shape, config)
        t0 = time.perf_counter()
        tracker = MemTracker()
        tracker.track_external(model, *inputs)
        with tracker:
            out = model(*inputs)
            loss = family.loss(out, inputs)
            loss.backward()
        seconds = time.perf_counter() - t0
        peak = tracker.get_tracker_snapshot("peak")
    del model, inputs, out, loss, tracker
    # {device: {_MemRefType.PARAM: bytes, ..., "Total": bytes}} -> one device, plain keys
    snap = next(iter(peak.values())) if peak else {}
    return seconds, {"snapshot": {getattr(k, "value", k): v for k, v in snap.items()}}


# -- driver -----------------------------------------------------------------------------------
def measure(fn: Callable[[], tuple[float, dict]], repeat: int, budget: float) -> tuple[list[float], dict]:
    times: list[float] = []
    extra: dict = {}
    while len(times) < repeat:
        gc.collect()
        seconds, extra = fn()
        times.append(seconds)
        if sum(times) + times[-1] > budget:  # another run would take this method past the budget
            break
    gc.collect()
    return times, extra


def peak_rss_mib() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB on Linux


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n:,} B ({n / 2**30:,.2f} GiB)"


def warm_up(cases: list[Case], compiled: bool = False) -> float:
    t0 = time.perf_counter()
    done = set()
    for case in cases:
        family = models.family_of(case.preset)
        if family.__name__ in done:
            continue
        done.add(family.__name__)
        config = shallow_config(models.config_of(case.preset))
        shape = tiny_shape(case.shape)
        run_bare(family, config, shape)
        with torch.device("meta"):
            module = family.build(config)
        run_graphmem_module(module, shape, family.loss)
        run_memtracker(family, config, shape)
        if compiled:  # dynamo's and AOTAutograd's first-use imports and caches
            run_graphmem_compiled(module, shape, family.loss)
    run_graphmem_preset(cases[0].preset, tiny_shape(cases[0].shape))  # the by-name path (meta build, load)
    gc.collect()
    return time.perf_counter() - t0


def bench_case(case: Case, repeat: int, budget: float, methods: tuple[str, ...] = METHODS) -> dict:
    family = models.family_of(case.preset)
    config = models.config_of(case.preset)
    with torch.device("meta"):  # built once, reused: graphmem leaves the module as it was
        meta_module = models.build(case.preset)
    runs = {
        "bare": lambda: run_bare(family, config, case.shape),
        "graphmem": lambda: run_graphmem_module(meta_module, case.shape, family.loss),
        "graphmem-all": lambda: run_graphmem_module(meta_module, case.shape, family.loss, reuse=False),
        "graphmem+": lambda: run_graphmem_preset(case.preset, case.shape),
        "memtracker": lambda: run_memtracker(family, config, case.shape),
        "compiled": lambda: run_graphmem_compiled(meta_module, case.shape, family.loss),
        "compiled-bare-1": lambda: run_bare_compiled(family, config, case.shape, 1),
        "compiled-bare-6": lambda: run_bare_compiled(family, config, case.shape, 6),
    }
    result = {}
    for method in methods:
        _CPU.pop(method, None)
        times, extra = measure(runs[method], repeat, budget)
        result[method] = {"times": times, "best": min(times), "extra": extra, "rss_mib": peak_rss_mib(),
                          "cpu": min(_CPU.pop(method, [float("nan")]))}
        print(f"  {method:<10} best {min(times):8.3f} s of {len(times)} run(s); peak RSS so far "
              f"{peak_rss_mib():,.0f} MiB", flush=True)
    gc.collect()
    return result


def print_case(case: Case, r: dict) -> None:
    print(f"\n=== {case.label} ===")
    rows = [[LABELS[m], f"{r[m]['best']:.3f}", len(r[m]["times"]),
             " ".join(f"{t:.3f}" for t in r[m]["times"])] for m in METHODS]
    print(tabulate(rows, headers=["method", "best s", "runs", "all runs (s)"], disable_numparse=True))

    g_over_b = r["graphmem"]["best"] / r["bare"]["best"]
    m_over_g = r["memtracker"]["best"] / r["graphmem"]["best"]
    gp_over_b = r["graphmem+"]["best"] / r["bare"]["best"]
    print()
    print(tabulate([
        ["graphmem / bare", f"{g_over_b:.2f}x", f"<= {GOAL_GRAPHMEM_OVER_BARE:g}x",
         "yes" if g_over_b <= GOAL_GRAPHMEM_OVER_BARE else "no"],
        ["memtracker / graphmem", f"{m_over_g:.2f}x", f">= {GOAL_MEMTRACKER_OVER_GRAPHMEM:g}x",
         "yes" if m_over_g >= GOAL_MEMTRACKER_OVER_GRAPHMEM else "no"],
        ["(graphmem, every block captured / bare)", f"{r['graphmem-all']['best'] / r['bare']['best']:.2f}x",
         f"<= {GOAL_GRAPHMEM_OVER_BARE:g}x", ""],
        ["(memtracker / graphmem, every block captured)", f"{r['memtracker']['best'] / r['graphmem-all']['best']:.2f}x",
         f">= {GOAL_MEMTRACKER_OVER_GRAPHMEM:g}x", ""],
        ["(graphmem incl. construction / bare)", f"{gp_over_b:.2f}x", "", ""],
    ], headers=["ratio (best times)", "value", "goal", "meets goal"], disable_numparse=True))
    print(GOAL_LINE)

    g = r["graphmem"]["extra"]
    gp = r["graphmem+"]["extra"]
    mt = r["memtracker"]["extra"].get("snapshot", {})
    print()
    print(tabulate([
        ["peak (params + buffers + inputs + everything live)", fmt_bytes(g["peak_bytes"]), fmt_bytes(mt.get("Total"))],
        ["activations: graphmem = saved for backward; MemTracker = 'Activation' at its peak",
         fmt_bytes(g["activation_bytes"]), fmt_bytes(mt.get("Activation"))],
    ], headers=["bytes", "graphmem", "MemTracker"], disable_numparse=True))
    if mt:
        parts = ", ".join(f"{k} {v:,}" for k, v in mt.items() if k != "Total" and v)
        print(f"MemTracker peak breakdown: {parts}")
    ga = r["graphmem-all"]["extra"]
    same = g["peak_bytes"] == gp["peak_bytes"] == ga["peak_bytes"] and \
        g["activation_bytes"] == gp["activation_bytes"] == ga["activation_bytes"]
    print(f"graphmem by module, by preset name and with every block captured agree: {'yes' if same else 'NO'}; "
          f"graphmem recorded {g['num_ops']:,} ops; peak RSS so far {peak_rss_mib():,.0f} MiB")
    if "compiled" in r:
        print_compiled(r)


def print_compiled(r: dict) -> None:
    c, e = r["compiled"], r["graphmem"]
    ratio = c["best"] / e["best"]
    print()
    print(tabulate([
        ["eager: graphmem.analyze(module)", f"{e['best']:.3f}", f"{e['cpu']:.3f}", f"{e['rss_mib']:,.0f}"],
        ["compiled: graphmem.analyze(module, mode=\"compiled\")", f"{c['best']:.3f}", f"{c['cpu']:.3f}",
         f"{c['rss_mib']:,.0f}"],
        ["compiled / eager", f"{ratio:.2f}x (goal <= {GOAL_COMPILED_OVER_EAGER:g}x: "
         f"{'yes' if ratio <= GOAL_COMPILED_OVER_EAGER else 'no'})", f"{c['cpu'] / e['cpu']:.2f}x", ""],
    ], headers=["analysis", "best wall s", "best CPU s", "peak RSS after (MiB)"], disable_numparse=True))
    if "compiled-bare-1" in r:
        print_floor(r)
    x = c["extra"]
    print(f"compiled: {x['num_ops']:,} ops, saved {fmt_bytes(x['activation_bytes'])}, peak {fmt_bytes(x['peak_bytes'])}"
          + "".join(f"\n  note: {n}" for n in x["notes"] if "depth reuse" in n))


def print_floor(r: dict) -> None:
    """What torch.compile itself costs on the model cut to 1 and to 6 blocks, next to the eager
    analysis: a compiled analysis runs the engine on at least one block, and compiled mode also
    reports the eager step, so (one block's compile + the eager analysis) / the eager analysis is
    a floor of the compiled / eager ratio for any scheme that compiles fewer blocks than now."""
    e = r["graphmem"]
    one, six = r["compiled-bare-1"], r["compiled-bare-6"]
    floor = (one["best"] + e["best"]) / e["best"]
    print(tabulate([
        ["torch.compile(aot_eager) step, model cut to 1 block (no graphmem)", f"{one['best']:.3f}",
         f"{one['cpu']:.3f}", f"{one['best'] / e['best']:.2f}x"],
        ["torch.compile(aot_eager) step, model cut to 6 blocks (no graphmem)", f"{six['best']:.3f}",
         f"{six['cpu']:.3f}", f"{six['best'] / e['best']:.2f}x"],
        ["floor of compiled / eager: (1-block compile + eager analysis) / eager analysis", f"{floor:.2f}x",
         "", ""],
    ], headers=["the engine alone (floor)", "best wall s", "best CPU s", "/ eager analysis"],
        disable_numparse=True))


def compiled_phases(module: torch.nn.Module, shape: tuple[int, ...], loss_fn: Callable) -> list[tuple[str, float, int]]:
    """One more compiled analysis with timers (the process's CPU seconds) around the functions
    where it goes: (label, seconds, calls). Nested: the trace holds dynamo's compile, which holds
    AOTAutograd's joint graph and its partition (rows starting with dots are inside the row
    above them with fewer dots)."""
    import torch._dynamo.backends.debugging as debugging  # (aot_eager passes the partitioner it imported)
    import torch._dynamo.convert_frame as convert_frame
    import torch._functorch.aot_autograd as aot_autograd  # (it calls the stages by the names it imported)

    import graphmem.api as api
    import graphmem.capture.compiled as compiled
    import graphmem.capture.reuse_compiled as reuse_compiled
    import graphmem.step.recapture as recapture

    spots = [(recapture, "capture", "captures: compiled at depth 6 (or every block), the eager check's at 5 and 6"),
             (compiled.CompiledStep, "trace", ". the compiled trace (dynamo, AOTAutograd, the forward on fake tensors)"),
             (convert_frame, "_compile", ". . dynamo's compile (AOTAutograd included)"),
             (aot_autograd, "aot_stage1_graph_capture", ". . . AOTAutograd's joint graph"),
             (aot_autograd, "aot_stage2_compile", ". . . AOTAutograd's partition and graph compilers"),
             (debugging, "min_cut_rematerialization_partition", ". . . . the min-cut partitioner"),
             (compiled.CompiledStep, "replay", ". the replay's forward (its backward is in the capture's row only)"),
             (reuse_compiled, "widen", "widen (the block-3 check, then to full depth)"),
             (api, "capture", "the eager analysis beside the compiled one: its captures")]
    spent: dict[str, list[float]] = {}
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in spots]

    def timed(fn: Callable, label: str) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            c0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent.setdefault(label, []).append(time.process_time() - c0)
        return run
    for (owner, name, label), (_, _, fn) in zip(spots, saved):
        setattr(owner, name, staticmethod(timed(fn, label)) if isinstance(owner, type) and name == "trace"
                else timed(fn, label))
    try:
        gc.collect()
        c0 = time.process_time()
        graphmem.analyze(module, input_shape=shape, loss=loss_fn, mode="compiled")
        total = time.process_time() - c0
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, staticmethod(fn) if isinstance(owner, type) and name == "trace" else fn)
    return [("the compiled analysis", total, 1)] + [(label, sum(spent.get(label, [])), len(spent.get(label, [])))
                                                     for _, _, label in spots]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=DEFAULT_CASES, metavar="PRESET:SHAPE",
                    help=f"cases to run, space- or comma-separated (default: {' '.join(DEFAULT_CASES)})")
    ap.add_argument("--repeat", type=int, default=3, help="runs per method; the best (min) is reported (default 3)")
    ap.add_argument("--compiled", action="store_true",
                    help="also time graphmem.analyze(module, mode=\"compiled\") and print compiled / eager and RSS")
    ap.add_argument("--phases", action="store_true",
                    help="with --compiled: one more compiled analysis per case, timed by phase (CPU seconds)")
    ap.add_argument("--floor", action="store_true",
                    help="with --compiled: also time torch.compile's own step (aot_eager, fake tensors, no graphmem) "
                         "on the model cut to 1 and to 6 blocks: the floor of the compiled / eager ratio")
    ap.add_argument("--budget", type=float, default=20.0,
                    help="seconds per method per case: stop repeating once another run would exceed it (default 20)")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        raise SystemExit("--repeat must be at least 1")
    if args.floor and not args.compiled:
        raise SystemExit("--floor goes with --compiled")
    cases = parse_cases(args.cases)
    warnings.filterwarnings("ignore", category=UserWarning)

    t_start = time.perf_counter()
    print(f"graphmem {graphmem.__version__}, torch {torch.__version__}, Python {platform.python_version()}, "
          f"{platform.machine()} {platform.system()}, {torch.get_num_threads()} torch threads")
    print(f"cases: {', '.join(c.label for c in cases)}; best of up to {args.repeat} run(s) per method, "
          f"budget {args.budget:g} s per method per case; gc.collect() before each run")
    families = sorted({models.family_of(c.preset).__name__.rsplit('.', 1)[-1] for c in cases})
    print(f"warm-up: each method once on a 1-block {'/'.join(families)} at a tiny shape, so the one-time "
          "FakeTensorMode setup of the process is not charged to the first method; not counted ...",
          end=" ", flush=True)
    print(f"{warm_up(cases, args.compiled):.1f} s")

    results = []
    for case in cases:
        print(f"\n{case.label}:", flush=True)
        extra = (("compiled",) if args.compiled else ()) + (("compiled-bare-1", "compiled-bare-6") if args.floor else ())
        r = bench_case(case, args.repeat, args.budget, METHODS + extra)
        print_case(case, r)
        results.append((case, r))
        if args.compiled and args.phases:
            with torch.device("meta"):
                module = models.build(case.preset)
            phases = compiled_phases(module, case.shape, models.family_of(case.preset).loss)
            print(tabulate([[label, f"{sec:.3f}", n] for label, sec, n in phases],
                           headers=["where the compiled analysis goes", "CPU s", "calls"], disable_numparse=True))

    if len(results) > 1:
        print("\n=== summary (best seconds) ===")
        rows = [[c.label, f"{r['bare']['best']:.3f}", f"{r['graphmem']['best']:.3f}",
                 f"{r['graphmem+']['best']:.3f}", f"{r['memtracker']['best']:.3f}",
                 f"{r['graphmem']['best'] / r['bare']['best']:.2f}x",
                 f"{r['memtracker']['best'] / r['graphmem']['best']:.2f}x"] for c, r in results]
        print(tabulate(rows, headers=["case", "bare", "graphmem", "graphmem incl. build", "memtracker",
                                      "graphmem/bare", "memtracker/graphmem"], disable_numparse=True))
        print(GOAL_LINE)
    print(f"\npeak RSS of the process: {peak_rss_mib():,.0f} MiB; total wall time "
          f"{time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
