"""Our Rays start their workers at niceness 0, not Ray's default 15: the workers are the training
ranks, and on a busy start-up their imports are the critical path (a driver and Ray's agents at
niceness 0 would otherwise take the CPU first). Real private Ray, through the trainer's runner."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import os, sys
from hpc_verl.trainer.config.schema import load_config
from hpc_verl.trainer.driver.ray_runner import DataflowRunner
import ray
cfg = load_config(None, [f"hpc_verl.run_dir={sys.argv[1]}", "hpc_verl.ray_num_cpus=1"]).to_dict()
runner = DataflowRunner()
runner._connect(cfg)
try:
    print(ray.get(ray.remote(lambda: os.nice(0)).remote()))
finally:
    runner.shutdown()
"""


def test_a_private_rays_workers_run_at_niceness_zero(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "run")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == str(os.nice(0))   # Ray's default would be 15 more
