"""What to tell a user whose override names a key verl's config does not have.

A port from an older verl is the common case, so the advice comes from verl's own
history first: ``key_history.json`` lists the keys of verl's past releases that the
installed verl no longer has (``scripts/verl_key_history.py`` reads them from the release
tags). A removed key's successor is named only when the current config has one key that
ends with the same trailing path (the section moved: ``ray_init.num_cpus`` is now
``ray_kwargs.ray_init.num_cpus``), or when verl gathered the setting into a sub-section
(validation sampling went into ``val_kwargs``: ``val_temperature``/``n_val`` are
``val_kwargs.temperature``/``val_kwargs.n``). Otherwise the key is reported removed. A
did-you-mean is offered only when it is likely right: same section, a close name and a
value of the candidate's type; else the section's valid keys are listed.
"""
from __future__ import annotations

import difflib
import functools
import json
import re
from pathlib import Path
from typing import Any, Iterable

from hpc_verl.verl_upstream.config import VerlSchema

HISTORY_FILE = Path(__file__).with_name("key_history.json")
MAX_LISTED = 24


@functools.lru_cache(maxsize=1)
def history() -> dict[str, str]:
    """Removed key -> the last verl release whose config had it."""
    try:
        data = json.loads(HISTORY_FILE.read_text())
    except (OSError, ValueError):
        return {}
    return dict(data.get("last_release_with_key", {}))


def _val_kwargs_successor(key: str, keys: frozenset[str]) -> str | None:
    """``S.val_X``, ``S.X_val`` -> ``S.val_kwargs.X`` where verl has it."""
    parent, _, leaf = key.rpartition(".")
    for pattern in (r"^val_(.+)$", r"^(.+)_val$"):
        m = re.match(pattern, leaf)
        if m:
            cand = f"{parent}.val_kwargs.{m.group(1)}" if parent else f"val_kwargs.{m.group(1)}"
            if cand in keys:
                return cand
    return None


def _moved(key: str, keys: frozenset[str]) -> str | None:
    """The one current key ending with the removed key's trailing path (≥ 2 parts, or a distinctive
    leaf name that moved into a sub-section of its own section)."""
    parts = key.split(".")
    for m in range(len(parts), 0, -1):
        tail = "." + ".".join(parts[-m:])
        hits = [k for k in keys if k.endswith(tail) and k != key]
        if m == 1:  # the leaf alone: a distinctive name that moved deeper into its own section
            parent = ".".join(parts[:-1])
            if len(parts[-1]) < 10 or "_" not in parts[-1] or not parent:
                return None
            hits = [k for k in hits if k.startswith(parent + ".")]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            return None
    return None


def successor(key: str, schema: VerlSchema) -> str | None:
    """What verl calls this setting now, when its history says so."""
    return _val_kwargs_successor(key, schema.keys) or (
        _moved(key, schema.keys) if key in history() else None)


def _type_fits(value: str | None, default: Any) -> bool:
    if value is None or default is None or value in ("null", "") or value.startswith("${"):
        return True
    if isinstance(default, bool):
        return value.lower() in ("true", "false")
    if isinstance(default, (int, float)):
        try:
            float(value)
        except ValueError:
            return False
        return True
    if isinstance(default, str):
        return value.lower() not in ("true", "false")
    return True


def did_you_mean(key: str, value: str | None, schema: VerlSchema) -> str | None:
    """A sibling key with a close name whose type fits the value (else None)."""
    parent, _, leaf = key.rpartition(".")
    siblings = [k for k in schema.children(parent) if k != key]
    best, best_r = None, 0.0
    for cand in siblings:
        c_leaf = cand.rpartition(".")[2]
        ratio = difflib.SequenceMatcher(None, leaf, c_leaf).ratio()
        if ratio > best_r:
            best, best_r = cand, ratio
    if best is None or best_r < 0.8:
        return None
    if best not in schema.defaults and any(k.startswith(best + ".") for k in schema.keys):
        return None  # a section, not a setting
    return best if _type_fits(value, schema.defaults.get(best)) else None


def _deepest_section(key: str, schema: VerlSchema) -> str:
    parent = key.rpartition(".")[0]
    while parent and parent not in schema.keys:
        parent = parent.rpartition(".")[0]
    return parent


def section_keys(section: str, schema: VerlSchema) -> str:
    names = [k.rsplit(".", 1)[-1] for k in schema.children(section) if not k.endswith("._target_")]
    shown = ", ".join(names[:MAX_LISTED]) + (f", ... ({len(names)} in all)" if len(names) > MAX_LISTED else "")
    return f"keys under '{section or '(top level)'}': {shown}"


def unknown_key(key: str, value: str | None, schema: VerlSchema) -> str:
    """The advice for a key verl's config lacks (no leading separator)."""
    tag = f"verl {schema.version}"
    last = history().get(key)
    nxt = successor(key, schema)
    if nxt is not None:
        when = f" (its key until verl {last})" if last else ""
        return f"{tag} calls this setting '{nxt}'{when}; use {nxt}={value if value is not None else '...'}"
    if last is not None:
        return f"{tag} removed it (last in verl {last}); drop the override"
    guess = did_you_mean(key, value, schema)
    if guess is not None:
        return f"did you mean '{guess}'?"
    return section_keys(_deepest_section(key, schema), schema)


def closest_groups(name: str, groups: Iterable[str]) -> list[str]:
    return difflib.get_close_matches(name, sorted(groups), n=3, cutoff=0.6)
