"""Entry point of the built-in trainer: ``python -m hpc_verl.trainer.main --config FILE key=value ...``.

``hpc-verl train`` and the launcher's train stage both call ``main(argv)``. Exit
codes: 0 done, 2 user error (one line on stderr), ``REQUEUE_EXIT_CODE`` (99)
after checkpointing on the preemption signal (SIGUSR2), so the job requeues.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Sequence

from hpc_verl.errors import report_errors


def build_parser(prog: str = "hpc-verl train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run the built-in PPO/GRPO trainer (verl config keys).")
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML config (verl key names); defaults: ppo_default.yaml")
    p.add_argument("--print-config", action="store_true", help="print the merged, validated config and exit")
    p.add_argument("--check", action="store_true", help="validate config, data and model, then exit")
    p.add_argument("--dry-run", action="store_true",
                   help="print the worker groups, ranks and bundles the trainer would place on "
                        "trainer.nnodes x n_gpus_per_node devices (no Ray, no model load), then exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted overrides, e.g. data.train_batch_size=64 trainer.total_epochs=2")


def run(args: argparse.Namespace) -> int:
    from hpc_verl.trainer.config.schema import load_config, to_yaml  # lazy: the CLI imports this module for its parser

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        sys.stdout.write(to_yaml(cfg))
        return 0
    # (--dry-run plans trainer.nnodes x n_gpus_per_node devices without running: it shows, not refuses)
    ranks_line = check_cpu_ranks(cfg, refuse=not args.dry_run)
    if args.dry_run:
        from hpc_verl.trainer.driver.ppo_graph import describe_placement  # lazy: CLI parser
        print(describe_placement(cfg))
        if ranks_line:
            print(ranks_line)
        return 0
    if args.check:  # the full offline model check (config and tokenizer load), then the trainer's own
        if ranks_line:
            print(ranks_line)
        from hpc_verl.trainer.config.schema import validate_for_run  # lazy: the CLI imports this module for its parser
        from hpc_verl.trainer.models.check import check_model  # lazy: the CLI imports this module for its parser
        from hpc_verl.trainer.driver.ppo_trainer import PPOTrainer  # lazy: the CLI imports this module for its parser
        validate_for_run(cfg)
        check_model(cfg.actor_rollout_ref.model.path)
        trainer = PPOTrainer(cfg, progress=False)
        print(f"ok: {len(trainer.dataset)} prompts, {trainer.total_steps} steps, run dir {trainer.run_dir}")
        return 0
    _setup_logging()
    from hpc_verl.trainer.config.schema import validate_for_run  # lazy: the CLI imports this module for its parser
    from hpc_verl.trainer.driver.ray_runner import DataflowRunner  # lazy: the CLI imports this module for its parser
    from hpc_verl.trainer.models.check import check_model_dir  # lazy: the CLI imports this module for its parser
    from hpc_verl.util.fs import ensure_writable_dir  # lazy: the CLI imports this module for its parser

    validate_for_run(cfg)   # what can be refused at once is refused before Ray starts
    check_model_dir(cfg.actor_rollout_ref.model.path)
    ensure_writable_dir(os.path.expanduser(cfg.hpc_verl.run_dir))
    runner = DataflowRunner()
    runner.begin(cfg.to_dict())   # Ray comes up while this process loads torch, the tokenizer and the data
    try:
        from hpc_verl.trainer.driver.ppo_trainer import PPOTrainer  # lazy: the CLI imports this module for its parser
        trainer = PPOTrainer(cfg, runner=runner, progress=False if args.no_progress else None)
    except BaseException:
        runner.shutdown()
        raise
    return trainer.fit()


def check_cpu_ranks(cfg: Any, refuse: bool = True) -> str | None:
    """With trainer.device=cpu: the ranks per node against this node's usable CPUs, as one line
    (None on GPUs). More ranks than CPUs is refused, or with hpc_verl.allow_cpu_oversubscribe=true
    warned about once."""
    from hpc_verl.errors import ConfigError  # lazy: the CLI imports this module for its parser
    from hpc_verl.util import cpus as cpu_util  # lazy: the CLI imports this module for its parser

    t = cfg["trainer"]
    if t["device"] != "cpu":
        return None
    ranks = int(t["n_gpus_per_node"])
    usable = cpu_util.usable_cpus()
    problem = cpu_util.rank_problem(ranks, usable, "trainer.n_gpus_per_node")
    if problem and refuse:
        if not cfg["hpc_verl"].get("allow_cpu_oversubscribe"):
            raise ConfigError(problem)
        print(f"hpc-verl: warning: {ranks} CPU ranks per node on {usable}: oversubscribed "
              f"({cpu_util.OVERSUBSCRIBE_KEY}=true); each rank gets less than a CPU", file=sys.stderr)
    return cpu_util.rank_line(ranks, usable)


def _setup_logging(stream: Any = None) -> None:
    """The driver's log on ``stream`` (stdout, with the step lines): on a terminal through rich
    (wrapped to the terminal's width); in a file or pipe (a job's log) one plain line per record,
    never wrapped at 80 columns, so a log reads and greps as it was written."""
    root = logging.getLogger("hpc_verl")
    if root.handlers:
        return
    stream = sys.stdout if stream is None else stream
    handler: logging.Handler
    if stream.isatty():
        from rich.console import Console
        from rich.logging import RichHandler
        handler = RichHandler(show_path=False, console=Console(file=stream))
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False   # printed here only, also where a library gave the root logger a handler


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser("python -m hpc_verl.trainer.main")
    args = parser.parse_args(argv)
    return report_errors(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
