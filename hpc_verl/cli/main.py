"""Entry point of ``hpc-verl``.

Each verb lives in its own module in this package and exposes
``register(subparsers) -> None``, which adds its parser and sets
``func=callable(args) -> int``. Verb modules must import heavy libraries (ray,
torch) inside their functions, so ``hpc-verl --help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from hpc_verl._version import __version__
from hpc_verl.errors import report_errors
from hpc_verl.util.argparser import OneLineParser

# Add a verb by adding its module name here (module hpc_verl.cli.<name>).
VERB_MODULES: tuple[str, ...] = (
    "profiles", "render", "validate", "submit", "jobs", "attach", "cluster",
    "doctor", "plan",
    "train", "preprocess", "make_tiny_model", "check_model", "plot",
    "dashboard", "import_verl",
)
# Verbs that take a command given after `--` (`hpc-verl attach JOB -- hostname`, `hpc-verl submit
# --profile P -- python3 -m verl.trainer.main_ppo ...`): it reaches them untouched, as args.command,
# whatever options it has.
COMMAND_VERBS: tuple[str, ...] = ("attach", "submit", "render", "validate", "plan")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="hpc-verl",
        description="Run verl-style RL post-training of LLMs on HPC clusters.",
    )
    parser.add_argument("--version", action="version", version=f"hpc-verl {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=OneLineParser)
    for name in VERB_MODULES:
        importlib.import_module(f"hpc_verl.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    command = None
    if argv[:1] and argv[0] in COMMAND_VERBS and "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
        if not command and argv[0] != "attach":  # (attach alone opens a shell)
            parser.error("nothing after '--': give the trainer command, e.g. -- python3 -m verl.trainer.main_ppo "
                         "key=value ...")
    args, extra = parser.parse_known_args(argv)
    if command is not None:
        args.command = command
    # verbs with trainer overrides take key=value anywhere on the line, also after options
    if extra:
        if isinstance(getattr(args, "overrides", None), list) and all(
                "=" in e and not e.startswith("-") for e in extra):
            args.overrides.extend(extra)
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    return report_errors(lambda: func(args))


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
