"""A trainer's private Ray whose raylet missed Ray's fixed 30 s registration bound (seen on the loaded
suite machine: "The current node timed out during startup") is started once more, as the job bootstrap
does for its nodes. Real private Ray through the trainer's runner; the slow raylet is a fault injection
(``HPC_VERL_FAULT=slow-registration`` makes the first head process end with Ray's words)."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import os, sys
from hpc_verl.trainer.config.schema import load_config
from hpc_verl.trainer.driver import ray_runner
from hpc_verl.trainer.driver.ray_runner import DataflowRunner
ray_runner.PRIVATE_RAY_TRIES = int(sys.argv[2])
cfg = load_config(None, [f"hpc_verl.run_dir={sys.argv[1]}", "hpc_verl.ray_num_cpus=1"]).to_dict()
runner = DataflowRunner()
print("PID", os.getpid(), flush=True)
try:
    runner._connect(cfg)
    import ray
    print("TASK", ray.get(ray.remote(lambda: 6 * 7).remote()), flush=True)
except Exception as err:
    print(f"ERROR {type(err).__name__}: {err}", flush=True)
finally:
    runner.shutdown()
"""


def _run(tmp_path: Path, tries: int) -> tuple[subprocess.CompletedProcess, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env["HPC_VERL_FAULT"] = "slow-registration"
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "run"), str(tries)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    pid = int(out.stdout.split("PID ", 1)[1].split()[0])
    return out, pid


def test_a_private_ray_that_missed_the_registration_bound_is_started_once_more(tmp_path):
    out, pid = _run(tmp_path, tries=2)
    assert "TASK 42" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "missed Ray's fixed registration bound (a loaded machine); starting it once more" in out.stderr
    kept = tmp_path / "run" / "logs" / "private-ray-head-1.log"
    assert "The current node timed out during startup" in kept.read_text()
    # neither attempt's temp dir is left (the first is removed before the second starts)
    assert not glob.glob(f"/tmp/hpcv-train-{pid}-*")


def test_a_second_miss_is_the_one_line_error(tmp_path):
    out, pid = _run(tmp_path, tries=1)
    line = out.stdout.split("ERROR ", 1)[1].strip()
    assert "\n" not in line
    assert line.startswith("SlowRegistration: the trainer's private Ray did not start: its head process ended "
                           "(exit status 1); its last words: injected fault: Exception: The current node timed "
                           "out during startup."), line
    assert "starting it once more" not in out.stderr
    assert not glob.glob(f"/tmp/hpcv-train-{pid}-*")
