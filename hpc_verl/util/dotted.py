"""Dotted-key access into nested config mappings (verl's ``a.b.c`` key names)."""
from __future__ import annotations

from typing import Any, Mapping


def get_path(cfg: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    """``cfg["a"]["b"]`` for ``"a.b"``; also accepts flat ``{"a.b": v}`` mappings."""
    if dotted in cfg:
        return cfg[dotted]
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node
