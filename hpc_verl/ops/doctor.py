"""``hpc-verl doctor``: check a node against its cluster profile before a job wastes hours.

Each check returns OK / WARN / FAIL (or SKIP when it does not apply) with one
line of detail and, when not OK, one line saying how to fix it. The checks
target the failures that cost users days: NCCL silently on sockets because the
HCAs are down or not passed into the container, Ray advertising a loopback or
docker-bridge address, a small ``/dev/shm``, low memlock/nofile limits, ports of
the job's block already taken, an old Ray, torch not seeing the GPUs.

All file-system views come through :class:`~hpc_verl.ops.sysinfo.Roots`, so the
tests run every check against fake sysfs/proc/dev trees.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from hpc_verl.bootstrap.netif import is_bridge
from hpc_verl.bootstrap.ports import busy_ports, ephemeral_range, pick_node_ports, port_block
from hpc_verl.ops import sysinfo
from hpc_verl.ops.doctor_job import check_cpu_ranks, check_engine_neighbours, check_head_ports
from hpc_verl.ops.sysinfo import Roots
from hpc_verl.profiles.schema import RaySection, SlurmSection
from hpc_verl.util.versions import RAY_MIN_VERSION, version_tuple
from hpc_verl.ops.checkresult import FAIL, OK, SKIP, WARN, CheckResult  # noqa: F401  (re-exported)

NOFILE_WANTED = 65536
IB_TRANSPORTS = ("infiniband", "roce")


@dataclass
class Expectations:
    """What the profile asks of a node (flattened from the launcher's Profile)."""

    profile: str = "local"
    scheduler: str = "local"
    transport: str = "loopback"
    interface: str | None = None
    socket_ifname: str | None = None
    allow_loopback: bool = True
    ib_hcas: list[str] = field(default_factory=list)
    gid_index: int | None = None
    ib_devices: list[str] = field(default_factory=lambda: ["/dev/infiniband"])
    shm_size: str = "16G"
    shm_bytes: int = 16 * 2**30
    runtime: str = "none"
    image: str | None = None
    global_flags: list[str] = field(default_factory=list)
    run_flags: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)
    ipc_lock: bool = True
    memlock_unlimited: bool = True
    accelerator: str = "none"
    gpus_per_node: int = 0
    port_base: int = RaySection.port_base  # (the profile's defaults: one place)
    port_stride: int = RaySection.port_stride
    port_slots: int = RaySection.port_slots
    python: str = "python3"
    temp_dir_root: str = RaySection.temp_dir_root
    cpus_per_task: int = SlurmSection.cpus_per_task
    docker_host: str | None = None  # the profile's env.vars.DOCKER_HOST (the job exports it)
    ulimits: list[str] = field(default_factory=list)  # the container's --ulimit values (NAME=SOFT[:HARD])

    @classmethod
    def from_profile(cls, p: Any) -> "Expectations":
        """From the launcher's ``Profile`` (hpc_verl.profiles.schema)."""
        from hpc_verl.profiles.schema import parse_size_bytes

        c, n, s, r = p.container, p.network, p.slurm, p.ray
        return cls(profile=p.name, scheduler=p.scheduler, transport=n.transport, interface=n.interface,
                   socket_ifname=n.socket_ifname,
                   allow_loopback=bool(n.allow_loopback) or p.scheduler == "local" or n.transport == "loopback",
                   ib_hcas=list(n.ib_hcas), gid_index=n.gid_index, ib_devices=list(n.ib_devices), shm_size=c.shm_size,
                   shm_bytes=parse_size_bytes(c.shm_size), runtime=c.runtime, image=c.image,
                   global_flags=list(c.global_flags), run_flags=list(c.run_flags), devices=list(c.devices),
                   mounts=list(c.mounts),
                   ipc_lock=c.ipc_lock, memlock_unlimited=c.memlock_unlimited, accelerator=p.accelerator,
                   gpus_per_node=s.gpus_per_node, port_base=r.port_base, port_stride=r.port_stride,
                   port_slots=r.port_slots, python=r.python, temp_dir_root=r.temp_dir_root,
                   cpus_per_task=s.cpus_per_task, docker_host=p.env.vars.get("DOCKER_HOST"),
                   ulimits=c.ulimit_values())

    @property
    def uses_ib(self) -> bool:
        return self.transport in IB_TRANSPORTS

    @property
    def isolating_runtime(self) -> bool:
        """docker/podman give the container its own /dev/shm, limits and devices."""
        return self.runtime in ("docker", "podman")


@dataclass
class Context:
    """How doctor runs: roots, where it is, and the optional deep container probe."""

    roots: Roots = field(default_factory=Roots)
    in_container: bool = False
    job_id: int | None = None
    deep: bool = False
    runner: Callable[..., subprocess.CompletedProcess] = subprocess.run
    probe: dict[str, Any] | None = None  # filled by the deep container probe
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))  # SLURM_*, HPCV_RAY_NUM_CPUS
    node: str | None = None  # this node's name as the job sees it (default: SLURMD_NODENAME or the hostname)
    uid: int = field(default_factory=os.geteuid)  # who runs the job's docker client
    groups: set[int] = field(default_factory=lambda: {os.getegid(), *os.getgroups()})


