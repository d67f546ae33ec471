"""The local backend: ``hpc-verl submit --profile local`` runs the job's script on this machine.

The script is the same one the launcher renders for SLURM (profile ``local``:
scheduler local, no container, loopback Ray), run with ``bash`` in its own
session. Foreground (default): its output streams to the terminal and to the
job's log, and the submit returns its exit status. ``--detach``: a small
supervisor (``python -m hpc_verl.launch.backends.local supervise JOB_DIR``) runs it in
the background and records the exit status, so ``hpc-verl list/status/logs/cancel``
work as for SLURM jobs. Every process of the job carries ``HPCV_LOCAL_JOB=<job
dir>`` in its environment; ``cancel`` uses that to leave nothing behind.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, Sequence

from hpc_verl.errors import ConfigError, SubmitError
from hpc_verl.launch import registry
from hpc_verl.launch.backends.base import DryRun, JobInfo, JobState, SubmitRequest
from hpc_verl.launch.backends.script import ScriptBackend
from hpc_verl.util.package import PACKAGE_DIR, with_package_on_pythonpath

MARKER_ENV = "HPCV_LOCAL_JOB"
SUPERVISOR = "hpc_verl.launch.backends.local"  # python -m SUPERVISOR supervise JOB_DIR
LOG_NAME = "job.log"
CANCEL_GRACE_S = 60.0
# SLURM variables the script would take for its own (job id, submit dir, restart count, CPUs)
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_SUBMIT_DIR", "SLURM_RESTART_COUNT", "SLURM_CPUS_PER_TASK",
               "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS")


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


def job_env(rec: registry.JobRecord, cpus: int) -> dict[str, str]:
    """The script's environment: ours, minus SLURM's job variables, plus the job marker."""
    env = with_package_on_pythonpath({k: v for k, v in os.environ.items() if k not in _SLURM_VARS})
    env[MARKER_ENV] = rec.job_dir
    env.setdefault("HPCV_RAY_NUM_CPUS", str(cpus))
    return env


def _start(rec: registry.JobRecord, out: int | IO[bytes], *, new_session: bool) -> subprocess.Popen:
    prof_cpus = int(_profile(rec).get("slurm", {}).get("cpus_per_task") or 0)
    proc = subprocess.Popen(["bash", rec.script], cwd=rec.submit_dir or None, env=job_env(rec, prof_cpus),
                            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=new_session)
    rec.pid = proc.pid
    rec.job_id = proc.pid  # the script's $$: its HPCV_JOB_ID and run directory name
    rec.run_dir = str(Path(rec.job_dir) / f"{rec.name}-{proc.pid}")
    rec.log_dir = str(Path(rec.run_dir) / "logs")
    rec.batch_log = str(Path(rec.job_dir) / LOG_NAME)
    rec.dry_run = False
    rec.save()
    return proc


def _profile(rec: registry.JobRecord) -> dict[str, Any]:
    import json

    try:
        return json.loads((Path(rec.job_dir) / "profile.json").read_text())
    except (OSError, ValueError):
        return {}


def reap(job_dir: str, grace_s: float = 30.0) -> int:
    """Wait for the job's last processes (Ray stops a few seconds after the script), then SIGKILL the rest.

    Returns how many had to be killed."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and job_pids(job_dir):
        time.sleep(0.2)
    left = job_pids(job_dir)
    for pid in left:
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and job_pids(job_dir):
        time.sleep(0.1)
    return len(left)


