"""What every benchmark here shares: the JSON report, the equal-work rule, run order, CPU pinning, output.

The report has one fixed shape for every benchmark (``REPORT_KEYS``): a top-level
``ratio`` (ours over the strongest baseline in the run, or null when the run
refused to give one, with the reason in ``refused``), the run's record at the top
(``RECORD_KEYS``: the command, the commit measured, the date, the machine and the
load average at the start and end; ``run_record``, which every benchmark's report
takes), what the ratio means, the per-row figures (with the load next to each), the
settings and the versions. The latest report of each benchmark is kept in
``benchmarks/results/``; ``benchmarks/figures.py`` writes the docs' figures from them.
"""
from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hpc_verl.errors import HpcVerlError  # noqa: E402
from hpc_verl.util.fs import atomic_write_text  # noqa: E402

RECORD_KEYS = ("command", "commit", "date", "machine", "load")
REPORT_KEYS = ("benchmark", "ratio", *RECORD_KEYS, "ratio_definition", "baseline", "equal_work", "refused",
               "rows", "settings", "environment", "notes")
# what environment() measures that a report carries in its record (run_record), not in "environment"
_RECORDED = ("command", "commit", "date_utc", "host", "cpus", "cpus_usable", "cpu_model", "loadavg_start",
             "loadavg_end")
ROW_KINDS = ("ours", "baseline", "reference", "lower_bound", "extra")


class BenchError(HpcVerlError):
    """A benchmark could not run as asked (one line: what, where, how to fix)."""


