"""Trainer config: YAML plus dotted ``key=value`` overrides, verl's key names, strict.

The shipped ``ppo_default.yaml`` is both the defaults and the schema: a key not in
it is an error with a did-you-mean, a value of the wrong type or out of range is an
error naming the key and what is allowed. ``check_batch_arithmetic`` is separate and
dependency-free so other parts (e.g. validation of upstream verl jobs) can call it.
"""
from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import yaml

from hpc_verl.errors import ConfigError
from hpc_verl.trainer.config.derive import derive_micro_batches, derive_sequence_parallel
from hpc_verl.trainer.config.environment import check_vllm_install
from hpc_verl.trainer.config.refusals import refuse_unsupported
from hpc_verl.trainer.config.topology import topology
from hpc_verl.trainer.core_algos import ADV_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, LR_SCHEDULERS
from hpc_verl.util.batch_rules import ROLES as BATCH_ROLES
from hpc_verl.util.batch_rules import batch_problems
from hpc_verl.util.dotted import get_path
from hpc_verl.util.suggest import did_you_mean, unknown_key_message
from hpc_verl.util.yamlfile import read_yaml

DEFAULT_YAML = Path(__file__).with_name("ppo_default.yaml")

# Types of keys whose default is null (or that accept more than the default's type).
_NULLABLE_TYPES: dict[str, tuple[type, ...]] = {
    "data.train_files": (str, list),
    "data.val_files": (str, list),
    "data.val_batch_size": (int,),
    "data.seed": (int,),
    "data.tokenizer": (str,),
    "actor_rollout_ref.model.path": (str,),
    "actor_rollout_ref.model.tokenizer_path": (str,),
    "actor_rollout_ref.model.custom_chat_template": (str,),
    "actor_rollout_ref.actor.ppo_micro_batch_size": (int,),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": (int,),
    "actor_rollout_ref.actor.clip_ratio_low": (float,),
    "actor_rollout_ref.actor.clip_ratio_high": (float,),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": (int,),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": (int,),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": (int,),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": (int,),
    "critic.enable": (bool,),
    "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size": (int,),
    "critic.ppo_mini_batch_size": (int,),
    "critic.ppo_micro_batch_size": (int,),
    "critic.ppo_micro_batch_size_per_gpu": (int,),
    "critic.ppo_epochs": (int,),
    "critic.model.path": (str,),
    "critic.model.tokenizer_path": (str,),
    "reward_model.model.path": (str,),
    "reward_model.micro_batch_size_per_gpu": (int,),
    "custom_reward_function.path": (str,),
    "trainer.total_training_steps": (int,),
    "trainer.resume_from_path": (str,),
    "trainer.max_actor_ckpt_to_keep": (int,),
    "trainer.max_critic_ckpt_to_keep": (int,),
    "trainer.logger": (list, str),
    "trainer.stop_when.metric": (str,),
    "trainer.stop_when.at_least": (float,),
    "trainer.stop_when.at_most": (float,),
    "hpc_verl.run_dir": (str,),
    "hpc_verl.ray_address": (str,),
    "hpc_verl.ray_num_cpus": (int,),
    "hpc_verl.device_mapping": (dict,),
    "hpc_verl.torch_threads": (int,),
    "hpc_verl.pin_cpus": (list,),
    "hpc_verl.old_log_prob_from_rollout": (bool,),
    "actor_rollout_ref.rollout.enable_sleep_mode": (bool,),
    "hpc_verl.collective_timeout_s": (int, float),
    "hpc_verl.ddp_bucket_mb": (int, float),
    "hpc_verl.start_timeout_s": (int, float),
    "actor_rollout_ref.actor.loss_scale_factor": (int, float),
    "critic.loss_scale_factor": (int, float),
    "critic.loss_agg_mode": (str,),
    "critic.shuffle": (bool,),
    "actor_rollout_ref.actor.optim.warmup_style": (str,),
    "critic.optim.warmup_style": (str,),
}

ROLLOUT_NAMES = ("hf", "vllm")   # the engines rollout/__init__.ROLLOUTS registers