# ----------------------------------------------------------------------------- checks
def check_ib(exp: Expectations, ctx: Context) -> CheckResult:
    name = "infiniband"
    if not exp.uses_ib:
        return CheckResult(name, SKIP, f"profile uses network.transport={exp.transport} (no HCAs needed)")
    ports = sysinfo.ib_ports(ctx.roots)
    base = ctx.roots.sysfs / "class" / "infiniband"
    if not ports:
        return CheckResult(name, FAIL, f"no InfiniBand devices: {base} is missing or empty (profile wants "
                           f"{', '.join(exp.ib_hcas)}); NCCL would fall back to TCP sockets",
                           "load the RDMA drivers (modprobe mlx5_ib ib_uverbs) and check 'ibstat'; "
                           "on a node without IB use a profile with network.transport: ethernet")
    problems, good = [], []
    want_layer = "InfiniBand" if exp.transport == "infiniband" else "Ethernet"
    for spec in exp.ib_hcas:
        hca, _, port = spec.lstrip("^=").partition(":")
        if spec.startswith("^"):
            continue  # NCCL exclusion list: nothing to require
        if hca not in ports:
            problems.append(f"{hca} not found (present: {', '.join(sorted(ports))})")
            continue
        hports = [p for p in ports[hca] if not port or p.port == int(port)]
        if not hports:
            problems.append(f"{hca} has no port {port}")
            continue
        for p in hports:
            if p.state != "ACTIVE":
                problems.append(f"{hca} port {p.port} is {p.state}")
            elif p.link_layer not in (want_layer, "unknown"):
                problems.append(f"{hca} port {p.port} link layer is {p.link_layer}, "
                                f"transport {exp.transport} needs {want_layer}")
            elif exp.transport == "roce" and exp.gid_index is not None:
                gid_type = sysinfo.gid_type(ctx.roots, hca, p.port, exp.gid_index)
                if gid_type is None or "v2" not in gid_type.lower():
                    problems.append(f"{hca} port {p.port} GID index {exp.gid_index} is "
                                    f"{gid_type or 'not populated'}, not RoCE v2")
                else:
                    good.append(f"{hca}:{p.port} (GID {exp.gid_index} {gid_type})")
            else:
                good.append(f"{hca}:{p.port}")
    if problems:
        fix = ("fix network.ib_hcas to the active HCAs 'ibstat' lists, or bring the port up "
               "(cable, subnet manager: 'sminfo')")
        if all("GID index" in p for p in problems):
            fix = "set network.gid_index to the RoCE v2 index that 'show_gids' lists (often 3)"
        return CheckResult(name, FAIL, "; ".join(problems), fix)
    return CheckResult(name, OK, f"active: {', '.join(good)}")


def check_interface(exp: Expectations, ctx: Context) -> CheckResult:
    name = "interface"
    ifaces = sysinfo.interfaces(ctx.roots)
    iface = exp.interface or sysinfo.default_route_interface(ctx.roots)
    present = ", ".join(sorted(ifaces)) or "none"
    if iface is None:
        if exp.allow_loopback:
            return CheckResult(name, OK, "no network.interface and no default route; single-host profile "
                               "uses loopback")
        return CheckResult(name, FAIL, f"network.interface is unset and there is no default route "
                           f"(interfaces: {present})", "set network.interface in the profile (e.g. ib0, eth0)")
    if iface not in ifaces:
        return CheckResult(name, FAIL, f"interface '{iface}' does not exist here (present: {present})",
                           f"set network.interface to one of: {present}")
    info = ifaces[iface]
    addrs = info.ipv4
    if not addrs:
        return CheckResult(name, FAIL, f"'{iface}' has no IPv4 address (state {info.operstate})",
                           "bring it up ('ip addr') or pick the interface with the cluster network's address")
    routable = [a for a in addrs if not a.startswith("127.") and not is_bridge(iface, a)]
    if all(is_bridge(iface, a) for a in addrs):
        return CheckResult(name, FAIL, f"'{iface}' ({', '.join(addrs)}) is a container bridge: other nodes "
                           "cannot reach Ray there", "set network.interface to the node's cluster NIC")
    if not routable and not exp.allow_loopback:
        return CheckResult(name, FAIL, f"'{iface}' has only loopback addresses ({', '.join(addrs)}): Ray "
                           "workers on other nodes cannot reach the head",
                           "set network.interface to the node's cluster NIC (e.g. ib0, eth0)")
    status = OK if info.operstate in ("up", "unknown") else WARN
    fix = "" if status == OK else f"'{iface}' is {info.operstate}: check 'ip link show {iface}'"
    return CheckResult(name, status, f"'{iface}' {info.operstate}, IPv4 {', '.join(addrs)}", fix)


def check_socket_ifname(exp: Expectations, ctx: Context) -> CheckResult:
    """NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME must match an interface, as NCCL reads it.

    NCCL treats each comma-separated name as a prefix (``=name`` exact); ``^``
    excludes instead. A list matching nothing makes NCCL's bootstrap fail with
    "no socket interface found" only when the trainer starts.
    """
    name = "socket-ifname"
    spec = exp.socket_ifname or exp.interface
    if not spec:
        return CheckResult(name, SKIP, "network.socket_ifname and network.interface unset (NCCL picks)")
    if spec.startswith("^"):
        return CheckResult(name, OK, f"NCCL_SOCKET_IFNAME={spec} (an exclusion list)")
    ifaces = sorted(sysinfo.interfaces(ctx.roots))
    exact = spec.startswith("=")
    wanted = [w for w in spec.lstrip("=").split(",") if w]
    matched = [i for i in ifaces if any((i == w) if exact else i.startswith(w) for w in wanted)]
    if not matched:
        return CheckResult(name, FAIL, f"NCCL_SOCKET_IFNAME={spec} matches no interface here (present: "
                           f"{', '.join(ifaces) or 'none'}): NCCL fails with 'no socket interface found'",
                           "set network.socket_ifname to one of the present interfaces")
    return CheckResult(name, OK, f"NCCL_SOCKET_IFNAME={spec} matches {', '.join(matched)}")


