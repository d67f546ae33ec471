"""What upstream verl will do with a config that its schema accepts: refuse it later, or ignore part of it.

Key validation (:mod:`~hpc_verl.verl_upstream.overrides`) knows which keys
exist; these rules know what verl's code does with the values. Each rule was
read off verl 0.9.1's source (the file is named in the rule) and
``tests/test_verl_findings.py`` re-reads that source, so a verl that changes
the behaviour fails the tests instead of getting stale advice:

- an *error* is what verl raises after the job has waited in the queue, loaded
  the models and started Ray (the job is refused before submission instead);
- a *warning* is a setting verl accepts and then does not act on, or a
  combination that runs but slowly or without the save the user expects.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from hpc_verl.util.batch_rules import uses_critic
from hpc_verl.util.dotted import get_path
from hpc_verl.util.versions import version_tuple

ROLLOUT = "actor_rollout_ref.rollout"
ACTOR = "actor_rollout_ref.actor"
SERVER_ROLLOUTS = ("vllm", "sglang", "trtllm")  # verl's RolloutConfig refuses pipeline parallelism for these

#: (deprecated key, its per-GPU twin, the use_dynamic_bsz key that switches verl's check off, where verl raises)
MICRO_BATCH_PAIRS = (
    (f"{ACTOR}.ppo_micro_batch_size", f"{ACTOR}.ppo_micro_batch_size_per_gpu", f"{ACTOR}.use_dynamic_bsz",
     "ActorConfig.__post_init__ (verl/workers/config/actor.py)"),
    ("critic.ppo_micro_batch_size", "critic.ppo_micro_batch_size_per_gpu", "critic.use_dynamic_bsz",
     "CriticConfig.__post_init__ (verl/workers/config/critic.py)"),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
     f"{ACTOR}.use_dynamic_bsz", "validate_config (verl/utils/config.py)"),
    (f"{ROLLOUT}.log_prob_micro_batch_size", f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu",
     f"{ACTOR}.use_dynamic_bsz", "validate_config (verl/utils/config.py)"),
)

#: Keys verl 0.9 accepts and never reads, with what happens instead.
IGNORED_KEYS: dict[str, str] = {
    "actor_rollout_ref.nccl_timeout": (
        "no code reads it: the workers create their process groups with "
        "initialize_global_process_group_ray(timeout_second=None) (verl/workers/engine_workers.py), so torch's "
        "default timeout applies whatever you set"),
    "data.return_raw_input_ids": "no code reads it (the dataset returns raw prompts as it always does)",
}
#: CPUs each GPU bundle of verl's placement groups reserves (ResourcePoolManager.max_colocate_count,
#: verl/single_controller/ray/base.py): Ray needs this many CPUs per GPU on every node
VERL_CPUS_PER_GPU = 3
IGNORED_SERIES = (0, 9)  # the verl series the IGNORED_KEYS were read from
SYNC_REMOVED_IN = (0, 8)


@dataclass(frozen=True)
class Finding:
    level: str  # "error" | "warning"
    key: str
    message: str

    def __str__(self) -> str:
        return self.message


def _set(value: Any) -> bool:
    return value is not None and value != "null"


def _int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def cpu_shortfall(cpus_per_node: int, gpus_per_node: int) -> str | None:
    """Why ``cpus_per_node`` Ray CPUs are too few for verl's placement groups on ``gpus_per_node`` GPUs."""
    need = VERL_CPUS_PER_GPU * gpus_per_node
    if gpus_per_node <= 0 or cpus_per_node >= need:
        return None
    return (f"upstream verl reserves {VERL_CPUS_PER_GPU} CPUs per GPU in its placement groups, {need} for "
            f"{gpus_per_node} GPUs, but Ray gets {cpus_per_node} per node: the placement groups never become "
            f"ready and the job hangs at start-up; set slurm.cpus_per_task to at least {need}")


def review(cfg: Mapping[str, Any], user_keys: set[str], version: str | None, nnodes: int, gpus_per_node: int,
           *, time_limited: bool = False, transport: str | None = None,
           cpus_per_node: int | None = None) -> list[Finding]:
    """Every finding for a composed config (``cfg``: nested or flat dotted keys, as resolved).

    ``user_keys``: the keys the job set itself (rules about pointless settings
    only speak about those); ``version``: the installed verl's (None: unknown,
    version-bound rules are skipped); ``time_limited``: a SLURM job, which has a
    time limit to survive; ``cpus_per_node``: what ``ray start --num-cpus`` gets on
    real GPU nodes (None: not checked).
    """
    v = version_tuple(version) if version else None
    tag = f"verl {version}" if version else "verl"
    out: list[Finding] = []

    mode = get_path(cfg, f"{ROLLOUT}.mode")
    if v is not None and v >= SYNC_REMOVED_IN and mode == "sync":
        out.append(Finding("error", f"{ROLLOUT}.mode", (
            f"{ROLLOUT}.mode=sync was removed in verl 0.8: {tag}'s RolloutConfig raises \"Rollout mode 'sync' has "
            f"been removed\" when the rollout starts; drop the override (async is the only mode)")))

    out += _micro_batches(cfg, user_keys, tag)
    out += _replica(cfg, nnodes, gpus_per_node, tag, transport)

    if v is not None and v[:2] == IGNORED_SERIES:
        for key, why in IGNORED_KEYS.items():
            if key in user_keys:
                out.append(Finding("warning", key, f"{key} is accepted but ignored by {tag}: {why}; drop it"))

    short = cpu_shortfall(cpus_per_node, gpus_per_node) if cpus_per_node is not None else None
    if short:
        out.append(Finding("warning", "slurm.cpus_per_task", short))
    if time_limited:
        out += _time_limit(cfg, user_keys, v, tag)
    return out


