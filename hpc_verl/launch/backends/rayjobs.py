"""The Ray Jobs backend: a job sent to a Ray cluster that is already up, through its Jobs API.

``rayjobs_api`` speaks to Ray; this module decides *what* to send (the driver
command, a runtime_env from the profile's environment block and the job's
``ray_job`` section), writes the job directory (``ray_job.json``: the exact
entrypoint and runtime_env, before anything is sent) and answers for the
registry's ``rayjob`` records. The target is ``--ray-address`` (+
``--ray-token-file``) or ``--cluster JOB``, a cluster held by ``hpc-verl
cluster up`` (its address, token and profile come from the registry).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, TextIO

from hpc_verl.errors import ConfigError, JobNotFoundError
from hpc_verl.launch import registry
from hpc_verl.launch.backends import rayjobs_api as api
from hpc_verl.launch.backends import upload
from hpc_verl.launch.backends.base import Backend, DryRun, JobInfo, JobState, SubmitRequest
from hpc_verl.launch.backends.rayjobs_job import (KNOWN_TRAINERS, STAGES_MODULE, anchor_paths, held_profile,
                                                  ray_need, stage_plan)
from hpc_verl.launch.registry import JobRecord
from hpc_verl.launch.spec.jobconfig import RayJobOptions, TrainerSpec
from hpc_verl.util.fs import atomic_write_json
from hpc_verl.util.package import PACKAGE_DIR
from hpc_verl.verl_upstream.command import MODULE as VERL_TRAINER_MODULE


# --------------------------------------------------------------------------- what to run
@dataclass
class DriverSpec:
    """The driver process Ray runs: the built-in trainer, upstream verl, or any command."""

    argv: list[str]

    @classmethod
    def for_module(cls, module: str, args: Sequence[str] = (), python: str = "python3") -> "DriverSpec":
        return cls([python, "-m", module, *args])

    @classmethod
    def for_trainer(cls, trainer: str, overrides: Sequence[str] = (), python: str = "python3") -> "DriverSpec":
        """``builtin`` (hpc_verl.trainer.main) or ``verl`` (verl.trainer.main_ppo)."""
        module = {"builtin": TrainerSpec().module, "verl": VERL_TRAINER_MODULE}.get(trainer)
        if module is None:
            raise api.RayJobsError(f"unknown trainer '{trainer}'; use builtin or verl (or give a command)")
        return cls.for_module(module, overrides, python)

    @classmethod
    def for_command(cls, command: Sequence[str], args: Sequence[str] = ()) -> "DriverSpec":
        if not command or not all(isinstance(c, str) and c for c in command):
            raise api.RayJobsError("the driver command must be a non-empty list of strings "
                                   "(e.g. [python3, train.py])")
        return cls([*command, *args])

    @property
    def module(self) -> Optional[str]:
        """The ``-m`` module the driver runs, if any."""
        if "-m" in self.argv[:-1]:
            return self.argv[self.argv.index("-m") + 1]
        return None

    @property
    def runs_hpc_verl(self) -> bool:
        return (self.module or "").split(".")[0] == "hpc_verl"

    def entrypoint(self) -> str:
        """The shell line Ray runs; every piece quoted (Ray passes it to a shell)."""
        return shlex.join(self.argv)


def build_runtime_env(env_vars: Optional[Mapping[str, Any]] = None, *,
                      working_dir: Optional[str] = None, pip: Optional[Sequence[str]] = None,
                      py_modules: Optional[Sequence[str]] = None, excludes: Optional[Sequence[str]] = None,
                      base_dir: Optional[str | os.PathLike[str]] = None) -> dict[str, Any]:
    """A Ray runtime_env from the profile's environment and the job's files/packages.

    Local paths are made absolute (relative to ``base_dir``: the job config's
    directory) and must exist, so a typo fails here, not as an upload error.
    """
    base = Path(base_dir) if base_dir else Path.cwd()
    env: dict[str, Any] = {}
    if env_vars:
        env["env_vars"] = {str(k): str(v) for k, v in env_vars.items()}
    if working_dir:
        env["working_dir"] = _local_or_uri(working_dir, base, "working_dir")
    if py_modules:
        env["py_modules"] = [_local_or_uri(p, base, "py_modules") for p in py_modules]
    if pip:
        env["pip"] = [str(p) for p in pip]
    if excludes:
        env["excludes"] = [str(e) for e in excludes]
    return env


def _local_or_uri(value: str, base: Path, key: str) -> str:
    text = str(value)
    if "://" in text:  # s3://, gs://, https:// packages: Ray fetches them itself
        return text
    path = (base / Path(text).expanduser()).resolve()
    if not path.exists():
        raise api.RayJobsError(f"job config: ray_job.{key} path {path} does not exist; fix the path "
                               "(relative paths are taken from the job config's directory)")
    return str(path)


def hpc_verl_package_dir() -> str:
    """The hpc_verl package directory, shipped as a py_module so the built-in trainer
    runs on clusters where hpc_verl is not installed."""
    return str(PACKAGE_DIR)


def new_submission_id(name: str) -> str:
    """Readable and unique: ``hpcverl-<name>-<UTC time>-<4 hex>``."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()[:32] or "job"
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"hpcverl-{slug}-{stamp}-{secrets.token_hex(2)}"