def check_shm(exp: Expectations, ctx: Context) -> CheckResult:
    name = "shm"
    size = sysinfo.fs_size_bytes(ctx.roots.shm)
    if size is None:
        return CheckResult(name, FAIL, f"{ctx.roots.shm} does not exist", "mount a tmpfs at /dev/shm")
    have = f"{size / 2**30:.1f} GiB"
    if exp.isolating_runtime and not ctx.in_container:
        return CheckResult(name, OK, f"the {exp.runtime} container gets its own --shm-size {exp.shm_size} "
                           f"(host {ctx.roots.shm}: {have})")
    if size < exp.shm_bytes:
        return CheckResult(name, FAIL, f"{ctx.roots.shm} is {have}, profile wants container.shm_size "
                           f"{exp.shm_size}: DataLoader workers and NCCL can hang or die with bus errors",
                           f"remount it larger (mount -o remount,size={exp.shm_size} /dev/shm) or lower "
                           "container.shm_size")
    return CheckResult(name, OK, f"{ctx.roots.shm} is {have} (wanted {exp.shm_size})")


def _fmt_limit(v: int | None) -> str:
    return "unlimited" if v is None else str(v)


def check_memlock(exp: Expectations, ctx: Context) -> CheckResult:
    name = "memlock"
    lim = sysinfo.process_limits(ctx.roots).get("Max locked memory")
    if lim is None:
        return CheckResult(name, WARN, "cannot read the memlock limit", "check 'ulimit -l'")
    text = f"soft {_fmt_limit(lim.soft)}, hard {_fmt_limit(lim.hard)}"
    if not exp.uses_ib:
        return CheckResult(name, OK, f"{text} (no RDMA on transport {exp.transport})")
    if exp.isolating_runtime and exp.memlock_unlimited and not ctx.in_container:
        return CheckResult(name, OK, f"host {text}; the container raises it (--ulimit memlock=-1:-1)")
    if lim.soft is not None:
        return CheckResult(name, FAIL, f"{text}: RDMA memory registration fails, NCCL falls back to sockets "
                           "or dies with 'ibv_reg_mr failed'",
                           "set 'memlock unlimited' in /etc/security/limits.conf (and SLURM "
                           "PropagateResourceLimits), or container.memlock_unlimited: true")
    return CheckResult(name, OK, text)


def container_ulimit(exp: Expectations, resource: str) -> sysinfo.Limit | None:
    """The ``--ulimit RESOURCE=soft[:hard]`` a docker/podman profile passes (container.ulimits, run flags)."""
    flags = exp.run_flags
    values = list(exp.ulimits)
    for i, flag in enumerate(flags):
        values.append(flag.split("=", 1)[1] if flag.startswith("--ulimit=") else
                      flags[i + 1] if flag == "--ulimit" and i + 1 < len(flags) else "")
    for value in values:
        if value.startswith(resource + "="):
            soft, _, hard = value.split("=", 1)[1].partition(":")
            conv = [None if v in ("-1", "unlimited") else int(v) if v.isdigit() else None
                    for v in (soft, hard or soft)]
            return sysinfo.Limit(conv[0], conv[1])
    return None


def check_nofile(exp: Expectations, ctx: Context) -> CheckResult:
    name = "nofile"
    lim = sysinfo.process_limits(ctx.roots).get("Max open files")
    where = ""
    if exp.isolating_runtime and not ctx.in_container:
        flag = container_ulimit(exp, "nofile")
        if flag is not None:
            lim, where = flag, " (the container's --ulimit from the profile)"
    if lim is None:
        return CheckResult(name, WARN, "cannot read the open-files limit", "check 'ulimit -n'")
    text = f"soft {_fmt_limit(lim.soft)}, hard {_fmt_limit(lim.hard)}{where}"
    if lim.soft is not None and lim.soft < 1024:
        return CheckResult(name, FAIL, f"{text}: Ray runs out of file descriptors",
                           f"raise it: 'ulimit -n {NOFILE_WANTED}' (limits.conf nofile)")
    if lim.soft is not None and lim.soft < NOFILE_WANTED:
        hint = (f"'ulimit -n {NOFILE_WANTED}' before ray start" if lim.hard is None or lim.hard >= NOFILE_WANTED
                else f"ask the admin for nofile {NOFILE_WANTED} in /etc/security/limits.conf")
        return CheckResult(name, WARN, f"{text}: below the {NOFILE_WANTED} Ray recommends for big clusters",
                           hint)
    return CheckResult(name, OK, text)


# a job id of this many digits when none is given (SLURM's ids stay below 67108864 without federation)
ASSUMED_JOB_ID = 99999999
NETWORK_FS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "panfs",
              "wekafs", "afs", "orangefs", "pvfs2", "fuse.sshfs", "fuse.glusterfs", "fuse.ceph-fuse", "fuse.juicefs",
              "fuse.gcsfuse", "fuse.s3fs", "fuse.lustre")


