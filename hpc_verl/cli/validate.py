"""``hpc-verl validate``: schema, then ``bash -n`` and shellcheck on the rendered script."""
from __future__ import annotations

import argparse
from typing import Any

from hpc_verl.cli.common import add_plan_arguments


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("validate", help="check a profile: schema, bash -n and shellcheck on its render",
                                   description="Check profiles: load them (strict schema), render the job "
                                               "script and run bash -n and shellcheck on it.")
    add_plan_arguments(parser, profile_required=False)
    parser.add_argument("--all", action="store_true", help="validate every profile on the search path")
    parser.add_argument("--no-shellcheck", action="store_true", help="skip shellcheck (bash -n still runs)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from hpc_verl.errors import HpcVerlError, ProfileError
    from hpc_verl.launch.spec.launch_plan import build_plan, validate_script
    from hpc_verl.profiles import list_profiles

    if args.all == bool(args.profile):
        raise ProfileError("give either --profile NAME or --all")
    names = [i.name for i in list_profiles()] if args.all else [args.profile]
    console = Console(highlight=False)
    failed = 0
    for name in names:
        try:
            plan = build_plan(name, args.config, args.overrides, profile_overrides=args.sets,
                              command=args.command)
            problems = validate_script(plan.script, shellcheck=not args.no_shellcheck)
        except HpcVerlError as exc:
            if not args.all:
                raise
            problems = [str(exc)]
        checks = "schema, bash -n" + ("" if args.no_shellcheck else ", shellcheck")
        if problems:
            failed += 1
            console.print(f"[red]✗[/red] {name}: {problems[0]}" + (f" (+{len(problems) - 1} more)"
                                                                     if len(problems) > 1 else ""))
            for line in problems[1:20]:
                console.print(f"    {line}")
        else:
            console.print(f"[green]✓[/green] {name}: {checks} ok")
    if failed:
        raise ProfileError(f"{failed} of {len(names)} profile(s) failed validation (details above)")
    return 0
