"""The cluster profile schema: typed sections, strict keys, checked values.

A profile is plain YAML; this module turns the merged mapping into typed
dataclasses. Every field carries a one-line doc (``docs/profiles.md`` is checked
against it) and an optional check that returns a problem description. Values
that end up in the rendered shell script are quoted by the template, but the
characters a value can never sensibly contain (newlines, NUL, and for names that
go into ``#SBATCH`` lines anything beyond a safe set) are refused here, so a bad
value fails with one line instead of producing a surprising script.
"""
from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from hpc_verl.errors import ProfileError
from hpc_verl.util.fields import (Ctx, abs_path, between, build, choice, field_docs, matches, no_control, non_empty,
                                  path_value, spec)

RUNTIMES = ("docker", "podman", "apptainer", "singularity", "enroot-pyxis", "none")
ACCELERATORS = ("nvidia", "amd", "fake", "none")
TRANSPORTS = ("infiniband", "roce", "ethernet", "loopback")
SCHEDULERS = ("slurm", "local")
SIGNALS = ("USR2", "TERM", "INT", "HUP", "URG", "XCPU")
NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")

_SIZE_RE = re.compile(r"^(\d+)([kKmMgGtT])(?:i?[bB])?$")
_SLURM_NAME_RE = re.compile(r"^[A-Za-z0-9_.,+-]{1,128}$")
_IFACE_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,15}$")
_SOCKET_IFNAME_RE = re.compile(r"^[\^=]?[A-Za-z0-9_.:-]{1,15}(,[\^=]?[A-Za-z0-9_.:-]{1,15})*$")
_HCA_RE = re.compile(r"^[\^=]?[A-Za-z0-9_]{1,32}(:\d{1,2})?$")
_IMAGE_RE = re.compile(r"^[A-Za-z0-9._/:@#+-]{1,512}$")
_EXEC_RE = re.compile(r"^[A-Za-z0-9_./+-]{1,256}$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_SBATCH_ARG_RE = re.compile(r"^--[a-z][a-z0-9-]*(=[A-Za-z0-9_.,:/@%+=\[\]-]+)?$")
_CONSTRAINT_RE = re.compile(r"^[A-Za-z0-9_.,&|*\[\]()-]{1,256}$")
_ULIMIT_VALUE_RE = re.compile(r"^(-1|unlimited|\d+)(:(-1|unlimited|\d+))?$")
# the resources `docker run --ulimit` / `podman run --ulimit` know
ULIMITS = ("core", "cpu", "data", "fsize", "locks", "memlock", "msgqueue", "nice", "nofile", "nproc", "rss", "rtprio",
           "rttime", "sigpending", "stack")
ULIMIT_RUNTIMES = ("docker", "podman")


def parse_size_bytes(text: str) -> int:
    """``"128G"`` -> bytes (binary units: k, M, G, T)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(text)
    return int(m.group(1)) * 1024 ** ("kmgt".index(m.group(2).lower()) + 1)


# ----------------------------------------------------------------------------- checks
def _size(v: str) -> Optional[str]:
    try:
        if parse_size_bytes(v) <= 0:
            return f"must be a positive size like '64G', got {v!r}"
    except ValueError:
        return f"must be a size like '64G', '512M' or '1T', got {v!r}"
    return None


def _mount(v: str) -> Optional[str]:
    parts = v.split(":")
    if no_control(v) or len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
        return no_control(v) or f"must be 'SRC:DST' or 'SRC:DST:ro|rw', got {v!r}"
    return path_value(parts[0]) or path_value(parts[1]) or (
        None if parts[1].startswith("/") else
        f"destination must be an absolute path inside the container, got {parts[1]!r}")


def _device(v: str) -> Optional[str]:
    return abs_path(v) or (None if v.startswith("/dev/") else f"must be a device path under /dev/, got {v!r}")


def _ulimit_value(v: str) -> Optional[str]:
    if _ULIMIT_VALUE_RE.match(v):
        return None
    return f"must be 'SOFT' or 'SOFT:HARD' (numbers, -1 = unlimited; quote it in YAML), got {v!r}"


def _signal(v: str) -> Optional[str]:
    if v in ("USR1", "SIGUSR1"):
        return "must not be USR1 (NCCL uses SIGUSR1); use USR2"
    return choice(SIGNALS)(v)


def _env_value(v: str) -> Optional[str]:
    return no_control(v)


def _env_name(v: str) -> Optional[str]:
    if not _ENV_NAME_RE.match(v):
        return f"must be a shell variable name like NCCL_DEBUG, got {v!r}"
    if v.startswith("HPCV_") or v in ("SLURM_JOB_ID", "PATH", "HOME"):
        return f"{v} is set by the launcher and cannot be overridden"
    return None


# ----------------------------------------------------------------------------- sections
@dataclass
class SlurmSection:
    """What the sbatch header asks for."""

    partition: Optional[str] = spec(None, doc="SLURM partition (`--partition`); unset = the site default",
                                    check=matches(_SLURM_NAME_RE, "a SLURM name"))
    account: Optional[str] = spec(None, doc="account to charge (`--account`)",
                                  check=matches(_SLURM_NAME_RE, "a SLURM name"))
    qos: Optional[str] = spec(None, doc="quality of service (`--qos`)",
                              check=matches(_SLURM_NAME_RE, "a SLURM name"))
    nodes: int = spec(1, doc="number of nodes (`--nodes`), one container and one Ray node each",
                      check=between(1, 10000))
    gpus_per_node: int = spec(0, doc="GPUs per node; 0 for CPU-only jobs", check=between(0, 64))
    gpu_request: str = spec("gpus-per-node", doc="how GPUs are requested: `gpus-per-node` (`--gpus-per-node=N`) "
                            "or `gres` (`--gres=gpu:N`, older sites)", check=choice(("gpus-per-node", "gres")))
    cpus_per_task: int = spec(1, doc="CPUs for the one task per node (`--cpus-per-task`)", check=between(1, 4096))
    mem_gb: Optional[int] = spec(None, doc="memory per node in GB (`--mem`); 0 = all of it; unset = site default",
                                 check=between(0, 65536))
    time_min: int = spec(60, doc="time limit in minutes (`--time`)", check=between(1, 525600))
    constraint: Optional[str] = spec(None, doc="node features (`--constraint`)",
                                     check=matches(_CONSTRAINT_RE, "a SLURM constraint expression"))
    exclusive: bool = spec(False, doc="ask for whole nodes (`--exclusive`)")
    requeue: bool = spec(True, doc="let SLURM requeue the job after preemption or node failure (`--requeue`)")
    max_restarts: int = spec(3, doc="how many times the job requeues itself (preemption signal, lost node)",
                             check=between(0, 100))
    signal: str = spec("USR2", doc="signal sent before the time limit (`--signal=B:SIG@lead`); never USR1, "
                       "which NCCL uses", check=_signal)
    signal_lead_s: int = spec(300, doc="seconds before the time limit that the signal arrives (checkpoint time)",
                              check=between(10, 65535))
    extra_args: list[str] = spec(default_factory=list, doc="more `#SBATCH` options, one `--opt[=value]` each "
                                 "(no spaces or quotes)",
                                 item_check=matches(_SBATCH_ARG_RE, "an option like '--mail-type=END'"))


@dataclass
class ContainerSection:
    """One container per node: runtime, image and the flags the site needs."""

    runtime: str = spec("none", doc="`docker`, `podman`, `apptainer`, `singularity`, `enroot-pyxis` "
                        "(`srun --container-image`) or `none` (run on the host)", check=choice(RUNTIMES))
    image: Optional[str] = spec(None, doc="image reference, `.sif` path or enroot image (`nvcr.io#nvidia/pytorch`)",
                                check=matches(_IMAGE_RE, "an image reference without spaces or quotes"))
    shm_size: str = spec("16G", doc="`/dev/shm` size for the container (`--shm-size`), e.g. `128G`", check=_size)
    init: bool = spec(True, doc="run an init process as PID 1 (`--init`) where the runtime has one")
    ipc_lock: bool = spec(True, doc="add the IPC_LOCK capability (RDMA memory registration)")
    memlock_unlimited: bool = spec(True, doc="raise the memlock ulimit to unlimited (`--ulimit memlock=-1:-1`)")
    ulimits: dict[str, str] = spec(default_factory=dict, doc="resource limits inside the container, `NAME: "
                                   "'SOFT[:HARD]'` (`-1` = unlimited) as `--ulimit NAME=VALUE` (docker, podman)",
                                   key_check=choice(ULIMITS), item_check=_ulimit_value)
    global_flags: list[str] = spec(default_factory=list, doc="runtime options before the verb, one argument each "
                                   "(podman: `--runtime`, `runc`, `--cgroup-manager=cgroupfs`)", item_check=non_empty)
    run_flags: list[str] = spec(default_factory=list, doc="extra options for `run`/`instance start` (for "
                                "`enroot-pyxis`: extra `srun` options), one argument each (`--ulimit`, "
                                "`nofile=1024:1024`)", item_check=non_empty)
    mounts: list[str] = spec(default_factory=list, doc="extra bind mounts `SRC:DST[:ro|rw]`; the submit, job, data, "
                             "model and cache directories are always mounted at their own paths", item_check=_mount)
    devices: list[str] = spec(default_factory=list, doc="extra host devices to pass in (`/dev/...`)",
                              item_check=_device)
    start_timeout_s: int = spec(600, doc="bound on starting the containers on all nodes (image pulls included)",
                                check=between(10, 7200))

    def ulimit_values(self) -> list[str]:
        """``NAME=SOFT[:HARD]`` for each ``--ulimit`` the container gets (memlock_unlimited included)."""
        values = ["memlock=-1:-1"] if self.memlock_unlimited else []
        return values + [f"{name}={value}" for name, value in self.ulimits.items()]


@dataclass
class NetworkSection:
    """Interconnect: where NCCL and Ray talk."""

    transport: str = spec("ethernet", doc="`infiniband`, `roce`, `ethernet` (NCCL over sockets) or `loopback` "
                          "(single host test beds)", check=choice(TRANSPORTS))
    interface: Optional[str] = spec(None, doc="NIC whose IPv4 address the Ray head advertises (e.g. `ib0`, `eth0`); "
                                    "unset = the address of the default route",
                                    check=matches(_IFACE_RE, "a network interface name"))
    socket_ifname: Optional[str] = spec(None, doc="`NCCL_SOCKET_IFNAME` / `GLOO_SOCKET_IFNAME` (e.g. `eth0` or "
                                        "`^lo,docker`); unset = `interface`",
                                        check=matches(_SOCKET_IFNAME_RE, "interface names like 'eth0' or '^lo,docker'"))
    ib_hcas: list[str] = spec(default_factory=list, doc="HCAs for `NCCL_IB_HCA` (e.g. `mlx5_0:1`)",
                              item_check=matches(_HCA_RE, "an HCA name like 'mlx5_0' or 'mlx5_0:1'"))
    gid_index: Optional[int] = spec(None, doc="RoCE GID index (`NCCL_IB_GID_INDEX`); required for `roce`",
                                    check=between(0, 255))
    ib_devices: list[str] = spec(default_factory=lambda: ["/dev/infiniband"], doc="device paths passed to the "
                                 "container for `infiniband`/`roce`", item_check=_device)
    allow_loopback: bool = spec(False, doc="let the Ray head advertise a loopback address (test beds where all "
                                "'nodes' share one host)")


@dataclass
class EnvSection:
    """Environment exported before Ray starts, on every node and in every container."""

    hf_offline: bool = spec(True, doc="set `HF_HUB_OFFLINE`, `TRANSFORMERS_OFFLINE` and `HF_DATASETS_OFFLINE` to 1 "
                            "(no hub downloads in jobs)")
    tokenizers_parallelism: bool = spec(False, doc="value of `TOKENIZERS_PARALLELISM`")
    cuda_device_max_connections: Optional[int] = spec(1, doc="`CUDA_DEVICE_MAX_CONNECTIONS` (1 for Megatron-style "
                                                      "overlap); unset to leave it alone", check=between(1, 32))
    nccl_debug: Optional[str] = spec(None, doc="`NCCL_DEBUG` level", check=choice(NCCL_DEBUG_LEVELS))
    vars: dict[str, str] = spec(default_factory=dict, doc="more variables, `NAME: value` (values are quoted)",
                                key_check=_env_name, item_check=_env_value)


@dataclass
class RaySection:
    """Ray cluster inside the job. Ports are derived from the job id at run time."""

    port_base: int = spec(20000, doc="first port of the range Ray ports are carved from", check=between(1024, 65000))
    port_stride: int = spec(100, doc="ports per job: job `J` uses `port_base + (J % port_slots) * port_stride` "
                            "and the `port_stride` ports after it", check=between(20, 10000))
    port_slots: int = spec(120, doc="number of port blocks (jobs sharing a node never collide unless their ids "
                           "are equal modulo this); the default range 20000-31999 stays below the kernel's "
                           "ephemeral ports (32768+)", check=between(1, 10000))
    readiness_timeout_s: int = spec(300, doc="bound of the readiness barrier (all nodes and GPUs registered)",
                                    check=between(5, 7200))
    temp_dir_root: str = spec("/tmp/hpcv-ray", doc="root of the per-job Ray `--temp-dir` (keep it short: Unix "
                              "socket paths are limited to 107 bytes)", check=abs_path)
    python: str = spec("python3", doc="Python executable used for Ray and the trainer (inside the container)",
                       check=matches(_EXEC_RE, "an executable name or path"))
    dashboard: bool = spec(False, doc="start the Ray dashboard on the head node (port from the job's block)")
    client_server: bool = spec(False, doc="start Ray's Client server on the head (`ray://head:PORT`, port from "
                               "the job's block); off, `ray start` skips it: one Python process fewer on the "
                               "head's start-up path (about 0.5 s on a 2-core node)")


@dataclass
class CpuSection:
    """CPU-only nodes (``accelerator: none``): how many trainer ranks each node runs."""

    ranks_per_node: int = spec(1, doc="trainer ranks per CPU node (verl's `trainer.n_gpus_per_node`, Ray's logical "
                               "GPUs): 2 fits a `tensor_model_parallel_size=2` rollout in one node; at most "
                               "`slurm.cpus_per_task` (one CPU or more each)", check=between(1, 256))


@dataclass
class WatchdogSection:
    """The stall watchdog: a training run that makes no progress ends FAILED, with every process's stack."""

    stall_timeout_s: Optional[int] = spec(None, doc="end the job when no new training step (verl's `step:N` line, "
                                          "a `metrics.jsonl` record) came for this long; unset = derived from the "
                                          "first steps' times (never shorter than the first step with its "
                                          "start-up; the job log says what it chose)", check=between(10, 604800))
    startup_timeout_s: int = spec(1800, doc="bound on the time from the train stage's start to the first step "
                                  "(model load, engine start-up, first weight sync)", check=between(30, 604800))


@dataclass
class PathsSection:
    """Shared-filesystem locations, absolute or relative to the submit directory."""

    job_root: str = spec("jobs", doc="run directories go to `<job_root>/<job name>-<job id>`", check=path_value)
    data_dir: str = spec("data", doc="datasets (raw input and preprocessed parquet)", check=path_value)
    model_dir: str = spec("models", doc="model checkpoints and tokenizers to start from", check=path_value)
    cache_dir: str = spec(".cache/hpc_verl", doc="caches (`HF_HOME` is `<cache_dir>/huggingface`)", check=path_value)


@dataclass
class Profile:
    """A resolved cluster profile (after `extends:` and overrides)."""

    name: str = spec("", doc="profile name (the file name without `.yaml`; not set in the file)")
    description: str = spec("", doc="one line shown by `hpc-verl profiles list`", check=no_control)
    scheduler: str = spec("slurm", doc="`slurm` (sbatch/srun) or `local` (this machine, no SLURM)",
                          check=choice(SCHEDULERS))
    accelerator: str = spec("nvidia", doc="`nvidia`, `amd`, `fake` (test bed: SLURM GPUs that are placeholder "
                            "files; only the visible-device variables are set) or `none`", check=choice(ACCELERATORS))
    slurm: SlurmSection = spec(default_factory=SlurmSection, doc="sbatch resources and preemption")
    container: ContainerSection = spec(default_factory=ContainerSection, doc="container runtime")
    network: NetworkSection = spec(default_factory=NetworkSection, doc="interconnect")
    env: EnvSection = spec(default_factory=EnvSection, doc="exported environment")
    ray: RaySection = spec(default_factory=RaySection, doc="Ray bootstrap")
    paths: PathsSection = spec(default_factory=PathsSection, doc="shared-filesystem paths")
    cpu: CpuSection = spec(default_factory=CpuSection, doc="ranks per CPU node")
    watchdog: WatchdogSection = spec(default_factory=WatchdogSection, doc="stall watchdog")
    source: str = field(default="", compare=False, repr=False)
    provenance: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict of the schema fields (no provenance)."""
        out = dataclasses.asdict(self)
        out.pop("source")
        out.pop("provenance")
        return out

    def where(self, dotted_key: str) -> str:
        """Where a value came from: a file (with line), `extends`, `--set` or `default`."""
        return self.provenance.get(dotted_key, "default")

    def flat(self) -> dict[str, Any]:
        """``{"slurm.nodes": 2, ...}`` for tables and provenance."""
        return dict(_flatten(self.to_dict()))


# The top-level keys a profile file may contain that are not schema fields.
META_KEYS = ("extends",)


def _flatten(d: dict[str, Any], prefix: str = ""):
    for key, value in d.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from _flatten(value, dotted + ".")
        else:
            yield dotted, value


def section_classes() -> dict[str, type]:
    """Section name -> dataclass, for docs and key listings."""
    hints = typing.get_type_hints(Profile)
    return {f.name: hints[f.name] for f in dataclasses.fields(Profile) if dataclasses.is_dataclass(hints[f.name])}


def schema_fields(cls: type = Profile, prefix: str = ""):
    """Yield (dotted name, type text, default, doc) for every documented field."""
    return field_docs(cls, prefix)


# ----------------------------------------------------------------------------- building
def build_profile(name: str, data: dict[str, Any], where: Callable[[str], str]) -> Profile:
    """Typed, checked Profile from a merged mapping; raises ProfileError (one line)."""
    ctx = Ctx(lambda key: f"profile '{name}' ({where(key)})", ProfileError)
    body = {k: v for k, v in data.items() if k not in META_KEYS}
    profile: Profile = build(Profile, body, ctx, hidden=("name",), also_valid=META_KEYS)
    profile.name = name
    _check_consistency(profile, ctx)
    return profile


def _check_consistency(p: Profile, ctx: Ctx) -> None:
    """Rules that involve more than one field."""
    c, n, s, r = p.container, p.network, p.slurm, p.ray
    if c.runtime != "none" and not c.image:
        raise ctx.fail("container.image", f"is required for runtime '{c.runtime}'",
                       "set container.image or use runtime 'none'")
    if c.runtime == "none" and c.image:
        raise ctx.fail("container.image", "is set but container.runtime is 'none'",
                       "set container.runtime or remove the image")
    if c.ulimits and c.runtime not in ULIMIT_RUNTIMES:
        raise ctx.fail("container.ulimits", f"cannot be set by runtime '{c.runtime}'",
                       "set the limits on the nodes (limits.conf, SLURM PropagateResourceLimits) or use docker/podman")
    if c.memlock_unlimited and "memlock" in c.ulimits:
        raise ctx.fail("container.ulimits.memlock", "conflicts with container.memlock_unlimited: true",
                       "set container.memlock_unlimited: false to give memlock a value")
    if n.transport == "roce" and n.gid_index is None:
        raise ctx.fail("network.gid_index", "is required when network.transport is 'roce'",
                       "set it to the RoCE v2 GID index of your HCAs (often 3)")
    if n.transport in ("infiniband", "roce") and not n.ib_hcas:
        raise ctx.fail("network.ib_hcas", f"must list at least one HCA for transport '{n.transport}'",
                       "e.g. [mlx5_0, mlx5_1]")
    if n.transport in ("ethernet", "loopback") and (n.ib_hcas or n.gid_index is not None):
        raise ctx.fail("network.ib_hcas" if n.ib_hcas else "network.gid_index",
                       f"makes no sense with transport '{n.transport}'", "remove it or change network.transport")
    if r.port_base + r.port_slots * r.port_stride - 1 > 65535:
        raise ctx.fail("ray.port_slots", f"puts the port range past 65535 (port_base {r.port_base} + "
                       f"port_slots {r.port_slots} x port_stride {r.port_stride})", "lower port_slots or port_base")
    if p.scheduler == "local" and s.nodes != 1:
        raise ctx.fail("slurm.nodes", f"must be 1 for scheduler 'local', got {s.nodes}")
    if p.scheduler == "local" and c.runtime == "enroot-pyxis":
        raise ctx.fail("container.runtime", "enroot-pyxis needs SLURM (srun --container-image)",
                       "use scheduler 'slurm' or another runtime")
    if p.accelerator == "none" and s.gpus_per_node:
        raise ctx.fail("slurm.gpus_per_node", f"is {s.gpus_per_node} but accelerator is 'none'",
                       "set it to 0 or choose an accelerator; ranks per CPU node are cpu.ranks_per_node")
    if p.accelerator != "none" and p.cpu.ranks_per_node != 1:
        raise ctx.fail("cpu.ranks_per_node", f"is {p.cpu.ranks_per_node} but accelerator is '{p.accelerator}'",
                       "on GPU nodes the ranks per node are slurm.gpus_per_node; remove cpu.ranks_per_node")
    if p.scheduler == "slurm" and p.cpu.ranks_per_node > s.cpus_per_task:
        raise ctx.fail("cpu.ranks_per_node", f"is {p.cpu.ranks_per_node} but a node's task has "
                       f"{s.cpus_per_task} CPU(s) (slurm.cpus_per_task)",
                       f"raise slurm.cpus_per_task to at least {p.cpu.ranks_per_node} or lower cpu.ranks_per_node")
    if p.accelerator in ("nvidia", "amd") and s.gpus_per_node == 0:
        raise ctx.fail("slurm.gpus_per_node", f"is 0 but accelerator is '{p.accelerator}'",
                       "set the GPU count or accelerator 'none'")
    if len(r.temp_dir_root) > 48:
        raise ctx.fail("ray.temp_dir_root", f"is {len(r.temp_dir_root)} characters; keep it under 48 "
                       "(Ray's socket paths below it must fit in 107 bytes)")
