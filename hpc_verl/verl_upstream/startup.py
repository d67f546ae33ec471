"""verl's own start-up checks, run on the login node before the job waits in the queue.

``main_ppo`` composes its Hydra config, then calls ``verl.utils.config.validate_config``,
which builds verl's dataclasses (ActorConfig, CriticConfig, PolicyLossConfig, ...) and
asserts the batch arithmetic: a key added with ``+`` that a dataclass does not have, or a
value a ``__post_init__`` refuses, raises there. We run exactly that code, so the job is
refused with verl's own message instead of after the queue wait and the model load.

Importing verl pulls in torch, Ray and transformers (seconds, and a CUDA build of torch on
some login nodes), so the check runs in a child Python with a time limit unless verl's
modules are already imported in this process (then there is no import to save). Nothing
starts Ray or touches a GPU: ``validate_config`` reads the config only. The child runs with
the Hugging Face hub offline: a model that is not on this machine, or a rollout engine that
is not installed here, skips the rest of verl's check with a note instead of refusing the
job (the job runs where those exist).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from hpc_verl.util.fs import atomic_write_text

TIMEOUT_S = 120
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
_MODEL_MISSING = ("couldn't connect to", "is not a local folder", "does not appear to have", "Repo id",
                  "Can't load", "not a valid model identifier", "No such file or directory")
_NO_ENGINE = "version None not supported"  # verl's vLLM/SGLang rollout module, neither engine installed


@dataclass(frozen=True)
class StartupResult:
    """verl's verdict: ``problem`` (verl refuses; its message) or ``skipped`` (could not finish here)."""

    problem: str | None = None
    skipped: str | None = None


def _flat(text: str, limit: int = 400) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


def _message(exc: BaseException) -> str:
    """verl's own words: Hydra wraps a dataclass's error as "Error in call to target 'X': ..."; name
    the dataclass and give the error it raised."""
    cause = exc.__cause__ or exc.__context__
    target = re.search(r"target '([\w.]+)'", str(exc))
    if cause is not None and target is not None:
        return _flat(f"{target.group(1).rpartition('.')[2]}: {type(cause).__name__}: {cause}")
    return _flat(f"{type(exc).__name__}: {exc}")


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return out


def _classify(exc: BaseException) -> StartupResult:
    """verl's refusal, or what this machine lacks for verl's check to finish (not the job's fault)."""
    chain = _chain(exc)
    text = " ".join(str(e) for e in chain)
    if "HFModelConfig" in text and any(isinstance(e, OSError) for e in chain) and \
            any(mark in text for mark in _MODEL_MISSING):
        return StartupResult(skipped="the model's files are not on this machine, so verl's check stopped where it "
                                     "loads the model config")
    if _NO_ENGINE in text:
        return StartupResult(skipped="no rollout engine (vLLM, SGLang) is installed here, so verl's check stopped "
                                     "where it imports one")
    missing = next((e for e in chain if isinstance(e, ImportError)), None)
    if missing is not None:
        return StartupResult(skipped=f"verl's check needs a module not installed here ({_flat(str(missing), 120)})")
    return StartupResult(problem=_message(exc))


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """The hub offline for the check, also where huggingface_hub was imported before the variable
    was set (it reads HF_HUB_OFFLINE once, at import): a missing model fails at once, not after
    the hub client's retries."""
    constants = sys.modules.get("huggingface_hub.constants")
    before = getattr(constants, "HF_HUB_OFFLINE", None)
    if constants is not None:
        constants.HF_HUB_OFFLINE = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if constants is not None:
            constants.HF_HUB_OFFLINE = before  # type: ignore[attr-defined]


def check_composed(cfg: Any) -> StartupResult:
    """``validate_config`` on a composed (unresolved) config, as ``main_ppo.main`` calls it."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), _hub_offline():
            warnings.simplefilter("ignore")
            validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    except Exception as exc:  # noqa: BLE001 - whatever verl raises is its verdict on the job
        return _classify(exc)
    return StartupResult()


def preload() -> None:
    """Import verl's checking modules into this process (a long-lived caller that checks many jobs
    pays the import once; ``run_checks`` then runs in-process)."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    import verl.trainer.ppo.utils  # noqa: F401
    import verl.utils.config  # noqa: F401


def _in_process() -> bool:
    return "verl.utils.config" in sys.modules and "verl.trainer.ppo.utils" in sys.modules


def run_checks(config_dir: str, config_name: str, overrides: Sequence[str], cfg: Any = None,
               timeout_s: float = TIMEOUT_S) -> StartupResult:
    """verl's checks on the job's config (``cfg``: already composed from the same overrides)."""
    if _in_process():
        if cfg is None:
            from hpc_verl.verl_upstream.config import compose_dir

            cfg = compose_dir(config_dir, config_name, overrides)
        for key, value in OFFLINE_ENV.items():
            os.environ.setdefault(key, value)
        return check_composed(cfg)
    request = json.dumps({"config_dir": config_dir, "config_name": config_name, "overrides": list(overrides)})
    cache = _cache_file(config_dir, request)
    if cache is not None and cache.is_file():
        try:
            answer = json.loads(cache.read_text())
            return StartupResult(answer.get("problem"), None)
        except (OSError, ValueError):
            pass
    env = {**os.environ, **OFFLINE_ENV, "CUDA_VISIBLE_DEVICES": ""}
    try:
        done = subprocess.run([sys.executable, "-m", __name__], input=request, capture_output=True, text=True,
                              timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return StartupResult(skipped=f"verl's own check did not finish in {timeout_s:.0f} s here")
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = _flat(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}")
        return StartupResult(skipped=f"verl's own check could not run here ({tail})")
    answer = json.loads(lines[-1])
    if cache is not None and not answer.get("skipped"):  # a full verdict only: a missing model may appear later
        with contextlib.suppress(OSError):  # a cache only
            atomic_write_text(cache, json.dumps({"problem": answer.get("problem")}))
    return StartupResult(answer.get("problem"), answer.get("skipped"))


def _cache_file(config_dir: str, request: str) -> Path | None:
    """Where verl's verdict on this exact request is kept (``validate``, then ``render``, then ``submit``
    of one job pay verl's import once): keyed by the request and verl's installed check code."""
    try:
        verl_dir = Path(config_dir).resolve().parents[1]
        stamp = "|".join(str((verl_dir / rel).stat().st_mtime_ns) for rel in ("utils/config.py", "version/version"))
    except (OSError, IndexError):
        return None
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpc_verl" / "verl-check"
    digest = hashlib.sha256(f"{verl_dir}|{stamp}|{request}".encode()).hexdigest()[:32]
    return root / f"{digest}.json"


def _main() -> None:
    request = json.loads(sys.stdin.read())
    from hpc_verl.errors import ConfigError
    from hpc_verl.verl_upstream.config import compose_dir

    try:
        cfg = compose_dir(request["config_dir"], request["config_name"], request["overrides"])
        result = check_composed(cfg)
    except ConfigError as exc:
        result = StartupResult(problem=str(exc))
    except ImportError as exc:
        result = StartupResult(skipped=f"verl's modules do not import here ({_flat(str(exc), 160)})")
    print(json.dumps({"problem": result.problem, "skipped": result.skipped}))


if __name__ == "__main__":
    _main()
