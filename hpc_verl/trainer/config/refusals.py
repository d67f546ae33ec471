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
    from hpc_verl.trainer.config.topology import topology
    topo = topology(cfg)
    return topo.role_group.get("rollout") == topo.role_group.get("actor")


def refuse_unsupported(cfg: Mapping) -> None:
    """Raise one ConfigError line for the first value the trainer cannot honour."""
    from hpc_verl.trainer.observe.trackers import check_logger_names
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


# (deprecated key, verl 0.9's key) of the Ulysses sequence-parallel sizes
SP_KEYS = (("actor_rollout_ref.actor.ulysses_sequence_parallel_size",
            "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"),
           ("critic.ulysses_sequence_parallel_size", "critic.fsdp.ulysses_sequence_parallel_size"))
REF_SP_KEY = "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size"


_SP_OF = {"actor": SP_KEYS[0][1], "critic": SP_KEYS[1][1], "ref": REF_SP_KEY}


def derive_sequence_parallel(cfg: dict) -> None:
    """verl 0.9 moved ``<role>.ulysses_sequence_parallel_size`` into the FSDP settings: the old key
    still works (with a warning); both keys end up holding the size in effect (the batch rules
    read the old one); the reference follows the actor unless set."""
    import warnings

    for old, new in SP_KEYS:
        old_v, new_v = get_path(cfg, old), get_path(cfg, new)
        if old_v != 1 and new_v not in (1, old_v):
            raise ConfigError(f"config keys '{old}'={old_v} and '{new}'={new_v} disagree; set only '{new}' "
                              f"(the first is deprecated)")
        if old_v != 1 and new_v == 1:
            warnings.warn(f"config key '{old}' is deprecated (verl 0.9); use '{new}'={old_v}", UserWarning,
                          stacklevel=2)
            new_v = old_v
        for key in (old, new):
            parent, leaf = key.rsplit(".", 1)
            get_path(cfg, parent)[leaf] = new_v
    if get_path(cfg, REF_SP_KEY) is None:
        parent, leaf = REF_SP_KEY.rsplit(".", 1)
        get_path(cfg, parent)[leaf] = get_path(cfg, SP_KEYS[0][1])


def derive_micro_batches(cfg: dict) -> None:
    """verl's deprecated global micro-batch keys -> per rank (divided by the role's group size)."""
    from hpc_verl.trainer.config.topology import topology

    topo = topology(cfg)
    for role, global_key, rank_key in MICRO_BATCH_KEYS:
        g = get_path(cfg, global_key)
        if g is None or get_path(cfg, rank_key) is not None:
            continue
        spec = topo.group_of(role)
        sp = int(get_path(cfg, _SP_OF.get(role, SP_KEYS[0][1])) or 1)
        world = max(1, (spec.world_size if spec else 1) // sp)   # data-parallel ranks (verl divides by them)
        if g % world:
            raise ConfigError(f"config key '{global_key}'={g} must be a multiple of the {world} rank(s) of the "
                              f"{role}; or set {rank_key} instead")
        parent, leaf = rank_key.rsplit(".", 1)
        get_path(cfg, parent)[leaf] = g // world
        gparent, gleaf = global_key.rsplit(".", 1)
        get_path(cfg, gparent)[gleaf] = None   # one of the pair is set, as verl requires

