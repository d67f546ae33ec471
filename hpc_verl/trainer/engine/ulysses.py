"""Ulysses sequence parallelism for the Hugging Face models we train (Llama, Qwen2 families).

An SP group of size P holds one batch: every rank runs the model on its 1/P of
the sequence (the batch padded on the right to a multiple of P). Everything but
attention is per token, so only attention needs the other ranks: before it, an
all-to-all turns "all heads of my chunk" into "my heads of the whole sequence",
attention runs there, and a second all-to-all turns it back (DeepSpeed-Ulysses).

The hook is transformers' attention registry, not an edit of the models' files:
``enable(model, group)`` registers ``ATTN_IMPLEMENTATION`` (an attention
function and, for masks, the sdpa mask builder) and switches the model to it.
The group lives on the attention modules (``set_group``), so ``set_group(model,
None)`` turns the same model back to unsplit between steps.

Padding: ``shard_batch`` builds the whole sequence's mask (causal, minus padded
keys) once as a 4D tensor, which transformers passes through to attention
unchanged; positions come from the caller's ``position_ids`` (left padding).

Gradients: ``gather_seq``'s backward hands each rank the slice of the gradient
that belongs to its chunk, so if every rank computes the same loss from the
gathered outputs, the sum of the SP ranks' parameter gradients is the gradient
of that loss. A data-parallel wrapper over all ``dp x sp`` ranks that averages
gradients therefore needs the loss scaled by its world size (as the trainer's
DP loss already is), or ``sum_grads`` for an SP group alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpc_verl.errors import HpcVerlError
from hpc_verl.trainer import core_algos as A
import copy
from hpc_verl.trainer.engine.logprobs import response_log_probs as unsplit_log_probs

ATTN_IMPLEMENTATION = "hpc_verl_ulysses"
_GROUP_ATTR = "_hpc_verl_sp_group"


class UlyssesError(HpcVerlError):
    """A model or batch that cannot be split over the sequence-parallel group."""


def _dist() -> Any:
    import torch.distributed as dist
    return dist


def group_size(group: Any) -> int:
    return 1 if group is None else _dist().get_world_size(group=group)


def group_rank(group: Any) -> int:
    return 0 if group is None else _dist().get_rank(group=group)


def _heads(config: Any) -> tuple[int, int]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    return heads, kv


def check_sp(config: Any, sp: int, where: str = "ulysses_sequence_parallel_size") -> None:
    """verl's rule: heads divisible by SP; KV heads divisible by SP, or SP by them (KV replicated)."""
    if sp < 1:
        raise UlyssesError(f"{where}={sp}: must be 1 or more")
    if sp == 1:
        return
    heads, kv = _heads(config)
    if heads % sp:
        raise UlyssesError(f"{where}={sp} does not divide the model's num_attention_heads={heads}; "
                           f"use a divisor of {heads}")
    if kv % sp and sp % kv:
        raise UlyssesError(f"{where}={sp}: the model's num_key_value_heads={kv} must be divisible by it or divide "
                           f"it (then the KV heads are replicated); use a divisor or multiple of {kv}")


# ---- the all-to-all exchanges ------------------------------------------------------------------
def _seq_to_heads(x: Any, group: Any) -> Any:
    """(B, H, S/P, D) on each rank -> (B, H/P, S, D): rank r keeps head group r of every chunk."""
    import torch
    p = group_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, p, h // p, s, d).transpose(0, 1).contiguous()      # (P, B, H/P, S/P, D)
    recv = torch.empty_like(send)
    _dist().all_to_all_single(recv, send, group=group)                      # recv[j]: rank j's chunk
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * s, d)


