"""The dashboard verb without a live cluster: bad addresses and status files."""
from __future__ import annotations

import json

from hpc_verl import HybridScheduler
from hpc_verl.dataflow import ClusterNode
from hpc_verl.testbed.dataflow_examples import ppo_example_graph
from hpc_verl.testbed.ports import free_ports
from hpc_verl.util.fs import atomic_write_json


def test_unreachable_ray_is_one_line_fast(cli):
    res = cli("dashboard", "--address", f"127.0.0.1:{free_ports(1)[0]}", "--once", "--json", timeout=60)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "cannot reach Ray at 127.0.0.1:" in lines[0], res.stderr
    res = cli("dashboard", "--address", "nonsense", "--json", timeout=60)
    assert res.returncode == 2 and "is not HOST:PORT" in res.stderr


def test_status_file_renders_and_prints_json(cli, tmp_path):
    cluster = [ClusterNode(f"id{i}", f"gpu-node-{i}", {"CPU": 8.0, "GPU": 4.0}) for i in (1, 2)]
    sched = HybridScheduler(ppo_example_graph("from_file"), cluster=cluster)
    sched.plan()
    path = tmp_path / "status.json"
    atomic_write_json(path, sched.get_status())
    res = cli("dashboard", "--file", str(path), "--json")
    assert res.returncode == 0, res.stderr
    snap = json.loads(res.stdout)["graphs"][0]
    assert set(snap["nodes"]) == {"actor_rollout", "reward_score", "critic_train"}
    assert len(snap["gpus"]) == 8 and all(r["memory"] == "n/a" for r in snap["gpus"].values())
    res = cli("dashboard", "--file", str(path), "--once", env={"COLUMNS": "200"})
    assert res.returncode == 0, res.stderr
    for word in ("actor_rollout", "critic_train->actor_rollout", "GPU memory", "decision log"):
        assert word in res.stdout
    res = cli("dashboard", "--file", str(tmp_path / "missing.json"), "--json")
    assert res.returncode == 2 and "does not exist" in res.stderr
    # the standalone verl-scheduler-dashboard (setup.cfg console script) is the same view
    import subprocess
    import sys
    from pathlib import Path

    REPO = Path(__file__).resolve().parents[1]
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-m", "hpc_verl.ops.dashboard", "--file", str(path), "--json"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0 and json.loads(res.stdout)["graphs"][0]["graph"] == "from_file", res.stderr
    assert "verl-scheduler-dashboard = hpc_verl.ops.dashboard:console_main" in (REPO / "setup.cfg").read_text()