def runtime_env_for(driver: DriverSpec, profile_env: Mapping[str, Any], options: RayJobOptions,
                    base_dir: Optional[str | Path] = None, needs_hpc_verl: bool = False) -> dict[str, Any]:
    """profile environment (NCCL block etc.) + the job's own env, files and packages; when files
    are uploaded, the upload guard's default excludes before the job's own (``upload.excludes_for``).
    ``needs_hpc_verl``: the job's workers import hpc_verl (verl's CPU plugin), whatever the driver."""
    env_vars = {**{k: str(v) for k, v in profile_env.items()}, **options.env_vars}
    py_modules = list(options.py_modules)
    if options.ships_hpc_verl(driver.runs_hpc_verl or needs_hpc_verl):
        py_modules.append(hpc_verl_package_dir())
    env = build_runtime_env(env_vars, working_dir=options.working_dir, pip=options.pip, py_modules=py_modules,
                            base_dir=base_dir)
    if env.get("working_dir") or env.get("py_modules"):
        env["excludes"] = upload.excludes_for(options.excludes, [p for p in env.get("py_modules", [])
                                                                if "://" not in p])
    return env


# The launcher's derived trainer overrides (render.derived_overrides spells them as shell
# expressions for the sbatch script; a Ray job has no such shell): the values they stand for.
def _derived_values(profile: Any, job: Any, job_dir: Optional[Path]) -> dict[str, str]:
    values = {"HPCV_DATA_PATH": job.data.dir, "HPCV_TRAIN_FILE": job.data.train_file,
              "HPCV_VAL_FILE": job.data.val_file}
    if profile is not None:  # without a profile, the cluster's size is the trainer config's business
        values.update({"HPCV_NODES": str(profile.slurm.nodes), "HPCV_GPUS_PER_NODE": str(profile.slurm.gpus_per_node)})
    if job.model.path:
        values["HPCV_MODEL_PATH"] = job.model.path
    if job_dir is not None:
        values["HPCV_RUN_DIR"] = str(job_dir)
    return values


_SHELL_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


def derived_overrides(profile: Any, job: Any, job_dir: Optional[Path] = None) -> tuple[list[str], list[str]]:
    """The launcher's derived overrides with concrete values: (key=value list, keys left out)."""
    from hpc_verl.launch.spec.render import derived_overrides as launcher_derived
    from hpc_verl.profiles import Profile

    values = _derived_values(profile, job, job_dir)
    out, skipped = [], []
    for key, expr in launcher_derived(profile if profile is not None else Profile(), job):
        if any(n not in values for n in _SHELL_VAR.findall(expr)):
            skipped.append(key)
            continue
        out.append(f"{key}=" + _SHELL_VAR.sub(lambda m: values[m.group(1)], expr))
    return out, skipped


def driver_for(profile: Any, job: Any, job_dir: Optional[Path] = None) -> tuple[DriverSpec, list[str]]:
    """The driver for a job config: ``ray_job.command`` or ``<python> -m <trainer.module>``,
    with the job's overrides and the launcher's derived ones; returns (driver, skipped keys)."""
    derived, skipped = derived_overrides(profile, job, job_dir)
    args = [*job.trainer.args, *job.trainer_override_args(), *derived]
    python = profile.ray.python if profile is not None else "python3"
    if job.ray_job.command:
        driver = DriverSpec.for_command(job.ray_job.command, args)
    else:
        driver = DriverSpec.for_module(job.trainer.module, args, python)
    plan = stage_plan(job)
    if plan:  # preprocess / model-check run in the driver first, as the batch script runs them
        driver = DriverSpec([python, "-m", STAGES_MODULE, "--plan", json.dumps(plan, sort_keys=True), "--",
                             *driver.argv])
    return driver, skipped




