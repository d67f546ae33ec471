from hpc_verl import __version__


def test_version(cli):
    res = cli("--version")
    assert res.returncode == 0
    assert __version__ in res.stdout


def test_unknown_verb_is_one_line_exit_2(cli):
    res = cli("frobnicate")
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert "frobnicate" in lines[0]
    assert "Traceback" not in res.stderr


def _one_line(res):
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def test_bad_yaml_files_get_file_and_line(cli, tmp_path):
    """Profile, job config and trainer config share one reader: same 'file:line' message."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntrainer: [1\n")
    line = _one_line(cli("render", "--profile", "local", "--config", str(bad)))
    assert f"job config {bad}:" in line and "not valid YAML" in line
    prof_dir = tmp_path / "profiles"
    prof_dir.mkdir()
    (prof_dir / "broken.yaml").write_text("slurm:\n  nodes: [1\n")
    line = _one_line(cli("render", "--profile", str(prof_dir / "broken.yaml")))
    assert "profile file" in line and "broken.yaml:" in line and "not valid YAML" in line
    line = _one_line(cli("render", "--profile", "local", "--config", str(tmp_path / "missing.yaml")))
    assert "missing.yaml cannot be read" in line
