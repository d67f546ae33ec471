"""A job that chooses upstream verl (trainer.module: verl.trainer.main_ppo), end to end
through the launcher's render: refused before anything is written or submitted when an
override is misspelt or the batch does not divide across the GPUs; rendered otherwise."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from hpc_verl.launch.spec.jobconfig import JobConfig, load_job_config
from hpc_verl.launch.spec.render import derived_overrides
from hpc_verl.launch.spec.trainer_check import trainer_kind, validate_job_trainer
from hpc_verl.profiles import load_profile
from hpc_verl.verl_upstream import config as vconfig
from hpc_verl.verl_upstream import startup

needs_verl = pytest.mark.skipif(vconfig.find_verl() is None, reason="upstream verl not installed")

if vconfig.find_verl() is not None:
    startup.preload()  # verl's own check runs in this process: one import, not one per check


JOB = """\
name: verl-gsm8k
trainer:
  module: verl.trainer.main_ppo
  overrides:
    actor_rollout_ref.rollout.name: vllm
    data.train_batch_size: {tbs}
    actor_rollout_ref.actor.ppo_mini_batch_size: 256
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu: 4
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu: 8
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu: 8
    critic.ppo_micro_batch_size_per_gpu: 4
{extra}"""


def job_file(tmp_path, tbs=1024, extra=""):
    p = tmp_path / "job.yaml"
    p.write_text(JOB.format(tbs=tbs, extra=textwrap.indent(extra, "    ")))
    return p


@needs_verl
def test_verl_job_renders_main_ppo(cli, tmp_path):
    out = tmp_path / "job.sbatch"
    res = cli("render", "--profile", "ib-a100", "--config", str(job_file(tmp_path)), "-o", str(out))
    assert res.returncode == 0, res.stderr
    script = out.read_text()
    assert "verl.trainer.main_ppo" in script and "actor_rollout_ref.rollout.name=vllm" in script


@needs_verl
def test_misspelt_override_refused_before_anything_is_written(cli, tmp_path):
    out = tmp_path / "job.sbatch"
    res = cli("render", "--profile", "ib-a100", "--config", str(job_file(tmp_path)),
              "actor_rollout_ref.rollout.gpu_memory_utilisation=0.9", "-o", str(out))
    assert res.returncode == 2 and not out.exists()
    (line,) = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert "did you mean 'actor_rollout_ref.rollout.gpu_memory_utilization'" in line
    assert "Traceback" not in res.stderr


@needs_verl
def test_batch_not_dividing_gpus_refused_with_numbers(cli, tmp_path):
    res = cli("render", "--profile", "ib-a100", "--config", str(job_file(tmp_path, tbs=1000)))
    assert res.returncode == 2
    assert "data.train_batch_size (1000)" in res.stderr and "16 GPUs" in res.stderr
    # the same job on 5 nodes of 8: 1000 x 1 is not divisible by 40 either, 1040 is
    res = cli("render", "--profile", "ib-a100", "--set", "slurm.nodes=5", "--config",
              str(job_file(tmp_path, tbs=1040)), "actor_rollout_ref.actor.ppo_mini_batch_size=520",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "critic.ppo_micro_batch_size_per_gpu=1",
              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2")
    assert res.returncode == 0, res.stderr


def test_allocation_keys_never_typed_twice(tmp_path):
    profile = load_profile("ib-a100")
    job = load_job_config(str(job_file(tmp_path, extra="trainer.nnodes: 4\n")))
    with pytest.raises(Exception) as e:
        validate_job_trainer(profile, job)
    assert "trainer.nnodes=4" in str(e.value) and "2 node(s)" in str(e.value)


@needs_verl
def test_launcher_derived_keys_are_verl_keys(tmp_path):
    """The launcher adds data paths, checkpoint dir and model path: all must exist in verl."""
    schema = vconfig.schema()
    job = load_job_config(str(job_file(tmp_path)))
    job.model.path = "models/m"
    for key, _ in derived_overrides(load_profile("ib-a100"), job):
        if key.startswith("hydra."):  # Hydra's own config (hydra.run.dir), not verl's
            import dataclasses

            from hydra.conf import HydraConf

            node: object = HydraConf()
            for part in key.split(".")[1:]:
                assert part in {f.name for f in dataclasses.fields(node)}, key
                node = getattr(node, part)
            continue
        assert key in schema.keys, key


def test_trainer_kind():
    assert trainer_kind(JobConfig()) == "builtin"
    job = JobConfig()
    job.trainer.module = "verl.trainer.main_ppo"
    assert trainer_kind(job) == "verl"


def test_builtin_trainer_gets_the_same_arithmetic(tmp_path):
    """Through the trainer's own config loader when it is present (the trainer branch)."""
    pytest.importorskip("hpc_verl.trainer.config.schema")
    from hpc_verl.errors import ConfigError

    profile = load_profile("ib-a100")
    job = load_job_config(None, ["data.train_batch_size=1000"])
    with pytest.raises(ConfigError) as e:
        validate_job_trainer(profile, job)
    assert "1000" in str(e.value) and "16" in str(e.value)
    # the built-in trainer's own layout rules: the transformers rollout has no tensor parallelism,
    # and a vLLM replica's TP must divide the rollout's GPUs of a node
    job = load_job_config(None, ["actor_rollout_ref.rollout.tensor_model_parallel_size=3"])
    with pytest.raises(ConfigError, match="tensor parallelism needs rollout.name=vllm"):
        validate_job_trainer(profile, job)
    job = load_job_config(None, ["actor_rollout_ref.rollout.tensor_model_parallel_size=3",
                                 "actor_rollout_ref.rollout.name=vllm",
                                 "hpc_verl.device_mapping={actor: [0,1,2,3], rollout: [4,5,6,7]}"])
    with pytest.raises(ConfigError, match="does not divide the rollout's 4 GPUs per node"):
        validate_job_trainer(profile, job)
    job = load_job_config(None, ["trainer.n_gpus_per_node=4"])
    with pytest.raises(ConfigError, match="disagrees with profile 'ib-a100'"):
        validate_job_trainer(profile, job)
    assert validate_job_trainer(profile, load_job_config(None, [])).kind == "builtin"


