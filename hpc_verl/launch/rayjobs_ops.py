"""The glue between a job (profile + job config) and a Ray cluster's Jobs API.

``rayjobs`` speaks to Ray; this module decides *what* to send (driver command,
runtime_env from the profile's environment block and the job's ``ray_job``
section), writes the job directory, and turns registry records back into
handles, so the ``status``/``logs``/``cancel`` verbs treat Ray jobs and SLURM
jobs alike (they call :func:`describe`, :func:`logs`, :func:`cancel` when a
record's ``kind`` is ``rayjob``).
"""
from __future__ import annotations

import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence, TextIO

from hpc_verl.errors import ConfigError
from hpc_verl.launch import rayjobs
from hpc_verl.util.fs import atomic_write_json
from hpc_verl.util.suggest import unknown_key_message

KIND = "rayjob"


@dataclass
class RayJobOptions:
    """The job config's ``ray_job:`` section: what the runtime_env carries besides the profile's env."""

    command: list[str] | None = None  # replaces `python3 -m <trainer.module> <trainer.args>`
    working_dir: str | None = None
    pip: list[str] = field(default_factory=list)
    py_modules: list[str] = field(default_factory=list)
    excludes: list[str] = field(default_factory=lambda: [".git", "__pycache__", "*.pyc"])
    env_vars: dict[str, str] = field(default_factory=dict)
    ship_hpc_verl: str = "auto"  # auto (when the driver is the built-in trainer) | true | false
    entrypoint_num_cpus: float | None = None
    entrypoint_num_gpus: float | None = None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None, where: str = "ray_job") -> "RayJobOptions":
        data = dict(data or {})
        valid = set(cls.__dataclass_fields__)
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
        if str(opts.ship_hpc_verl).lower() not in ("auto", "true", "false"):
            raise ConfigError(f"{where}.ship_hpc_verl: '{opts.ship_hpc_verl}' is not auto, true or false")
        return opts

    def ships_hpc_verl(self, driver: rayjobs.DriverSpec) -> bool:
        mode = str(self.ship_hpc_verl).lower()
        return mode == "true" or (mode == "auto" and driver.runs_hpc_verl)


def runtime_env_for(driver: rayjobs.DriverSpec, profile_env: Mapping[str, Any],
                    options: RayJobOptions, base_dir: str | Path | None = None) -> dict[str, Any]:
    """profile environment (NCCL block etc.) + the job's own env, files and packages."""
    env_vars = {**{k: str(v) for k, v in profile_env.items()}, **options.env_vars}
    py_modules = list(options.py_modules)
    if options.ships_hpc_verl(driver):
        py_modules.append(rayjobs.hpc_verl_package_dir())
    return rayjobs.build_runtime_env(env_vars, working_dir=options.working_dir, pip=options.pip,
                                     py_modules=py_modules, excludes=options.excludes,
                                     base_dir=base_dir)


def submit(*, address: str, driver: rayjobs.DriverSpec, name: str,
           profile_env: Mapping[str, Any] | None = None, options: RayJobOptions | None = None,
           token_file: str | Path | None = None, base_dir: str | Path | None = None,
           job_dir: str | Path | None = None, profile_name: str | None = None,
           extra_record: Mapping[str, Any] | None = None,
           dry_run: bool = False) -> tuple[rayjobs.RayJobHandle | None, dict[str, Any]]:
    """Submit ``driver`` to the cluster at ``address``; returns (handle, registry record).

    Everything is checked and written to ``job_dir`` (``ray_job.json``: the exact
    entrypoint and runtime_env) before anything is sent, so a rejected submission
    leaves an inspectable record and ``dry_run`` shows what would be sent.
    """
    options = options or RayJobOptions()
    runtime_env = runtime_env_for(driver, profile_env or {}, options, base_dir)
    entrypoint = driver.entrypoint()
    submission_id = rayjobs.new_submission_id(name)
    address = rayjobs.normalize_address(address)
    token_path = str(Path(token_file).expanduser().resolve()) if token_file else None
    record: dict[str, Any] = {
        "id": submission_id,
        "kind": KIND,
        "name": name,
        "address": address,
        "submission_id": submission_id,
        "token_file": token_path,
        "profile": profile_name,
        "entrypoint": entrypoint,
        "submitted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "job_dir": str(Path(job_dir).resolve()) if job_dir else None,
        **dict(extra_record or {}),
    }
    if job_dir:
        atomic_write_json(Path(job_dir) / "ray_job.json", {
            "address": address, "submission_id": submission_id, "entrypoint": entrypoint,
            "runtime_env": runtime_env, "dry_run": dry_run,
        })
    if dry_run:
        return None, record
    cluster = rayjobs.connect(address, token_file)
    record["ray_version"] = cluster.cluster_version
    cluster.submit(entrypoint, runtime_env, submission_id=submission_id,
                   metadata={"hpc_verl_name": name, "hpc_verl_profile": profile_name or ""},
                   entrypoint_num_cpus=options.entrypoint_num_cpus,
                   entrypoint_num_gpus=options.entrypoint_num_gpus)
    return rayjobs.RayJobHandle(address, submission_id, token_path, cluster), record


