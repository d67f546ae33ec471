"""Hydra overrides for upstream verl: parsing and key validation.

Each problem is one line naming the override, what is wrong and how to fix it,
so a misspelt key is refused on the login node instead of an hour into a job.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from hpc_verl.errors import ConfigError
from hpc_verl.verl_upstream.config import VerlSchema

_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:[.@/][A-Za-z0-9_]+)*$")


@dataclass(frozen=True)
class Override:
    """One ``[+|++|~]key[=value]`` Hydra override."""

    raw: str
    key: str
    value: str | None
    op: str  # "set" | "add" | "force_add" | "delete"


def parse_override(raw: str, where: str = "verl override") -> Override:
    """Split one Hydra override; raise ConfigError on a malformed one."""
    text = raw.strip()
    op = "set"
    if text.startswith("++"):
        op, text = "force_add", text[2:]
    elif text.startswith("+"):
        op, text = "add", text[1:]
    elif text.startswith("~"):
        op, text = "delete", text[1:]
    key, sep, value = text.partition("=")
    if op != "delete" and not sep:
        raise ConfigError(f"{where} '{raw}': expected key=value (e.g. trainer.total_epochs=2)")
    if not _KEY_RE.match(key):
        raise ConfigError(f"{where} '{raw}': '{key}' is not a dotted config key "
                          "(letters, digits, '_' and '.' only)")
    return Override(raw=raw, key=key, value=value if sep else None, op=op)


def parse_overrides(raws: Iterable[str], where: str = "verl override") -> list[Override]:
    return [parse_override(r, where) for r in raws]


def suggest_key(key: str, keys: Iterable[str]) -> str | None:
    """Closest dotted key, judged mostly on the last component.

    Whole-string similarity is useless here: two keys under
    'actor_rollout_ref.rollout.' look alike whatever their last part is.
    """
    parent, _, leaf = key.rpartition(".")
    best, best_score = None, 0.0
    for cand in keys:
        c_parent, _, c_leaf = cand.rpartition(".")
        leaf_r = difflib.SequenceMatcher(None, leaf, c_leaf).ratio()
        if leaf.startswith(c_leaf) or c_leaf.startswith(leaf):
            leaf_r = max(leaf_r, 0.8)
        if leaf_r < 0.6:
            continue
        parent_r = difflib.SequenceMatcher(None, parent, c_parent).ratio() if parent or c_parent else 1.0
        score = 0.65 * leaf_r + 0.35 * parent_r
        if score > best_score:
            best, best_score = cand, score
    return best if best_score >= 0.6 else None


def _type_problem(ov: Override, default: Any) -> str | None:
    """A value that cannot have the default's type (only the clear cases)."""
    value = (ov.value or "").strip()
    if value in ("null", "") or value.startswith("${") or default is None:
        return None
    if isinstance(default, bool):
        if value.lower() not in ("true", "false"):
            return f"expects true or false (default {str(default).lower()})"
        return None
    if isinstance(default, (int, float)):
        try:
            float(value)
        except ValueError:
            kind = "an integer" if isinstance(default, int) else "a number"
            return f"expects {kind} (default {default})"
    return None


def check_overrides(overrides: Sequence[Override], schema: VerlSchema,
                    where: str = "verl override") -> list[str]:
    """Every problem as one line; an empty list means the keys are all verl's."""
    problems = []
    for ov in overrides:
        key = ov.key
        if "@" in key or key in schema.groups or key.split("/")[0] in schema.groups:
            if key.split("@")[0].split("/")[0] not in schema.groups:
                problems.append(f"{where} '{ov.raw}': '{key.split('@')[0]}' is not a config group of "
                                f"verl {schema.version} (groups: {', '.join(sorted(schema.groups))})")
            continue
        known = key in schema.keys
        if ov.op == "delete" and not known:
            guess = suggest_key(key, schema.keys)
            hint = f" (did you mean '{guess}'?)" if guess else ""
            problems.append(f"{where} '{ov.raw}': cannot delete '{key}', verl {schema.version}'s config has "
                            f"no such key{hint}")
            continue
        if ov.op == "add":
            if known:
                problems.append(f"{where} '{ov.raw}': '{key}' already exists in verl's config; "
                                f"drop the '+' ({key}={ov.value}) or force it with '++'")
            continue
        if ov.op == "force_add":
            continue
        if not known:
            guess = suggest_key(key, schema.keys)
            hint = f" (did you mean '{guess}'?)" if guess else ""
            parent = key.rpartition(".")[0]
            if parent in schema.keys and not guess:
                sib = schema.children(parent)
                hint = f"; keys under '{parent}': {', '.join(s.rsplit('.', 1)[-1] for s in sib[:20])}"
            problems.append(f"{where} '{ov.raw}': unknown key '{key}' in verl {schema.version}'s "
                            f"config{hint}; prefix with '+' to add a new key on purpose")
            continue
        if ov.op == "set" and key in schema.defaults:
            bad = _type_problem(ov, schema.defaults[key])
            if bad:
                problems.append(f"{where} '{ov.raw}': '{key}' {bad}")
    return problems


def one_line(problems: Sequence[str]) -> str:
    """The first problem in full, the count of the others (the CLI prints one line)."""
    if len(problems) == 1:
        return problems[0]
    return f"{problems[0]} (and {len(problems) - 1} more problem(s); fix this one and re-run)"


def override_map(overrides: Iterable[Override]) -> dict[str, str | None]:
    """Last value set per key (for lookups like 'did the user set trainer.nnodes?')."""
    out: dict[str, str | None] = {}
    for ov in overrides:
        if ov.op == "delete":
            out.pop(ov.key, None)
        else:
            out[ov.key] = ov.value
    return out
