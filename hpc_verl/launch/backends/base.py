"""The one interface every backend implements, and the vocabulary they share.

A backend is where a job runs: SLURM (``slurm.py``), this machine (``local.py``),
a running Ray cluster through its Jobs API (``rayjobs.py``). The CLI, the Python
API and held clusters only ever talk to :class:`Backend`:

- ``dryrun(request) -> DryRun``: everything but the submission. Inputs are
  checked, the job directory and its registry record are written, and the result
  says what would run (``hpc-verl submit --dry-run`` prints it);
- ``submit(dry) -> JobRecord``: send exactly that; the record gets the job id;
- ``describe(record) -> JobInfo``, ``logs(record, node, follow)``,
  ``cancel(record)``, ``attach(record, node, command)``: operations on a
  registered job, chosen by the record's ``scheduler`` (``backends.for_record``).

Backends are registered by name in ``backends/__init__.py``; the pattern is
torchx's ``Scheduler`` (``submit_dryrun`` → ``schedule``, ``describe``,
``cancel``, one ``AppState``) and submitit's template-method ``Executor``: the
base class handles what is the same everywhere (dry-run records), a backend
fills in the ``_hooks``.
"""
from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, Mapping, Optional, Sequence, TextIO

from hpc_verl.errors import JobNotFoundError, SubmitError
from hpc_verl.launch.registry import JobRecord


class JobState(str, Enum):
    """Job states of every backend, in SLURM's words (the richest vocabulary of the three).

    Ray's statuses map onto it (SUCCEEDED → COMPLETED, STOPPED → CANCELLED), a local
    job uses RUNNING/COMPLETED/FAILED/CANCELLED/LOST. ``GONE``: the scheduler no longer
    knows the job (SLURM purged its record), ``UNKNOWN``: a word we do not know (the
    backend's own word is kept in ``JobInfo.native``), ``DRY_RUN``: never submitted.
    """

    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    SUSPENDED = "SUSPENDED"
    STOPPED = "STOPPED"
    SIGNALING = "SIGNALING"
    STAGE_OUT = "STAGE_OUT"
    RESIZING = "RESIZING"
    REQUEUED = "REQUEUED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    REQUEUE_FED = "REQUEUE_FED"
    RESV_DEL_HOLD = "RESV_DEL_HOLD"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    REVOKED = "REVOKED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    LOST = "LOST"
    GONE = "GONE"
    UNKNOWN = "UNKNOWN"
    DRY_RUN = "DRY-RUN"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def terminal(self) -> bool:
        """The job ended (``logs --follow`` stops, ``cancel`` has nothing to do)."""
        return self in _TERMINAL

    @classmethod
    def of(cls, word: str) -> "JobState":
        """The member for a backend's word; UNKNOWN for a word not in the vocabulary."""
        try:
            return cls(str(word).strip().upper())
        except ValueError:
            return cls.UNKNOWN


_TERMINAL = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT,
                       JobState.NODE_FAIL, JobState.PREEMPTED, JobState.OUT_OF_MEMORY, JobState.BOOT_FAIL,
                       JobState.DEADLINE, JobState.LOST, JobState.GONE})


@dataclass
class JobInfo:
    """What a backend says about one job, in the shared vocabulary."""

    state: JobState
    reason: str = ""
    nodes: str = ""
    exit_code: str = ""
    restarts: int = 0
    source: str = ""  # where the state came from: squeue, scontrol, local, ray, registry
    job_id: Any = None
    native: str = ""  # the backend's own word for the state (Ray's JobStatus, an unknown SLURM word)
    raw: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)  # backend-specific fields for `hpc-verl status`

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    @property
    def label(self) -> str:
        """The state for a person: ``RUNNING``; ``UNKNOWN (why)`` when there is a why."""
        why = self.reason or self.native
        return f"{self.state} ({why})" if self.state is JobState.UNKNOWN and why else str(self.state)


@dataclass
class SubmitRequest:
    """What a person asked to run and where: ``hpc-verl submit``'s flags, or the Python API's arguments."""

    profile: Optional[str] = None
    config: Optional[str] = None
    overrides: Sequence[str] = ()
    sets: Sequence[str] = ()
    command: Sequence[str] = ()    # the trainer command given after `--` (python3 -m MODULE ARGS...)
    name: Optional[str] = None
    ray_address: Optional[str] = None
    ray_token_file: Optional[str] = None
    cluster: Optional[str] = None  # a held cluster (`hpc-verl cluster up`) to submit into
    detach: bool = False           # local: run in the background
    hold: bool = False             # a cluster job that keeps Ray up instead of training
    resume: Optional[str] = None   # a registered job to run again in its own run directory