# Values of the launcher's derived trainer overrides (render.derived_overrides spells
# them as shell expressions for the sbatch script; a Ray job has no such shell).
def _derived_values(profile: Any, job: Any, job_dir: Path | None) -> dict[str, str]:
    values = {"HPCV_DATA_PATH": job.data.dir, "HPCV_TRAIN_FILE": job.data.train_file,
              "HPCV_VAL_FILE": job.data.val_file}
    if profile is not None:  # without a profile, the cluster's size is the trainer config's business
        values.update({"HPCV_NODES": str(profile.slurm.nodes),
                       "HPCV_GPUS_PER_NODE": str(profile.slurm.gpus_per_node)})
    if job.model.path:
        values["HPCV_MODEL_PATH"] = job.model.path
    if job_dir is not None:
        values["HPCV_RUN_DIR"] = str(job_dir)
    return values


def derived_overrides(profile: Any, job: Any, job_dir: Path | None = None) -> tuple[list[str], list[str]]:
    """The launcher's derived overrides with concrete values: (key=value list, keys left out)."""
    from hpc_verl.launch.render import derived_overrides as launcher_derived
    from hpc_verl.profiles import Profile

    values = _derived_values(profile, job, job_dir)
    out, skipped = [], []
    for key, expr in launcher_derived(profile if profile is not None else Profile(), job):
        names = re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", expr)
        if any(n not in values for n in names):
            skipped.append(key)
            continue
        out.append(f"{key}=" + re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: values[m.group(1)], expr))
    return out, skipped


def profile_env(profile: Any) -> dict[str, str]:
    """The profile's environment block, exactly as the sbatch script exports it."""
    from hpc_verl.launch.render import env_block

    return {name: value for name, value, _why in env_block(profile)}


def driver_for(profile: Any, job: Any, job_dir: Path | None = None) -> tuple[rayjobs.DriverSpec, list[str]]:
    """The driver for a job config: ``ray_job.command`` or ``<python> -m <trainer.module>``,
    with the job's overrides and the launcher's derived ones; returns (driver, skipped keys)."""
    options = RayJobOptions.from_mapping(job.ray_job, f"job config {job.source}: ray_job")
    derived, skipped = derived_overrides(profile, job, job_dir)
    args = [*job.trainer.args, *job.trainer_override_args(), *derived]
    if options.command:
        return rayjobs.DriverSpec.for_command(options.command, args), skipped
    python = profile.ray.python if profile is not None else "python3"
    return rayjobs.DriverSpec.for_module(job.trainer.module, args, python), skipped


def submit_job(profile: Any, job: Any, *, address: str, token_file: str | Path | None = None,
               job_dir: str | Path | None = None, base_dir: str | Path | None = None,
               dry_run: bool = False, name: str | None = None) -> tuple[rayjobs.RayJobHandle | None, dict[str, Any]]:
    """Submit a (profile, job config) pair to the Ray cluster at ``address``.

    The job config's directory anchors relative ``ray_job`` paths; the job
    directory (if given) gets ``ray_job.json``, and checkpoints go to
    ``JOB_DIR/checkpoints`` as in the sbatch path.
    """
    jd = Path(job_dir).resolve() if job_dir else None
    driver, skipped = driver_for(profile, job, jd)
    options = RayJobOptions.from_mapping(job.ray_job, f"job config {job.source}: ray_job")
    if base_dir is None and job.source and Path(job.source).is_file():
        base_dir = Path(job.source).resolve().parent
    return submit(address=address, driver=driver, name=name or job.name,
                  profile_env=profile_env(profile) if profile is not None else {},
                  options=options, token_file=token_file, base_dir=base_dir, job_dir=jd,
                  profile_name=profile.name if profile is not None else None, dry_run=dry_run,
                  extra_record={"skipped_overrides": skipped} if skipped else None)


def _get(record: Any, key: str) -> Any:
    """Registry records are JobRecord objects; plain dicts (from ``submit``) work too."""
    if isinstance(record, Mapping):
        return record.get(key)
    return getattr(record, key, None)


def _ref(record: Any) -> str:
    return str(_get(record, "submission_id") or _get(record, "id"))


def handle(record: Any) -> rayjobs.RayJobHandle:
    """A handle for a registry record (reconnects; re-reads the token file)."""
    address = _get(record, "ray_address") or _get(record, "address")
    return rayjobs.RayJobHandle(address, _get(record, "submission_id"), _get(record, "token_file"))


