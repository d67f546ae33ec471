"""The job config: what to train (trainer module + overrides), on which data and model.

A YAML file (``--config JOB.yaml``) with strict keys, plus ``key=value``
overrides from the command line that go to the trainer (verl-style dotted keys,
e.g. ``trainer.total_epochs=2``). Paths are absolute or relative to the
directory the job is submitted from.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from hpc_verl.errors import ConfigError
from hpc_verl.util.suggest import unknown_key_message
from hpc_verl.util.yamlfile import read_yaml

_JOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
# Hydra-style override keys: optional +/++/~ prefix, dotted identifiers (list indices allowed).
_OVERRIDE_KEY_RE = re.compile(r"^(\+\+|\+|~)?[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")


@dataclass
class TrainerSpec:
    module: str = "hpc_verl.trainer.main"
    args: list[str] = field(default_factory=list)
    overrides: dict[str, Any] = field(default_factory=dict)
    derive_overrides: bool = True


@dataclass
class DataSpec:
    raw: Optional[str] = None
    dir: str = "data/gsm8k"
    train_file: str = "train.parquet"
    val_file: str = "test.parquet"
    preprocess_module: str = "hpc_verl.data.preprocess"
    preprocess_args: list[str] = field(default_factory=list)


@dataclass
class ModelSpec:
    path: Optional[str] = None
    check: bool = True


@dataclass
class RayJobOptions:
    """The job config's ``ray_job:`` section: used only when the job goes to a Ray cluster's Jobs
    API (``--ray-address``/``--cluster``); what the runtime_env carries besides the profile's env."""

    command: Optional[list[str]] = None  # replaces `python3 -m <trainer.module> <trainer.args>`
    working_dir: Optional[str] = None
    pip: list[str] = field(default_factory=list)
    py_modules: list[str] = field(default_factory=list)
    excludes: list[str] = field(default_factory=lambda: [".git", "__pycache__", "*.pyc"])
    env_vars: dict[str, str] = field(default_factory=dict)
    ship_hpc_verl: str = "auto"  # auto (when the driver is hpc_verl's own) | true | false
    entrypoint_num_cpus: Optional[float] = None
    entrypoint_num_gpus: Optional[float] = None

    @classmethod
    def from_mapping(cls, data: Optional[dict[str, Any]], where: str = "ray_job") -> "RayJobOptions":
        data = dict(data or {})
        valid = list(cls.__dataclass_fields__)
        for key in data:
            if key not in valid:
                raise ConfigError(unknown_key_message(key, where, valid))
        opts = cls(**data)
        if opts.command is not None and (not isinstance(opts.command, list) or not opts.command
                                         or not all(isinstance(c, str) and c for c in opts.command)):
            raise ConfigError(f"{where}.command: expected a non-empty list of strings, got "
                              f"{opts.command!r}; write command: [python3, train.py]")
        for key in ("pip", "py_modules", "excludes"):
            value = getattr(opts, key)
            if isinstance(value, str) or not isinstance(value, list):
                raise ConfigError(f"{where}.{key}: expected a list of strings, got {value!r}; "
                                  f"write {key}: [a, b]")
        if not isinstance(opts.env_vars, dict):
            raise ConfigError(f"{where}.env_vars: expected a mapping NAME: value, got {opts.env_vars!r}")
        opts.ship_hpc_verl = str(opts.ship_hpc_verl).lower()
        if opts.ship_hpc_verl not in ("auto", "true", "false"):
            raise ConfigError(f"{where}.ship_hpc_verl: '{opts.ship_hpc_verl}' is not auto, true or false")
        return opts

    def ships_hpc_verl(self, runs_hpc_verl: bool) -> bool:
        """Send this hpc_verl as a py_module: ``true``, or ``auto`` when the driver is hpc_verl's own."""
        return self.ship_hpc_verl == "true" or (self.ship_hpc_verl == "auto" and runs_hpc_verl)


@dataclass
class JobConfig:
    """What one job runs. Defaults give the built-in PPO trainer on gsm8k-style data."""

    name: str = "hpcv"
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    data: DataSpec = field(default_factory=DataSpec)
    model: ModelSpec = field(default_factory=ModelSpec)
    ray_job: RayJobOptions = field(default_factory=RayJobOptions)
    source: str = "(built-in default job)"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("source")
        return d

    def trainer_override_args(self) -> list[str]:
        """``key=value`` tokens for the trainer command line, in file order."""
        return [f"{k}={format_override_value(v)}" for k, v in self.trainer.overrides.items()]


_SECTIONS = {"trainer": TrainerSpec, "data": DataSpec, "model": ModelSpec}
_TOP_KEYS = ("name", "trainer", "data", "model", "ray_job")


