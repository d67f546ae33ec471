"""Profile schema and loader: search path, extends, overrides, provenance, one-line errors."""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from hpc_verl.errors import HpcVerlError, ProfileError
from hpc_verl.profiles import list_profiles, load_profile

SHIPPED = ["eth-l40s", "ib-a100", "local", "mi300x-rocm", "pyxis-h100", "roce-h100", "testbed",
           "testbed-docker", "testbed-podman"]


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """Empty cwd and user dir, an env-path dir we can write profiles to."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    envdir = tmp_path / "envprofiles"
    envdir.mkdir()
    monkeypatch.setenv("HPC_VERL_PROFILE_PATH", str(envdir))
    return envdir


def write(d: Path, name: str, text: str) -> Path:
    p = d / f"{name}.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_every_shipped_profile_loads(sandbox):
    names = [i.name for i in list_profiles()]
    assert names == SHIPPED
    for name in SHIPPED:
        p = load_profile(name)
        assert p.name == name
        assert p.to_dict()["slurm"]["nodes"] >= 1


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_port_blocks_stay_below_the_default_ephemeral_range(sandbox, name):
    """Linux hands out 32768+ for outgoing connections: a Ray port planned there can be taken by
    any client socket on the node (the node then has to move to another block)."""
    r = load_profile(name).ray
    assert r.port_base >= 1024
    assert r.port_base + r.port_slots * r.port_stride <= 32768, (r.port_base, r.port_slots, r.port_stride)


def test_shipped_profiles_have_their_hardware(sandbox):
    a100 = load_profile("ib-a100")
    assert (a100.slurm.gpus_per_node, a100.accelerator, a100.network.transport) == (8, "nvidia", "infiniband")
    assert a100.network.ib_hcas[0].startswith("mlx5_")
    assert load_profile("roce-h100").network.gid_index == 3
    eth = load_profile("eth-l40s")
    assert eth.network.transport == "ethernet" and eth.network.socket_ifname and not eth.network.ib_hcas
    assert load_profile("mi300x-rocm").accelerator == "amd"
    assert load_profile("pyxis-h100").container.runtime == "enroot-pyxis"
    tb = load_profile("testbed-podman")
    assert tb.container.global_flags == ["--runtime", "runc", "--cgroup-manager=cgroupfs"]
    assert "nofile=1024:1024" in tb.container.run_flags and tb.slurm.gpus_per_node == 4
    assert load_profile("local").scheduler == "local"
    dk = load_profile("testbed-docker")
    assert (dk.container.runtime, dk.container.global_flags, dk.container.run_flags) == ("docker", [], [])
    assert dk.container.ulimit_values() == ["nofile=1024:1024"]  # memlock unlimited is refused here


def test_container_ulimits_checked_and_refused_where_they_cannot_apply(sandbox):
    ok = load_profile("ib-a100", ["container.ulimits.nofile=65536:65536", "container.ulimits.stack=-1"])
    assert ok.container.ulimit_values() == ["memlock=-1:-1", "nofile=65536:65536", "stack=-1"]
    bad = {
        "container.ulimits.nofiles=1024": "container.ulimits.nofiles must be one of core, cpu",
        "container.ulimits.nofile=1k": "container.ulimits.nofile must be 'SOFT' or 'SOFT:HARD'",
        "container.ulimits.memlock=-1": "container.ulimits.memlock conflicts with container.memlock_unlimited",
    }
    for override, want in bad.items():
        with pytest.raises(ProfileError, match=re.escape(want)):
            load_profile("ib-a100", [override])
    with pytest.raises(ProfileError, match="container.ulimits cannot be set by runtime 'apptainer'"):
        load_profile("ib-a100", ["container.runtime=apptainer", "container.ulimits.nofile=1024"])
    with pytest.raises(ProfileError, match="container.ulimits cannot be set by runtime 'enroot-pyxis'"):
        load_profile("pyxis-h100", ["container.ulimits.nofile=1024"])


def test_search_path_order_and_shadowing(sandbox, tmp_path):
    # env path shadows shipped; ./cluster_profiles shadows env; user dir sits between them
    write(sandbox, "ib-a100", "extends: ib-a100\nslurm:\n  partition: envpart\n")
    assert load_profile("ib-a100").slurm.partition == "envpart"
    user = tmp_path / "xdg" / "hpc_verl" / "profiles"
    user.mkdir(parents=True)
    write(user, "ib-a100", "extends: ib-a100\nslurm:\n  partition: userpart\n")
    assert load_profile("ib-a100").slurm.partition == "userpart"
    cwd = Path("cluster_profiles")
    cwd.mkdir()
    write(cwd, "ib-a100", "extends: ib-a100\nslurm:\n  partition: cwdpart\n")
    p = load_profile("ib-a100")
    assert p.slurm.partition == "cwdpart"
    # the chain walks down the search path: cwd -> user -> env -> shipped, values from each
    assert p.slurm.gpus_per_node == 8
    assert p.where("slurm.partition") == "cluster_profiles/ib-a100.yaml:3"
    assert p.where("slurm.gpus_per_node") == "shipped:ib-a100.yaml:9"
    info = {i.name: i for i in list_profiles()}["ib-a100"]
    assert info.origin == "cwd" and info.shadows == 3


def test_env_path_is_colon_separated(sandbox, tmp_path, monkeypatch):
    second = tmp_path / "second"
    second.mkdir()
    write(second, "site", "extends: local\ndescription: my site\n")
    monkeypatch.setenv("HPC_VERL_PROFILE_PATH", f"{sandbox}:{second}")
    assert load_profile("site").description == "my site"
    assert "site" in [i.name for i in list_profiles()]


def test_overrides_are_typed_and_recorded(sandbox):
    p = load_profile("ib-a100", ["slurm.nodes=4", "container.init=false", "env.vars.MY_VAR=a b",
                                 "container.mounts=[/scratch:/scratch:ro]", "slurm.partition="])
    assert p.slurm.nodes == 4 and p.container.init is False and p.slurm.partition is None
    assert p.env.vars["MY_VAR"] == "a b" and p.env.vars["NCCL_PROTO"] == "Simple"
    assert p.container.mounts == ["/scratch:/scratch:ro"]
    assert p.where("slurm.nodes") == "--set slurm.nodes"
    assert p.where("env.vars.MY_VAR") == "--set env.vars.MY_VAR"
    assert p.where("env.vars.NCCL_PROTO").startswith("shipped:ib-a100.yaml:")
    assert p.where("ray.python") == "default"


def test_extends_relative_path_is_relative_to_the_child(sandbox, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    write(site, "base", "extends: ib-a100\nslurm:\n  account: base-acct\n")
    child = write(site, "child", "extends: ./base.yaml\nslurm:\n  qos: high\n")
    p = load_profile(str(child))
    assert (p.slurm.account, p.slurm.qos, p.slurm.gpus_per_node) == ("base-acct", "high", 8)


def test_profile_by_path(sandbox, tmp_path):
    f = write(tmp_path, "mine", "extends: local\nray:\n  readiness_timeout_s: 42\n")
    p = load_profile(str(f))
    assert p.name == "mine" and p.ray.readiness_timeout_s == 42


# One case per class of invalid profile: (file text or None, overrides, expected fragments of the one line)
INVALID = {
    "typo_top_level": ("extends: local\nslurmm:\n  nodes: 1\n", [],
                       ["bad.yaml:2", "unknown key 'slurmm'", "did you mean 'slurm'", "valid keys: accelerator"]),
    "typo_section_key": ("extends: ib-a100\nslurm:\n  gpus_per_nod: 8\n", [],
                         ["bad.yaml:3", "section 'slurm'", "did you mean 'gpus_per_node'", "valid keys:"]),
    "negative_gpus": ("extends: ib-a100\nslurm:\n  gpus_per_node: -1\n", [],
                      ["bad.yaml:3", "slurm.gpus_per_node must be between 0 and 64, got -1"]),
    "zero_nodes": (None, ["slurm.nodes=0"], ["--set slurm.nodes", "slurm.nodes must be between 1"]),
    "bad_size": ("extends: ib-a100\ncontainer:\n  shm_size: 12 gigs\n", [],
                 ["container.shm_size must be a size like '64G'"]),
    "port_range": (None, ["ray.port_base=60000", "ray.port_slots=100"], ["ray.port_slots puts the port range past 65535"]),
    "port_base": (None, ["ray.port_base=80"], ["ray.port_base must be between 1024 and 65000"]),
    "interface_name": (None, ["network.interface=eth 0"], ["network.interface must be a network interface name"]),
    "interface_too_long": (None, ["network.interface=averyveryverylongname0"], ["network.interface must be"]),
    "runtime_name": ("extends: ib-a100\ncontainer:\n  runtime: dockr\n", [],
                     ["bad.yaml:3", "container.runtime must be one of docker, podman"]),
    "usr1_signal": (None, ["slurm.signal=USR1"], ["slurm.signal must not be USR1 (NCCL uses SIGUSR1); use USR2"]),
    "roce_without_gid": (None, ["network.transport=roce"], ["network.gid_index is required"]),
    "ib_without_hcas": (None, ["network.ib_hcas=[]"], ["network.ib_hcas must list at least one HCA"]),
    "image_missing": ("extends: local\ncontainer:\n  runtime: podman\n", [], ["container.image is required"]),
    "wrong_type": (None, ["slurm.nodes=two"], ["slurm.nodes must be an integer, got 'two'"]),
    "wrong_bool": (None, ["container.init=maybe"], ["container.init must be true or false"]),
    "section_not_mapping": ("slurm: 3\n", [], ["slurm must be a mapping of partition"]),
    "duplicate_key": ("slurm:\n  nodes: 1\n  nodes: 2\n", [], ["bad.yaml:3", "'slurm.nodes' appears twice"]),
    "invalid_yaml": ("slurm:\n  nodes: [1\n", [], ["not valid YAML"]),
    "not_a_mapping": ("- a\n- b\n", [], ["must be a mapping of sections"]),
    "extends_unknown": ("extends: ib-a10\n", [], ["extends: profile 'ib-a10' not found", "did you mean 'ib-a100'"]),
    "hostile_partition": (None, ["slurm.partition=gpu;touch x"], ["slurm.partition must be a SLURM name"]),
    "newline_in_mount": ("extends: ib-a100\ncontainer:\n  mounts: [\"/a\\n/b:/x\"]\n", [],
                         ["container.mounts[0] must not contain newlines"]),
    "newline_in_env": ("extends: ib-a100\nenv:\n  vars:\n    X: \"a\\nb\"\n", [], ["env.vars.X must not contain newlines"]),
    "env_name": ("extends: ib-a100\nenv:\n  vars:\n    1BAD: x\n", [], ["env.vars.1BAD must be a shell variable name"]),
    "env_reserved": (None, ["env.vars.HPCV_NODES=3"], ["HPCV_NODES is set by the launcher"]),
    "relative_mount_dst": (None, ["container.mounts=[/data:data]"], ["destination must be an absolute path"]),
    "tilde_path": (None, ["paths.data_dir=~/data"], ["'~' is not expanded"]),
    "sbatch_arg": (None, ["slurm.extra_args=['--comment=a b']"], ["slurm.extra_args[0] must be an option"]),
    "local_multi_node": ("extends: local\nslurm:\n  nodes: 2\n", [], ["slurm.nodes must be 1 for scheduler 'local'"]),
    "temp_dir_long": (None, ["ray.temp_dir_root=/" + "x" * 60], ["ray.temp_dir_root is 61 characters"]),
    "gpus_without_accelerator": ("extends: local\nslurm:\n  gpus_per_node: 2\n", [], ["accelerator is 'none'"]),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_profile_one_line(case, sandbox):
    text, overrides, fragments = INVALID[case]
    if text is None:
        target = "ib-a100"
    else:
        write(sandbox, "bad", text)
        target = "bad"
    with pytest.raises(ProfileError) as info:
        load_profile(target, overrides)
    msg = str(info.value)
    assert isinstance(info.value, HpcVerlError)
    assert "\n" not in msg
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"


def test_extends_cycle(sandbox):
    write(sandbox, "a", "extends: b\n")
    write(sandbox, "b", "extends: a\n")
    with pytest.raises(ProfileError, match=r"cycle: .*a.yaml -> .*b.yaml -> .*a.yaml"):
        load_profile("a")


def test_unknown_profile_suggests(sandbox):
    with pytest.raises(ProfileError, match=r"profile 'roce-h10' not found \(did you mean 'roce-h100'\?\)"):
        load_profile("roce-h10")


def test_cli_show_and_errors(cli, tmp_path):
    res = cli("profiles", "show", "roce-h100", "--set", "slurm.nodes=3", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "--set slurm.nodes" in res.stdout and "shipped:roce-h100.yaml" in res.stdout
    res = cli("profiles", "show", "ib-a100", "--set", "slurm.gpus_per_node=-2", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().count("\n") == 0
    assert "slurm.gpus_per_node must be between 0 and 64, got -2" in res.stderr
    res = cli("profiles", "list", cwd=tmp_path)
    assert res.returncode == 0
    for name in SHIPPED:
        assert name in res.stdout


def test_docs_describe_every_field():
    from pathlib import Path

    from hpc_verl.profiles import schema_fields

    docs = (Path(__file__).resolve().parents[1] / "docs" / "profiles.md").read_text()
    missing = [name for name, *_ in schema_fields() if f"| `{name}` |" not in docs]
    assert not missing, f"docs/profiles.md lacks rows for: {missing}"


def test_docs_defaults_match_the_schema():
    """The reference table's default column (numbers and booleans) follows the schema."""
    import re
    from pathlib import Path

    from hpc_verl.profiles import schema_fields

    docs = (Path(__file__).resolve().parents[1] / "docs" / "profiles.md").read_text()
    wrong = []
    for name, _type, default, _doc in schema_fields():
        if not isinstance(default, (int, float)):
            continue
        text = str(default).lower() if isinstance(default, bool) else str(default)
        m = re.search(rf"^\| `{re.escape(name)}` \| [^|]+ \| ([^|]+) \|", docs, re.M)
        if m and m.group(1).strip() != f"`{text}`":
            wrong.append(f"{name}: docs {m.group(1).strip()}, schema {text}")
    assert not wrong, wrong
