"""Checkpoints: atomic (a failed save leaves the previous latest intact), keep-last-N, latest pointer;
the manifest (size + SHA-256 of every file, sharded directories included) catches damage, resume
falls back past a damaged checkpoint, and partial directories of interrupted saves are removed."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from hpc_verl.trainer.driver.checkpoint import (CheckpointError, clean_leftovers, latest_checkpoint,  # noqa: E402
                                         list_checkpoints, load_checkpoint, save_checkpoint, verify_checkpoint)


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("disk full (simulated)")


def test_atomic_save_rotation_and_failed_save(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"actor": {"w": torch.full((2,), float(step))}}, {"step": step},
                        keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    assert latest_checkpoint(tmp_path).name == "global_step_3"
    # a save that fails half-way leaves no global_step_4 and no temp dir, and latest stays 3
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(tmp_path, 4, {"actor": {"w": torch.zeros(1)}, "critic": Unpicklable()}, {"step": 4})
    assert not (tmp_path / "global_step_4").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    state, parts = load_checkpoint(latest_checkpoint(tmp_path))
    assert state == {"step": 3} and parts["actor"]["w"].tolist() == [3.0, 3.0]
    # a directory without trainer_state.json (e.g. copied by hand, incomplete) is not a checkpoint
    (tmp_path / "global_step_9").mkdir()
    assert latest_checkpoint(tmp_path).name == "global_step_3"
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "global_step_9")
    # the tracker names a step that vanished: fall back to the newest complete one
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7\n")
    assert latest_checkpoint(tmp_path).name == "global_step_3"
    # re-saving the same step replaces it atomically
    save_checkpoint(tmp_path, 3, {"actor": {"w": torch.ones(1)}}, {"step": 3, "again": True})
    assert json.loads((tmp_path / "global_step_3" / "trainer_state.json").read_text())["again"] is True


def test_preemption_flag_from_signal_or_launcher_file(tmp_path, monkeypatch):
    """The launcher asks through $HPCV_PREEMPT_FILE (signals stop at srun/exec wrappers) or SIGUSR2."""
    import os
    import signal

    from hpc_verl.trainer.driver.preemption import PreemptionFlag

    marker = tmp_path / "PREEMPT"
    monkeypatch.setenv("HPCV_PREEMPT_FILE", str(marker))
    flag = PreemptionFlag().install()
    try:
        assert not flag.requested
        marker.touch()
        assert flag.requested
        marker.unlink()
        assert not flag.requested
        os.kill(os.getpid(), signal.SIGUSR2)
        assert flag.requested
    finally:
        flag.uninstall()
    monkeypatch.delenv("HPCV_PREEMPT_FILE")
    assert not PreemptionFlag().requested


def _save(root, step, shard_bytes=b"", **kw):
    """A checkpoint with a sharded-style sub-directory (as the worker groups write) and a .pt part."""
    def shards(d):
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(shard_bytes or bytes(range(256)) * 64)
        (d / ".metadata").write_bytes(b"meta")
    return save_checkpoint(root, step, {"driver_rng": {"w": torch.full((4,), float(step))}}, {"step": step},
                           writers={"actor": shards}, **kw)


def test_manifest_covers_every_file_and_catches_truncation_and_changed_bytes(tmp_path):
    d = _save(tmp_path, 2)
    manifest = json.loads((d / "manifest.json").read_text())
    assert set(manifest["files"]) == {"actor/__0_0.distcp", "actor/.metadata", "driver_rng.pt", "trainer_state.json"}
    assert verify_checkpoint(d) is True
    shard = d / "actor" / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:100])                      # truncated
    with pytest.raises(CheckpointError, match=r"global_step_2 is damaged: actor/__0_0.distcp has 100 bytes.*truncated"):
        verify_checkpoint(d)
    flipped = bytearray(data)
    flipped[4096:4096 + 16] = b"\xff" * 16              # same size, bytes changed
    shard.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="actor/__0_0.distcp does not match its SHA-256"):
        load_checkpoint(d)
    (d / "driver_rng.pt").unlink()
    with pytest.raises(CheckpointError, match="driver_rng.pt is missing"):
        verify_checkpoint(d)


def test_resume_falls_back_past_a_damaged_checkpoint_and_names_it(tmp_path):
    for step in (2, 4):
        _save(tmp_path, step)
    newest = tmp_path / "global_step_4" / "driver_rng.pt"
    newest.write_bytes(newest.read_bytes()[:-7])
    warnings = []
    assert latest_checkpoint(tmp_path).name == "global_step_4"          # unverified: what the tracker says
    assert latest_checkpoint(tmp_path, verify=True, warn=warnings.append).name == "global_step_2"
    assert len(warnings) == 1 and "global_step_4 is damaged" in warnings[0] and "driver_rng.pt" in warnings[0]
    older = tmp_path / "global_step_2" / "actor" / ".metadata"
    older.write_bytes(b"META")
    with pytest.raises(CheckpointError, match="every checkpoint under .* is damaged.*resume_mode=disable"):
        latest_checkpoint(tmp_path, verify=True)


def test_leftovers_of_killed_saves_are_removed_and_a_moved_aside_step_is_put_back(tmp_path):
    import os
    _save(tmp_path, 1)
    d3 = _save(tmp_path, 3)
    for name in (".tmp_global_step_2.999999", ".tmp_global_step_3.999998"):   # a killed save's partial dirs
        (tmp_path / name / "actor").mkdir(parents=True)
        (tmp_path / name / "actor" / "__0_0.distcp").write_bytes(b"x" * 1000)
    os.replace(d3, tmp_path / ".old_global_step_3.999997")   # killed between the two renames of a re-save
    warnings = []
    removed = clean_leftovers(tmp_path, warn=warnings.append)
    assert sorted(removed) == [".tmp_global_step_2.999999", ".tmp_global_step_3.999998"]
    assert (tmp_path / "global_step_3").is_dir() and verify_checkpoint(tmp_path / "global_step_3")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp", ".old"))]
    assert any("put back global_step_3" in w for w in warnings) and any("removed 2 partial" in w for w in warnings)
    # a save removes them too (and its own temp dir is gone afterwards)
    (tmp_path / ".tmp_global_step_5.999996").mkdir()
    _save(tmp_path, 5)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp", ".old"))]


def test_a_torch_write_failure_names_the_disk(tmp_path):
    import errno

    """torch's zip writer says "unexpected pos" when a disk fills up; the save turns it into an
    OSError with the path (the real full disk is in tests/test_faults.py)."""
    def failing(d):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
    with pytest.raises(OSError) as info:
        save_checkpoint(tmp_path, 1, {}, {"step": 1}, writers={"actor": failing})
    assert info.value.filename == str(tmp_path) and "while writing checkpoint global_step_1" in str(info.value)
    assert info.value.errno in (errno.ENOSPC, errno.EIO)   # ENOSPC where the disk is (nearly) full
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_a_rank_s_os_error_becomes_an_os_error_naming_the_checkpoint_dir(tmp_path):
    """A worker group's sharded save fails on a rank; its OSError arrives as a one-line DataflowError."""
    import errno

    from hpc_verl.errors import DataflowError, os_error_line

    def rank_failed(d):
        raise DataflowError("graph 'ppo': a node failed in actor_update_0: CheckpointException: OSError: "
                            "[Errno 28] No space left on device")
    with pytest.raises(OSError) as info:
        save_checkpoint(tmp_path, 3, {}, {"step": 3}, writers={"actor": rank_failed})
    assert info.value.errno == errno.ENOSPC
    line = os_error_line(info.value)
    assert line.startswith(f"{tmp_path}: No space left on device while writing checkpoint global_step_3 (ENOSPC)")
    assert "free there; free space there or write somewhere else" in line


