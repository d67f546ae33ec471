"""Response log-probs (and entropies) of a causal LM over a batch, in micro-batch row slices,
with the shared-prompt path for GRPO groups. Rank processes; torch on first use."""
from __future__ import annotations

from typing import Any, Iterator

from hpc_verl.trainer import core_algos as A
from hpc_verl.trainer.engine.device import torch_mod
from hpc_verl.trainer.engine.kvcache import expand_rows
import inspect


def chunks(n: int, size: int | None) -> Iterator[slice]:
    size = n if not size or size <= 0 else size
    for s in range(0, n, size):
        yield slice(s, min(n, s + size))


def sub_batch(batch: dict, idx: Any) -> dict:
    """Rows ``idx`` (slice or index tensor) of every row tensor of ``batch``."""
    torch = torch_mod()
    n = batch["responses"].shape[0] if "responses" in batch else None
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and (n is None or v.shape[0] == n):
            out[k] = v[idx]
        else:
            out[k] = v
    return out


def response_log_probs(model: Any, batch: dict, temperature: float = 1.0, with_entropy: bool = False,
                       device: Any = None, share_prompts: bool = False) -> Any:
    """log p(response token) under ``model`` for every response position (and entropy).

    ``share_prompts`` (a plain, unwrapped Hugging Face causal LM only): rows that repeat the row
    before them's prompt (GRPO's ``rollout.n`` samples) run that prompt through the model once
    and their responses on its keys/values. Causal attention makes a prompt's keys, values and
    last logits independent of the response after it, so this is the same function of the
    weights - gradients included - with the prompt's share of the work done once per group."""
    dev = device if device is not None else next(model.parameters()).device
    ids = batch["input_ids"].to(dev)
    attn, pos = batch["attention_mask"].to(dev), batch["position_ids"].to(dev)
    resp_len = batch["responses"].shape[1]
    logits = _shared_prompt_logits(model, ids, attn, pos, resp_len) if share_prompts else None
    if logits is None:
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False)
        logits = out.logits[:, -resp_len - 1:-1, :]
        del out
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    labels = batch["responses"].to(dev)
    logp = A.log_probs_from_logits(logits, labels)
    return (logp, A.entropy_from_logits(logits)) if with_entropy else logp


def can_share_prompts(model: Any) -> bool:
    """Whether ``response_log_probs(share_prompts=True)`` applies to ``model`` called directly: a
    causal LM that takes a cache and ``logits_to_keep`` (transformers' own), FSDP2-sharded or not
    (its per-layer reduce-scatter runs once per pass through a layer: linear, so the same gradient).
    A DDP wrapper is not one: it must see one forward per backward (``TrainModel.run``)."""
    if not hasattr(model, "config") or not hasattr(model, "forward"):
        return False
    params = inspect.signature(model.forward).parameters
    return "logits_to_keep" in params and "past_key_values" in params


def _shared_prompt_logits(model: Any, ids: Any, attn: Any, pos: Any, resp_len: int) -> Any:
    """The response positions' logits with every distinct prompt run once (None: no prompt repeats)."""
    torch = torch_mod()
    from transformers.cache_utils import DynamicCache


    plen = ids.shape[1] - resp_len
    if plen < 1 or resp_len < 1 or ids.shape[0] < 2:
        return None
    _, owner = torch.unique_consecutive(torch.cat([ids[:, :plen], attn[:, :plen]], dim=1), dim=0,
                                        return_inverse=True)
    if int(owner[-1]) + 1 == ids.shape[0]:
        return None
    first = torch.nonzero(torch.cat([torch.ones(1, dtype=torch.bool, device=owner.device),
                                     owner[1:] != owner[:-1]])).squeeze(1)
    cache = DynamicCache(config=model.config)
    head = model(input_ids=ids[first, :plen], attention_mask=attn[first, :plen], position_ids=pos[first, :plen],
                 past_key_values=cache, use_cache=True, logits_to_keep=1).logits[owner]   # predicts response 0
    if resp_len == 1:
        return head
    expand_rows(cache, owner)
    tail = model(input_ids=ids[:, plen:-1], attention_mask=attn[:, :-1], position_ids=pos[:, plen:-1],
                 past_key_values=cache, use_cache=True).logits                          # predict responses 1..
    return torch.cat([head, tail], dim=1)
