"""The driver's prompt tokenizer, without torch.

The trainer's driver tokenises the data set and nothing else, but transformers'
``AutoTokenizer`` imports torch and ``torch._dynamo`` on the way (about 4 s of CPU
on the 2-core development VM). At start-up those seconds compete with Ray's
daemons and with the worker processes, which need torch for real.

A model directory with a ``tokenizer.json`` is therefore read here:
- the text is encoded by the ``tokenizers`` library, which backs every
  transformers fast tokenizer;
- the chat template is rendered by transformers' own renderer
  (``transformers.utils.chat_template_utils``, which needs no torch), with the
  special-token variables ``apply_chat_template`` passes.

Anything else goes to ``AutoTokenizer`` as before: no ``tokenizer.json``, several
named templates, or remote code. The rollout checks the first prompts against
transformers' own tokenizer (``check_prompt_ids``), so a tokenizer this reads
differently is one clear error, never silent.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from hpc_verl.errors import DataError

#: the named special tokens apply_chat_template passes to a template (transformers' SPECIAL_TOKENS_ATTRIBUTES)
NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: how many of the first prompts the rollout re-tokenises with transformers' tokenizer
CHECK_PROMPTS = 8


class PromptTokenizer:
    """Encodes prompt text as the model directory's fast tokenizer does (no special tokens added)."""

    def __init__(self, path: Path, core: Any, chat_template: str | None, special: dict[str, str]) -> None:
        self.path = path
        self._core = core
        self.chat_template = chat_template
        self.special_tokens_map = special

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = False) -> str:
        if tokenize:
            raise TypeError("PromptTokenizer.apply_chat_template renders text only (tokenize=False)")
        if not self.chat_template:
            raise ValueError(f"{self.path}: the tokenizer has no chat template")
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(conversations=[messages], chat_template=self.chat_template,
                                            add_generation_prompt=add_generation_prompt,
                                            **self.special_tokens_map)
        return rendered[0]

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self._core.encode(text, add_special_tokens=add_special_tokens).ids}


def load_prompt_tokenizer(path: str | Path, chat_template: str | None = None, trust_remote_code: bool = False) -> Any:
    """The tokenizer the driver encodes prompts with: ``PromptTokenizer`` where the directory
    allows it, else transformers' ``AutoTokenizer`` (``chat_template`` replaces the model's)."""
    p = Path(path)
    fast = _fast(p, trust_remote_code)
    if fast is None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True, trust_remote_code=trust_remote_code)
    else:
        tok = fast
    if chat_template:
        tok.chat_template = chat_template
    return tok


def _fast(p: Path, trust_remote_code: bool) -> PromptTokenizer | None:
    if not (p / "tokenizer.json").is_file():
        return None
    try:
        config = json.loads((p / "tokenizer_config.json").read_text()) if (p / "tokenizer_config.json").is_file() \
            else {}
    except (OSError, ValueError):
        return None   # AutoTokenizer says what is wrong with it
    if trust_remote_code and config.get("auto_map"):
        return None   # the model's own tokenizer class may do anything
    template: Any = config.get("chat_template")
    if (p / "chat_template.jinja").is_file():
        template = (p / "chat_template.jinja").read_text()
    if template is not None and not isinstance(template, str):
        return None   # several named templates: AutoTokenizer picks among them
    from tokenizers import Tokenizer

    try:
        core = Tokenizer.from_file(str(p / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - AutoTokenizer reports it in its own words
        return None
    special = {name: _content(config[name]) for name in NAMED_SPECIAL if config.get(name) is not None}
    return PromptTokenizer(p, core, template, special)


def _content(token: Any) -> str:
    """A special token as tokenizer_config.json holds it: a string, or an AddedToken's dict."""
    return str(token["content"]) if isinstance(token, dict) else str(token)


def probe_samples(tokenizer: Any, prompts: Sequence[Any]) -> list[tuple[Any, str, list[int]]]:
    """(prompt, text, ids) of the first ``CHECK_PROMPTS`` prompts as ``tokenizer`` renders and
    encodes them: what ``check_prompt_ids`` compares with transformers' tokenizer."""
    from hpc_verl.data.dataset import prompt_text

    out = []
    for prompt in list(prompts)[:CHECK_PROMPTS]:
        text = prompt_text(tokenizer, prompt)
        out.append((prompt, text, list(tokenizer(text, add_special_tokens=False)["input_ids"])))
    return out


def check_prompt_ids(tokenizer: Any, samples: Sequence[tuple[Any, str, list[int]]], chat_template: str | None,
                     where: str) -> int:
    """Render and encode ``samples`` with transformers' ``tokenizer`` (its chat template replaced by
    ``chat_template`` where given); one DataError line at the first that differs from the
    driver's. Returns how many were checked."""
    from hpc_verl.data.dataset import prompt_text

    own = tokenizer.chat_template
    if chat_template:
        tokenizer.chat_template = chat_template
    try:
        for prompt, text, ids in samples:
            got_text = prompt_text(tokenizer, prompt)
            got = list(tokenizer(got_text, add_special_tokens=False)["input_ids"])
            if got_text != text or got != list(ids):
                what = (f"renders {str(prompt)[:60]!r} as {text[:60]!r}, transformers as {got_text[:60]!r}"
                        if got_text != text else f"encodes {text[:60]!r} as {list(ids)[:12]}, transformers as "
                                                 f"{got[:12]}")
                raise DataError(f"{where}: the driver's prompt tokenizer {what}; set "
                                f"hpc_verl.fast_prompt_tokenizer=false (and please report the model's tokenizer)")
    finally:
        tokenizer.chat_template = own
    return len(samples)
