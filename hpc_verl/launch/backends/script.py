"""What the SLURM and local backends share: both run the launcher's rendered batch script.

A script job's directory (``registry.new_job_dir``) holds ``script.sbatch``, the
resolved ``profile.json`` and ``job_config.json``, the record ``job.json``, the
batch log and the run directory (``<name>-<job id>/``: ``ray/``, ``logs/``
with one ``node-<name>.log`` per node, ``stages/``). The profile's
``paths.job_root`` is pointed at the job directory so the run directory lands
next to the record. Jobs that train pass the same checks as ``hpc-verl
plan``/``render`` (``build_plan``: trainer keys, batch arithmetic) before
anything is written.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar, Mapping, Optional, Sequence, TextIO

from hpc_verl.errors import ConfigError, JobNotFoundError, SubmitError
from hpc_verl.launch import registry
from hpc_verl.launch.backends.base import Backend, DryRun, JobInfo, JobState, SubmitRequest
from hpc_verl.launch.registry import JobRecord
from hpc_verl.util.fs import atomic_write_json, atomic_write_text


def _load_profile(name: str, sets: Sequence[str]) -> Any:
    from hpc_verl.profiles import load_profile

    return load_profile(name, list(sets))


class ScriptBackend(Backend):
    """A backend that runs the rendered batch script of a profile whose ``scheduler`` is ``runs_profiles``."""

    runs_profiles: ClassVar[str]
    """The profiles' ``scheduler`` value this backend runs."""
    holds_clusters: ClassVar[bool] = False
    """Whether ``hpc-verl cluster up`` can hold a Ray cluster with it."""

    # -------------------------------------------------------------- hooks a script backend may fill
    def job_config(self, request: SubmitRequest) -> Any:
        """The job config of a request (``--config`` plus trainer overrides)."""
        from hpc_verl.launch.spec.jobconfig import load_job_config

        return load_job_config(request.config, list(request.overrides), list(request.command) or None)

    def check_inputs(self, job: Any) -> None:
        """Checks that only hold where the job runs (nothing to check for a remote scheduler)."""

    def profile_sets(self, profile: Any, sets: Sequence[str]) -> list[str]:
        """``--set`` values the backend adds to the user's."""
        return []

    def by_hand(self, record: JobRecord) -> str:
        """The command that would submit the dry run's script without hpc-verl."""
        return ""

    def new_job_id(self, profile: Any) -> Optional[int]:
        """The job's id when the backend fixes it before submission (rendered into the script);
        None: the scheduler assigns it (``$SLURM_JOB_ID``)."""
        return None

    def batch_log(self, record: JobRecord) -> str:
        """Where the batch script's output goes."""
        return str(Path(record.job_dir) / f"{record.name}-{record.job_id}.out")

    # -------------------------------------------------------------- Backend
    def accepts(self, request: SubmitRequest) -> bool:
        if request.ray_address or request.cluster or not request.profile:
            return False
        return _load_profile(request.profile, request.sets).scheduler == self.runs_profiles

    def dryrun(self, request: SubmitRequest) -> DryRun:
        from hpc_verl.launch.spec.launch_plan import build_plan

        if not request.profile:
            raise ConfigError(f"the {self.scheduler} backend needs a profile (--profile NAME)")
        job = self.job_config(request).rename(request.name)
        first = _load_profile(request.profile, request.sets)
        if request.hold and (first.scheduler != self.runs_profiles or not self.holds_clusters):
            raise ConfigError(f"profile {first.name} uses scheduler '{first.scheduler}'; 'hpc-verl cluster up' "
                              "needs a SLURM profile")
        if first.scheduler != self.runs_profiles:
            raise ConfigError(f"profile {first.name} uses scheduler '{first.scheduler}'; the {self.scheduler} "
                              f"backend runs '{self.runs_profiles}' profiles")
        self.check_inputs(job)
        sets = list(request.sets)
        if not request.hold:  # the job's own size asks for the allocation (job_size)
            from hpc_verl.launch.spec.job_size import size_sets
            sets += size_sets(first, job, request.sets)
        sets += self.profile_sets(first, request.sets)
        job_dir = registry.new_job_dir(job.name)
        try:
            profile = _load_profile(request.profile, [*sets, f"paths.job_root={job_dir}"])
            job_id = self.new_job_id(profile)
            plan = build_plan(profile, job, hold=request.hold, job_id=job_id)
            script_path = job_dir / "script.sbatch"
            atomic_write_text(script_path, plan.script, mode=0o700)
            atomic_write_json(job_dir / "profile.json", profile.to_dict())
            atomic_write_json(job_dir / "job_config.json", job.to_dict())
            rec = JobRecord(name=job.name, job_dir=str(job_dir), profile=profile.name, script=str(script_path),
                            slurm_conf=os.environ.get("SLURM_CONF"), dry_run=True, scheduler=self.scheduler,
                            submit_dir=os.getcwd(), role=registry.ROLE_CLUSTER if request.hold else registry.ROLE_JOB)
            if job_id is not None:
                set_run_paths(rec, job_id, submitted=False)
                rec.batch_log = self.batch_log(rec)
            rec.save()
        except BaseException:
            shutil.rmtree(job_dir, ignore_errors=True)  # nothing half-written in the registry
            raise
        return DryRun(self.scheduler, rec, plan.summary(), files=[("script", str(script_path))],
                      by_hand=self.by_hand(rec), request=request, payload=plan)

    def report(self, record: JobRecord) -> list[str]:
        return [f"submitted job {record.job_id} ({record.name}, profile {record.profile})",
                f"job directory: {record.job_dir}", f"run directory: {record.run_dir}",
                f"logs: {record.batch_log} and {record.log_dir}/node-<node>.log",
                f"follow: hpc-verl logs {record.job_id} --follow"]

    def _logs(self, record: JobRecord, node: Optional[str], follow: bool, out: TextIO) -> int:
        log = Path(record.log_dir) / f"node-{node}.log" if node else Path(record.batch_log)
        if node and not log.exists():
            known = sorted(p.stem[len("node-"):] for p in Path(record.log_dir).glob("node-*.log"))
            raise JobNotFoundError(f"job {self.ref(record)}: no log for node '{node}' in {record.log_dir}; "
                                   f"nodes with logs: {', '.join(known) or 'none yet'}")
        pos = 0
        while True:
            if log.exists():
                with open(log, "rb") as fh:
                    fh.seek(pos)
                    chunk = fh.read()
                    pos += len(chunk)
                out.write(chunk.decode(errors="replace"))
                out.flush()
            if not follow:
                return 0
            info = self.describe(record)
            if info.terminal or info.state is JobState.UNKNOWN:
                if log.exists() and log.stat().st_size > pos:
                    continue
                return 0
            time.sleep(0.5)

    def _status_details(self, record: JobRecord, info: JobInfo) -> Mapping[str, Any]:
        record.refresh_from_ray()
        head: dict[str, Any] = {}
        try:
            head = json.loads((Path(record.run_dir) / "ray" / "head.json").read_text())
        except (OSError, ValueError):
            pass
        stages = sorted(p.stem for p in (Path(record.run_dir) / "stages").glob("*.done")) if record.run_dir else []
        reason = info.reason
        if info.state is JobState.FAILED and (line := failure_line(record)) and line != info.reason:
            # the run's own first failure line says why; the scheduler's word (NonZeroExitCode) follows
            reason = line + (f" ({info.source or 'scheduler'}: {info.reason})" if info.reason else "")
        out = {"source": info.source or None, "reason": reason, "exit_code": info.exit_code,
               "restarts": info.restarts, "slurm_nodes": info.nodes, "nodes": record.nodes,
               "ray_address": head.get("address"), "ports": record.ports, "stages_done": stages,
               "job_dir": record.job_dir, "run_dir": record.run_dir, "batch_log": record.batch_log,
               "log_dir": record.log_dir}
        if record.role == registry.ROLE_CLUSTER:
            out.update(jobs_address=record.ray_address, token_file=record.token_file)
        return out

    # -------------------------------------------------------------- attach
    def attach_command(self, record: JobRecord, node: str, script: Path, command: list[str],
                       tty: bool) -> list[str]:
        """The command that runs the job's attach script on ``node``: here, for a job on this machine."""
        return ["bash", str(script), *command]

    def _attach(self, record: JobRecord, node: Optional[str], command: list[str]) -> int:
        """The job's ``attach.sh`` (written by the job itself, see templates/partials/attach.sh.j2) on
        the chosen node: its environment, the Ray address and token, the runtime's exec."""
        ref = self.ref(record)
        info = self.describe(record)
        if info.state is not JobState.RUNNING:
            then = "it has ended" if info.terminal else f"wait until it runs ('hpc-verl status {ref}')"
            raise SubmitError(f"job {ref} is {info.label}, not running: nothing to attach to; {then}")
        script = Path(record.run_dir) / "attach.sh"
        if not script.is_file():
            raise SubmitError(f"job {ref} has not written {script} yet (it does right after its validate stage; "
                              "a job from an hpc-verl before 'attach' never does); try again in a moment")
        target = pick_node(node_list(info.nodes), node, ref)
        argv = self.attach_command(record, target, script, command, sys.stdin.isatty())
        return subprocess.call(argv, env={**os.environ, **record.env()})

    def jobs_api(self, record: JobRecord) -> tuple[str, str]:
        """A cluster job's Ray Jobs address and token file (``ray/cluster.json``), or why it has none yet."""
        from hpc_verl.bootstrap.raydir import read_cluster_info

        info = read_cluster_info(record.run_dir or record.job_dir) if self.holds_clusters else None
        if info is None:
            if not self.holds_clusters or record.role != registry.ROLE_CLUSTER:
                return super().jobs_api(record)
            state = self.describe(record).label
            raise SubmitError(f"cluster job {self.ref(record)} has no Ray Jobs API yet ({self.scheduler} state "
                              f"{state}); wait for 'hpc-verl cluster up' to print the address, or start a new one")
        return info["address"], info["token_file"]


