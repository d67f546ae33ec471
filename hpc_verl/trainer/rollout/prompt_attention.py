"""Decoding with GRPO's shared prompts read once per group, not once per row.

The rollout prefills each distinct prompt once (``kvcache``). Copying its keys and
values to every row of its group (``expand_rows``) makes every decoding step read
the prompt part of the cache ``rollout.n`` times: on a CPU that step's attention
is bound by those reads (about a fifth of the rollout at the benchmark's size).
Here the prompt's keys/values stay one per group and each row keeps only its
response's; a decoding step scores a group's queries against its prompt in one
batched product, each row's query against its own response, and takes one
softmax over both parts. That is the same attention (same scores, same
normaliser, same weighted sum) up to float rounding; ``tests/test_prompt_attention.py``
holds it to the copying path.

It applies to a plain transformers causal LM whose attention is SDPA over full
causal layers (Llama, Qwen2, Mistral without a window, ...), with every group the
same size; anything else keeps the copying path (``applies``).
"""
from __future__ import annotations

from typing import Any
from hpc_verl.trainer.engine.kvcache import preallocated_layer_class

NAME = "hpc_verl_shared_prompt"   # the attention implementation the rollout model is switched to
_registered = False


def _register() -> None:
    """Our attention under ``NAME`` (SDPA wherever no shared prompt is passed), with SDPA's masks."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    _registered = True


def applies(model: Any, group_sizes: list[int]) -> bool:
    """Whether ``model`` can decode with shared prompts (and the batch has equal groups of >1 row)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    cfg = getattr(model, "config", None)
    if cfg is None or len(set(group_sizes)) != 1 or group_sizes[0] < 2:
        return False
    if getattr(cfg, "_attn_implementation", None) not in ("sdpa", NAME):
        return False
    if any(getattr(cfg, k, None) for k in ("sliding_window", "attn_logit_softcapping", "use_sliding_window")):
        return False
    layers = DynamicCache(config=cfg).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def enable(model: Any) -> None:
    """Switch ``model`` (the rollout's own copy) to ``NAME``: SDPA until a call passes ``shared_prompt``."""
    _register()
    model.config._attn_implementation = NAME


def _layer_class() -> Any:
    class SharedPromptLayer(preallocated_layer_class()):
        """The first update (the prefill, one row per prompt) is the prompt part, kept as it came;
        later ones go to per-row response buffers of ``capacity`` positions (the preallocated
        layer's), so ``keys``/``values`` are the response part."""

        def __init__(self, capacity: int) -> None:
            super().__init__(capacity)
            self.prompt_k: Any = None
            self.prompt_v: Any = None

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            if self.prompt_k is None:
                self.prompt_k, self.prompt_v = key_states, value_states
                return key_states, value_states
            return super().update(key_states, value_states)

        def get_seq_length(self) -> int:
            return (0 if self.prompt_k is None else self.prompt_k.shape[-2]) + self.length

    return SharedPromptLayer


_LAYER: Any = None


def shared_prompt_cache(config: Any, response_capacity: int, prompt_mask: Any) -> Any:
    """A cache whose layers keep the prefill's prompts once and each row's response apart.
    ``prompt_mask`` ``[prompts, prompt_len]`` (1 = token, 0 = left padding) masks the prompt part."""
    global _LAYER
    from transformers.cache_utils import DynamicCache

    if _LAYER is None:
        _LAYER = _layer_class()
    cache = DynamicCache(config=config)
    cache.layers = [_LAYER(response_capacity) for _ in cache.layers]
    cache.prompt_mask = prompt_mask.bool()[:, None, None, :]   # [G, 1, 1, P]
    return cache


def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
              scaling: float | None = None, shared_prompt: Any = None, **kwargs: Any) -> tuple[Any, None]:
    """One decoding step's attention with the prompt part per group (``shared_prompt``: the cache),
    else SDPA as transformers runs it. Returns ``[rows, 1, heads, head_dim]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if shared_prompt is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    import torch

    layer = shared_prompt.layers[module.layer_idx]
    pk, pv = layer.prompt_k, layer.prompt_v                       # [G, Hkv, P, D]
    rows, heads, q_len, dim = query.shape
    groups, kv_heads, plen, _ = pk.shape
    assert q_len == 1 and rows % groups == 0 and heads % kv_heads == 0, (query.shape, pk.shape)
    n, rep = rows // groups, heads // kv_heads
    scale = scaling if scaling is not None else dim ** -0.5
    # a group's queries against its prompt: [G, Hkv, n*rep, P]
    qg = query.reshape(groups, n, kv_heads, rep, dim).transpose(1, 2).reshape(groups, kv_heads, n * rep, dim)
    s_prompt = torch.matmul(qg, pk.transpose(-1, -2)).mul_(scale)
    s_prompt.masked_fill_(~shared_prompt.prompt_mask, float("-inf"))
    s_prompt = s_prompt.reshape(groups, kv_heads, n, rep, plen).transpose(1, 2).reshape(rows, kv_heads, rep, plen)
    # each row's query against its own response so far: [B, Hkv, rep, R]
    qr = query.reshape(rows, kv_heads, rep, dim)
    s_resp = torch.matmul(qr, key.transpose(-1, -2)).mul_(scale)
    probs = torch.softmax(torch.cat([s_prompt, s_resp], dim=-1).float(), dim=-1).to(value.dtype)
    p_prompt = probs[..., :plen].reshape(groups, n, kv_heads, rep, plen).transpose(1, 2)
    out = torch.matmul(p_prompt.reshape(groups, kv_heads, n * rep, plen), pv)       # [G, Hkv, n*rep, D]
    out = out.reshape(groups, kv_heads, n, rep, dim).transpose(1, 2).reshape(rows, kv_heads, rep, dim)
    out = out + torch.matmul(probs[..., plen:], value)
    return out.reshape(rows, 1, heads, dim), None
