"""Extract the main_ppo argument lists of verl's example launch scripts (a one-off; see README.md).

Each ``examples/**/run_*.sh`` of a verl checkout runs in bash with an empty environment, a
scratch working directory and a PATH holding only stubs: ``python3``/``python`` record the
arguments of ``-m verl.trainer.main_ppo`` and exit (``python3 -c ...`` fails, so probes such as
``import torch_npu`` take their GPU branch), ``uv`` runs its trailing ``python3``, and a short list
of harmless tools (date, nproc, dirname, ...) is linked in. Anything else (downloads, pip, ray,
nvidia-smi) is not found. Usage: python extract.py VERL_REPO_DIR COMMIT > corpus.json
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SAFE_TOOLS = ("date", "nproc", "dirname", "basename", "realpath", "readlink", "cat", "echo", "printf", "expr",
              "seq", "head", "tail", "tr", "cut", "awk", "sed", "grep", "wc", "mkdir", "true", "false", "env",
               "sort", "uname", "whoami", "hostname")
PY_STUB = r'''#!/bin/bash
if [ "$1" = "-c" ]; then exit 1; fi
if [ "$1" = "-m" ] && [ "$2" = "verl.trainer.main_ppo" ]; then
  shift 2
  "$REAL_PY" -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@" >> "$ARGS_OUT"
  exit 0
fi
exit 0
'''
UV_STUB = r'''#!/bin/bash
while [ $# -gt 0 ] && [ "$1" != python3 ] && [ "$1" != python ]; do shift; done
[ $# -gt 0 ] && exec "$@"
exit 0
'''


#: ``ulimit`` may not be raised here; ``set -u`` stays off so a knob the script reads from the
#: environment without a default expands empty unless KNOBS gives it a value
PRELUDE = "ulimit() { :; }\nset() { builtin set \"${@//u/}\"; }\n"
#: environment knobs some scripts require without a default (the values their comments suggest)
KNOBS = {"INFER_BACKEND": "vllm", "HDFS_ROOT": "/home/user"}


def extract(repo: Path, script: str, commit: str) -> list[list[str]]:
    text = subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{script}"], check=True,
                          capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bind, work = root / "bin", root / "work"
        bind.mkdir()
        work.mkdir()
        for tool in SAFE_TOOLS:
            found = shutil.which(tool)
            if found:
                (bind / tool).symlink_to(found)
        for name, body in (("python3", PY_STUB), ("python", PY_STUB), ("uv", UV_STUB)):
            (bind / name).write_text(body)
            (bind / name).chmod(0o755)
        (work / "run.sh").write_text(PRELUDE + text)
        out = root / "args.jsonl"
        env = {**KNOBS, "PATH": str(bind), "HOME": "/home/user", "ARGS_OUT": str(out), "REAL_PY": sys.executable}
        subprocess.run(["/bin/bash", "run.sh"], cwd=work, env=env, capture_output=True, timeout=20)
        if not out.exists():
            return []
        return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def config_name(args: list[str]) -> tuple[str, list[str]]:
    name, rest, it = "ppo_trainer", [], iter(args)
    for arg in it:
        if arg in ("--config-name", "-cn"):
            name = next(it)
        elif arg.startswith("--config-name="):
            name = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return name, rest


def main() -> None:
    repo, commit = Path(sys.argv[1]), sys.argv[2]
    listing = subprocess.run(["git", "-C", str(repo), "ls-tree", "-r", "--name-only", commit, "examples"],
                             check=True, capture_output=True, text=True).stdout.split()
    scripts = sorted(p for p in listing if Path(p).name.startswith("run_") and p.endswith(".sh"))
    rows, skipped = [], []
    for script in scripts:
        calls = extract(repo, script, commit)
        if not calls:
            skipped.append(script)
        for i, call in enumerate(calls):
            name, args = config_name(call)
            rows.append({"script": script + (f"#{i + 1}" if len(calls) > 1 else ""), "config_name": name,
                         "args": args})
    json.dump({"verl_repository": "https://github.com/verl-project/verl", "verl_commit": commit,
               "how": "tests/data/verl_examples/extract.py (scripts run with stub commands, never verl)",
               "scripts": rows, "without_main_ppo": skipped}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
