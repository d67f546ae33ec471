"""benchmarks/vs_verl.py's parts: the tagged process tree, the counting hooks loaded into verl's
processes, verl's command (composed with verl's own config) and the report's refusals.

The whole benchmark (verl's start alone takes ~90 s here) is run by hand; its figures are in
docs/benchmarks.md with the command, commit and load."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import proctree  # noqa: E402
from benchmarks import vs_verl as V  # noqa: E402

try:
    import verl  # noqa: F401
    HAVE_VERL = True
except Exception:  # noqa: BLE001 - verl's import pulls in many packages; any failure means "not here"
    HAVE_VERL = False


def _python(code: str, env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **env}, **kw)


def test_the_sampler_follows_a_tagged_process_that_left_the_tree_and_ends_it(tmp_path):
    """A grandchild in a session of its own (as Ray's processes are) still counts, by its tag;
    after the parent ends it is a leftover, and kill_leftovers ends it."""
    tag = proctree.tag_env()
    ready = tmp_path / "ready"
    parent = _python(f"""
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(300_000_000); b[::4096] = b'x' * len(b[::4096]); "
                          "open({str(ready)!r}, 'w').close(); time.sleep(600)"], start_new_session=True)
        time.sleep(600)
    """, tag)
    sampler = proctree.TreeSampler(tag[proctree.TAG], sorted(os.sched_getaffinity(0)), interval_s=0.05, pss_every=1)
    sampler.start()
    deadline = time.time() + 30
    while not ready.exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    parent.kill()
    parent.wait()
    figures = sampler.stop()
    assert figures["peak_rss_gb"] >= 0.3 and figures["peak_pss_gb"] >= 0.25, figures
    assert figures["max_processes"] == 2 and figures["cpu_s"] >= 0
    left = proctree.leftovers(tag[proctree.TAG])
    assert len(left) == 1                                   # the grandchild outlived its parent
    assert "bytearray" in proctree.kill_leftovers(tag[proctree.TAG])[0]
    assert proctree.leftovers(tag[proctree.TAG]) == []


def test_counting_hooks_count_rows_padded_and_packed_backward_and_optimizer_steps(tmp_path):
    """What the hooks inside verl's processes count, on a tiny Hugging Face Llama in a fresh
    process (the hooks are process-wide): padded rows, packed rows (one position 0 each), rows
    whose gradient flowed back, optimizer steps; nothing without the count directory."""
    code = """
        import json, os, sys, torch
        sys.path.insert(0, %r)
        import benchmarks.verl_counting  # noqa: F401  (installs the hooks)
        from transformers import LlamaConfig, LlamaForCausalLM
        m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with torch.no_grad():
            m(input_ids=torch.randint(0, 64, (3, 5)))                        # 3 rows, no backward
        pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])                   # 3 sequences packed in one row
        out = m(input_ids=torch.randint(0, 64, (1, 9)), position_ids=pos)
        out.logits.sum().backward()
        opt.step()
        m(input_ids=torch.randint(0, 64, (2, 4)))                           # a forward whose backward never runs
        print(json.dumps(sorted(os.listdir(os.environ.get("HPCV_BENCH_COUNT_DIR", ".")))))
    """ % str(REPO)
    counts = tmp_path / "counts"
    counts.mkdir()
    proc = _python(code, {"HPCV_BENCH_COUNT_DIR": str(counts)}, stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    files = json.loads(out.strip().splitlines()[-1])
    assert len(files) == 1 and files[0].endswith(".json")
    assert json.loads((counts / files[0]).read_text()) == {"fwd_rows": 8, "bwd_rows": 3, "optim_steps": 1}
    quiet = _python(code.replace('os.environ.get("HPCV_BENCH_COUNT_DIR", ".")', repr(str(tmp_path / "none"))),
                    {"HPCV_BENCH_COUNT_DIR": ""}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    quiet.communicate(timeout=120)
    assert list(counts.iterdir()) == [counts / files[0]]     # (no directory: the hooks are not installed)


def _args(**kw):
    a = V.parse_args(["--repeats", "3", *kw.pop("argv", [])])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def _run(side, rep, counts, foreign=0.01, sps=10.0):
    return {"side": side, "repeat": rep, "samples_per_s": sps, "first_step_s": 10.0, "peak_rss_gb": 2.0,
            "peak_pss_gb": 1.0, "max_processes": 5, "phases_s": {p: 0.1 for p in V.PHASES}, "counts": counts,
            "foreign_load": foreign, "leftover_processes": []}


def _env():
    return {"date_utc": "x", "command": "x", "commit": "x", "cpus_usable": 2, "loadavg_start": [0.0], "versions": {}}


def test_report_gives_ratios_only_at_equal_work_on_a_quiet_machine():
    a = _args()
    same = {"fwd_rows": 64, "bwd_rows": 32, "optim_steps": 2, "gen_tokens": 1024}
    runs = {"ours": [_run("ours", r, same, sps=30.0) for r in range(3)],
            "verl": [_run("verl", r, same, sps=10.0) for r in range(3)]}
    rep = V.build_report(a, runs, _env(), 1)
    assert rep["ratio"] == pytest.approx(3.0) and rep["equal_work"] is True
    assert rep["settings"]["ratios"]["first_step_s"] == pytest.approx(1.0)
    fewer = dict(same, bwd_rows=16)
    runs["verl"][1] = _run("verl", 1, fewer)
    rep = V.build_report(a, runs, _env(), 1)
    assert rep["ratio"] is None and rep["equal_work"] is False and "bwd_rows 32 vs 16" in rep["refused"]
    runs["verl"][1] = _run("verl", 1, same, foreign=0.4)
    rep = V.build_report(a, runs, _env(), 1)
    assert rep["ratio"] is None and "foreign CPU load" in rep["refused"] and "verl repeat 2" in rep["refused"]


def test_bad_arguments_are_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        V.parse_args(["--hidden", "64", "--heads", "4"])
    assert exc.value.code == 2 and "vLLM's CPU attention needs >= 32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        V.parse_args(["--sides", "ours,trl"])
    assert "--sides trl: choose from" in capsys.readouterr().err


@pytest.mark.skipif(not HAVE_VERL, reason="verl is not installed (scripts/setup.sh installs verl 0.9.1)")
def test_verls_command_composes_with_verls_own_config(tmp_path):
    """Every key of verl's side is one verl 0.9.1 knows, with the values of our side's workload."""
    from hpc_verl.util.dotted import get_path
    from hpc_verl.verl_upstream.command import resolved_config
    from benchmarks.rl_common import workload_settings

    a = _args()
    s = workload_settings(a)
    cmd, env = V.verl_command(s, tmp_path / "model", tmp_path / "data", tmp_path / "run", 5)
    assert cmd[1:3] == ["-m", "verl.trainer.main_ppo"]
    assert env["VERL_USE_EXTERNAL_MODULES"].split(",")[-1] == V.COUNTING_MODULE
    cfg = resolved_config(cmd[3:])
    mini = a.prompts // a.updates_per_round
    assert get_path(cfg, "actor_rollout_ref.actor.ppo_mini_batch_size") == mini
    assert get_path(cfg, "actor_rollout_ref.rollout.n") == a.group
    assert get_path(cfg, "data.max_response_length") == a.response_length
    assert get_path(cfg, "reward.custom_reward_function.name") == "digits_score"
    assert get_path(cfg, "actor_rollout_ref.rollout.name") == "vllm" and get_path(cfg, "trainer.device") == "cpu"
    ours = V.ours_command(s, tmp_path / "model", tmp_path / "data", tmp_path / "run", 5, "vllm")
    assert "actor_rollout_ref.rollout.name=vllm" in ours
    for key in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu"):
        assert f"actor_rollout_ref.actor.{key}={get_path(cfg, 'actor_rollout_ref.actor.' + key)}" in ours


def test_the_step_clock_times_a_step_at_its_head_and_keeps_its_whole_values(tmp_path):
    """verl's output as Ray forwards it: a long step line cut, another worker's line glued onto its
    head, its rest later. The step is timed when its head arrives; its values are the joined line's."""
    items = " - ".join(f"timing_s/part_{k}:{k}.5" for k in range(200))
    line = f"step:1 - {items}"
    cut = line.index("part_150:") + len("part_150:1")
    go = tmp_path / "go"
    script = f"""
        import os, sys, time
        line = {line!r}
        sys.stdout.write("(TaskRunner pid=7) " + line[:{cut}] + "(WorkerDict pid=9) INFO: saved\\n")
        sys.stdout.flush()
        while not os.path.exists({str(go)!r}):      # the rest comes only after the clock saw the head
            time.sleep(0.05)
        sys.stdout.write("(AgentLoopWorker pid=11) WARNING: x\\n" + line[{cut}:] + "\\n")
    """
    proc = _python(script, {}, stdout=subprocess.PIPE)
    clock = V.StepClock(proc, tmp_path / "verl.log", None)
    clock.start()
    deadline = time.monotonic() + 30
    while not clock.steps and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [rec["step"] for _, rec in clock.steps] == [1]    # timed at its head
    go.touch()
    clock.join(timeout=30)
    assert proc.wait(timeout=30) == 0
    [(_, rec)] = clock.steps
    assert len(rec) == 201 and rec["timing_s/part_150"] == 150.5 and rec["timing_s/part_199"] == 199.5
    assert (tmp_path / "verl.log").read_text().count("step:1 - ") == 1
