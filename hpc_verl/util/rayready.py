"""The Ray readiness record: the bootstrap's barrier writes it once every node and GPU is up; a
trainer started before that (it reads its tokenizer and data meanwhile)
waits for it and connects with what it says.

Lives below both (bootstrap writes, trainer reads): one file name, one format.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Mapping

from hpc_verl.errors import BootstrapError
from hpc_verl.util.fs import atomic_write_text

#: in the job's ray/ dir, next to env.sh (the same variables, as JSON)
READY_FILE_NAME = "ready.json"
#: the job's Ray token, in the same dir (written when the job's Ray is planned)
TOKEN_FILE_NAME = "token"
#: names the record for a trainer started before Ray was ready, and how long it may wait
READY_FILE_ENV = "HPC_VERL_RAY_READY_FILE"
READY_TIMEOUT_ENV = "HPC_VERL_RAY_READY_TIMEOUT_S"


#: set (to 1) in the job's env.sh / ready.json: the job's raylets carry ``worker_env()`` themselves,
#: so a driver needs no runtime_env for it (one per-worker runtime-env set-up fewer)
WORKER_ENV_MARK = "HPC_VERL_RAY_WORKER_ENV"
#: what a Ray head ends with when its raylet did not register with the GCS within Ray's fixed
#: bound (30 s, ray/_private/node.py): a loaded node or a cold image, worth one more start
SLOW_REGISTRATION = "The current node timed out during startup"


def worker_env() -> dict[str, str]:
    """What every Ray worker of ours needs: this package importable, tokenizers single-threaded,
    the Hugging Face hub offline (models are local directories)."""
    parent = str(Path(__file__).resolve().parents[2])
    return {"PYTHONPATH": os.pathsep.join(filter(None, [parent, os.environ.get("PYTHONPATH")])),
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def auth_env(ray_dir: str | os.PathLike[str]) -> dict[str, str]:
    """The token variables of the job whose Ray files are in ``ray_dir``. Ray reads them when it
    is imported (the token file itself only when it connects), so a trainer started before Ray
    is up sets these and imports Ray while the cluster is still starting."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(Path(ray_dir) / TOKEN_FILE_NAME)}


#: for the raylets of our own Rays (the job's, a trainer's private one): the workers they start run
#: at the niceness of everything else. Ray's default (15) lets any other process take the CPU from
#: them; ours are the training ranks, and on a busy start-up their imports of torch and
#: transformers are the critical path (a driver and Ray's agents at 0 would come first)
RAYLET_ENV = {"RAY_worker_niceness": "0"}


def write_ready(path: str | os.PathLike[str], env: Mapping[str, str]) -> None:
    """Atomically: a reader sees the whole record or none."""
    atomic_write_text(path, json.dumps(dict(env), sort_keys=True) + "\n")


def wait_ready(path: str | os.PathLike[str], timeout_s: float, poll_s: float = 0.05,
               stop: threading.Event | None = None) -> dict[str, str] | None:
    """The record's variables (RAY_ADDRESS and the token's), once the barrier has written it;
    None when ``stop`` is set first (the trainer failed meanwhile: nothing to connect for)."""
    p = Path(path)
    deadline = time.monotonic() + timeout_s
    while stop is None or not stop.is_set():
        try:
            env = json.loads(p.read_text())
        except FileNotFoundError:
            env = None
        except (OSError, ValueError) as exc:
            raise BootstrapError(f"Ray readiness record {p} cannot be read ({exc}); was it written by "
                               f"another job?") from None
        if isinstance(env, dict) and env.get("RAY_ADDRESS"):
            return {str(k): str(v) for k, v in env.items()}
        if time.monotonic() > deadline:
            raise BootstrapError(f"Ray was not ready within {timeout_s:g}s: {p} never appeared (the job's "
                               f"ray-up stage failed or was stopped; see its log)")
        if stop is not None:
            stop.wait(poll_s)
        else:
            time.sleep(poll_s)
    return None
