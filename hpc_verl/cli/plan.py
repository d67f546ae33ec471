"""``hpc-verl plan``: recommended verl overrides for a profile, a node count and a model size."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hpc_verl.cli.common import add_profile_argument, add_set_argument

KIND_STYLE = {"override": "", "derived": "dim", "env": "cyan", "note": "yellow"}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan", help="recommended verl overrides for N nodes of a profile, each with its reason",
        description="Scale a PPO job: recommended batch sizes, rollout tensor parallelism and GPU memory "
                    "utilisation, parameter/optimizer offload and environment for N nodes of a profile and a "
                    "model size, each with a one-line reason. --format overrides prints only key=value lines "
                    "to paste after 'hpc-verl submit' or into a job file.")
    add_profile_argument(parser)
    add_set_argument(parser)
    parser.add_argument("--nodes", type=int, default=None,
                        help="number of nodes (default: trainer.nnodes of the command after '--')")
    parser.add_argument("--model-size", default="7B", help="model parameters, e.g. 0.5B, 7B, 70B (default 7B)")
    parser.add_argument("--gpu-mem-gb", type=float, default=None,
                        help="GPU memory in GB (default: from the GPU model the profile names)")
    parser.add_argument("--rollout-n", type=int, default=None,
                        help="responses per prompt (GRPO uses > 1; default: the command's "
                             "actor_rollout_ref.rollout.n, else 1)")
    parser.add_argument("--format", choices=("table", "overrides", "yaml", "json"), default="table",
                        help="table (default), overrides (key=value lines), yaml (a trainer.overrides block "
                             "for a job file), or json")
    parser.set_defaults(func=cmd_plan, command=[])


def cmd_plan(args: argparse.Namespace) -> int:
    from hpc_verl.errors import ConfigError
    from hpc_verl.ops.scaling import add_verl_notes, format_overrides, make_plan, verify_plan
    from hpc_verl.profiles import load_profile
    from hpc_verl.verl_upstream.config import schema as verl_schema

    from hpc_verl.launch.spec.job_size import job_count

    job = None
    if args.command:  # the job's own command line: its size and sample count, as submit would take them
        from hpc_verl.launch.spec.jobconfig import load_job_config
        job = load_job_config(None, None, args.command)
    if args.nodes is None:
        args.nodes = job_count(job, "trainer.nnodes") if job is not None else None
        if args.nodes is None:
            raise ConfigError("--nodes N is required (or a command after '--' that sets trainer.nnodes)")
    if args.rollout_n is None:
        args.rollout_n = (job_count(job, "actor_rollout_ref.rollout.n") if job is not None else None) or 1
    if args.rollout_n < 1:
        raise ConfigError(f"--rollout-n {args.rollout_n}: must be at least 1")
    profile = load_profile(args.profile, args.sets)
    schema = verl_schema()
    plan = make_plan(profile, args.nodes, args.model_size, args.gpu_mem_gb, args.rollout_n, schema)
    problems = verify_plan(plan, schema)
    if problems:  # a bug in the rules, not a user error: say so plainly
        raise ConfigError(f"plan for profile '{profile.name}' failed its own checks: {problems[0]}")
    add_verl_notes(plan, profile, schema)
    if args.format == "overrides":
        print(format_overrides(plan))
        return 0
    if args.format == "yaml":
        import yaml

        from hpc_verl.ops.scaling import typed_value

        block = {"trainer": {"overrides": {r.key: typed_value(r.value) for r in plan.rows if r.kind == "override"}}}
        print(yaml.safe_dump(block, sort_keys=False, default_flow_style=False), end="")
        return 0
    if args.format == "json":
        print(json.dumps(plan.to_dict(), indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160, soft_wrap=False)
    mem = f"{plan.gpu_mem_gb:g} GB GPUs ({plan.gpu_mem_source})" if plan.gpu_mem_gb else plan.gpu_mem_source
    table = Table(title=f"plan: profile '{plan.profile}', {plan.nodes} node(s) × {plan.gpus_per_node} GPU(s), "
                        f"{plan.model_params_b:g}B model, {mem}", title_justify="left")
    table.add_column("key", no_wrap=True)
    table.add_column("value", no_wrap=True)
    table.add_column("why", overflow="fold")
    for r in plan.rows:
        key = r.key if r.kind == "override" else f"{r.key} ({r.kind})"
        table.add_row(key, r.value, r.reason, style=KIND_STYLE.get(r.kind, ""))
    console.print(table)
    checked = f"keys checked against verl {schema.version}" if schema else "verl not installed: keys not checked"
    console.print(f"{checked}; paste with: hpc-verl plan --profile {plan.profile} --nodes {plan.nodes} "
                  f"--model-size {args.model_size} --format overrides", highlight=False)
    return 0