_CHOICES: dict[str, tuple[str, ...]] = {
    "data.truncation": ("error", "left", "right"),
    "actor_rollout_ref.rollout.name": ROLLOUT_NAMES,
    "actor_rollout_ref.rollout.mode": ("sync", "async"),
    "actor_rollout_ref.rollout.dtype": ("bfloat16", "float16", "float32"),
    "actor_rollout_ref.actor.strategy": ("fsdp", "fsdp2", "ddp"),
    "critic.strategy": ("fsdp", "fsdp2", "ddp"),
    "actor_rollout_ref.actor.kl_loss_type": KL_ESTIMATORS,
    "actor_rollout_ref.actor.loss_agg_mode": LOSS_AGG_MODES,
    "critic.loss_agg_mode": LOSS_AGG_MODES,
    "algorithm.adv_estimator": ADV_ESTIMATORS,
    "algorithm.kl_penalty": KL_ESTIMATORS,
    "actor_rollout_ref.actor.optim.lr_scheduler_type": LR_SCHEDULERS,
    "critic.optim.lr_scheduler_type": LR_SCHEDULERS,
    "actor_rollout_ref.actor.optim.warmup_style": LR_SCHEDULERS,
    "critic.optim.warmup_style": LR_SCHEDULERS,
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "trainer.device": ("cuda", "cpu"),
    "trainer.resume_mode": ("auto", "disable", "resume_path"),
    "hpc_verl.cpu_matmul": ("onednn", "torch"),
}

# key -> (minimum, inclusive?) for numbers
_POSITIVE = {
    "data.max_prompt_length", "data.max_response_length", "data.train_batch_size",
    "data.val_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.ppo_epochs", "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.tensor_model_parallel_size", "actor_rollout_ref.rollout.max_num_seqs",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size",
    "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size",
    "critic.ulysses_sequence_parallel_size", "critic.fsdp.ulysses_sequence_parallel_size",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "critic.ppo_mini_batch_size", "critic.ppo_micro_batch_size_per_gpu", "critic.ppo_epochs",
    "reward_model.micro_batch_size_per_gpu", "trainer.nnodes", "trainer.total_epochs",
    "trainer.total_training_steps", "trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep",
    "hpc_verl.ray_num_cpus", "hpc_verl.torch_threads", "hpc_verl.collective_timeout_s",
    "hpc_verl.weight_sync_bucket_mb", "hpc_verl.start_timeout_s", "hpc_verl.ddp_bucket_mb",
    "actor_rollout_ref.actor.loss_scale_factor", "critic.loss_scale_factor", "trainer.stop_when.window_steps",
}
_NON_NEGATIVE = {
    "trainer.n_gpus_per_node", "actor_rollout_ref.actor.clip_ratio", "actor_rollout_ref.actor.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high", "actor_rollout_ref.actor.grad_clip", "critic.grad_clip",
    "actor_rollout_ref.actor.optim.lr", "critic.optim.lr", "actor_rollout_ref.actor.optim.weight_decay",
    "critic.optim.weight_decay", "critic.cliprange_value", "algorithm.kl_ctrl.kl_coef",
    "algorithm.kl_ctrl.target_kl", "actor_rollout_ref.actor.kl_loss_coef", "trainer.critic_warmup",
    "actor_rollout_ref.actor.optim.num_cycles", "critic.optim.num_cycles",
}
# Sections that may be given as null: null means the section's defaults (for trainer.stop_when: off).
_NULLABLE_SECTIONS = {"trainer.stop_when"}

_UNIT_INTERVAL = {"algorithm.gamma", "algorithm.lam", "actor_rollout_ref.rollout.top_p",
                  "actor_rollout_ref.rollout.gpu_memory_utilization", "actor_rollout_ref.actor.optim.min_lr_ratio",
                  "critic.optim.min_lr_ratio"}