def failure_line(record: JobRecord) -> str:
    """The run's first failure line (``$HPCV_FAILURE_FILE`` in the run directory), if it wrote one."""
    from hpc_verl.errors import FAILURE_FILE_NAME

    if not record.run_dir:
        return ""
    try:
        return (Path(record.run_dir) / FAILURE_FILE_NAME).read_text().strip().splitlines()[0]
    except (OSError, IndexError):
        return ""


def set_run_paths(record: JobRecord, job_id: int, batch_log: Optional[str] = None, submitted: bool = True) -> None:
    """The record of a script job with its id: run directory, logs (saved once ``submitted``)."""
    record.job_id = job_id
    record.run_dir = str(Path(record.job_dir) / f"{record.name}-{job_id}")
    record.log_dir = str(Path(record.run_dir) / "logs")
    record.batch_log = batch_log or str(Path(record.job_dir) / f"{record.name}-{job_id}.out")
    if submitted:
        record.dry_run = False
        record.save()


def node_list(nodes: str) -> list[str]:
    """A job's nodes, head first (SLURM's order: the batch script's head is the first of them)."""
    from hpc_verl.bootstrap.hostlist import expand_hostlist

    return expand_hostlist(nodes) if nodes and nodes != "(null)" else []


def pick_node(nodes: list[str], node: Optional[str], ref: str) -> str:
    """``node``: None (the head), an index into ``nodes`` (0 = head) or a node's name."""
    if not nodes:
        raise SubmitError(f"job {ref}: the scheduler names no node of it yet; try again in a moment")
    if node is None:
        return nodes[0]
    if node in nodes:
        return node
    if node.isdigit() and int(node) < len(nodes):
        return nodes[int(node)]
    listed = ", ".join(f"{i}: {n}" for i, n in enumerate(nodes))
    raise JobNotFoundError(f"job {ref} has no node '{node}'; --node takes an index or a name ({listed}; 0 is the head)")
