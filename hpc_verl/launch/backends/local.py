"""The local backend: ``hpc-verl submit --profile local`` runs the job's script on this machine.

The script is the same one the launcher renders for SLURM (profile ``local``:
scheduler local, no container, loopback Ray), run by ``bash`` under the job's
supervisor (``backends/supervisor.py``), the one owner of the job's processes.
Foreground (default): the submit follows the job's log on the terminal and returns
its exit status; SIGINT, SIGTERM or SIGHUP to it (Ctrl-C, a CI timeout, a closed ssh
session) stop the job, which ends CANCELLED with nothing left. ``--detach``: the
submit returns at once, and ``hpc-verl list/status/logs/cancel`` work as for SLURM jobs.

A local job's id is fixed when it is submitted (rendered into its script), so its run
directory ``<job dir>/<name>-<id>`` stays the same: running the script again, or
``hpc-verl submit --resume JOB``, continues from its last checkpoint and skips the
stages that finished. A job asked to stop with SIGUSR2 checkpoints and ends PREEMPTED.
"""
from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import IO, Any, Optional, Sequence

from hpc_verl.errors import ConfigError, Stopped, SubmitError, install_stop_signals
from hpc_verl.launch import registry
from hpc_verl.launch.backends import supervisor as sup
from hpc_verl.launch.backends.base import DryRun, JobInfo, JobState, SubmitRequest
from hpc_verl.launch.backends.script import ScriptBackend, failure_line
from hpc_verl.util import procs
from hpc_verl.util.package import PACKAGE_DIR

LOG_NAME = sup.LOG_NAME
CANCEL_GRACE_S = 60.0
FOLLOW_POLL_S = 0.1
#: ``HPC_VERL_LOCAL_JOB_ID=N`` pins the next local job's id (its run dir name, port block, Ray temp dir)
JOB_ID_ENV = "HPC_VERL_LOCAL_JOB_ID"
_ID_RANGE = (100_000, 9_999_999)


def demo_job_dict() -> dict[str, Any]:
    """The embedded default job for ``--profile local`` without ``--config`` (examples/job_local_demo.yaml).

    The tiny model (``hpc-verl make-tiny-model models/tiny``) on the shipped gsm8k sample,
    five GRPO steps on CPU: the whole pipeline in a couple of minutes.
    """
    sample = PACKAGE_DIR / "data" / "samples" / "gsm8k_sample.jsonl"
    return {
        "name": "local-demo",
        "trainer": {"module": "hpc_verl.trainer.main", "overrides": dict(DEMO_OVERRIDES)},
        "data": {"raw": str(sample), "dir": "data/gsm8k"},
        "model": {"path": "models/tiny"},
    }


DEMO_OVERRIDES: dict[str, Any] = {
    "data.max_prompt_length": 256, "data.max_response_length": 16, "data.train_batch_size": 8,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 8,
    "actor_rollout_ref.actor.optim.lr": 1.0e-4, "actor_rollout_ref.rollout.name": "hf",
    "actor_rollout_ref.rollout.n": 4, "algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": False,
    "trainer.device": "cpu", "trainer.total_epochs": 1, "trainer.total_training_steps": 5, "trainer.save_freq": 5,
    "trainer.max_actor_ckpt_to_keep": 2, "trainer.experiment_name": "local_demo",
}


def check_inputs(job: Any, cwd: str) -> None:
    """This machine is where the job runs: a missing model or raw data is one line now, not a failed job later."""
    def resolve(p: str) -> Path:
        return Path(p) if os.path.isabs(p) else Path(cwd) / p

    if job.model.path and job.model.check and not resolve(job.model.path).exists():
        raise ConfigError(f"model-check: model {job.model.path} does not exist (looked in {resolve(job.model.path)}); "
                          f"make a tiny one with 'hpc-verl make-tiny-model {job.model.path}' "
                          "or set model.path in the job config")
    if job.data.raw and not resolve(job.data.raw).exists():
        raise ConfigError(f"preprocess: raw data {job.data.raw} does not exist (looked in {resolve(job.data.raw)}); "
                          "set data.raw in the job config")


