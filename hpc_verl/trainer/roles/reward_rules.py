"""Rule-based reward functions, chosen per sample by its ``data_source``.

A reward function is ``compute_score(data_source, solution_str, ground_truth,
extra_info) -> float`` (verl's signature), so a user's custom function file drops in.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any, Callable

from hpc_verl.errors import ConfigError, DataError

ScoreFn = Callable[[str, str, Any, dict], float]

_LAST_NUMBER = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def gsm8k_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                format_score: float = 0.0, score: float = 1.0) -> float:
    """1 if the number after the response's last ``####`` equals the ground truth, else ``format_score``/0."""
    found = _LAST_NUMBER.findall(solution_str)
    if not found:
        return 0.0
    answer = found[-1].replace(",", "")
    try:
        ok = float(answer) == float(str(ground_truth).replace(",", ""))
    except ValueError:
        ok = answer == str(ground_truth)
    return score if ok else format_score


def digits_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """Fraction of the expected digits produced at the right position (leading spaces ignored)."""
    want = str(ground_truth)
    got = solution_str.lstrip()
    if not want:
        return 0.0
    return sum(1 for i, ch in enumerate(want) if i < len(got) and got[i] == ch) / len(want)


REGISTRY: dict[str, ScoreFn] = {
    "openai/gsm8k": gsm8k_score,
    "gsm8k": gsm8k_score,
    "hpc_verl/digits": digits_score,
}


def load_custom_reward(path: str, name: str) -> ScoreFn:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"custom_reward_function.path {p} not found")
    spec = importlib.util.spec_from_file_location(f"hpc_verl_custom_reward_{p.stem}", p)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ConfigError(f"custom_reward_function.path {p}: import failed ({type(exc).__name__}: {exc})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"custom_reward_function.path {p}: no function '{name}' (custom_reward_function.name)")
    return fn


class RuleReward:
    """Score decoded responses with the function registered for each sample's data_source."""

    def __init__(self, custom_path: str | None = None, custom_name: str = "compute_score") -> None:
        self.custom = load_custom_reward(custom_path, custom_name) if custom_path else None

    def score(self, data_source: str, solution: str, ground_truth: Any, extra_info: dict | None = None) -> float:
        fn = self.custom or REGISTRY.get(data_source)
        if fn is None:
            raise DataError(f"no reward function for data_source '{data_source}'; known: "
                            f"{', '.join(sorted(REGISTRY))} (or set custom_reward_function.path)")
        return float(fn(data_source, solution, ground_truth, extra_info or {}))
