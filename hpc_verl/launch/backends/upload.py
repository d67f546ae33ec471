"""The Ray Jobs upload guard: what a submission would upload, measured before anything is sent.

Ray packs the job's ``working_dir`` and every local ``py_modules`` directory into a zip
(stored, not compressed) and sends each one in a single HTTP request to the dashboard,
which refuses a request body over 100 MiB (Ray's ``DASHBOARD_CLIENT_MAX_SIZE``). The
classic failure: a model, a checkpoint or a dataset in the working_dir, found only after
Ray zipped and sent it. So before a submission:

- the upload leaves out what never belongs in one (``BULK_EXCLUDES``: weights,
  checkpoints, data and run directories) on top of ``BASE_EXCLUDES`` and the job's own
  ``ray_job.excludes`` (gitignore patterns, relative to each uploaded directory; a
  ``!PATTERN`` there uploads a default-excluded path after all);
- every local directory Ray would upload is walked with Ray's own traversal (the same
  patterns, ``.gitignore`` and ``.rayignore``), so the measured files are the ones Ray
  would send, and one over the limit is refused with one line that names the biggest
  paths and the ``ray_job.excludes`` key.

Ray applies the runtime_env's ``excludes`` to py_modules too. The bulk defaults are meant
for the working_dir, so files of a py_module that only they would drop (hpc_verl's own
``data/`` package, say) are put back by exact ``!/path`` patterns; a working_dir file at
the very same relative path is then uploaded as well (and measured with the rest).
"""
from __future__ import annotations

import inspect
import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from hpc_verl.errors import ConfigError

MIB = 1024 * 1024
RAY_UPLOAD_LIMIT_BYTES = 100 * MIB
"""Ray's dashboard limit on one upload (``ray._private.ray_constants.DASHBOARD_CLIENT_MAX_SIZE``
where that Ray has it)."""

BASE_EXCLUDES = (".git", "__pycache__", "*.pyc")
BULK_EXCLUDES = (
    "*.safetensors", "*.bin", "*.pt", "*.pth",   # model weights, optimizer states
    "checkpoints/", "global_step_*/",            # checkpoint directories (hpc-verl's, verl's)
    "/data/", "/runs/", "/outputs/", "/wandb/", "/mlruns/",  # data; run dirs (hpc-verl, hydra, trackers)
)
DEFAULT_EXCLUDES = BASE_EXCLUDES + BULK_EXCLUDES
_ZIP_ENTRY_BYTES = 30 + 46 + 22  # a zip's local header, central directory entry (+ its end record), per file
_SPECIAL = "\\*?[]!#"


def upload_limit_bytes() -> int:
    """The most one upload may hold: Ray's own constant, else its value in Ray 2.x (100 MiB)."""
    try:
        from ray._private.ray_constants import DASHBOARD_CLIENT_MAX_SIZE
    except (ImportError, AttributeError):
        return RAY_UPLOAD_LIMIT_BYTES
    return int(DASHBOARD_CLIENT_MAX_SIZE)


def mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


@dataclass
class Upload:
    """One directory (or file) Ray would zip and send, with the files it would hold."""

    key: str                  # the job config key it comes from: ray_job.working_dir, ray_job.py_modules
    root: str
    files: list[tuple[str, int]] = field(default_factory=list)  # (path relative to root, bytes)

    @property
    def bytes(self) -> int:
        """About the zip's size: Ray stores files uncompressed, plus headers per entry."""
        return sum(size + _ZIP_ENTRY_BYTES + 2 * len(rel.encode()) for rel, size in self.files)

    def biggest(self, n: int = 3) -> list[tuple[str, int]]:
        """The largest top-level entries (``name/`` for a directory), largest first."""
        sizes: dict[str, int] = defaultdict(int)
        for rel, size in self.files:
            head, sep, _ = rel.partition("/")
            sizes[head + ("/" if sep else "")] += size
        return sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))[:n]

    def too_big(self, limit: int) -> str:
        """The one line for an upload over ``limit``."""
        top = self.biggest()
        first = top[0][0] if top else "PATH"
        return (f"{self.key} {self.root} would upload {mib(self.bytes)} ({len(self.files)} files), over Ray's "
                f"{mib(limit)} upload limit; biggest: {', '.join(f'{p} {mib(s)}' for p, s in top)}; leave them out "
                f"with ray_job.excludes in the job config (e.g. excludes: ['/{first}']), or put them on a shared "
                "filesystem or behind a URI")

    def line(self) -> str:
        n = len(self.files)
        return f"{self.key.rpartition('.')[2]} {mib(self.bytes)} ({n} file{'' if n == 1 else 's'})"


