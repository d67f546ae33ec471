"""Fake sysfs/proc/dev trees for doctor tests (this machine has no InfiniBand or GPU).

They reproduce the kernel's file formats: ``ports/N/state`` as ``4: ACTIVE``,
``/proc/net/route`` with little-endian hex, ``/proc/net/fib_trie`` leaves,
``/proc/self/limits`` with its aligned columns.
"""
from __future__ import annotations

import ipaddress
from pathlib import Path

from hpc_verl.ops.sysinfo import Roots

STATE_CODES = {"DOWN": 1, "INIT": 2, "ARMED": 3, "ACTIVE": 4}


def _hex_le(ip: str) -> str:
    return bytes(reversed(ipaddress.IPv4Address(ip).packed)).hex().upper()


def make_node(root: Path, *, hcas: dict[str, tuple[str, str]] | None = None,
              ifaces: dict[str, str] | None = None, default_iface: str | None = None,
              memlock: str = "unlimited", nofile: str = "1048576", nvidia_gpus: int | None = None,
              amd_gpus: int | None = None, uverbs: int = 0,
              mounts: tuple[tuple[str, str], ...] = (("/", "ext4"), ("/dev/shm", "tmpfs")),
              cpus_online: str = "0-63", cpus_allowed: str | None = None, pid_max: int = 4194304) -> Roots:
    """Build a node: ``hcas`` name -> (state, link layer); ``ifaces`` name -> 'ip/prefix' ('' = no IPv4);
    ``mounts`` (point, fstype) as /proc/self/mounts lists them; CPU lists in the kernel's format."""
    sysfs, proc, dev = root / "sys", root / "proc", root / "dev"
    for d in (sysfs / "class" / "net", proc / "self", proc / "net", dev):
        d.mkdir(parents=True, exist_ok=True)
    for name, (state, layer) in (hcas or {}).items():
        port = sysfs / "class" / "infiniband" / name / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text(f"{STATE_CODES[state]}: {state}\n")
        (port / "link_layer").write_text(layer + "\n")
        (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
        if layer == "Ethernet":  # RoCE: GIDs 0,1 are v1/v2 of the link-local address, 2,3 of the IPv4
            (port / "gids").mkdir()
            (port / "gid_attrs" / "types").mkdir(parents=True)
            for i, kind in enumerate(["IB/RoCE v1", "RoCE v2", "IB/RoCE v1", "RoCE v2"]):
                (port / "gids" / str(i)).write_text(f"fe80:0000:0000:0000:0000:0000:0000:000{i + 1}\n")
                (port / "gid_attrs" / "types" / str(i)).write_text(kind + "\n")
            (port / "gids" / "4").write_text("0000:0000:0000:0000:0000:0000:0000:0000\n")
    ifaces = {"lo": "127.0.0.1/8", **(ifaces or {})}
    routes = ["Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT"]
    trie = ["Main:", "  +-- 0.0.0.0/0 3 0 5"]
    for name, cidr in ifaces.items():
        d = sysfs / "class" / "net" / name
        d.mkdir(parents=True)
        (d / "operstate").write_text("unknown\n" if name == "lo" else "up\n")
        if not cidr:
            continue
        iface = ipaddress.IPv4Interface(cidr)
        trie += [f"     |-- {iface.ip}", "        /32 host LOCAL"]
        if name == "lo":
            continue
        routes.append(f"{name}\t{_hex_le(str(iface.network.network_address))}\t00000000\t0001\t0\t0\t0\t"
                      f"{_hex_le(str(iface.network.netmask))}\t0\t0\t0")
        if name == default_iface:
            routes.append(f"{name}\t00000000\t{_hex_le(str(next(iface.network.hosts())))}\t0003\t0\t0\t0\t"
                          "00000000\t0\t0\t0")
    (proc / "net" / "route").write_text("\n".join(routes) + "\n")
    (proc / "net" / "fib_trie").write_text("\n".join(trie) + "\n")
    rows = [("Max open files", nofile, nofile, "files"), ("Max locked memory", memlock, memlock, "bytes")]
    text = f"{'Limit':<26}{'Soft Limit':<21}{'Hard Limit':<21}Units     \n"
    text += "".join(f"{n:<26}{s:<21}{h:<21}{u:<10}\n" for n, s, h, u in rows)
    (proc / "self" / "limits").write_text(text)
    escaped = [(point.replace(" ", "\\040"), fstype) for point, fstype in mounts]  # as the kernel writes spaces
    (proc / "self" / "mounts").write_text("".join(f"dev{i} {point} {fstype} rw,relatime 0 0\n"
                                                  for i, (point, fstype) in enumerate(escaped)))
    (proc / "self" / "status").write_text(f"Name:\tpython3\nCpus_allowed_list:\t{cpus_allowed or cpus_online}\n")
    (proc / "sys" / "kernel").mkdir(parents=True, exist_ok=True)
    (proc / "sys" / "kernel" / "pid_max").write_text(f"{pid_max}\n")
    cpu = sysfs / "devices" / "system" / "cpu"
    cpu.mkdir(parents=True, exist_ok=True)
    (cpu / "online").write_text(cpus_online + "\n")
    if nvidia_gpus is not None:
        g = proc / "driver" / "nvidia" / "gpus"
        g.mkdir(parents=True)
        for i in range(nvidia_gpus):
            (g / f"0000:{i:02x}:00.0").mkdir()
    if amd_gpus is not None:
        base = sysfs / "class" / "kfd" / "kfd" / "topology" / "nodes"
        for i in range(amd_gpus + 1):  # node 0 is the CPU (gpu_id 0)
            (base / str(i)).mkdir(parents=True)
            (base / str(i) / "gpu_id").write_text("0\n" if i == 0 else f"{1000 + i}\n")
    if uverbs:
        (dev / "infiniband").mkdir()
        for i in range(uverbs):
            (dev / "infiniband" / f"uverbs{i}").write_text("")
    return Roots(sysfs=sysfs, proc=proc, dev=dev, shm=root)