def test_plain_parts_are_json_tensors_stay_torch_and_both_load_back(tmp_path):
    """The driver's parts (plain values) go to JSON, so a save or a resume imports no torch in the
    driver; anything else is still torch.save'd, and a checkpoint of both kinds loads whole."""
    plain = {"kl_ctrl": {"value": 0.1 + 0.2, "n": 3, "ok": True, "tags": ["a", None]}}
    d = save_checkpoint(tmp_path, 5, {"adv": plain, "tensors": {"w": torch.arange(3.0)}}, {"step": 5})
    assert json.loads((d / "adv.json").read_text()) == plain and (d / "tensors.pt").is_file()
    assert {"adv.json", "tensors.pt", "trainer_state.json"} <= set(json.loads((d / "manifest.json").read_text())["files"])
    state, parts = load_checkpoint(d)
    assert state == {"step": 5} and parts["adv"] == plain and torch.equal(parts["tensors"]["w"], torch.arange(3.0))
    assert set(parts) == {"adv", "tensors"}   # not the manifest, not the trainer state
    for not_json in ({"x": float("nan")}, {1: "int key"}, (1, 2)):
        d = save_checkpoint(tmp_path / "other", 1, {"p": not_json}, {"step": 1})
        assert (d / "p.pt").is_file() and not (d / "p.json").exists()
    code = ("import sys\nfrom hpc_verl.trainer.driver.checkpoint import save_checkpoint, load_checkpoint\n"
            "d = save_checkpoint(sys.argv[1], 1, {'adv': {'kl_ctrl': {'value': 0.5}}}, {'step': 1})\n"
            "assert load_checkpoint(d)[1] == {'adv': {'kl_ctrl': {'value': 0.5}}}\nprint('torch' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "driver")], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr
