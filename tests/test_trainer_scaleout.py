"""The built-in trainer as worker groups, end to end on CPU (gloo): ``trainer.n_gpus_per_node``
counts CPU ranks here, so W=2 is two real ranks of one torch.distributed group.

- a W=2 run: the two actor ranks end with identical weights (their digests, recorded and
  checked at every checkpoint) and both rollout replicas generated rows (dataflow_status.json);
- resume across world sizes (2 -> 1 -> 2, DDP then FSDP2): each load re-saves exactly the weights and
  optimiser state that were saved, and training goes on from them;
- W=2 on two simulated Ray nodes places one rank per node and trains;
- a killed rank ends the run within the collective timeout with one line and leaves nothing;
- a live resize of the hybrid group between steps;
- nothing accepted and ignored: unsupported values are refused in one line; --dry-run plans.
"""
from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ray")

from trainer_fixtures import digit_overrides, digits_data, tiny_model  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _args(model: Path, data: Path, run_dir: Path, steps: int, world: int, *extra: str) -> list[str]:
    return [*digit_overrides(model, data, run_dir, steps, ("trainer.seed=5",)), f"trainer.n_gpus_per_node={world}",
            "hpc_verl.collective_timeout_s=30", *extra]


def _train(args: list[str], log: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("RAY_ADDRESS", None)
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "hpc_verl", "train", "--no-progress", *args], cwd=REPO,
                                env=env, stdout=fh, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=timeout)
        finally:
            _kill_session(proc.pid)
    return subprocess.CompletedProcess(proc.args, proc.returncode, log.read_text(), err)