def _finish(rec: registry.JobRecord, rc: int) -> None:
    if rc < 0:  # killed by a signal: the shell's convention, 128 + signal number
        rc = 128 - rc
    killed = reap(rec.job_dir)
    if killed:
        print(f"hpc-verl: killed {killed} processes the job left behind", file=sys.stderr)
    rec.exit_code = rc
    rec.save()
    if rc == 0:
        try:
            make_plot(rec)
        except Exception as exc:  # a plot is a nicety; the run's results are already there
            print(f"hpc-verl: warning: no plot: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)


def trainer_dir(rec: registry.JobRecord) -> Path:
    """Where the built-in trainer wrote metrics.jsonl and its checkpoints (trainer.default_local_dir)."""
    return Path(rec.run_dir) / "checkpoints"


def make_plot(rec: registry.JobRecord) -> Path | None:
    d = trainer_dir(rec)
    if not (d / "metrics.jsonl").exists():
        return None
    from hpc_verl.trainer.metrics import plot_run

    return Path(plot_run(d))


def run_foreground(rec: registry.JobRecord) -> int:
    """Run the script here, its output to our stdout and the job log; return its exit status."""
    env_tty = sys.stdout.isatty()
    if env_tty:
        import shutil

        os.environ.setdefault("FORCE_COLOR", "1")  # rich keeps its live progress through our pipe
        os.environ.setdefault("COLUMNS", str(shutil.get_terminal_size().columns))
    with open(Path(rec.job_dir) / LOG_NAME, "ab") as log:
        proc = _start(rec, subprocess.PIPE, new_session=True)
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        out = sys.stdout.buffer
        interrupted = False
        while True:
            try:
                chunk = os.read(fd, 65536)
            except KeyboardInterrupt:  # Ctrl-C: the script's trap stops Ray and the trainer
                if not interrupted:
                    print("\nhpc-verl: interrupted; stopping the job (Ctrl-C again does not skip the cleanup)",
                          file=sys.stderr)
                interrupted = True
                _signal(proc.pid, signal.SIGTERM)
                continue
            if not chunk:
                break
            log.write(chunk)
            log.flush()
            out.write(chunk)
            out.flush()
        rc = proc.wait()
    if interrupted:
        rec.cancelled = True
    _finish(rec, rc)
    return rc


def supervise(job_dir: str) -> int:
    """The detached job's parent: start the script, wait, record the exit status."""
    rec = registry.load(job_dir)
    # a handler (not SIG_IGN, which the script would inherit): cancel signals the script itself
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)
    with open(Path(job_dir) / LOG_NAME, "ab") as log:
        proc = _start(rec, log, new_session=False)  # we are the session leader already
        while True:
            try:
                rc = proc.wait()
                break
            except InterruptedError:  # pragma: no cover (PEP 475 retries)
                continue
    rec = registry.load(job_dir)  # cancel may have marked it
    _finish(rec, rc)
    return rc