@dataclass
class RaySubmission:
    """Exactly what goes to the Jobs API (the payload of a Ray Jobs DryRun); the token stays in its file."""

    address: str
    submission_id: str
    entrypoint: str
    runtime_env: dict[str, Any]
    token_file: Optional[str] = None
    metadata: dict[str, str] = field(default_factory=dict)
    entrypoint_num_cpus: Optional[float] = None
    entrypoint_num_gpus: Optional[float] = None
    skipped_overrides: list[str] = field(default_factory=list)
    need: Optional[Any] = None  # placement.Need: what the cluster must have (checked before sending)
    uploads: list[upload.Upload] = field(default_factory=list, repr=False)  # measured by the upload guard

    def summary(self) -> str:
        env = self.runtime_env
        lines = [f"address   {self.address}" + (f" (token file {self.token_file})" if self.token_file else ""),
                 f"driver    {self.entrypoint}",
                 f"runtime   env_vars {len(env.get('env_vars', {}))}, working_dir {env.get('working_dir', '-')}, "
                 f"py_modules {len(env.get('py_modules', []))}, pip {len(env.get('pip', []))}"]
        if self.uploads:
            lines.append("upload    " + ", ".join(u.line() for u in self.uploads)
                         + f" (Ray's limit: {upload.mib(upload.upload_limit_bytes())} each)")
        if self.need is not None:
            lines.append(f"needs     {self.need.nodes} node(s) with {self.need.gpus:g} GPU slot(s)"
                         + (f" and {self.need.cpus:g} CPUs" if self.need.cpus else "")
                         + " each (checked against the cluster before sending)")
        if self.skipped_overrides:
            lines.append(f"left out  {', '.join(self.skipped_overrides)} (no profile: the trainer config decides)")
        return "\n".join(lines)

    def request_file(self) -> dict[str, Any]:
        return {"address": self.address, "submission_id": self.submission_id, "entrypoint": self.entrypoint,
                "runtime_env": self.runtime_env}


