"""SLURM hostlist expansion: ``node[01-03,7],gpu-a[1-2]-ib`` -> names.

``scontrol show hostnames`` is the reference; this pure-Python copy is the
fallback where scontrol is not on PATH (inside a container, for example).
"""
from __future__ import annotations

import re
import shutil
import subprocess

from hpc_verl.errors import BootstrapError

_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise BootstrapError(f"hostlist {text!r}: unbalanced ']'; expected e.g. node[1-4]")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise BootstrapError(f"hostlist {text!r}: unbalanced '['; expected e.g. node[1-4]")
    parts.append("".join(cur))
    return [p for p in (s.strip() for s in parts) if p]


def _expand_one(pattern: str, whole: str) -> list[str]:
    start = pattern.find("[")
    if start < 0:
        return [pattern]
    end = pattern.find("]", start)
    prefix, body, rest = pattern[:start], pattern[start + 1:end], pattern[end + 1:]
    values: list[str] = []
    for item in body.split(","):
        m = _RANGE_RE.match(item.strip())
        if not m:
            raise BootstrapError(f"hostlist {whole!r}: bad range {item!r}; expected N or N-M")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise BootstrapError(f"hostlist {whole!r}: range {item!r} goes backwards")
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        values.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    tails = _expand_one(rest, whole)
    return [f"{prefix}{v}{t}" for v in values for t in tails]


def expand_hostlist(text: str) -> list[str]:
    """All host names of a SLURM hostlist expression, in order, duplicates kept out."""
    seen: dict[str, None] = {}
    for part in _split_top(text.strip()):
        for name in _expand_one(part, text):
            seen.setdefault(name, None)
    return list(seen)


def job_hostnames(nodelist: str) -> list[str]:
    """Expand with ``scontrol show hostnames`` when present, else in Python."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                 text=True, timeout=20)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            pass
    return expand_hostlist(nodelist)