def run_detached(rec: registry.JobRecord, timeout_s: float = 30.0) -> registry.JobRecord:
    """Start the supervisor in its own session; return once it recorded the script's pid."""
    sup = subprocess.Popen([sys.executable, "-m", SUPERVISOR, "supervise", rec.job_dir],
                           cwd=rec.submit_dir or None, env=with_package_on_pythonpath(dict(os.environ)),
                           stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=open(Path(rec.job_dir) / "supervisor.err", "ab"),
                           start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cur = registry.load(rec.job_dir)
        if cur.pid:
            return cur
        if sup.poll() is not None:
            break
        time.sleep(0.1)
    err = (Path(rec.job_dir) / "supervisor.err").read_text(errors="replace").strip().splitlines()
    raise SubmitError(f"local job {rec.job_dir} did not start: {err[-1] if err else 'no pid after %.0fs' % timeout_s}")


# ---------------------------------------------------------------------------- job ops
def _is_ours(pid: int, job_dir: str) -> bool:
    """True while ``pid`` lives and belongs to this job (guards against a reused pid)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{MARKER_ENV}={job_dir}".encode() in env.split(b"\0")


def job_pids(job_dir: str) -> list[int]:
    """Every live process of this job (the script, Ray, the trainer), by its environment marker."""
    mark = f"{MARKER_ENV}={job_dir}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if mark in (d / "environ").read_bytes().split(b"\0"):
                stat = (d / "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(d.name))
        except OSError:
            continue
    return pids


def info(rec: registry.JobRecord) -> JobInfo:
    if rec.exit_code is not None:
        rc = rec.exit_code
        state = JobState.CANCELLED if rec.cancelled else (JobState.COMPLETED if rc == 0 else JobState.FAILED)
        return JobInfo(state, exit_code=f"{rc}", nodes=os.uname().nodename, source="local", job_id=rec.job_id)
    if rec.pid and _is_ours(rec.pid, rec.job_dir):
        return JobInfo(JobState.RUNNING, nodes=os.uname().nodename, source="local", job_id=rec.job_id)
    return JobInfo(JobState.LOST, reason="the job's process ended without recording its exit status",
                   source="local", job_id=rec.job_id)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def cancel(rec: registry.JobRecord, grace_s: float = CANCEL_GRACE_S) -> str:
    """SIGTERM to the script (its trap stops Ray and the trainer), then SIGKILL whatever of the job is left."""
    if rec.exit_code is not None:
        return f"job {rec.job_id} already ended (exit status {rec.exit_code})"
    rec.cancelled = True
    rec.save()
    if rec.pid and _is_ours(rec.pid, rec.job_dir):
        _signal(rec.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _is_ours(rec.pid, rec.job_dir):
            time.sleep(0.2)
    left = reap(rec.job_dir, grace_s=20.0)
    deadline = time.monotonic() + 10  # the supervisor records the exit status after its own reap
    while time.monotonic() < deadline and registry.load(rec.job_dir).exit_code is None:
        time.sleep(0.2)
    cur = registry.load(rec.job_dir)
    if cur.exit_code is None:  # the supervisor was killed too: record it ourselves
        cur.exit_code = 128 + signal.SIGTERM
        cur.cancelled = True
        cur.save()
    return f"cancelled job {rec.job_id}" + (f" ({len(left)} leftover processes killed)" if left else "")


def results(rec: registry.JobRecord) -> list[str]:
    """Lines for the person at the terminal: where the run's results are."""
    d = trainer_dir(rec)
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

    def job_config(self, request: SubmitRequest) -> Any:
        """``--profile local`` without ``--config`` runs the embedded demo job (newcomers start there)."""
        from hpc_verl.launch.spec.jobconfig import job_from_dict, load_job_config

        if request.config is not None or Path(request.profile or "").stem != "local":
            return super().job_config(request)
        job = job_from_dict(demo_job_dict(), "(built-in local demo job)")
        if request.overrides:
            job.trainer.overrides.update(load_job_config(None, list(request.overrides)).trainer.overrides)
        return job

    def check_inputs(self, job: Any) -> None:
        check_inputs(job, os.getcwd())

    def profile_sets(self, profile: Any, sets: Sequence[str]) -> list[str]:
        return _local_python_set(profile, sets)

    def by_hand(self, record: registry.JobRecord) -> str:
        return f"bash {record.script}"

    def submit(self, dry: DryRun) -> registry.JobRecord:
        if dry.request.detach:
            return run_detached(dry.record)
        run_foreground(dry.record)
        return dry.record

    def report(self, record: registry.JobRecord) -> list[str]:
        if record.exit_code is None:
            return [f"started local job {record.job_id} ({record.name}) in the background",
                    f"run directory: {record.run_dir}",
                    f"follow: hpc-verl logs {record.job_id} --follow    stop: hpc-verl cancel {record.job_id}"]
        return [f"local job {record.job_id} ({record.name}): {info(record).state}, exit status {record.exit_code}",
                *results(record)]

    def _describe(self, record: registry.JobRecord) -> JobInfo:
        return info(record)

    def _cancel(self, record: registry.JobRecord) -> str:
        return cancel(record)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "supervise":
        print(f"usage: python -m {SUPERVISOR} supervise JOB_DIR", file=sys.stderr)
        return 2
    return supervise(args[1])


if __name__ == "__main__":
    sys.exit(main())
