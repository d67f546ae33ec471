"""``hpc-verl train --config FILE key=value ...``: the built-in PPO trainer (same entry as the launcher's stage)."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="run the built-in PPO/GRPO trainer on Ray (verl config keys)",
                              description="Run the built-in PPO/GRPO trainer. Config keys follow verl's names; "
                                          "defaults are in hpc_verl/trainer/config/ppo_default.yaml.")
    from hpc_verl.trainer.main import add_arguments
    add_arguments(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from hpc_verl.trainer.main import run
    return run(args)
