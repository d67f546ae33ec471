"""Decoding with a group's prompt kept once (prompt_attention) is the same attention as decoding
with the prompt copied to every row (kvcache.expand_rows): same logits to float rounding (1e-5),
on left-padded prompts of different lengths, with grouped-query attention (fewer key/value
heads than query heads) and without, and the rollout samples the same tokens either way."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from trainer_fixtures import digits_data, digit_overrides, tiny_model  # noqa: E402,F401


def _model(kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def _decode(model, prompts, n, steps, shared):
    from hpc_verl.trainer.rollout import prompt_attention as P
    from hpc_verl.trainer.engine.kvcache import expand_rows, preallocated_cache

    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    owner = torch.arange(len(prompts)).repeat_interleave(n)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50, (len(prompts) * n, steps), generator=gen)
    if shared:
        P.enable(model)
        cache = P.shared_prompt_cache(model.config, steps, attn)
    else:
        cache = preallocated_cache(model.config, width + steps)
    outs = []
    with torch.inference_mode():
        outs.append(model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                          use_cache=True, logits_to_keep=1).logits[owner, -1])
        if not shared:
            expand_rows(cache, owner)
        full_attn, last = attn[owner], pos[owner, -1:]
        for t in range(steps):
            last = last + 1
            if shared:
                kw = {"attention_mask": None, "shared_prompt": cache}
            else:
                full_attn = torch.cat([full_attn, torch.ones_like(full_attn[:, :1])], dim=1)
                kw = {"attention_mask": full_attn}
            outs.append(model(input_ids=tokens[:, t:t + 1], position_ids=last, past_key_values=cache,
                              use_cache=True, **kw).logits[:, -1])
    return torch.stack(outs, dim=1)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_shared_prompt_decoding_matches_copied_prompts(kv_heads):
    from hpc_verl.trainer.rollout import prompt_attention as P

    model = _model(kv_heads)
    prompts = [[3, 4, 5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23]]   # left padding of 0, 5 and 3
    assert P.applies(model, [4, 4, 4])
    want = _decode(model, prompts, n=4, steps=6, shared=False)
    got = _decode(model, prompts, n=4, steps=6, shared=True)
    assert got.shape == want.shape == (12, 7, 50)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and the padding is really masked: unmasked pads give other logits
    bad = _decode(model, [[3, 4, 5, 6, 7, 8, 9], [0, 0, 0, 0, 0, 11, 12], [0, 0, 0, 20, 21, 22, 23]],
                  n=4, steps=6, shared=False)
    assert not torch.allclose(bad, want, atol=1e-3)


def test_it_applies_only_where_it_is_the_same_attention():
    from hpc_verl.trainer.rollout import prompt_attention as P

    model = _model(4)
    assert not P.applies(model, [4, 3])    # unequal groups
    assert not P.applies(model, [1, 1])    # nothing shared
    model.config._attn_implementation = "eager"
    assert not P.applies(model, [4, 4])    # not SDPA (its masks and kernels are what we match)
    windowed = _model(4)
    windowed.config.sliding_window = 8
    assert not P.applies(windowed, [4, 4])


def test_rollout_samples_the_same_tokens_with_either_cache(tiny_model, digits_data, tmp_path, monkeypatch):
    from hpc_verl.trainer.rollout import prompt_attention as P
    from hpc_verl.trainer.rollout import hf as R
    from hpc_verl.trainer.config.schema import load_config

    cfg = load_config(None, digit_overrides(tiny_model, digits_data, tmp_path, 1,
                                            ("data.max_response_length=8", "actor_rollout_ref.rollout.n=3")))
    roll = R.RolloutWorker(cfg)
    prompts = [[5, 9, 10, 7, 6]] * 3 + [[5, 9, 10, 11, 12, 13, 7, 6]] * 3
    caches = []
    real = P.shared_prompt_cache
    monkeypatch.setattr(P, "shared_prompt_cache", lambda *a: caches.append(real(*a)) or caches[-1])
    shared = roll.generate({"prompt_ids": prompts, "step": 2})
    assert len(caches) == 1 and caches[0].layers[0].prompt_k.shape[0] == 2   # two prompts held, not six rows
    assert caches[0].layers[0].keys.shape[:3] == (6, caches[0].layers[0].keys.shape[1], 7)  # 7 response steps
    monkeypatch.setattr(P, "applies", lambda *a: False)
    copied = roll.generate({"prompt_ids": prompts, "step": 2})
    assert torch.equal(shared["responses"], copied["responses"])
    torch.testing.assert_close(shared["rollout_log_prob"], copied["rollout_log_prob"], atol=1e-5, rtol=1e-5)
