"""PPO/GRPO maths on padded token tensors (batch, response_length) with a 0/1 mask.

Everything here is pure torch on tensors, no model or Ray, so it is unit-tested
against independent numpy computations and, value by value, against upstream verl
0.9.1's own functions (``tests/test_verl_parity.py``). Conventions follow verl:
masks mark the response tokens that count; losses are aggregated by
``loss_agg_mode`` over a whole mini-batch, as verl's training engine does.

The names the trainer accepts (estimators, loss aggregation modes, schedules) are defined
here once; the config (driver, no torch) reads them, so torch is imported on first use.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
import math
from typing import TYPE_CHECKING, Any, Callable, Hashable, Mapping, Sequence

if TYPE_CHECKING:
    import torch


class _TorchOnFirstUse:
    """Stands for torch until a function here first runs, then puts torch itself in its place:
    the config's name lists load without torch, and the maths pays nothing after the first call."""

    def __getattr__(self, name: str) -> Any:
        import torch   # heavy: only when maths runs (the config reads this module's names)

        globals()["torch"] = torch
        return getattr(torch, name)


if not TYPE_CHECKING:
    torch = _TorchOnFirstUse()

# verl 0.9.1's names (each means what it means in verl: tests/test_verl_parity.py)
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
OUTCOME_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
ADV_ESTIMATORS = ("gae", *OUTCOME_ESTIMATORS)   # gae: the critic's; the others are critic-free
KL_BASE_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_ESTIMATORS = KL_BASE_ESTIMATORS + tuple(k + "+" for k in KL_BASE_ESTIMATORS)   # "+": k's value, k2's gradient
LR_SCHEDULERS = ("constant", "cosine")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum where ``mask`` is 1; a NaN or inf at a masked-out position cannot leak in."""
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device)) * mask
    return kept.sum() if dim is None else kept.sum(dim)


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


def loss_denominator(mask: torch.Tensor, mode: str = "token-mean",
                     loss_scale_factor: float | None = None) -> float:
    """What ``agg_loss`` divides a whole mini-batch's sum by, as verl's engine sets it: its
    response tokens (token-mean), 1 (token-sum), or its sequences (seq-mean-*: every row,
    an empty one too, as verl's ``global_batch_size`` = ppo_mini_batch_size x rollout.n),
    times ``loss_scale_factor`` (default: the padded response length) for
    seq-mean-token-sum-norm."""
    if mode == "token-mean":
        return max(float(mask.sum()), 1e-8)
    if mode == "token-sum":
        return 1.0
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return max(float(mask.shape[0]), 1.0)
    if mode == "seq-mean-token-sum-norm":
        scale = float(mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return max(float(mask.shape[0]), 1.0) * scale
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
             denom: float | None = None, loss_scale_factor: float | None = None) -> torch.Tensor:
    """Reduce a (batch, T) loss: a sum over all tokens, or per sequence (token sum or
    mean) then over sequences, divided by ``denom``.

    ``denom``: the mini-batch's ``loss_denominator``; given it, a micro-batch (or a
    data-parallel rank's share) contributes its sum over that global count, so the
    contributions add up to exactly the mini-batch's loss whatever the split. Without
    it, ``loss_mat`` is taken to be the whole mini-batch."""
    if denom is None:
        denom = loss_denominator(mask, mode, loss_scale_factor)
    if mode in ("token-mean", "token-sum"):
        return masked_sum(loss_mat, mask) / denom
    per_seq = masked_sum(loss_mat, mask, dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1e-8)
    return per_seq.sum() / denom


def compute_gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                gamma: float, lam: float, whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation, token-level, skipping masked-out positions.

    A masked position neither contributes a TD term nor breaks the chain: the
    value and running advantage of the next kept token are carried across it.
    Returns (advantages, returns); returns = raw advantages + values. Both are 0 at
    masked-out positions (verl leaves the carried-over values there; no loss reads them).
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


def _groups(group_ids: Sequence[Hashable]) -> list[list[int]]:
    """Row indices of each prompt group, in order of first appearance."""
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        groups[g].append(i)
    return list(groups.values())


def compute_grpo_advantages(scores: torch.Tensor, group_ids: Sequence[Hashable], mask: torch.Tensor,
                            norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each response's score minus its prompt group's mean (over its std), on every token.

    A group of one has mean 0 and std 1 (its score passes through), as in verl.
    """
    adv = torch.zeros_like(scores)
    for idx in _groups(group_ids):
        s = scores[idx]
        if len(idx) == 1:
            mean, std = torch.zeros((), dtype=s.dtype), torch.ones((), dtype=s.dtype)
        else:
            mean, std = s.mean(), s.std(unbiased=True)
        adv[idx] = (s - mean) / (std + eps) if norm_by_std else s - mean
    return adv.unsqueeze(-1) * mask


def compute_rloo_advantages(scores: torch.Tensor, group_ids: Sequence[Hashable], mask: torch.Tensor
                            ) -> torch.Tensor:
    """RLOO: each score minus the mean of the other responses to its prompt, n/(n-1)(s - mean);
    a group of one keeps its score."""
    adv = scores.clone()
    for idx in _groups(group_ids):
        n = len(idx)
        if n > 1:
            s = scores[idx]
            adv[idx] = s * n / (n - 1) - s.mean() * n / (n - 1)
    return adv.unsqueeze(-1) * mask


def compute_reinforce_pp_baseline_advantages(scores: torch.Tensor, group_ids: Sequence[Hashable],
                                             mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE++ with a baseline: score minus its group's mean (0 for a group of one) on every
    token, then whitened over the batch's response tokens."""
    centred = scores.clone()
    for idx in _groups(group_ids):
        if len(idx) > 1:
            centred[idx] = scores[idx] - scores[idx].mean()
    adv = centred.unsqueeze(-1) * mask
    return masked_whiten(adv, mask) * mask


def compute_reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go per token (masked positions carry it across),
    whitened over the batch's response tokens; returns (advantages, returns)."""
    mask = mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        nxt = token_rewards[:, t] + gamma * running
        returns[:, t] = nxt * m
        running = nxt * m + running * (1 - m)
    return masked_whiten(returns, mask) * mask, returns


def outcome_advantages(estimator: str, token_rewards: torch.Tensor, mask: torch.Tensor,
                       group_ids: Sequence[Hashable], gamma: float = 1.0, norm_adv_by_std_in_grpo: bool = True
                       ) -> torch.Tensor:
    """Advantages of a critic-free estimator (verl's ``algorithm.adv_estimator`` names)."""
    if estimator == "reinforce_plus_plus":
        return compute_reinforce_pp_advantages(token_rewards, mask, gamma)[0]
    scores = masked_sum(token_rewards, mask, dim=-1)
    if estimator == "grpo":
        return compute_grpo_advantages(scores, group_ids, mask, norm_adv_by_std_in_grpo)
    if estimator == "rloo":
        return compute_rloo_advantages(scores, group_ids, mask)
    if estimator == "reinforce_plus_plus_baseline":
        return compute_reinforce_pp_baseline_advantages(scores, group_ids, mask)
    raise ValueError(f"unknown outcome advantage estimator {estimator!r}")


@dataclass
class PolicyLossOut:
    loss: torch.Tensor
    clipfrac: torch.Tensor
    clipfrac_lower: torch.Tensor
    approx_kl: torch.Tensor


def policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                clip_ratio_c: float | None = 3.0, loss_agg_mode: str = "token-mean",
                denom: float | None = None, token_denom: float | None = None,
                loss_scale_factor: float | None = None) -> PolicyLossOut:
    """PPO clipped surrogate with dual-clip for negative advantages.

    loss_t = max(-A r, -A clip(r, 1-low, 1+high)); where A < 0 it is further capped
    at -A * clip_ratio_c (dual-clip, Ye et al. 2020), so a huge ratio on a bad
    action cannot dominate. ``clip_ratio_c`` None or <= 1 disables dual-clip.
    ``denom``/``token_denom``: the mini-batch's loss and token denominators (see
    ``agg_loss``): the loss and the token statistics become this part's share.
    """
    neg_kl = (log_prob - old_log_prob).clamp(-20.0, 20.0)   # the clamped log-ratio feeds ppo_kl too
    ratio = torch.exp(neg_kl)

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
    return PolicyLossOut(agg_loss(final, mask, loss_agg_mode, denom, loss_scale_factor), clipfrac, clipfrac_lower,
                         approx_kl)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float, loss_agg_mode: str = "token-mean", denom: float | None = None,
               token_denom: float | None = None, loss_scale_factor: float | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss 0.5*max((v-R)^2, (clip(v, v_old±c)-R)^2); returns (loss, clipfrac)."""
    clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    l1 = (values - returns) ** 2
    l2 = (clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(l1, l2), mask, loss_agg_mode, denom, loss_scale_factor)
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
    """Per-token KL estimate between the policy and the reference (verl's names: kl = k1,
    mse = k2 (half the squared log-ratio), low_var_kl = k3 (Schulman 2020, clamped), abs).

    A ``+`` suffix (``k3+``, ``low_var_kl+``, ...) keeps the estimate's value but takes k2's
    gradient (straight-through): k2's gradient is the unbiased one for the KL."""
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    diff = log_prob - ref_log_prob
    if base in ("kl", "k1"):
        value = diff
    elif base == "abs":
        value = diff.abs()
    elif base in ("mse", "k2"):
        value = 0.5 * diff.square()
    elif base in ("low_var_kl", "k3"):   # non-negative; clamped for stability
        kl = (ref_log_prob - log_prob).clamp(-20.0, 20.0)
        value = (kl.exp() - kl - 1).clamp(-10.0, 10.0)
    else:
        raise ValueError(f"unknown kl penalty {kind!r}")
    if not straight_through:
        return value
    k2 = 0.5 * diff.square()
    return value.detach() + (k2 - k2.detach())


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


def lr_lambda(optim: Mapping, total_steps: int) -> Callable[[int], float]:
    """The learning-rate multiplier per training step, as verl's FSDP engine builds it from the
    role's ``optim`` keys: linear warm-up from 0 over ``lr_warmup_steps`` (<= 0: the ratio
    ``lr_warmup_steps_ratio`` of ``total_steps``), then constant or a cosine down to
    ``min_lr_ratio`` over ``num_cycles`` (``lr_scheduler_type``)."""
    warmup = int(optim["lr_warmup_steps"])
    if warmup <= 0:
        warmup = int(optim["lr_warmup_steps_ratio"] * max(total_steps, 0))
    kind = optim["lr_scheduler_type"]
    if kind == "constant":
        return lambda step: step / max(1, warmup) if step < warmup else 1.0
    if kind != "cosine":
        raise ValueError(f"unknown lr_scheduler_type {kind!r}")
    floor = float(optim["min_lr_ratio"] or 0.0)
    cycles = float(optim["num_cycles"])
    shift = 0 if optim["zero_indexed_step"] else 1

    def cosine(step: int) -> float:
        step += shift
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total_steps - warmup)
        wave = 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * progress))
        return max(floor, floor + (1.0 - floor) * wave)

    return cosine