@dataclass
class DryRun:
    """What a backend would submit: checked, written to the job directory, not sent.

    Every backend returns one; ``str()`` is what ``--dry-run`` prints and ``submit``
    sends exactly ``payload``.
    """

    scheduler: str
    record: JobRecord
    summary: str                                   # what will run, one aspect per line
    files: list[tuple[str, str]] = field(default_factory=list)  # (what, path) written to the job directory
    by_hand: str = ""                              # how to submit it without hpc-verl, when there is a way
    request: SubmitRequest = field(default_factory=SubmitRequest)
    payload: Any = field(default=None, repr=False)  # backend-private: what submit() sends

    def lines(self) -> list[str]:
        out = [f"dry run ({self.scheduler}): job directory {self.record.job_dir}"]
        out += [f"{what}: {path}" for what, path in self.files]
        if self.by_hand:
            out.append(f"submit with: {self.by_hand}")
        return out + self.summary.splitlines()

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler, "job_dir": self.record.job_dir, "files": dict(self.files),
                "by_hand": self.by_hand, "summary": self.summary}


class Backend(ABC):
    """Where jobs run. Subclasses set ``scheduler`` and implement the ``_hooks``."""

    scheduler: ClassVar[str]
    """The name in ``JobRecord.scheduler`` and in the registry (``backends.BACKENDS``)."""
    resumes: ClassVar[bool] = False
    """Whether ``submit --resume JOB`` can run a job of this backend again (``dryrun`` gets the request)."""

    # -------------------------------------------------------------- submission
    @abstractmethod
    def accepts(self, request: SubmitRequest) -> bool:
        """True when this backend is the one to run ``request`` (``backends.for_request`` asks each)."""

    @abstractmethod
    def dryrun(self, request: SubmitRequest) -> DryRun:
        """Check everything, write the job directory and its record (``dry_run=True``); send nothing."""

    @abstractmethod
    def submit(self, dry: DryRun) -> JobRecord:
        """Send what ``dry`` describes; returns its record with the job id set."""

    def report(self, record: JobRecord) -> list[str]:
        """Lines for the person after ``submit``: what was submitted, where to look, how to follow."""
        return [f"submitted job {record.job_id} ({record.name}, profile {record.profile})",
                f"job directory: {record.job_dir}", f"follow: hpc-verl logs {self.ref(record)} --follow"]

    # -------------------------------------------------------------- a registered job
    def ref(self, record: JobRecord) -> str:
        """How the person names the job (`hpc-verl status REF`): its id, else its directory's name."""
        for ref in (record.job_id, record.submission_id):
            if ref is not None:
                return str(ref)
        return Path(record.job_dir).name

    def describe(self, record: JobRecord) -> JobInfo:
        """The job's state now (a dry run's is DRY_RUN)."""
        if record.dry_run:
            return JobInfo(JobState.DRY_RUN, source="registry")
        return self._describe(record)

    def list_state(self, record: JobRecord) -> str:
        """The state for a `hpc-verl list` row (a backend may turn its failures into UNKNOWN (why))."""
        return self.describe(record).label

    def status(self, record: JobRecord) -> dict[str, Any]:
        """Everything `hpc-verl status` shows: the shared fields, then the backend's own."""
        info = self.describe(record)
        return {"job_id": record.job_id if record.job_id is not None else record.submission_id,
                "name": record.name, "profile": record.profile, "kind": record.scheduler, "state": info.label,
                **self._status_details(record, info)}

    def logs(self, record: JobRecord, node: Optional[str] = None, follow: bool = False,
             out: Optional[TextIO] = None) -> int:
        """Print the job's log (``node``: one node's); ``follow`` until the job ends. Returns an exit status."""
        if record.dry_run:
            raise JobNotFoundError(f"job {self.ref(record)} was a dry run; it has no logs")
        return self._logs(record, node, follow, out or sys.stdout)

    def cancel(self, record: JobRecord) -> str:
        """Stop the job; returns a one-line outcome."""
        if record.dry_run:
            raise SubmitError(f"job {self.ref(record)} was a dry run; nothing to cancel")
        return self._cancel(record)

    def attach(self, record: JobRecord, node: Optional[str] = None, command: Sequence[str] = ()) -> int:
        """Run ``command`` (default: an interactive shell) inside the running job, on its head node or
        ``node`` (an index, 0 = head, or a name), with the job's environment (RAY_ADDRESS, its token
        variables); returns the command's exit status."""
        if record.dry_run:
            raise JobNotFoundError(f"job {self.ref(record)} was a dry run; there is nothing to attach to")
        return self._attach(record, node, list(command))

    def jobs_api(self, record: JobRecord) -> tuple[str, str]:
        """(Ray Jobs address, token file) of a job that holds a Ray cluster (``hpc-verl cluster up``)."""
        raise SubmitError(f"job {self.ref(record)} ({self.scheduler}) holds no Ray cluster; "
                          "start one with 'hpc-verl cluster up --profile NAME --nodes N'")

    # -------------------------------------------------------------- hooks
    @abstractmethod
    def _describe(self, record: JobRecord) -> JobInfo: ...

    @abstractmethod
    def _logs(self, record: JobRecord, node: Optional[str], follow: bool, out: TextIO) -> int: ...

    @abstractmethod
    def _cancel(self, record: JobRecord) -> str: ...

    def _status_details(self, record: JobRecord, info: JobInfo) -> Mapping[str, Any]:
        return info.details

    def _attach(self, record: JobRecord, node: Optional[str], command: list[str]) -> int:
        raise SubmitError(f"job {self.ref(record)} ({self.scheduler}) cannot be attached to")
