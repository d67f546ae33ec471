"""Tiny model/tokenizer creation, the offline model check, rollout generation and weight sync."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from trainer_fixtures import digits_data, digit_overrides, tiny_model  # noqa: E402,F401


def test_make_tiny_model_and_check_model_cli(cli, tmp_path):
    out = tmp_path / "m"
    res = cli("make-tiny-model", str(out), "--hidden-size", "32", "--layers", "1", "--heads", "2")
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 32
    res = cli("check-model", str(out))
    assert res.returncode == 0 and "chat template: yes" in res.stdout, res.stderr
    from hpc_verl.trainer.models.check import ModelError
    from hpc_verl.trainer.models.tiny import make_tiny_model
    with pytest.raises(ModelError, match="--overwrite"):  # never over an existing model
        make_tiny_model(out)
    (out / "tokenizer.json").write_text("{broken")
    (out / "tokenizer_config.json").write_text("{broken")
    res = cli("check-model", str(out))
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "tokenizer does not load" in lines[0], res.stderr
    res = cli("check-model", str(tmp_path / "nothing"))
    assert res.returncode == 2 and "is not a directory" in res.stderr


def _cfg(tiny_model, digits_data, tmp_path, *extra):
    from hpc_verl.trainer.config.schema import load_config
    return load_config(None, digit_overrides(tiny_model, digits_data, tmp_path, 2, extra)).to_dict()


def test_job_model_check_stage_is_quick_and_still_refuses_broken_models(tiny_model, tmp_path):
    """The launcher's model-check stage loads config and fast tokenizer without importing
    transformers (seconds saved before Ray comes up), reports the same token count as
    transformers, and one line (exit 2) for a broken directory."""
    import shutil
    import subprocess
    import sys

    from transformers import AutoTokenizer

    probe = ("import sys; from hpc_verl.launch.checks import main; rc = main(['model', sys.argv[1]]); "
             "print('transformers imported' if 'transformers' in sys.modules else 'no transformers'); "
             "raise SystemExit(rc)")
    run = lambda d: subprocess.run([sys.executable, "-c", probe, str(d)], capture_output=True, text=True,  # noqa: E731
                                   timeout=120)
    res = run(tiny_model)
    assert res.returncode == 0, res.stderr
    assert f"({len(AutoTokenizer.from_pretrained(str(tiny_model)))} tokens)" in res.stdout
    assert "llama" in res.stdout and "no transformers" in res.stdout
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model, bad)
    (bad / "tokenizer.json").write_text("{broken")
    for broken, what in ((bad, "bad"), (tmp_path / "nothing", "config.json does not exist")):
        res = run(broken)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("model-check: cannot load"), res.stderr
        assert what in lines[0], lines
    (bad / "tokenizer.json").unlink()   # no fast tokenizer: transformers decides (and refuses the broken config)
    (bad / "tokenizer_config.json").write_text("{broken")
    res = run(bad)
    assert res.returncode == 2 and "model-check: cannot load" in res.stderr


def test_rollout_generates_masked_responses_and_syncs_versions(tiny_model, digits_data, tmp_path):
    from hpc_verl.trainer.rollout import hf as R
    from hpc_verl.trainer.roles import actor as W
    cfg = _cfg(tiny_model, digits_data, tmp_path, "data.max_response_length=6")
    roll = R.RolloutWorker(cfg)
    actor = W.ActorWorker(cfg)
    prompts = [[5, 9, 10, 7, 6], [5, 9, 10, 11, 12, 13, 7, 6]]
    out = roll.generate({"prompt_ids": prompts}, required_version=0)
    assert out["input_ids"].shape == (2, 8 + 6) and out["responses"].shape == (2, 6)
    # prompts are left-padded to end together, attention follows the padding
    assert out["attention_mask"][0, :3].tolist() == [0, 0, 0] and out["attention_mask"][1].sum() >= 8
    eos = roll.tokenizer.eos_token_id
    for r, m in zip(out["responses"], out["response_mask"]):
        hit = (r == eos).nonzero()
        if len(hit):  # mask keeps tokens up to and including the first EOS
            assert m[: hit[0] + 1].all() and not m[hit[0] + 1:].any()
        else:
            assert m.all()
    # sampled tokens recomputed by the actor with the same weights: finite log-probs, greedy = argmax
    greedy = roll.generate({"prompt_ids": prompts}, greedy=True)
    lp = actor.compute_log_prob(greedy)[0]["old_log_prob"]
    assert torch.isfinite(lp).all()
    # rollout.ignore_eos: every response runs to max_response_length (the benchmarks' fixed work)
    forced = R.RolloutWorker(_cfg(tiny_model, digits_data, tmp_path, "data.max_response_length=6",
                                  "actor_rollout_ref.rollout.ignore_eos=true"))
    assert forced.generate({"prompt_ids": prompts})["response_mask"].sum().item() == 2 * 6
    # the sampler is seeded by (seed, step, first row): the same draw whatever replica layout
    a = roll.generate({"prompt_ids": prompts, "step": 3}, first_row=8)
    b = roll.generate({"prompt_ids": prompts, "step": 3}, first_row=8)
    assert torch.equal(a["responses"], b["responses"])
    # weight sync: versions move forward only; a stale rollout refuses to generate
    with pytest.raises(R.StalePolicyError):
        roll.generate({"prompt_ids": prompts}, required_version=1)
    with torch.no_grad():
        for p in actor.model.parameters():
            p.add_(0.5)
    actor.version = 1
    assert roll.load_tensors(actor.export_tensors(), 1) == 1   # streamed (name, tensor) pairs
    for name, t in actor.model.module.named_parameters():
        assert torch.equal(dict(roll.model.named_parameters())[name], t), name
    roll.generate({"prompt_ids": prompts}, required_version=1)
    with pytest.raises(R.StalePolicyError):
        roll.load_tensors(actor.export_tensors(), 0)


def test_actor_update_accumulates_micro_batches_like_one_batch(tiny_model, digits_data, tmp_path):
    """Grad accumulation over micro-batches gives the same update as the whole mini-batch at once."""
    from hpc_verl.trainer.rollout import hf as R
    from hpc_verl.trainer.roles import actor as W
    base = ("actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.rollout.n=2",
            "data.train_batch_size=16", "actor_rollout_ref.actor.grad_clip=1000",
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean")
    cfg_one = _cfg(tiny_model, digits_data, tmp_path, *base)
    cfg_micro = _cfg(tiny_model, digits_data, tmp_path, *base, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8")
    roll = R.RolloutWorker(cfg_one)
    batch = roll.generate({"prompt_ids": [[5, 9 + i % 10, 10, 7, 6] for i in range(32)]})
    a1, a2 = W.ActorWorker(cfg_one), W.ActorWorker(cfg_micro)
    batch.update(a1.compute_log_prob(batch)[0])
    batch["advantages"] = torch.randn(32, 1).expand(-1, batch["responses"].shape[1]) * batch["response_mask"]
    m1, m2 = a1.update_policy(dict(batch)), a2.update_policy(dict(batch))
    assert m1["actor/grad_norm"] == pytest.approx(m2["actor/grad_norm"], rel=1e-4)
    for (k, p1), p2 in zip(a1.model.module.named_parameters(), a2.model.parameters()):
        assert torch.allclose(p1, p2, atol=1e-6), k
    # and the update changed the policy
    a3 = W.ActorWorker(cfg_one)
    assert any(not torch.equal(p, q) for p, q in zip(a1.model.parameters(), a3.model.parameters()))
    # grad clipping bounds the step: with clip 1e-6 the weights barely move
    cfg_clip = _cfg(tiny_model, digits_data, tmp_path, *base[:-2], "actor_rollout_ref.actor.grad_clip=0.000001")
    a4 = W.ActorWorker(cfg_clip)
    before = [p.detach().clone() for p in a4.model.parameters()]
    a4.update_policy(dict(batch))
    lr = cfg_clip["actor_rollout_ref"]["actor"]["optim"]["lr"]
    assert max((p - b).abs().max().item() for p, b in zip(a4.model.parameters(), before)) <= lr * 1.01


def test_vllm_rollout_without_vllm_is_one_clear_error(tiny_model, digits_data, tmp_path):
    import importlib.util

    from hpc_verl.errors import HpcVerlError
    from hpc_verl.trainer.rollout import make_rollout_worker
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    cfg = _cfg(tiny_model, digits_data, tmp_path, "actor_rollout_ref.rollout.name=vllm")
    with pytest.raises(HpcVerlError, match="vLLM is not installed"):
        make_rollout_worker(cfg)
    assert cfg["hpc_verl"]["old_log_prob_from_rollout"] is False  # vLLM numerics differ: recompute


def test_the_driver_checks_the_model_files_and_train_check_loads_them(tiny_model, digits_data, tmp_path, cli):
    """The driver's light check (no transformers) refuses a config without model_type and a
    directory without weights in one line; ``train --check`` also loads config and tokenizer."""
    import shutil

    from hpc_verl.trainer.models.check import ModelError, check_model_files

    assert check_model_files(tiny_model) == tiny_model
    for name, damage, message in (
            ("notype", lambda d: (d / "config.json").write_text(json.dumps({"vocab_size": 9})), "no model_type"),
            ("noweights", lambda d: (d / "model.safetensors").unlink(), "no weights")):
        d = tmp_path / name
        shutil.copytree(tiny_model, d)
        damage(d)
        with pytest.raises(ModelError, match=message):
            check_model_files(d)
    odd = tmp_path / "odd"
    shutil.copytree(tiny_model, odd)
    cfg = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**cfg, "model_type": "no-such-architecture"}))
    check_model_files(odd)   # (the driver leaves loading it to the ranks)
    res = cli("train", "--check", *digit_overrides(odd, digits_data, tmp_path / "run", 1))
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "config does not load" in lines[0], res.stderr
    # without --check the ranks find it, and the one line still names the cause
    res = cli("train", "--no-progress", *digit_overrides(odd, digits_data, tmp_path / "run", 1), timeout=300)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip().startswith("hpc-verl")]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"model {odd}: the model does not load (ValueError: " in lines[0] and "no-such-architecture" in lines[0]
