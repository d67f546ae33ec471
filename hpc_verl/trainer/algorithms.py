"""PPO/GRPO maths on padded token tensors (batch, response_length) with a 0/1 mask.

Everything here is pure torch on tensors, no model or Ray, so it is unit-tested
against independent numpy computations. Conventions follow verl: masks mark the
response tokens that count; losses are aggregated by ``loss_agg_mode``.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over the positions where ``mask`` is 1 (0 if none)."""
    denom = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / denom.clamp(min=1e-8)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n > 1:
            var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise to zero mean / unit variance over the masked positions."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out


def loss_denominator(mask: torch.Tensor, mode: str = "token-mean") -> float:
    """What ``agg_loss`` divides by over a whole mini-batch: its response tokens
    (token-mean) or its sequences that have any (seq-mean-*)."""
    if mode == "token-mean":
        return max(float(mask.sum()), 1e-8)
    return max(float((mask.sum(-1) > 0).float().sum()), 1.0)


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
             denom: float | None = None) -> torch.Tensor:
    """Reduce a (batch, T) loss: over all tokens, or per sequence then over sequences.

    ``denom``: the mini-batch's ``loss_denominator``; given it, a micro-batch (or a
    data-parallel rank's share) contributes its sum over that global count, so the
    contributions add up to exactly the mini-batch's loss whatever the split."""
    if mode not in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        raise ValueError(f"unknown loss_agg_mode {mode!r}")
    if mode == "token-mean":
        if denom is None:
            return masked_mean(loss_mat, mask)
        return masked_sum(loss_mat, mask) / denom
    seq_has_tokens = (mask.sum(-1) > 0).float()
    if mode == "seq-mean-token-sum":
        per_seq = masked_sum(loss_mat, mask, dim=-1)
    else:
        per_seq = masked_mean(loss_mat, mask, dim=-1)
    if denom is None:
        denom = seq_has_tokens.sum().clamp(min=1)
    return (per_seq * seq_has_tokens).sum() / denom


def compute_gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                gamma: float, lam: float, whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation, token-level, skipping masked-out positions.

    A masked position neither contributes a TD term nor breaks the chain: the
    value and running advantage of the next kept token are carried across it.
    Returns (advantages, returns); returns = raw advantages + values.
    """
    mask = mask.to(values.dtype)
    batch, length = values.shape
    next_value = torch.zeros(batch, dtype=values.dtype, device=values.device)
    last_gae = torch.zeros_like(next_value)
    adv = torch.zeros_like(values)
    for t in reversed(range(length)):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        adv[:, t] = gae_t * m
        last_gae = m * gae_t + (1 - m) * last_gae
        next_value = m * values[:, t] + (1 - m) * next_value
    returns = (adv + values) * mask
    if whiten:
        adv = masked_whiten(adv, mask) * mask
    return adv, returns


def compute_grpo_advantages(scores: torch.Tensor, group_ids: Sequence[Hashable], mask: torch.Tensor,
                            norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each response's score minus its prompt group's mean (over its std), on every token.

    A group of one has mean 0 and std 1 (its score passes through), as in verl.
    """
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        groups[g].append(i)
    adv = torch.zeros_like(scores)
    for idx in groups.values():
        s = scores[idx]
        if len(idx) == 1:
            mean, std = torch.zeros((), dtype=s.dtype), torch.ones((), dtype=s.dtype)
        else:
            mean, std = s.mean(), s.std(unbiased=True)
        adv[idx] = (s - mean) / (std + eps) if norm_by_std else s - mean
    return adv.unsqueeze(-1) * mask


@dataclass
class PolicyLossOut:
    loss: torch.Tensor
    clipfrac: torch.Tensor
    clipfrac_lower: torch.Tensor
    approx_kl: torch.Tensor


def policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                clip_ratio_c: float | None = 3.0, loss_agg_mode: str = "token-mean",
                denom: float | None = None, token_denom: float | None = None) -> PolicyLossOut:
    """PPO clipped surrogate with dual-clip for negative advantages.

    loss_t = max(-A r, -A clip(r, 1-low, 1+high)); where A < 0 it is further capped
    at -A * clip_ratio_c (dual-clip, Ye et al. 2020), so a huge ratio on a bad
    action cannot dominate. ``clip_ratio_c`` None or <= 1 disables dual-clip.
    ``denom``/``token_denom``: the mini-batch's loss and token denominators (see
    ``agg_loss``): the loss and the token statistics become this part's share.
    """
    neg_kl = log_prob - old_log_prob
    ratio = torch.exp(neg_kl.clamp(-20.0, 20.0))

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return masked_mean(x, mask) if token_denom is None else masked_sum(x, mask) / token_denom

    approx_kl = token_mean(-neg_kl)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    clipfrac = token_mean((loss2 > loss1).float())
    if clip_ratio_c is not None and clip_ratio_c > 1:
        loss3 = -advantages * clip_ratio_c
        dual = torch.minimum(loss3, clipped)
        clipfrac_lower = token_mean(((clipped > loss3) & (advantages < 0)).float())
        final = torch.where(advantages < 0, dual, clipped)
    else:
        clipfrac_lower = torch.zeros(())
        final = clipped
    return PolicyLossOut(agg_loss(final, mask, loss_agg_mode, denom), clipfrac, clipfrac_lower, approx_kl)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float, loss_agg_mode: str = "token-mean", denom: float | None = None,
               token_denom: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss 0.5*max((v-R)^2, (clip(v, v_old±c)-R)^2); returns (loss, clipfrac)."""
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    l1 = (values - returns) ** 2
    l2 = (clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(l1, l2), mask, loss_agg_mode, denom)
    frac = (l2 > l1).float()
    return loss, (masked_mean(frac, mask) if token_denom is None else masked_sum(frac, mask) / token_denom)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dim."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] without materialising the full log-softmax twice."""
    logits = logits.float()
    return torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str = "kl") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (verl's names)."""
    diff = log_prob - ref_log_prob
    if kind == "kl":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "mse":
        return 0.5 * diff ** 2
    if kind == "low_var_kl":  # k3 estimator, Schulman 2020; non-negative, clamped for stability
        kl = (ref_log_prob - log_prob).clamp(-20.0, 20.0)
        return (kl.exp() - kl - 1).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl penalty {kind!r}")


class FixedKLController:
    """KL coefficient that never changes."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. 2019: move the coefficient so the measured KL tracks ``target_kl``."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        super().__init__(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(kl_ctrl: dict) -> FixedKLController:
    if kl_ctrl["type"] == "fixed":
        return FixedKLController(kl_ctrl["kl_coef"])
    if kl_ctrl["type"] == "adaptive":
        return AdaptiveKLController(kl_ctrl["kl_coef"], kl_ctrl["target_kl"], kl_ctrl["horizon"])
    raise ValueError(f"unknown kl_ctrl.type {kl_ctrl['type']!r}")


def apply_kl_penalty(token_scores: torch.Tensor, log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                     mask: torch.Tensor, controller: FixedKLController, kind: str = "kl"
                     ) -> tuple[torch.Tensor, float]:
    """token rewards = scores - beta * KL per token; updates the controller with the batch KL.

    Returns (token_rewards, current_kl) where current_kl is the mean over
    sequences of each sequence's mean token KL.
    """
    kld = kl_penalty(log_prob, ref_log_prob, kind) * mask
    beta = controller.value
    rewards = token_scores - beta * kld
    current_kl = float(masked_mean(kld, mask, dim=-1).mean())
    controller.update(current_kl, n_steps=token_scores.shape[0])
    return rewards, current_kl


def scores_to_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put each sequence's scalar score on its last response token (outcome reward)."""
    rewards = torch.zeros_like(mask, dtype=scores.dtype)
    lengths = mask.long().sum(-1)
    has = lengths > 0
    # last kept position: index of the last 1 in each row
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(-1).values
    rows = torch.nonzero(has).squeeze(-1)
    rewards[rows, last[rows]] = scores[rows]
    return rewards