def format_override_value(value: Any) -> str:
    """Hydra spelling of a YAML value: ``true``, ``3``, ``[a,b]``, ``null``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
    return str(value)


def _fail(where: str, key: str, problem: str) -> ConfigError:
    return ConfigError(f"job config {where}: {key} {problem}")


def _no_control(where: str, key: str, value: str) -> None:
    if "\n" in value or "\r" in value or "\x00" in value:
        raise _fail(where, key, "must not contain newlines or NUL characters")


def _path_value(where: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(where, key, f"must be a non-empty path string, got {value!r}")
    _no_control(where, key, value)
    if value.startswith("~"):
        raise _fail(where, key, "must be absolute or relative to the submit directory ('~' is not expanded)")
    if ":" in value or "," in value:
        raise _fail(where, key, "must not contain ':' or ',' (they separate container mount fields)")
    return value


def _str_list(where: str, key: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                              for v in value):
        raise _fail(where, key, f"must be a list of strings, got {value!r}")
    out = [str(v) for v in value]
    for v in out:
        _no_control(where, key, v)
    return out


def _check_override(where: str, key: str, value: Any) -> None:
    if not _OVERRIDE_KEY_RE.match(key):
        raise _fail(where, f"trainer override {key!r}", "is not a dotted key like trainer.total_epochs")
    _no_control(where, f"trainer override {key}", format_override_value(value))


def _build_section(cls: type, data: Any, where: str, section: str) -> Any:
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise _fail(where, section, f"must be a mapping, got {type(data).__name__}")
    valid = [f for f in cls.__dataclass_fields__]
    for key in data:
        if key not in valid:
            raise ConfigError(f"job config {where}: " + unknown_key_message(str(key), f"section '{section}'", valid))
    obj = cls()
    for key, value in data.items():
        dotted = f"{section}.{key}"
        current = getattr(obj, key)
        if key in ("raw", "dir", "path"):
            value = None if (value is None and key != "dir") else _path_value(where, dotted, value)
        elif key in ("module", "preprocess_module"):
            if not isinstance(value, str) or not _MODULE_RE.match(value):
                raise _fail(where, dotted, f"must be a Python module name like hpc_verl.trainer.main, got {value!r}")
        elif key in ("train_file", "val_file"):
            value = _path_value(where, dotted, value)
            if value.startswith("/") or "/" in value:
                raise _fail(where, dotted, "must be a file name inside data.dir")
        elif isinstance(current, bool):
            if not isinstance(value, bool):
                raise _fail(where, dotted, f"must be true or false, got {value!r}")
        elif isinstance(current, list):
            value = _str_list(where, dotted, value)
        elif isinstance(current, dict):
            if not isinstance(value, dict):
                raise _fail(where, dotted, f"must be a mapping of dotted keys to values, got {value!r}")
            value = {str(k): v for k, v in value.items()}
            for k, v in value.items():
                _check_override(where, k, v)
        setattr(obj, key, value)
    return obj


def job_from_dict(data: dict[str, Any], where: str) -> JobConfig:
    """Strictly typed JobConfig from a mapping (a YAML file's content)."""
    if not isinstance(data, dict):
        raise ConfigError(f"job config {where}: must be a mapping with keys {', '.join(_TOP_KEYS)}")
    for key in data:
        if key not in _TOP_KEYS:
            raise ConfigError(f"job config {where}: " + unknown_key_message(str(key), "top level", _TOP_KEYS))
    job = JobConfig(source=where)
    if "name" in data:
        name = data["name"]
        if not isinstance(name, str) or not _JOB_NAME_RE.match(name):
            raise _fail(where, "name", f"must be letters, digits, '.', '_' or '-' (at most 64), got {name!r}")
        job.name = name
    for section, cls in _SECTIONS.items():
        if section in data:
            setattr(job, section, _build_section(cls, data[section], where, section))
    if data.get("ray_job") is not None:
        if not isinstance(data["ray_job"], dict):
            raise _fail(where, "ray_job", f"must be a mapping, got {type(data['ray_job']).__name__}")
        job.ray_job = RayJobOptions.from_mapping(data["ray_job"], f"job config {where}: ray_job")
    return job


def load_job_config(path: Optional[str], overrides: Optional[list[str]] = None) -> JobConfig:
    """Job file (or the built-in default) plus ``key=value`` trainer overrides from the command line."""
    if path is None:
        job = JobConfig()
    else:
        data, _ = read_yaml(Path(path), "job config", ConfigError)
        job = job_from_dict(data if data is not None else {}, str(path))
    for text in overrides or []:
        if "=" not in text:
            raise ConfigError(f"override {text!r} must look like key=value (e.g. trainer.total_epochs=2)")
        key, value = text.split("=", 1)
        _check_override("(command line)", key, value)
        job.trainer.overrides[key] = value
    return job
