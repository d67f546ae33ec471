"""Tiny local models for tests and the demo: ``make_tiny_model`` writes a randomly initialised
Llama-architecture causal LM and a character-level tokenizer built with the ``tokenizers``
library (with a chat template), all made locally: no hub access. torch and transformers are
imported in the functions.
"""
from __future__ import annotations

import os
import shutil
import string
import tempfile
from pathlib import Path
from typing import Any

from hpc_verl.trainer.models.check import ModelError


SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# Characters of the tokenizer: printable ASCII without the form feeds.
CHARS = [c for c in string.printable if c not in "\x0b\x0c\r"]


def build_char_tokenizer() -> Any:
    """A character-level fast tokenizer (BPE without merges), with a chat template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", pad_token="<pad>")
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "left"
    return tok


def make_tiny_model(out_dir: str | os.PathLike[str], hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 2, intermediate_size: int | None = None, seed: int = 0,
                    max_positions: int = 1024, overwrite: bool = False) -> Path:
    """Write a random tiny Llama causal LM and its tokenizer to ``out_dir`` (atomically)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ModelError(f"{out} exists and is not empty; choose a new directory or pass --overwrite")
    tok = build_char_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=max_positions, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
