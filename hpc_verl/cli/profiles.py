"""``hpc-verl profiles list|show``: what profiles exist, and what one resolves to."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hpc_verl.cli.common import add_set_argument


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("profiles", help="list cluster profiles or show one resolved",
                                   description="List the cluster profiles on the search path, or show one "
                                               "resolved (extends and --set applied) with where each value came from.")
    sub = parser.add_subparsers(dest="profiles_cmd", metavar="CMD", parser_class=type(parser))
    p_list = sub.add_parser("list", help="profiles on the search path")
    p_list.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p_list.set_defaults(func=cmd_list)
    p_show = sub.add_parser("show", help="one profile resolved, with provenance")
    p_show.add_argument("name", help="profile name or path to a .yaml file")
    add_set_argument(p_show)
    p_show.add_argument("--json", action="store_true", help="print the resolved profile as JSON")
    p_show.set_defaults(func=cmd_show)
    parser.set_defaults(func=lambda args: (parser.print_help(sys.stderr), 2)[1])


def _console():
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 120, soft_wrap=False)


def cmd_list(args: argparse.Namespace) -> int:
    from hpc_verl.profiles import list_profiles, search_path

    infos = list_profiles()
    if args.json:
        print(json.dumps([{"name": i.name, "origin": i.origin, "path": str(i.path), "description": i.description,
                           "shadows": i.shadows} for i in infos], indent=2))
        return 0
    from rich.table import Table

    table = Table(title="cluster profiles", title_justify="left")
    for col in ("name", "from", "description"):
        table.add_column(col, overflow="fold")
    for i in infos:
        origin = i.origin + (f" (shadows {i.shadows})" if i.shadows else "")
        table.add_row(i.name, origin, i.description)
    console = _console()
    console.print(table)
    console.print("search path: " + " -> ".join(f"{o}:{d}" for o, d in search_path()), highlight=False)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from hpc_verl.profiles import load_profile

    profile = load_profile(args.name, args.sets)
    if args.json:
        print(json.dumps({"name": profile.name, "source": profile.source, "values": profile.to_dict(),
                          "provenance": profile.provenance}, indent=2))
        return 0
    from rich.table import Table

    table = Table(title=f"profile {profile.name} ({profile.source})", title_justify="left")
    table.add_column("key")
    table.add_column("value", overflow="fold")
    table.add_column("from", overflow="fold")
    for key, value in profile.flat().items():
        text = json.dumps(value) if not isinstance(value, str) else value
        src = "file name" if key == "name" else profile.where(key)
        table.add_row(key, text, src if src != "default" else "[dim]default[/dim]")
    _console().print(table)
    return 0
