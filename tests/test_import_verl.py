"""``hpc-verl import-verl RUN.sh``: verl launch scripts of the shapes verl's examples have, read (never
run) into job configs. The scripts here are written for the test in those shapes: knobs with
``${VAR:-default}``, a device chosen by a command substitution, ``case``/``if`` on settings, argument
arrays built up with ``+=``, ``$((...))``, a launcher array in front of python, ``ray job submit --``,
Hydra's ``--config-path/--config-name``."""
from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import yaml

from hpc_verl.launch.spec.import_verl import import_script

ENV = {"HOME": "/home/u", "PATH": os.environ.get("PATH", "")}

FSDP_SHAPE = textwrap.dedent('''\
    #!/usr/bin/env bash
    # GRPO | some model | FSDP
    set -xeuo pipefail
    DEVICE=${DEVICE:-$(python3 -c 'import torch_npu' 2>/dev/null && echo npu || echo gpu)}
    BACKEND=${BACKEND:-vllm}
    NNODES=${NNODES:-1}
    NGPUS_PER_NODE=${NGPUS_PER_NODE:-}
    train_batch_size=${TRAIN_BATCH_SIZE:-1024}
    max_prompt_length=${MAX_PROMPT_LENGTH:-1024}
    rollout_tp=${ROLLOUT_TP:-}
    EXPERIMENT_NAME=${EXPERIMENT_NAME:-grpo_${BACKEND}_$(date +%Y%m%d_%H%M)}
    case "${DEVICE}" in
        gpu | npu) ;;
        *)
            echo "DEVICE must be gpu or npu" >&2
            exit 1
            ;;
    esac
    EXTRA=()
    case "${DEVICE}" in
        gpu)
            NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}
            rollout_tp=${rollout_tp:-2}
            offload=False
            ;;
        npu)
            NGPUS_PER_NODE=16
            rollout_tp=4
            offload=True
            max_prompt_length=$((1024 * 2))
            EXTRA+=(actor_rollout_ref.actor.use_torch_compile=False)
            ;;
    esac
    DATA=(
        algorithm.adv_estimator=grpo
        data.train_files="['$HOME/data/gsm8k/train.parquet', '$HOME/data/math/train.parquet']"
        data.train_batch_size=${train_batch_size}
        data.max_prompt_length=${max_prompt_length}   # long prompts
        data.truncation='error'
    )
    ROLLOUT=(
        actor_rollout_ref.rollout.name=${BACKEND}
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4
        actor_rollout_ref.rollout.tensor_model_parallel_size=${rollout_tp}
        actor_rollout_ref.actor.fsdp_config.param_offload=${offload}
    )
    TRAINER=(
        trainer.logger='["console","wandb"]'
        trainer.experiment_name=${EXPERIMENT_NAME}
        trainer.n_gpus_per_node=${NGPUS_PER_NODE}
        trainer.nnodes=${NNODES}
    )
    LAUNCH=(python3)
    if [ "${USE_UV:-0}" != 0 ]; then
        LAUNCH=(uv run python3)
    fi
    "${LAUNCH[@]}" -m verl.trainer.main_ppo \\
        "${DATA[@]}" \\
        "${ROLLOUT[@]}" \\
        "${TRAINER[@]}" \\
        "${EXTRA[@]}" \\
        "$@"
''')

MEGATRON_SHAPE = textwrap.dedent('''\
    set -x
    export CUDA_DEVICE_MAX_CONNECTIONS=1 # overlap
    gsm8k_train_path=$HOME/data/gsm8k/train.parquet
    train_files="['$gsm8k_train_path']"
    python3 -m verl.trainer.main_ppo --config-path=config \\
        --config-name='ppo_megatron_trainer.yaml'\\
        algorithm.adv_estimator=grpo \\
        data.train_files="$train_files" \\
        actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2 \\
        actor_rollout_ref.model.path=$MODEL_PATH \\
        trainer.nnodes=1 $@
''')

RAY_SUBMIT_SHAPE = textwrap.dedent('''\
    #!/bin/bash
    PROJECT=my_project
    ray job submit --address="http://127.0.0.1:8265" \\
        --runtime-env=verl/trainer/runtime_env.yaml \\
        --no-wait \\
        -- \\
        python3 -m verl.trainer.main_ppo \\
        trainer.project_name=$PROJECT \\
        trainer.nnodes=4
''')


def _write(tmp_path: Path, text: str, name: str = "run_job.sh") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_fsdp_shaped_script_with_the_device_chosen(tmp_path):
    got = import_script(str(_write(tmp_path, FSDP_SHAPE)), {**ENV, "DEVICE": "gpu"})
    ov = got.job["trainer"]["overrides"]
    assert got.job["trainer"]["module"] == "verl.trainer.main_ppo" and got.job["name"] == "run_job"
    assert ov == {
        "algorithm.adv_estimator": "grpo",
        "data.train_files": "['/home/u/data/gsm8k/train.parquet', '/home/u/data/math/train.parquet']",
        "data.train_batch_size": "1024", "data.max_prompt_length": "1024", "data.truncation": "error",
        "actor_rollout_ref.rollout.name": "vllm", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size": "2",
        "actor_rollout_ref.actor.fsdp_config.param_offload": "False",
        "trainer.logger": '["console","wandb"]', "trainer.n_gpus_per_node": "8", "trainer.nnodes": "1"}
    # the one value only a run knows: named in one line, left out
    (line,) = got.problems
    assert "trainer.experiment_name left out" in line and "$(date +%Y%m%d_%H%M)" in line and "\n" not in line


