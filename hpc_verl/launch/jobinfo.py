"""One job-state record for every backend that runs a batch script (SLURM, this machine).

``hpc-verl status``/``list``/``logs --follow`` read the same fields whichever backend
ran the job; each backend fills them from its own source (squeue/scontrol, or the
local registry record and /proc).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# SLURM's final states, plus LOST: a local job whose process is gone without an exit status.
TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                             "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "LOST"})


@dataclass
class JobInfo:
    """What the backend says about one job."""

    state: str
    reason: str = ""
    nodes: str = ""
    exit_code: str = ""
    restarts: int = 0
    source: str = ""  # where the state came from: squeue, scontrol, local
    job_id: Optional[int] = None
    raw: dict[str, str] = field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES
