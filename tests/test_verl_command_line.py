"""The verl command line itself as a job (``-- python3 -m verl.trainer.main_ppo ...``) and the job's
size from the job (``trainer.nnodes``/``trainer.n_gpus_per_node`` ask for the allocation)."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from hpc_verl.errors import ConfigError
from hpc_verl.launch.spec.jobconfig import load_job_config
from hpc_verl.launch.spec.render import derived_overrides
from hpc_verl.launch.spec.trainer_command import parse_trainer_command
from hpc_verl.profiles import load_profile

DATA = Path(__file__).resolve().parent / "data" / "verl_scripts"
MAIN_PPO = ["python3", "-m", "verl.trainer.main_ppo"]


# verl refuses an actor without a micro-batch size (its own start-up check)
MICRO = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1"]

def script_args(name: str) -> list[str]:
    """The main_ppo arguments of a verl example script, as kept in tests/data/verl_scripts."""
    return [ln for ln in (DATA / name).read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def _lines(res: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in res.stderr.splitlines() if ln.strip() and "warning" not in ln]


# ---------------------------------------------------------------- verl's own example, as-is
@pytest.mark.parametrize("sets", [[], ["--set", "slurm.nodes=1"]])
def test_verl_example_script_renders_for_ib_a100(cli, tmp_path, sets):
    args = script_args("run_qwen3_8b_fsdp.args")
    out = tmp_path / "job.sbatch"
    res = cli("render", "--profile", "ib-a100", *sets, "-o", str(out), "--", *MAIN_PPO, *args, timeout=180)
    assert res.returncode == 0, res.stderr
    script = out.read_text()
    assert "#SBATCH --nodes=1" in script and "#SBATCH --gpus-per-node=8" in script  # trainer.nnodes=1 asks for 1
    assert "export HPCV_TRAINER_MODULE=verl.trainer.main_ppo" in script
    body = script.split("HPCV_TRAINER_ARGS=(", 1)[1].split(")\n", 1)[0]
    for arg in args:  # every override of the script, in its order, quoted for the shell
        assert arg in body or f"'{arg}'" in body or arg.replace("'", "'\"'\"'") in body, arg
    assert "job       hpcv ((trainer command after --))" in res.stderr


def test_the_command_is_the_same_job_config_a_yaml_gives(tmp_path):
    yaml_job = tmp_path / "job.yaml"
    yaml_job.write_text("name: mine\ntrainer:\n  module: hpc_verl.trainer.main\n  overrides:\n"
                        "    trainer.total_epochs: 2\n    data.max_prompt_length: 64\n")
    job = load_job_config(str(yaml_job), ["trainer.total_epochs=3"],
                          [*MAIN_PPO, "--config-name", "ppo_megatron_trainer", "--config-path=cfg",
                           "data.max_prompt_length=128", "+actor_rollout_ref.actor.policy_loss.tau_pos=1.0"])
    assert job.name == "mine"  # the file's other settings stay
    assert job.trainer.module == "verl.trainer.main_ppo"
    assert job.trainer.args == ["--config-name", "ppo_megatron_trainer", "--config-path=cfg"]
    assert job.trainer.overrides == {"trainer.total_epochs": "3", "data.max_prompt_length": "128",
                                     "+actor_rollout_ref.actor.policy_loss.tau_pos": "1.0"}


@pytest.mark.parametrize("python", ["python", "python3", "python3.11", "/opt/venv/bin/python3"])
def test_any_python_and_module(python):
    cmd = parse_trainer_command([python, "-u", "-m", "my_pkg.train", "-cn", "mine", "a.b=1"])
    assert (cmd.module, cmd.args, cmd.overrides) == ("my_pkg.train", ["-cn", "mine"], ["a.b=1"])


@pytest.mark.parametrize("argv, words", [
    ([], "nothing after '--'"),
    (["bash", "run.sh"], "expected a Python"),
    (["python3", "train.py", "a=1"], "expected '-m MODULE'"),
    (["python3", "-m", "verl.trainer.main_ppo", "--multirun", "a=1"], "'--multirun' is not supported"),
    (["python3", "-m", "verl.trainer.main_ppo", "trainer"], "is not key=value"),
    (["python3", "-m", "verl.trainer.main_ppo", "--config-name"], "needs a value"),
    (["python3", "-m", "bad module", "a=1"], "-m 'bad module'"),
])
def test_commands_that_cannot_be_a_job_are_one_line(cli, tmp_path, argv, words):
    res = cli("render", "--profile", "ib-a100", "-o", str(tmp_path / "x.sbatch"), "--", *argv)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    (line,) = _lines(res)
    assert words in line, line
    assert not (tmp_path / "x.sbatch").exists()


def test_hostile_strings_reach_the_trainer_literally(cli, tmp_path):
    # each a value verl's Hydra takes (quoted for Hydra), and each hostile to a shell
    hostile = ["trainer.experiment_name='$(touch PWNED) x'", "trainer.project_name='`id`;rm -rf /'",
               "data.train_files=['/d/a b.parquet', \"/d/c'd.parquet\"]", "trainer.default_hdfs_dir='x\\y$HOME'"]
    out = tmp_path / "job.sbatch"
    res = cli("render", "--profile", "ib-a100", "--check", "-o", str(out), "--", *MAIN_PPO,
              "actor_rollout_ref.rollout.name=vllm", *MICRO, *hostile, cwd=tmp_path, timeout=180)
    assert res.returncode == 0, res.stderr  # --check: bash -n and shellcheck pass
    line = next(ln for ln in out.read_text().splitlines() if ln.strip().startswith("HPCV_TRAINER_ARGS=("))
    got = subprocess.run(["bash", "-c", line + '; printf "%s\\n" "${HPCV_TRAINER_ARGS[@]}"'], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert got == ["actor_rollout_ref.rollout.name=vllm", *MICRO, *hostile]
    assert not (tmp_path / "PWNED").exists()


def test_submit_dry_run_writes_the_job_directory_of_the_command(cli, tmp_path):
    env = {"HPC_VERL_HOME": str(tmp_path / "home")}
    res = cli("submit", "--profile", "local", "--dry-run", "--name", "cmdjob", "--",
              "python3", "-m", "hpc_verl.trainer.main", "trainer.total_epochs=1", cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    (job_dir,) = (tmp_path / "home" / "jobs").iterdir()
    job = json.loads((job_dir / "job_config.json").read_text())
    assert job["name"] == "cmdjob" and job["trainer"]["module"] == "hpc_verl.trainer.main"
    assert job["trainer"]["overrides"] == {"trainer.total_epochs": "1"}


# ---------------------------------------------------------------- the job's size
def _job(**overrides: str):
    job = load_job_config(None, [f"{k}={v}" for k, v in overrides.items()])
    job.trainer.module = "verl.trainer.main_ppo"
    return job


def test_size_from_the_job_asks_for_the_allocation():
    from hpc_verl.launch.spec.job_size import size_sets

    ib = load_profile("ib-a100")  # 2 nodes x 8 GPUs
    assert size_sets(ib, _job(**{"trainer.nnodes": "4", "trainer.n_gpus_per_node": "4"})) == \
        ["slurm.nodes=4", "slurm.gpus_per_node=4"]
    assert size_sets(ib, _job(**{"trainer.nnodes": "2"})) == []          # already the profile's
    assert size_sets(ib, _job(**{"trainer.nnodes": "1"}), ["slurm.nodes=1"]) == []  # --set agrees


@pytest.mark.parametrize("overrides, sets, fix", [
    ({"trainer.nnodes": "1"}, ["slurm.nodes=2"], "use --set slurm.nodes=1"),
    ({"trainer.n_gpus_per_node": "16"}, [], "add --set slurm.gpus_per_node=16"),
    ({"trainer.n_gpus_per_node": "4"}, ["slurm.gpus_per_node=8"], "use --set slurm.gpus_per_node=4"),
    ({"trainer.nnodes": "two"}, [], "must be a whole number"),
])
def test_size_conflicts_are_one_line_naming_the_set(cli, tmp_path, overrides, sets, fix):
    set_args = [a for s in sets for a in ("--set", s)]
    res = cli("render", "--profile", "ib-a100", *set_args, "-o", str(tmp_path / "x.sbatch"), "--", *MAIN_PPO,
              "actor_rollout_ref.rollout.name=vllm", *[f"{k}={v}" for k, v in overrides.items()])
    assert res.returncode == 2
    (line,) = _lines(res)
    assert fix in line, line
    assert not (tmp_path / "x.sbatch").exists()


def test_job_size_in_a_submission_goes_to_the_script(tmp_path, monkeypatch):
    from hpc_verl.launch.spec.launch_plan import build_plan

    plan = build_plan("ib-a100", None, None, command=[*MAIN_PPO, "actor_rollout_ref.rollout.name=vllm", *MICRO,
                                                      "trainer.nnodes=1", "trainer.n_gpus_per_node=4"])
    assert plan.nodes == 1 and plan.gpus_per_node == 4
    assert "--nodes=1" in plan.sbatch_options and "--gpus-per-node=4" in plan.sbatch_options


def test_allocation_disagreement_from_the_api_names_the_set():
    from hpc_verl.verl_upstream.command import Allocation, build_verl_command

    with pytest.raises(ConfigError) as err:
        build_verl_command(["trainer.nnodes=4", "actor_rollout_ref.rollout.name=vllm"], Allocation(2, 8, 32),
                           check_keys=False)
    assert "--set slurm.nodes=4" in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------- Hydra's output directory
def test_hydra_output_goes_into_the_run_directory_unless_the_job_says():
    profile = load_profile("ib-a100")
    derived = dict(derived_overrides(profile, _job(**{"actor_rollout_ref.rollout.name": "vllm"})))
    assert derived["hydra.run.dir"] == "$HPCV_RUN_DIR/hydra"
    own = dict(derived_overrides(profile, _job(**{"hydra.run.dir": "/scratch/h"})))
    assert "hydra.run.dir" not in own
    builtin = load_job_config(None)
    assert "hydra.run.dir" not in dict(derived_overrides(profile, builtin))  # our trainer has no Hydra
    assert re.match(r"^\$HPCV_RUN_DIR/", derived["hydra.run.dir"])


def test_plan_takes_the_size_and_samples_from_the_command(cli):
    res = cli("plan", "--profile", "ib-a100", "--format", "json", "--", *MAIN_PPO, "trainer.nnodes=4",
              "actor_rollout_ref.rollout.n=5")
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    same = json.loads(cli("plan", "--profile", "ib-a100", "--format", "json", "--nodes", "4",
                          "--rollout-n", "5").stdout)
    assert plan == same and plan["nodes"] == 4
    res = cli("plan", "--profile", "ib-a100")
    assert res.returncode == 2 and "--nodes N is required" in res.stderr
