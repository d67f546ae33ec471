"""The type verl declares for a config field, read from its dataclass source without importing verl.

A section of verl's config that names a ``_target_`` (``verl.workers.config.ActorConfig``)
becomes that dataclass; the field's annotation, not the YAML default, says which values
verl takes (``rollout_is_threshold: str | float = 2.0`` takes ``0.5_2.0``). We parse the
class with ``ast`` from the installed files (importing verl costs seconds and pulls in
torch), following base classes by name.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Iterator


@functools.lru_cache(maxsize=256)
def _parse(path: str) -> ast.Module | None:
    try:
        return ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None


def _candidate_files(package_dir: Path, module: str) -> Iterator[Path]:
    """Files that may define a class of ``module`` (a package re-exports from its submodules)."""
    rel = Path(*module.split(".")[1:])  # package_dir is verl/ itself
    base = package_dir / rel
    if base.with_suffix(".py").is_file():
        yield base.with_suffix(".py")
    if base.is_dir():
        yield from sorted(base.glob("*.py"))
    yield package_dir / "base_config.py"


@functools.lru_cache(maxsize=256)
def _find_class(package_dir: str, module: str, name: str) -> tuple[ast.ClassDef, str] | None:
    for path in _candidate_files(Path(package_dir), module):
        tree = _parse(str(path))
        if tree is None:
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node, module
    return None


def field_annotation(package_dir: str | Path, target: str, field: str, _depth: int = 0) -> str | None:
    """The annotation of ``field`` in dataclass ``target`` as source text (None: not found)."""
    module, _, name = target.rpartition(".")
    if not module.startswith("verl") or _depth > 6:
        return None
    found = _find_class(str(package_dir), module, name)
    if found is None:
        return None
    node, mod = found
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == field:
            return ast.unparse(stmt.annotation)
    for base in node.bases:
        base_name = ast.unparse(base).rpartition(".")[2]
        hit = field_annotation(package_dir, f"{mod}.{base_name}", field, _depth + 1)
        if hit is not None:
            return hit
    return None


def has_field(package_dir: str | Path, target: str, field: str) -> bool | None:
    """Whether the dataclass declares ``field`` (None: the class could not be read)."""
    module, _, name = target.rpartition(".")
    if _find_class(str(package_dir), module, name) is None:
        return None
    return field_annotation(package_dir, target, field) is not None


def value_problem(annotation: str, value: str) -> str | None:
    """Why a command-line ``value`` cannot have the annotated type (only the clear cases)."""
    ann = annotation.replace("typing.", "").replace("Optional[", "").replace("]", "")
    kinds = {part.strip() for part in ann.replace("|", ",").replace("Union[", "").split(",")}
    if value in ("null", "") or value.startswith("${") or kinds & {"str", "Any", "Literal", "object"} \
            or any(k.startswith(("Literal", "str", "list", "dict", "tuple")) for k in kinds):
        return None
    if kinds <= {"bool", "None"}:
        return None if value.lower() in ("true", "false") else "expects true or false"
    if kinds <= {"int", "float", "bool", "None"}:
        try:
            number = float(value)
        except ValueError:
            return f"expects {'an integer' if kinds <= {'int', 'None'} else 'a number'} ({annotation})"
        if kinds <= {"int", "None"} and not number.is_integer():
            return f"expects an integer ({annotation})"
    return None


def _class_in(annotation: str, module: str, package_dir: str) -> str | None:
    """The dataclass an annotation names (``Optional[RolloutCorrectionConfig]``), as module.Class."""
    for name in ast.walk(ast.parse(annotation, mode="eval")):
        if isinstance(name, ast.Name) and name.id[:1].isupper() and name.id not in ("Optional", "Union", "Any",
                                                                                      "Literal"):
            if _find_class(package_dir, module, name.id) is not None:
                return f"{module}.{name.id}"
    return None


def key_annotation(package_dir: str | Path, targets: dict[str, str] | object, key: str) -> str | None:
    """The annotation verl declares for dotted ``key``: from the nearest section with a ``_target_``,
    down through nested dataclass fields (``algorithm`` is AlgoConfig, its ``rollout_correction`` a
    RolloutCorrectionConfig). None when no dataclass declares it."""
    parts = key.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        target = targets.get(".".join(parts[:cut]))  # type: ignore[union-attr]
        if target is None:
            continue
        cls, rest = target, parts[cut:]
        for i, part in enumerate(rest):
            ann = field_annotation(package_dir, cls, part)
            if ann is None:
                return None
            if i == len(rest) - 1:
                return ann
            nxt = _class_in(ann, cls.rpartition(".")[0], str(package_dir))
            if nxt is None:
                return None
            cls = nxt
        return None
    return None
