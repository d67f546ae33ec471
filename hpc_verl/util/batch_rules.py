"""Batch-size arithmetic of verl-style PPO configs: one set of rules for every trainer.

The built-in trainer (``trainer.config.validate_for_run``) and the launcher's
checks of upstream verl jobs (``verl_upstream.command``, ``ops.scaling``,
``launch.spec.trainer_check``) ask this module, so a rule, its default and its
wording live here once. The rules are the ones verl applies after Ray is up and
the models are loaded (``verl.utils.config.validate_config``, the actor and critic
configs' ``validate`` and the workers' per-GPU normalisation): here they run on a
login node in milliseconds, and every message carries the numbers and a value that
would work. Missing keys take verl's defaults (``VERL_DEFAULTS``). Pure
arithmetic: no imports beyond the standard library and ``util.dotted``.
"""
from __future__ import annotations

from typing import Any, Mapping

from hpc_verl.util.dotted import get_path

ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"
ROLES = ("actor", "critic", "rollout")
"""Keys of ``dp_sizes``: the actor and critic (PPO updates) and the rollout (its log-prob pass)."""
_SECTION = {"actor": ACTOR, "critic": "critic", "rollout": ROLLOUT}

VERL_DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 1024,
    f"{ROLLOUT}.n": 1,
    f"{ROLLOUT}.tensor_model_parallel_size": 2,
    f"{ACTOR}.ppo_mini_batch_size": 256,
    f"{ACTOR}.use_dynamic_bsz": False,
    "algorithm.adv_estimator": "gae",
}
"""verl's defaults (trainer/config/ppo_trainer.yaml) for the keys the rules read; the
critic's mini-batch and dynamic-batch flag default to the actor's, every
sequence-parallel size to 1, every micro-batch to unset."""


def _get(cfg: Mapping[str, Any], key: str) -> Any:
    """The value, an explicit null counting as unset (verl's YAML writes ``key: null``)."""
    value = get_path(cfg, key)
    return VERL_DEFAULTS.get(key) if value is None else value


def _int(value: Any) -> int | None:
    """An integer as YAML or a command line may spell it (``8``, ``8.0``, ``"8"``); else None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def _positive(cfg: Mapping[str, Any], key: str, problems: list[str]) -> int | None:
    """The key's positive integer value; None when unset, or (with a problem added) when invalid."""
    raw = _get(cfg, key)
    if raw is None:
        return None
    value = _int(raw)
    if value is None or value < 1:
        problems.append(f"{key} must be a positive integer, got {raw!r}")
        return None
    return value


def _divisors(n: int, most: int = 6) -> str:
    found = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, found[-most:]))


