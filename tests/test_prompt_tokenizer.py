"""The driver's torch-free prompt tokenizer gives transformers' token ids, falls back where it
cannot, and a disagreement is one clear line (hpc_verl.data.prompt_tokenizer)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from trainer_fixtures import digit_overrides, digits_data, tiny_model  # noqa: E402,F401

from hpc_verl.data.dataset import prompt_text, tokenize_prompt  # noqa: E402
from hpc_verl.data.prompt_tokenizer import (PromptTokenizer, check_prompt_ids, load_prompt_tokenizer,  # noqa: E402
                                            probe_samples)
from hpc_verl.errors import DataError  # noqa: E402

PROMPTS = [
    "What is 12 + 30?",
    [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April.\nHow many?"}],
    [{"role": "system", "content": "Think step by step."}, {"role": "user", "content": "  leading  spaces\tand tab"}],
    [{"role": "user", "content": "unicode: naïve café — 数学 🙂"}],
    [{"role": "user", "content": ""}],
]
TEMPLATE_WITH_BOS = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
                     "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer (GPT-2 style) with BOS/EOS used by its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    corpus = [p if isinstance(p, str) else " ".join(m["content"] for m in p) for p in PROMPTS] * 20
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.chat_template = TEMPLATE_WITH_BOS
    out = tmp_path_factory.mktemp("bpe")
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("which", ["tiny", "bpe"])
def test_same_text_and_ids_as_transformers(which, tiny_model, bpe_model):  # noqa: F811
    from transformers import AutoTokenizer

    path = tiny_model if which == "tiny" else bpe_model
    ours, theirs = load_prompt_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert isinstance(ours, PromptTokenizer)
    for prompt in PROMPTS:
        assert prompt_text(ours, prompt) == prompt_text(theirs, prompt)
        assert tokenize_prompt(ours, prompt) == tokenize_prompt(theirs, prompt)
    if which == "bpe":   # the template's {{ bos_token }} came from tokenizer_config.json
        assert prompt_text(ours, PROMPTS[0]).startswith("<s>[user] What")
    custom = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    ours, theirs.chat_template = load_prompt_tokenizer(path, chat_template=custom), custom
    assert [tokenize_prompt(ours, p) for p in PROMPTS] == [tokenize_prompt(theirs, p) for p in PROMPTS]
    assert check_prompt_ids(theirs, probe_samples(ours, PROMPTS), None, "here") == len(PROMPTS)


def test_loading_it_imports_no_torch(tiny_model):  # noqa: F811
    code = ("import sys; from hpc_verl.data.prompt_tokenizer import load_prompt_tokenizer; "
            "from hpc_verl.data.dataset import tokenize_prompt; t = load_prompt_tokenizer(sys.argv[1]); "
            "print(type(t).__name__, len(tokenize_prompt(t, 'hello')), 'torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code, str(tiny_model)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    from transformers import AutoTokenizer

    expected = len(tokenize_prompt(AutoTokenizer.from_pretrained(str(tiny_model)), "hello"))
    assert res.stdout.split() == ["PromptTokenizer", str(expected), "False"]


def test_falls_back_to_transformers_where_it_cannot_read_the_tokenizer(tiny_model, tmp_path):  # noqa: F811
    no_json = tmp_path / "nojson"
    shutil.copytree(tiny_model, no_json)
    (no_json / "tokenizer.json").unlink()
    (no_json / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(Exception):   # transformers' own error: the driver's loader turns it into one line
        load_prompt_tokenizer(no_json)
    named = tmp_path / "named"
    shutil.copytree(tiny_model, named)
    (named / "chat_template.jinja").unlink()
    cfg = json.loads((named / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": "{{ messages[0]['content'] }}"}]
    (named / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_prompt_tokenizer(named)
    assert not isinstance(tok, PromptTokenizer)   # several named templates: transformers chooses
    assert prompt_text(tok, "plain") == "plain"


def test_a_disagreement_is_one_line(tiny_model):  # noqa: F811
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(tiny_model))
    samples = probe_samples(load_prompt_tokenizer(tiny_model), PROMPTS)
    prompt, text, ids = samples[1]
    with pytest.raises(DataError, match="encodes .* transformers as .*fast_prompt_tokenizer=false") as e:
        check_prompt_ids(theirs, [samples[0], (prompt, text, ids[:-1])], None, "actor_rollout")
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="renders .* transformers as"):
        check_prompt_ids(theirs, [(prompt, text + " ", ids)], None, "actor_rollout")
    assert theirs.chat_template == AutoTokenizer.from_pretrained(str(tiny_model)).chat_template  # left as it was


def test_the_driver_imports_no_torch_and_the_key_turns_it_off(tiny_model, digits_data, tmp_path):  # noqa: F811
    code = ("import sys\n"
            "from hpc_verl.trainer.config.schema import load_config\n"
            "from hpc_verl.trainer.driver.ppo_trainer import PPOTrainer\n"
            "t = PPOTrainer(load_config(None, sys.argv[1:]), progress=False)\n"
            "print(type(t.tokenizer).__name__, len(t.dataset), 'torch' in sys.modules)\n")
    for value, expect in (("true", ["PromptTokenizer", "256", "False"]), ("false", None)):
        args = digit_overrides(tiny_model, digits_data, tmp_path / value, 1, (f"hpc_verl.fast_prompt_tokenizer={value}",))
        res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        out = res.stdout.split()
        if expect:
            assert out == expect
        else:
            assert out[0] != "PromptTokenizer" and out[1:] == ["256", "True"]