def _kill_session(sid: int) -> None:
    for pid in _session(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _session(sid: int) -> list[int]:
    """Live processes of session ``sid`` (everything the trainer started, Ray included)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(d.name))
    return out


def _records(run_dir: Path) -> list[dict]:
    f = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


def _weights(ckpt: Path) -> dict:
    from hpc_verl.trainer.engine.sharded import read_sharded
    return read_sharded(ckpt / "actor")


def test_two_ranks_train_identical_replicas_and_resume_across_world_sizes(tiny_model, digits_data, tmp_path):
    run = tmp_path / "run"
    res = _train(_args(tiny_model, digits_data, run, 3, 2, "actor_rollout_ref.actor.strategy=ddp",
                       "trainer.save_freq=3"), tmp_path / "w2.log")
    assert res.returncode == 0, res.stderr + res.stdout[-3000:]
    recs = _records(run)
    assert [r["step"] for r in recs] == [1, 2, 3] and {r["rollout/replicas"] for r in recs} == {2}
    state = json.loads((run / "global_step_3" / "trainer_state.json").read_text())
    digests = state["actor_weight_digests"]
    assert len(digests) == 2 and digests[0] == digests[1] and state["world_sizes"] == {"hybrid": 2}
    status = json.loads((run / "dataflow_status.json").read_text())
    rollout = status["nodes"]["actor_rollout"]
    assert rollout["world_size"] == 2 and [w["rank"] for w in rollout["workers"]] == [0, 1]
    assert all(w["rows"] == 3 * 16 * 16 // 2 for w in rollout["workers"])   # each replica: half of every batch
    assert status["nodes"]["actor_update"]["world_size"] == 2
    assert status["edges"]["actor_update->actor_rollout"]["transfer"]["mode"] == "in-process"
    saved = _weights(run / "global_step_3")

    # 2 -> 1: the one rank loads both shards' state; it re-saves step 3 from what it holds
    res = _train(_args(tiny_model, digits_data, run, 3, 1, "actor_rollout_ref.actor.strategy=ddp"),
                 tmp_path / "w1.log")
    assert res.returncode == 0, res.stderr
    at_one = _weights(run / "global_step_3")
    assert json.loads((run / "global_step_3" / "trainer_state.json").read_text())["world_sizes"] == {"hybrid": 1}
    for key in ("model", "optim"):
        _assert_same(saved[key], at_one[key], key)
    # 1 -> 2 (fsdp2 this time: a sharded layout from a replicated one): the two ranks load their shards
    # of what one rank saved and re-save step 3 from them; the same weights and optimizer state come back
    res = _train(_args(tiny_model, digits_data, run, 3, 2, "actor_rollout_ref.actor.strategy=fsdp2"),
                 tmp_path / "w2s.log")
    assert res.returncode == 0, res.stderr
    assert json.loads((run / "global_step_3" / "trainer_state.json").read_text())["world_sizes"] == {"hybrid": 2}
    sharded = _weights(run / "global_step_3")
    _assert_same(at_one["model"], sharded["model"], "model")
    _assert_same(at_one["optim"]["state"], sharded["optim"]["state"], "optim.state")
    assert [_hyper(g) for g in at_one["optim"]["param_groups"]] == [_hyper(g) for g in sharded["optim"]["param_groups"]]
    # then one more step
    res = _train(_args(tiny_model, digits_data, run, 4, 2, "actor_rollout_ref.actor.strategy=fsdp2"),
                 tmp_path / "w2b.log")
    assert res.returncode == 0, res.stderr
    recs = _records(run)
    assert recs[-1]["step"] == 4 and recs[-1]["run/start_step"] == 3 and recs[-1]["rollout/policy_version"] == 3


def _hyper(group: dict) -> dict:
    """An optimizer param group's hyperparameters and parameters (not how the step is run: fused or not)."""
    return {k: v for k, v in group.items() if k not in ("fused", "foreach")}


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_two_ranks_on_two_simulated_nodes_one_rank_each(tiny_model, digits_data, tmp_path):
    from hpc_verl.testbed.simcluster import start_sim_cluster, stop_sim_cluster
    from hpc_verl.trainer.config.schema import load_config
    from hpc_verl.trainer.driver.ppo_trainer import PPOTrainer

    cluster = start_sim_cluster([(2, 0), (2, 0)])
    try:
        cfg = load_config(None, _args(tiny_model, digits_data, tmp_path / "run", 2, 1, "trainer.nnodes=2"))
        trainer = PPOTrainer(cfg, progress=False)
        assert trainer.fit() == 0
    finally:
        stop_sim_cluster(cluster)
    status = json.loads((tmp_path / "run" / "dataflow_status.json").read_text())
    workers = status["nodes"]["actor_update"]["workers"]
    assert [w["rank"] for w in workers] == [0, 1]
    assert len({w["ray_node_id"] for w in workers}) == 2          # one rank per node
    assert any("worker group hybrid" in d and "has 2 rank(s) on 2 node(s)" in d for d in status["decisions"])
    assert [r["step"] for r in _records(tmp_path / "run")] == [1, 2]


def test_a_killed_rank_ends_the_run_with_one_line_and_leaves_nothing(tiny_model, digits_data, tmp_path):
    run = tmp_path / "run"
    args = _args(tiny_model, digits_data, run, 400, 2, "hpc_verl.collective_timeout_s=20")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("RAY_ADDRESS", None)
    log = tmp_path / "kill.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "hpc_verl", "train", "--no-progress", *args], cwd=REPO,
                                env=env, stdout=fh, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and len(_records(run)) < 2:
            assert proc.poll() is None, proc.stderr.read() + log.read_text()[-3000:]
            time.sleep(0.2)
        status = json.loads((run / "dataflow_status.json").read_text())
        victim = next(w for w in status["nodes"]["actor_update"]["workers"] if w["rank"] == 1)
        t0 = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        _kill_session(proc.pid)
    lines = [ln for ln in err.splitlines() if ln.startswith("hpc-verl: error:")]
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and "rank 1/2 of group 'hybrid'" in lines[0] and "died" in lines[0], err
    assert f"pid {victim['pid']}" in lines[0]
    assert took < 40, f"the run took {took:.0f}s to end after the kill"
    assert not _session(proc.pid), "processes of the run were left behind"


def test_live_resize_of_the_hybrid_group_between_steps(tiny_model, digits_data, tmp_path):
    from hpc_verl.testbed.simcluster import start_sim_cluster, stop_sim_cluster
    from hpc_verl.errors import DataflowError
    from hpc_verl.trainer.config.schema import load_config
    from hpc_verl.trainer.driver.ray_runner import DataflowRunner
    from hpc_verl.trainer.driver.ppo_trainer import PPOTrainer

    cluster = start_sim_cluster([(4, 0)])
    try:
        cfg = load_config(None, _args(tiny_model, digits_data, tmp_path / "run", 4, 2))
        trainer = PPOTrainer(cfg, runner=DataflowRunner(), progress=False)
        trainer.runner.start(cfg.to_dict(), trainer.total_steps)
        try:
            first = trainer.train_step()
            sched = trainer.scheduler
            assert sched.adjust_parallelism("actor_rollout", 1, "test") == 1   # the hybrid group, all its roles
            assert sched.get_status()["nodes"]["actor_update"]["world_size"] == 1
            second = trainer.train_step()
            with pytest.raises(DataflowError, match="cannot resize worker group hybrid 1 -> 3: .*not divisible by 3"):
                sched.adjust_parallelism("actor_update", 3, "test")
            assert sched.adjust_parallelism("actor_update", 2, "test") == 2
            third = trainer.train_step()
        finally:
            trainer.runner.shutdown()
    finally:
        stop_sim_cluster(cluster)
    # the policy versions follow on: the state (weights, optimiser, version) was carried over
    assert [m["rollout/policy_version"] for m in (first, second, third)] == [0, 1, 2]
    assert [m["rollout/replicas"] for m in (first, second, third)] == [2, 1, 2]


def test_disable_ulysses_switches_the_next_step_to_unsplit(tiny_model, digits_data, tmp_path):
    from hpc_verl.testbed.simcluster import start_sim_cluster, stop_sim_cluster
    from hpc_verl.trainer.config.schema import load_config
    from hpc_verl.trainer.driver.ray_runner import DataflowRunner
    from hpc_verl.trainer.driver.ppo_trainer import PPOTrainer

    cluster = start_sim_cluster([(3, 0)])
    try:
        cfg = load_config(None, _args(tiny_model, digits_data, tmp_path / "run", 3, 2,
                                      "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2"))
        trainer = PPOTrainer(cfg, runner=DataflowRunner(), progress=False)
        trainer.runner.start(cfg.to_dict(), trainer.total_steps)
        try:
            first = trainer.train_step()
            assert trainer.scheduler.disable_ulysses("actor_update") is True
            second = trainer.train_step()
            status = trainer.scheduler.get_status()
        finally:
            trainer.runner.shutdown()
    finally:
        stop_sim_cluster(cluster)
    assert first["actor/ulysses_sp"] == 2 and second["actor/ulysses_sp"] == 1
    assert status["nodes"]["actor_update"]["ulysses"] is False
    assert any("disabled Ulysses sequence parallelism for actor_update" in d for d in status["decisions"])


@pytest.mark.parametrize("override,what", [
    ("actor_rollout_ref.actor.strategy=megatron", "is not one of fsdp, fsdp2, ddp"),
    ("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=3", "does not divide"),
    ("hpc_verl.one_step_off_policy=true", "its own devices"),
    ("actor_rollout_ref.rollout.mode=async", "only the synchronous rollout"),
    ("actor_rollout_ref.model.use_remove_padding=true", "padding-free"),
    ("actor_rollout_ref.rollout.gpu_memory_utilization=0.8", "applies to the vLLM rollout only"),
    ("trainer.test_freq=5", "validation runs are not implemented"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=2", "tensor parallelism needs rollout.name=vllm"),
])
def test_unsupported_values_are_refused_in_one_line(cli, override, what):
    res = cli("train", "--dry-run", override)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and what in lines[0], res.stderr
    assert override.split("=")[0] in lines[0]


def test_every_default_key_is_read_or_refused():
    """A key of ppo_default.yaml that no trainer code reads and no refusal names would be accepted
    and ignored: this keeps new keys honest (a string or attribute use counts as read)."""
    import re

    import yaml

    from hpc_verl.trainer.config.refusals import REFUSALS
    defaults = yaml.safe_load((REPO / "hpc_verl/trainer/config/ppo_default.yaml").read_text())
    code = "\n".join(p.read_text() for d in ("trainer", "data", "dataflow")
                     for p in (REPO / "hpc_verl" / d).rglob("*.py")
                     if p.name not in ("ppo_default.yaml", "refusals.py", "derive.py"))   # (support.py before)
    refused = {r.key for r in REFUSALS} | {"data.val_files", "data.val_batch_size"}   # read when validation is
    code += "\n".join(re.findall(r"\$\{([a-z_.]+)\}", (REPO / "hpc_verl/trainer/config/ppo_default.yaml").read_text()))

    def leaves(d, prefix=""):
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and key != "hpc_verl.device_mapping":
                yield from leaves(v, key + ".")
            else:
                yield key

    unread = [k for k in leaves(defaults) if k not in refused
              and not re.search(r"""(["'.])%s\b""" % re.escape(k.split(".")[-1]), code)
              and k not in code]
    assert not unread, f"accepted but read nowhere: {unread}"


def test_dry_run_shows_groups_ranks_and_bundles(cli):
    res = cli("train", "trainer.nnodes=4", "trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.strategy=fsdp",
              "--dry-run")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "group hybrid: actor+rollout+critic, world size 32 (4 node(s) x 8 rank(s), GPU=1 per rank" in out
    assert "rollout replicas: 32" in out and "worker group hybrid: world size 32" in out
    assert "ranks 0-7 on node0; ranks 8-15 on node1; ranks 16-23 on node2; ranks 24-31 on node3" in out
    assert out.count(" b31") == 1 and "reward_score_0" in out
    # the rule reward lives in rank 0's process (hpc_verl.light_nodes_in_rank0, default true) ...
    assert re.search(r"reward_score_0 .* b0 \(in process hybrid_0\)", out) and "32 processes" in out
    res = cli("train", "trainer.nnodes=4", "trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.strategy=fsdp",
              "hpc_verl.light_nodes_in_rank0=false", "--dry-run")
    assert res.returncode == 0, res.stderr   # ... or in one of its own
    assert "(in process" not in res.stdout and "33 processes" in res.stdout
    res = cli("train", "trainer.nnodes=2", "trainer.n_gpus_per_node=8", "--dry-run",
              "hpc_verl.device_mapping={actor: [0,1,2,3], rollout: [4,5,6,7]}")
    assert res.returncode == 0 and "group actor: actor+critic, world size 8" in res.stdout, res.stderr
    assert "group rollout: rollout, world size 8" in res.stdout
    res = cli("train", "trainer.n_gpus_per_node=3", "data.train_batch_size=4", "--dry-run")
    assert res.returncode == 2 and "not divisible by 3" in res.stderr