class Section(dict):
    """A dict whose keys are also attributes (``cfg.data.train_batch_size``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def get_path(self, dotted: str, default: Any = None) -> Any:
        return get_path(self, dotted, default)

    def to_dict(self) -> dict:
        return _plain(self)


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


def _sectioned(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return Section({k: _sectioned(v) for k, v in obj.items()})
    if isinstance(obj, list):
        return [_sectioned(v) for v in obj]
    return obj


def load_defaults() -> dict:
    """The shipped defaults (also the schema)."""
    with open(DEFAULT_YAML, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def _flatten(d: Mapping, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and key != "hpc_verl.device_mapping":
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out



def _check_key(schema: Mapping, dotted: str, where: str) -> None:
    """Raise a one-line ConfigError if ``dotted`` is not a key of the schema."""
    node: Any = schema
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, Mapping):
            parent = ".".join(parts[:i])
            raise ConfigError(f"{where}: '{parent}' is a value, not a section, so '{dotted}' is not a key")
        if part not in node:
            parent = ".".join(parts[:i])
            valid = [f"{parent}.{c}" if parent else c for c in node]
            full_keys = list(_flatten(schema))
            hint = did_you_mean(dotted, full_keys) or did_you_mean(".".join(parts[: i + 1]), valid)
            if hint:
                raise ConfigError(f"{where}: unknown key '{dotted}'{hint}")
            raise ConfigError(unknown_key_message(".".join(parts[: i + 1]), where, valid))
        node = node[part]
        if dotted.startswith("hpc_verl.device_mapping") and i == 1:
            return


def _merge(base: dict, update: Mapping, schema: Mapping, where: str, prefix: str = "") -> None:
    for k, v in update.items():
        key = f"{prefix}{k}"
        _check_key(schema, key, where)
        sub_schema = schema
        for part in key.split("."):
            sub_schema = sub_schema[part]
        if isinstance(sub_schema, Mapping) and key != "hpc_verl.device_mapping":
            if v is None and key in _NULLABLE_SECTIONS:
                _set(base, key, copy.deepcopy(sub_schema))
                continue
            if not isinstance(v, Mapping):
                raise ConfigError(f"{where}: '{key}' is a section; give its keys ({', '.join(sub_schema)}), not a value")
            _merge(base, v, schema, where, key + ".")
        else:
            _set(base, key, v)


def _set(d: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for part in parts[:-1]:
        d = d.setdefault(part, {})
    d[parts[-1]] = value


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}': expected key=value, e.g. data.train_batch_size=64")
    key, raw = item.split("=", 1)
    key = key.strip().lstrip("+")
    if not key:
        raise ConfigError(f"override '{item}': empty key before '='")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _type_name(types: Iterable[type]) -> str:
    return " or ".join({bool: "true/false", int: "an integer", float: "a number", str: "a string",
                        list: "a list", dict: "a mapping"}[t] for t in types)


def _validate_values(flat_defaults: Mapping[str, Any], cfg: Mapping) -> None:
    flat = _flatten(cfg)
    for key, value in flat.items():
        default = flat_defaults.get(key)
        if value is None:
            if default is None:
                continue
            raise ConfigError(f"config key '{key}' may not be null (default: {default!r})")
        types = _NULLABLE_TYPES.get(key) or (type(default),)
        if float in types and isinstance(value, str):
            try:  # YAML 1.1 reads 1e-3 (no dot) as a string
                value = float(value)
            except ValueError:
                pass
            else:
                _set(cfg, key, value)  # type: ignore[arg-type]
        if float in types and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
            _set(cfg, key, value)  # type: ignore[arg-type]
        if isinstance(value, bool) and bool not in types:
            raise ConfigError(f"config key '{key}': expected {_type_name(types)}, got {value!r}")
        if not isinstance(value, types):
            raise ConfigError(f"config key '{key}': expected {_type_name(types)}, got {value!r}")
        if key in _CHOICES and value not in _CHOICES[key]:
            raise ConfigError(f"config key '{key}': {value!r} is not one of {', '.join(_CHOICES[key])}"
                              f"{did_you_mean(str(value), _CHOICES[key])}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if key in _POSITIVE and value <= 0:
                raise ConfigError(f"config key '{key}': must be > 0, got {value}")
            if key in _NON_NEGATIVE and value < 0:
                raise ConfigError(f"config key '{key}': must be >= 0, got {value}")
            if key in _UNIT_INTERVAL and not 0 <= value <= 1:
                raise ConfigError(f"config key '{key}': must be within [0, 1], got {value}")
    temp = cfg["actor_rollout_ref"]["rollout"]["temperature"]
    if temp <= 0 and cfg["actor_rollout_ref"]["rollout"]["do_sample"]:
        raise ConfigError("config key 'actor_rollout_ref.rollout.temperature': must be > 0 when do_sample=true")
    _validate_device_mapping(cfg)
    _validate_stop_when(cfg["trainer"]["stop_when"])
    pins = cfg["hpc_verl"].get("pin_cpus")
    if pins is not None and (not pins or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                                                   for c in pins)):
        raise ConfigError(f"config key 'hpc_verl.pin_cpus': expected a list of CPU ids like [0, 1], got {pins!r}")


ROLES = ("actor", "rollout", "ref", "critic", "reward")


def _validate_stop_when(section: Mapping) -> None:
    """``trainer.stop_when`` (types already checked): a metric needs exactly one target, a target a metric."""
    metric, targets = section["metric"], [k for k in ("at_least", "at_most") if section[k] is not None]
    for k in targets:
        if not math.isfinite(section[k]):
            raise ConfigError(f"config key 'trainer.stop_when.{k}': expected a finite number, got {section[k]!r}")
    if metric is None:
        if targets:
            raise ConfigError(f"config key 'trainer.stop_when.{targets[0]}' is set but trainer.stop_when.metric is "
                              f"null; name the metric to watch, e.g. trainer.stop_when.metric=critic/score/mean")
        return
    if not metric.strip():
        raise ConfigError("config key 'trainer.stop_when.metric': expected a metric name like critic/score/mean, "
                          "got ''")
    if not targets:
        raise ConfigError(f"config key 'trainer.stop_when.metric'={metric!r} needs a target: set "
                          f"trainer.stop_when.at_least (stop once the mean rises to it) or trainer.stop_when.at_most "
                          f"(once it falls to it)")
    if len(targets) == 2:
        raise ConfigError("config keys 'trainer.stop_when.at_least' and 'trainer.stop_when.at_most' are both set; "
                          "give one (the direction the metric should move)")


def _validate_device_mapping(cfg: Mapping) -> None:
    mapping = cfg["hpc_verl"]["device_mapping"]
    if mapping is None:
        return
    n_gpus = cfg["trainer"]["n_gpus_per_node"]
    for role, gpus in mapping.items():
        where = f"config key 'hpc_verl.device_mapping.{role}'"
        if role not in ROLES:
            raise ConfigError(f"{where}: unknown role{did_you_mean(str(role), ROLES)}; roles: {', '.join(ROLES)}")
        if isinstance(gpus, str):
            try:
                gpus = [int(x) for x in gpus.replace("cuda:", "").split(",") if x.strip()]
            except ValueError:
                raise ConfigError(f"{where}: expected GPU ids like [0,1] or '0,1', got {gpus!r}") from None
            mapping[role] = gpus
        if not isinstance(gpus, list) or not gpus or not all(isinstance(g, int) and not isinstance(g, bool)
                                                              for g in gpus):
            raise ConfigError(f"{where}: expected a non-empty list of GPU ids like [0, 1], got {gpus!r}")
        bad = [g for g in gpus if not 0 <= g < n_gpus]
        if bad:
            raise ConfigError(f"{where}: GPU id(s) {bad} outside 0..{n_gpus - 1} (trainer.n_gpus_per_node={n_gpus})")
        if len(set(gpus)) != len(gpus):
            raise ConfigError(f"{where}: GPU ids repeat: {gpus}")


_INTERP = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")


def _interpolate(cfg: dict) -> None:
    def resolve(value: Any, key: str, depth: int = 0) -> Any:
        if not isinstance(value, str) or "${" not in value:
            return value
        if depth > 8:
            raise ConfigError(f"config key '{key}': interpolation loop in {value!r}")

        def repl(m: re.Match) -> str:
            target = Section(cfg).get_path(m.group(1), default=KeyError)
            if target is KeyError:
                raise ConfigError(f"config key '{key}': '${{{m.group(1)}}}' names no config key")
            return str(resolve(target, m.group(1), depth + 1))

        return _INTERP.sub(repl, value)

    for key, value in _flatten(cfg).items():
        if isinstance(value, str) and "${" in value:
            _set(cfg, key, resolve(value, key))


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (),
                base: Mapping | None = None) -> Section:
    """Defaults, then ``path`` (YAML), then ``base`` (a dict), then ``key=value`` overrides; validated."""
    schema = load_defaults()
    cfg = copy.deepcopy(schema)
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} not found; pass an existing YAML file to --config")
        data = read_yaml(p, "config file", ConfigError)[0] or {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"config file {p}: expected a mapping of sections (data:, trainer:, ...)")
        _merge(cfg, data, schema, f"config file {p}")
    if base:
        _merge(cfg, base, schema, "config")
    for item in overrides:
        key, value = _parse_override(item)
        _check_key(schema, key, f"override '{item}'")
        if isinstance(value, Mapping):
            _merge(cfg, {key: value} if "." not in key else _nest(key, value), schema, f"override '{item}'")
        else:
            sub: Any = schema
            for part in key.split("."):
                sub = sub[part] if isinstance(sub, Mapping) and part in sub else None
            if isinstance(sub, Mapping) and value is None and key in _NULLABLE_SECTIONS:
                value = copy.deepcopy(sub)
            elif isinstance(sub, Mapping) and key != "hpc_verl.device_mapping":
                raise ConfigError(f"override '{item}': '{key}' is a section; set one of its keys, "
                                  f"e.g. {key}.{next(iter(sub))}=...")
            _set(cfg, key, value)
    _validate_values(_flatten(schema), cfg)
    _interpolate(cfg)
    _fill_derived(cfg)
    refuse_unsupported(cfg)
    derive_sequence_parallel(cfg)
    derive_micro_batches(cfg)
    return _sectioned(cfg)


def _nest(dotted: str, value: Any) -> dict:
    out: dict = {}
    _set(out, dotted, value)
    return out


def _fill_derived(cfg: dict) -> None:
    """Resolve the null-means-'same as' defaults, as verl's interpolations do."""
    actor = cfg["actor_rollout_ref"]["actor"]
    critic = cfg["critic"]
    for k in ("clip_ratio_low", "clip_ratio_high"):
        if actor[k] is None:
            actor[k] = actor["clip_ratio"]
    if critic["ppo_mini_batch_size"] is None:
        critic["ppo_mini_batch_size"] = actor["ppo_mini_batch_size"]
    if critic["ppo_epochs"] is None:
        critic["ppo_epochs"] = actor["ppo_epochs"]
    for k in ("shuffle", "loss_agg_mode", "loss_scale_factor"):   # verl's critic.yaml takes the actor's
        if critic[k] is None:
            critic[k] = actor[k]
    for optim in (actor["optim"], critic["optim"]):   # verl's deprecated name wins, as in verl
        if optim["warmup_style"] is not None:
            optim["lr_scheduler_type"] = optim["warmup_style"]
    if critic["enable"] is None:
        critic["enable"] = cfg["algorithm"]["adv_estimator"] == "gae"
    if critic["model"]["path"] is None:
        critic["model"]["path"] = cfg["actor_rollout_ref"]["model"]["path"]
    if cfg["data"]["seed"] is None:
        cfg["data"]["seed"] = cfg["trainer"]["seed"]
    hv = cfg["hpc_verl"]
    if hv["old_log_prob_from_rollout"] is None:
        rollout = cfg["actor_rollout_ref"]["rollout"]
        hv["old_log_prob_from_rollout"] = rollout["name"] == "hf" and (
            cfg["trainer"]["device"] == "cpu" or rollout["dtype"] == "float32")
    if cfg["hpc_verl"]["run_dir"] is None:
        cfg["hpc_verl"]["run_dir"] = cfg["trainer"]["default_local_dir"]


