"""Benchmark figures in the docs come from results files, never from prose.

``benchmarks/results/<benchmark>.json`` holds a benchmark's latest ``--json`` report;
``benchmarks/figures.py`` writes README.md's headline table and docs/benchmarks.md's "Latest
figures" table from them. These tests fail when a quoted figure is not in a results file (the
generated text is out of date or edited by hand), when a results file lacks its record, or
when a benchmark script has no method section to link to."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import figures as F  # noqa: E402
from benchmarks.benchlib import record_of  # noqa: E402


def _between(path: Path, markers: tuple[str, str]) -> str:
    text = path.read_text()
    return text[text.index(markers[0]) + len(markers[0]):text.index(markers[1])]


def _ratio_cells(block: str, column: int) -> list[str]:
    rows = [line for line in block.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    return [[c.strip() for c in row.strip("|").split("|")][column] for row in rows[1:]]


def test_generated_tables_are_up_to_date():
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "figures.py"), "--check"],
                         capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0, res.stderr


def test_every_quoted_ratio_is_in_a_results_file():
    results = F.load_results()
    recorded = {F.fmt_ratio(r.report["ratio"]) for r in results if r.report["ratio"] is not None}
    quoted = (_ratio_cells(_between(F.README, F.README_MARKERS), 2)
              + _ratio_cells(_between(F.DOC, F.DOC_MARKERS), 3))
    assert len(quoted) == 2 * len(results) and len(_ratio_cells(_between(F.README, F.README_MARKERS), 2)) <= 8
    for cell in quoted:
        figure = re.match(r"\*\*([0-9.]+)\*\*", cell)
        assert figure and figure.group(1) in recorded, f"{cell!r} is not the ratio of any results file"


def test_every_results_file_has_its_ratio_and_record():
    files = sorted((REPO / "benchmarks" / "results").glob("*.json"))
    assert files
    for path in files:
        report = json.loads(path.read_text())
        assert report.get("benchmark") in F.BENCHMARKS, path
        assert "ratio" in report and (report["ratio"] is not None or report.get("refused")), path
        rec = record_of(report)
        for key in ("command", "commit", "date"):
            assert isinstance(rec[key], str) and rec[key], f"{path.name}: no {key}"


def test_every_benchmark_with_a_report_has_a_method_section_and_a_table_entry():
    doc = F.DOC.read_text()
    headings = {F.anchor(h) for h in re.findall(r"^#+ (.+)$", doc, flags=re.M)}
    scripts = [p.stem for p in (REPO / "benchmarks").glob("*.py")
               if "--json" in p.read_text() or "add_common_args(p" in p.read_text()]
    scripts = [s for s in scripts if s not in ("benchlib", "figures")]
    assert {"bringup", "startup", "dataflow_overhead", "ppo_throughput", "scale_out", "vs_verl"} <= set(scripts)
    for name in scripts:
        assert name in F.BENCHMARKS, f"benchmarks/{name}.py writes a report but figures.py does not know it"
        assert F.anchor(f"{name}.py") in headings, f"docs/benchmarks.md has no '## {name}.py' section"
        assert f"--json benchmarks/results/{name}.json" in doc, f"no run command for {name}.py"
    for link in re.findall(r"\(docs/benchmarks\.md#([\w-]+)\)", F.README.read_text()):
        assert link in headings, link
    assert len(doc.splitlines()) <= 300


def test_a_benchmark_without_results_gets_no_row(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    doc, readme = tmp_path / "b.md", tmp_path / "R.md"
    doc.write_text(f"x\n{F.DOC_MARKERS[0]}\nold\n{F.DOC_MARKERS[1]}\ny\n")
    readme.write_text(f"{F.README_MARKERS[0]}{F.README_MARKERS[1]}\n")
    rep = {"benchmark": "startup", "ratio": 0.9551, "command": "python benchmarks/startup.py --json x",
           "commit": "abc", "date": "2026-01-02T03:04:05Z",
           "machine": {"cores": 2, "cpus": 2, "cpu_model": "Some CPU", "host": "h"},
           "load": {"start": [0.5, 0.4, 0.3], "end": [1.0, 0.5, 0.4]}, "settings": {"params": 21e6}}
    (results / "startup.json").write_text(json.dumps(rep))
    pages = F.render(results, doc, readme)
    text = pages[doc]
    assert text.startswith("x\n") and text.endswith("y\n") and "old" not in text
    assert "**0.96** (lower is better)" in text and "2 cores, Some CPU, load 0.5 → 1" in text
    assert "`python benchmarks/startup.py --json x`" in text and "21.0M-parameter" in text
    assert "ppo_throughput.py" in text.split("No results file yet")[1]   # named, with no figure
    assert "startup" in pages[readme] and "ppo_throughput" not in pages[readme]
    (results / "bogus.json").write_text(json.dumps(dict(rep, benchmark="nope")))
    with pytest.raises(SystemExit, match="not one of"):
        F.render(results, doc, readme)
