"""Rendering profiles + job configs into sbatch scripts with one strict Jinja environment.

Rules that keep the scripts safe and reviewable:
- one ``Environment`` with ``StrictUndefined``: a missing variable is an error,
  never an empty string in a shell command;
- every profile or user value that reaches the shell goes through ``shquote``
  (``#SBATCH`` lines, which bash does not evaluate, only carry values that the
  schema restricted to a safe character set);
- each template gets its variables from exactly one context function
  (``CONTEXTS``), so what a template can see is written down in one place;
- the output is deterministic (no timestamps, no paths of the rendering
  machine): golden files compare byte for byte.
"""
from __future__ import annotations

import math
import os
import re
import shlex
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Optional

import jinja2

from hpc_verl._version import __version__
from hpc_verl.bootstrap.timing import FAILURE_REPORT_S
from hpc_verl.errors import FAILURE_FILE_NAME, RenderError
from hpc_verl.launch.spec.jobconfig import JobConfig
from hpc_verl.profiles.schema import Profile, parse_size_bytes
from hpc_verl.errors import REQUEUE_EXIT_CODE
from hpc_verl.util.package import PACKAGE_DIR
from hpc_verl.util.rayready import READY_FILE_ENV, READY_FILE_NAME, READY_TIMEOUT_ENV

STAGES = ("validate", "preprocess", "model-check", "ray-up", "train", "collect")
SBATCH_TEMPLATE = "job.sbatch.j2"
_SBATCH_SAFE = re.compile(r"^[A-Za-z0-9_.,:/@%+=\[\]-]+$")
REQUEUE_EXIT_VAR = "HPC_VERL_REQUEUE_EXIT_CODE"  # the variable hpc_verl.errors reads the code from
VERL_HYDRA_RUN_DIR = "hydra.run.dir"  # where verl's Hydra writes its outputs/ (derived: the run directory)


def job_stages(hold: bool = False) -> tuple[str, ...]:
    """The job's stages in order; a cluster job (``hold``) keeps Ray up where others train."""
    return tuple("hold" if st == "train" else st for st in STAGES) if hold else STAGES


def templates_dir() -> Path:
    """Templates shipped in the package (a link to the repo's templates/)."""
    return PACKAGE_DIR / "templates"


def shquote(value: Any) -> str:
    """Quote one value for bash: a literal, whatever it holds (booleans as true/false).

    Plain single quotes (``shlex.quote``), except for a value holding ``$``, a backtick or a
    backslash: that one becomes bash's ``$'...'`` literal (only ``\\`` and ``'`` escaped). Both
    mean the same to bash, but shellcheck takes ``'a $(b)'`` for a forgotten expansion (SC2016)
    and ``'a\'`` for a botched escape (SC1003), and knows that ``$'...'`` holds neither, so a
    script with such a user value passes shellcheck while the same text in a template is still
    reported."""
    if value is None or isinstance(value, jinja2.Undefined):
        raise RenderError("internal: an unset value reached the shell quoting filter; please report this")
    if isinstance(value, bool):
        value = "true" if value else "false"
    text = str(value)
    if "\x00" in text:
        raise RenderError(f"value {text!r} contains a NUL character and cannot be passed to the shell")
    if any(c in text for c in "$`\\"):
        return "$'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return shlex.quote(text)