def n_gpus_total(cfg: Mapping) -> int:
    """GPUs the job uses: 0 on CPU."""
    trainer = cfg["trainer"]
    if trainer.get("device", "cuda") == "cpu":
        return 0
    return int(trainer.get("nnodes", 1)) * int(trainer.get("n_gpus_per_node", 0))


def check_batch_arithmetic(cfg_dict: Mapping, n_gpus_total: int) -> list[str]:
    """Problems with batch sizes when every role runs on ``n_gpus_total`` GPUs (0: CPU), one line each.

    The rules, defaults and wording are ``hpc_verl.util.batch_rules``, the ones the
    launcher checks upstream verl jobs with; a trainer whose roles have their own GPU
    groups passes each group's size to ``batch_problems`` instead.
    """
    return batch_problems(cfg_dict, {role: n_gpus_total for role in BATCH_ROLES})


def batch_problems_for(cfg: Mapping) -> list[str]:
    """Batch arithmetic against the real sizes of the roles' worker groups (CPU ranks count
    like GPUs: every rank takes an equal share of a mini-batch)."""

    topo = topology(cfg)
    sizes = {}
    for role in BATCH_ROLES:
        g = topo.group_of(role)
        sizes[role] = g.world_size if g else 1
    problems = batch_problems(cfg, sizes)
    tbs, n = cfg["data"]["train_batch_size"], cfg["actor_rollout_ref"]["rollout"]["n"]
    for role, key, sp_key in (("actor", "actor_rollout_ref.actor.ppo_mini_batch_size",
                               "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"),
                              ("critic", "critic.ppo_mini_batch_size", "critic.fsdp.ulysses_sequence_parallel_size")):
        if role == "critic" and not cfg["critic"]["enable"]:
            continue
        mini = get_path(cfg, key)
        dp = max(1, sizes[role] // max(1, int(get_path(cfg, sp_key) or 1)))
        if isinstance(mini, int) and 0 < mini < tbs and tbs % mini and ((tbs % mini) * n) % dp:
            problems.append(f"data.train_batch_size ({tbs}) is not a multiple of {key} ({mini}): its last, "
                            f"smaller mini-batch ({tbs % mini} x n={n} responses) does not split over the "
                            f"{dp} data-parallel ranks of the {role}; make the train batch a multiple of it")
    return problems


def validate_for_run(cfg: Mapping) -> None:
    """Checks that need the whole config (raise the first problem as one line)."""
    problems = batch_problems_for(cfg)
    if problems:
        raise ConfigError(problems[0])
    if cfg["actor_rollout_ref"]["model"]["path"] is None:
        raise ConfigError("actor_rollout_ref.model.path is not set; give a local Hugging Face model directory "
                          "(make one with: hpc-verl make-tiny-model DIR)")
    if cfg["data"]["train_files"] is None:
        raise ConfigError("data.train_files is not set; give a parquet file in verl's schema "
                          "(make one with: hpc-verl preprocess gsm8k --input FILE --output DIR)")
    if cfg["trainer"]["resume_mode"] == "resume_path" and not cfg["trainer"]["resume_from_path"]:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path=DIR")
    est = cfg["algorithm"]["adv_estimator"]
    if est in ("grpo", "rloo") and cfg["actor_rollout_ref"]["rollout"]["n"] < 2:
        raise ConfigError(f"algorithm.adv_estimator={est} needs actor_rollout_ref.rollout.n >= 2 "
                          "(the baseline is each prompt's group of responses)")
    if cfg["algorithm"]["adv_estimator"] == "gae" and not cfg["critic"]["enable"]:
        raise ConfigError("algorithm.adv_estimator=gae needs a critic; set critic.enable=true or use "
                          "algorithm.adv_estimator=grpo")
    if cfg["actor_rollout_ref"]["rollout"]["name"] == "vllm":   # here, where the workers run, not on a login node
        check_vllm_install(str(cfg["trainer"]["device"]))


def to_yaml(cfg: Mapping) -> str:
    return yaml.safe_dump(_plain(cfg), sort_keys=False)
