"""Atomic, verified, rotating checkpoints in verl's layout: ``<dir>/global_step_<N>/``.

A checkpoint holds the actor and critic as sharded ``torch.distributed.checkpoint``
directories (weights and optimiser, written by every rank of their group, loadable
at any world size) with their scheduler and versions, small parts as ``<name>.pt``
(KL controller, driver RNG) and the trainer state (step, data position) in
``trainer_state.json``. Last comes ``manifest.json``: the size and SHA-256 of every
other file of the checkpoint, the sharded directories included. All of it is written
to a hidden temp directory that is renamed into place, then
``latest_checkpointed_iteration.txt`` is replaced atomically.

A crash mid-save leaves the previous checkpoint as the latest; the partial temp
directory is removed by the next save or resume (:func:`clean_leftovers`). A
checkpoint damaged later (truncated, bytes changed) fails its manifest: resuming
(:func:`latest_checkpoint` with ``verify=True``) warns with its name and falls back
to the previous intact one; loading it by name (:func:`load_checkpoint`) is one line.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from hpc_verl.errors import CheckpointError, free_bytes
from hpc_verl.util.fs import atomic_write_text

log = logging.getLogger("hpc_verl.trainer")

LATEST_FILE = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_LEFTOVER = re.compile(r"^\.(tmp|old)_global_step_(\d+)\.(\d+)$")
_CHUNK = 1 << 20
#: torch's zip writer reports a failed write (a full disk) as RuntimeError with one of these
_TORCH_WRITE_FAILED = ("file write failed", "unexpected pos", "PytorchStreamWriter failed")

#: the trainer state's "format": 2 = sharded actor/critic directories (1: whole-model actor.pt, before worker groups)
CHECKPOINT_FORMAT = 2


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def _complete(d: Path) -> bool:
    """Written to the end: the manifest is the last file (checkpoints from before it: trainer_state.json)."""
    return (d / MANIFEST).is_file() or (d / "trainer_state.json").is_file()


def list_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root``, oldest first (temp dirs are ignored; nothing is verified)."""
    r = Path(root)
    if not r.is_dir():
        return []
    out = []
    for child in r.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir() and _complete(child):
            out.append((int(m.group(1)), child))
    return sorted(out)


# ---------------------------------------------------------------------------- the manifest
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)   # hashlib releases the GIL: the pool below hashes files in parallel
    return h.hexdigest()


def _files(d: Path) -> list[Path]:
    return sorted(f for f in d.rglob("*") if f.is_file() and f.name != MANIFEST)


def _hash_all(d: Path, files: list[Path]) -> dict[str, str]:
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(files)))) as pool:
        return dict(zip((f.relative_to(d).as_posix() for f in files), pool.map(_sha256, files)))