def sharray(values: Any) -> str:
    """Quoted items of a bash array literal body: ``'a' 'b c'``."""
    return " ".join(shquote(v) for v in values)


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    """The one Jinja environment for every template."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        # bash uses "{#" (${#array[@]}); Jinja comments get a spelling bash never has
        comment_start_string="<#--",
        comment_end_string="--#>",
    )
    env.filters["shquote"] = shquote
    env.filters["sharray"] = sharray
    return env


def docker_size(text: str) -> str:
    """``"128G"`` -> ``"128g"``; ``"1T"`` -> ``"1024g"`` (docker/podman spelling)."""
    n = parse_size_bytes(text)
    for unit, factor in (("g", 1024 ** 3), ("m", 1024 ** 2), ("k", 1024)):
        if n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)  # pragma: no cover - sizes are whole kilobytes by schema


def _time_hms(minutes: int) -> str:
    days, rest = divmod(minutes, 24 * 60)
    hours, mins = divmod(rest, 60)
    return f"{days}-{hours:02d}:{mins:02d}:00" if days else f"{hours:02d}:{mins:02d}:00"


def _sbatch_value(key: str, value: str) -> str:
    if not _SBATCH_SAFE.match(value):
        raise RenderError(f"{key} {value!r} cannot go into an #SBATCH line (only letters, digits and "
                          "_.,:/@%+=[]- are allowed there); choose a simpler value")
    return value


def sbatch_options(profile: Profile, job: JobConfig) -> list[str]:
    """The ``#SBATCH`` options, each one token with no quoting needed."""
    s = profile.slurm
    opts = [f"--job-name={job.name}", f"--nodes={s.nodes}", "--ntasks-per-node=1", f"--cpus-per-task={s.cpus_per_task}"]
    if s.gpus_per_node:
        opts.append(f"--gpus-per-node={s.gpus_per_node}" if s.gpu_request == "gpus-per-node"
                    else f"--gres=gpu:{s.gpus_per_node}")
    if s.mem_gb is not None:
        opts.append(f"--mem={s.mem_gb}G" if s.mem_gb else "--mem=0")
    opts.append(f"--time={_time_hms(s.time_min)}")
    for key in ("partition", "account", "qos", "constraint"):
        value = getattr(s, key)
        if value:
            opts.append(f"--{key}={value}")
    if s.exclusive:
        opts.append("--exclusive")
    opts.append("--requeue" if s.requeue else "--no-requeue")
    opts.append(f"--signal=B:{s.signal}@{s.signal_lead_s}")
    opts.append("--open-mode=append")
    log_dir = _sbatch_value("paths.job_root", profile.paths.job_root.rstrip("/") or "/")
    opts.append(f"--output={log_dir}/%x-%j.out")
    opts.extend(s.extra_args)
    return opts


def env_block(profile: Profile) -> list[tuple[str, str, str]]:
    """(name, value, why) for the exported environment, in order; user ``env.vars`` last (they win)."""
    n, e, out = profile.network, profile.env, []
    out.append(("PYTHONUNBUFFERED", "1", "logs appear as they are written"))
    out.append(("RAY_USAGE_STATS_ENABLED", "0", "no telemetry from compute nodes"))
    out.append(("TOKENIZERS_PARALLELISM", "true" if e.tokenizers_parallelism else "false",
                "tokenizer threads vs. forked workers"))
    if e.cuda_device_max_connections is not None:
        out.append(("CUDA_DEVICE_MAX_CONNECTIONS", str(e.cuda_device_max_connections),
                    "kernel ordering for compute/communication overlap"))
    if e.hf_offline:
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
            out.append((name, "1", "no hub downloads inside jobs"))
    ifname = n.socket_ifname or n.interface
    if n.transport in ("infiniband", "roce"):
        out.append(("NCCL_IB_DISABLE", "0", "use the RDMA HCAs"))
        out.append(("NCCL_IB_HCA", ",".join(n.ib_hcas), "HCAs from the profile"))
        if n.transport == "roce":
            out.append(("NCCL_IB_GID_INDEX", str(n.gid_index), "RoCE v2 GID index"))
    else:
        out.append(("NCCL_IB_DISABLE", "1", f"{n.transport}: no RDMA"))
    if ifname:
        out.append(("NCCL_SOCKET_IFNAME", ifname, "bootstrap/socket traffic interface"))
        out.append(("GLOO_SOCKET_IFNAME", ifname, "torch.distributed gloo interface"))
    if e.nccl_debug:
        out.append(("NCCL_DEBUG", e.nccl_debug, "NCCL log level"))
    if REQUEUE_EXIT_VAR not in e.vars:  # the trainer in the container exits with the code the script tests
        out.append((REQUEUE_EXIT_VAR, str(requeue_exit_code(profile)),
                    "the trainer's 'checkpointed, requeue me' exit status"))
    if profile.accelerator == "amd":
        out.append(("HSA_NO_SCRATCH_RECLAIM", "1", "ROCm: keep scratch memory (as verl sets for its workers); "
                    "RCCL reads the NCCL_* variables above"))
    if "WANDB_MODE" not in e.vars:   # compute nodes rarely reach wandb.ai: record offline, `wandb sync` later
        out.append(("WANDB_MODE", "offline", "trainer.logger wandb: offline on compute nodes (wandb sync later)"))
    for name, value in e.vars.items():
        out.append((name, value, "profile env.vars"))
    return out


def requeue_exit_code(profile: Profile) -> int:
    """The exit status that means "checkpointed, requeue me": the trainer's constant
    (``errors.REQUEUE_EXIT_CODE``), or the profile's ``env.vars`` value of its
    variable when the profile sets one (the trainer in the job then reads that)."""
    text = profile.env.vars.get(REQUEUE_EXIT_VAR)
    if text is None:
        return REQUEUE_EXIT_CODE
    if not text.strip().isdigit() or not 3 <= int(text) <= 125:
        raise RenderError(f"env.vars.{REQUEUE_EXIT_VAR} {text!r} must be an exit status from 3 to 125 "
                          "(0-2 mean done/failed/bad input, 126+ are the shell's); e.g. 99")
    return int(text)


