"""What the built-in trainer implements, in one place: every key of
``ppo_default.yaml`` either does what its name says or a value it cannot honour
is refused here with one line naming the key and what is supported.

``refuse_unsupported`` runs in ``load_config`` (so ``--print-config``,
``--check``, ``--dry-run`` and the launcher's submit-time validation all see
it); ``derive_micro_batches`` turns verl's global micro-batch keys into the
per-rank ones the workers use, from the worker groups' sizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from hpc_verl.errors import ConfigError
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
    Refusal("actor_rollout_ref.actor.ulysses_sequence_parallel_size", lambda v, c: v != 1,
            "Ulysses sequence parallelism is not implemented yet; only 1 is supported"),
    Refusal("actor_rollout_ref.rollout.mode", lambda v, c: v != "sync",
            "only the synchronous rollout (sync) is implemented; async rollout is not"),
    _vllm_only("gpu_memory_utilization", 0.5),
    _vllm_only("enforce_eager", False),
    _vllm_only("free_cache_engine", True),
    _vllm_only("max_num_seqs", 256),
    Refusal("critic.model.tokenizer_path",
            lambda v, c: v is not None and v != (c["actor_rollout_ref"]["model"]["tokenizer_path"]
                                                 or c["actor_rollout_ref"]["model"]["path"]),
            "the critic reads the actor's token ids, so it must share the actor's tokenizer (leave it null)"),
    Refusal("trainer.max_critic_ckpt_to_keep",
            lambda v, c: v is not None and v != c["trainer"]["max_actor_ckpt_to_keep"],
            "actor and critic are saved in one global_step_N checkpoint, rotated by "
            "trainer.max_actor_ckpt_to_keep; leave it null or equal"),
)


def refuse_unsupported(cfg: Mapping) -> None:
    """Raise one ConfigError line for the first value the trainer cannot honour."""
    from hpc_verl.trainer.trackers import check_logger_names
    check_logger_names(get_path(cfg, "trainer.logger"))
    for rule in REFUSALS:
        value = get_path(cfg, rule.key)
        if rule.bad(value, cfg):
            raise ConfigError(f"config key '{rule.key}'={value!r} is not supported: {rule.why}")


# (role, global key, per-rank key) of verl's micro-batch pairs
MICRO_BATCH_KEYS = (
    ("actor", "actor_rollout_ref.actor.ppo_micro_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    ("critic", "critic.ppo_micro_batch_size", "critic.ppo_micro_batch_size_per_gpu"),
    ("ref", "actor_rollout_ref.ref.log_prob_micro_batch_size", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"),
    ("actor", "actor_rollout_ref.rollout.log_prob_micro_batch_size",
     "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"),
)


def derive_micro_batches(cfg: dict) -> None:
    """verl's deprecated global micro-batch keys -> per rank (divided by the role's group size)."""
    from hpc_verl.trainer.topology import topology

    topo = topology(cfg)
    for role, global_key, rank_key in MICRO_BATCH_KEYS:
        g = get_path(cfg, global_key)
        if g is None or get_path(cfg, rank_key) is not None:
            continue
        spec = topo.group_of(role)
        world = spec.world_size if spec else 1
        if g % world:
            raise ConfigError(f"config key '{global_key}'={g} must be a multiple of the {world} rank(s) of the "
                              f"{role}; or set {rank_key} instead")
        parent, leaf = rank_key.rsplit(".", 1)
        get_path(cfg, parent)[leaf] = g // world
        gparent, gleaf = global_key.rsplit(".", 1)
        get_path(cfg, gparent)[gleaf] = None   # one of the pair is set, as verl requires