def _node_name(ctx: Context) -> str:
    import socket

    return ctx.node or ctx.env.get("SLURMD_NODENAME") or ctx.env.get("HPC_VERL_NODE") or socket.gethostname()


def check_ray_socket_path(exp: Expectations, ctx: Context) -> CheckResult:
    """Ray's Unix sockets live under the job's temp dir; a path over 107 bytes makes ``ray start`` fail."""
    from hpc_verl.bootstrap.node import AF_UNIX_PATH_MAX, longest_socket_path, node_temp_dir

    name = "ray-socket-path"
    job = ctx.job_id if ctx.job_id is not None else ASSUMED_JOB_ID
    node = _node_name(ctx)
    temp = node_temp_dir({"temp_dir_root": exp.temp_dir_root, "job_id": job}, node)
    path = longest_socket_path(temp, len(str(sysinfo.pid_max(ctx.roots) - 1)))
    n = len(path.encode())
    basis = f"job {job}" + ("" if ctx.job_id is not None else " (an 8-digit id: no --job-id)") + f", node {node}"
    fix = (f"shorten ray.temp_dir_root ({len(exp.temp_dir_root)} characters now), e.g. /tmp/hpcv; Ray adds "
           f"/<job>/<node>/session_<date>_<pid>/sockets/{path.rsplit('/', 1)[-1]} below it")
    if n > AF_UNIX_PATH_MAX:
        return CheckResult(name, FAIL, f"Ray's socket {path} is {n} bytes ({basis}), over the {AF_UNIX_PATH_MAX} an "
                           "AF_UNIX path may have: ray start fails with 'AF_UNIX path length cannot exceed'", fix)
    if n > AF_UNIX_PATH_MAX - 8:
        return CheckResult(name, WARN, f"Ray's longest socket path is {n} of {AF_UNIX_PATH_MAX} bytes ({basis}): a "
                           "longer job id or node name tips it over", fix)
    return CheckResult(name, OK, f"Ray's longest socket path is {n} of {AF_UNIX_PATH_MAX} bytes ({basis})")


def check_ray_temp_fs(exp: Expectations, ctx: Context) -> CheckResult:
    name = "ray-temp-fs"
    found = sysinfo.mount_of(exp.temp_dir_root, sysinfo.mounts(ctx.roots))
    if found is None:
        return CheckResult(name, WARN, f"cannot tell which filesystem holds {exp.temp_dir_root} "
                           f"({ctx.roots.proc}/self/mounts unreadable)", "check it with 'df -T'")
    point, fstype = found
    if fstype in NETWORK_FS:
        return CheckResult(name, FAIL, f"ray.temp_dir_root {exp.temp_dir_root} is on {fstype} (mounted at {point}): "
                           "the raylet's Unix sockets and the object store's files break or crawl on a network "
                           "filesystem, and every node shares the same directory",
                           "set ray.temp_dir_root to node-local storage (e.g. /tmp/hpcv-ray, or /dev/shm/hpcv "
                           "where /tmp is shared)")
    return CheckResult(name, OK, f"ray.temp_dir_root {exp.temp_dir_root} is on {fstype} (mounted at {point})")


def check_cpus(exp: Expectations, ctx: Context) -> CheckResult:
    """What ``ray start --num-cpus`` gets (HPCV_RAY_NUM_CPUS, else SLURM_CPUS_PER_TASK, else Ray counts the
    node's CPUs) against the CPUs the job may really use."""
    from hpc_verl.verl_upstream.findings import cpu_shortfall

    name = "cpus"
    env = ctx.env
    allowed = sysinfo.allowed_cpus(ctx.roots)
    online = sysinfo.online_cpus(ctx.roots)
    in_job = exp.scheduler == "slurm" and bool(env.get("SLURM_JOB_ID"))
    if env.get("HPCV_RAY_NUM_CPUS", "").isdigit():
        told, source = int(env["HPCV_RAY_NUM_CPUS"]), "HPCV_RAY_NUM_CPUS"
    elif in_job and env.get("SLURM_CPUS_PER_TASK", "").isdigit():
        told, source = int(env["SLURM_CPUS_PER_TASK"]), "SLURM_CPUS_PER_TASK"
    elif exp.scheduler == "slurm" and not in_job:
        told, source = exp.cpus_per_task, "slurm.cpus_per_task (sbatch --cpus-per-task)"
    elif exp.scheduler == "local":
        told, source = exp.cpus_per_task, "slurm.cpus_per_task, passed as HPCV_RAY_NUM_CPUS by the local backend"
    else:
        told, source = 0, ""
    here = in_job or exp.scheduler == "local"  # this process's cpuset is the job's
    if told == 0:
        counted = online or allowed
        if in_job and allowed and online and online > allowed:
            return CheckResult(name, WARN, f"Ray will count all {online} CPUs of the node, but this job may use "
                               f"{allowed} (Cpus_allowed_list): it schedules work the cores cannot run",
                               f"request CPUs per task (slurm.cpus_per_task: {allowed}) or export "
                               f"HPCV_RAY_NUM_CPUS={allowed}")
        return CheckResult(name, OK, f"Ray counts the node's CPUs itself ({counted if counted else 'unknown'})")
    if here and allowed is not None and told > allowed:
        return CheckResult(name, FAIL, f"Ray will be told {told} CPUs ({source}) but this task may run on "
                           f"{allowed} (Cpus_allowed_list): Ray places {told} CPUs of work on {allowed} cores",
                           f"make them agree: slurm.cpus_per_task: {allowed}, or export HPCV_RAY_NUM_CPUS={allowed}")
    if not here and online is not None and told > online:
        return CheckResult(name, FAIL, f"{source} is {told}, this node has {online} CPUs: SLURM never starts the "
                           "job here (it pends)", f"lower slurm.cpus_per_task to at most {online}")
    detail = f"Ray will be told {told} CPUs per node ({source}); this node has {online or '?'}"
    short = cpu_shortfall(told, exp.gpus_per_node) if exp.accelerator in ("nvidia", "amd") else None
    if short:
        why, _, fix = short.rpartition("; ")
        return CheckResult(name, WARN, f"{detail}: {why}", fix)
    return CheckResult(name, OK, detail)