def _micro_batches(cfg: Mapping[str, Any], user_keys: set[str], tag: str) -> list[Finding]:
    out = []
    ref_used = bool(get_path(cfg, "algorithm.use_kl_in_reward", False)) or bool(get_path(cfg, f"{ACTOR}.use_kl_loss",
                                                                                         False))
    for old, per_gpu, dynamic_key, where in MICRO_BATCH_PAIRS:
        if not ({old, per_gpu} & user_keys):
            continue
        if not (_set(get_path(cfg, old)) and _set(get_path(cfg, per_gpu))):
            continue
        if old.startswith("critic.") and not uses_critic(cfg):
            continue
        if old.startswith("actor_rollout_ref.ref.") and not ref_used:
            continue
        if bool(get_path(cfg, dynamic_key, False)):
            out.append(Finding("warning", old, (
                f"both {old} and {per_gpu} are set, and {dynamic_key}=true makes {tag} ignore both (micro-batches "
                "are packed by token count, ppo_max_token_len_per_gpu); drop them")))
        else:
            out.append(Finding("error", old, (
                f"both {old} and {per_gpu} are set: {tag} raises ValueError in {where} once the job runs (the "
                f"global {old.rsplit('.', 1)[-1]} is deprecated); drop {old}")))
    return out


def _replica(cfg: Mapping[str, Any], nnodes: int, gpn: int, tag: str, transport: str | None) -> list[Finding]:
    """One rollout replica is TP × DP × PP GPUs (verl/workers/rollout/replica.py)."""
    if gpn <= 0:
        return []
    name = get_path(cfg, f"{ROLLOUT}.name")
    tp = _int(get_path(cfg, f"{ROLLOUT}.tensor_model_parallel_size"), 1)
    dp = _int(get_path(cfg, f"{ROLLOUT}.data_parallel_size"), 1)
    pp = _int(get_path(cfg, f"{ROLLOUT}.pipeline_model_parallel_size"), 1)
    size = tp * dp * pp
    shape = f"TP {tp} × DP {dp} × PP {pp} = {size} GPUs"
    out = []
    if pp > 1 and name in SERVER_ROLLOUTS:
        out.append(Finding("error", f"{ROLLOUT}.pipeline_model_parallel_size", (
            f"{ROLLOUT}.pipeline_model_parallel_size={pp}: {tag}'s RolloutConfig raises NotImplementedError for "
            f"pipeline parallelism with the {name} rollout; use 1 (raise tensor_model_parallel_size instead)")))
    if size <= gpn:
        return out
    total = nnodes * gpn
    if size > total:
        out.append(Finding("error", f"{ROLLOUT}.tensor_model_parallel_size", (
            f"one {name} rollout replica needs {shape}, the allocation has {total} ({nnodes} node(s) × {gpn}); "
            "lower the rollout's parallel sizes or add nodes")))
    elif size % gpn:
        out.append(Finding("error", f"{ROLLOUT}.tensor_model_parallel_size", (
            f"one {name} rollout replica ({shape}) spans nodes but is not a multiple of the {gpn} GPUs per node: "
            f"{tag} asserts 'world_size must be divisible by gpus_per_node' (replica.py); use a multiple of {gpn}")))
    else:
        over = " over TCP sockets" if transport in ("ethernet", "loopback") else ""
        out.append(Finding("warning", f"{ROLLOUT}.tensor_model_parallel_size", (
            f"one {name} rollout replica ({shape}) spans {size // gpn} nodes of {gpn} GPUs: its tensor/pipeline "
            f"collectives cross the inter-node network{over} for every generated token, far slower than inside a "
            f"node; keep TP × DP × PP ≤ {gpn} unless the model does not fit in one node")))
    return out


def _time_limit(cfg: Mapping[str, Any], user_keys: set[str], v: tuple[int, ...] | None,
                tag: str) -> list[Finding]:
    """verl's saves before the time limit (verl/trainer/ppo/ray_trainer.py, .../ppo/v1/trainer_base.py)."""
    out = []
    raw = get_path(cfg, "trainer.save_freq")  # absent: verl's default is unknown here (verl not installed)
    save_freq = _int(raw, 0)
    if raw is not None and save_freq <= 0:
        out.append(Finding("warning", "trainer.save_freq", (
            f"trainer.save_freq={save_freq}: {tag} writes no checkpoint at all, not even its save before the time "
            "limit, so a requeued job starts over; set trainer.save_freq to a step count (e.g. 50)")))
    if v is not None and v[:2] == IGNORED_SERIES and bool(get_path(cfg, "trainer.use_v1", False)):
        extra = " (so trainer.esi_redundant_time does nothing)" if "trainer.esi_redundant_time" in user_keys else ""
        out.append(Finding("warning", "trainer.use_v1", (
            f"trainer.use_v1=true, {tag}'s default trainer, has no save before the time limit{extra}: only the "
            "legacy trainer (trainer.use_v1=false) checks the job's end time; at the preemption signal hpc-verl "
            "stops verl after its next periodic save (or shortly before the end) and the requeued run resumes "
            "from the last one")))
    return out


def user_keys_of(overrides: list[str]) -> set[str]:
    """The dotted keys a list of ``key=value`` overrides sets (prefixes stripped)."""
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides}


def split(findings: list[Finding]) -> tuple[list[str], list[str]]:
    """(errors, warnings) as message lines."""
    return ([str(f) for f in findings if f.level == "error"], [str(f) for f in findings if f.level != "error"])