def _heads_to_seq(x: Any, group: Any) -> Any:
    """The inverse: (B, H/P, S, D) -> (B, H, S/P, D)."""
    import torch
    p = group_size(group)
    b, hp, s, d = x.shape
    send = x.reshape(b, hp, p, s // p, d).permute(2, 0, 1, 3, 4).contiguous()  # (P, B, H/P, S/P, D)
    recv = torch.empty_like(send)
    _dist().all_to_all_single(recv, send, group=group)                          # recv[j]: head group j
    return recv.transpose(0, 1).reshape(b, p * hp, s // p, d)


def _exchange_fn() -> Any:
    import torch

    class _Exchange(torch.autograd.Function):
        """An all-to-all whose backward is the opposite all-to-all of the gradient."""

        @staticmethod
        def forward(ctx: Any, x: Any, group: Any, to_heads: bool) -> Any:  # type: ignore[override]
            ctx.group, ctx.to_heads = group, to_heads
            return _seq_to_heads(x, group) if to_heads else _heads_to_seq(x, group)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:  # type: ignore[override]
            grad = grad.contiguous()
            out = _heads_to_seq(grad, ctx.group) if ctx.to_heads else _seq_to_heads(grad, ctx.group)
            return out, None, None

    return _Exchange


_EXCHANGE: Any = None


def exchange(x: Any, group: Any, to_heads: bool) -> Any:
    global _EXCHANGE
    if _EXCHANGE is None:
        _EXCHANGE = _exchange_fn()
    return _EXCHANGE.apply(x, group, to_heads)


# ---- the attention function --------------------------------------------------------------------
def _repeat_heads(x: Any, n: int) -> Any:
    """(B, KV, S, D) -> (B, KV*n, S, D), each head repeated n times in place (GQA layout)."""
    if n == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, n, s, d).reshape(b, kv * n, s, d)


def ulysses_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                      dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                      sliding_window: int | None = None, **kwargs: Any) -> tuple[Any, None]:
    """transformers' attention signature: q (B, H, S_local, D), k/v (B, KV, S_local, D);
    returns (B, S_local, H, D). Without a group on ``module`` it is plain sdpa attention."""
    import torch
    if sliding_window is not None:
        raise UlyssesError(f"{type(module).__name__}: sliding-window attention (sliding_window={sliding_window}) "
                           "is not supported by the Ulysses attention; turn use_sliding_window off")
    group = getattr(module, _GROUP_ATTR, None)
    p = group_size(group)
    heads, kv = query.shape[1], key.shape[1]
    if p > 1:
        if attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[-1] != query.shape[2] * p:
            raise UlyssesError("Ulysses attention over a group needs the whole sequence's mask; run the model "
                               "through hpc_verl.trainer.engine.ulysses.shard_batch (no KV cache)")
        if kv % p:   # fewer KV heads than ranks: replicate so that every rank holds one
            key, value = _repeat_heads(key, p // kv), _repeat_heads(value, p // kv)
        query, key, value = (exchange(t, group, True) for t in (query, key, value))
    key = _repeat_heads(key, query.shape[1] // key.shape[1])
    value = _repeat_heads(value, query.shape[1] // value.shape[1])
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal and attention_mask is None and query.shape[2] > 1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, is_causal=causal)
    if p > 1:
        out = exchange(out, group, False)
    assert out.shape[1] == heads
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Add ``ATTN_IMPLEMENTATION`` to transformers' attention and mask registries (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, ulysses_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)   # unsplit calls get sdpa's masks


def _attention_modules(model: Any) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "k_proj")]


def set_group(model: Any, group: Any) -> int:
    """Split attention over ``group`` from the next forward on (None: unsplit); returns the SP size."""
    sp = group_size(group)
    check_sp(model.config, sp)
    mods = _attention_modules(model)
    if not mods:
        raise UlyssesError(f"{type(model).__name__}: no attention modules with q_proj/k_proj found; Ulysses "
                           "supports the Llama and Qwen2 families")
    for m in mods:
        setattr(m, _GROUP_ATTR, group if sp > 1 else None)
    return sp


