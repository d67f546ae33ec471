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
