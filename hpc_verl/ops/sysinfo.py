"""Read what a node has, from sysfs/procfs/devfs trees whose roots are parameters.

Every reader takes its root, so tests drive them with fake trees (there is no
InfiniBand or GPU on the CI machine) and ``hpc-verl doctor`` can point them at a
container's view. Nothing here raises on a missing file: absent means absent.
"""
from __future__ import annotations

import ipaddress
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from hpc_verl.bootstrap.netif import interface_ipv4


@dataclass(frozen=True)
class Roots:
    """Where the node's kernel views are mounted (override for tests or containers)."""

    sysfs: Path = Path("/sys")
    proc: Path = Path("/proc")
    dev: Path = Path("/dev")
    shm: Path = Path("/dev/shm")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


# ----------------------------------------------------------------------------- InfiniBand
@dataclass(frozen=True)
class IbPort:
    hca: str
    port: int
    state: str          # e.g. "ACTIVE", "DOWN", "INIT"
    link_layer: str     # "InfiniBand" or "Ethernet" (RoCE)
    rate: str = ""


def ib_ports(roots: Roots) -> dict[str, list[IbPort]]:
    """HCA name -> its ports, from ``<sysfs>/class/infiniband/*/ports/*``."""
    base = roots.sysfs / "class" / "infiniband"
    out: dict[str, list[IbPort]] = {}
    if not base.is_dir():
        return out
    for hca in sorted(p.name for p in base.iterdir()):
        ports = []
        pdir = base / hca / "ports"
        if pdir.is_dir():
            for port in sorted(pdir.iterdir(), key=lambda p: (len(p.name), p.name)):
                if not port.name.isdigit():
                    continue
                state = _read(port / "state") or "unknown"
                # sysfs writes "4: ACTIVE"
                state = state.split(":", 1)[-1].strip()
                ports.append(IbPort(hca, int(port.name), state, _read(port / "link_layer") or "unknown",
                                    _read(port / "rate") or ""))
        out[hca] = ports
    return out


def gid_type(roots: Roots, hca: str, port: int, index: int) -> str | None:
    """``RoCE v2`` / ``IB/RoCE v1`` for a populated GID, None for an empty or absent one."""
    pdir = roots.sysfs / "class" / "infiniband" / hca / "ports" / str(port)
    gid = _read(pdir / "gids" / str(index))
    if not gid or set(gid.replace(":", "")) == {"0"}:
        return None
    return _read(pdir / "gid_attrs" / "types" / str(index))


# ----------------------------------------------------------------------------- network
@dataclass
class Interface:
    name: str
    operstate: str
    ipv4: list[str] = field(default_factory=list)


def interfaces(roots: Roots) -> dict[str, Interface]:
    """Network interfaces from ``<sysfs>/class/net`` with their IPv4 addresses."""
    base = roots.sysfs / "class" / "net"
    out: dict[str, Interface] = {}
    if base.is_dir():
        for p in sorted(base.iterdir()):
            out[p.name] = Interface(p.name, _read(p / "operstate") or "unknown")
    for name, addr in ipv4_addresses(roots):
        if name in out and addr not in out[name].ipv4:
            out[name].ipv4.append(addr)
    return out


def default_route_interface(roots: Roots) -> str | None:
    """The interface of the IPv4 default route (``<proc>/net/route``)."""
    for row in _route_rows(roots):
        if row["dest"] == 0 and row["mask"] == 0:
            return row["iface"]
    return None


def _route_rows(roots: Roots) -> list[dict]:
    text = _read(roots.proc / "net" / "route")
    rows = []
    for line in (text or "").splitlines()[1:]:
        parts = line.split()
        if len(parts) < 8:
            continue
        try:
            dest = struct.unpack("<I", bytes.fromhex(parts[1]))[0]
            mask = struct.unpack("<I", bytes.fromhex(parts[7]))[0]
        except (ValueError, struct.error):
            continue
        rows.append({"iface": parts[0], "dest": dest, "mask": mask})
    return rows


def ipv4_addresses(roots: Roots) -> list[tuple[str, str]]:
    """(interface, address) pairs.

    The kernel's local addresses are the ``/32 host LOCAL`` leaves of
    ``<proc>/net/fib_trie``; each is given to the interface whose subnet route
    (``<proc>/net/route``) contains it, and 127/8 to ``lo``. On the real /proc,
    interfaces left without an address are asked with SIOCGIFADDR as well.
    """
    locals_: list[str] = []
    text = _read(roots.proc / "net" / "fib_trie") or ""
    last_ip = None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("|--"):
            last_ip = s[3:].strip()
        elif s.startswith("/32 host LOCAL") and last_ip and last_ip not in locals_:
            locals_.append(last_ip)
    routes = [r for r in _route_rows(roots) if r["mask"] != 0]
    pairs: list[tuple[str, str]] = []
    for ip in locals_:
        try:
            addr = ipaddress.IPv4Address(ip)
        except ValueError:
            continue
        if addr.is_loopback:
            pairs.append(("lo", ip))
            continue
        as_int = struct.unpack("<I", addr.packed[::-1])[0]
        best = None
        for r in routes:
            if as_int & r["mask"] == r["dest"] & r["mask"]:
                if best is None or bin(r["mask"]).count("1") > bin(best["mask"]).count("1"):
                    best = r
        if best:
            pairs.append((best["iface"], ip))
    if roots.proc == Path("/proc") and roots.sysfs == Path("/sys"):
        have = {name for name, _ in pairs}
        for name in os.listdir("/sys/class/net") if os.path.isdir("/sys/class/net") else []:
            if name not in have and (ip := interface_ipv4(name)):
                pairs.append((name, ip))
    return pairs