def enable(model: Any, group: Any) -> Any:
    """Switch ``model`` to the Ulysses attention over ``group`` (None or size 1: unsplit)."""
    register()
    set_group(model, group)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


# ---- inputs and outputs ------------------------------------------------------------------------
@dataclass
class ShardedBatch:
    """One rank's part of a batch: the model's inputs and what is needed to put outputs back."""

    inputs: dict[str, Any]       # input_ids, position_ids, attention_mask (4D), use_cache
    group: Any
    seq_len: int                 # before padding to a multiple of P
    pad: int                     # columns appended on the right
    start: int                   # this rank's first column in the padded sequence
    stop: int

    def local(self, x: Any, dim: int = 1) -> Any:
        """This rank's columns of a full-sequence tensor (padded like the inputs)."""
        import torch.nn.functional as F
        if self.pad:
            pads = [0, 0] * (x.dim() - 1 - dim) + [0, self.pad]
            x = F.pad(x, pads)
        return x.narrow(dim, self.start, self.stop - self.start)

    def gather(self, x: Any, dim: int = 1) -> Any:
        """Every rank's chunk of ``x`` along ``dim``, in order, padding removed (autograd: see module doc)."""
        out = gather_seq(x, self.group, dim)
        return out.narrow(dim, 0, self.seq_len)


def full_mask(attention_mask: Any, total: int) -> Any:
    """(B, S) padding mask -> (B, 1, T, T) boolean causal mask over ``total`` >= S columns:
    a query sees the non-padded keys up to itself; a padded query also sees itself, so no
    row is empty (finite outputs, which nothing downstream uses)."""
    import torch
    b, s = attention_mask.shape
    keys = torch.zeros((b, total), dtype=torch.bool, device=attention_mask.device)
    keys[:, :s] = attention_mask.bool()
    causal = torch.ones((total, total), dtype=torch.bool, device=attention_mask.device).tril()
    mask = causal[None] & keys[:, None, :]
    eye = torch.eye(total, dtype=torch.bool, device=attention_mask.device)
    mask = mask | (eye[None] & ~keys[:, :, None])
    return mask[:, None]


def shard_batch(input_ids: Any, attention_mask: Any, position_ids: Any, group: Any) -> ShardedBatch:
    """Pad the sequence to a multiple of the group size and take this rank's chunk."""
    p, r = group_size(group), group_rank(group)
    s = input_ids.shape[1]
    pad = (-s) % p
    total = s + pad
    per = total // p
    mask = full_mask(attention_mask, total)
    sb = ShardedBatch({}, group, s, pad, r * per, (r + 1) * per)
    ids = sb.local(input_ids)
    sb.inputs = {"input_ids": ids, "position_ids": sb.local(position_ids), "attention_mask": mask, "use_cache": False}
    return sb


def _gather_fn() -> Any:
    import torch

    class _Gather(torch.autograd.Function):
        """All-gather along ``dim``; backward keeps this rank's slice of the gradient."""

        @staticmethod
        def forward(ctx: Any, x: Any, group: Any, dim: int) -> Any:  # type: ignore[override]
            ctx.group, ctx.dim, ctx.size = group, dim, x.shape[dim]
            parts = [torch.empty_like(x) for _ in range(group_size(group))]
            _dist().all_gather(parts, x.contiguous(), group=group)
            return torch.cat(parts, dim=dim)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:  # type: ignore[override]
            r = group_rank(ctx.group)
            return grad.narrow(ctx.dim, r * ctx.size, ctx.size).contiguous(), None, None

    return _Gather


_GATHER: Any = None


def gather_seq(x: Any, group: Any, dim: int = 1) -> Any:
    """Concatenate the SP ranks' chunks of ``x`` along ``dim`` (identity without a group)."""
    global _GATHER
    if group_size(group) == 1:
        return x
    if _GATHER is None:
        _GATHER = _gather_fn()
    return _GATHER.apply(x, group, dim)


