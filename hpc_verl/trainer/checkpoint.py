"""Atomic, rotating checkpoints in verl's layout: ``<dir>/global_step_<N>/``.

A checkpoint holds the actor and critic as sharded ``torch.distributed.checkpoint``
directories (weights and optimiser, written by every rank of their group, loadable
at any world size) with their scheduler and versions, small parts as ``<name>.pt``
(KL controller, driver RNG) and the trainer state (step, data position) in
``trainer_state.json``. It is written to a hidden temp directory that is renamed
into place, then ``latest_checkpointed_iteration.txt`` is replaced atomically. A
crash mid-save leaves the previous checkpoint as the latest.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any, Callable

from hpc_verl.errors import HpcVerlError
from hpc_verl.util.fs import atomic_write_text

LATEST_FILE = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")

#: Exit code meaning "checkpointed on the preemption signal, requeue me" (the launcher maps it).
REQUEUE_EXIT_CODE = int(os.environ.get("HPC_VERL_REQUEUE_EXIT_CODE", "99"))
PREEMPT_SIGNAL = signal.SIGUSR2


class CheckpointError(HpcVerlError):
    """A checkpoint is missing or unreadable."""


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def list_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root``, oldest first (temp dirs are ignored)."""
    r = Path(root)
    if not r.is_dir():
        return []
    out = []
    for child in r.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir() and (child / "trainer_state.json").is_file():
            out.append((int(m.group(1)), child))
    return sorted(out)


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The checkpoint named by the tracker file, or else the newest complete one."""
    r = Path(root)
    tracker = r / LATEST_FILE
    if tracker.is_file():
        try:
            step = int(tracker.read_text().strip())
            d = step_dir(r, step)
            if (d / "trainer_state.json").is_file():
                return d
        except ValueError:
            pass
    found = list_checkpoints(r)
    return found[-1][1] if found else None


def save_checkpoint(root: str | os.PathLike[str], step: int, parts: dict[str, Any], trainer_state: dict,
                    keep_last: int | None = None,
                    writers: dict[str, Callable[[Path], None]] | None = None) -> Path:
    """Write ``parts`` (name → torch-saveable), the directories ``writers`` fill (name →
    ``write(dir)``, e.g. a worker group's sharded save) and ``trainer_state`` (JSON) as
    step ``step``."""
    import torch

    r = Path(root)
    r.mkdir(parents=True, exist_ok=True)
    final = step_dir(r, step)
    tmp = r / f".tmp_global_step_{step}.{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        for name, write in (writers or {}).items():
            write(tmp / name)
        for name, obj in parts.items():
            torch.save(obj, tmp / f"{name}.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2, sort_keys=True))
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        if final.exists():  # re-saving the same step (e.g. signal right after a periodic save)
            old = r / f".old_global_step_{step}.{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(r / LATEST_FILE, f"{step}\n")
    if keep_last is not None and keep_last > 0:
        for _, old_dir in list_checkpoints(r)[:-keep_last]:
            shutil.rmtree(old_dir, ignore_errors=True)
    return final


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[dict, dict[str, Any]]:
    """(trainer_state, parts) of a checkpoint directory."""
    import torch

    p = Path(path)
    state_file = p / "trainer_state.json"
    if not state_file.is_file():
        raise CheckpointError(f"checkpoint {p}: trainer_state.json missing; not a complete checkpoint "
                              "(pick another global_step_N directory or set trainer.resume_mode=disable)")
    try:
        state = json.loads(state_file.read_text())
        parts = {f.stem: torch.load(f, map_location="cpu", weights_only=False) for f in sorted(p.glob("*.pt"))}
    except Exception as exc:
        raise CheckpointError(f"checkpoint {p}: unreadable ({type(exc).__name__}: {exc})") from None
    return state, parts


def read_sharded(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A sharded part (e.g. ``global_step_N/actor``) as one full state dict in this process:
    ``{"model": {name: tensor}, "optim": {...}}``, whatever world size wrote it (tools, tests,
    export)."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    p = Path(path)
    if not (p / ".metadata").is_file():
        raise CheckpointError(f"{p} is not a sharded checkpoint part (no .metadata); expected global_step_N/actor")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "full.pt"
        dcp_to_torch_save(str(p), str(out))
        return torch.load(out, map_location="cpu", weights_only=False)


class PreemptionFlag:
    """Set by SIGUSR2 or by the launcher's preempt file; polled at step boundaries only.

    Inside a job the launcher cannot signal the trainer directly (srun and container
    ``exec`` wrappers sit in between), so it also creates ``$HPCV_PREEMPT_FILE`` on the
    shared filesystem; either one asks for a checkpoint and the "requeue me" exit.
    """

    def __init__(self, preempt_file: str | os.PathLike[str] | None = None) -> None:
        self._signalled = False
        self._previous: Any = None
        path = preempt_file if preempt_file is not None else os.environ.get("HPCV_PREEMPT_FILE")
        self.preempt_file = Path(path) if path else None

    @property
    def requested(self) -> bool:
        if self._signalled:
            return True
        return self.preempt_file is not None and self.preempt_file.exists()

    def install(self) -> "PreemptionFlag":
        try:
            self._previous = signal.signal(PREEMPT_SIGNAL, self._handle)
        except ValueError:  # not the main thread: the launcher's signal cannot reach us anyway
            self._previous = None
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self._signalled = True

    def uninstall(self) -> None:
        if self._previous is not None:
            try:
                signal.signal(PREEMPT_SIGNAL, self._previous)
            except ValueError:
                pass