def _job_paths(profile: Profile, job: JobConfig) -> None:
    """Absolute job paths must be inside a directory that is mounted into the container: the submit
    directory (where the job is submitted from: this process's working directory, as sbatch's), the
    profile's ``paths.*`` and ``container.mounts``."""
    if profile.container.runtime == "none":
        return
    roots = [os.getcwd()]
    roots += [p for p in (profile.paths.job_root, profile.paths.data_dir, profile.paths.model_dir,
                          profile.paths.cache_dir) if p.startswith("/")]
    roots += [m.split(":")[0] for m in profile.container.mounts if m.startswith("/")]
    roots += [os.path.realpath(r) for r in roots]

    def inside(value: str) -> bool:
        return any(v.rstrip("/") == r.rstrip("/") or v.startswith(r.rstrip("/") + "/")
                   for r in roots for v in (value, os.path.realpath(value)))

    for key, value in (("data.raw", job.data.raw), ("data.dir", job.data.dir), ("model.path", job.model.path)):
        if value and value.startswith("/") and not inside(value):
            raise RenderError(f"job config {job.source}: {key} {value!r} is outside every directory mounted into "
                              "the container (the submit directory, paths.*, container.mounts); use a relative "
                              "path or add a mount with --set container.mounts=[...]")


def derived_overrides(profile: Profile, job: JobConfig) -> list[tuple[str, str]]:
    """Trainer overrides the launcher adds (unless the job sets them): (key, fixed shell expression)."""
    if not job.trainer.derive_overrides:
        return []
    wanted = [("trainer.nnodes", "$HPCV_NODES"), ("trainer.n_gpus_per_node", "$HPCV_GPUS_PER_NODE"),
              ("data.train_files", "$HPCV_DATA_PATH/$HPCV_TRAIN_FILE"),
              ("data.val_files", "$HPCV_DATA_PATH/$HPCV_VAL_FILE"),
              ("trainer.default_local_dir", "$HPCV_RUN_DIR/checkpoints")]
    if job.model.path:
        wanted.append(("actor_rollout_ref.model.path", "$HPCV_MODEL_PATH"))
    if _is_verl(job):
        from hpc_verl.verl_upstream.expiry import derived_overrides as verl_expiry_overrides
        wanted += verl_expiry_overrides(profile.slurm.signal_lead_s)
        # verl's Hydra writes outputs/<date>/<time>/ into the working directory: keep it in the run
        wanted.append((VERL_HYDRA_RUN_DIR, "$HPCV_RUN_DIR/hydra"))
        cpu = _verl_cpu(profile, job)
        if cpu is not None:  # CPU nodes: logical GPUs, and the settings CPU needs
            wanted = [(k, str(cpu["gpus_per_node"]) if k == "trainer.n_gpus_per_node" else v) for k, v in wanted]
            wanted += cpu["overrides"]
    else:
        from hpc_verl.launch.spec.trainer_check import builtin_device_overrides
        device = dict(builtin_device_overrides(profile))
        wanted = [(k, device.pop(k, v)) for k, v in wanted] + list(device.items())
    given = {k.lstrip("+~") for k in job.trainer.overrides}
    return [(k, v) for k, v in wanted if k.lstrip("+") not in given]


def _starts_with_ray(job: JobConfig) -> bool:
    from hpc_verl.launch.spec.trainer_check import starts_with_ray
    return starts_with_ray(job)


def _is_verl(job: JobConfig) -> bool:
    from hpc_verl.launch.spec.trainer_check import trainer_kind
    return trainer_kind(job) == "verl"


def _verl_cpu(profile: Profile, job: JobConfig) -> dict[str, Any] | None:
    """An upstream verl job on a CPU profile (``verl_upstream.cpu.rules``): its Ray resources,
    environment and overrides (None: not such a job)."""
    from hpc_verl.verl_upstream.cpu import rules

    if not rules.applies(profile, job):
        return None
    user = job.trainer_override_args()
    ranks = profile.cpu.ranks_per_node
    return {"gpus_per_node": ranks, "num_cpus": rules.ray_cpus(user, ranks),
            "env": rules.env(profile.env.vars) + rules.cpu_set_env(user, ranks),
            "overrides": rules.derived_overrides(user)}


def _held_cpu_slots(profile: Profile) -> dict[str, Any] | None:
    """A cluster held on CPU nodes (``hpc-verl cluster up``) declares what a verl CPU job sent into it
    asks for: the logical GPU slots and the CPUs its actors hold (at least the allocation's CPUs)."""
    if profile.accelerator != "none":
        return None
    from hpc_verl.verl_upstream.cpu import rules

    gpus = rules.LOGICAL_GPUS_PER_NODE
    return {"gpus_per_node": gpus, "num_cpus": max(rules.ray_cpus([], gpus), profile.slurm.cpus_per_task),
            "env": [], "overrides": []}