def forward(model: Any, input_ids: Any, attention_mask: Any, position_ids: Any, group: Any) -> tuple[Any, ShardedBatch]:
    """Run ``model`` on this rank's chunk; returns (model output with local logits, the shard)."""
    sb = shard_batch(input_ids, attention_mask, position_ids, group)
    return model(**sb.inputs), sb


def response_log_probs(model: Any, batch: dict, temperature: float = 1.0, with_entropy: bool = False,
                       group: Any = None, device: Any = None) -> Any:
    """``lm.response_log_probs`` under sequence parallelism: log-probs (and entropy) per token of
    this rank's chunk against the labels of its chunk, gathered into the response columns."""
    import torch

    dev = device if device is not None else next(model.parameters()).device
    ids = batch["input_ids"].to(dev)
    out, sb = forward(model, ids, batch["attention_mask"].to(dev), batch["position_ids"].to(dev), group)
    labels = sb.local(torch.roll(ids, -1, dims=1))   # column t predicts token t+1 (the last is unused)
    logits = out.logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    rlen = batch["responses"].shape[1]
    s = sb.seq_len
    logp = sb.gather(A.log_probs_from_logits(logits, labels))[:, s - rlen - 1:s - 1]
    if not with_entropy:
        return logp
    ent = sb.gather(A.entropy_from_logits(logits))[:, s - rlen - 1:s - 1]
    return logp, ent


def sum_grads(model: Any, group: Any) -> None:
    """Add up the SP ranks' parameter gradients (the gradient of the loss they share); for an SP
    group without a data-parallel wrapper that already reduces over it."""
    if group_size(group) == 1:
        return
    dist = _dist()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)


def compare_with_unsplit(ref: Any, batch: dict, group: Any, temperature: float = 1.0) -> dict[str, Any]:
    """How far a copy of ``ref`` under Ulysses over ``group`` is from ``ref`` itself (the check of
    the tests and of the GPU check): max differences of the logits at real tokens, of the response
    log-probs, of the parameter gradients of one loss (summed over the SP ranks), and of the copy
    switched back to unsplit. ``batch``: input_ids, attention_mask, position_ids, responses,
    weights (per response token, the loss's)."""
    import torch

    sp = enable(copy.deepcopy(ref), group)
    dev = next(ref.parameters()).device
    b = {k: v.to(dev) for k, v in batch.items()}
    valid = b["attention_mask"].bool()

    def loss(logp: Any, ent: Any) -> Any:
        return (logp * b["weights"]).sum() + 0.1 * ent.sum()

    ref_logits = ref(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"],
                     use_cache=False).logits.detach()
    out, sb = forward(sp, b["input_ids"], b["attention_mask"], b["position_ids"], group)
    sp_logits = sb.gather(out.logits).detach()
    ref.zero_grad(set_to_none=True)
    logp, ent = unsplit_log_probs(ref, b, temperature, with_entropy=True)
    loss(logp, ent).backward()
    sp_logp, sp_ent = response_log_probs(sp, b, temperature, with_entropy=True, group=group)
    loss(sp_logp, sp_ent).backward()
    sum_grads(sp, group)
    ref_grads = dict(ref.named_parameters())
    grads = max(float((p.grad - ref_grads[n].grad).abs().max()) for n, p in sp.named_parameters())
    set_group(sp, None)
    with torch.no_grad():
        unsplit = sp(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"],
                     use_cache=False).logits
    return {"logits": float((sp_logits - ref_logits)[valid].abs().max()),
            "logp": float((sp_logp - logp).detach().abs().max()), "grads": grads,
            "grad_scale": max(float(p.grad.abs().max()) for p in ref.parameters()),
            "unsplit": float((unsplit - ref_logits)[valid].abs().max()),
            "local_cols": int(out.logits.shape[1]), "finite": bool(torch.isfinite(sp_logits).all())}