def _include_gitignore() -> bool:
    """Whether Ray's client honours .gitignore files (as Ray's SDK decides it)."""
    return os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"


def walk(root: str | os.PathLike[str], patterns: Sequence[str]) -> list[tuple[str, int]]:
    """The files Ray would put into the zip of ``root`` with exclude ``patterns``, by Ray's own
    traversal (patterns, then each directory's .gitignore and .rayignore)."""
    from ray._private.runtime_env import packaging

    base = Path(root).absolute()
    if base.is_file():
        return [(base.name, base.stat().st_size)]
    files: list[tuple[str, int]] = []

    def handler(path: Path) -> None:
        if path.is_file():
            files.append((path.relative_to(base).as_posix(), path.stat().st_size))

    accepted = inspect.signature(packaging._dir_travel).parameters
    kwargs: dict[str, Any] = {}
    if "include_gitignore" in accepted:
        kwargs["include_gitignore"] = _include_gitignore()
    if "logger" in accepted:  # Ray logs the ignore files it reads; ours stays quiet
        kwargs["logger"] = logging.getLogger("hpc_verl.upload")
    packaging._dir_travel(base, [packaging._get_excludes(base, list(patterns))], handler, **kwargs)
    return sorted(files)


def _literal(rel: str) -> str:
    """A gitignore pattern for exactly this path below the root."""
    return "/" + "".join("\\" + c if c in _SPECIAL else c for c in rel)


def _matches(base: Path, patterns: Sequence[str], rel: str) -> bool:
    from ray._private.runtime_env import packaging

    return bool(packaging._get_excludes(base, list(patterns))(base / rel))


def excludes_for(user_excludes: Sequence[str], py_module_dirs: Iterable[str]) -> list[str]:
    """The runtime_env's excludes: the defaults, put-backs for py_module files that only the bulk
    defaults would drop, then the job's own patterns (last, so they win).

    Ray skips an excluded directory whole, so a put-back file's excluded parent comes back as
    ``!/dir`` followed by ``/dir/*`` (the directory, but none of its entries), then the file."""
    patterns = list(DEFAULT_EXCLUDES)
    for d in py_module_dirs:
        base = Path(d).absolute()
        if not base.is_dir():
            continue
        kept = {rel for rel, _ in walk(base, DEFAULT_EXCLUDES)}
        for rel in (rel for rel, _ in walk(base, BASE_EXCLUDES) if rel not in kept):
            parts = rel.split("/")
            for anc in ("/".join(parts[:i]) for i in range(1, len(parts))):
                if _matches(base, patterns, anc):
                    patterns += ["!" + _literal(anc), _literal(anc) + "/*"]
            if _matches(base, patterns, rel):
                patterns.append("!" + _literal(rel))
    return [*patterns, *user_excludes]


def _local(value: Any) -> Optional[str]:
    text = str(value)
    return None if "://" in text else text


def uploads_of(runtime_env: Mapping[str, Any]) -> list[Upload]:
    """Every local directory or file the runtime_env makes Ray upload, measured."""
    patterns = list(runtime_env.get("excludes") or [])
    out = []
    working_dir = _local(runtime_env.get("working_dir") or "")
    if working_dir:
        out.append(Upload("ray_job.working_dir", working_dir, walk(working_dir, patterns)))
    for module in runtime_env.get("py_modules") or []:
        path = _local(module)
        if path:  # Ray applies no excludes to a single file or a wheel
            out.append(Upload("ray_job.py_modules", path, walk(path, patterns if Path(path).is_dir() else [])))
    return out


def check_uploads(runtime_env: Mapping[str, Any], limit: Optional[int] = None) -> list[Upload]:
    """The uploads of ``runtime_env``; one line (ConfigError) for the first over Ray's limit."""
    limit = upload_limit_bytes() if limit is None else limit
    uploads = uploads_of(runtime_env)
    for up in uploads:
        if up.bytes > limit:
            raise ConfigError(up.too_big(limit))
    return uploads
