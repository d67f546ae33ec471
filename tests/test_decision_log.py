"""The driver's log as a person reads it: every scheduling decision once, and the placement
plan as short lines (no table that wraps in an 80-column terminal or a job log).

The duplication this guards against: the scheduler logs each decision as it places the graph,
and the trainer then logged the whole plan, whose text repeated every decision. The test runs
that same path (the scheduler's placement, then the trainer's plan log, through the trainer's
own log set-up) on a planned cluster, without Ray."""
from __future__ import annotations

import io
import logging

import pytest

from hpc_verl.dataflow import HybridScheduler
from hpc_verl.trainer import main as trainer_main
from hpc_verl.trainer.config.schema import load_config
from hpc_verl.trainer.driver.ppo_graph import build_ppo_graph, synthetic_cluster
from hpc_verl.trainer.driver.ray_runner import DataflowRunner

OVERRIDES = ["trainer.device=cpu", "trainer.n_gpus_per_node=2", "data.train_batch_size=16",
             "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
             "algorithm.adv_estimator=grpo"]


@pytest.fixture
def driver_log():
    """The trainer's log set-up writing to a buffer (a file, not a terminal: the job log's case)."""
    root = logging.getLogger("hpc_verl")
    saved = (list(root.handlers), root.level, root.propagate)
    root.handlers.clear()
    buf = io.StringIO()
    trainer_main._setup_logging(buf)
    # a library that configures the root logger (logging.basicConfig) must not print ours again
    other = logging.StreamHandler(buf)
    logging.getLogger().addHandler(other)
    try:
        yield buf
    finally:
        logging.getLogger().removeHandler(other)
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        root.propagate = saved[2]


@pytest.mark.parametrize("extra", [[], ["hpc_verl.light_nodes_in_rank0=false"]])
def test_each_scheduling_decision_is_logged_once(driver_log, extra):
    cfg = load_config(None, OVERRIDES + extra).to_dict()
    sched = HybridScheduler(build_ppo_graph(cfg, 1, name="ppo-log"), cluster=synthetic_cluster(cfg))
    sched._place()                       # what spawn() does before it creates the processes
    runner = DataflowRunner()
    runner.sched = sched
    runner.log_placement()               # what start() logs once the graph is placed
    text = driver_log.getvalue()
    logged = [line.split("Scheduling decision: ", 1)[1] for line in text.splitlines()
              if "Scheduling decision: " in line]
    assert sched.decisions and len(logged) == len(sched.decisions)
    for decision in sched.decisions:
        assert logged.count(decision.split("Scheduling decision: ", 1)[1]) == 1, text
    assert "dataflow plan:" in text and "worker group" in text
    plan_lines = text[text.index("dataflow plan:"):].splitlines()
    assert all(len(line) <= 100 for line in plan_lines), [line for line in plan_lines if len(line) > 100]


def test_a_plan_shown_on_its_own_keeps_its_decisions():
    """``hpc-verl train --dry-run`` prints the plan with no scheduler beside it: there the
    decisions are part of the plan's text."""
    cfg = load_config(None, OVERRIDES).to_dict()
    sched = HybridScheduler(build_ppo_graph(cfg, 1, name="ppo-dry"), cluster=synthetic_cluster(cfg))
    plan = sched.plan()
    assert plan.decisions and all(d in str(plan) for d in plan.decisions)
    assert not any(d in plan.describe(decisions=False) for d in plan.decisions)
