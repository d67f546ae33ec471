"""The offline model check and the driver's tokenizer. ``check_model`` is the full offline
check (``hpc-verl check-model``): config and tokenizer must load, weights must be
present; the trainer's driver makes the light one (``check_model_files``) and
leaves loading the model to its ranks.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hpc_verl.errors import HpcVerlError
from hpc_verl.data.prompt_tokenizer import load_prompt_tokenizer


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
