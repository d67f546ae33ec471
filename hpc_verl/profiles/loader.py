"""Finding, merging and overriding profiles, remembering where each value came from.

Search order (first match wins): ``./cluster_profiles``, the user directory
(``$XDG_CONFIG_HOME/hpc_verl/profiles``, default ``~/.config/hpc_verl/profiles``),
each directory of ``$HPC_VERL_PROFILE_PATH`` (colon-separated), then the
profiles shipped inside the package. A site can therefore shadow a shipped
profile, and a profile may ``extends:`` one of the same name: the parent is then
looked up *after* the child's own file.
"""
from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from hpc_verl.errors import ProfileError
from hpc_verl.profiles.schema import Profile, build_profile
from hpc_verl.util.yamlfile import read_yaml

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
MAX_EXTENDS_DEPTH = 8


@dataclass(frozen=True)
class ProfileInfo:
    """One entry of ``list_profiles()``."""

    name: str
    path: Path
    origin: str  # cwd | user | env | shipped | file
    description: str
    shadows: int = 0  # how many later search-path entries have the same name


def shipped_dir() -> Path:
    """Profiles that ship inside the package (a link to the repo's cluster_profiles/)."""
    return Path(__file__).resolve().parent.parent / "cluster_profiles"


def user_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "hpc_verl" / "profiles"


def search_path() -> list[tuple[str, Path]]:
    """(origin, directory) in lookup order; directories may not exist."""
    dirs: list[tuple[str, Path]] = [("cwd", Path.cwd() / "cluster_profiles"), ("user", user_dir())]
    for entry in os.environ.get("HPC_VERL_PROFILE_PATH", "").split(":"):
        if entry.strip():
            dirs.append(("env", Path(entry).expanduser()))
    dirs.append(("shipped", shipped_dir()))
    seen: set[Path] = set()
    out = []
    for origin, d in dirs:
        key = d.resolve() if d.exists() else d
        if key not in seen:
            seen.add(key)
            out.append((origin, d))
    return out


def _display(path: Path) -> str:
    """Short, stable name of a profile file for messages and provenance."""
    real = path.resolve()
    try:
        return "shipped:" + str(real.relative_to(shipped_dir().resolve()))
    except ValueError:
        pass
    for base, label in ((Path.cwd().resolve(), ""), (Path.home().resolve(), "~/")):
        try:
            return label + str(real.relative_to(base))
        except ValueError:
            pass
    return str(path)


def _candidates(name: str) -> list[tuple[str, Path]]:
    found = []
    for origin, d in search_path():
        for ext in (".yaml", ".yml"):
            p = d / f"{name}{ext}"
            if p.is_file():
                found.append((origin, p))
                break
    return found


def _looks_like_path(name_or_path: str) -> bool:
    return "/" in name_or_path or name_or_path.endswith((".yaml", ".yml"))


def _not_found(name: str) -> ProfileError:
    from hpc_verl.util.suggest import did_you_mean

    names = [info.name for info in list_profiles()]
    return ProfileError(f"profile '{name}' not found{did_you_mean(name, names)}; known profiles: "
                        f"{', '.join(names) or 'none'} (search path: "
                        f"{', '.join(_display(d) for _, d in search_path())})")


