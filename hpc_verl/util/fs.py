"""Atomic file writes: nothing half-written on any exit path."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Union

PathLike = Union[str, "os.PathLike[str]"]


def ensure_writable_dir(path: PathLike) -> Path:
    """Make ``path`` (and parents) and prove a file can be created in it: a read-only or
    unwritable run directory fails here, in a second, as an OSError naming the directory, and
    not after Ray and the workers are up."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    try:
        fd, probe = tempfile.mkstemp(prefix=".hpcv-write-probe.", dir=str(p))
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(p)) from None
    os.close(fd)
    os.unlink(probe)
    return p


@contextlib.contextmanager
def atomic_target(path: PathLike) -> Iterator[Path]:
    """Yield a temp path beside ``path``; rename it into place only if the block succeeds.

    For writers that want a file name (parquet, torch.save): on any exception the temp
    file is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_bytes(path: PathLike, data: bytes, mode: int | None = None) -> Path:
    """Write ``data`` to a temp file beside ``path`` and rename it into place."""
    with atomic_target(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
    return Path(path)


def atomic_write_text(path: PathLike, text: str, mode: int | None = None) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), mode=mode)


def atomic_write_json(path: PathLike, obj: Any, mode: int | None = None) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", mode=mode)
