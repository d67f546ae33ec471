"""The docs this project owns stay in step with the code: the CLI reference is
generated from the parsers, the troubleshooting page names every doctor check, the
commands of docs/from-verl.md run, and every page says what it is for and speaks of the
product only."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from hpc_verl.ops.doctor import CHECKS, Context, Expectations, run_doctor

REPO = Path(__file__).resolve().parents[1]


def test_cli_reference_is_up_to_date():
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_cli_docs.py"), "--check"],
                         capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0, res.stderr


def test_cli_reference_lists_every_verb():
    from hpc_verl.cli.main import build_parser
    text = (REPO / "docs" / "cli.md").read_text()
    verbs = [a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction"][0].choices
    assert len(verbs) >= 5
    for verb in verbs:
        assert f"## hpc-verl {verb}\n" in text


def test_troubleshooting_names_every_doctor_check():
    text = (REPO / "docs" / "troubleshooting.md").read_text()
    names = {c.name for c in run_doctor(Expectations(), Context()).checks}
    assert len(names) == len(CHECKS)
    documented = set(re.findall(r"^\| `([a-z-]+)` \|", text, flags=re.M))
    assert names <= documented, names - documented
    for heading in ("Nodes cannot connect", "Multi-node is slower than one node",
                    "NCCL on sockets instead of InfiniBand", "Rollout latency", "Raylet registration"):
        assert f"## {heading}" in text


def test_quickstart_verl_job_is_valid(tmp_path):
    """The verl job file shown in the quick start passes the same validation as a submission."""
    import pytest

    from hpc_verl.launch.spec.jobconfig import load_job_config
    from hpc_verl.launch.spec.trainer_check import validate_job_trainer
    from hpc_verl.profiles import load_profile
    from hpc_verl.verl_upstream.config import find_verl

    if find_verl() is None:
        pytest.skip("upstream verl not installed")
    text = (REPO / "docs" / "quickstart.md").read_text()
    block = re.search(r"```yaml\n(# job.yaml\n.*?)```", text, flags=re.S).group(1)
    (tmp_path / "job.yaml").write_text(block)
    job = load_job_config(str(tmp_path / "job.yaml"))
    check = validate_job_trainer(load_profile("ib-a100"), job)
    assert check.kind == "verl" and check.command.verl_version


def test_job_config_reference_names_every_field():
    """The job config's fields are declared with docs (util.fields.spec, as the profile schema's);
    the YAML references in docs/profiles.md (job config) and docs/rayjobs.md (ray_job) show each."""
    from hpc_verl.launch.spec.jobconfig import JobConfig
    from hpc_verl.util.fields import field_docs

    def yaml_block(page: str, first_line: str) -> str:
        text = (REPO / "docs" / page).read_text()
        start = re.search(rf"^{re.escape(first_line)}", text, re.M).start()
        return text[start:text.index("```", start)]

    blocks = {"ray_job": yaml_block("rayjobs.md", "ray_job:"), "": yaml_block("profiles.md", "name: ppo-gsm8k")}
    missing = []
    for name, _type, _default, doc in field_docs(JobConfig):
        assert doc, name
        section, _, leaf = name.rpartition(".")
        block = blocks["ray_job" if section == "ray_job" else ""]
        if not re.search(rf"^\s*{re.escape(leaf)}:", block, re.M):
            missing.append(name)
    assert not missing, f"job config fields missing from the docs' YAML references: {missing}"


# ---------------------------------------------------------------- docs/from-verl.md
def _from_verl() -> str:
    return (REPO / "docs" / "from-verl.md").read_text()


def test_from_verl_commands_run(cli, tmp_path):
    """The page's ```console commands (`$ hpc-verl ...`: no cluster, no long run) run as shown, in
    a fresh directory holding the page's two YAML files, and exit 0."""
    import shlex

    import pytest

    from hpc_verl.verl_upstream.config import find_verl

    if find_verl() is None:
        pytest.skip("upstream verl not installed (the job's overrides are checked against it)")
    text = _from_verl()
    files = re.findall(r"```yaml\n# (\S+)\n(.*?)```", text, flags=re.S)
    assert {name for name, _ in files} == {"cluster_profiles/my-site.yaml", "job.yaml"}
    for name, body in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
    commands = [line[2:] for block in re.findall(r"```console\n(.*?)```", text, flags=re.S)
                for line in block.splitlines() if line.startswith("$ ")]
    assert len(commands) >= 5
    env = {"HPC_VERL_HOME": str(tmp_path / "home"), "HPC_VERL_PROFILE_PATH": ""}
    for command in commands:
        argv = shlex.split(command, comments=True)
        assert argv[0] == "hpc-verl", command
        res = cli(*argv[1:], cwd=tmp_path, env=env)
        assert res.returncode == 0, f"{command}\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
    assert (tmp_path / "job.sbatch").is_file()


