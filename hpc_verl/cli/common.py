"""Arguments several verbs share, defined once so their spelling and help never drift."""
from __future__ import annotations

import argparse
from typing import Any, Optional

PROFILE_HELP = "cluster profile name or path to a .yaml file"


def add_profile_argument(parser: Any, *, required: bool = True, default: Optional[str] = None,
                         help: str = PROFILE_HELP) -> None:
    parser.add_argument("--profile", required=required, default=default, metavar="NAME", help=help)


def add_set_argument(parser: Any) -> None:
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a profile value (repeatable), e.g. --set slurm.nodes=4")


def add_plan_arguments(parser: argparse.ArgumentParser, *, profile_required: bool = True,
                       profile_help: str = PROFILE_HELP) -> None:
    """The inputs of a launch plan, shared by render, validate and submit."""
    add_profile_argument(parser, required=profile_required, help=profile_help)
    parser.add_argument("--config", metavar="JOB.yaml", help="job config (trainer, data, model)")
    add_set_argument(parser)
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="trainer overrides, e.g. trainer.total_epochs=2; or, after '--', the trainer command "
                             "itself: -- python3 -m verl.trainer.main_ppo [--config-name NAME] key=value ...")
    parser.set_defaults(command=[])
