"""Reading a user's YAML file (profile, job config, trainer config) with one-line errors.

Every bad file becomes the same kind of message, "<what> <file>:<line>: <problem>; <fix>",
raised as the caller's error class, so the CLI prints one line and exits 2.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml


def read_yaml(path: Path, what: str, error_cls: type[Exception], *, display: Optional[str] = None,
              compose: bool = False) -> tuple[Any, Optional[yaml.Node]]:
    """The file's data (None for an empty file) and, with ``compose``, its node tree (for line numbers).

    ``what`` names the file's role in messages ("profile file", "job config"); ``display``
    is how to print its path (default: as given).
    """
    disp = display or str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise error_cls(f"{what} {disp} cannot be read ({reason}); check the path and its permissions") \
            from None
    try:
        if compose:  # parse once: the node tree, and the data built from it
            loader = yaml.SafeLoader(text)
            try:
                node = loader.get_single_node()
                data = loader.construct_document(node) if node is not None else None
            finally:
                loader.dispose()
        else:
            node, data = None, yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{disp}:{mark.line + 1}" if mark else disp
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise error_cls(f"{what} {where}: not valid YAML ({problem}); check indentation and quoting") from None
    return data, node