def job_port_range(job_id: int, port_base: int, port_stride: int, port_slots: int) -> range:
    """Ports of a job's block: ``port_base + (job_id % port_slots) * port_stride``, ``port_stride`` long."""
    block = port_block(job_id, port_base=port_base, port_stride=port_stride, port_slots=port_slots)
    return range(block.block_start, block.block_start + port_stride)


def check_ports(exp: Expectations, ctx: Context) -> CheckResult:
    name = "ports"
    if ctx.job_id is None:
        return CheckResult(name, SKIP, "no job id (SLURM_JOB_ID unset); pass --job-id N to check that job's "
                           "port block")
    rng = job_port_range(ctx.job_id, exp.port_base, exp.port_stride, exp.port_slots)
    busy = busy_ports(list(rng))
    span = f"{rng.start}-{rng.stop - 1}"
    if busy:
        shown = ", ".join(map(str, busy[:8])) + (" ..." if len(busy) > 8 else "")
        moved = _bootstrap_fallback(ctx.job_id, exp)
        if moved is not None:
            return CheckResult(name, WARN, f"job {ctx.job_id}'s Ray port block {span}: {len(busy)} in use "
                               f"({shown}); the bootstrap will move to the free block at {moved}",
                               f"find the holder with 'ss -ltnp | grep :{busy[0]}'")
        return CheckResult(name, FAIL, f"job {ctx.job_id}'s Ray port block {span}: {len(busy)} in use "
                           f"({shown})", f"find the holder with 'ss -ltnp | grep :{busy[0]}'; if it is not "
                           "an older run of this job, change ray.port_base in the profile")
    lo, hi = ephemeral_range(ctx.roots.proc)
    if rng.start <= hi and rng.stop - 1 >= lo:
        return CheckResult(name, WARN, f"job {ctx.job_id}'s block {span} is free but overlaps the ephemeral "
                           f"range {lo}-{hi}: outgoing connections may take its ports",
                           "move ray.port_base below the ephemeral range "
                           "(/proc/sys/net/ipv4/ip_local_port_range)")
    return CheckResult(name, OK, f"job {ctx.job_id}'s Ray port block {span} is free")


def _bootstrap_fallback(job_id: int, exp: Expectations) -> int | None:
    """Where the bootstrap's own port picker would go instead (None: it would fail)."""
    from hpc_verl.errors import HpcVerlError

    try:
        block = pick_node_ports(job_id, head=True, port_base=exp.port_base, port_stride=exp.port_stride,
                                port_slots=exp.port_slots)
    except HpcVerlError:
        return None
    return block.block_start


def _host_view_note(exp: Expectations, ctx: Context) -> str:
    """Checks of software on the host matter less when the job runs in a container."""
    if exp.runtime != "none" and not ctx.in_container:
        return f" (host; the job uses the {exp.runtime} image's copy: check it with --deep)"
    return ""


def check_ray(exp: Expectations, ctx: Context) -> CheckResult:
    name = "ray"
    probe = ctx.probe or {}
    if "ray" in probe:
        version, where = probe["ray"], " (in the container)"
    else:
        try:
            version, where = importlib.metadata.version("ray"), _host_view_note(exp, ctx)
        except importlib.metadata.PackageNotFoundError:
            version, where = None, _host_view_note(exp, ctx)
    soft = bool(where) and "host" in where
    want = RAY_MIN_VERSION
    if not version:
        return CheckResult(name, WARN if soft else FAIL, f"Ray is not installed{where}",
                           f"pip install 'ray[default]>={want}'")
    if version_tuple(version) < version_tuple(RAY_MIN_VERSION):
        return CheckResult(name, WARN if soft else FAIL, f"Ray {version}{where} is older than {want}",
                           f"pip install -U 'ray[default]>={want}'")
    return CheckResult(name, OK, f"Ray {version}{where}")


def check_gpu_devices(exp: Expectations, ctx: Context) -> CheckResult:
    name = "gpu-devices"
    if exp.accelerator not in ("nvidia", "amd") or exp.gpus_per_node == 0:
        return CheckResult(name, SKIP, f"profile expects no physical GPUs (accelerator {exp.accelerator})")
    if exp.accelerator == "nvidia":
        count, source, fix = (sysinfo.nvidia_gpu_count(ctx.roots), ctx.roots.proc / "driver/nvidia/gpus",
                              "install/load the NVIDIA driver ('nvidia-smi' must list the GPUs)")
    else:
        count, source, fix = (sysinfo.amd_gpu_count(ctx.roots), ctx.roots.sysfs / "class/kfd",
                              "load amdgpu ('rocm-smi' must list the GPUs); /dev/kfd and /dev/dri are needed")
    if count is None:
        return CheckResult(name, FAIL, f"no {exp.accelerator} driver here ({source} missing); profile wants "
                           f"{exp.gpus_per_node} GPUs per node", fix)
    if count < exp.gpus_per_node:
        return CheckResult(name, FAIL, f"driver sees {count} GPUs, profile wants slurm.gpus_per_node="
                           f"{exp.gpus_per_node}", f"{fix}, or lower slurm.gpus_per_node")
    return CheckResult(name, OK, f"driver sees {count} GPUs (profile wants {exp.gpus_per_node})")


