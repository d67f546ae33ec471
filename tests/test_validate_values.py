"""`hpc-verl validate` on legal values (issue 13, item 7).

A user value holding ``$(b)``, a backtick or a quote is quoted as a literal in the script, and
shellcheck (the real one) must not take it for a forgotten expansion; a template that does
have a real shellcheck finding must still fail validation.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from hpc_verl.launch.spec import render
from hpc_verl.launch.spec.render import shquote

REPO = Path(__file__).resolve().parents[1]
HOSTILE_VALUE = "a $(b) `c` it's"
LITERALS = [HOSTILE_VALUE, "$(touch /tmp/x)", "`id`", "it's", "\\", "$'x'", "a\\'b", "\\$HOME", "'$", "$",
            "tab\there\nnew line", "ünï $x ${y:-z}", "${actor_rollout_ref.model.path}", "\\x41$\\n", "", "-n",
            "plain", "with space", "a\"b"]


def _bash_value(quoted: str) -> str:
    res = subprocess.run(["bash", "-c", f"printf '%s' {quoted}"], capture_output=True, text=True, check=True)
    return res.stdout


@pytest.mark.parametrize("value", LITERALS)
def test_shquote_gives_bash_the_value_itself(value):
    assert _bash_value(shquote(value)) == value


def test_quoted_values_pass_real_shellcheck(tmp_path):
    script = tmp_path / "values.sh"
    script.write_text("#!/bin/bash\n" + "".join(f"v{i}={shquote(v)}\nprintf '%s\\n' \"$v{i}\"\n"
                                                 for i, v in enumerate(LITERALS)))
    res = subprocess.run(["shellcheck", "--shell=bash", "--format=gcc", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout
    # the guard against a lint that passes anything: the same values in plain single quotes are reported
    script.write_text("#!/bin/bash\nv='a $(b)'\nprintf '%s\\n' \"$v\"\n")
    res = subprocess.run(["shellcheck", "--shell=bash", "--format=gcc", str(script)], capture_output=True, text=True)
    assert res.returncode != 0 and "SC2016" in res.stdout


def _eval_in_bash(lines: list[str], setup: str, show: str) -> str:
    return subprocess.run(["bash", "-c", setup + "\n" + "\n".join(lines) + "\n" + show], capture_output=True,
                          text=True, check=True).stdout


def test_validate_passes_a_profile_whose_env_value_holds_expansions_and_quotes(cli, tmp_path):
    prof = tmp_path / "cluster_profiles" / "hostile-env.yaml"
    prof.parent.mkdir()
    # JSON is YAML: the value goes in exactly as the test holds it
    import json
    prof.write_text(json.dumps({"extends": "ib-a100", "env": {"vars": {"HOSTILE": HOSTILE_VALUE}}}))
    res = cli("validate", "--profile", "hostile-env", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "✓ hostile-env: schema, bash -n, shellcheck ok" in res.stdout
    res = cli("render", "--profile", "hostile-env", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("hpcv_export HOSTILE ")]
    assert len(line) == 1
    # ... and the script gives the trainer the value itself, not its expansion
    out = _eval_in_bash(line, 'hpcv_export() { printf "%s=%s" "$1" "$2"; }', "")
    assert out == f"HOSTILE={HOSTILE_VALUE}"


def test_the_verl_example_validates_and_keeps_its_interpolation(cli, tmp_path):
    """examples/job_verl_gsm8k.yaml: critic.model.path=${actor_rollout_ref.model.path} is verl's own
    interpolation; it must reach verl as written, and the script must pass shellcheck."""
    config = str(REPO / "examples" / "job_verl_gsm8k.yaml")
    res = cli("validate", "--profile", "ib-a100", "--config", config, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    script = cli("render", "--profile", "ib-a100", "--config", config, cwd=tmp_path).stdout
    line = [ln.strip() for ln in script.splitlines() if ln.strip().startswith("HPCV_TRAINER_ARGS=(")]
    args = _eval_in_bash(line, "", 'printf "%s\\n" "${HPCV_TRAINER_ARGS[@]}"').splitlines()
    assert "critic.model.path=${actor_rollout_ref.model.path}" in args


@pytest.mark.parametrize("bad_line, code", [
    ("hpcv_log 'run dir: $HPCV_RUN_DIR'", "SC2016"),   # a single-quoted expansion that never expands
    ("ls $HPCV_RUN_DIR", "SC2086"),                    # an unquoted expansion
])
def test_validate_still_fails_a_template_with_a_real_finding(tmp_path, monkeypatch, capsys, bad_line, code):
    from hpc_verl.cli.main import main

    templates = tmp_path / "templates"
    shutil.copytree(render.templates_dir(), templates)
    job = templates / "job.sbatch.j2"
    text = job.read_text()
    assert "\nhpcv_validate\n" in text
    job.write_text(text.replace("\nhpcv_validate\n", f"\nhpcv_validate\n{bad_line}\n", 1))
    monkeypatch.setattr(render, "templates_dir", lambda: templates)
    render.environment.cache_clear()
    try:
        rc = main(["validate", "--profile", "ib-a100"])
        out = capsys.readouterr()
    finally:
        monkeypatch.undo()
        render.environment.cache_clear()
    assert rc == 2
    assert code in out.out and "1 of 1 profile(s) failed validation" in out.err
    assert main(["validate", "--profile", "ib-a100"]) == 0  # the shipped templates pass
