"""The GPU check's model and figures: the Qwen2-0.5B-shaped model built locally (random weights,
the char tokenizer), parameters counted on the meta device, FLOPs per trained token, the H200 peak."""
from __future__ import annotations

from pathlib import Path
from typing import Any

H200_BF16_DENSE_FLOPS = 989e12     # NVIDIA's H200 SXM bf16 dense peak (tensor cores, no sparsity)

# Model shapes: "0.5b" is Qwen2-0.5B's (its 151936-token vocabulary kept, so the lm_head costs
# what it costs there; the char tokenizer uses the first ids only); "tiny" is for CPU tests.
SIZES: dict[str, dict[str, int]] = {
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2),
    "tiny": dict(vocab_size=0, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}
# Work per check: rows, prompt and response tokens (responses forced to full length).
WORK: dict[str, dict[str, int]] = {
    "0.5b": dict(rows=32, prompt=512, response=512, micro=8, gen_rows=64, gen_prompt=128, gen_response=256,
                 updates=3),
    "tiny": dict(rows=4, prompt=8, response=6, micro=2, gen_rows=4, gen_prompt=8, gen_response=6, updates=1),
}



def model_config(size: str, tokenizer: Any) -> Any:
    """A Qwen2Config of the given size, token ids from the char tokenizer."""
    from transformers import Qwen2Config

    shape = dict(SIZES[size])
    shape["vocab_size"] = shape["vocab_size"] or len(tokenizer)
    return Qwen2Config(**shape, max_position_embeddings=4096, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, use_sliding_window=False, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def count_params(config: Any) -> int:
    """Parameters of the causal LM for ``config``, counted on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def build_model(out_dir: Path, size: str, seed: int = 0) -> tuple[Path, int]:
    """Write the random model and the char tokenizer to ``out_dir/model``; returns (path, parameters)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_verl.trainer.models.tiny import build_char_tokenizer
    tok = build_char_tokenizer()
    config = model_config(size, tok)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    path = out_dir / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, sum(p.numel() for p in model.parameters())


def train_flops_per_token(n_params: int, config: Any, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6N for the matmuls with the weights, plus attention's
    12 * layers * hidden * seq (PaLM's estimate, no causal discount)."""
    return 6.0 * n_params + 12.0 * config.num_hidden_layers * config.hidden_size * seq_len