def test_from_verl_other_commands_are_real():
    """The page's other hpc-verl commands (on a cluster, or a longer CPU run) parse with the
    CLI's own parser: every verb and option on the page exists."""
    import shlex

    from hpc_verl.cli.main import build_parser

    parser = build_parser()
    lines = [line for block in re.findall(r"```bash\n(.*?)```", _from_verl(), flags=re.S)
             for line in block.splitlines() if "hpc-verl " in line]
    assert len(lines) >= 6
    for line in lines:
        argv = shlex.split(line[line.index("hpc-verl "):], comments=True)[1:]
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            raise AssertionError(f"not a valid hpc-verl command: {line}") from e


def test_from_verl_is_linked_where_docs_are_listed():
    assert "docs/from-verl.md" in (REPO / "README.md").read_text()
    assert "(from-verl.md)" in (REPO / "docs" / "quickstart.md").read_text()


# ---------------------------------------------------------------- every page
_ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
_NOT_PRODUCT_TEXT = {
    "a work-log heading": re.compile(rf"^#{{1,6}}\s+(?:{_ORDINALS})\b|^#{{1,6}}\s.*\bsessions?\b", re.I | re.M),
    "an issue number": re.compile(r"\bissues?\s*#?\d+|(?<![\w&/#\"'])#\d+\b|\bPR\s*#?\d+", re.I),
    "'held-out'": re.compile(r"\bheld[- ]out\b", re.I),
    # "session" for a stretch of our work; a Ray session, an ssh session, a process's session and
    # a pytest session fixture are product words and stay
    "a work session": re.compile(rf"\b(?:{_ORDINALS}|this|that|last|next|previous|earlier|later|same|each|every|"
                                 rf"work|working)[ -]sessions?\b|\bsessions?\s+\d+\b", re.I),
}


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_pages_speak_of_the_product_only():
    """No page mentions how the product was made: work-log headings ("Eighth ..."), issue or PR
    numbers, work sessions, held-out runs. History lives in git."""
    found = []
    for page in _pages():
        text = page.read_text()
        for what, rx in _NOT_PRODUCT_TEXT.items():
            for m in rx.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{page.relative_to(REPO)}:{line}: {what}: {m.group(0)!r}")
    assert not found, "\n".join(found)


def test_the_product_text_check_catches_what_it_is_for():
    bad = ["### Eighth session (issue 17): three runs", "## Fifth pass", "fixed in #29", "see issue 29",
           "three held-out runs", "in the second session", "session 4 figures"]
    good = ["a Ray session name", "in a session of its own", "a closed ssh session", "the session fixture",
            "## Getting started", "see docs/slurm.md#upstream-verl", "&#123;"]
    assert all(any(rx.search(t) for rx in _NOT_PRODUCT_TEXT.values()) for t in bad)
    assert not any(rx.search(t) for t in good for rx in _NOT_PRODUCT_TEXT.values())


def test_every_page_starts_by_saying_what_it_is_for():
    """After the title, one or two lines of prose (not a heading, code, list or table)."""
    for page in _pages():
        lines = page.read_text().splitlines()
        assert lines[0].startswith("# "), page
        first = next(line for line in lines[1:] if line.strip())
        assert not re.match(r"(#|```|\||- |\* |\d+\. |<!--)", first), f"{page.relative_to(REPO)}: {first!r}"


def test_readme_curve_is_a_demo_runs_and_clears_the_demo_gate():
    """README's reward curve is the text scripts/demo.sh saved for its main job (copied in by
    scripts/readme_curve.py between markers, with the run's commit and date), and its last-10
    mean clears the gate the demo applies."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("readme_curve", REPO / "scripts" / "readme_curve.py")
    rc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rc)
    shown = rc.block((REPO / "README.md").read_text())
    assert "run: bash scripts/demo.sh, commit " in shown, "README's curve block is missing or not a demo run's"
    demo = (REPO / "scripts" / "demo.sh").read_text()
    gate = float(re.search(r"--require-final ([0-9.]+)", demo).group(1))
    assert gate >= 0.8 and rc.last_mean(shown) >= gate