def new_job_id(temp_dir_root: str) -> int:
    """A local job's id: unused in the registry and in Ray's temp dir root (``$HPC_VERL_LOCAL_JOB_ID`` pins it)."""
    taken = {j.job_id for j in registry.all_jobs()}
    pinned = os.environ.get(JOB_ID_ENV)
    if pinned:
        if not pinned.isdigit() or int(pinned) < 1:
            raise ConfigError(f"{JOB_ID_ENV}={pinned!r}: expected a positive integer")
        if int(pinned) in taken:
            raise ConfigError(f"{JOB_ID_ENV}={pinned}: a job in the registry already has that id; unset it or "
                              "pick another")
        return int(pinned)
    rng = random.SystemRandom()
    while True:
        job_id = rng.randint(*_ID_RANGE)
        if job_id not in taken and not (Path(temp_dir_root) / str(job_id)).exists():
            return job_id


# ---------------------------------------------------------------------------- running
class _Terminal:
    """Our stdout, until it goes away (a closed terminal or pipe): then the job's log is all there is."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out: IO[bytes] | None = out

    def write(self, chunk: bytes) -> None:
        if self.out is None:
            return
        try:
            self.out.write(chunk)
            self.out.flush()
        except (OSError, ValueError):
            self.out = None


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _copy_new(log: Path, pos: int, out: _Terminal) -> int:
    try:
        with open(log, "rb") as fh:
            fh.seek(pos)
            chunk = fh.read()
    except FileNotFoundError:
        return pos
    if chunk:
        out.write(chunk)
    return pos + len(chunk)


def run_foreground(rec: registry.JobRecord) -> int:
    """Run the job under its supervisor and follow its log here; returns its exit status.

    A stop signal (SIGINT, SIGTERM, SIGHUP) is passed on to the job once; the job's clean-up
    runs to its end (a second signal does not skip it), then this returns."""
    install_stop_signals()
    extra: dict[str, str] = {}
    if sys.stdout.isatty():
        import shutil

        extra = {"FORCE_COLOR": os.environ.get("FORCE_COLOR", "1"),   # rich keeps its live progress in the log
                 "COLUMNS": os.environ.get("COLUMNS", str(shutil.get_terminal_size().columns))}
    log = Path(rec.job_dir) / LOG_NAME
    pos = log.stat().st_size if log.exists() else 0
    out = _Terminal(sys.stdout.buffer)
    proc = sup.spawn(rec, extra)
    stopping = False
    while True:
        try:
            pos = _copy_new(log, pos, out)
            if proc.poll() is not None:
                _copy_new(log, pos, out)
                break
            time.sleep(FOLLOW_POLL_S)
        except (KeyboardInterrupt, Stopped) as exc:
            signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
            if stopping:
                continue
            stopping = True
            signal.signal(signal.SIGINT, lambda *_: None)   # the clean-up runs to its end
            name = signal.Signals(signum).name
            _say(f"\nhpc-verl: got {name}: stopping local job {rec.job_id}; its clean-up stops the trainer and "
                 "Ray (a second signal does not skip it)")
            with sup.updating(rec.job_dir) as cur:
                cur.cancelled = True
                cur.stop_reason = f"{name} to hpc-verl submit"
            try:
                os.kill(proc.pid, signum)
            except ProcessLookupError:
                pass
    _settle(rec.job_dir, signal.SIGTERM if stopping else signal.SIGKILL)   # (only if it could not record the end)
    final = registry.load(rec.job_dir)
    rec.__dict__.update(final.__dict__)
    return int(final.exit_code or 0)


def run_detached(rec: registry.JobRecord, timeout_s: float = 30.0) -> registry.JobRecord:
    """Start the supervisor in its own session; return once it started the script."""
    proc = sup.spawn(rec)
    cur = sup.wait_started(rec, proc, timeout_s)
    if cur is None:
        raise SubmitError(f"local job {rec.job_dir} did not start: {sup.supervisor_error(rec)}")
    return cur


def _settle(job_dir: str, signum: int) -> list[int]:
    """After the supervisor is gone: if it could not record the end (it was killed), end what is
    left of the job (its script's tree, its marked processes, Ray temp dirs) and record it."""
    cur = registry.load(job_dir)
    if cur.exit_code is not None:
        return []
    pids = set(sup.marked_pids(job_dir))
    if sup.runs(cur.pid, job_dir):
        pids |= {cur.pid, *procs.descendants(cur.pid)}
    procs.end_pids(sorted(pids), grace_s=10.0)
    sup.remove_ray_temp_dirs(job_dir)
    with sup.updating(job_dir) as rec:
        if rec.exit_code is None:
            rec.exit_code = 128 + signum
            rec.stop_reason = rec.stop_reason or "its supervisor was killed"
            rec.cancelled = rec.cancelled or signum == signal.SIGTERM
    return sorted(pids)


# ---------------------------------------------------------------------------- job ops
def requeue_exit_code(rec: registry.JobRecord) -> int:
    """The job's "checkpointed, stopped, resume me" exit status (the profile may set its own)."""
    from hpc_verl.errors import REQUEUE_EXIT_CODE

    text = str(sup.profile_of(rec).get("env", {}).get("vars", {}).get("HPC_VERL_REQUEUE_EXIT_CODE", ""))
    return int(text) if text.isdigit() else REQUEUE_EXIT_CODE


def _checkpoint_step(rec: registry.JobRecord) -> str:
    try:
        return (sup.trainer_dir(rec) / "latest_checkpointed_iteration.txt").read_text().strip()
    except OSError:
        return "?"


def info(rec: registry.JobRecord) -> JobInfo:
    host = os.uname().nodename
    if rec.exit_code is not None:
        rc = rec.exit_code
        if rec.cancelled:
            state, why = JobState.CANCELLED, rec.stop_reason
        elif rc == 0:
            state, why = JobState.COMPLETED, ""
        elif rc == requeue_exit_code(rec):
            state = JobState.PREEMPTED
            why = (f"checkpointed at step {_checkpoint_step(rec)}; continue with 'hpc-verl submit --resume "
                   f"{rec.job_id}' or 'bash {rec.script}'")
        else:
            state, why = JobState.FAILED, failure_line(rec) or rec.stop_reason or f"exit status {rc}"
        return JobInfo(state, reason=why, exit_code=f"{rc}", nodes=host, source="local", job_id=rec.job_id)
    if sup.runs(rec.supervisor_pid, rec.job_dir) or sup.runs(rec.pid, rec.job_dir):
        return JobInfo(JobState.RUNNING, nodes=host, source="local", job_id=rec.job_id)
    return JobInfo(JobState.LOST, reason="the job's process ended without recording its exit status",
                   source="local", job_id=rec.job_id)


def cancel(rec: registry.JobRecord, grace_s: float = CANCEL_GRACE_S) -> str:
    """SIGTERM to the job's supervisor (it passes it to the script, whose trap stops the trainer and
    Ray, then ends whatever of the job is left); waits until the end is recorded."""
    with sup.updating(rec.job_dir) as cur:
        if cur.exit_code is not None:
            return f"job {cur.job_id} already ended ({info(cur).state}, exit status {cur.exit_code})"
        cur.cancelled = True
        cur.stop_reason = cur.stop_reason or "hpc-verl cancel"
    target = cur.supervisor_pid if sup.runs(cur.supervisor_pid, cur.job_dir) else cur.pid
    if sup.runs(target, cur.job_dir):
        os.kill(target, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and registry.load(cur.job_dir).exit_code is None and (
            sup.runs(cur.supervisor_pid, cur.job_dir) or sup.runs(cur.pid, cur.job_dir)):
        time.sleep(0.2)
    forced = _settle(cur.job_dir, signal.SIGTERM)
    end = registry.load(cur.job_dir)
    return (f"cancelled job {end.job_id}: {info(end).state}, exit status {end.exit_code}"
            + (f" ({len(forced)} processes had to be killed)" if forced else ""))


def results(rec: registry.JobRecord) -> list[str]:
    """Lines for the person at the terminal: where the run's results are."""
    d = sup.trainer_dir(rec)
    lines = [f"run directory: {rec.run_dir}", f"log: {rec.batch_log}"]
    if (d / "metrics.jsonl").exists():
        lines.append(f"metrics: {d / 'metrics.jsonl'}")
    if (d / "curves.png").exists():
        lines.append(f"plot: {d / 'curves.png'}")
    ckpts = sorted(d.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]) if
                   p.name.rsplit("_", 1)[1].isdigit() else -1)
    if ckpts:
        lines.append(f"checkpoint: {ckpts[-1]}")
    return lines


