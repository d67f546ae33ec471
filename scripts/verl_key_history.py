"""Write hpc_verl/verl_upstream/key_history.json: the config keys of verl's past releases that the
pinned verl no longer has, and the last release that had each.

Usage: python scripts/verl_key_history.py VERL_GIT_DIR > hpc_verl/verl_upstream/key_history.json
(run with the pinned verl installed; reads each release tag's trainer config, never runs verl).
"""
from __future__ import annotations

import json
import subprocess
import sys

import yaml

from hpc_verl.verl_upstream.config import schema

TAGS = ("v0.1", "v0.2", "v0.3.0.post1", "v0.4.0", "v0.4.1", "v0.5.0", "v0.6.0", "v0.6.1", "v0.7.0", "v0.7.1",
        "v0.8.0", "v0.9.0")
FILES = ("verl/trainer/config/_generated_ppo_trainer.yaml", "verl/trainer/config/_generated_ppo_megatron_trainer.yaml",
         "verl/trainer/config/ppo_trainer.yaml", "verl/trainer/config/ppo_megatron_trainer.yaml")


def leaves(tree, prefix=""):
    for key, value in (tree or {}).items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from leaves(value, dotted + ".")
        elif key not in ("_target_", "defaults"):
            yield dotted


def main() -> None:
    repo = sys.argv[1]
    now = set()
    for name in ("ppo_trainer", "ppo_megatron_trainer"):
        now |= schema(config_name=name).keys
    last: dict[str, str] = {}
    for tag in TAGS:
        for path in FILES:
            shown = subprocess.run(["git", "-C", repo, "show", f"{tag}:{path}"], capture_output=True, text=True)
            if shown.returncode:
                continue
            tree = yaml.safe_load(shown.stdout)
            if not isinstance(tree, dict):
                continue
            for key in leaves(tree):
                if key not in now and not key.startswith("hydra."):
                    last[key] = tag.lstrip("v")
    json.dump({"verl": schema().version, "source": "verl's release tags " + ", ".join(TAGS),
               "last_release_with_key": dict(sorted(last.items()))}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
