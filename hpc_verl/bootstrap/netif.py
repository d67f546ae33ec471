"""Which IPv4 address a node advertises to Ray: the profile's interface, never a bridge.

Pure Python (``ioctl(SIOCGIFADDR)``), so it works in minimal containers without
iproute2. Loopback addresses are refused unless the profile says
``network.allow_loopback: true`` (a test bed where every "node" is this host).
Docker/podman bridge addresses are always refused: other hosts cannot reach them.
"""
from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import socket
import struct

from hpc_verl.errors import BootstrapError

SIOCGIFADDR = 0x8915
BRIDGE_PREFIXES = ("docker", "br-", "veth", "virbr", "cni", "podman", "flannel", "cali")
BRIDGE_NETS = (ipaddress.ip_network("172.17.0.0/16"), ipaddress.ip_network("10.88.0.0/16"))


def interface_ipv4(name: str) -> str | None:
    """The IPv4 address of interface ``name``, or None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interfaces() -> dict[str, str]:
    """Interface name -> IPv4 address, for interfaces that have one."""
    found = {}
    for _, name in socket.if_nameindex():
        ip = interface_ipv4(name)
        if ip:
            found[name] = ip
    return found


def default_route_interface() -> str | None:
    """The interface of the IPv4 default route (from /proc/net/route)."""
    try:
        with open("/proc/net/route") as fh:
            next(fh)
            for line in fh:
                fields = line.split()
                if len(fields) > 2 and fields[1] == "00000000":
                    return fields[0]
    except (OSError, StopIteration):
        pass
    return None


def is_bridge(name: str, ip: str | None = None) -> bool:
    """A container/VM bridge (by interface name, or docker's/podman's default network, which is
    what eth0 carries inside a container without host networking): other nodes cannot reach it."""
    return name.startswith(BRIDGE_PREFIXES) or (bool(ip) and any(ipaddress.ip_address(ip) in net
                                                                 for net in BRIDGE_NETS))


def refusal(name: str, ip: str, allow_loopback: bool) -> str | None:
    """Why ``ip`` on ``name`` cannot be a Ray address (None when it can)."""
    addr = ipaddress.ip_address(ip)
    if addr.is_loopback and not allow_loopback:
        return (f"{name} has loopback address {ip}; other nodes cannot reach it (set network.interface "
                "to the cluster NIC, or network.allow_loopback: true on a single-host test bed)")
    if is_bridge(name, ip):
        return f"{name} ({ip}) is a container bridge address; other nodes cannot reach it"
    return None


def select_ip(interface: str | None = None, allow_loopback: bool = False,
              available: dict[str, str] | None = None, default_iface: str | None = None) -> str:
    """The address to advertise: ``interface`` if given, else the default-route interface.

    ``interface='lo'`` with ``allow_loopback`` gives 127.0.0.1 (test beds). Raises
    BootstrapError with the interfaces that do exist when nothing fits.
    """
    avail = interfaces() if available is None else available
    listing = ", ".join(f"{n}={ip}" for n, ip in sorted(avail.items())) or "none"
    if interface and interface != "auto":
        ip = avail.get(interface)
        if ip is None:
            raise BootstrapError(f"network.interface '{interface}' has no IPv4 address on "
                                 f"{socket.gethostname()}; interfaces here: {listing}")
        why = refusal(interface, ip, allow_loopback)
        if why:
            raise BootstrapError(f"network.interface: {why}")
        return ip
    candidates = []
    route_if = default_route_interface() if available is None else default_iface
    if route_if in avail:
        candidates.append(route_if)
    candidates += sorted(n for n in avail if n not in candidates)
    for name in candidates:
        if refusal(name, avail[name], allow_loopback) is None:
            if ipaddress.ip_address(avail[name]).is_loopback and len(candidates) > 1 \
                    and any(refusal(n, avail[n], False) is None for n in candidates):
                continue  # prefer a routable address even when loopback is allowed
            return avail[name]
    raise BootstrapError(f"no usable IPv4 address for Ray on {socket.gethostname()} (interfaces: {listing}); "
                         "set network.interface in the profile")


def tcp_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Does something accept connections at host:port? (Cheap; Ray's GCS client blocks ~40 s
    on an address where nothing listens, so callers ask this first.)"""
    return tcp_probe(host, port, timeout_s) is None


def tcp_probe(host: str, port: int, timeout_s: float = 0.5) -> str | None:
    """None when something accepts connections at host:port, else why not, in words a person
    acts on: refused (nothing listens, or a firewall rejects), no answer (a firewall drops it),
    no route."""
    with socket.socket() as s:
        s.settimeout(timeout_s)
        try:
            err = s.connect_ex((host, port))
        except socket.timeout:
            err = errno.ETIMEDOUT
        except OSError as exc:   # e.g. a name that does not resolve
            return f"cannot connect ({exc.strerror or exc})"
    if err == 0:
        return None
    if err in (errno.ETIMEDOUT, errno.EAGAIN, errno.EINPROGRESS):
        return f"no answer within {timeout_s:g} s (dropped on the way: a firewall?)"
    if err == errno.ECONNREFUSED:
        return "connection refused (nothing listens there, or a firewall rejects it)"
    if err in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return f"{os.strerror(err).lower()} (routing or a firewall between the nodes)"
    return os.strerror(err).lower()


def split_address(address: str) -> tuple[str, int]:
    """``"10.0.0.1:6379"`` -> ("10.0.0.1", 6379)."""
    host, _, port = address.rpartition(":")
    return host, int(port)