# ----------------------------------------------------------------------------- limits, shm
@dataclass(frozen=True)
class Limit:
    soft: int | None   # None = unlimited
    hard: int | None


def process_limits(roots: Roots, pid: str = "self") -> dict[str, Limit]:
    """``<proc>/<pid>/limits`` as name -> Limit (names as the kernel prints them)."""
    text = _read(roots.proc / pid / "limits") or ""
    out: dict[str, Limit] = {}
    for line in text.splitlines()[1:]:
        # columns are aligned: name (up to col 26), soft (21 wide), hard (21 wide), units
        name, rest = line[:26].strip(), line[26:].split()
        if len(rest) < 2:
            continue
        out[name] = Limit(_limit(rest[0]), _limit(rest[1]))
    return out


def _limit(text: str) -> int | None:
    return None if text == "unlimited" else int(text) if text.isdigit() else None


def fs_size_bytes(path: Path) -> int | None:
    """Total size of the filesystem holding ``path`` (None when absent)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def mounts(roots: Roots) -> list[tuple[str, str]]:
    """(mount point, filesystem type) from ``<proc>/self/mounts`` (octal escapes such as ``\\040`` decoded)."""
    out = []
    for line in (_read(roots.proc / "self" / "mounts") or "").splitlines():
        parts = line.split()
        if len(parts) >= 3:
            point = parts[1].encode().decode("unicode_escape") if "\\" in parts[1] else parts[1]
            out.append((point, parts[2]))
    return out


def mount_of(path: str, table: list[tuple[str, str]]) -> tuple[str, str] | None:
    """The mount (point, type) that holds ``path``: the longest mount point above it (last mount wins)."""
    norm = os.path.normpath(path)
    best: tuple[str, str] | None = None
    for point, fstype in table:
        p = os.path.normpath(point)
        if norm == p or norm.startswith(p.rstrip("/") + "/"):
            if best is None or len(p) >= len(os.path.normpath(best[0])):
                best = (point, fstype)
    return best


def cpu_list_count(text: str | None) -> int | None:
    """``"0-3,8,10-11"`` -> 7 (the kernel's CPU list format); None when absent or malformed."""
    if not text:
        return None
    n = 0
    try:
        for part in text.strip().split(","):
            lo, _, hi = part.partition("-")
            n += int(hi or lo) - int(lo) + 1
    except ValueError:
        return None
    return n


def allowed_cpus(roots: Roots, pid: str = "self") -> int | None:
    """CPUs this process may run on (``Cpus_allowed_list``: SLURM's cpuset/affinity for a job step)."""
    for line in (_read(roots.proc / pid / "status") or "").splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return cpu_list_count(line.split(":", 1)[1])
    return None


def online_cpus(roots: Roots) -> int | None:
    """CPUs of the node (``<sysfs>/devices/system/cpu/online``), what Ray counts when not told."""
    return cpu_list_count(_read(roots.sysfs / "devices" / "system" / "cpu" / "online"))


def pid_max(roots: Roots) -> int:
    """The largest process id plus one (``<proc>/sys/kernel/pid_max``; the kernel's default when unreadable)."""
    text = _read(roots.proc / "sys" / "kernel" / "pid_max")
    return int(text) if text and text.isdigit() else 4194304


# ----------------------------------------------------------------------------- GPUs
def nvidia_gpu_count(roots: Roots) -> int | None:
    """GPUs the NVIDIA driver knows (``<proc>/driver/nvidia/gpus/*``); None without the driver."""
    base = roots.proc / "driver" / "nvidia" / "gpus"
    if not base.is_dir():
        return None
    return sum(1 for _ in base.iterdir())


def amd_gpu_count(roots: Roots) -> int | None:
    """GPUs the amdgpu/KFD driver exposes (topology nodes with a non-zero gpu_id)."""
    base = roots.sysfs / "class" / "kfd" / "kfd" / "topology" / "nodes"
    if not base.is_dir():
        return None
    n = 0
    for node in base.iterdir():
        gid = _read(node / "gpu_id")
        if gid and gid != "0":
            n += 1
    return n


def in_container() -> bool:
    """Whether the job said this process runs inside its container.

    Set by the job (``HPC_VERL_IN_CONTAINER=1``) or ``doctor --in-container``;
    marker files such as ``/.dockerenv`` are not trusted, since sandboxes that
    are not a job's container carry them too.
    """
    return os.environ.get("HPC_VERL_IN_CONTAINER", "") not in ("", "0", "false")
