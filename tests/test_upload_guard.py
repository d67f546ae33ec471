"""The Ray Jobs upload guard (issue 13, item 4) without a cluster: what Ray would upload, measured.

Large files are sparse (``truncate``): their size is real to Ray's zip, their disk cost is nothing.
The submissions against a real Ray head are in tests/test_rayjobs.py.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpc_verl.errors import ConfigError
from hpc_verl.launch.backends import rayjobs, upload
from hpc_verl.launch.spec.jobconfig import RayJobOptions

MIB = 1024 * 1024


def sparse(path: Path, mib: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(mib * MIB)
    return path


def tree(root: Path, files: dict[str, int]) -> Path:
    for rel, mib in files.items():
        if mib:
            sparse(root / rel, mib)
        else:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text("print('x')\n")
    return root


def test_sparse_files_cost_no_disk(tmp_path):
    f = sparse(tmp_path / "big.bin", 200)
    assert f.stat().st_size == 200 * MIB and f.stat().st_blocks * 512 < MIB


def test_defaults_leave_out_weights_checkpoints_data_and_run_dirs(tmp_path):
    root = tree(tmp_path / "w", {"main.py": 0, "pkg/mod.py": 0, "pkg/data/loader.py": 0,
                                 "model.safetensors": 200, "shard.bin": 1, "opt.pt": 1, "m/x.pth": 1,
                                 "checkpoints/global_step_5/actor.txt": 1, "exp/global_step_9/x.txt": 1,
                                 "data/train.parquet": 50, "runs/r1/log.txt": 1, "outputs/2026/x.log": 1,
                                 "wandb/run/x": 1, ".git/objects/ab": 1, "pkg/__pycache__/m.pyc": 1})
    files = dict(upload.walk(root, upload.excludes_for([], [])))
    # code stays, also a nested data/ package: /data/ is the working_dir's top-level data dir only
    assert sorted(files) == ["main.py", "pkg/data/loader.py", "pkg/mod.py"]


def test_job_excludes_add_to_the_defaults_and_bang_brings_one_back(tmp_path):
    root = tree(tmp_path / "w", {"main.py": 0, "notes/big.txt": 3, "tokenizer.bin": 1, "model.safetensors": 2})
    ex = upload.excludes_for(["/notes/", "!/tokenizer.bin"], [])
    assert sorted(dict(upload.walk(root, ex))) == ["main.py", "tokenizer.bin"]


def test_gitignore_and_rayignore_count_as_ray_counts_them(tmp_path):
    root = tree(tmp_path / "w", {"main.py": 0, "scratch/a.txt": 2, "cache/b.txt": 2})
    (root / ".gitignore").write_text("scratch/\n")
    (root / ".rayignore").write_text("cache/\n")
    files = dict(upload.walk(root, upload.excludes_for([], [])))
    assert sorted(files) == [".gitignore", ".rayignore", "main.py"]


def test_py_modules_are_shipped_whole(tmp_path):
    """Ray applies `excludes` to py_modules too: the bulk defaults must not cut a package
    (hpc_verl's own data/ package, a vocabulary .bin inside a user's package)."""
    pkg = tree(tmp_path / "mypkg", {"__init__.py": 0, "data/__init__.py": 0, "data/samples/s.txt": 0,
                                    "data/samples/deep/t.txt": 0, "vocab.bin": 1, "__pycache__/x.pyc": 1})
    own = rayjobs.hpc_verl_package_dir()
    ex = upload.excludes_for([], [str(pkg), own])
    for d in (pkg, Path(own)):
        whole = dict(upload.walk(d, upload.BASE_EXCLUDES))
        assert dict(upload.walk(d, ex)) == whole
    assert "data/preprocess.py" in dict(upload.walk(own, ex))
    assert "__pycache__/x.pyc" not in dict(upload.walk(pkg, ex))  # the base excludes still apply
    # a working_dir beside it keeps the defaults, except the same relative paths put back
    work = tree(tmp_path / "w", {"main.py": 0, "data/train.parquet": 5, "data/samples/other.txt": 0,
                                 "data/samples/s.txt": 0})
    assert sorted(dict(upload.walk(work, ex))) == ["data/samples/s.txt", "main.py"]


def test_oversize_upload_is_one_line_naming_the_biggest_paths(tmp_path):
    root = tree(tmp_path / "w", {"main.py": 0, "corpus/a.txt": 150, "corpus/b.txt": 50, "notes.txt": 20})
    env = {"working_dir": str(root), "excludes": upload.excludes_for([], [])}
    with pytest.raises(ConfigError) as err:
        upload.check_uploads(env, limit=100 * MIB)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"ray_job.working_dir {root} would upload 220.0 MiB (4 files), over Ray's 100.0 MiB")
    assert "biggest: corpus/ 200.0 MiB, notes.txt 20.0 MiB, main.py 0.0 MiB" in msg
    assert "ray_job.excludes" in msg and "excludes: ['/corpus/']" in msg
    # under the limit: measured, no complaint
    env["excludes"] = upload.excludes_for(["/corpus/"], [])
    (up,) = upload.check_uploads(env, limit=100 * MIB)
    assert up.key == "ray_job.working_dir" and 20 * MIB < up.bytes < 21 * MIB


def test_the_limit_is_rays_own_constant():
    from ray._private.ray_constants import DASHBOARD_CLIENT_MAX_SIZE

    assert upload.upload_limit_bytes() == DASHBOARD_CLIENT_MAX_SIZE == 100 * MIB


def test_runtime_env_carries_the_excludes_only_with_something_to_upload(tmp_path):
    (tmp_path / "w").mkdir()
    driver = rayjobs.DriverSpec.for_command(["python3", "main.py"])
    env = rayjobs.runtime_env_for(driver, {}, RayJobOptions(working_dir="w", excludes=["/big/"]), tmp_path)
    assert env["excludes"][:len(upload.DEFAULT_EXCLUDES)] == list(upload.DEFAULT_EXCLUDES)
    assert env["excludes"][-1] == "/big/"
    assert "excludes" not in rayjobs.runtime_env_for(driver, {"A": "1"}, RayJobOptions(), tmp_path)


def test_dry_run_refuses_an_oversize_working_dir_and_writes_nothing(tmp_path, monkeypatch):
    from hpc_verl.launch import backends

    monkeypatch.setenv("HPC_VERL_HOME", str(tmp_path / "home"))
    tree(tmp_path / "w", {"main.py": 0, "corpus/shard.txt": 200})
    config = tmp_path / "job.yaml"
    config.write_text("name: big\ntrainer: {module: x, derive_overrides: false}\n"
                      "ray_job: {command: [python3, main.py], working_dir: w}\n")
    request = backends.SubmitRequest(ray_address="127.0.0.1:1", config=str(config))  # nothing listens there
    with pytest.raises(ConfigError, match=r"corpus/ 200\.0 MiB.*ray_job\.excludes"):
        backends.for_request(request).dryrun(request)
    assert not list((tmp_path / "home").glob("jobs/*"))
    os.remove(tmp_path / "w" / "corpus" / "shard.txt")
    dry = backends.for_request(request).dryrun(request)
    assert "upload    working_dir 0.0 MiB (1 file) (Ray's limit: 100.0 MiB each)" in str(dry)
