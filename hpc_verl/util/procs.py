"""Process-tree helpers: stop exactly the processes a supervisor started.

A supervisor (a job's, or a node's in the bootstrap) makes itself a *child subreaper*
(``prctl(PR_SET_CHILD_SUBREAPER)``), so what its children leave behind (the Ray daemons
``ray start`` daemonises, a step started with ``setsid``) is re-parented to it instead
of to init. Teardown then walks the process table for its descendants and signals them and
their process groups: no pattern matching on command lines (Ray renames its processes with
setproctitle, and other users' Ray clusters share the node), no environment markers
(Ray's agents do not inherit them). Process tables, names, command lines, open files and
listening sockets come from psutil; signals, waits and the subreaper flag from ``os``.
"""
from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Collection
from typing import NamedTuple

import psutil

PR_SET_CHILD_SUBREAPER = 36
_ENDED = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux only); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def alive(pid: int | None) -> bool:
    """True when ``pid`` runs and is not a zombie."""
    if not pid or pid <= 0:
        return False
    try:
        return psutil.Process(pid).status() not in _ENDED
    except psutil.Error:
        return False


class Proc(NamedTuple):
    """One line of :func:`process_table`."""

    ppid: int
    sid: int
    start: float   # start time: with the pid, it names one process; pids are reused


_PROC = "/proc"
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_table() -> dict[int, Proc]:
    """Every live process (no zombies), from one pass over the process table: the stat lines of
    /proc where there is one (a third of psutil's cost: the watchdogs read the table several times
    a second for a job's whole life), psutil elsewhere. ``start`` is psutil's create time either way."""
    if os.path.isfile(f"{_PROC}/self/stat"):
        return _stat_table()
    out = {}
    for p in psutil.process_iter(["ppid", "status", "create_time"]):
        info = p.info
        if info["status"] in _ENDED or info["ppid"] is None:
            continue
        try:
            sid = os.getsid(p.pid)
        except OSError:   # ended meanwhile
            continue
        out[p.pid] = Proc(int(info["ppid"]), sid, info["create_time"])
    return out


def _stat_table() -> dict[int, Proc]:
    boot = psutil.boot_time()
    out = {}
    for name in os.listdir(_PROC):
        if not name.isdigit():
            continue
        try:
            with open(f"{_PROC}/{name}/stat", "rb") as fh:
                line = fh.read()
        except OSError:   # ended meanwhile
            continue
        # after the name (which may hold spaces and parentheses): state ppid pgrp session ... starttime (22nd)
        fields = line[line.rindex(b")") + 2:].split()
        if fields[0] in (b"Z", b"X", b"x"):
            continue
        out[int(name)] = Proc(int(fields[1]), int(fields[3]), boot + int(fields[19]) / _TICKS)
    return out


