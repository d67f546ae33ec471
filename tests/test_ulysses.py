"""Ulysses sequence parallelism equals the unsplit model.

Two real processes (torch.multiprocessing spawn) form a gloo group. Each builds the same tiny
model from a config (no hub) twice: the reference, unchanged (transformers' sdpa attention and
its own masks), and a copy switched to ``hpc_verl.trainer.engine.ulysses`` over the group of 2. The
batch has left padding, three different lengths and an odd length (so the split pads it). The
SP copy's gathered logits must equal the reference's at every real token, and after the same
loss (log-probs and entropy of the response tokens, gathered) the SP ranks' summed parameter
gradients must equal the reference's, to 1e-5, for a Llama (GQA, KV heads split: 4 q / 2 kv)
and a Qwen2 (attention biases; 1 KV head, replicated to both ranks). Then ``set_group(model,
None)`` turns the SP copy back to unsplit and it still equals the reference.
"""
from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hpc_verl.trainer.engine import ulysses  # noqa: E402

TOL = 1e-5
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _model(kind: str, heads: int = 4, kv: int = 2) -> object:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=41, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64,
                  pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(11)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, rms_norm_eps=1e-5)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False)).eval()


def _batch(seq: int = 11, rlen: int = 4) -> dict:
    g = torch.Generator().manual_seed(3)
    lengths = [seq, 7, 5]                   # left padded to seq
    ids = torch.zeros(len(lengths), seq, dtype=torch.long)
    attn = torch.zeros(len(lengths), seq, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, seq - n:] = torch.randint(1, 41, (n,), generator=g)
        attn[i, seq - n:] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    weights = torch.randn(len(lengths), rlen, generator=g)
    return {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "responses": ids[:, -rlen:],
            "weights": weights}


def _compare(kind: str, kv: int, group) -> dict:
    return ulysses.compare_with_unsplit(_model(kind, 4, kv), _batch(), group, temperature=0.7)


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        results = {kind: _compare(kind, kv, group) for kind, kv in (("llama", 2), ("qwen2", 1))}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sp2(tmp_path_factory) -> dict:
    import torch.multiprocessing as mp

    d = tmp_path_factory.mktemp("ulysses")
    mp.spawn(_worker, args=(str(d / "init"), str(d)), nprocs=2, join=True)
    return {r: json.loads((d / f"rank{r}.json").read_text()) for r in (0, 1)}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_sp2_equals_unsplit_model(sp2: dict, kind: str) -> None:
    for rank in (0, 1):
        r = sp2[rank][kind]
        assert r["local_cols"] == 6, "11 columns padded to 12, 6 per rank"
        assert r["finite"]
        assert r["logits"] < TOL, r
        assert r["logp"] < TOL, r
        assert r["grad_scale"] > 1e-3, "the loss must reach the parameters"
        assert r["grads"] < TOL, r
        assert r["unsplit"] < TOL, r


def test_sp1_is_plain_attention() -> None:
    """No group: the same attention function is sdpa over the whole sequence (the SP=1 path)."""
    import copy

    from hpc_verl.trainer.engine.logprobs import response_log_probs

    ref = _model("llama")
    sp = ulysses.enable(copy.deepcopy(ref), None)
    assert sp.config._attn_implementation == ulysses.ATTN_IMPLEMENTATION
    b = _batch()
    with torch.no_grad():
        want = response_log_probs(ref, b)
        via_shard = ulysses.response_log_probs(sp, b)
        via_hf_mask = response_log_probs(sp, b)   # transformers' own 2D-mask path (how the rollout calls it)
    assert float((via_shard - want).abs().max()) < TOL
    assert float((via_hf_mask - want).abs().max()) < TOL


@pytest.mark.parametrize("heads,kv,sp,fragment", [
    (4, 4, 3, "does not divide the model's num_attention_heads=4"),
    (6, 3, 2, "num_key_value_heads=3 must be divisible by it or divide it"),
])
def test_divisibility_is_one_line(heads: int, kv: int, sp: int, fragment: str) -> None:
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=48, num_attention_heads=heads, num_key_value_heads=kv)
    with pytest.raises(ulysses.UlyssesError) as e:
        ulysses.check_sp(cfg, sp, where="actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size")
    msg = str(e.value)
    assert fragment in msg and "\n" not in msg
    assert msg.startswith("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=")


def test_kv_replication_and_split_are_accepted() -> None:
    from transformers import LlamaConfig

    ulysses.check_sp(LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2), 4)  # replicated
    ulysses.check_sp(LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=4), 2)  # split


def test_full_mask_padding_and_causality() -> None:
    attn = torch.tensor([[0, 1, 1]])
    m = ulysses.full_mask(attn, 4)[0, 0]
    # query 2 sees keys 1..2; the left-padded query 0 only itself (no empty row); the appended
    # column 3 the real keys before it and itself, and no real query sees it
    assert m[2].tolist() == [False, True, True, False]
    assert m[0].tolist() == [True, False, False, False]
    assert m[3].tolist() == [False, True, True, True]
    assert not m[:3, 3].any()
    assert not m[1, 2]