def torch_info() -> dict[str, Any]:
    """torch version and what it sees (imported here only: it is heavy)."""
    try:
        import torch
    except ImportError:
        return {}
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                            "hip": getattr(torch.version, "hip", None)}
    try:
        info["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken driver must not crash doctor
        info["gpus"] = 0
    return info


def check_torch(exp: Expectations, ctx: Context, info: dict[str, Any] | None = None) -> CheckResult:
    name = "torch"
    probe = ctx.probe or {}
    if "torch" in probe:
        info, where = probe, " (in the container)"
    else:
        info, where = (info if info is not None else torch_info()), _host_view_note(exp, ctx)
    soft = "host" in where
    if not info.get("torch"):
        return CheckResult(name, WARN if soft else FAIL, f"torch is not installed{where}",
                           "install the project's train extra (pip install 'hpc_verl[train]')")
    build = f"CUDA {info['cuda']}" if info.get("cuda") else f"ROCm {info['hip']}" if info.get("hip") else "CPU"
    seen = int(info.get("gpus") or 0)
    detail = f"torch {info['torch']} ({build} build), sees {seen} GPU(s){where}"
    want = exp.gpus_per_node if exp.accelerator in ("nvidia", "amd") else 0
    if seen < want:
        if build == "CPU":
            fix = "this is a CPU build of torch: install the CUDA/ROCm build in the image"
        else:
            fix = ("check CUDA_VISIBLE_DEVICES/HIP_VISIBLE_DEVICES and that the container gets the "
                   "allocation's GPUs")
        return CheckResult(name, WARN if soft else FAIL, f"{detail}; profile wants {want}", fix)
    if exp.accelerator == "amd" and info.get("cuda") and not info.get("hip"):
        return CheckResult(name, WARN if soft else FAIL, f"{detail}: a CUDA build on an AMD profile",
                           "install the ROCm build of torch")
    return CheckResult(name, OK, detail)


RUNTIME_BINARIES = {"docker": "docker", "podman": "podman", "apptainer": "apptainer",
                    "singularity": "singularity", "enroot-pyxis": "enroot"}


def check_runtime(exp: Expectations, ctx: Context) -> CheckResult:
    name = "container-runtime"
    if exp.runtime == "none":
        return CheckResult(name, SKIP, "profile runs on the host (container.runtime: none)")
    if ctx.in_container:
        return CheckResult(name, SKIP, f"running inside the {exp.runtime} container")
    binary = RUNTIME_BINARIES[exp.runtime]
    path = shutil.which(binary)
    if path is None:
        return CheckResult(name, FAIL, f"'{binary}' is not on PATH (container.runtime: {exp.runtime})",
                           f"install {binary} or 'module load' it before the job; or change container.runtime")
    cmd = [path, *(exp.global_flags if exp.runtime in ("docker", "podman") else []),
           "version" if exp.runtime == "enroot-pyxis" else "--version"]
    res = _run(ctx, cmd)
    if res.returncode != 0:
        return CheckResult(name, FAIL, f"'{binary} --version' failed: {_last_line(res)}",
                           f"repair the {binary} installation")
    version = _last_line(res)
    if exp.runtime == "enroot-pyxis":
        srun = shutil.which("srun")
        if srun is None:
            return CheckResult(name, FAIL, f"{version}, but srun is not on PATH (pyxis runs through srun)",
                               "run doctor on a SLURM node, or use another container.runtime")
        if "--container-image" not in _run(ctx, [srun, "--help"]).stdout:
            return CheckResult(name, FAIL, f"{version}, but srun has no --container-image (pyxis plugin "
                               "missing)", "install pyxis (plugstack.conf) or use another runtime")
    return CheckResult(name, OK, version)


DOCKER_DEFAULT_HOST = "unix:///var/run/docker.sock"
DOCKER_ROOTLESS_FIX = ("or use rootless Docker (dockerd-rootless-setuptool.sh install; then "
                       "DOCKER_HOST=unix://$XDG_RUNTIME_DIR/docker.sock in env.vars)")


def docker_host(exp: Expectations, ctx: Context) -> tuple[str, str]:
    """The daemon the job's docker client talks to, and where that comes from."""
    if exp.docker_host:
        return exp.docker_host, "env.vars.DOCKER_HOST"
    if ctx.env.get("DOCKER_HOST"):
        return ctx.env["DOCKER_HOST"], "$DOCKER_HOST"
    return DOCKER_DEFAULT_HOST, "the default socket"


def _socket_access(path: str, ctx: Context) -> tuple[bool, str, str]:
    """May ``ctx.uid`` (in ``ctx.groups``) read and write the socket? With the reason in words and the
    socket's group."""
    import grp
    import pwd

    st = os.stat(path)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    if ctx.uid == 0:
        return True, "you are root", group
    if st.st_uid == ctx.uid:
        return st.st_mode & 0o600 == 0o600, "the socket is yours (rootless)", group
    if st.st_gid in ctx.groups:
        return st.st_mode & 0o060 == 0o060, f"you are in group '{group}'", group
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    return st.st_mode & 0o006 == 0o006, (f"the socket is {owner}:{group} mode {st.st_mode & 0o777:o} and "
                                          f"you are not in group '{group}'"), group


def check_docker_daemon(exp: Expectations, ctx: Context) -> CheckResult:
    """The docker runtime: the daemon at the job's DOCKER_HOST answers, and this user may use it."""
    name = "docker-daemon"
    if exp.runtime != "docker":
        return CheckResult(name, SKIP, f"container.runtime is {exp.runtime}")
    if ctx.in_container:
        return CheckResult(name, SKIP, "running inside the docker container")
    binary = shutil.which("docker")
    if binary is None:
        return CheckResult(name, SKIP, "no docker client (see container-runtime)")
    host, source = docker_host(exp, ctx)
    user = _user_name(ctx.uid)
    how = ""
    if host.startswith("unix://"):
        path = host[len("unix://"):]
        if not os.path.exists(path):
            return CheckResult(name, FAIL, f"no docker daemon socket at {path} ({source})",
                               "start the daemon (sudo systemctl start docker) or point DOCKER_HOST at it "
                               "(env.vars.DOCKER_HOST in the profile)")
        allowed, how, group = _socket_access(path, ctx)
        if not allowed:
            return CheckResult(name, FAIL, f"user {user} may not use {path}: {how}",
                               f"ask an admin to add you to it (sudo usermod -aG {group} {user}, then log in "
                               f"again) {DOCKER_ROOTLESS_FIX}")
    info = _run(ctx, [binary, "info", "--format", "{{.ServerVersion}} {{json .SecurityOptions}}"],
                env={**ctx.env, "DOCKER_HOST": host})
    if info.returncode != 0:
        last = _last_line(info)
        if "permission denied" in last.lower():
            return CheckResult(name, FAIL, f"user {user} may not use the daemon at {host}: {last}",
                               f"join the socket's group (sudo usermod -aG docker {user}, then log in again) "
                               f"{DOCKER_ROOTLESS_FIX}")
        return CheckResult(name, FAIL, f"the docker daemon at {host} ({source}) does not answer: {last}",
                           "start dockerd (sudo systemctl start docker) or set DOCKER_HOST to a running one "
                           "(env.vars.DOCKER_HOST in the profile)")
    version, _, options = info.stdout.strip().partition(" ")
    mode = "rootless daemon" if "rootless" in options else "root daemon, containers run as you (--user)"
    return CheckResult(name, OK, f"daemon {version} at {host} ({source}); {mode}" + (f"; {how}" if how else ""))


def _user_name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def check_container_ib(exp: Expectations, ctx: Context) -> CheckResult:
    name = "container-ib"
    if not exp.uses_ib:
        return CheckResult(name, SKIP, f"transport {exp.transport}: no IB devices to pass in")
    dev = ctx.roots.dev / "infiniband"
    uverbs = sorted(p.name for p in dev.glob("uverbs*")) if dev.is_dir() else []
    if ctx.in_container or exp.runtime == "none":
        where = "inside the container" if ctx.in_container else "on the host (no container)"
        if not uverbs:
            return CheckResult(name, FAIL, f"no {dev}/uverbs* {where}: NCCL cannot open the HCAs and uses "
                               "sockets", "pass /dev/infiniband into the container (network.ib_devices) "
                               "and load ib_uverbs on the host")
        return CheckResult(name, OK, f"{', '.join(uverbs)} visible {where}")
    if ctx.probe is not None and "ib" in ctx.probe:
        seen = ctx.probe["ib"]
        if not seen:
            return CheckResult(name, FAIL, "the container sees no /dev/infiniband/uverbs*",
                               "add /dev/infiniband to network.ib_devices (and IPC_LOCK)")
        return CheckResult(name, OK, f"the container sees {', '.join(seen)}")
    passed = [d for d in exp.ib_devices + exp.devices if d.startswith("/dev/infiniband")]
    if exp.runtime in ("docker", "podman") and not passed:
        return CheckResult(name, FAIL, f"the profile passes no /dev/infiniband device to {exp.runtime}: NCCL "
                           "inside falls back to sockets", "set network.ib_devices: [/dev/infiniband]")
    if exp.runtime in ("apptainer", "singularity") and any(
            f in exp.run_flags for f in ("--contain", "--containall", "-c", "-C")) and not any(
            "/dev/infiniband" in f for f in exp.run_flags):
        return CheckResult(name, FAIL, f"{exp.runtime} runs with --contain(all), which hides /dev/infiniband",
                           "add '--bind', '/dev/infiniband' to container.run_flags")
    if not uverbs:
        return CheckResult(name, FAIL, f"the profile passes {', '.join(passed) or '/dev (shared)'}, but the "
                           f"host has no {dev}/uverbs* to pass", "load ib_uverbs (modprobe ib_uverbs) and "
                           "check the RDMA stack ('ibv_devices')")
    if exp.runtime in ("docker", "podman") and not exp.ipc_lock:
        return CheckResult(name, WARN, f"{', '.join(uverbs)} passed in, but without IPC_LOCK",
                           "set container.ipc_lock: true (RDMA memory registration needs it)")
    return CheckResult(name, OK, f"{', '.join(uverbs)} on the host, passed in via "
                       f"{', '.join(passed) or 'the shared /dev'} (run --deep to look inside)")


CHECKS: tuple[Callable[[Expectations, Context], CheckResult], ...] = (
    check_ib, check_interface, check_socket_ifname, check_shm, check_memlock, check_nofile, check_ports,
    check_ray_socket_path, check_ray_temp_fs, check_cpus, check_cpu_ranks, check_head_ports, check_ray, check_gpu_devices,
    check_torch, check_engine_neighbours, check_runtime, check_docker_daemon, check_container_ib)


# ----------------------------------------------------------------------------- deep probe
_PROBE = (
    "import json, glob, importlib.metadata as m\n"
    "out = {'ib': sorted(p.rsplit('/', 1)[-1] for p in glob.glob('/dev/infiniband/uverbs*'))}\n"
    "try:\n out['ray'] = m.version('ray')\nexcept Exception:\n pass\n"
    "try:\n import torch\n out.update(torch=torch.__version__, cuda=torch.version.cuda,"
    " hip=getattr(torch.version, 'hip', None),"
    " gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0)\nexcept Exception:\n pass\n"
    "print('HPCV_PROBE ' + json.dumps(out))\n")


def container_probe_command(exp: Expectations) -> list[str] | None:
    """The one container run ``--deep`` makes: what Ray, torch and IB look like inside."""
    binary = RUNTIME_BINARIES.get(exp.runtime)
    if binary is None or not exp.image or exp.runtime == "enroot-pyxis":
        return None
    devs = [d for d in exp.ib_devices + exp.devices if exp.uses_ib or not d.startswith("/dev/infiniband")]
    if exp.runtime in ("docker", "podman"):
        cmd = [binary, *exp.global_flags, "run", "--rm", "--network", "host", *exp.run_flags]
        for u in exp.ulimits:
            cmd += ["--ulimit", u]
        for d in devs:
            cmd += ["--device", d]
        for m in exp.mounts:
            cmd += ["--volume", m]
        if exp.ipc_lock:
            cmd += ["--cap-add", "IPC_LOCK"]
        return [*cmd, exp.image, exp.python, "-c", _PROBE]
    binds = [a for m in exp.mounts for a in ("--bind", m)]
    return [binary, "exec", *binds, *exp.run_flags, exp.image, exp.python, "-c", _PROBE]


def run_probe(exp: Expectations, ctx: Context, timeout_s: float = 300) -> CheckResult:
    """Start the profile's image once and record what it sees (into ``ctx.probe``)."""
    name = "container-run"
    cmd = container_probe_command(exp)
    if cmd is None:
        return CheckResult(name, SKIP, f"no deep probe for runtime {exp.runtime}")
    env = {**ctx.env, "DOCKER_HOST": docker_host(exp, ctx)[0]} if exp.runtime == "docker" else None
    res = _run(ctx, cmd, timeout_s=timeout_s, env=env)
    for line in res.stdout.splitlines():
        if line.startswith("HPCV_PROBE "):
            ctx.probe = json.loads(line[len("HPCV_PROBE "):])
            return CheckResult(name, OK, f"{exp.runtime} ran {exp.image}")
    return CheckResult(name, FAIL, f"{exp.runtime} could not run {exp.image}: {_last_line(res)}",
                       "check the image name and container.run_flags/global_flags (try the command by hand)")


def _run(ctx: Context, cmd: list[str], timeout_s: float = 30,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    try:
        extra = {"env": env} if env is not None else {}
        return ctx.runner(cmd, capture_output=True, text=True, timeout=timeout_s, **extra)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 124, "", f"timed out after {timeout_s:.0f} s")
    except OSError as exc:
        return subprocess.CompletedProcess(cmd, 127, "", str(exc))


def _last_line(res: subprocess.CompletedProcess) -> str:
    lines = [ln.strip() for ln in (res.stdout + "\n" + res.stderr).splitlines() if ln.strip()]
    return lines[-1][:200] if lines else f"exit {res.returncode}"


# ----------------------------------------------------------------------------- driver
@dataclass
class Report:
    profile: str
    checks: list[CheckResult]

    @property
    def failed(self) -> bool:
        return any(c.status == FAIL for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        counts = {s: sum(c.status == s for c in self.checks) for s in (OK, WARN, FAIL, SKIP)}
        return {"profile": self.profile, "ok": not self.failed, "counts": counts,
                "checks": [c.to_dict() for c in self.checks]}


def run_doctor(exp: Expectations, ctx: Context | None = None,
               checks: Sequence[Callable[[Expectations, Context], CheckResult]] = CHECKS) -> Report:
    """Run every check; a crashing check becomes a FAIL line, never a traceback."""
    ctx = ctx or Context()
    if ctx.job_id is None and os.environ.get("SLURM_JOB_ID", "").isdigit():
        ctx.job_id = int(os.environ["SLURM_JOB_ID"])
    results = []
    if ctx.deep and exp.runtime != "none" and not ctx.in_container:
        results.append(run_probe(exp, ctx))
    for check in checks:
        try:
            results.append(check(exp, ctx))
        except Exception as exc:  # noqa: BLE001 - report, do not crash
            results.append(CheckResult(check.__name__.removeprefix("check_"), FAIL,
                                       f"check crashed: {type(exc).__name__}: {exc}",
                                       "report this as an hpc-verl bug"))
    return Report(exp.profile, results)