def descendants(root: int, table: dict[int, Proc] | None = None) -> list[int]:
    """All live descendants of ``root`` (children first-level first), in ``table`` (default: now)."""
    children: dict[int, list[int]] = {}
    for pid, st in (process_table() if table is None else table).items():
        children.setdefault(st.ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def listens_in_tree(root: int, port: int) -> bool | None:
    """Whether a descendant of ``root`` holds the socket listening on ``port`` (any address, IPv4 or
    IPv6): True, False (someone else's, or nobody's yet), None (the kernel's tables are unreadable
    here: cannot tell)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    holders = {c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port}
    if not holders:
        return False
    return bool(holders & set(descendants(root)))


def comm(pid: int) -> str:
    """The process's name ("" when it is gone)."""
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return ""


def reap() -> dict[int, int]:
    """Collect exited children so they do not linger as zombies; returns {pid: wait status}."""
    out: dict[int, int] = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return out
        if pid == 0:
            return out
        out[pid] = status


def describe_status(status: int) -> str:
    """A wait status in words: ``exit status 1`` or ``killed by SIGKILL``."""
    if os.WIFSIGNALED(status):
        try:
            return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
        except ValueError:
            return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


def _signal_all(pids: list[int], sig: int) -> None:
    """``sig`` to each pid and to each of their process groups (not our own group)."""
    own = os.getpgrp()
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except OSError:
            pass
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    for pgid in groups - {own}:
        try:
            os.killpg(pgid, sig)
        except OSError:
            pass


def _send(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _wait_gone(pids: list[int], timeout_s: float, reap_children: bool) -> None:
    """Up to ``timeout_s`` for ``pids`` to end (``reap_children``: they are ours, collect them)."""
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        if reap_children:
            reap()
        time.sleep(0.05)


def stop_and_wait(pids: list[int], timeout_s: float) -> None:
    """SIGTERM ``pids`` and wait up to ``timeout_s`` for them to end (no KILL: a caller's next step)."""
    _send(pids, signal.SIGTERM)
    _wait_gone(pids, timeout_s, reap_children=True)


KILL_WAIT_S = 2.0   # a SIGKILLed process is gone within this (kernel teardown of a large one)


def end_pids(pids: list[int], grace_s: float = 3.0) -> None:
    """TERM ``pids`` (processes outside the caller's tree), wait up to ``grace_s`` for them, KILL
    the ones left and wait up to KILL_WAIT_S for those. Reaps nothing: they are not the caller's
    children, and a caller with children of its own (a trainer's driver) must keep their statuses."""
    _send(pids, signal.SIGTERM)
    _wait_gone(pids, grace_s, reap_children=False)
    left = [p for p in pids if alive(p)]
    _send(left, signal.SIGKILL)
    _wait_gone(left, KILL_WAIT_S, reap_children=False)   # gone before the caller removes their files


def reap_tree(root: int, wait_s: float = 0.0, grace_s: float = 5.0, keep: Collection[int] = ()) -> list[int]:
    """End every descendant of ``root`` but ``keep`` (and theirs): first let them exit on their own
    for up to ``wait_s`` (Ray stops a few seconds after its supervisor asked), then TERM them and
    their process groups, then KILL what is left after ``grace_s``. Returns the pids signalled."""
    spared = set(keep)

    def tree() -> list[int]:
        kept = spared | {d for k in spared for d in descendants(k)} if spared else set()
        return [p for p in descendants(root) if p not in kept]
    deadline = time.monotonic() + wait_s
    while tree() and time.monotonic() < deadline:
        reap()
        time.sleep(0.1)
    reap()
    signalled = tree()
    if not signalled:
        return []
    _signal_all(signalled, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        reap()
        if not tree():
            return signalled
        time.sleep(0.1)
    for _ in range(3):   # a process may fork while it is being stopped
        left = tree()
        if not left:
            break
        signalled += [p for p in left if p not in signalled]
        _signal_all(left, signal.SIGKILL)
        time.sleep(0.2)
        reap()
    return signalled


def end_ray_tree(root: int, grace_s: float = 6.0) -> list[int]:
    """End the Ray daemons (and everything else) under ``root`` in the order they let go of each
    other: the raylet first (its workers and agents go with it), then the rest, the GCS last. TERMed
    all at once, the GCS and the autoscaler's monitor each wait for a peer already gone until the
    KILL, seconds later. Returns every pid that was under ``root``."""
    before = descendants(root)
    stop_and_wait([p for p in before if comm(p) == "raylet"], 3.0)
    stop_and_wait([p for p in descendants(root) if comm(p) != "gcs_server"], 3.0)
    return sorted(set(before) | set(reap_tree(root, wait_s=0.0, grace_s=grace_s)))


def pids_using(path: str) -> list[int]:
    """Live processes (not this one) that name ``path`` on their command line or hold a file
    under it open (a private Ray's temp dir: its agents rename themselves with setproctitle but
    keep their log files there). A unique path is safe to match, unlike a program name."""
    root = os.path.realpath(path)
    me = os.getpid()
    out = []
    for p in psutil.process_iter(["status", "cmdline"]):
        if p.pid == me or p.info["status"] in _ENDED:
            continue
        if root in "\0".join(p.info["cmdline"] or ()):
            out.append(p.pid)
            continue
        try:
            files = p.open_files()
        except psutil.Error:
            continue
        if any(f.path == root or f.path.startswith(root + "/") for f in files):
            out.append(p.pid)
    return out


def in_session(sid: int, table: dict[int, Proc] | None = None) -> list[int]:
    """Live processes (not this one) of session ``sid``, in ``table`` (default: now): what a session
    leader's tree was, even for those whose parents are gone (a process leaves its session only by
    ``setsid``)."""
    me = os.getpid()
    return [pid for pid, st in (process_table() if table is None else table).items() if st.sid == sid and pid != me]


def kill_everything(sid: int | Collection[int], paths: tuple[str, ...] = (), bound_s: float = KILL_WAIT_S) -> list[int]:
    """SIGKILL, until none is left (at most ``bound_s``): every process of session ``sid`` (or of
    each of several) and every descendant of this process (a subreaper's orphans), then whatever
    names one of ``paths`` (see :func:`pids_using`) with its descendants. Returns the pids killed."""
    sids = {sid} if isinstance(sid, int) else set(sid)
    killed: list[int] = []
    deadline = time.monotonic() + bound_s
    while True:
        table = process_table()   # one pass over /proc a round, for every session and tree
        found = {p for s in sids for p in in_session(s, table)} | set(descendants(os.getpid(), table))
        if not found:   # (the path scan reads every fd of every process: only once the cheap one is empty)
            for path in paths:
                for pid in pids_using(path):
                    found |= {pid, *descendants(pid, table)}
        found.discard(os.getpid())
        found = {p for p in found if alive(p)}
        if not found or time.monotonic() > deadline:
            return killed
        _send(sorted(found), signal.SIGKILL)
        killed += [p for p in sorted(found) if p not in killed]
        reap()
        time.sleep(0.02)
