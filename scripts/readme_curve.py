#!/usr/bin/env python3
"""Put the demo's own reward curve into README.md.

``bash scripts/demo.sh`` saves what ``hpc-verl plot`` drew for its main job in
``runs/demo/curve.txt`` (with the run's commit and date); this script copies that text, unchanged,
between the README's ``<!-- demo-curve:begin -->`` and ``<!-- demo-curve:end -->`` markers, so the
curve a reader sees is the one a run printed, never one edited by hand.

    .venv/bin/python scripts/readme_curve.py [runs/demo/curve.txt]
    .venv/bin/python scripts/readme_curve.py --check    # exit 1 when README's block is not a demo curve
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BEGIN, END = "<!-- demo-curve:begin -->", "<!-- demo-curve:end -->"
LAST = re.compile(r"last (\d+) steps (\d+\.\d+)")


def block(readme: str) -> str:
    """The README's curve block (between the markers), or '' when it has none."""
    if BEGIN not in readme or END not in readme:
        return ""
    return readme[readme.index(BEGIN) + len(BEGIN):readme.index(END)]


def last_mean(text: str) -> float | None:
    """The 'last N steps X' mean the plot printed."""
    m = LAST.search(text)
    return float(m.group(2)) if m else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("curve", nargs="?", default=str(REPO / "runs" / "demo" / "curve.txt"))
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    readme = README.read_text()
    if args.check:
        shown = block(readme)
        ok = "run:" in shown and last_mean(shown) is not None
        print("README curve: " + ("a demo run's" if ok else "missing or not a demo run's"))
        return 0 if ok else 1
    try:
        saved = Path(args.curve).read_text().splitlines()
        # the chart as drawn and the run it came from (not plot's "wrote <path>" line)
        curve = "\n".join(ln for ln in saved if not ln.startswith("plot:")).strip("\n")
    except OSError as exc:
        print(f"readme_curve: cannot read {args.curve} ({exc.strerror}); run 'bash scripts/demo.sh' first",
              file=sys.stderr)
        return 2
    if last_mean(curve) is None or "run:" not in curve:
        print(f"readme_curve: {args.curve} is not a curve saved by scripts/demo.sh", file=sys.stderr)
        return 2
    if not block(readme) and (BEGIN not in readme or END not in readme):
        print(f"readme_curve: README.md has no {BEGIN} ... {END} block", file=sys.stderr)
        return 2
    new = readme.replace(BEGIN + block(readme) + END, f"{BEGIN}\n```text\n{curve}\n```\n{END}")
    tmp = README.with_suffix(".md.tmp")
    tmp.write_text(new)
    tmp.replace(README)
    print(f"README.md: the curve of {args.curve} (last-10 mean {last_mean(curve):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