def test_the_other_branch_and_the_environment_are_followed(tmp_path):
    got = import_script(str(_write(tmp_path, FSDP_SHAPE)),
                        {**ENV, "DEVICE": "npu", "EXPERIMENT_NAME": "e1", "TRAIN_BATCH_SIZE": "16", "USE_UV": "1"})
    ov = got.job["trainer"]["overrides"]
    assert ov["data.max_prompt_length"] == "2048"  # $((1024 * 2))
    assert ov["data.train_batch_size"] == "16" and ov["trainer.experiment_name"] == "e1"
    assert ov["trainer.n_gpus_per_node"] == "16" and ov["actor_rollout_ref.actor.use_torch_compile"] == "False"
    assert got.problems == []  # `uv run python3` in front of -m: still the trainer


def test_without_the_device_what_depends_on_it_is_named(tmp_path):
    got = import_script(str(_write(tmp_path, FSDP_SHAPE)), ENV)
    keys = {p.split(": ")[1].split(" left out")[0] for p in got.problems}
    assert {"actor_rollout_ref.rollout.tensor_model_parallel_size", "trainer.n_gpus_per_node",
            "actor_rollout_ref.actor.fsdp_config.param_offload", "trainer.experiment_name"} <= keys
    assert all("\n" not in p for p in got.problems)
    assert any("'case' on \"${DEVICE}\" was not followed" in n and "command substitution" in n for n in got.notes)


def test_megatron_shape_keeps_hydra_config_options_and_names_unset_variables(tmp_path):
    got = import_script(str(_write(tmp_path, MEGATRON_SHAPE)), ENV)
    trainer = got.job["trainer"]
    assert trainer["args"] == ["--config-path=config", "--config-name=ppo_megatron_trainer.yaml"]
    assert trainer["overrides"]["data.train_files"] == "['/home/u/data/gsm8k/train.parquet']"
    assert trainer["overrides"]["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"] == "2"
    (line,) = got.problems
    assert "actor_rollout_ref.model.path left out: MODEL_PATH is not set" in line
    assert any("CUDA_DEVICE_MAX_CONNECTIONS" in n for n in got.notes)


def test_ray_job_submit_shape(tmp_path):
    got = import_script(str(_write(tmp_path, RAY_SUBMIT_SHAPE)), ENV)
    assert got.job["trainer"]["overrides"] == {"trainer.project_name": "my_project", "trainer.nnodes": "4"}


def test_cli_writes_a_job_config_that_renders(cli, tmp_path):
    script = _write(tmp_path, FSDP_SHAPE)
    out = tmp_path / "job.yaml"
    res = cli("import-verl", str(script), "-o", str(out), env={"DEVICE": "gpu", "HOME": "/home/u"})
    assert res.returncode == 0, res.stderr
    warnings = [ln for ln in res.stderr.splitlines() if "warning" in ln]
    assert len(warnings) == 1 and "trainer.experiment_name" in warnings[0]
    text = out.read_text()
    assert "# left out:" in text and yaml.safe_load(text)["trainer"]["overrides"]["trainer.nnodes"] == "1"
    res = cli("render", "--profile", "ib-a100", "--config", str(out), "-o", str(tmp_path / "job.sbatch"),
              timeout=180)
    assert res.returncode == 0, res.stderr
    assert "#SBATCH --nodes=1" in (tmp_path / "job.sbatch").read_text()  # the script's size asked for


@pytest.mark.parametrize("text, words", [
    ("echo hello\nmkdir -p out\n", "runs no 'python3 -m MODULE'"),
    ("A='unterminated\npython3 -m verl.trainer.main_ppo a=1\n", "unterminated single quote"),
    ("python3 -m verl.trainer.main_ppo --multirun a=1\n", "'--multirun' is not supported"),
])
def test_scripts_that_cannot_be_imported_are_one_line(cli, tmp_path, text, words):
    script = _write(tmp_path, text)
    out = tmp_path / "job.yaml"
    res = cli("import-verl", str(script), "-o", str(out))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert words in line, line
    assert not out.exists()


def test_the_script_is_never_run(cli, tmp_path):
    marker = tmp_path / "RAN"
    script = _write(tmp_path, f"touch {marker}\nX=$(touch {marker})\npython3 -m verl.trainer.main_ppo a=$X\n")
    res = cli("import-verl", str(script))
    assert res.returncode == 0 and not marker.exists()
    assert "a left out" in res.stderr and "command substitution" in res.stderr


def test_output_is_written_atomically(cli, tmp_path):
    script = _write(tmp_path, "python3 -m verl.trainer.main_ppo a.b=1\n")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        res = cli("import-verl", str(script), "-o", str(ro / "job.yaml"))
        if os.geteuid() != 0:  # root writes anywhere: the case below still holds
            assert res.returncode == 2 and "cannot write" in res.stderr
    finally:
        ro.chmod(0o700)
    out = tmp_path / "job.yaml"
    out.write_text("old\n")
    bad = _write(tmp_path, "echo no trainer\n", "bad.sh")
    assert cli("import-verl", str(bad), "-o", str(out)).returncode == 2
    assert out.read_text() == "old\n"  # a failed import leaves the old file
    assert cli("import-verl", str(script), "-o", str(out)).returncode == 0
    assert yaml.safe_load(out.read_text())["trainer"]["overrides"] == {"a.b": "1"}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".job.yaml")] == []