def resolve(name_or_path: str, skip: Optional[Path] = None) -> tuple[str, Path]:
    """Profile name and file for a name (search path) or a path to a YAML file."""
    if _looks_like_path(name_or_path):
        p = Path(name_or_path).expanduser()
        if not p.is_file():
            raise ProfileError(f"profile file {name_or_path} does not exist; give a profile name "
                               "or the path of a .yaml file")
        return p.stem, p
    if not _NAME_RE.match(name_or_path):
        raise ProfileError(f"profile name {name_or_path!r} is not valid; use letters, digits, '.', '_' and '-'")
    found = [p for _origin, p in _candidates(name_or_path)]
    if skip is not None:
        # extends of the same name: look further down the search path than the child itself
        real = [p.resolve() for p in found]
        if skip.resolve() in real:
            found = found[real.index(skip.resolve()) + 1:]
    if found:
        return name_or_path, found[0]
    raise _not_found(name_or_path)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML silently keeps the last)."""


def _read(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """Mapping in the file and the line of every (dotted) key."""
    disp = _display(path)
    data, node = read_yaml(path, "profile file", ProfileError, display=disp, compose=True)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ProfileError(f"profile file {disp}: must be a mapping of sections (slurm:, container:, ...), "
                           f"got {type(data).__name__}")
    lines: dict[str, int] = {}

    def walk(n: Any, prefix: str) -> None:
        if not isinstance(n, yaml.MappingNode):
            return
        seen: set[str] = set()
        for k, v in n.value:
            key = str(k.value)
            if key in seen:
                raise ProfileError(f"profile file {disp}:{k.start_mark.line + 1}: key '{prefix}{key}' appears "
                                   "twice; keep one")
            seen.add(key)
            lines[prefix + key] = k.start_mark.line + 1
            walk(v, f"{prefix}{key}.")

    walk(node, "")
    return data, lines


def _leaf_keys(d: dict[str, Any], prefix: str = ""):
    for k, v in d.items():
        dotted = f"{prefix}{k}"
        yield dotted
        if isinstance(v, dict):
            yield from _leaf_keys(v, dotted + ".")


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep merge: mappings merge key by key, everything else (lists too) replaces."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _load_raw(path: Path, chain: list[Path]) -> tuple[dict[str, Any], dict[str, str]]:
    """Merged mapping of a file and its ``extends`` chain, with provenance per key."""
    if path.resolve() in [c.resolve() for c in chain]:
        cycle = " -> ".join(_display(c) for c in [*chain, path])
        raise ProfileError(f"profile extends itself in a cycle: {cycle}; break the cycle")
    if len(chain) >= MAX_EXTENDS_DEPTH:
        raise ProfileError(f"profile {_display(path)}: 'extends' chain deeper than {MAX_EXTENDS_DEPTH}")
    data, lines = _read(path)
    disp = _display(path)
    prov = {k: f"{disp}:{lines.get(k, '?')}" for k in _leaf_keys(data)}
    parent = data.pop("extends", None)
    prov.pop("extends", None)
    if parent is None:
        return data, prov
    if not isinstance(parent, str) or not parent:
        raise ProfileError(f"profile file {disp}:{lines.get('extends')}: extends must be a profile name, "
                           f"got {parent!r}")
    if _looks_like_path(parent) and not Path(parent).expanduser().is_absolute():
        parent = str(path.parent / parent)  # a relative path is relative to the child's file
    try:
        _, parent_path = resolve(parent, skip=path)
    except ProfileError as exc:
        raise ProfileError(f"profile file {disp}:{lines.get('extends')}: extends: {exc}") from None
    base, base_prov = _load_raw(parent_path, [*chain, path])
    merged = _merge(base, data)
    return merged, {**base_prov, **prov}


def parse_override(text: str) -> tuple[str, Any]:
    """``"slurm.nodes=4"`` -> ``("slurm.nodes", 4)``; values are read as YAML scalars/lists."""
    if "=" not in text:
        raise ProfileError(f"override {text!r} must look like section.key=value (e.g. slurm.nodes=4)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not _KEY_RE.match(key):
        raise ProfileError(f"override {text!r}: {key!r} is not a dotted key like slurm.nodes")
    if "\n" in raw or "\x00" in raw:
        raise ProfileError(f"override {key}: the value must not contain newlines or NUL characters")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    if isinstance(value, (dict, set)) or (value is not None and not isinstance(value, (str, int, float, bool, list))):
        value = raw
    return key, value


def _apply_override(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ProfileError(f"override {key}: {'.'.join(parts[:i + 1])} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def load_profile(name_or_path: str, overrides: Optional[list[str]] = None) -> Profile:
    """Resolve a profile by name or path, apply ``extends`` and ``key=value`` overrides, validate.

    Raises ProfileError with one line (what, where, how to fix) on any problem.
    """
    name, path = resolve(str(name_or_path))
    data, prov = _load_raw(path, [])
    for text in overrides or []:
        key, value = parse_override(text)
        _apply_override(data, key, value)
        for k in list(prov):
            if k == key or k.startswith(key + "."):
                del prov[k]
        prov[key] = f"--set {key}"
        if isinstance(value, dict):  # pragma: no cover - parse_override never returns a dict
            for sub in _leaf_keys(value, key + "."):
                prov[sub] = f"--set {key}"

    def where(key: str) -> str:
        probe = key.split("[")[0]
        while probe:
            if probe in prov:
                return prov[probe]
            probe = probe.rpartition(".")[0]
        return _display(path)

    profile = build_profile(name, data, where)
    profile.source = str(path)
    flat = profile.flat()
    profile.provenance = {k: prov.get(k, "default") for k in flat}
    return profile


def list_profiles() -> list[ProfileInfo]:
    """Every profile on the search path (first of each name), sorted by name."""
    found: dict[str, ProfileInfo] = {}
    for origin, d in search_path():
        if not d.is_dir():
            continue
        for p in sorted([*d.glob("*.yaml"), *d.glob("*.yml")]):
            if not _NAME_RE.match(p.stem):
                continue
            if p.stem in found:
                info = found[p.stem]
                found[p.stem] = ProfileInfo(info.name, info.path, info.origin, info.description, info.shadows + 1)
                continue
            found[p.stem] = ProfileInfo(p.stem, p, origin, _description(p))
    return [found[k] for k in sorted(found)]


def _description(path: Path) -> str:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return "(unreadable: run 'hpc-verl profiles show' for the error)"
    if isinstance(data, dict):
        desc = data.get("description")
        if isinstance(desc, str):
            return desc
        if isinstance(data.get("extends"), str):
            return f"(extends {data['extends']})"
    return ""
