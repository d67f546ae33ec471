"""The test beds' port picker: ports that differ, are never handed out twice in a
process, and lie below the kernel's ephemeral range (a CI run failed when two
``bind(0)`` picks in a row returned the same port for two Ray components)."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from hpc_verl.profiles.schema import RaySection
from hpc_verl.testbed.ports import RAY_BAND, SLURM_BAND, free_ports


def test_ports_are_distinct_within_and_across_calls_and_stay_in_their_band():
    seen: list[int] = []
    for _ in range(50):
        got = free_ports(4)
        assert all(RAY_BAND[0] <= p < RAY_BAND[1] for p in got)
        seen += got
    assert len(set(seen)) == len(seen) == 200
    slurm = free_ports(6, SLURM_BAND)
    assert len(set(slurm)) == 6 and all(SLURM_BAND[0] <= p < SLURM_BAND[1] for p in slurm)


def test_bands_are_below_the_ephemeral_range_and_clear_of_ray_and_of_our_job_port_blocks():
    lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ray = RaySection()
    blocks = (ray.port_base, ray.port_base + ray.port_slots * ray.port_stride)
    assert SLURM_BAND[1] <= RAY_BAND[0] or RAY_BAND[1] <= SLURM_BAND[0]
    for band in (RAY_BAND, SLURM_BAND):
        assert band[1] <= lo
        assert not any(band[0] <= p < band[1] for p in (6379, 8265, 10001))
        assert band[1] <= 10002                                # Ray's worker ports are 10002-19999
        assert band[1] <= blocks[0] or band[0] >= blocks[1]


def test_a_port_in_use_is_never_handed_out():
    band = (RAY_BAND[1] - 40, RAY_BAND[1])
    held = []
    try:
        for p in range(*band):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                s.close()
                continue
            held.append(s)
            if len(held) == 30:
                break
        taken = {s.getsockname()[1] for s in held}
        got = free_ports(5, band)
        assert not taken & set(got)
        left = 40 - len(taken) - 5
        with pytest.raises(OSError, match=f"no {left + 1} free TCP ports"):
            free_ports(left + 1, band)   # the ports not held and not yet handed out are one too few
    finally:
        for s in held:
            s.close()


def test_a_test_bed_without_free_ports_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    import shutil

    from hpc_verl.testbed import __main__ as testbed_cli
    from hpc_verl.testbed import cluster

    if not (shutil.which("slurmctld") or Path("/usr/sbin/slurmctld").exists()):
        pytest.skip("SLURM is not installed (scripts/setup.sh installs it)")

    def exhausted(n, band):
        raise OSError(f"no {n} free TCP ports in {band[0]}-{band[1]} on 127.0.0.1")

    monkeypatch.setattr(cluster, "free_ports", exhausted)
    rc = testbed_cli.main(["up", "--dir", str(tmp_path / "bed")])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("testbed: error: test bed: no 4 free TCP ports in 6400-7900")
    assert not (tmp_path / "bed" / "testbed.json").exists() and not (tmp_path / "bed" / "slurm.conf").exists()
