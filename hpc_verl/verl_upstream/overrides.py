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
from hpc_verl.verl_upstream.advice import closest_groups, history, unknown_key
from hpc_verl.verl_upstream.annotations import has_field, key_annotation, value_problem
from hpc_verl.verl_upstream.config import VerlSchema

_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*(?:[.@/][A-Za-z0-9_-]+)*$")


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
    """Closest dotted key, judged mostly on the last component (for our own trainer's keys).

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


def _type_problem(ov: Override, default: Any, annotation: str | None = None) -> str | None:
    """A value that cannot have the key's type: verl's dataclass annotation where it declares one,
    else the default's type (only the clear cases)."""
    value = (ov.value or "").strip()
    if annotation is not None:
        return value_problem(annotation, value)
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


def is_choice(key: str, schema: VerlSchema) -> bool:
    """A config-group choice (``model_engine``, ``actor@actor_rollout_ref.actor``, ``rollout/...``)."""
    return "@" in key or key in schema.groups or key.split("/")[0] in schema.groups


def choices_of(overrides: Sequence[Override], groups: Iterable[str]) -> list[str]:
    """The overrides that pick config-group options: they decide which keys exist at all."""
    group_set = set(groups)
    return [ov.raw for ov in overrides
            if "@" in ov.key or ov.key in group_set or ov.key.split("/")[0] in group_set]


def _section_target(key: str, schema: VerlSchema) -> str | None:
    return schema.targets.get(key.rpartition(".")[0])


def check_overrides(overrides: Sequence[Override], schema: VerlSchema,
                    where: str = "verl override") -> list[str]:
    """Every problem as one line; an empty list means the keys are all verl's."""
    problems = []
    tag = f"verl {schema.version}"
    for ov in overrides:
        key = ov.key
        if key == "hydra" or key.startswith("hydra."):
            continue  # Hydra's own settings (hydra.run.dir, hydra.job.chdir): main_ppo's Hydra takes them
        if is_choice(key, schema):
            group = key.split("@")[0].split("/")[0]
            if group not in schema.groups:
                near = closest_groups(group, schema.groups)
                hint = f" (did you mean '{near[0]}'?)" if near else ""
                problems.append(f"{where} '{ov.raw}': '{group}' is not a config group of {tag}{hint}; groups: "
                                f"{', '.join(sorted(schema.groups))}")
            continue
        known = key in schema.keys
        if ov.op == "delete":
            if not known:
                problems.append(f"{where} '{ov.raw}': cannot delete '{key}', {tag}'s config has no such key; "
                                f"{unknown_key(key, None, schema)}")
            continue
        if ov.op == "add":
            if known:
                problems.append(f"{where} '{ov.raw}': '{key}' already exists in verl's config; "
                                f"drop the '+' ({key}={ov.value}) or force it with '++'")
                continue
            target = _section_target(key, schema)
            if target and has_field(schema.package_dir, target, key.rpartition(".")[2]) is False:
                cls, section, name = target.rpartition(".")[2], key.rpartition(".")[0], key.rpartition(".")[2]
                problems.append(f"{where} '{ov.raw}': {tag} refuses it at start: {cls}.__init__() got an unexpected "
                                f"keyword argument '{name}' ('{section}' becomes verl's {cls}, which has no field "
                                f"'{name}'); {unknown_key(key, ov.value, schema)}")
            continue
        if ov.op == "force_add":
            continue
        if not known:
            advice = unknown_key(key, ov.value, schema)
            add = "" if _section_target(key, schema) or key in history() else \
                "; prefix with '+' to add a new key on purpose"
            problems.append(f"{where} '{ov.raw}': unknown key '{key}' in {tag}'s config; {advice}{add}")
            continue
        if ov.op == "set" and key in schema.defaults:
            annotation = key_annotation(schema.package_dir, schema.targets, key) if schema.package_dir else None
            bad = _type_problem(ov, schema.defaults[key], annotation)
            if bad:
                problems.append(f"{where} '{ov.raw}': '{key}' {bad}")
    return problems


def one_line(problems: Sequence[str]) -> str:
    """The first problem in full, then the others: every finding of one check, on one line."""
    if len(problems) == 1:
        return problems[0]
    others = "; ".join(f"({i}) {p}" for i, p in enumerate(problems[1:], start=2))
    return f"{problems[0]} — and {len(problems) - 1} more: {others}"


def override_map(overrides: Iterable[Override]) -> dict[str, str | None]:
    """Last value set per key (for lookups like 'did the user set trainer.nnodes?')."""
    out: dict[str, str | None] = {}
    for ov in overrides:
        if ov.op == "delete":
            out.pop(ov.key, None)
        else:
            out[ov.key] = ov.value
    return out