def job_env(profile: Profile, job: JobConfig) -> list[tuple[str, str, str]]:
    """The job's exported environment: the profile's (``env_block``), then what its trainer needs
    (a verl job on CPU: verl's plugin and platform, vLLM-CPU's settings)."""
    cpu = _verl_cpu(profile, job)
    return env_block(profile) + (cpu["env"] if cpu else [])


def _expiry_context(profile: Profile, job: JobConfig) -> dict[str, Any] | None:
    """What partials/verl_expiry.sh.j2 renders: SLURM jobs of upstream verl only (None: not rendered)."""
    if profile.scheduler != "slurm" or not _is_verl(job):
        return None
    from hpc_verl.errors import REQUEUE_EXIT_CODE
    from hpc_verl.verl_upstream import expiry
    return {"env": expiry.EXPIRY_ENV, "poll_s": int(expiry.POLL_DEFAULT_S), "requeue_exit": REQUEUE_EXIT_CODE}


def _watchdog_context() -> dict[str, Any]:
    """The stall watchdog's names the batch script uses (``bootstrap.watchdog``)."""
    from hpc_verl.bootstrap import watchdog
    return {"stall_file": watchdog.STALL_FILE, "stacks_dir": watchdog.STACKS_DIR, "stall_exit": watchdog.STALL_EXIT,
            "self_env": watchdog.SELF_ENV}


def sbatch_context(profile: Profile, job: JobConfig, hold: bool = False,
                   job_id: Optional[int] = None) -> dict[str, Any]:
    """Everything job.sbatch.j2 and its partials may use (the only context of that template).

    ``hold``: a cluster job (``hpc-verl cluster up``): the hold stage replaces train. ``job_id``:
    the job's fixed id (a local job); None: SLURM's, or the shell's pid when run by hand."""
    c, n = profile.container, profile.network
    devices = list(n.ib_devices) if n.transport in ("infiniband", "roce") else []
    devices += [d for d in c.devices if d not in devices]
    _job_paths(profile, job)
    return {
        "version": __version__,
        "profile": profile,
        "job": job,
        "stages": job_stages(hold),
        "hold": hold,
        "slurm": profile.scheduler == "slurm",
        "sbatch_options": sbatch_options(profile, job) if profile.scheduler == "slurm" else [],
        "runtime": c.runtime,
        "runtime_partial": f"partials/runtime/{'apptainer' if c.runtime == 'singularity' else c.runtime}.sh.j2",
        "shm_size": docker_size(c.shm_size),
        "devices": devices,
        "env": job_env(profile, job),
        "verl_cpu": _verl_cpu(profile, job) or (_held_cpu_slots(profile) if hold else None),
        "trainer_args": [*job.trainer.args, *job.trainer_override_args()],
        "derived": derived_overrides(profile, job),
        "requeue_exit_code": requeue_exit_code(profile),
        "verl_job": _is_verl(job),
        "early_train": not hold and _starts_with_ray(job),
        "ray_ready": {"file": READY_FILE_NAME, "env": READY_FILE_ENV, "timeout_env": READY_TIMEOUT_ENV},
        "watchdog": _watchdog_context(),
        "expiry": _expiry_context(profile, job),
        "job_id": job_id,
        "failure_file": FAILURE_FILE_NAME,
        "node_failure_report_ds": math.ceil(FAILURE_REPORT_S * 10),
    }


# template -> its one context function
CONTEXTS: dict[str, Callable[..., dict[str, Any]]] = {SBATCH_TEMPLATE: sbatch_context}


def render_template(name: str, *args: Any) -> str:
    """Render ``name`` with the variables of its context function; template errors become RenderError."""
    context = CONTEXTS[name](*args)
    try:
        return environment().get_template(name).render(**context)
    except jinja2.UndefinedError as exc:
        raise RenderError(f"template {name}: {exc} (a template bug: the context function does not provide it)") \
            from None
    except jinja2.TemplateError as exc:
        raise RenderError(f"template {name}: {exc}") from None


def render_sbatch(profile: Profile, job: Optional[JobConfig] = None, hold: bool = False,
                  job_id: Optional[int] = None) -> str:
    """The sbatch script (text) for a resolved profile and job config (``hold``: a cluster job;
    ``job_id``: a fixed job id, see ``sbatch_context``)."""
    return render_template(SBATCH_TEMPLATE, profile, job or JobConfig(), hold, job_id)
