"""Preemption: SIGUSR2 or the launcher's preempt file asks the trainer to checkpoint and
exit with the requeue code (``hpc_verl.errors.REQUEUE_EXIT_CODE``). Driver; no torch."""
from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

PREEMPT_SIGNAL = signal.SIGUSR2


class PreemptionFlag:
    """Set by SIGUSR2 or by the launcher's preempt file; polled at step boundaries only.

    Inside a job the launcher cannot signal the trainer directly (srun and container
    ``exec`` wrappers sit in between), so it also creates ``$HPCV_PREEMPT_FILE`` on the
    shared filesystem; either one asks for a checkpoint and the "requeue me" exit.
    """

    def __init__(self, preempt_file: str | os.PathLike[str] | None = None) -> None:
        self._signalled = False
        self._previous: Any = None
        path = preempt_file if preempt_file is not None else os.environ.get("HPCV_PREEMPT_FILE")
        self.preempt_file = Path(path) if path else None

    @property
    def requested(self) -> bool:
        if self._signalled:
            return True
        return self.preempt_file is not None and self.preempt_file.exists()

    def install(self) -> "PreemptionFlag":
        try:
            self._previous = signal.signal(PREEMPT_SIGNAL, self._handle)
        except ValueError:  # not the main thread: the launcher's signal cannot reach us anyway
            self._previous = None
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self._signalled = True

    def uninstall(self) -> None:
        if self._previous is not None:
            try:
                signal.signal(PREEMPT_SIGNAL, self._previous)
            except ValueError:
                pass