@needs_verl
def test_rendered_overrides_compose_against_verl(tmp_path):
    """Take the trainer arguments out of the rendered script as bash expands them (with
    the run-time variables a 2-node job has) and compose them with verl's config."""
    import re
    import subprocess

    from hpc_verl.launch.spec.launch_plan import build_plan
    from hpc_verl.verl_upstream.command import resolved_config

    extra = 'trainer.experiment_name: "my run"\ntrainer.logger: [console]\n'
    plan = build_plan("ib-a100", str(job_file(tmp_path, extra=extra)))
    args_line = re.search(r"^\s*HPCV_TRAINER_ARGS=\(.*\)$", plan.script, flags=re.M).group(0)
    call = re.search(r'-m "\$HPCV_TRAINER_MODULE" "\$\{HPCV_TRAINER_ARGS\[@\]\}" \\\n((?:\s+".*" [\\&]\n)+)',
                     plan.script).group(1)
    derived = " ".join(line.strip().rstrip("\\&").strip() for line in call.splitlines())
    snippet = (f"HPCV_NODES=2 HPCV_GPUS_PER_NODE=8 HPCV_DATA_PATH=/d HPCV_TRAIN_FILE=t.parquet "
               f"HPCV_VAL_FILE=v.parquet HPCV_RUN_DIR=/r\n{args_line}\n"
               f'printf "%s\\n" "${{HPCV_TRAINER_ARGS[@]}}" {derived}\n')
    out = subprocess.run(["bash", "-c", snippet], capture_output=True, text=True, check=True).stdout
    overrides = out.splitlines()
    assert "trainer.nnodes=2" in overrides and "trainer.experiment_name=my run" in overrides
    cfg = resolved_config(overrides)
    assert cfg["trainer"]["nnodes"] == 2 and cfg["trainer"]["n_gpus_per_node"] == 8
    assert cfg["trainer"]["experiment_name"] == "my run" and cfg["data"]["train_files"] == "/d/t.parquet"
    assert cfg["actor_rollout_ref"]["rollout"]["name"] == "vllm"


def test_without_verl_the_job_renders_with_one_warning_line(tmp_path):
    """verl hidden from the interpreter (sys.modules['verl'] = None makes find_spec fail)."""
    import subprocess
    import sys

    from conftest import REPO
    job = job_file(tmp_path, extra="trainer.nnode: 3\n")
    code = ("import sys; sys.modules['verl'] = None\n"
            "from hpc_verl.cli.main import main\n"
            f"sys.exit(main(['render', '--profile', 'ib-a100', '--config', {str(job)!r}]))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert line.startswith("hpc-verl: warning: upstream verl is not installed") and "skipped" in line
    assert "validate_config" in line and "batch arithmetic ran" in line
    assert "trainer.nnode=3" in res.stdout


@needs_verl
def test_example_verl_job_validates_and_renders(cli):
    from conftest import REPO
    res = cli("validate", "--profile", "ib-a100", "--config", str(REPO / "examples" / "job_verl_gsm8k.yaml"),
              "--no-shellcheck")
    assert res.returncode == 0, res.stderr


CPU_NODES = ["accelerator=none", "slurm.gpus_per_node=0"]
CPU_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "job_verl_cpu.yaml"


@needs_verl
@pytest.mark.parametrize("nodes", [1, 2])
def test_the_cpu_example_is_accepted_on_one_and_two_cpu_nodes(nodes):
    profile = load_profile("testbed", [*CPU_NODES, f"slurm.nodes={nodes}"])
    check = validate_job_trainer(profile, load_job_config(str(CPU_EXAMPLE)))
    assert check.kind == "verl" and check.command.resolved["trainer"]["nnodes"] == nodes


@needs_verl
def test_log_prob_micro_batch_larger_than_a_ranks_share_is_one_line_before_submission(cli, tmp_path):
    """Two CPU nodes, 4 × 2 samples: 4 per rank, and a log-prob micro-batch of 8 makes verl's engine
    assert at its first compute_log_prob (verl/workers/engine/utils.py), minutes into the job."""
    out = tmp_path / "job.sbatch"
    sets = [a for s in [*CPU_NODES, "slurm.nodes=2"] for a in ("--set", s)]
    res = cli("render", "--profile", "testbed", *sets, "--config", str(CPU_EXAMPLE),
              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8", "-o", str(out))
    assert res.returncode == 2 and not out.exists() and "Traceback" not in res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert "log_prob_micro_batch_size_per_gpu (8) does not divide the 4 samples" in line
    assert "use one of 1, 2, 4" in line