# --------------------------------------------------------------------------- the backend
class RayJobsBackend(Backend):
    """Jobs sent to a running Ray cluster (``--ray-address URL`` or ``--cluster JOB``)."""

    scheduler = "rayjob"

    def accepts(self, request: SubmitRequest) -> bool:
        return bool(request.ray_address or request.cluster)

    def _target(self, request: SubmitRequest) -> tuple[str, Optional[str], Any]:
        """(address, token file, profile) of the request's cluster: a held cluster's own resolved
        profile, else ``--profile`` (with ``--set`` and the job's size, ``job_size``), else None."""
        if not request.cluster:
            return api.normalize_address(request.ray_address or ""), request.ray_token_file, request.profile
        if request.ray_address:
            raise ConfigError("give either --cluster JOB or --ray-address URL, not both")
        from hpc_verl.launch.backends import for_record

        crec = registry.find_cluster(request.cluster)
        address, token_file = for_record(crec).jobs_api(crec)
        if request.profile:
            return address, request.ray_token_file or token_file, request.profile
        if request.sets:
            raise ConfigError(f"--set changes a profile, and cluster job {crec.job_id} runs with the one it was "
                              "started with; give the --set values to 'hpc-verl cluster up' (or add --profile NAME)")
        return address, request.ray_token_file or token_file, held_profile(crec)

    def dryrun(self, request: SubmitRequest) -> DryRun:
        """Without a profile no environment block is sent (the cluster's own environment applies)
        and node/GPU counts are left to the trainer's config."""
        from hpc_verl.launch.spec.jobconfig import load_job_config

        address, token_file, profile = self._target(request)
        job = load_job_config(request.config, list(request.overrides), list(request.command) or None)
        job = anchor_paths(job.rename(request.name), Path.cwd())
        if isinstance(profile, str):
            from hpc_verl.launch.spec.job_size import size_sets
            from hpc_verl.profiles import load_profile

            first = load_profile(profile, list(request.sets))
            extra = size_sets(first, job, request.sets)
            profile = load_profile(profile, [*request.sets, *extra]) if extra else first
        elif profile is None and request.sets:
            raise ConfigError("--set changes a profile; give --profile NAME too")
        if profile is not None and not job.ray_job.command and job.trainer.module in KNOWN_TRAINERS:
            # the same checks as a batch job (launch_plan.build_plan): keys, arithmetic, CPU rules
            from hpc_verl.launch.spec.trainer_check import validate_job_trainer
            validate_job_trainer(profile, job)
        token_path = str(Path(token_file).expanduser().resolve()) if token_file else None
        job_dir = registry.new_job_dir(job.name)
        try:
            if profile is not None:
                atomic_write_json(job_dir / "profile.json", profile.to_dict())
            atomic_write_json(job_dir / "job_config.json", job.to_dict())
            sub = self._submission(profile, job, address, token_path, job_dir)
            atomic_write_json(job_dir / "ray_job.json", sub.request_file())
            rec = JobRecord(name=job.name, job_dir=str(job_dir), profile=profile.name if profile else "-",
                            scheduler=self.scheduler, log_dir=str(job_dir / "logs"), ray_address=address,
                            token_file=token_path, submission_id=sub.submission_id, dry_run=True)
            rec.save()
        except BaseException:
            shutil.rmtree(job_dir, ignore_errors=True)  # nothing was sent: leave no half record
            raise
        return DryRun(self.scheduler, rec, sub.summary(), files=[("request", str(job_dir / "ray_job.json"))],
                      request=request, payload=sub)

    def _submission(self, profile: Any, job: Any, address: str, token_file: Optional[str],
                    job_dir: Path) -> RaySubmission:
        """The job's driver and runtime_env; checkpoints go to ``JOB_DIR/checkpoints`` as in the sbatch
        path, relative ``ray_job`` paths are taken from the job config's directory."""
        from hpc_verl.launch.spec.render import job_env

        driver, skipped = driver_for(profile, job, job_dir)
        base_dir = Path(job.source).resolve().parent if job.source and Path(job.source).is_file() else None
        # the profile's environment and what the trainer needs (a verl job on CPU: its platform), as a batch job
        profile_env = {name: value for name, value, _why in job_env(profile, job)} if profile is not None else {}
        opts = job.ray_job
        need = ray_need(profile, job) if profile is not None else None
        runtime_env = runtime_env_for(driver, profile_env, opts, base_dir,
                                      needs_hpc_verl=need is not None and need.why.startswith("verl on CPU"))
        uploads = upload.check_uploads(runtime_env)  # over Ray's limit: one line now, nothing sent
        return RaySubmission(address=address, submission_id=new_submission_id(job.name), entrypoint=driver.entrypoint(),
                             runtime_env=runtime_env, token_file=token_file,
                             metadata={"hpc_verl_name": job.name, "hpc_verl_profile": profile.name if profile else ""},
                             entrypoint_num_cpus=opts.entrypoint_num_cpus, entrypoint_num_gpus=opts.entrypoint_num_gpus,
                             skipped_overrides=skipped, uploads=uploads, need=need)

    def submit(self, dry: DryRun) -> JobRecord:
        sub: RaySubmission = dry.payload
        rec = dry.record
        try:
            cluster = api.connect(sub.address, sub.token_file)
            if sub.need is not None:  # what verl will ask of the cluster, before it waits or fails inside verl
                from hpc_verl.launch.spec.placement import placement_problem

                problem = placement_problem(cluster.nodes(), sub.need, sub.address)
                if problem:
                    raise ConfigError(problem)
                missing = cluster.missing_modules(sub.need.python, list(sub.need.modules))
                if missing:
                    raise ConfigError(f"the Python of the Ray cluster at {sub.address} ({sub.need.python}) cannot "
                                      f"import {', '.join(missing)}, which this job runs; install "
                                      f"{' and '.join(missing)} there (verl: pip install verl), or set the "
                                      "profile's ray.python to a Python that has them")
            cluster.submit(sub.entrypoint, sub.runtime_env, submission_id=sub.submission_id, metadata=sub.metadata,
                           entrypoint_num_cpus=sub.entrypoint_num_cpus, entrypoint_num_gpus=sub.entrypoint_num_gpus)
        except BaseException:
            shutil.rmtree(rec.job_dir, ignore_errors=True)  # nothing was submitted: leave no half record
            raise
        rec.dry_run = False
        rec.submitted = time.time()
        rec.save()
        if cluster.client_version.split(".")[:2] != cluster.cluster_version.split(".")[:2]:
            print(f"hpc-verl: note: Ray here is {cluster.client_version}, the cluster runs {cluster.cluster_version}; "
                  "the driver uses the cluster's Ray (both are >= 2.40, so the Jobs API works)", file=sys.stderr)
        return rec

    def report(self, record: JobRecord) -> list[str]:
        return [f"submitted Ray job {record.submission_id} ({record.name}) to {record.ray_address}",
                f"job directory: {record.job_dir}", f"follow: hpc-verl logs {record.submission_id} --follow"]

    def handle(self, record: JobRecord) -> api.RayJobHandle:
        """A handle for a registry record (reconnects; re-reads the token file)."""
        return api.RayJobHandle(record.ray_address or "", record.submission_id or "", record.token_file)

    # -------------------------------------------------------------- a registered job
    def ref(self, record: JobRecord) -> str:
        return str(record.submission_id)

    def _describe(self, record: JobRecord) -> JobInfo:
        h = self.handle(record)
        info = h.cluster.info(h.submission_id)
        state = api.state_of(info.status)
        native = str(getattr(info.status, "value", info.status))
        code = getattr(info, "driver_exit_code", None)
        details: dict[str, Any] = {
            "ray_status": native, "ray_address": h.address, "submission_id": h.submission_id,
            "message": api.short_message(info.message),
            "start_time": _ms_to_iso(getattr(info, "start_time", None)),
            "end_time": _ms_to_iso(getattr(info, "end_time", None)),
            "driver_exit_code": code, "entrypoint": info.entrypoint, "job_dir": record.job_dir,
            "token_file": record.token_file}
        if state is JobState.FAILED:
            details["last_log_lines"] = api.last_lines(h.logs(), api.FAILED_LOG_LINES)
        return JobInfo(state, reason=details["message"], exit_code="" if code is None else str(code), source="ray",
                       job_id=h.submission_id, native=native, details=details)

    def list_state(self, record: JobRecord) -> str:
        """Just the state (no log fetch); one dead cluster must not break `hpc-verl list`."""
        if record.dry_run:
            return str(JobState.DRY_RUN)
        try:
            return str(self.handle(record).state)
        except api.RayUnreachableError:
            return "UNKNOWN (cluster unreachable)"
        except api.RayJobsError as exc:
            return f"UNKNOWN ({type(exc).__name__})"

    def _logs(self, record: JobRecord, node: Optional[str], follow: bool, out: TextIO) -> int:
        """The driver's log; with ``follow`` until the end: 1 when it ended FAILED/CANCELLED
        (so scripts can ``hpc-verl logs --follow JOB && next-step``)."""
        if node:
            raise JobNotFoundError(f"job {self.ref(record)} is a Ray job: it has one driver log, no per-node logs; "
                                   "drop --node (node logs are in the cluster job's logs)")
        h = self.handle(record)
        if not follow:
            out.write(h.logs())
            out.flush()
            return 0
        final = h.follow(out)
        if final in (JobState.FAILED, JobState.CANCELLED):
            how = "FAILED (see the lines above)" if final is JobState.FAILED else "was cancelled"
            print(f"hpc-verl: job {self.ref(record)} {how}", file=sys.stderr)
            return 1
        return 0

    def _attach(self, record: JobRecord, node: Optional[str], command: list[str]) -> int:
        raise ConfigError(f"job {self.ref(record)} is a Ray job: a driver inside someone's Ray cluster, with no "
                          "container or allocation of its own to attach to; attach to the cluster's own job "
                          "instead ('hpc-verl attach CLUSTER_JOB' for one held by 'hpc-verl cluster up')")

    def _cancel(self, record: JobRecord) -> str:
        h = self.handle(record)
        current = h.state
        if current.terminal:
            return f"job {self.ref(record)} already ended ({current})"
        h.stop()
        return f"job {self.ref(record)}: stop requested on {h.address}"


def _ms_to_iso(ms: Any) -> Optional[str]:
    if not ms:
        return None
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="seconds")