def describe(record: Any, failed_lines: int = rayjobs.FAILED_LOG_LINES) -> dict[str, Any]:
    """State and details for ``hpc-verl status``; a failed job carries its last log lines."""
    h = handle(record)
    info = h.cluster.info(h.submission_id)
    state = rayjobs.state_of(info.status)
    out: dict[str, Any] = {
        "job_id": h.submission_id, "name": _get(record, "name"), "profile": _get(record, "profile"),
        "kind": KIND, "state": state,
        "ray_status": str(getattr(info.status, "value", info.status)),
        "ray_address": h.address, "submission_id": h.submission_id,
        "message": rayjobs.short_message(info.message),
        "start_time": _ms_to_iso(getattr(info, "start_time", None)),
        "end_time": _ms_to_iso(getattr(info, "end_time", None)),
        "driver_exit_code": getattr(info, "driver_exit_code", None),
        "entrypoint": info.entrypoint, "job_dir": _get(record, "job_dir"),
        "token_file": _get(record, "token_file"),
    }
    if state == "FAILED":
        out["last_log_lines"] = rayjobs.last_lines(h.logs(), failed_lines)
    return out


def _ms_to_iso(ms: Any) -> str | None:
    if not ms:
        return None
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="seconds")


def state(record: Any) -> str:
    """Just the state word (for ``hpc-verl list``)."""
    return handle(record).state


def list_state(record: Any) -> str:
    """For a table row: the state, or why it is unknown (one dead cluster must not break `list`)."""
    try:
        return state(record)
    except rayjobs.RayUnreachableError:
        return "UNKNOWN (cluster unreachable)"
    except rayjobs.RayJobsError as exc:
        return f"UNKNOWN ({type(exc).__name__})"


def logs(record: Any, follow: bool = False, out: TextIO | None = None) -> int:
    """Print the driver's log; with ``follow`` stream until the end.

    Returns 0, or 1 when a followed job ended FAILED/CANCELLED (so scripts can
    ``hpc-verl logs --follow JOB && next-step``).
    """
    stream = out or sys.stdout
    h = handle(record)
    if not follow:
        stream.write(h.logs())
        stream.flush()
        return 0
    final = h.follow(stream)
    if final == "FAILED":
        print(f"hpc-verl: job {_ref(record)} FAILED (see the lines above)", file=sys.stderr)
        return 1
    if final == "CANCELLED":
        print(f"hpc-verl: job {_ref(record)} was cancelled", file=sys.stderr)
        return 1
    return 0


def cancel(record: Any) -> str:
    """Stop the driver; returns a one-line outcome."""
    h = handle(record)
    current = h.state
    if current in rayjobs.TERMINAL_STATES:
        return f"job {_ref(record)} already ended ({current})"
    h.stop()
    return f"job {_ref(record)}: stop requested on {h.address}"


# --------------------------------------------------------------------------- registry


def submit_to_registry(profile_name: str | None, config: str | None = None,
                       overrides: Sequence[str] = (), sets: Sequence[str] = (),
                       name: str | None = None, *, ray_address: str,
                       token_file: str | Path | None = None, dry_run: bool = False) -> tuple[rayjobs.RayJobHandle | None, Any]:
    """``hpc-verl submit --ray-address``: job directory + Ray submission + registry record.

    Without a profile, no environment block is sent (the cluster's own
    environment applies) and node/GPU counts are left to the trainer's config.
    """
    from hpc_verl.launch import registry
    from hpc_verl.launch.jobconfig import load_job_config

    profile = None
    if profile_name:
        from hpc_verl.profiles import load_profile

        profile = load_profile(profile_name, list(sets))
    elif sets:
        raise ConfigError("--set changes a profile; give --profile NAME too")
    job = load_job_config(config, list(overrides))
    job_name = name or job.name
    job_dir = registry.new_job_dir(job_name)
    if profile is not None:
        atomic_write_json(job_dir / "profile.json", profile.to_dict())
    atomic_write_json(job_dir / "job_config.json", job.to_dict())
    rec = registry.JobRecord(name=job_name, job_dir=str(job_dir), profile=profile.name if profile else "-",
                             scheduler=KIND, log_dir=str(job_dir / "logs"),
                             ray_address=rayjobs.normalize_address(ray_address),
                             token_file=str(Path(token_file).expanduser().resolve()) if token_file else None,
                             dry_run=True)
    try:
        h, info = submit_job(profile, job, address=ray_address, token_file=token_file, job_dir=job_dir,
                             dry_run=dry_run, name=job_name)
    except BaseException:
        shutil.rmtree(job_dir, ignore_errors=True)  # nothing was submitted: leave no half record
        raise
    rec.submission_id = info["submission_id"]
    if h is not None:
        rec.dry_run = False
        rec.submitted = time.time()
    rec.save()
    return h, rec