def _multiples_near(value: int, step: int) -> str:
    lo = (value // step) * step
    return f"{lo} or {lo + step}" if lo > 0 else f"{step}"


def uses_critic(cfg: Mapping[str, Any]) -> bool:
    """verl's rule: ``critic.enable`` when set, else a critic exactly for GAE advantages."""
    enable = get_path(cfg, "critic.enable")
    return bool(enable) if enable is not None else _get(cfg, "algorithm.adv_estimator") == "gae"


def _dynamic(cfg: Mapping[str, Any], section: str) -> bool:
    actor = bool(_get(cfg, f"{ACTOR}.use_dynamic_bsz"))
    own = get_path(cfg, f"{section}.use_dynamic_bsz")
    return actor if own is None else bool(own)


def _sp_key(cfg: Mapping[str, Any], section: str) -> str:
    """Where the section's Ulysses size is set: verl 0.9's FSDP settings (``fsdp_config``, the
    critic's ``fsdp``) when set there, else the deprecated ``<section>.ulysses_sequence_parallel_size``."""
    for key in (f"{section}.fsdp_config.ulysses_sequence_parallel_size",
                f"{section}.fsdp.ulysses_sequence_parallel_size", f"{section}.veomni.ulysses_parallel_size"):
        if get_path(cfg, key) not in (None, 1):
            return key
    return f"{section}.ulysses_sequence_parallel_size"


def _sp(cfg: Mapping[str, Any], section: str, world: int, problems: list[str]) -> int:
    """The section's Ulysses sequence-parallel size (1 on CPU: one worker, nothing to split)."""
    if world <= 0:
        return 1
    return _positive(cfg, _sp_key(cfg, section), problems) or 1


def batch_problems(cfg: Mapping[str, Any], dp_sizes: Mapping[str, int], *, gpus_per_node: int = 0,
                   replica_may_span: bool = False, pairs: bool = True) -> list[str]:
    """Problems (one line each, with the numbers and a fix) of a PPO config on these worker groups.

    ``dp_sizes[role]`` (roles in ``ROLES``) is the number of ranks the role's batch is
    spread over: its worker group, verl's device mesh. With Ulysses sequence parallelism
    of size ``sp`` (``<section>.ulysses_sequence_parallel_size``), ``sp`` ranks share
    one sample stream, so ``dp_sizes[role] // sp`` ranks take distinct data. 0 or a
    missing role means CPU: one worker does everything and no per-GPU split is
    checked. ``gpus_per_node`` > 0 adds the rollout tensor-parallel check (a group must
    sit inside one node; ``replica_may_span``: upstream verl runs a replica larger than a
    node, judged by hpc_verl.verl_upstream.findings instead). ``pairs=False`` leaves a
    micro-batch key set together with its ``_per_gpu`` twin to the caller (upstream verl's
    findings know what verl does with both). ``cfg`` is nested or flat
    (``{"data.train_batch_size": 8}``).
    """
    problems: list[str] = []
    tbs = _positive(cfg, "data.train_batch_size", problems)
    n = _positive(cfg, f"{ROLLOUT}.n", problems) or 1
    if tbs is None:
        return problems
    active = [r for r in ("actor", "critic") if r != "critic" or uses_critic(cfg)]
    worlds = {r: int(dp_sizes.get(r) or 0) for r in ROLES}
    if not _dynamic(cfg, ACTOR):
        problems += _train_batch(tbs, n, {r: worlds[r] for r in active})
    if gpus_per_node > 0:
        problems += _tensor_parallel(cfg, gpus_per_node, replica_may_span)
    for role in active:
        if not _dynamic(cfg, _SECTION[role]):
            problems += _update_batches(cfg, role, tbs, n, worlds[role], pairs)
    if not _dynamic(cfg, ACTOR):
        problems += _log_prob_batches(cfg, worlds["rollout"], pairs)
    return problems


def _train_batch(tbs: int, n: int, worlds: Mapping[str, int]) -> list[str]:
    """Every rank gets the same number of responses (verl dispatches a batch over all ranks)."""
    out = []
    distinct = sorted({w for w in worlds.values() if w > 0})
    for world in distinct:
        total = tbs * n
        if total % world:
            roles = [r for r, w in worlds.items() if w == world]
            whose = "" if len(distinct) == 1 else f" of the {' and '.join(roles)}"
            step = world // _gcd(n, world)
            out.append(f"data.train_batch_size ({tbs}) × {ROLLOUT}.n ({n}) = {total} responses is not divisible "
                       f"by {world} GPUs{whose}: every GPU must get the same number of samples; use e.g. "
                       f"data.train_batch_size={_multiples_near(tbs, step)}")
    return out


def _gcd(a: int, b: int) -> int:
    import math

    return math.gcd(a, b) or 1


def _tensor_parallel(cfg: Mapping[str, Any], gpus_per_node: int, may_span: bool = False) -> list[str]:
    """The rollout tensor-parallel group must sit inside one node and divide its GPUs."""
    problems: list[str] = []
    key = f"{ROLLOUT}.tensor_model_parallel_size"
    tp = _positive(cfg, key, problems)
    if tp is not None and may_span and tp > gpus_per_node:
        return problems
    if tp is not None and gpus_per_node % tp:
        problems.append(f"{key} ({tp}) does not divide the {gpus_per_node} GPUs per node: a tensor-parallel "
                        f"group must sit inside one node; use one of {_divisors(gpus_per_node, gpus_per_node)}")
    return problems


def _update_batches(cfg: Mapping[str, Any], role: str, tbs: int, n: int, world: int, pairs: bool = True) -> list[str]:
    """Mini-batch over the data-parallel ranks, micro-batches inside it (PPO updates)."""
    section = _SECTION[role]
    out: list[str] = []
    mini_key = f"{section}.ppo_mini_batch_size"
    raw_mini = get_path(cfg, mini_key)
    mini = _positive(cfg, mini_key if raw_mini is not None else f"{ACTOR}.ppo_mini_batch_size", out)
    if mini is None:
        return out
    if mini > tbs:
        return [f"{mini_key} ({mini}) is larger than data.train_batch_size ({tbs}); lower the mini-batch "
                f"or raise the train batch"]
    micro_key, per_gpu_key = f"{section}.ppo_micro_batch_size", f"{section}.ppo_micro_batch_size_per_gpu"
    micro_global, micro = _positive(cfg, micro_key, out), _positive(cfg, per_gpu_key, out)
    if out:
        return out
    if micro_global is not None and micro is not None:
        if pairs:
            return [f"{section}: set only one of ppo_micro_batch_size and ppo_micro_batch_size_per_gpu "
                    "(the first is deprecated in verl)"]
        micro_global = None   # the caller judges the pair; check the per-GPU one
    sp = _sp(cfg, section, world, out)
    ranks = max(world, 1)
    if ranks % sp:
        return out + [f"{_sp_key(cfg, section)} ({sp}) does not divide the {ranks} GPUs of the "
                      f"{role}; use one of {_divisors(ranks, ranks)}"]
    dp = max(1, ranks // sp)
    if micro_global is not None:
        if mini % micro_global:
            out.append(f"{mini_key} ({mini}) is not divisible by {micro_key} ({micro_global})")
        if world and micro_global * sp < ranks:
            out.append(f"{micro_key} ({micro_global}) × ulysses_sequence_parallel_size ({sp}) is less than the "
                       f"{ranks} GPUs of the {role}: it gives no sample per GPU; use at least {dp}")
        if out:
            return out
        micro, per_gpu_key = micro_global // dp, micro_key
    samples = mini * n
    if samples % dp:
        return [f"{mini_key} ({mini}) × rollout.n ({n}) = {samples} does not split over {dp} data-parallel ranks "
                f"({ranks} GPUs / sequence parallel {sp}); use a mini-batch whose product with rollout.n is a "
                f"multiple of {dp}"]
    per_gpu = samples // dp
    if micro is not None and per_gpu % micro:
        got = f"{per_gpu_key} ({micro})" if per_gpu_key.endswith("_per_gpu") else \
            f"{per_gpu_key} ({micro_global}, {micro} per GPU)"
        out.append(f"{got} does not divide the per-GPU mini-batch {per_gpu} (= {mini} × {n} / {dp} data-parallel "
                   f"ranks); use one of {_divisors(per_gpu)}")
    return out


def _log_prob_batches(cfg: Mapping[str, Any], world: int, pairs: bool = True) -> list[str]:
    """The rollout's log-prob pass: one micro-batch setting, and at least one sample per GPU."""
    out: list[str] = []
    key, per_gpu_key = f"{ROLLOUT}.log_prob_micro_batch_size", f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu"
    micro_global, micro = _positive(cfg, key, out), _positive(cfg, per_gpu_key, out)
    if micro_global is not None and micro is not None and pairs:
        out.append(f"{ROLLOUT}: set only one of log_prob_micro_batch_size and log_prob_micro_batch_size_per_gpu "
                   "(the first is deprecated in verl)")
    elif micro_global is not None and micro is None and world > 0:
        sp = _sp(cfg, ACTOR, world, out)
        dp = max(1, world // sp)
        if micro_global < dp:
            out.append(f"{key} ({micro_global}) is less than the {dp} data-parallel ranks of the rollout: it gives "
                       f"no sample per GPU; use at least {dp} or set {per_gpu_key}")
    return out


def log_prob_split_problems(cfg: Mapping[str, Any], dp_sizes: Mapping[str, int], ref_used: bool) -> list[str]:
    """Each rank's share of the batch must split into whole log-prob micro-batches: verl's engine
    asserts "data size must be divisible by ... micro_batch_size_per_gpu" (verl/workers/engine/utils.py)
    at the first compute_log_prob, after the queue wait and the model load. ``dp_sizes[role]``: the
    data-parallel ranks of the engine that runs it (rollout: the actor's; ref: its own)."""
    tbs = _int(_get(cfg, "data.train_batch_size"))
    n = _int(_get(cfg, f"{ROLLOUT}.n")) or 1
    if not tbs or tbs < 1:
        return []
    out = []
    for role, section in (("rollout", ROLLOUT), ("ref", "actor_rollout_ref.ref")):
        dp = int(dp_sizes.get(role) or 0)
        if dp <= 0 or (role == "ref" and not ref_used):
            continue
        dynamic = get_path(cfg, f"{section}.log_prob_use_dynamic_bsz")
        if bool(_get(cfg, f"{ACTOR}.use_dynamic_bsz") if dynamic is None else dynamic):
            continue
        key = f"{section}.log_prob_micro_batch_size_per_gpu"
        micro = _int(get_path(cfg, key))
        total = tbs * n
        if not micro or micro < 1 or total % dp:
            continue
        per_rank = total // dp
        if per_rank % micro:
            out.append(f"{key} ({micro}) does not divide the {per_rank} samples each of the {dp} data-parallel ranks "
                       f"gets (data.train_batch_size {tbs} × rollout.n {n} / {dp}): verl asserts 'data size must be "
                       f"divisible by ... micro_batch_size_per_gpu' at its first log-prob pass; use one of "
                       f"{_divisors(per_rank)}")
    return out


def engine_dp(cfg: Mapping[str, Any], section: str, gpus: int) -> tuple[int, str | None]:
    """The data-parallel ranks of a role's engine on ``gpus`` GPUs, before Ulysses sequence parallelism
    (``batch_problems`` divides that out): all GPUs for FSDP and VeOmni, GPUs / (TP × PP × CP) for
    Megatron (verl's validate_config). The second value is a problem when they do not divide."""
    strategy = get_path(cfg, f"{section}.strategy")
    if strategy != "megatron" or gpus <= 0:
        return gpus, None
    sizes = {p: _int(get_path(cfg, f"{section}.megatron.{p}_parallel_size")) or 1
             for p in ("tensor_model", "pipeline_model", "context")}
    model = sizes["tensor_model"] * sizes["pipeline_model"] * sizes["context"]
    if gpus % model:
        return gpus, (f"{section}.megatron: tensor × pipeline × context parallel = {sizes['tensor_model']} × "
                      f"{sizes['pipeline_model']} × {sizes['context']} = {model} does not divide the {gpus} GPUs")
    return gpus // model, None


def check_ppo_arithmetic(cfg: Mapping[str, Any], nnodes: int, gpus_per_node: int,
                         replica_may_span: bool = False, pairs: bool = True) -> list[str]:
    """``batch_problems`` for verl's layout: every role on all ``nnodes × gpus_per_node`` GPUs
    (0 GPUs per node: a CPU job, one worker)."""
    gpus = max(0, nnodes * gpus_per_node)
    return batch_problems(cfg, {role: gpus for role in ROLES}, gpus_per_node=gpus_per_node,
                          replica_may_span=replica_may_span, pairs=pairs)


def data_parallel(cfg: Mapping[str, Any], section: str, world: int) -> int:
    """Ranks that take distinct data: the engine's data-parallel ranks over its Ulysses size."""
    if world <= 0:
        return 0
    return max(1, world // _sp(cfg, section, world, []))
