"""Free TCP ports for the test beds: one rule for the SLURM test bed, the simulated
Ray cluster and the test Ray heads.

Ports are drawn at random from a band *below* the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768+ on Linux), so an outgoing
connection never takes one between the pick and its use, clear of Ray's
defaults (6379, 8265, 10001, worker ports 10002-19999) and of the port blocks
our jobs carve from ``ray.port_base`` (20000-31999 by default), which the SLURM
tests running beside these use. A port is handed out at
most once per process: two picks in a row (``bind(0)`` twice) can return the same
port, and Ray then refuses the node because two of its components share it.
"""
from __future__ import annotations

import os
import random
import socket
import threading
import time

SLURM_BAND = (6400, 7900)
RAY_BAND = (2000, 6300)

_lock = threading.Lock()
_given: set[int] = set()
_rnd = random.Random(os.getpid() ^ time.time_ns())


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int, band: tuple[int, int] = RAY_BAND) -> list[int]:
    """``n`` distinct ports from ``band`` that bind now and were never handed out before in this process."""
    lo, hi = band
    assert 0 < n <= (hi - lo) // 4, (n, band)
    found: list[int] = []
    with _lock:
        for _ in range(200 * n):
            if len(found) == n:
                break
            port = _rnd.randrange(lo, hi)
            if port in _given or not _bindable(port):
                continue
            _given.add(port)
            found.append(port)
    if len(found) < n:
        raise OSError(f"no {n} free TCP ports in {lo}-{hi} on 127.0.0.1")
    return found
