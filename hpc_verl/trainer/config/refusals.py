"""What the built-in trainer implements, in one place: every key of
``ppo_default.yaml`` either does what its name says or a value it cannot honour
is refused here with one line naming the key and what is supported.

``refuse_unsupported`` runs in ``load_config`` (so ``--print-config``,
``--check``, ``--dry-run`` and the launcher's submit-time validation all see
it). Driver; no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from hpc_verl.errors import ConfigError
from hpc_verl.trainer.config.environment import check_logger_names
from hpc_verl.trainer.config.topology import topology
from hpc_verl.util.dotted import get_path


@dataclass(frozen=True)
class Refusal:
    key: str
    bad: Callable[[Any, Mapping], bool]   # (value, whole config) -> refused?
    why: str                              # what is supported instead


def _vllm_only(key: str, default: Any) -> Refusal:
    return Refusal(f"actor_rollout_ref.rollout.{key}",
                   lambda v, c: c["actor_rollout_ref"]["rollout"]["name"] != "vllm" and v != default,
                   f"applies to the vLLM rollout only (rollout.name=vllm); the transformers rollout has no "
                   f"such setting (leave it at {default!r})")


REFUSALS: tuple[Refusal, ...] = (
    # data.val_files / val_batch_size name the validation data, read only when validation runs (as in
    # verl with test_freq=-1 and val_before_train=false); asking for validation runs is refused:
    Refusal("trainer.test_freq", lambda v, c: v is not None and v > 0,
            "validation runs are not implemented by the built-in trainer yet; leave it at -1"),
    Refusal("trainer.val_before_train", lambda v, c: bool(v),
            "validation runs are not implemented by the built-in trainer yet; leave it false"),
    Refusal("data.reward_fn_key", lambda v, c: v != "data_source",
            "rule rewards are chosen by the data_source field (the only one supported)"),
    Refusal("data.return_raw_chat", lambda v, c: v is not True,
            "prompts are tokenized with the chat template by the data loader; only true is supported"),
    Refusal("data.tokenizer", lambda v, c: v is not None,
            "the model's tokenizer is used (actor_rollout_ref.model.tokenizer_path); leave it null"),
    Refusal("actor_rollout_ref.hybrid_engine", lambda v, c: v is not True,
            "only the hybrid engine (true) is supported, as in verl; give roles their own devices with "
            "hpc_verl.device_mapping instead"),
    Refusal("actor_rollout_ref.model.use_remove_padding", lambda v, c: bool(v),
            "padding-free (remove_padding) kernels are not implemented; the trainer runs padded batches "
            "(leave it false)"),
    Refusal("actor_rollout_ref.actor.fsdp_config.param_offload",
            lambda v, c: bool(v) and c["actor_rollout_ref"]["actor"]["strategy"] == "ddp",
            "parameter offload is FSDP2's (CPUOffloadPolicy); with actor.strategy=ddp every rank holds the "
            "whole model on its device: use strategy=fsdp, or leave it false"),
    Refusal("actor_rollout_ref.ref.fsdp_config.param_offload",
            lambda v, c: bool(v) and c["actor_rollout_ref"]["actor"]["strategy"] == "ddp",
            "the reference is sharded (and offloaded) only when the actor uses strategy=fsdp"),
    Refusal("critic.fsdp.param_offload", lambda v, c: bool(v) and c["critic"]["strategy"] == "ddp",
            "parameter offload is FSDP2's; with critic.strategy=ddp use strategy=fsdp, or leave it false"),
    Refusal("critic.enable", lambda v, c: v is True and c["algorithm"]["adv_estimator"] != "gae",
            "the built-in trainer uses a critic for GAE only (algorithm.adv_estimator=gae); GRPO, RLOO and "
            "REINFORCE++ have none"),
    Refusal("hpc_verl.one_step_off_policy", lambda v, c: bool(v) and _rollout_shares_actor(c),
            "the rollout of step k+1 can only run while step k trains when the rollout has its own devices "
            "(processes); give it some with hpc_verl.device_mapping, e.g. {actor: [0,1], rollout: [2,3]}"),
    Refusal("actor_rollout_ref.rollout.mode", lambda v, c: v != "sync",
            "only the synchronous rollout (sync) is implemented; async rollout is not"),
    _vllm_only("gpu_memory_utilization", 0.5),
    _vllm_only("enforce_eager", False),
    _vllm_only("free_cache_engine", True),
    _vllm_only("max_num_seqs", 256),
    _vllm_only("enable_sleep_mode", None),
    Refusal("actor_rollout_ref.rollout.enable_sleep_mode", lambda v, c: v is True and c["trainer"]["device"] == "cpu",
            "vLLM's CPU build has no sleep mode (it is CUDA/ROCm/XPU only), so the KV cache stays allocated "
            "between rollouts; leave it null"),
    Refusal("critic.model.tokenizer_path",
            lambda v, c: v is not None and v != (c["actor_rollout_ref"]["model"]["tokenizer_path"]
                                                 or c["actor_rollout_ref"]["model"]["path"]),
            "the critic reads the actor's token ids, so it must share the actor's tokenizer (leave it null)"),
    Refusal("trainer.max_critic_ckpt_to_keep",
            lambda v, c: v is not None and v != c["trainer"]["max_actor_ckpt_to_keep"],
            "actor and critic are saved in one global_step_N checkpoint, rotated by "
            "trainer.max_actor_ckpt_to_keep; leave it null or equal"),
)


def _rollout_shares_actor(cfg: Mapping) -> bool:
    topo = topology(cfg)
    return topo.role_group.get("rollout") == topo.role_group.get("actor")


def refuse_unsupported(cfg: Mapping) -> None:
    """Raise one ConfigError line for the first value the trainer cannot honour."""
    check_logger_names(get_path(cfg, "trainer.logger"))
    for rule in REFUSALS:
        value = get_path(cfg, rule.key)
        if rule.bad(value, cfg):
            raise ConfigError(f"config key '{rule.key}'={value!r} is not supported: {rule.why}")


