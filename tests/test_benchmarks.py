"""The benchmarks' own logic: arguments, the report's fixed shape, the equal-work refusal, the counting hooks.

No test here asserts a time. The benchmarks themselves are run by people (README,
docs); these tests keep what decides whether a ratio may be printed honest.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import benchlib as B  # noqa: E402
from benchmarks import bringup, dataflow_overhead, ppo_profile, ppo_throughput, startup  # noqa: E402
from benchmarks.counting import (COUNT_KEYS, PassCounter, generated_tokens, ours_counts_from_config,  # noqa: E402
                                 ours_round_counts)
from benchmarks.rl_common import ours_command  # noqa: E402


# ---------------------------------------------------------------- arguments
@pytest.mark.parametrize("mod, argv, message", [
    (ppo_throughput, ["--group", "1"], "--group must be >= 2"),
    (ppo_throughput, ["--prompts", "6", "--updates-per-round", "4"], "must be a multiple of --updates-per-round"),
    (ppo_throughput, ["--warmup", "0"], "--warmup must be >= 1"),
    (ppo_throughput, ["--size", "huge"], "invalid choice: 'huge'"),
    (ppo_throughput, ["--cores", "999"], "--cores 999"),
    (ppo_throughput, ["--repeats", "0"], "--repeats must be >= 1"),
    (dataflow_overhead, ["--parallelism", "1,x"], "expected numbers like 1,2,4"),
    (dataflow_overhead, ["--parallelism", "0"], "every value must be >= 1"),
    (dataflow_overhead, ["--micro-batch", "64", "--window", "32"], "larger than --window"),
    (dataflow_overhead, ["--ppo-repeats", "0"], "--ppo-repeats must be >= 1"),
    (bringup, ["--nodes", "2,9"], "each count must be within 2..4"),
    (bringup, ["--sides", "ours,sleep"], "give ours and poll"),
    (bringup, ["--testbed-dir", "/x", "--nodes", "2,4"], "a single --nodes count"),
    (bringup, ["--warmup", "-1"], "--warmup must be >= 0"),
    (startup, ["--sides", "submit,train"], "give trl and at least one of submit, train"),
    (ppo_profile, ["--sides", "trl"], "give ours and optionally trl"),
    (ppo_profile, ["--warmup", "0"], "--warmup must be >= 1"),
])
def test_bad_arguments_are_one_line_and_exit_2(mod, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        mod.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_sizes_and_overrides():
    a = ppo_throughput.parse_args(["--size", "tiny", "--hidden", "96", "--heads", "4"])
    assert (a.hidden, a.layers, a.heads) == (96, 2, 4)
    d = ppo_throughput.parse_args([])
    assert (d.hidden, d.layers) == (512, 8) and d.repeats == 3 and d.cpus
    assert "only 1 repeat" in ppo_throughput.parse_args(["--repeats", "1"]).notes[0]


def test_alternating_order_flips_every_repeat():
    assert B.alternating(["a", "b", "c"], 3) == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"),
                                                 (2, "a"), (2, "b"), (2, "c")]


def test_a_report_names_the_commit_it_measured(tmp_path, monkeypatch):
    env = B.environment()
    assert env["commit"] and env["commit"].split("+")[0] == subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    repo = tmp_path / "repo"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=repo,  # noqa: E731
                                    check=True, capture_output=True, text=True).stdout.strip()
    git("init", "-q")
    (repo / "bench.py").write_text("x = 1\n")
    git("add", "bench.py")
    git("commit", "-qm", "one")
    monkeypatch.setattr(B, "REPO", repo)
    head = git("rev-parse", "--short=12", "HEAD")
    (repo / "scratch.txt").write_text("untracked files are not the scripts\n")
    assert B.source_commit() == head
    (repo / "bench.py").write_text("x = 2\n")
    assert B.source_commit() == head + "+dirty"
    monkeypatch.setattr(B, "REPO", tmp_path / "not-a-repo")
    (tmp_path / "not-a-repo").mkdir()
    assert B.source_commit() is None


def test_the_ratio_interval_holds_the_ratio_and_narrows_with_more_rounds():
    import random
    rng = random.Random(1)
    ours = [100 * rng.lognormvariate(0, 0.18) for _ in range(201)]
    hand = [100 * rng.lognormvariate(0, 0.18) for _ in range(201)]
    point = B.summary(ours)["median"] / B.summary(hand)["median"]
    lo, hi = B.median_ratio_ci(ours, hand)
    assert lo < point < hi and B.median_ratio_ci(ours, hand) == [lo, hi]   # reproducible (fixed seed)
    lo31, hi31 = B.median_ratio_ci(ours[:31], hand[:31])
    assert hi31 - lo31 > 1.5 * (hi - lo)
    assert B.median_ratio_ci([2.0] * 5, [1.0] * 5) == [2.0, 2.0]


# ---------------------------------------------------------------- the report
def _report(**kw):
    base = dict(ratio=1.5, ratio_definition="x over y", baseline="y", rows=[{"name": "ours", "kind": "ours"}],
                settings={}, env=B.environment(), equal_work_ok=True)
    base.update(kw)
    return B.make_report("demo", **base)


def test_report_has_the_fixed_shape_and_writes_atomically(tmp_path):
    rep = _report()
    assert tuple(rep) == B.REPORT_KEYS and rep["ratio"] == 1.5
    out = tmp_path / "r.json"
    B.write_report(out, rep)
    assert json.loads(out.read_text())["ratio"] == 1.5
    bad = dict(rep, ratio=None)  # no ratio and no reason
    with pytest.raises(B.BenchError, match="must say why"):
        B.write_report(tmp_path / "bad.json", bad)
    assert not (tmp_path / "bad.json").exists() and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_every_report_starts_with_its_record():
    """command, commit, date, machine and load at the top of every benchmark's report (one helper,
    benchlib.run_record: the make_report benchmarks and scale_out alike)."""
    rep = _report()
    assert list(rep)[2:7] == list(B.RECORD_KEYS)
    assert rep["command"].startswith("python ") and rep["date"].endswith("Z") and rep["commit"]
    assert rep["machine"]["cores"] >= 1 and "cpu_model" in rep["machine"] and rep["load"]["start"]
    assert not set(rep["environment"]) & {"command", "commit", "date_utc", "loadavg_start"}
    assert B.record_of(rep) == {k: rep[k] for k in B.RECORD_KEYS}
    legacy = {"ratio": 2.0, "environment": {"date_utc": "d", "commit": "c", "command": "x.py", "cpus": 2,
                                            "cpus_usable": 2, "loadavg_start": [1.0], "loadavg_end": [2.0]}}
    old = B.record_of(legacy)   # a report written when the record was under "environment"
    assert (old["command"], old["commit"], old["date"], old["machine"]["cores"]) == ("x.py", "c", "d", 2)
    assert old["machine"]["cpu_model"] is None and old["load"] == {"start": [1.0], "end": [2.0]}
    for key in ("command", "date"):
        with pytest.raises(B.BenchError, match=f"lacks its {key}"):
            B.validate_report(dict(rep, **{key: None}))
    src = (REPO / "benchmarks" / "scale_out.py").read_text()
    assert "B.run_record(" in src and "B.validate_record(" in src


@pytest.mark.parametrize("kw, message", [
    (dict(ratio=2.0, refused="work differs"), "must not carry one"),
    (dict(ratio=2.0, equal_work_ok=False), "no ratio may be given"),
    (dict(rows=[]), "at least one row"),
    (dict(rows=[{"name": "x", "kind": "winner"}]), "needs a name and a kind"),
    (dict(ratio=-1.0), "positive number"),
])
def test_report_rejects_what_would_mislead(kw, message):
    with pytest.raises(B.BenchError, match=message):
        _report(**kw)


# ---------------------------------------------------------------- equal work
def test_equal_work_names_the_first_difference():
    same = {"fwd_rows": 256, "bwd_rows": 128, "optim_steps": 4, "gen_tokens": 4096}
    assert B.equal_work({"ours": [same, same], "trl": [same]}) is None
    fewer = dict(same, fwd_rows=128)
    why = B.equal_work({"ours": [same], "trl": [same, fewer]})
    assert why and "trl round 2" in why and "fwd_rows 256 vs 128" in why
    assert "no counted rounds" in B.equal_work({"ours": [same], "trl": []})


def _ppo_args(**kw):
    a = ppo_throughput.parse_args(["--size", "tiny", "--prompts", "4", "--group", "4", "--response-length", "8",
                                   "--updates-per-round", "2", "--rounds", "2", "--repeats", "1"])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def _run(counts, round_s=(0.2, 0.2), **extra):
    return dict({"round_s": list(round_s), "counts": [dict(counts) for _ in round_s], "median_round_s": round_s[0],
                 "count_source": {k: "measured" for k in COUNT_KEYS}, "loadavg_before": [1.0, 1.0, 1.0],
                 "versions": {"trl": "x"}}, **extra)


def test_ppo_report_gives_a_ratio_only_at_equal_work():
    a = _ppo_args()
    s = ppo_throughput.settings(a)
    ours = ours_counts_from_config(s)
    shortcut = ours_counts_from_config(dict(s, old_log_prob_from_rollout=True))
    runs = {"ours": [_run(ours, (0.1, 0.1))], "trl": [_run(ours, (0.2, 0.2))],
            "ours-shortcut": [_run(shortcut, (0.05, 0.05))], "ours-mkl": [_run(ours, (0.16, 0.16))]}
    rep = ppo_throughput.build_report(a, runs, B.environment(), 1000)
    assert rep["equal_work"] is True and rep["ratio"] == pytest.approx(2.0)
    extra = next(r for r in rep["rows"] if r["name"] == "ours-shortcut")
    assert extra["kind"] == "extra" and extra["ratio_vs_baseline"] is None
    assert "fwd_rows 32 vs 16" in extra["no_ratio_because"]
    mkl = next(r for r in rep["rows"] if r["name"] == "ours-mkl")   # equal work, another GEMM: a ratio, not the headline
    assert mkl["kind"] == "extra" and mkl["ratio_vs_baseline"] == pytest.approx(1.25)
    cmds = {side: ours_command(ppo_throughput.settings(a, side), Path("m"), Path("d"), Path("r"), 1)
            for side in ("ours", "ours-mkl")}
    assert "hpc_verl.cpu_matmul=onednn" in cmds["ours"] and "hpc_verl.cpu_matmul=torch" in cmds["ours-mkl"]
    # TRL did one forward pass more per round than ours: no headline ratio at all
    runs["trl"] = [_run(dict(ours, fwd_rows=ours["fwd_rows"] + 16))]
    rep = ppo_throughput.build_report(a, runs, B.environment(), 1000)
    assert rep["ratio"] is None and rep["equal_work"] is False and "fwd_rows" in rep["refused"]
    # equal counts, but TRL recomputed forwards in backward: refused too
    runs["trl"] = [_run(ours, gradient_checkpointing=True)]
    rep = ppo_throughput.build_report(a, runs, B.environment(), 1000)
    assert rep["ratio"] is None and "gradient checkpointing" in rep["refused"]


def test_dataflow_report_refuses_when_work_differs():
    a = dataflow_overhead.parse_args(["--repeats", "3"])
    rows = [{"name": "p1_ours", "kind": "ours", "case": "pipeline", "parallelism": 1, "per_item_us": 12.0,
             "work": {"items": 100}},
            {"name": "p1_hand", "kind": "baseline", "case": "pipeline", "parallelism": 1, "per_item_us": 10.0,
             "work": {"items": 100}},
            {"name": "p1_cg", "kind": "lower_bound", "case": "pipeline", "parallelism": 1, "error": "X: no"}]
    rep = dataflow_overhead.build_report(a, [dict(r) for r in rows], B.environment())
    assert rep["ratio"] == pytest.approx(1.2) and any("did not run here" in n for n in rep["notes"])
    rows[1]["work"] = {"items": 99}
    rep = dataflow_overhead.build_report(a, [dict(r) for r in rows], B.environment())
    assert rep["ratio"] is None and "items 100 vs 99" in rep["refused"]


def test_ours_counts_prefer_the_trainers_measured_keys():
    s = {"prompts": 4, "group": 4, "updates_per_round": 2, "response_length": 8, "old_log_prob_from_rollout": False}
    assert ours_counts_from_config(s) == {"fwd_rows": 32, "bwd_rows": 16, "optim_steps": 2, "gen_tokens": 128}
    counts, src = ours_round_counts({"n_response_tokens": 120}, s)
    assert counts["gen_tokens"] == 120 and src["gen_tokens"] == "measured" and src["fwd_rows"] == "analytic"
    counts, src = ours_round_counts({"perf/fwd_rows": 48, "perf/bwd_rows": 16, "perf/optim_steps": 2,
                                     "perf/gen_tokens": 128}, s)
    assert counts["fwd_rows"] == 48 and set(src.values()) == {"measured"}


# ---------------------------------------------------------------- counting hooks
def _tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      eos_token_id=39, pad_token_id=0, bos_token_id=1)
    return LlamaForCausalLM(cfg)


def test_pass_counter_counts_rows_through_forward_backward_steps_and_generation():
    import torch
    model = _tiny_llama()
    counter = PassCounter().attach(model).attach_optimizers()
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(2, 38, (3, 7))
        with torch.no_grad():                       # an old-log-prob style forward: no backward
            model(input_ids=ids)
        model(input_ids=ids).logits.sum().backward()
        opt.step()
        assert counter.snapshot() == {"fwd_rows": 6, "bwd_rows": 3, "optim_steps": 1, "gen_tokens": 0}
        out = model.generate(input_ids=ids[:2], max_new_tokens=5, min_new_tokens=5, do_sample=True,
                             pad_token_id=0, eos_token_id=39)
        assert out.shape == (2, 12)
        snap = counter.snapshot()
        assert snap["gen_tokens"] == 10 and snap["fwd_rows"] == 6  # generation's forwards are not full forwards
        assert counter.layer_rows == 6
    finally:
        counter.detach()


def test_pass_counter_sees_recomputation_under_gradient_checkpointing():
    model = _tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    counter = PassCounter().attach(model)
    import torch
    model(input_ids=torch.randint(2, 38, (2, 6))).logits.sum().backward()
    counter.detach()
    assert counter.totals["fwd_rows"] == 2 and counter.layer_rows > counter.totals["fwd_rows"]


def test_generated_tokens_stop_at_the_first_eos():
    import torch
    seqs = torch.tensor([[5, 5, 7, 9, 7, 7], [5, 5, 1, 2, 3, 4]])
    assert generated_tokens(seqs, 2, [9]) == 2 + 4  # row 0: 7, 9 (EOS counted, then padding)
    assert generated_tokens(seqs, 2, []) == 8


def test_never_stop_puts_eos_outside_the_vocabulary(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.rl_common import make_assets
    model_dir, data, params = make_assets(tmp_path, 32, 1, 4, 16)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert tok.eos_token_id >= model.config.vocab_size == model.get_output_embeddings().weight.shape[0]
    assert model.generation_config.eos_token_id == tok.eos_token_id and (data / "train.parquet").exists()
    ids = tok(["12345"], return_tensors="pt").input_ids
    out = model.generate(input_ids=ids, max_new_tokens=12, do_sample=True, pad_token_id=tok.pad_token_id)
    assert out.shape[1] - ids.shape[1] == 12  # no early stop is possible
    assert params == sum(p.numel() for p in model.parameters())


def test_trl_counts_equal_ours_analytic_counts_at_the_same_settings(tmp_path):
    """TRL (hooks, measured) does per round what our config says ours does: the comparison is like for like."""
    pytest.importorskip("trl")
    from benchmarks.rl_common import make_assets, trl_worker
    model_dir, data, _ = make_assets(tmp_path, 32, 1, 4, 64)
    a = _ppo_args()
    s = ppo_throughput.settings(a)
    out = trl_worker({"settings": s, "steps": 2, "model": str(model_dir), "data": str(data),
                      "work": str(tmp_path / "w")})
    assert out["counts"] == [ours_counts_from_config(s)] * 2
    assert out["gradient_checkpointing"] is False and out["recomputed_layer_rows"] == 0
    assert len(out["round_s"]) == 1 and out["versions"]["trl"]


# ---------------------------------------------------------------- ppo_profile's accounting
def test_profile_buckets_name_the_gemms_attention_and_optimizer():
    assert [ppo_profile.bucket(op) for op in ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm",
                                               "aten::_scaled_dot_product_flash_attention_for_cpu",
                                               "aten::_fused_adamw_", "aten::mul")] == \
        ["gemm", "gemm", "gemm", "attention", "attention", "optimizer", "other ops"]
    assert ppo_profile.gemm_flops("mkldnn::_linear_pointwise", [[32, 31, 512], [1024, 512], [], []]) == \
        2 * 32 * 31 * 512 * 1024
    assert ppo_profile.gemm_flops("aten::mm", [[1024, 512], [512, 64]]) == 2 * 1024 * 512 * 64
    assert ppo_profile.gemm_flops("aten::addmm", [[64], [8, 16], [16, 64], [], []]) == 2 * 8 * 16 * 64
    assert ppo_profile.gemm_flops("aten::bmm", [[4, 2, 3], [4, 3, 5]]) == 0


@pytest.mark.parametrize("choice", ["torch", "onednn"])
def test_profile_counts_a_linear_layers_three_products(choice):
    """A linear layer's forward, input gradient and weight gradient are 3 x 2MKN FLOPs in the
    profile's GEMM bucket, on MKL (F.linear) and on oneDNN (cpu_gemm) alike; the floor is timed."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    from hpc_verl.trainer.engine import cpu_gemm

    M, K, N = 48, 64, 40
    layer = torch.nn.Sequential(torch.nn.Linear(K, N))
    assert cpu_gemm.install(layer, choice) == (1 if choice == "onednn" and cpu_gemm.available() else 0)
    x = torch.randn(4, 12, K, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        layer(x).sum().backward()
    s = ppo_profile.finish_side(ppo_profile.summarise(prof, 5.0))
    assert s["gemm_gflop"] * 1e9 == pytest.approx(3 * 2 * M * K * N)
    assert sum(s["buckets_s"].values()) == pytest.approx(5.0) and s["buckets_s"]["gemm"] > 0
    assert 0 < s["gemm_floor_s"] < 5.0


@pytest.mark.slow
def test_ppo_profile_runs_small_and_writes_its_report(tmp_path):
    out = tmp_path / "prof.json"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ppo_profile.py"), "--size", "tiny",
                          "--prompts", "4", "--group", "2", "--response-length", "4", "--updates-per-round", "2",
                          "--sides", "ours", "--repeats", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr[-2000:] + res.stdout[-2000:]
    rep = json.loads(out.read_text())
    assert tuple(rep) == B.REPORT_KEYS and rep["ratio"] >= 1.0 and "only 1 repeat" in rep["notes"][0]
    ours = rep["rows"][0]
    assert ours["name"] == "ours" and ours["gemm_gflop"] > 0 and ours["gemm_floor_s"] > 0 and ours["plain_round_s"] > 0
    assert sum(ours["buckets_s"].values()) == pytest.approx(ours["round_s"], abs=0.01)
    assert ours["runs"][0]["top_non_gemm"] and "largest non-GEMM operators" in res.stdout
    run = ours["runs"][0]   # one run: its cost is the row's (rounded to 1 ms)
    assert ours["profiler_cost_s"] == pytest.approx(run["round_s"] - run["plain_round_s"], abs=6e-4)
    assert "ppo_profile: ratio" in res.stdout


def test_trl_profile_sees_more_gemm_work_than_ours_at_equal_passes(tmp_path):
    """At the same counted passes TRL's products cover every row's prompt, ours each prompt once:
    the profiles' FLOPs must show TRL's as the larger (a check of the accounting on both sides)."""
    pytest.importorskip("trl")
    from benchmarks.rl_common import make_assets, trl_worker, workload_settings
    model_dir, data, _ = make_assets(tmp_path, 32, 1, 4, 64)
    a = ppo_profile.parse_args(["--size", "tiny", "--hidden", "32", "--layers", "1", "--prompts", "4", "--group", "4",
                                "--response-length", "4", "--updates-per-round", "2"])
    s = {**workload_settings(a), "warmup": 1}
    common = {"settings": s, "model": str(model_dir), "data": str(data)}
    trl = trl_worker({**common, "steps": 2, "work": str(tmp_path / "t"), "profile_round": 1})["profile"]
    ours = ppo_profile.ours_child({**common, "work": str(tmp_path / "o")})
    assert trl["gemm_gflop"] > ours["gemm_gflop"] > 0


# ---------------------------------------------------------------- bring-up pieces that need no SLURM
@pytest.mark.parametrize("side", ["poll", "sleep"])
def test_baseline_scripts_quote_hostile_paths_and_pass_shellcheck(side, tmp_path):
    hostile = tmp_path / "a b$(touch pwned)'q"
    text = bringup.baseline_script(side, 3, hostile, "/tmp/x;y")
    script = tmp_path / "s.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    if shutil.which("shellcheck"):
        res = subprocess.run(["shellcheck", "-S", "warning", str(script)], capture_output=True, text=True)
        assert res.returncode == 0, res.stdout
    assert "#SBATCH --nodes=3" in text and not (tmp_path / "pwned").exists()


def test_hold_notes_ready_and_waits_for_release(tmp_path):
    t = threading.Thread(target=bringup.hold, args=(tmp_path, 20))
    t.start()
    deadline = time.monotonic() + 10
    while not (tmp_path / "declared").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert float((tmp_path / "declared").read_text()) > 0 and t.is_alive()
    (tmp_path / "release").write_text("1")
    t.join(5)
    assert not t.is_alive()


def test_bringup_report_never_uses_the_sleep_script_as_baseline():
    a = bringup.parse_args(["--nodes", "2", "--repeats", "3"])
    run = {"ready_s": 0.0, "declared_before_all_alive": False}
    runs = {2: {"ours": [dict(run, ready_s=6.0)], "poll": [dict(run, ready_s=8.0)],
                "sleep": [dict(run, ready_s=15.0, declared_before_all_alive=True)]}}
    warm = {2: {"ours": [30.0], "poll": [31.0]}}   # cold first jobs: recorded, never in a median
    rep = bringup.build_report(a, runs, B.environment(), None, {"available": True, "ran": False, "why": "one host"},
                               warm)
    ours = next(r for r in rep["rows"] if r["name"] == "ours_n2")
    assert rep["ratio"] == pytest.approx(0.75) and ours["baseline"] == "poll"
    assert rep["settings"]["warmup"] == 1 and rep["settings"]["warmup_ready_s"] == {"2": warm[2]}
    assert bringup.warmup_sides(a.side_list) == ["ours", "poll"]
    assert ours["ratio_vs_sleep"] == pytest.approx(0.4)
    assert next(r for r in rep["rows"] if r["name"] == "symmetric_n2")["why"] == "one host"
    assert any("before every node had joined" in n for n in rep["notes"])


# ---------------------------------------------------------------- one real, small dataflow run
@pytest.mark.slow
def test_dataflow_overhead_runs_small_and_writes_its_report(tmp_path):
    out = tmp_path / "df.json"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "dataflow_overhead.py"), "--items", "64",
                          "--micro-batch", "8", "--window", "32", "--parallelism", "1", "--repeats", "1", "--ppo-repeats", "1",
                          "--ppo-steps", "2", "--weights-mb", "1", "--payload-rows", "4", "--payload-seq", "16",
                          "--payload-resp", "8", "--num-cpus", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr[-2000:] + res.stdout[-2000:]
    rep = json.loads(out.read_text())
    assert tuple(rep) == B.REPORT_KEYS and rep["ratio"] > 0 and rep["equal_work"] is True
    names = {r["name"] for r in rep["rows"]}
    assert {"pipeline_p1_ours", "pipeline_p1_hand", "pipeline_p1_compiled", "ppo_ours", "ppo_hand"} <= names
    ppo = {r["name"]: r for r in rep["rows"]}
    assert ppo["ppo_ours"]["work"] == ppo["ppo_hand"]["work"] == {"steps": 2, "versions": 2}
    ours = ppo["pipeline_p1_ours"]   # every round's time is kept, and the ratio comes with its interval
    assert len(ours["round_us"]) == 1 and ours["ratio_ci95"][0] <= ours["ratio_vs_baseline"] <= ours["ratio_ci95"][1]
    assert "dataflow_overhead: ratio" in res.stdout


