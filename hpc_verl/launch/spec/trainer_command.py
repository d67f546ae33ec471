"""The trainer command line a verl user already runs, as a job: ``-- python3 -m MODULE [ARGS...]``.

``hpc-verl submit|render|validate --profile P [--config JOB.yaml] -- python3 -m
verl.trainer.main_ppo [--config-name NAME] key=value ...`` takes the command the
user would type (or put into ``ray job submit ... --``) and turns it into the same
``JobConfig`` a job YAML gives: the module into ``trainer.module``, Hydra's config
options (``--config-name``/``--config-path``/``--config-dir`` and their short
forms) into ``trainer.args``, every ``key=value`` into ``trainer.overrides``. So
the job directory, the checks and the derived settings are those of a YAML job.
Anything the launcher could not pass on faithfully is refused in one line.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Sequence

from hpc_verl.errors import ConfigError

_PYTHON_RE = re.compile(r"^python(\d+(\.\d+)*)?$")
#: Hydra's options that choose the config: (long, short); each takes one value.
HYDRA_CONFIG_OPTIONS = (("--config-name", "-cn"), ("--config-path", "-cp"), ("--config-dir", "-cd"))
#: Python's own options that change nothing a job depends on (the job's output is unbuffered anyway).
_HARMLESS_PYTHON_FLAGS = ("-u",)
_HOW = "write it as: -- python3 -m verl.trainer.main_ppo [--config-name NAME] key=value ..."


@dataclass
class TrainerCommand:
    """What a ``python -m MODULE ...`` command line asks for, in the job config's terms."""

    module: str
    args: list[str] = field(default_factory=list)       # Hydra's config options, as given
    overrides: list[str] = field(default_factory=list)  # key=value, in order


def is_python(word: str) -> bool:
    """``python``, ``python3``, ``python3.11`` or a path to one (``/opt/venv/bin/python3``)."""
    return bool(_PYTHON_RE.match(PurePosixPath(word).name))


def parse_trainer_command(argv: Sequence[str]) -> TrainerCommand:
    """Split ``python3 -m MODULE [hydra options] key=value ...``; raise ConfigError (one line) otherwise."""
    words = list(argv)
    if not words:
        raise ConfigError(f"nothing after '--': give the trainer command; {_HOW}")
    if not is_python(words[0]):
        raise ConfigError(f"trainer command {words[0]!r}: expected a Python (python3, python or a path to one) "
                          f"running a module; {_HOW}")
    i = 1
    while i < len(words) and words[i] in _HARMLESS_PYTHON_FLAGS:
        i += 1
    if i >= len(words) or words[i] != "-m" or i + 1 >= len(words):
        got = repr(words[i]) if i < len(words) else "nothing"
        raise ConfigError(f"trainer command: expected '-m MODULE' after {words[0]}, got {got} (a script path or "
                          f"Python option cannot be run as a job's trainer); {_HOW}")
    cmd = TrainerCommand(module=words[i + 1])
    rest = words[i + 2:]
    j = 0
    while j < len(rest):
        word = rest[j]
        option = _config_option(word)
        if option is not None:
            if "=" in word:
                cmd.args.append(word)
            elif j + 1 < len(rest) and not rest[j + 1].startswith("-"):
                cmd.args += [word, rest[j + 1]]
                j += 1
            else:
                raise ConfigError(f"trainer command: {word} needs a value (e.g. {option} NAME)")
        elif word.startswith("-"):
            raise ConfigError(f"trainer command option {word!r} is not supported: hpc-verl runs one job with "
                              "Hydra's --config-name/--config-path/--config-dir and key=value overrides; "
                              "remove it")
        elif "=" not in word:
            raise ConfigError(f"trainer command argument {word!r} is not key=value (e.g. trainer.total_epochs=2)")
        else:
            cmd.overrides.append(word)
        j += 1
    return cmd


def _config_option(word: str) -> str | None:
    """The long name of a Hydra config option ``word`` spells (``-cn``, ``--config-name=X``), else None."""
    head = word.split("=", 1)[0]
    for long, short in HYDRA_CONFIG_OPTIONS:
        if head in (long, short):
            return long
    return None
