"""The test bed's container image for the podman runtime, built locally (no registry).

Honest about what it is: a *skeleton* image made with ``podman import`` from a
tiny root filesystem (``/etc/passwd``, ``/etc/group``, empty mount points). The
interpreter, Ray and the project come from this host's installation through
read-only bind mounts listed in the generated profile (``container.mounts``):
``/usr``, ``/lib*``, ``/bin``, the Python installation, the virtualenv and the
project checkout. Containers are real podman containers (own mount/PID/UTS
namespaces, names, ``--rm``, ``--init``); only the image build is cut short, so
it takes a second and is cached by a content key (tag). A real site image is
built from ``containers/`` instead.
"""
from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

from hpc_verl.testbed.cluster import TestBedError

IMAGE_REPO = "localhost/hpc-verl-testbed"
PODMAN_GLOBAL = ["--runtime", "runc", "--cgroup-manager=cgroupfs"]
PODMAN_RUN = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
REPO = Path(__file__).resolve().parents[2]


def host_mounts(python: str | None = None) -> list[str]:
    """Read-only bind mounts that give the skeleton image Python, Ray and the project."""
    py = Path(python or sys.executable)
    venv = py.parent.parent  # <venv>/bin/python
    base = Path(sysconfig.get_config_var("prefix") or sys.base_prefix).resolve()
    if hasattr(sys, "base_prefix"):
        base = Path(sys.base_prefix).resolve()
    dirs = ["/usr", "/bin", "/sbin", "/lib", "/lib64", str(base), str(venv), str(REPO)]
    seen, out = set(), []
    for d in dirs:
        real = os.path.realpath(d)
        if os.path.islink(d) and d.count("/") == 1:
            continue  # merged-/usr hosts: /bin -> usr/bin is a symlink in the skeleton
        if os.path.isdir(d) and real not in seen and not any(real.startswith(s + "/") for s in seen):
            seen.add(real)
            out.append(f"{real}:{real}:ro")
    return out


def content_key(python: str | None = None) -> str:
    h = hashlib.sha256()
    for m in host_mounts(python):
        h.update(m.encode())
    h.update(sys.version.encode())
    return h.hexdigest()[:12]


def _skeleton_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("etc", "tmp", "root", "proc", "sys", "dev", "run", "var", "var/tmp", "usr", "bin", "sbin",
                  "lib", "lib64", "home"):
            info = tarfile.TarInfo(d)
            host = "/" + d
            if d in ("bin", "sbin", "lib", "lib64") and os.path.islink(host):
                info.type = tarfile.SYMTYPE
                info.linkname = os.readlink(host)
                tar.addfile(info)
                continue
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if d in ("tmp", "var/tmp") else 0o755
            tar.addfile(info)
        for name, text in (("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"),
                           ("etc/group", "root:x:0:\n"), ("etc/hostname", "hpcv\n")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _podman(*args: str, input_bytes: bytes | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["podman", *PODMAN_GLOBAL, *args], input=input_bytes, capture_output=True,
                              timeout=timeout_s)
    except FileNotFoundError:
        raise TestBedError("podman not found; install it with 'bash scripts/setup.sh' (apt: podman runc)") from None


def build_image(python: str | None = None) -> str:
    """Build (or reuse) the image; returns its reference ``localhost/hpc-verl-testbed:<key>``."""
    ref = f"{IMAGE_REPO}:{content_key(python)}"
    if _podman("image", "exists", ref).returncode == 0:
        return ref
    proc = _podman("import", "--change", "CMD [\"/bin/sh\"]", "-", ref, input_bytes=_skeleton_tar())
    if proc.returncode != 0:
        raise TestBedError(f"podman import failed: {proc.stderr.decode(errors='replace').strip()[-300:]}")
    return ref
