"""Did-you-mean suggestions for unknown keys, verbs and names."""
from __future__ import annotations

import difflib
from typing import Iterable


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` or ``""`` for appending to a message."""
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{matches[0]}'?)" if matches else ""


def unknown_key_message(key: str, where: str, valid: Iterable[str]) -> str:
    """One line: the unknown key, where it was found, a suggestion and the valid keys."""
    valid = sorted(valid)
    return f"{where}: unknown key '{key}'{did_you_mean(key, valid)}; valid keys: {', '.join(valid)}"
