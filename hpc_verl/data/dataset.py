"""Reading verl-schema parquet for training: tokenised prompts and a resumable sampler.

Prompts are chat messages; when the tokenizer has a chat template it is applied
(with the generation prompt), otherwise the message contents are joined. Prompts
longer than ``data.max_prompt_length`` are dropped (``filter_overlong_prompts``),
truncated (``truncation=left|right``) or refused with one line (``error``). With a
rule-based reward every row needs ``reward_model.ground_truth``; rows without it are
refused up front, since they would train on reward 0 without a word.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from hpc_verl.errors import DataError

REQUIRED_COLUMNS = ("data_source",)


@dataclass
class PromptSample:
    index: int                 # row in the dataset (stable id for checkpoints and groups)
    prompt_ids: list[int]
    data_source: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)
    raw_prompt: Any = None


def prompt_text(tokenizer: Any, prompt: Any) -> str:
    """The prompt as the model sees it (chat template when the tokenizer has one)."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = list(prompt)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "\n".join(str(m.get("content", "")) for m in messages)


def tokenize_prompt(tokenizer: Any, prompt: Any) -> list[int]:
    return list(tokenizer(prompt_text(tokenizer, prompt), add_special_tokens=False)["input_ids"])


class RLDataset:
    """All rows of the given parquet files, tokenised once at start-up."""

    def __init__(self, files: str | Sequence[str], tokenizer: Any, max_prompt_length: int,
                 prompt_key: str = "prompt", filter_overlong_prompts: bool = False,
                 truncation: str = "error", max_samples: int = -1, require_ground_truth: bool = False) -> None:
        import pyarrow.parquet as pq

        paths = [files] if isinstance(files, str) else list(files)
        rows: list[dict] = []
        for f in paths:
            p = Path(os.path.expanduser(f))
            if not p.is_file():
                raise DataError(f"data file {p} not found; check data.train_files / data.val_files "
                                "(make one with: hpc-verl preprocess gsm8k --input FILE --output DIR)")
            try:
                table = pq.read_table(p)
            except Exception as exc:
                raise DataError(f"data file {p}: not a readable parquet file ({type(exc).__name__})") from None
            missing = [c for c in (*REQUIRED_COLUMNS, prompt_key) if c not in table.column_names]
            if missing:
                raise DataError(f"data file {p}: missing column(s) {', '.join(missing)}; expected verl's schema "
                                "(data_source, prompt, ability, reward_model, extra_info)")
            for r in table.to_pylist():
                r["_file"] = str(p)
                rows.append(r)
        if max_samples is not None and max_samples > 0:
            rows = rows[:max_samples]
        self.samples: list[PromptSample] = []
        self.n_filtered = 0
        for i, r in enumerate(rows):
            ids = tokenize_prompt(tokenizer, r[prompt_key])
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    self.n_filtered += 1
                    continue
                if truncation == "left":
                    ids = ids[-max_prompt_length:]
                elif truncation == "right":
                    ids = ids[:max_prompt_length]
                else:
                    raise DataError(
                        f"data file {r['_file']} row {i}: prompt is {len(ids)} tokens, over data.max_prompt_length="
                        f"{max_prompt_length}; raise it, set data.filter_overlong_prompts=true, or "
                        "data.truncation=left|right")
            rm = r.get("reward_model") or {}
            self.samples.append(PromptSample(
                index=len(self.samples), prompt_ids=ids, data_source=str(r["data_source"]),
                ground_truth=rm.get("ground_truth") if isinstance(rm, dict) else None,
                extra_info=r.get("extra_info") or {}, raw_prompt=r[prompt_key]))
        if require_ground_truth:
            self._check_ground_truth(rows)
        if not self.samples:
            raise DataError(f"data files {', '.join(paths)}: no usable prompts "
                            f"({self.n_filtered} over data.max_prompt_length={max_prompt_length})")

    def _check_ground_truth(self, rows: list[dict]) -> None:
        """The rule-based reward compares each response with its row's ground truth: none means 0."""
        missing = [r for r in rows if not isinstance(r.get("reward_model"), dict)
                   or r["reward_model"].get("ground_truth") in (None, "")]
        if not missing:
            return
        first = missing[0]
        what = "empty" if isinstance(first.get("reward_model"), dict) else "no reward_model column"
        raise DataError(f"data file {first['_file']}: {len(missing)} of {len(rows)} rows have no "
                        f"reward_model.ground_truth ({what}); the rule-based reward would score every "
                        "response of them 0. Preprocess the data to verl's schema (hpc-verl preprocess "
                        "gsm8k|digits ...) or use a reward model (reward_model.enable=true)")

    def __len__(self) -> int:
        return len(self.samples)


class ResumableSampler:
    """Epoch-seeded shuffled batches whose position is two integers (epoch, cursor).

    The same (seed, epoch, cursor) always yields the same next batch, so a resumed
    run continues with exactly the prompts it would have seen.
    """

    def __init__(self, n: int, batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = True) -> None:
        if batch_size > n:
            raise DataError(f"data.train_batch_size={batch_size} is larger than the {n} usable prompts; "
                            "lower it or add data")
        self.n, self.batch_size, self.seed, self.shuffle, self.drop_last = n, batch_size, seed, shuffle, drop_last
        self.epoch = 0
        self.cursor = 0

    @property
    def batches_per_epoch(self) -> int:
        return self.n // self.batch_size if self.drop_last else -(-self.n // self.batch_size)

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(self.seed * 1000003 + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[int]:
        if self.cursor >= self.batches_per_epoch:
            self.epoch += 1
            self.cursor = 0
        order = self._order(self.epoch)
        start = self.cursor * self.batch_size
        self.cursor += 1
        return order[start:start + self.batch_size]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "n": self.n,
                "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("n") != self.n or state.get("batch_size") != self.batch_size:
            raise DataError(f"checkpoint data position was saved for {state.get('n')} prompts in batches of "
                            f"{state.get('batch_size')}, but this run has {self.n} in batches of {self.batch_size}; "
                            "resume with the same data and data.train_batch_size, or trainer.resume_mode=disable")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
