"""The render: lint-clean on every profile, the acceptance content of ib-a100, CLI behaviour."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hpc_verl.errors import ConfigError, RenderError
from hpc_verl.launch.spec.jobconfig import load_job_config
from hpc_verl.launch.spec.launch_plan import build_plan, validate_script
from hpc_verl.launch.spec.render import environment, shquote

HERE = Path(__file__).resolve().parent
SHIPPED = ["eth-l40s", "ib-a100", "local", "mi300x-rocm", "pyxis-h100", "roce-h100", "testbed", "testbed-docker",
           "testbed-podman"]
VARIANTS = {
    "ib-a100/apptainer": ("ib-a100", ["container.runtime=apptainer", "container.image=/shared/hpc-verl.sif"]),
    "mi300x/podman": ("mi300x-rocm", ["container.runtime=podman"]),
    "eth-l40s/singularity+gres": ("eth-l40s", ["container.runtime=singularity", "slurm.gpu_request=gres"]),
    "roce/docker-all-options": ("roce-h100", ["container.runtime=docker", "slurm.extra_args=[--mail-type=END]",
                                              "slurm.account=proj1", "slurm.qos=high", "env.nccl_debug=INFO",
                                              "container.devices=[/dev/gdrdrv]", "ray.dashboard=true",
                                              "container.mounts=[/scratch:/scratch:ro]"]),
}


def test_bash_n_and_shellcheck_clean_on_every_render(tmp_path):
    """One shellcheck run over the renders that `validate --all` (test_cli_validate) does not cover:
    runtime variants and a job config, each with and without the example job."""
    assert shutil.which("shellcheck"), "shellcheck is part of the set-up (scripts/setup.sh)"
    files = []
    cases = {"ib-a100": ("ib-a100", [])} | VARIANTS
    for case, (profile, sets) in cases.items():
        for job in (None, str(HERE / "data" / "job_example.yaml")):
            if job is None and case == "ib-a100":
                continue
            text = build_plan(profile, job, profile_overrides=sets).script
            f = tmp_path / f"{case.replace('/', '_')}{'-job' if job else ''}.sbatch"
            f.write_text(text)
            files.append(f)
            res = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
            assert res.returncode == 0, f"{case}: {res.stderr}"
    res = subprocess.run(["shellcheck", "--shell=bash", "--format=gcc", *map(str, files)],
                         capture_output=True, text=True)
    assert res.returncode == 0 and not res.stdout.strip(), res.stdout


def test_validate_script_reports_problems():
    assert validate_script("#!/bin/bash\necho ok\n") == []
    bad = validate_script("#!/bin/bash\nif true; then\n")
    assert bad and bad[0].startswith("bash -n:")
    lint = validate_script("#!/bin/bash\nx=$1\necho $x\n")
    assert any("SC2086" in p for p in lint)


def test_ib_a100_render_has_what_acceptance_asks():
    s = build_plan("ib-a100").script
    # header: version, profile, how to run; #SBATCH lines from the profile
    assert s.startswith("#!/bin/bash\n") and "hpc-verl 0.1.0 | profile: ib-a100" in s and "sbatch THIS_FILE" in s
    for opt in ("--nodes=2", "--gpus-per-node=8", "--partition=gpu", "--exclusive", "--requeue",
                "--signal=B:USR2@600", "--time=1-00:00:00", "--cpus-per-task=64"):
        assert f"#SBATCH {opt}\n" in s
    # per-node container: job- and node-scoped name, --init, cleanup trap on every exit path
    assert "printf 'hpcv-%s-%s\\n' \"$HPCV_JOB_ID\" \"$(hpcv_node_name)\"" in s
    assert "HPCV_ARGS+=(--init)" in s and "trap hpcv_container_stop EXIT" in s
    assert "trap hpcv_cleanup EXIT" in s and "trap hpcv_on_preempt USR2" in s and "TERM" in s
    # GPUs from the allocation, never all
    assert 'SLURM_STEP_GPUS:-${SLURM_JOB_GPUS' in s and '--gpus "\\"device=$ids\\""' in s
    assert not re.search(r"--gpus[ =]all|device=all", s)
    # NCCL/IB from the profile, IB devices, IPC_LOCK, memlock, shm
    assert "hpcv_export NCCL_IB_HCA mlx5_0,mlx5_1,mlx5_2,mlx5_3" in s
    assert "HPCV_DEVICES=(/dev/infiniband)" in s and "--cap-add IPC_LOCK" in s and "memlock=-1:-1" in s
    assert "--shm-size 128g" in s
    # Ray: ports from the job id at run time, head + workers via srun, bounded barrier, no sleep-as-wait
    assert '--port-base "$HPCV_RAY_PORT_BASE" --port-stride "$HPCV_RAY_PORT_STRIDE"' in s
    assert '--job-id "$HPCV_JOB_ID"' in s
    assert 'export HPCV_JOB_ID="${SLURM_JOB_ID:-$$}"' in s
    assert "hpcv_ray_node head" in s and "hpcv_ray_node worker" in s
    assert '-m hpc_verl.bootstrap wait --job-dir "$HPCV_RUN_DIR"' in s and '--timeout-s "$HPCV_RAY_TIMEOUT_S"' in s
    assert not re.search(r"sleep [0-9]+[^.]", s.replace("sleep 1\n  done", ""))  # only the bounded poll
    # stages in order
    pipeline = s[s.index("# ---- the pipeline"):]
    calls = ["hpcv_validate", "hpcv_containers_up", "hpcv_stage preprocess", "hpcv_stage model-check",
             "hpcv_ray_up", "hpcv_stage train", "hpcv_collect"]
    idx = [pipeline.index(c) for c in calls]
    assert idx == sorted(idx)


def test_runtime_specifics():
    pyxis = build_plan("pyxis-h100").script
    assert '--container-image="$HPCV_IMAGE"' in pyxis and "HPCV_CONTAINER_MODE=sync" in pyxis
    amd = build_plan("mi300x-rocm").script
    assert "--device /dev/kfd" in amd and "renderD$((128 + id))" in amd and "HSA_NO_SCRATCH_RECLAIM" in amd
    app = build_plan("eth-l40s").script
    assert "instance start" in app and "--nv" in app and "hpcv_export NCCL_IB_DISABLE 1" in app
    assert "hpcv_export NCCL_SOCKET_IFNAME eth0" in app
    roce = build_plan("roce-h100").script
    assert "hpcv_export NCCL_IB_GID_INDEX 3" in roce and "nvidia.com/gpu=$id" in roce
    local = build_plan("local").script
    local_code = "\n".join(ln for ln in local.splitlines() if not ln.lstrip().startswith("#"))
    assert "#SBATCH" not in local and "srun --" not in local_code and "setsid bash -c" in local


def test_strict_environment_and_quoting():
    env = environment()
    with pytest.raises(Exception):
        env.from_string("{{ nope }}").render()
    assert shquote("a b'c") == "'a b'\"'\"'c'" and shquote(True) == "true" and shquote(3) == "3"
    with pytest.raises(RenderError):
        shquote(None)


def test_job_config_strict_keys_and_values(tmp_path):
    bad = tmp_path / "job.yaml"
    bad.write_text("name: x\ntrainer:\n  modul: foo\n")
    with pytest.raises(ConfigError, match=r"unknown key 'modul' \(did you mean 'module'\?\)"):
        load_job_config(str(bad))
    bad.write_text("name: 'bad name; rm -rf /'\n")
    with pytest.raises(ConfigError, match="name must be letters"):
        load_job_config(str(bad))
    bad.write_text("data:\n  dir: \"a\\nb\"\n")
    with pytest.raises(ConfigError, match="data.dir must not contain newlines"):
        load_job_config(str(bad))
    with pytest.raises(ConfigError, match="is not a dotted key"):
        load_job_config(None, ["$(x)=1"])
    with pytest.raises(ConfigError, match="must look like key=value"):
        load_job_config(None, ["trainer.total_epochs"])
    job = load_job_config(None, ["trainer.total_epochs=2", "+extra.key=a b"])
    assert job.trainer_override_args() == ["trainer.total_epochs=2", "+extra.key=a b"]
    # the same declarative fields as the profile schema: every value checked, one line naming the key
    for text, needle in (("trainer:\n  overrides: {'$(x)': 1}\n", "trainer.overrides.$(x) is not a dotted key"),
                         ("data:\n  train_file: sub/t.parquet\n", "data.train_file must be a file name"),
                         ("model:\n  check: 'yes'\n", "model.check must be true or false, got 'yes'"),
                         ("ray_job:\n  command: []\n", "ray_job.command must not be empty"),
                         ("ray_job:\n  env_vars: {'A B': x}\n", "ray_job.env_vars.A B must be a variable name"),
                         ("ray_job:\n  entrypoint_num_gpus: -1\n", "ray_job.entrypoint_num_gpus must be between"),
                         ("ray_job:\n  ship_hpc_verl: maybe\n", "ray_job.ship_hpc_verl must be auto, true or false"),
                         ("ray_job: 3\n", "ray_job must be a mapping of command, working_dir")):
        bad.write_text(text)
        with pytest.raises(ConfigError) as err:
            load_job_config(str(bad))
        assert str(err.value).startswith(f"job config {bad}: ") and needle in str(err.value), str(err.value)
    bad.write_text("ray_job:\n  ship_hpc_verl: true\n  entrypoint_num_cpus: 2\n  command: [python3, t.py]\n")
    opts = load_job_config(str(bad)).ray_job  # parsed once, stored typed
    assert (opts.ship_hpc_verl, opts.entrypoint_num_cpus, opts.command) == ("true", 2.0, ["python3", "t.py"])
    assert opts.ships_hpc_verl(runs_hpc_verl=False)


def test_absolute_job_path_outside_mounts_is_refused(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("model:\n  path: /elsewhere/model\n")
    with pytest.raises(RenderError, match="model.path '/elsewhere/model' is outside every directory mounted"):
        build_plan("ib-a100", str(job))
    assert build_plan("ib-a100", str(job), profile_overrides=["container.mounts=[/elsewhere:/elsewhere]"])


def test_absolute_job_path_under_the_submit_directory_is_accepted(tmp_path, monkeypatch):
    """The submit directory is mounted into the container: an absolute path below it is inside."""
    job = tmp_path / "job.yaml"
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    job.write_text(f"model:\n  path: {tmp_path / 'models' / 'tiny'}\ndata:\n  dir: {tmp_path / 'data'}\n")
    monkeypatch.chdir(tmp_path)
    assert build_plan("ib-a100", str(job))
    monkeypatch.chdir(tmp_path / "models")  # submitted from below: the job's data dir is not mounted
    with pytest.raises(RenderError, match="data.dir .* is outside every directory mounted"):
        build_plan("ib-a100", str(job))


def test_cli_render_writes_atomically_and_refuses_bad_input(cli, tmp_path):
    out = tmp_path / "job.sbatch"
    res = cli("render", "--profile", "ib-a100", "-o", str(out), "trainer.total_epochs=2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert out.stat().st_mode & 0o111 and "trainer.total_epochs=2" in out.read_text()
    assert "wrote" in res.stderr and "stages    validate -> preprocess" in res.stderr
    bad_cases = [
        (["--set", "slurm.gpus_per_node=-1"], "slurm.gpus_per_node must be between 0 and 64"),
        (["--set", "slurm.gpus_per_nod=8"], "did you mean 'gpus_per_node'"),
        (["--set", "container.mounts=['/a\\nb:/x']"], None),
        (["--set", "container.mounts=['/data:/x\n;touch /tmp/pwned']"], "must not contain newlines"),
        (["--set", "paths.job_root=/a b"], "cannot go into an #SBATCH line"),
    ]
    for extra, fragment in bad_cases:
        target = tmp_path / "bad.sbatch"
        res = cli("render", "--profile", "ib-a100", *extra, "-o", str(target), cwd=tmp_path)
        if fragment is None:  # a literal backslash-n is just two characters: quoted, accepted
            assert res.returncode == 0, res.stderr
            target.unlink()
            continue
        assert res.returncode == 2, (extra, res.stderr)
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in res.stderr, res.stderr
        assert not target.exists() and not list(tmp_path.glob(".bad.sbatch.*"))


def test_cli_render_with_a_broken_site_profile_writes_nothing(cli, tmp_path):
    (tmp_path / "cluster_profiles").mkdir()
    (tmp_path / "cluster_profiles" / "site.yaml").write_text("extends: ib-a100\nslurm:\n  gpus_per_node: -8\n")
    (tmp_path / "cluster_profiles" / "typo.yaml").write_text("extends: ib-a100\ncontainer:\n  shm_sise: 64G\n")
    for name, fragment in (("site", "site.yaml:3): slurm.gpus_per_node must be between 0 and 64, got -8"),
                           ("typo", "typo.yaml:3): section 'container': unknown key 'shm_sise' "
                                    "(did you mean 'shm_size'?)")):
        res = cli("render", "--profile", name, "-o", "out.sbatch", cwd=tmp_path)
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert res.returncode == 2 and len(lines) == 1 and fragment in lines[0], res.stderr
        assert not (tmp_path / "out.sbatch").exists()


def test_cli_overrides_anywhere_on_the_line(cli, tmp_path):
    res = cli("render", "--profile", "ib-a100", "trainer.total_epochs=1", "--set", "slurm.nodes=4", "trainer.save_freq=2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "HPCV_TRAINER_ARGS=(trainer.total_epochs=1 trainer.save_freq=2)" in res.stdout and "#SBATCH --nodes=4" in res.stdout
    res = cli("render", "--profile", "ib-a100", "--bogus", cwd=tmp_path)
    assert res.returncode == 2 and "unrecognized arguments: --bogus" in res.stderr


def test_cli_validate(cli, tmp_path):
    res = cli("validate", "--all", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    for name in SHIPPED:
        assert f"✓ {name}: schema, bash -n, shellcheck ok" in res.stdout
    res = cli("validate", "--profile", "ib-a100", "--set", "network.transport=roce", cwd=tmp_path)
    assert res.returncode == 2 and "network.gid_index is required" in res.stderr
    res = cli("validate", cwd=tmp_path)
    assert res.returncode == 2 and "give either --profile NAME or --all" in res.stderr
