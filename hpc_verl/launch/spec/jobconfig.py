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
from hpc_verl.util.fields import Ctx, between, build, documented, matches, no_control, non_empty, path_value, spec
from hpc_verl.util.yamlfile import read_yaml

_JOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
# Hydra-style override keys: optional +/++/~ prefix, dotted identifiers (list indices allowed), and
# config-group choices: ``model_engine``, ``group@package`` (actor@actor_rollout_ref.actor), ``group/sub``.
_OVERRIDE_KEY_RE = re.compile(r"^(\+\+|\+|~)?[A-Za-z_][A-Za-z0-9_-]*([./][A-Za-z0-9_-]+)*"
                              r"(@[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*)?$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

_module = matches(_MODULE_RE, "a Python module name like hpc_verl.trainer.main")


def _job_name(v: str) -> Optional[str]:
    return None if _JOB_NAME_RE.match(v) else f"must be letters, digits, '.', '_' or '-' (at most 64), got {v!r}"


def _file_name(v: str) -> Optional[str]:
    return path_value(v) or ("must be a file name inside data.dir" if "/" in v else None)


def _override_key(k: str) -> Optional[str]:
    return None if _OVERRIDE_KEY_RE.match(k) else "is not a dotted key like trainer.total_epochs"


def _override_value(v: Any) -> Optional[str]:
    return no_control(format_override_value(v))


def _ship_mode(v: Any) -> Optional[str]:
    return None if str(v).lower() in ("auto", "true", "false") else f"must be auto, true or false, got {v!r}"


def format_override_value(value: Any) -> str:
    """Hydra spelling of a YAML value: ``true``, ``3``, ``[a,b]``, ``null``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
    return str(value)


@dataclass
class TrainerSpec:
    """What the train stage runs."""

    module: str = spec("hpc_verl.trainer.main", doc="`python -m MODULE` (`verl.trainer.main_ppo`: upstream verl)",
                       check=_module)
    args: list[str] = spec(default_factory=list, doc="extra arguments before the overrides", item_check=no_control)
    overrides: dict[str, Any] = spec(default_factory=dict, doc="`key: value` -> `key=value` on the trainer command "
                                     "line", key_check=_override_key, item_check=_override_value)
    derive_overrides: bool = spec(True, doc="add trainer.nnodes, trainer.n_gpus_per_node, data.train_files, "
                                  "data.val_files, trainer.default_local_dir and actor_rollout_ref.model.path "
                                  "from the allocation and paths (unless the overrides set them)")


@dataclass
class DataSpec:
    """The data the job preprocesses (once) and trains on."""

    raw: Optional[str] = spec(None, doc="preprocessing input; unset = no preprocessing", check=path_value)
    dir: str = spec("data/gsm8k", doc="preprocessed parquet directory", check=path_value)
    train_file: str = spec("train.parquet", doc="training parquet file inside `dir`", check=_file_name)
    val_file: str = spec("test.parquet", doc="validation parquet file inside `dir`", check=_file_name)
    preprocess_module: str = spec("hpc_verl.data.preprocess", doc="run as `MODULE --input RAW --output DIR ARGS...`",
                                  check=_module)
    preprocess_args: list[str] = spec(default_factory=list, doc="extra preprocessing arguments", item_check=no_control)


@dataclass
class ModelSpec:
    """The model the job starts from."""

    path: Optional[str] = spec(None, doc="local model directory (config, tokenizer, weights)", check=path_value)
    check: bool = spec(True, doc="run the model-check stage (config and tokenizer load offline)")


@dataclass
class RayJobOptions:
    """The job config's ``ray_job:`` section: used only when the job goes to a Ray cluster's Jobs
    API (``--ray-address``/``--cluster``); what the runtime_env carries besides the profile's env."""

    command: Optional[list[str]] = spec(None, doc="the driver command, replacing `python3 -m <trainer.module> "
                                        "<trainer.args>`", check=lambda v: None if v else "must not be empty",
                                        item_check=non_empty)
    working_dir: Optional[str] = spec(None, doc="uploaded as the driver's working directory (relative to the job "
                                      "config file)", check=non_empty)
    pip: list[str] = spec(default_factory=list, doc="packages the cluster installs for the job",
                          item_check=non_empty)
    py_modules: list[str] = spec(default_factory=list, doc="local packages shipped to the cluster",
                                 item_check=non_empty)
    excludes: list[str] = spec(default_factory=list, doc="more files the upload leaves out (gitignore patterns "
                               "relative to the working_dir), after the defaults (.git, weights, checkpoints, /data/, "
                               "run dirs: docs/rayjobs.md); `!PATTERN` uploads a default-excluded path",
                               item_check=non_empty)
    env_vars: dict[str, str] = spec(default_factory=dict, doc="more environment for the driver and its workers",
                                    key_check=matches(_ENV_NAME_RE, "a variable name like WANDB_MODE"))
    ship_hpc_verl: Any = spec("auto", doc="ship this hpc_verl as a py_module: `auto` (when the driver is "
                              "hpc_verl's own), `true`, `false`", check=_ship_mode)
    entrypoint_num_cpus: Optional[float] = spec(None, doc="CPUs reserved for the driver itself",
                                                check=between(0, 1e6))
    entrypoint_num_gpus: Optional[float] = spec(None, doc="GPUs reserved for the driver itself",
                                                check=between(0, 1e6))

    def __post_init__(self) -> None:
        self.ship_hpc_verl = str(self.ship_hpc_verl).lower()  # YAML's true/false and "auto" alike

    @classmethod
    def from_mapping(cls, data: Optional[dict[str, Any]], where: str = "(in memory)") -> "RayJobOptions":
        """The section from a mapping, checked like the rest of a job config from ``where``."""
        return build(cls, dict(data or {}), _ctx(where), "ray_job.")

    def ships_hpc_verl(self, runs_hpc_verl: bool) -> bool:
        """Send this hpc_verl as a py_module: ``true``, or ``auto`` when the driver is hpc_verl's own."""
        return self.ship_hpc_verl == "true" or (self.ship_hpc_verl == "auto" and runs_hpc_verl)


@dataclass
class JobConfig:
    """What one job runs. Defaults give the built-in PPO trainer on gsm8k-style data."""

    name: str = spec("hpcv", doc="the SLURM job name and run directory name", check=_job_name)
    trainer: TrainerSpec = spec(default_factory=TrainerSpec, doc="what the train stage runs")
    data: DataSpec = spec(default_factory=DataSpec, doc="data to preprocess and train on")
    model: ModelSpec = spec(default_factory=ModelSpec, doc="the model to start from")
    ray_job: RayJobOptions = spec(default_factory=RayJobOptions, doc="only for Ray Jobs submissions")
    source: str = field(default="(built-in default job)", compare=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("source")
        return d

    def rename(self, name: Optional[str]) -> "JobConfig":
        """Take ``--name`` (when given), checked like the file's ``name``: it names the job directory
        and goes into ``#SBATCH --job-name``."""
        if name is not None:
            problem = _job_name(name)
            if problem:
                raise ConfigError(f"--name {problem}")
            self.name = name
        return self

    def trainer_override_args(self) -> list[str]:
        """``key=value`` tokens for the trainer command line, in file order."""
        return [f"{k}={format_override_value(v)}" for k, v in self.trainer.overrides.items()]


def _ctx(where: str) -> Ctx:
    return Ctx(lambda _key: f"job config {where}", ConfigError)


def job_from_dict(data: dict[str, Any], where: str) -> JobConfig:
    """Strictly typed JobConfig from a mapping (a YAML file's content)."""
    if not isinstance(data, dict):
        names = ", ".join(f.name for f in documented(JobConfig))
        raise ConfigError(f"job config {where}: must be a mapping with keys {names}")
    sections = {"trainer", "data", "model", "ray_job"}
    job = build(JobConfig, {k: v for k, v in data.items() if not (k in sections and v is None)}, _ctx(where))
    job.source = where
    return job


def load_job_config(path: Optional[str], overrides: Optional[list[str]] = None,
                    command: Optional[list[str]] = None) -> JobConfig:
    """Job file (or the built-in default) plus ``key=value`` trainer overrides from the command line,
    then the trainer command given after ``--`` (``trainer_command``), if any."""
    if path is None:
        job = JobConfig()
    else:
        data, _ = read_yaml(Path(path), "job config", ConfigError)
        job = job_from_dict(data if data is not None else {}, str(path))
    cmd = None
    if command:  # the trainer command after `--`: module, Hydra options, and overrides checked like the rest
        from hpc_verl.launch.spec.trainer_command import parse_trainer_command

        cmd = parse_trainer_command(command)
        problem = _module(cmd.module)
        if problem:
            raise ConfigError(f"trainer command: -m {cmd.module!r} {problem}")
        job.trainer.module = cmd.module
        if cmd.args:
            job.trainer.args = list(cmd.args)
        if job.source == "(built-in default job)":
            job.source = "(trainer command after --)"
    for text in [*(overrides or []), *(cmd.overrides if cmd else [])]:
        if "=" not in text:
            raise ConfigError(f"override {text!r} must look like key=value (e.g. trainer.total_epochs=2)")
        key, value = text.split("=", 1)
        for problem in (_override_key(key), _override_value(value)):
            if problem:
                raise _ctx("(command line)").fail(f"trainer override {key!r}", problem)
        job.trainer.overrides[key] = value
    return job