# ---------------------------------------------------------------- statistics and order
def summary(values: Sequence[float]) -> dict[str, float | int]:
    """Median and spread (min, max) of repeated measurements."""
    if not values:
        raise BenchError("no measurements to summarise")
    vals = [float(v) for v in values]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def median_ratio_ci(ours: Sequence[float], base: Sequence[float], level: float = 0.95,
                    resamples: int = 2000) -> list[float]:
    """A bootstrap interval of median(ours) / median(base): both sides' rounds resampled with
    replacement (a fixed seed, so a report is reproducible from its rounds). How far the ratio
    of one run can be trusted; on a small shared machine it is a few per cent wide."""
    import random

    rng = random.Random(0)
    vals = []
    for _ in range(resamples):
        o = statistics.median(rng.choices(ours, k=len(ours)))
        b = statistics.median(rng.choices(base, k=len(base)))
        vals.append(o / b)
    vals.sort()
    lo = vals[int((1 - level) / 2 * resamples)]
    hi = vals[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return [round(lo, 4), round(hi, 4)]


def alternating(sides: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, side) in run order: the side order flips every repeat, so drift and load hit all alike."""
    out = []
    for r in range(repeats):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        out.extend((r, s) for s in order)
    return out


def equal_work(counts: Mapping[str, Sequence[Mapping[str, int]]]) -> str | None:
    """None when every side did the same work in every round; otherwise why not (one line).

    ``counts``: side -> the per-round count dicts (forward rows, backward rows,
    optimizer steps, generated tokens, ...) of all its timed rounds.
    """
    ref_side, ref = None, None
    for side, rounds in counts.items():
        if not rounds:
            return f"{side}: no counted rounds"
        for i, c in enumerate(rounds):
            if ref is None:
                ref_side, ref = side, dict(c)
                continue
            if dict(c) != ref:
                diff = ", ".join(f"{k} {ref.get(k)} vs {c.get(k)}" for k in sorted(set(ref) | set(c))
                                 if ref.get(k) != c.get(k))
                return f"work differs: {ref_side} round 1 vs {side} round {i + 1}: {diff}"
    return None


# ---------------------------------------------------------------- machine and report
def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def versions(names: Iterable[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def source_commit() -> str | None:
    """The checkout's commit the run measured, with ``+dirty`` when tracked files differ from it
    (a figure from uncommitted code is not a figure of the scripts as committed); None outside git."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``; the platform's answer elsewhere), None if unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def command_line() -> str:
    """How this run was started, as a command to paste from the checkout's root."""
    script = Path(sys.argv[0]).resolve()
    try:
        shown = str(script.relative_to(REPO))
    except ValueError:
        shown = script.name
    return " ".join(shlex.quote(a) for a in ["python", shown, *sys.argv[1:]])


def environment(packages: Iterable[str] = ("torch", "ray")) -> dict[str, Any]:
    """The machine at the start of a run (``finish`` adds the end)."""
    return {"date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": source_commit(), "command": command_line(),
            "host": platform.node(), "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
            "cpu_model": cpu_model(), "python": platform.python_version(), "versions": versions(packages),
            "loadavg_start": loadavg(), "loadavg_end": None}


def finish(env: dict[str, Any]) -> dict[str, Any]:
    env["loadavg_end"] = loadavg()
    return env


def run_record(env: Mapping[str, Any]) -> dict[str, Any]:
    """The top of every benchmark's ``--json`` report (``RECORD_KEYS``), from ``environment()``
    after ``finish()``: the command, the commit it measured, the date (UTC), the machine (cores
    this run could use, CPUs, CPU model, host) and the 1/5/15-minute load average at the start
    and the end."""
    return {"command": env.get("command"), "commit": env.get("commit"), "date": env.get("date_utc"),
            "machine": {"cores": env.get("cpus_usable"), "cpus": env.get("cpus"), "cpu_model": env.get("cpu_model"),
                        "host": env.get("host")},
            "load": {"start": env.get("loadavg_start"), "end": env.get("loadavg_end")}}


def record_of(report: Mapping[str, Any]) -> dict[str, Any]:
    """A report's record (``RECORD_KEYS``). A report written before the record moved to the top
    has it in its ``environment``; what such a run did not record (the CPU model) stays None."""
    if all(k in report for k in RECORD_KEYS):
        return {k: report[k] for k in RECORD_KEYS}
    return run_record(report.get("environment") or {})


def make_report(benchmark: str, *, ratio: float | None, ratio_definition: str, baseline: str | None,
                rows: list[dict], settings: Mapping[str, Any], env: dict[str, Any],
                equal_work_ok: bool | None = None, refused: str | None = None,
                notes: Sequence[str] = ()) -> dict[str, Any]:
    """The report every benchmark writes (validated here, so a bad shape fails before anything is written)."""
    report = {"benchmark": benchmark, "ratio": None if ratio is None else round(float(ratio), 4),
              **run_record(env),
              "ratio_definition": ratio_definition, "baseline": baseline, "equal_work": equal_work_ok,
              "refused": refused, "rows": rows, "settings": dict(settings),
              "environment": {k: v for k, v in env.items() if k not in _RECORDED}, "notes": list(notes)}
    validate_report(report)
    return report


def validate_report(report: Mapping[str, Any]) -> None:
    """Raise BenchError unless ``report`` has the fixed shape."""
    if tuple(report) != REPORT_KEYS:
        raise BenchError(f"report keys {list(report)} are not {list(REPORT_KEYS)}")
    ratio = report["ratio"]
    if ratio is not None and (not isinstance(ratio, (int, float)) or ratio <= 0):
        raise BenchError(f"report ratio {ratio!r} must be a positive number or null")
    if ratio is None and not report["refused"]:
        raise BenchError("a report without a ratio must say why (refused)")
    if ratio is not None and report["refused"]:
        raise BenchError("a report that refused a ratio must not carry one")
    if ratio is not None and report["equal_work"] is False:
        raise BenchError("no ratio may be given when the work differs")
    if not isinstance(report["rows"], list) or not report["rows"]:
        raise BenchError("a report needs at least one row")
    for row in report["rows"]:
        if not isinstance(row, dict) or not row.get("name") or row.get("kind") not in ROW_KINDS:
            raise BenchError(f"row {row!r}: needs a name and a kind in {ROW_KINDS}")
    validate_record(report)


def validate_record(report: Mapping[str, Any]) -> None:
    """Raise BenchError unless the report says what ran, when, at which commit, where and at what load."""
    for key in ("command", "date"):
        if not isinstance(report.get(key), str) or not report[key]:
            raise BenchError(f"report lacks its {key}")
    if "commit" not in report:
        raise BenchError("report lacks its commit (null only outside a git checkout)")
    if not isinstance(report.get("machine"), Mapping) or not report["machine"].get("cores"):
        raise BenchError("report lacks its machine (cores, CPU model)")
    if not isinstance(report.get("load"), Mapping) or report["load"].get("start") is None:
        raise BenchError("report lacks the load at its start")


def write_report(path: str | os.PathLike[str] | None, report: Mapping[str, Any]) -> None:
    """Write the report atomically (nothing half-written on failure)."""
    if path:
        validate_report(report)
        atomic_write_text(path, json.dumps(report, indent=2) + "\n")  # in REPORT_KEYS order


# ---------------------------------------------------------------- CPUs
def cpu_set(n: int | None) -> list[int]:
    """The first ``n`` CPUs this process may use (all when None)."""
    usable = sorted(os.sched_getaffinity(0))
    if n is None:
        return usable
    if n < 1 or n > len(usable):
        raise BenchError(f"--cores {n}: this process may use {len(usable)} CPU(s) ({usable}); "
                         f"give 1..{len(usable)}")
    return usable[:n]


def pin_to(cpus: Sequence[int]) -> Callable[[], None]:
    """A ``preexec_fn`` that pins a child (and everything it starts) to ``cpus``."""
    chosen = set(cpus)

    def _pin() -> None:
        os.sched_setaffinity(0, chosen)
    return _pin


def thread_env(threads: int) -> dict[str, str]:
    """Thread-count variables so every library in a child uses ``threads`` threads."""
    t = str(threads)
    return {"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, "OPENBLAS_NUM_THREADS": t, "TOKENIZERS_PARALLELISM": "false",
            "RAY_USAGE_STATS_ENABLED": "0"}


# ---------------------------------------------------------------- output
def console() -> Any:
    from rich.console import Console
    return Console() if sys.stdout.isatty() else Console(width=150)  # logs and pipes: no wrapped tables


def progress(con: Any) -> Any:
    """A rich progress display (transient: it leaves only the printed lines behind)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=con, transient=True)


def table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> Any:
    from rich.table import Table
    t = Table(title=title)
    for i, col in enumerate(columns):
        t.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*[fmt(v) for v in row])
    return t


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def publish(con: Any, report: Mapping[str, Any], path: str | None, show: Callable[[Any, Any], None]) -> int:
    """Print the report (the benchmark's own tables) and write it with ``--json``; the exit status."""
    show(con, report)
    write_report(path, report)
    return 0


def ratio_line(report: Mapping[str, Any]) -> str:
    """The one line every benchmark ends with."""
    if report["ratio"] is None:
        return f"{report['benchmark']}: no ratio: {report['refused']}"
    return f"{report['benchmark']}: ratio {report['ratio']:.3f} ({report['ratio_definition']})"


def add_common_args(parser: Any, repeats: int = 3) -> None:
    parser.add_argument("--json", metavar="FILE", help="write the report (fixed shape, top-level 'ratio') here")
    parser.add_argument("--repeats", type=int, default=repeats,
                        help="fresh measurements per side, order alternated (default: %(default)s; >= 3 for "
                             "figures worth quoting)")


def parse(parser: Any, argv: Sequence[str] | None) -> tuple[Any, Any]:
    """(parser, args) with the shared checks done; ``args.notes`` holds the notes for the report."""
    a = parser.parse_args(argv)
    if a.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {a.repeats}")
    a.notes = [] if a.repeats >= 3 else [f"only {a.repeats} repeat(s): a check of the script, not a figure to quote"]
    return parser, a
