"""Process-tree helpers: stop exactly the processes a node supervisor started.

The supervisor makes itself a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``),
so the Ray daemons that ``ray start`` leaves behind are re-parented to it instead
of to init. Teardown then walks ``/proc`` for its descendants: no pattern
matching on command lines (Ray renames its processes with setproctitle, and other
users' Ray clusters share the node).
"""
from __future__ import annotations

import ctypes
import os
import signal
import time

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux only); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _stat(pid: int) -> tuple[str, int, str] | None:
    """(comm, ppid, state) of ``pid`` or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            data = fh.read()
    except OSError:
        return None
    comm = data[data.index("(") + 1:data.rindex(")")]
    fields = data[data.rindex(")") + 2:].split()
    return comm, int(fields[1]), fields[0]


def alive(pid: int | None) -> bool:
    """True when ``pid`` runs and is not a zombie."""
    if not pid or pid <= 0:
        return False
    st = _stat(pid)
    return st is not None and st[2] not in ("Z", "X")


def descendants(root: int) -> list[int]:
    """All live descendants of ``root`` (children first-level first)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _stat(int(entry))
        if st and st[2] not in ("Z", "X"):
            children.setdefault(st[1], []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP ``port`` (any address, IPv4 or IPv6), from /proc/net/tcp*."""
    inodes = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as fh:
                lines = fh.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                inodes.add(f[9])
    return inodes


def listens_in_tree(root: int, port: int) -> bool | None:
    """Whether a descendant of ``root`` holds the socket listening on ``port``: True, False (someone
    else's, or nobody's yet), None (the kernel's tables are unreadable here: cannot tell)."""
    inodes = _listening_inodes(port)
    if not inodes:
        return False if os.path.exists("/proc/net/tcp") else None
    wanted = {f"socket:[{i}]" for i in inodes}
    for pid in descendants(root):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    return True
            except OSError:
                continue
    return False


def comm(pid: int) -> str:
    st = _stat(pid)
    return st[0] if st else ""


def reap() -> None:
    """Collect exited children so they do not linger as zombies."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_tree(root: int, grace_s: float = 8.0, include_root: bool = False) -> list[int]:
    """SIGTERM every descendant of ``root``, SIGKILL what is left after ``grace_s``."""
    pids = descendants(root) + ([root] if include_root else [])
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        reap()
        left = [p for p in pids if alive(p)] + [p for p in descendants(root) if p not in pids]
        if not left:
            return pids
        time.sleep(0.1)
    for pid in set(descendants(root) + [p for p in pids if alive(p)]):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(0.2)
    reap()
    return pids
