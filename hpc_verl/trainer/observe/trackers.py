"""Experiment tracking the way verl users work: ``trainer.logger`` is a list of
backends, each fed the step's metrics once per step by the driver (one process,
whatever the world size), under verl's metric names.

- ``console``: the rich progress bar (``hpc_verl.progress``) or, without it, one
  line per step on stderr;
- ``file``: ``metrics.jsonl`` in the run dir (always written: resume, ``hpc-verl
  plot`` and ``hpc-verl logs --metrics`` read it; naming it is allowed);
- ``tensorboard``: event files in ``<run_dir>/tensorboard`` (torch's writer);
- ``wandb``: offline unless ``WANDB_MODE`` says otherwise (the launcher exports
  ``WANDB_MODE=offline`` and ``WANDB_DIR`` = the run dir on compute nodes), project
  and name from ``trainer.project_name`` / ``experiment_name``; sync later with
  ``wandb sync <run_dir>/wandb/offline-run-*``;
- ``mlflow``: a file store in ``<run_dir>/mlruns`` unless ``MLFLOW_TRACKING_URI``
  is set; experiment = project, run name = experiment.

A resumed run continues the same tracker run: the wandb run id and the mlflow
run id are kept in the run dir, TensorBoard reopens its directory and drops the
events after the checkpoint's step. A missing package or an unknown name is one
line (``check_loggers``), before any training starts.
"""
from __future__ import annotations

import logging
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence
from hpc_verl.util.fs import atomic_write_text


log = logging.getLogger("hpc_verl.trainer")

WANDB_ID_FILE = "wandb_run_id"
MLFLOW_ID_FILE = "mlflow_run_id"


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[k] = float(v)
    return out


class _TensorBoard:
    def __init__(self, run_dir: Path, resume_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1 if resume_step else None)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _run_id(path: Path, make: Any) -> str:
    """The tracker's run id kept in the run dir (a resumed run continues the same run)."""
    if path.is_file():
        return path.read_text().strip()
    rid = make()
    atomic_write_text(path, rid + "\n")
    return rid


class _Wandb:
    def __init__(self, run_dir: Path, cfg: Mapping[str, Any]) -> None:
        import wandb
        t = cfg["trainer"]
        run_id = _run_id(run_dir / WANDB_ID_FILE, lambda: uuid.uuid4().hex[:8])   # wandb ids: [a-z0-9]
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project=t["project_name"], name=t["experiment_name"], id=run_id, resume="allow",
                              dir=os.environ.get("WANDB_DIR") or str(run_dir),
                              mode=os.environ.get("WANDB_MODE") or "offline", config=_flat(cfg),
                              settings=wandb.Settings(console="off", x_disable_stats=True))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, run_dir: Path, cfg: Mapping[str, Any]) -> None:
        import mlflow
        t = cfg["trainer"]
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # a store in the run dir (no server needed). MLflow 3 keeps its file store in maintenance
            # mode behind an opt-in; set MLFLOW_TRACKING_URI for a database or a server instead.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").resolve().as_uri()
        self.mlflow = mlflow
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(t["project_name"])
        id_file = run_dir / MLFLOW_ID_FILE
        if id_file.is_file():
            self.run = mlflow.start_run(run_id=id_file.read_text().strip())
        else:
            self.run = mlflow.start_run(run_name=t["experiment_name"])
            atomic_write_text(id_file, self.run.info.run_id + "\n")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(mlflow_keys(metrics), step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def mlflow_keys(metrics: Mapping[str, float]) -> dict[str, float]:
    """MLflow's file store keeps a metric as a file at its key's path, so a key that is also the
    prefix of others (``timing_s/update_actor`` beside ``timing_s/update_actor/forward``) is logged
    as ``<key>/total`` there; every other backend keeps verl's names."""
    parents = {k.rsplit("/", 1)[0] for k in metrics if "/" in k}
    return {(f"{k}/total" if k in parents else k): v for k, v in metrics.items()}


class _ConsoleLines:
    """One line per step on stderr (console logger without the progress bar)."""

    KEYS = ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "critic/vf_loss", "timing_s/step",
            "perf/throughput")

    def log(self, metrics: dict[str, float], step: int) -> None:
        parts = [f"{k}:{metrics[k]:.4g}" for k in self.KEYS if k in metrics]
        print(f"step:{step} - " + " - ".join(parts), file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


class Tracking:
    """Every configured backend, fed once per step (``console`` and ``file`` are the driver's
    progress bar / line and metrics.jsonl; the others are opened here)."""

    def __init__(self, names: Sequence[str], run_dir: str | os.PathLike[str], cfg: Mapping[str, Any],
                 resume_step: int = 0, progress_bar: bool = True) -> None:
        self.names = list(names)
        rd = Path(run_dir)
        self.backends: dict[str, Any] = {}
        try:
            if "console" in self.names and not progress_bar:
                self.backends["console"] = _ConsoleLines()
            if "tensorboard" in self.names:
                self.backends["tensorboard"] = _TensorBoard(rd, resume_step)
            if "wandb" in self.names:
                self.backends["wandb"] = _Wandb(rd, cfg)
            if "mlflow" in self.names:
                self.backends["mlflow"] = _Mlflow(rd, cfg)
        except BaseException:
            self.close()
            raise

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        numbers = _numbers(metrics)
        for name, backend in self.backends.items():
            try:
                backend.log(numbers, step)
            except Exception as exc:  # noqa: BLE001 - a tracker must never stop training
                log.warning("logger %s: %s: %s (step %d not recorded there)", name, type(exc).__name__, exc, step)

    def close(self) -> None:
        for name, backend in list(self.backends.items()):
            try:
                backend.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("logger %s: closing failed: %s", name, exc)
        self.backends.clear()


def _flat(cfg: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
