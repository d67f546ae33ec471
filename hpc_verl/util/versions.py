"""Version numbers the tool checks against, in one place."""
from __future__ import annotations

import re

RAY_MIN_VERSION = "2.40"  # the oldest Ray this verl (and our bootstrap) supports


def version_tuple(version: str) -> tuple[int, ...]:
    """``"2.60.0rc1"`` -> (2, 60): the leading numeric release parts, for comparisons."""
    parts = []
    for piece in re.split(r"[.+-]", version):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts) or (0,)
