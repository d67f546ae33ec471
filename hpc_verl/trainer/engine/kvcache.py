"""The transformers rollout's KV cache: preallocated once per batch, and shared prompts prefilled once.

transformers' default ``DynamicCache`` concatenates every layer's keys and values
with the new token's at every decoding step (a copy of the whole cache per token
and layer: about a fifth of a CPU rollout's time at the benchmark's size).
``preallocated_cache`` gives each full-attention layer a buffer for the prompt and
all response tokens; a step writes its token into the buffer and attention reads
a view of the filled part. The keys and values are the same numbers; only the
copies go. Layers of other kinds (sliding windows, ...) keep transformers' own.

GRPO's ``rollout.n`` samples of one prompt are consecutive rows with the same
(left-padded) prompt: the rollout prefills each distinct prompt once and
``expand_rows`` copies its keys and values to every row that repeats it, before
the rows' sampling differs.
"""
from __future__ import annotations

from typing import Any


def _layer_class() -> Any:
    import torch
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """Keys/values in a ``[batch, heads, capacity, head_dim]`` buffer; ``keys``/``values`` are views
        of its first ``length`` positions."""

        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = int(capacity)
            self.length = 0
            self.k_buf: Any = None
            self.v_buf: Any = None

        def lazy_initialization(self, key_states: Any, value_states: Any) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            b, h, _, d = key_states.shape
            self.k_buf = torch.empty((b, h, self.capacity, d), dtype=key_states.dtype, device=key_states.device)
            self.v_buf = torch.empty((b, h, self.capacity, value_states.shape[-1]), dtype=value_states.dtype,
                                     device=value_states.device)
            self.keys, self.values = self.k_buf[:, :, :0], self.v_buf[:, :, :0]
            self.is_initialized = True

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = key_states.shape[-2]
            if self.length + n > self.capacity:   # longer than planned: fall back to growing
                self.k_buf = torch.cat([self.k_buf[:, :, :self.length], key_states], dim=-2)
                self.v_buf = torch.cat([self.v_buf[:, :, :self.length], value_states], dim=-2)
                self.capacity = self.length = self.k_buf.shape[-2]
            else:
                self.k_buf[:, :, self.length:self.length + n] = key_states
                self.v_buf[:, :, self.length:self.length + n] = value_states
                self.length += n
            self.keys, self.values = self.k_buf[:, :, :self.length], self.v_buf[:, :, :self.length]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length

        def select_rows(self, index: Any) -> None:
            if self.is_initialized:
                self.k_buf = self.k_buf.index_select(0, index)
                self.v_buf = self.v_buf.index_select(0, index)
                self.keys, self.values = self.k_buf[:, :, :self.length], self.v_buf[:, :, :self.length]

    return PreallocatedLayer


_LAYER: Any = None


def preallocated_layer_class() -> Any:
    """A ``DynamicLayer`` that writes into a preallocated buffer (made on first use: transformers is
    imported lazily)."""
    global _LAYER
    if _LAYER is None:
        _LAYER = _layer_class()
    return _LAYER


def preallocated_cache(config: Any, capacity: int) -> Any:
    """A ``DynamicCache`` for ``config`` whose full-attention layers hold ``capacity`` positions in place."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    layer_class = preallocated_layer_class()
    cache = DynamicCache(config=config)
    if not cache.layers:   # no layer types known up front: transformers adds layers as they come
        return cache
    cache.layers = [layer_class(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def expand_rows(cache: Any, index: Any) -> None:
    """Rows ``index`` of every layer of ``cache`` (a prompt's row copied to each row of its run)."""
    for layer in cache.layers:
        if hasattr(layer, "select_rows"):
            layer.select_rows(index)
        else:
            layer.batch_select_indices(index)

