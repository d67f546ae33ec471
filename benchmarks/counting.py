"""Counting the work of one RL round, so a throughput ratio is only printed at equal work.

The quantities, per round (one generation batch and its optimizer steps):

- ``fwd_rows``: sequences through a full-sequence forward of a model (old
  log-prob, reference, value and training forwards, summed over micro-batches;
  the token-by-token forwards of generation are not counted here),
- ``bwd_rows``: sequences through a backward,
- ``optim_steps``: optimizer steps,
- ``gen_tokens``: generated tokens (up to and including the first EOS).

``PassCounter`` measures them with hooks inside a process that holds the model
(TRL's trainer; the tests). Our trainer runs its models in Ray actors, so for
our side ``ours_round_counts`` reads per-step counters from ``metrics.jsonl``
(``perf/fwd_rows``, ...) when the trainer writes them and otherwise falls back
to ``ours_counts_from_config`` - an analytic count, labelled as such in every
report. ``gen_tokens`` of ours is always measured (``n_response_tokens``).
"""
from __future__ import annotations

from typing import Any, Mapping

COUNT_KEYS = ("fwd_rows", "bwd_rows", "optim_steps", "gen_tokens")
METRIC_KEYS = {k: f"perf/{k}" for k in COUNT_KEYS}  # what our trainer writes per step, when it does


class PassCounter:
    """Counts ``COUNT_KEYS`` in this process with forward, tensor and optimizer hooks.

    ``attach(model)`` hooks a Hugging Face causal LM: its forward (rows of
    ``input_ids`` outside ``generate``), a gradient hook on the first decoder
    layer's output (rows that really went through a backward) and its
    ``generate`` (tokens produced). ``attach_optimizers()`` counts every
    optimizer step in the process. ``snapshot()`` returns the totals so far;
    ``layer_rows`` (rows through the first block of the first decoder layer,
    its attention, outside generation) is also kept: above ``fwd_rows`` it shows
    recomputation in backward (gradient checkpointing re-runs the blocks, not
    the whole model's forward).
    """

    def __init__(self) -> None:
        self.totals = {k: 0 for k in COUNT_KEYS}
        self.layer_rows = 0
        self._in_generate = 0
        self._handles: list[Any] = []

    # ---- hooks ------------------------------------------------------------
    def attach(self, model: Any) -> "PassCounter":
        self._handles.append(model.register_forward_hook(self._on_forward, with_kwargs=True))
        layer = first_decoder_layer(model)
        self._handles.append(layer.register_forward_hook(self._on_layer))
        block = next(iter(layer.children()), None)
        if block is not None:
            self._handles.append(block.register_forward_hook(self._on_block))
        original = model.generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            ids = kwargs.get("input_ids", args[0] if args else None)
            self._in_generate += 1
            try:
                out = original(*args, **kwargs)
            finally:
                self._in_generate -= 1
            seqs = out if hasattr(out, "shape") else out.sequences
            self.totals["gen_tokens"] += generated_tokens(seqs, ids.shape[1], eos_ids(model))
            return out

        model.generate = generate
        return self

    def attach_optimizers(self) -> "PassCounter":
        from torch.optim.optimizer import register_optimizer_step_post_hook
        self._handles.append(register_optimizer_step_post_hook(self._on_step))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _on_forward(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if self._in_generate:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.totals["fwd_rows"] += int(ids.shape[0])

    def _on_block(self, module: Any, args: tuple, output: Any) -> None:
        if not self._in_generate:
            hidden = output[0] if isinstance(output, tuple) else output
            self.layer_rows += int(hidden.shape[0])

    def _on_layer(self, module: Any, args: tuple, output: Any) -> None:
        if self._in_generate:
            return
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:
            rows = int(hidden.shape[0])

            def on_grad(grad: Any) -> None:
                self.totals["bwd_rows"] += rows
            hidden.register_hook(on_grad)

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.totals["optim_steps"] += 1

    def snapshot(self) -> dict[str, int]:
        return dict(self.totals)


def delta(after: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    return {k: int(after[k]) - int(before.get(k, 0)) for k in COUNT_KEYS}


def first_decoder_layer(model: Any) -> Any:
    """The first transformer block of a causal LM (``model.model.layers[0]`` for Llama-like ones)."""
    base = getattr(model, "model", None) or getattr(model, "transformer", None)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    if layers is None or len(layers) == 0:
        raise TypeError(f"{type(model).__name__}: no decoder layers found to count backward passes on")
    return layers[0]


def eos_ids(model: Any) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def generated_tokens(sequences: Any, prompt_len: int, eos: list[int]) -> int:
    """Generated tokens per row up to and including the first EOS, summed (what both sides train on)."""
    import torch
    gen = sequences[:, prompt_len:]
    if gen.numel() == 0:
        return 0
    if not eos:
        return int(gen.numel())
    is_eos = torch.isin(gen, torch.tensor(eos, device=gen.device)).long()
    after_eos = torch.cumsum(is_eos, dim=1) - is_eos
    return int((after_eos == 0).sum())


def ours_counts_from_config(s: Mapping[str, Any]) -> dict[str, int]:
    """ANALYTIC (not measured): what our trainer does per round, from its settings.

    Until the trainer writes ``perf/*`` counters this stands in for them. Per step:
    one rollout of ``prompts x group`` sequences; then, unless PPO's old log-probs
    come from the sampler (``old_log_prob_from_rollout``), one no-grad forward of
    every sequence; ``ppo_epochs`` passes of training forward+backward over
    mini-batches of ``prompts // updates_per_round`` prompts, one optimizer step
    each. No reference model and no critic (GRPO without a KL term).
    """
    rows = int(s["prompts"]) * int(s["group"])
    epochs = int(s.get("ppo_epochs", 1))
    fwd = rows * epochs + (0 if s["old_log_prob_from_rollout"] else rows)
    return {"fwd_rows": fwd, "bwd_rows": rows * epochs,
            "optim_steps": epochs * int(s["updates_per_round"]),
            "gen_tokens": rows * int(s["response_length"])}


def ours_round_counts(metrics: Mapping[str, Any], s: Mapping[str, Any]) -> tuple[dict[str, int], dict[str, str]]:
    """Counts of one of our steps: measured keys from metrics.jsonl where present, else the analytic ones.

    Returns (counts, source per key: "measured" or "analytic").
    """
    analytic = ours_counts_from_config(s)
    counts: dict[str, int] = {}
    source: dict[str, str] = {}
    for key in COUNT_KEYS:
        metric = METRIC_KEYS[key]
        if metric in metrics and metrics[metric] is not None:
            counts[key], source[key] = int(metrics[metric]), "measured"
        elif key == "gen_tokens" and "n_response_tokens" in metrics:
            counts[key], source[key] = int(metrics["n_response_tokens"]), "measured"
        else:
            counts[key], source[key] = analytic[key], "analytic"
    return counts, source
