"""Tiny local models for tests and the demo, and the offline model check.

``make_tiny_model`` writes a randomly initialised Llama-architecture causal LM and
a character-level tokenizer built with the ``tokenizers`` library (with a chat
template), all made locally: no hub access. ``check_model`` is the full offline
check (``hpc-verl check-model``): config and tokenizer must load, weights must be
present; the trainer's driver makes the light one (``check_model_files``) and
leaves loading the model to its ranks.
"""
from __future__ import annotations

import json
import os
import shutil
import string
import tempfile
from pathlib import Path
from typing import Any

from hpc_verl.errors import HpcVerlError


class ModelError(HpcVerlError):
    """A model directory is missing, incomplete or unreadable."""


def quiet_transformers(import_now: bool = True) -> None:
    """Offline, quiet transformers in this process (no hub, no progress bars, no fork warnings);
    ``import_now=False`` sets only the environment (transformers reads it when imported)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if not import_now:
        return
    try:
        import transformers
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:  # pragma: no cover
        pass


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


WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                "pytorch_model.bin.index.json")


def check_model_dir(path: str | os.PathLike[str]) -> Path:
    """The checks that need no transformers (a directory with a readable config.json): a wrong
    path fails at once, before anything slow starts."""
    p = Path(os.path.expanduser(str(path)))
    if not p.is_dir():
        raise ModelError(f"model path {p} is not a directory; set actor_rollout_ref.model.path to a local "
                         "Hugging Face model directory (or make one: hpc-verl make-tiny-model DIR)")
    if not (p / "config.json").is_file():
        raise ModelError(f"model {p}: config.json is missing; is this a Hugging Face model directory?")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"model {p}: config.json is not valid JSON ({exc})") from None
    return p


def check_model_files(path: str | os.PathLike[str]) -> Path:
    """The driver's check, without transformers: config.json names a model type and weights are
    there (the ranks load the model itself, and say so in one line when it does not load)."""
    p = check_model_dir(path)
    if not json.loads((p / "config.json").read_text()).get("model_type"):
        raise ModelError(f"model {p}: config.json has no model_type; is this a Hugging Face model directory?")
    if not any((p / f).is_file() for f in WEIGHT_FILES):
        raise ModelError(f"model {p}: no weights ({' or '.join(WEIGHT_FILES[:2])}) found")
    return p


def load_driver_tokenizer(path: str | os.PathLike[str], chat_template: str | None = None, fast: bool = True,
                          trust_remote_code: bool = False) -> Any:
    """The tokenizer the driver encodes prompts with (``hpc_verl.data.prompt_tokenizer``; with
    ``fast=False`` transformers' AutoTokenizer); one ModelError line when it does not load."""
    from hpc_verl.data.prompt_tokenizer import load_prompt_tokenizer

    quiet_transformers(import_now=False)
    try:
        if fast:
            return load_prompt_tokenizer(path, chat_template, trust_remote_code)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers and tokenizers raise many types here
        raise ModelError(f"model {path}: tokenizer does not load ({_first_line(exc)}); "
                         "add tokenizer.json / tokenizer_config.json to the directory") from None
    if chat_template:
        tok.chat_template = chat_template
    return tok


def check_model(path: str | os.PathLike[str], need_weights: bool = True) -> dict:
    """Load config + tokenizer offline; one-line ModelError on any problem. Returns a summary."""
    p = check_model_dir(path)
    from transformers import AutoConfig, AutoTokenizer
    try:
        cfg = AutoConfig.from_pretrained(str(p), local_files_only=True)
    except Exception as exc:  # transformers raises many types here
        raise ModelError(f"model {p}: config does not load ({_first_line(exc)})") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as exc:
        raise ModelError(f"model {p}: tokenizer does not load ({_first_line(exc)}); "
                         "add tokenizer.json / tokenizer_config.json to the directory") from None
    if need_weights and not any((p / f).is_file() for f in WEIGHT_FILES):
        raise ModelError(f"model {p}: no weights ({' or '.join(WEIGHT_FILES[:2])}) found")
    return {"path": str(p), "model_type": getattr(cfg, "model_type", "?"),
            "vocab_size": getattr(cfg, "vocab_size", None), "tokenizer_vocab": len(tok),
            "chat_template": bool(getattr(tok, "chat_template", None))}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