def write_manifest(d: str | os.PathLike[str], step: int) -> dict[str, Any]:
    """Size and SHA-256 of every file under ``d`` (recursively) into ``d/manifest.json``."""
    d = Path(d)
    files = _files(d)
    digests = _hash_all(d, files)
    entries = {rel: {"size": f.stat().st_size, "sha256": digests[rel]}
               for rel, f in zip((f.relative_to(d).as_posix() for f in files), files)}
    manifest = {"format": MANIFEST_FORMAT, "step": step, "algorithm": "sha256", "files": entries}
    (d / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def verify_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Check every file of a checkpoint against its manifest; raises CheckpointError naming the first
    damaged file. Returns False for a checkpoint written before manifests (nothing to check)."""
    p = Path(path)
    mf = p / MANIFEST
    if not mf.is_file():
        if (p / "trainer_state.json").is_file():
            return False
        raise CheckpointError(f"checkpoint {p}: no {MANIFEST} and no trainer_state.json; not a complete "
                              "checkpoint (pick another global_step_N directory or set trainer.resume_mode=disable)")
    try:
        manifest = json.loads(mf.read_text())
        entries = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {p} is damaged: {MANIFEST} is unreadable ({type(exc).__name__})") \
            from None
    missing = [rel for rel in entries if not (p / rel).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {p} is damaged: {missing[0]} is missing"
                              + (f" (and {len(missing) - 1} more files)" if len(missing) > 1 else ""))
    for rel, e in sorted(entries.items()):
        size = (p / rel).stat().st_size
        if size != e["size"]:
            raise CheckpointError(f"checkpoint {p} is damaged: {rel} has {size} bytes, the manifest says "
                                  f"{e['size']} ({'truncated' if size < e['size'] else 'grown'})")
    digests = _hash_all(p, [p / rel for rel in sorted(entries)])
    for rel in sorted(entries):
        if digests[rel] != entries[rel]["sha256"]:
            raise CheckpointError(f"checkpoint {p} is damaged: {rel} does not match its SHA-256 in {MANIFEST} "
                                  "(bytes changed on disk)")
    return True


# ---------------------------------------------------------------------------- finding one to resume
def latest_checkpoint(root: str | os.PathLike[str], verify: bool = False,
                      warn: Callable[[str], Any] | None = None) -> Path | None:
    """The checkpoint named by the tracker file, or else the newest complete one.

    ``verify``: the newest one whose files match its manifest; each damaged one on the way is
    reported through ``warn`` (with its name) and skipped. Raises CheckpointError when there
    are checkpoints but none is intact (starting over silently would lose the run)."""
    r = Path(root)
    found = list_checkpoints(r)
    order = [d for _, d in reversed(found)]
    tracker = r / LATEST_FILE
    if tracker.is_file():
        try:
            d = step_dir(r, int(tracker.read_text().strip()))
            if d in order:
                order.remove(d)
                order.insert(0, d)
        except ValueError:
            pass
    if not verify:
        return order[0] if order else None
    damaged = []
    for d in order:
        try:
            verify_checkpoint(d)
        except CheckpointError as exc:
            damaged.append(d.name)
            if warn is not None:
                warn(f"{exc}; falling back to the previous checkpoint")
            continue
        return d
    if damaged:
        raise CheckpointError(f"every checkpoint under {r} is damaged ({', '.join(damaged)}); "
                              "set trainer.resume_mode=disable to start over")
    return None


def clean_leftovers(root: str | os.PathLike[str], warn: Callable[[str], Any] | None = None) -> list[str]:
    """Remove what interrupted saves left (``.tmp_global_step_N.PID``, ``.old_global_step_N.PID``)
    under ``root``, except this process's own; returns their names.

    An ``.old_`` directory is a complete checkpoint moved aside while its step was re-saved: if the
    save died before the new one took its place, it is put back instead."""
    r = Path(root)
    if not r.is_dir():
        return []
    removed = []
    for child in sorted(r.iterdir()):
        m = _LEFTOVER.match(child.name)
        if not m or int(m.group(3)) == os.getpid():
            continue
        final = step_dir(r, int(m.group(2)))
        if m.group(1) == "old" and not final.exists() and _complete(child):
            os.replace(child, final)
            if warn is not None:
                warn(f"put back {final.name} from {child.name} (a re-save of that step was interrupted)")
            continue
        shutil.rmtree(child, ignore_errors=True)
        removed.append(child.name)
    if removed and warn is not None:
        warn(f"removed {len(removed)} partial checkpoint(s) left by interrupted saves under {r}: "
             f"{', '.join(removed)}")
    return removed


# ---------------------------------------------------------------------------- save and load
_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]")


def _write_failure(exc: Exception, root: Path, step: int) -> Exception:
    """A failed write as the error a person can act on: an OSError naming the checkpoint directory.

    The sharded parts are written by the worker groups' ranks, whose OSError reaches us as a
    one-line DataflowError; torch's zip writer says "unexpected pos" where the disk is full."""
    if isinstance(exc, OSError):
        code = exc.errno
    else:
        text = str(exc)
        m = _ERRNO_IN_TEXT.search(text)
        code = int(m.group(1)) if m else None
        if code is None and any(s in text for s in _TORCH_WRITE_FAILED):
            free = free_bytes(root)
            code = errno.ENOSPC if free is not None and free < 64 * 2**20 else errno.EIO
        if code is None:
            return exc
    return OSError(code, f"{os.strerror(code)} while writing checkpoint global_step_{step}", str(root))


def _fsync_tree(d: Path) -> None:
    for f in d.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    for sub in [d, *(x for x in d.rglob("*") if x.is_dir())]:
        try:
            fd = os.open(sub, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)


def save_checkpoint(root: str | os.PathLike[str], step: int, parts: dict[str, Any], trainer_state: dict,
                    keep_last: int | None = None,
                    writers: dict[str, Callable[[Path], None]] | None = None) -> Path:
    """Write ``parts`` (name → JSON-able, as ``<name>.json``, or else torch-saveable, as
    ``<name>.pt``), the directories ``writers`` fill (name → ``write(dir)``, e.g. a worker
    group's sharded save), ``trainer_state`` (JSON) and, last, the manifest of all of them as
    step ``step``. (The driver's parts are small plain values: writing them as JSON keeps torch
    out of the driver, seconds of import at every save.)"""
    r = Path(root)
    r.mkdir(parents=True, exist_ok=True)
    clean_leftovers(r, warn=log.warning)
    final = step_dir(r, step)
    tmp = r / f".tmp_global_step_{step}.{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        try:
            for name, write in (writers or {}).items():
                write(tmp / name)
            for name, obj in parts.items():
                assert name not in ("trainer_state", MANIFEST.split(".")[0]), name
                if _plain(obj):
                    (tmp / f"{name}.json").write_text(json.dumps(obj, sort_keys=True))
                else:
                    import torch

                    torch.save(obj, tmp / f"{name}.pt")
            (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2, sort_keys=True))
            write_manifest(tmp, step)
            _fsync_tree(tmp)
        except Exception as exc:
            raise _write_failure(exc, r, step) from None
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


def _plain(obj: Any) -> bool:
    """JSON holds it exactly: dicts with str keys, lists, str, int, finite float, bool, None."""
    if obj is None or isinstance(obj, (str, bool, int)):
        return True
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, list):
        return all(_plain(v) for v in obj)
    if isinstance(obj, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in obj.items())
    return False


def load_checkpoint(path: str | os.PathLike[str], verify: bool = True) -> tuple[dict, dict[str, Any]]:
    """(trainer_state, parts) of a checkpoint directory, its files checked against the manifest
    first (``verify=False``: the caller just did). Parts are its ``*.json`` and ``*.pt`` files."""
    p = Path(path)
    state_file = p / "trainer_state.json"
    if verify:
        verify_checkpoint(p)
    if not state_file.is_file():
        raise CheckpointError(f"checkpoint {p}: trainer_state.json missing; not a complete checkpoint "
                              "(pick another global_step_N directory or set trainer.resume_mode=disable)")
    try:
        state = json.loads(state_file.read_text())
        parts: dict[str, Any] = {f.stem: json.loads(f.read_text()) for f in sorted(p.glob("*.json"))
                                 if f.name not in ("trainer_state.json", MANIFEST)}
        pt_files = sorted(p.glob("*.pt"))
        if pt_files:
            import torch

            parts.update({f.stem: torch.load(f, map_location="cpu", weights_only=False) for f in pt_files})
    except Exception as exc:
        raise CheckpointError(f"checkpoint {p}: unreadable ({type(exc).__name__}: {exc})") from None
    return state, parts