# ---------------------------------------------------------------------------- the backend
def _local_python_set(profile: Any, sets: Sequence[str]) -> list[str]:
    """A local job runs with the interpreter running hpc-verl, unless the profile or --set names one."""
    if any(s.startswith("ray.python=") for s in sets) or profile.ray.python != "python3":
        return []
    return [f"ray.python={sys.executable}"]


class LocalBackend(ScriptBackend):
    """Jobs of ``scheduler: local`` profiles: the script runs here, in the foreground or detached."""

    scheduler = "local"
    runs_profiles = "local"
    resumes = True

    def job_config(self, request: SubmitRequest) -> Any:
        """``--profile local`` without ``--config`` runs the embedded demo job (newcomers start there)."""
        from hpc_verl.launch.spec.jobconfig import job_from_dict, load_job_config

        if request.config is not None or request.command or Path(request.profile or "").stem != "local":
            return super().job_config(request)
        job = job_from_dict(demo_job_dict(), "(built-in local demo job)")
        if request.overrides:
            job.trainer.overrides.update(load_job_config(None, list(request.overrides)).trainer.overrides)
        return job

    def check_inputs(self, job: Any) -> None:
        check_inputs(job, os.getcwd())

    def profile_sets(self, profile: Any, sets: Sequence[str]) -> list[str]:
        return _local_python_set(profile, sets)

    def new_job_id(self, profile: Any) -> Optional[int]:
        return new_job_id(profile.ray.temp_dir_root)

    def batch_log(self, record: registry.JobRecord) -> str:
        return str(Path(record.job_dir) / LOG_NAME)

    def by_hand(self, record: registry.JobRecord) -> str:
        return f"bash {record.script}"

    def dryrun(self, request: SubmitRequest) -> DryRun:
        if request.resume:
            return self._resume(request)
        return super().dryrun(request)

    def _resume(self, request: SubmitRequest) -> DryRun:
        """The job of ``--resume`` as it was submitted, to run again in its own run directory."""
        if (request.config or request.overrides or request.command or request.sets or request.name or request.profile
                or request.ray_address or request.cluster):
            raise ConfigError("--resume JOB runs that job again as it was submitted; leave out --profile, --config, "
                              "--set, --name, --ray-address, --cluster and overrides (or submit a new job)")
        rec = registry.find(str(request.resume))
        state = info(rec) if not rec.dry_run else JobInfo(JobState.DRY_RUN)
        if not state.terminal and state.state is not JobState.DRY_RUN:
            raise SubmitError(f"job {rec.job_id} is {state.state}; wait for it or 'hpc-verl cancel {rec.job_id}' "
                              "before resuming it")
        if not rec.job_id or not rec.script or not Path(rec.script).is_file():
            raise SubmitError(f"job {Path(rec.job_dir).name} has no script to run again ({rec.script or 'none'}); "
                              "submit a new job")
        step = _checkpoint_step(rec)
        where = f"from its checkpoint at step {step}" if step != "?" else "from the start (no checkpoint yet)"
        return DryRun(self.scheduler, rec, f"resume   local job {rec.job_id} in {rec.run_dir}, {where}",
                      files=[("script", rec.script)], by_hand=self.by_hand(rec), request=request)

    def submit(self, dry: DryRun) -> registry.JobRecord:
        if dry.request.resume:   # (not in dryrun: `--resume JOB --dry-run` leaves the record as it was)
            with sup.updating(dry.record.job_dir) as cur:
                cur.exit_code = None
                cur.cancelled = False
                cur.stop_reason = ""
                cur.supervisor_pid = None
            dry.record.__dict__.update(cur.__dict__)
        if dry.request.detach:
            return run_detached(dry.record)
        run_foreground(dry.record)
        return dry.record

    def report(self, record: registry.JobRecord) -> list[str]:
        if record.exit_code is None:
            return [f"started local job {record.job_id} ({record.name}) in the background",
                    f"run directory: {record.run_dir}",
                    f"follow: hpc-verl logs {record.job_id} --follow    stop: hpc-verl cancel {record.job_id}"]
        state = info(record)
        why = f": {state.reason}" if state.reason else ""
        return [f"local job {record.job_id} ({record.name}): {state.state}, exit status {record.exit_code}{why}",
                *results(record)]

    def _describe(self, record: registry.JobRecord) -> JobInfo:
        return info(record)

    def _cancel(self, record: registry.JobRecord) -> str:
        return cancel(record)