# ---------------------------------------------------------------- test bed sizes (for bring-up at N > 2)
def test_testbed_sizes_render_one_slurmd_per_node(tmp_path):
    from hpc_verl.testbed.cluster import MAX_NODES, TestBed, TestBedError, node_names
    assert node_names(3) == ("node1", "node2", "node3")
    for bad in (0, MAX_NODES + 1, True, "2"):
        with pytest.raises(TestBedError, match=f"1..{MAX_NODES}"):
            node_names(bad)
    bed = TestBed(tmp_path / "bed", 3)
    (tmp_path / "bed" / "fakegpu").mkdir(parents=True)
    bed._write_configs(7001, 7002, [7101, 7102, 7103])
    conf = (tmp_path / "bed" / "slurm.conf").read_text()
    assert [ln.split()[0] for ln in conf.splitlines() if ln.startswith("NodeName=")] == \
        ["NodeName=node1", "NodeName=node2", "NodeName=node3"]
    assert "PartitionName=debug Nodes=node1,node2,node3 " in conf and "Port=7103" in conf
    assert "\nFirstJobId=601001\n" in conf  # job ids of its own (from its slurmctld port): no shared container names
    assert (tmp_path / "bed" / "gres.conf").read_text().count("Name=gpu") == 3
    # a bed recorded with another size is not "up" for this size (up() would restart it)
    (tmp_path / "bed" / "testbed.json").write_text(json.dumps({"nodes": ["node1", "node2"]}))
    assert TestBed(tmp_path / "bed").nodes == ("node1", "node2")
    assert TestBed(tmp_path / "bed", 3).is_up() is False
