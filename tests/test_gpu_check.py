"""The GPU check script's CPU side: arguments, the JSON, the model it builds, and the whole
suite run for real on this CPU at a tiny size (gloo instead of NCCL, float32 instead of bf16).
No GPU here: on one, the same code runs with --device cuda --size 0.5b (not run on a GPU yet)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_script_is_clean_bash() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    subprocess.run(["shellcheck", str(SCRIPT)], check=True)


def test_usage_and_bad_arguments_are_one_line(tmp_path: Path) -> None:
    res = _run()
    assert res.returncode == 2 and res.stderr.startswith("usage: bash scripts/gpu_check.sh OUT_DIR")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    res = _run(str(a_file), "--device", "cpu")
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"gpu_check: {a_file} exists and is not a directory; name a directory for the results"]
    res = _run(str(tmp_path / "o"), "--device", "cpu", "--only", "nope")
    assert res.returncode == 2 and "unknown check 'nope'; choose from model, actor_update_fsdp2" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert not (tmp_path / "o").exists()


def test_no_cuda_here_is_one_line(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    res = _run(str(tmp_path / "o"))
    assert res.returncode == 2 and "no CUDA device visible" in res.stderr and "--device cpu --size tiny" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_the_model_is_qwen2_0_5b_shaped() -> None:
    pytest.importorskip("transformers")
    from hpc_verl.ops import gpu_check as G
    from hpc_verl.trainer.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = G.model_config("0.5b", tok)
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size) == ("qwen2", 896, 24, 14, 2, 4864, 151936)
    assert cfg.eos_token_id == tok.eos_token_id and cfg.tie_word_embeddings
    n = G.count_params(cfg)                       # on the meta device: no memory
    assert 480e6 < n < 510e6, n                   # Qwen2-0.5B has 494M
    tiny = G.model_config("tiny", tok)
    assert tiny.vocab_size == len(tok)
    # 6N per token for the weights' matmuls, plus attention's 12 * layers * hidden * sequence
    assert G.train_flops_per_token(n, cfg, 1024) == 6 * n + 12 * 24 * 896 * 1024


def test_a_failing_check_is_recorded_and_the_next_runs(tmp_path: Path) -> None:
    from hpc_verl.ops import gpu_check as G

    report = G.Report(tmp_path, {"size": "tiny"})
    seen: list[dict] = []

    def peek() -> dict:             # the JSON on disk already holds the checks before this one
        seen.append(json.loads((tmp_path / G.JSON_NAME).read_text()))
        return {"value": 1}

    def boom() -> dict:
        raise RuntimeError("out of memory\nsecond line")

    lines: list[str] = []
    failed = G.run_checks([("first", boom), ("second", peek)], report, budget_s=100, say=lines.append)
    assert failed == 1
    assert seen[0]["checks"]["first"]["status"] == "failed"
    data = json.loads((tmp_path / G.JSON_NAME).read_text())
    assert data["checks"]["first"]["error"] == "RuntimeError: out of memory"
    assert data["checks"]["second"] == {"status": "passed", "value": 1, "seconds": data["checks"]["second"]["seconds"]}
    assert (data["passed"], data["failed"], data["meta"]) == (1, 1, {"size": "tiny"})
    assert lines[0].startswith("FAIL first: error=RuntimeError: out of memory") and lines[1].startswith("PASS second")
    assert not [p for p in tmp_path.iterdir() if p.name != G.JSON_NAME]      # no temp files left


def test_checks_past_the_budget_are_skipped(tmp_path: Path) -> None:
    import time

    from hpc_verl.ops import gpu_check as G
    report = G.Report(tmp_path, {})
    G.run_checks([("slow", lambda: time.sleep(0.05) or {}), ("late", lambda: {})], report, budget_s=0.01,
                 say=lambda s: None)
    assert report.data["checks"]["late"]["status"] == "skipped" and report.data["skipped"] == 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_whole_suite_runs_on_cpu_at_tiny_size(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    res = _run(str(tmp_path / "out"), "--device", "cpu", "--size", "tiny", timeout=550)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    from hpc_verl.ops.gpu_roles import CHECKS
    assert data["order"] == list(CHECKS) and data["passed"] == len(CHECKS)
    c = data["checks"]
    # one CPU rank trains the plain module (parallel.shards: FSDP2 at world size 1 on CPU computes the
    # same plus an unshard/reshard per layer); FSDP2 itself is covered at W=2 by test_dp_equivalence
    assert c["actor_update_fsdp2"]["sharded"] is False and c["actor_update_ddp"]["sharded"] is False
    assert c["actor_update_fsdp2"]["optim_steps_per_update"] == 1 and c["actor_update_fsdp2"]["tokens_per_s"] > 0
    assert c["weight_handover"]["bytes"] > 0 and c["rollout_hf"]["tokens_per_s"] > 0
    assert c["ulysses_sp2"]["backend"] == "gloo" and c["ulysses_sp2"]["rank1_grads"] < 1e-4
    assert "mfu" not in c["actor_update_fsdp2"]            # no MFU against a GPU peak on a CPU
    assert [ln.split(":")[0] for ln in res.stdout.splitlines()[:len(CHECKS)]] == [f"PASS {n}" for n in CHECKS]
