"""Checkpoints: atomic (a failed save leaves the previous latest intact), keep-last-N, latest pointer."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from hpc_verl.trainer.checkpoint import (CheckpointError, latest_checkpoint, list_checkpoints,  # noqa: E402
                                         load_checkpoint, save_checkpoint)


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
    with pytest.raises(CheckpointError, match="trainer_state.json missing"):
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

    from hpc_verl.trainer.checkpoint import PreemptionFlag

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
