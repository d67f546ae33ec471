"""Declarative config fields: a dataclass field carries its default, a one-line doc and its checks.

The model of every strict config here (cluster profiles, the job config with its
``ray_job`` section): ``build`` turns a YAML mapping into the dataclass, refusing
unknown keys with a did-you-mean and every wrong value with one line that names
the key. Types understood: ``bool``, ``int``, ``float``, ``str`` (numbers become
strings), ``list[T]``, ``dict[str, T]``, ``Optional[T]``, nested dataclasses and
``Any`` (no conversion: the field's check decides).
"""
from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import field
from typing import Any, Callable, Iterator, Optional

from hpc_verl.errors import HpcVerlError
from hpc_verl.util.suggest import unknown_key_message

Check = Callable[[Any], Optional[str]]
"""A value check: None when fine, else the problem (``must be ..., got X``)."""


def spec(default: Any = dataclasses.MISSING, *, doc: str, check: Optional[Check] = None,
         default_factory: Any = dataclasses.MISSING, item_check: Optional[Check] = None,
         key_check: Optional[Check] = None) -> Any:
    """A config field: default, one-line doc, value check, per-item (list/dict) and per-key checks."""
    meta = {"doc": doc, "check": check, "item_check": item_check, "key_check": key_check}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=meta)
    if default is dataclasses.MISSING:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


# ----------------------------------------------------------------------------- checks
def no_control(v: str) -> Optional[str]:
    if "\n" in v or "\r" in v or "\x00" in v:
        return "must not contain newlines or NUL characters"
    return None


def non_empty(v: str) -> Optional[str]:
    return no_control(v) or (None if v else "must not be empty")


def matches(regex: re.Pattern, what: str) -> Check:
    def check(v: Any) -> Optional[str]:
        return None if regex.match(v) else f"must be {what}, got {v!r}"
    return check


def choice(options: tuple[str, ...]) -> Check:
    def check(v: Any) -> Optional[str]:
        return None if v in options else f"must be one of {', '.join(options)}, got {v!r}"
    return check


def between(lo: float, hi: float) -> Check:
    def check(v: Any) -> Optional[str]:
        return None if lo <= v <= hi else f"must be between {lo} and {hi}, got {v}"
    return check


def path_value(v: str) -> Optional[str]:
    """A path a job script uses: absolute or relative to the submit directory, safe in mount specs."""
    if not v:
        return "must not be empty"
    bad = no_control(v)
    if bad:
        return bad
    if v.startswith("~"):
        return f"must be absolute or relative to the submit directory ('~' is not expanded), got {v!r}"
    if ":" in v or "," in v:
        return f"must not contain ':' or ',' (they separate container mount fields), got {v!r}"
    return None


def abs_path(v: str) -> Optional[str]:
    return path_value(v) or (None if v.startswith("/") else f"must be an absolute path, got {v!r}")


def each(check: Check) -> Check:
    def run(values: Any) -> Optional[str]:
        for item in values:
            msg = check(item)
            if msg:
                return msg
        return None
    return run


# ----------------------------------------------------------------------------- building
class Ctx:
    """Formats one-line errors: what is being read and where (``label(key)``), then the key."""

    def __init__(self, label: Callable[[str], str], error: type[HpcVerlError]):
        self.label = label
        self.error = error

    def fail(self, key: str, problem: str, fix: str = "") -> HpcVerlError:
        return self.error(f"{self.label(key)}: {key} {problem}" + (f"; {fix}" if fix else ""))

    def unknown(self, prefix: str, key: str, valid: list[str]) -> HpcVerlError:
        section = f"section '{prefix[:-1]}'" if prefix else "top level"
        return self.error(f"{self.label(prefix + key)}: " + unknown_key_message(key, section, valid))


def convert(value: Any, tp: Any, key: str, ctx: Ctx) -> Any:
    """``value`` as type ``tp`` (see the module doc), or the one-line error for ``key``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is typing.Union and type(None) in args:
        if value is None:
            return None
        return convert(value, [a for a in args if a is not type(None)][0], key, ctx)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ctx.fail(key, f"must be a mapping of {', '.join(f.name for f in documented(tp))}, "
                           f"got {type(value).__name__}")
        return build(tp, value, ctx, key + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ctx.fail(key, f"must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ctx.fail(key, f"must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ctx.fail(key, f"must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ctx.fail(key, f"must be a string, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ctx.fail(key, f"must be a list, got {value!r}")
        return [convert(v, args[0], f"{key}[{i}]", ctx) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ctx.fail(key, f"must be a mapping, got {value!r}")
        return {str(k): convert(v, args[1], f"{key}.{k}", ctx) for k, v in value.items()}
    raise AssertionError(f"unsupported schema type {tp!r}")  # pragma: no cover


def documented(cls: type) -> list[dataclasses.Field]:
    """The fields a config file may set (those declared with ``spec``)."""
    return [f for f in dataclasses.fields(cls) if "doc" in f.metadata]


def build(cls: type, data: dict[str, Any], ctx: Ctx, prefix: str = "", *, hidden: tuple[str, ...] = (),
          also_valid: tuple[str, ...] = ()) -> Any:
    """``cls`` from a mapping: unknown keys refused (``hidden`` fields may not be set here,
    ``also_valid`` are other keys the file may hold, offered in suggestions), values converted
    and checked; keys not given keep their defaults."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in documented(cls) if f.name not in hidden}
    for key in data:
        if key not in fields:
            raise ctx.unknown(prefix, str(key), [*fields, *also_valid])
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in data:
            continue
        key = prefix + name
        value = convert(data[name], hints[name], key, ctx)
        meta = f.metadata
        if value is not None:
            if meta["check"] and (msg := meta["check"](value)):
                raise ctx.fail(key, msg)
            if isinstance(value, dict):
                for k, v in value.items():
                    if meta["key_check"] and (msg := meta["key_check"](k)):
                        raise ctx.fail(f"{key}.{k}", msg)
                    if meta["item_check"] and (msg := meta["item_check"](v)):
                        raise ctx.fail(f"{key}.{k}", msg)
            elif isinstance(value, list) and meta["item_check"]:
                for i, v in enumerate(value):
                    if msg := meta["item_check"](v):
                        raise ctx.fail(f"{key}[{i}]", msg)
        kwargs[name] = value
    return cls(**kwargs)


def field_docs(cls: type, prefix: str = "") -> Iterator[tuple[str, str, Any, str]]:
    """(dotted name, type text, default, doc) for every documented field, nested sections flattened."""
    hints = typing.get_type_hints(cls)
    for f in documented(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from field_docs(tp, f"{prefix}{f.name}.")
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = dataclasses.MISSING
        yield f"{prefix}{f.name}", type_text(tp), default, f.metadata["doc"]


def type_text(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union and type(None) in args:
        return type_text([a for a in args if a is not type(None)][0]) + " (optional)"
    if origin is list:
        return f"list of {type_text(args[0])}"
    if origin is dict:
        return f"mapping {type_text(args[0])} → {type_text(args[1])}"
    return {int: "integer", str: "string", bool: "boolean", float: "number"}.get(
        tp, "any" if tp is Any else getattr(tp, "__name__", str(tp)))
