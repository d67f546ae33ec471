"""PPO/GRPO maths against independent numpy loops (random inputs, 1e-5) and hand-computed cases."""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hpc_verl.trainer import core_algos as A  # noqa: E402

RNG = np.random.default_rng(1234)


def _rand_mask(b: int, t: int, holes: bool = True) -> np.ndarray:
    """Responses of random length, optionally with masked holes inside (e.g. tool output)."""
    mask = np.zeros((b, t))
    for i in range(b):
        n = RNG.integers(1, t + 1)
        mask[i, :n] = 1
        if holes and n > 3:
            mask[i, RNG.integers(1, n - 1)] = 0
    return mask


def np_gae(r, v, m, gamma, lam):
    b, t = r.shape
    adv = np.zeros((b, t))
    for i in range(b):
        idx = [j for j in range(t) if m[i, j] > 0]  # the kept tokens, as one chain
        nxt, acc = 0.0, 0.0
        for j in reversed(idx):
            delta = r[i, j] + gamma * nxt - v[i, j]
            acc = delta + gamma * lam * acc
            adv[i, j] = acc
            nxt = v[i, j]
    ret = (adv + v) * m
    kept = adv[m > 0]
    mean, var = kept.mean(), kept.var(ddof=1)
    white = (adv - mean) / math.sqrt(var + 1e-8) * m
    return white, ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_numpy_with_token_masks(gamma, lam):
    b, t = 7, 11
    r, v, m = RNG.normal(size=(b, t)), RNG.normal(size=(b, t)), _rand_mask(b, t)
    adv, ret = A.compute_gae(torch.tensor(r), torch.tensor(v), torch.tensor(m), gamma, lam)
    want_adv, want_ret = np_gae(r, v, m, gamma, lam)
    np.testing.assert_allclose(adv.numpy(), want_adv, atol=1e-5)
    np.testing.assert_allclose(ret.numpy(), want_ret, atol=1e-5)


def test_gae_hand_computed():
    # one sequence, 3 tokens, reward 1 at the end, values 0.5, 0.25, 0; gamma=1, lam=1:
    # delta2 = 1 + 0 - 0 = 1; delta1 = 0 + 0 - 0.25 = -0.25; delta0 = 0 + 0.25 - 0.5 = -0.25
    # adv2 = 1; adv1 = -0.25 + 1 = 0.75; adv0 = -0.25 + 0.75 = 0.5; returns = adv + v = 1, 1, 1
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.25, 0.0]])
    m = torch.ones(1, 3)
    adv, ret = A.compute_gae(r, v, m, 1.0, 1.0, whiten=False)
    assert adv.tolist() == [[0.5, 0.75, 1.0]]
    assert ret.tolist() == [[1.0, 1.0, 1.0]]
    # gamma = 0.5, lam = 0.5: delta2 = 1; delta1 = 0 + .5*0 - .25 = -.25; delta0 = .5*.25 - .5 = -.375
    # adv2 = 1; adv1 = -.25 + .25*1 = 0; adv0 = -.375 + .25*0 = -.375
    adv, _ = A.compute_gae(r, v, m, 0.5, 0.5, whiten=False)
    np.testing.assert_allclose(adv.numpy(), [[-0.375, 0.0, 1.0]])
    # a masked-out middle token is skipped: the chain goes 0 -> 2
    m2 = torch.tensor([[1.0, 0.0, 1.0]])
    adv, _ = A.compute_gae(r, v, m2, 1.0, 1.0, whiten=False)
    # delta2 = 1; delta0 = 0 + v2(0) - .5 = -.5; adv0 = -.5 + 1 = .5
    np.testing.assert_allclose(adv.numpy(), [[0.5, 0.0, 1.0]])


def test_grpo_matches_numpy_and_hand_case():
    groups = [0, 0, 0, 0, 1, 1, 1, 1, 2]
    s = RNG.normal(size=len(groups))
    m = _rand_mask(len(groups), 6, holes=False)
    got = A.compute_grpo_advantages(torch.tensor(s), groups, torch.tensor(m)).numpy()
    want = np.zeros(len(groups))
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        if len(idx) == 1:
            want[idx] = s[idx]
        else:
            want[idx] = (s[idx] - s[idx].mean()) / (s[idx].std(ddof=1) + 1e-6)
    np.testing.assert_allclose(got, want[:, None] * m, atol=1e-5)
    # hand: scores 1, 0 in one group -> mean .5, std (unbiased) sqrt(.5) -> +-0.7071
    got = A.compute_grpo_advantages(torch.tensor([1.0, 0.0]), ["p", "p"], torch.ones(2, 2),
                                    eps=0.0)
    np.testing.assert_allclose(got.numpy(), [[0.70710678] * 2, [-0.70710678] * 2], atol=1e-6)
    got = A.compute_grpo_advantages(torch.tensor([1.0, 0.0]), ["p", "p"], torch.ones(2, 1),
                                    norm_by_std=False)
    np.testing.assert_allclose(got.numpy(), [[0.5], [-0.5]])


def np_policy_loss(old, new, adv, m, lo, hi, c, mode):
    out = np.zeros_like(adv)
    for i in range(adv.shape[0]):
        for j in range(adv.shape[1]):
            r = math.exp(new[i, j] - old[i, j])
            a = adv[i, j]
            l1 = -a * r
            l2 = -a * min(max(r, 1 - lo), 1 + hi)
            loss = max(l1, l2)
            if a < 0:
                loss = min(loss, -a * c)
            out[i, j] = loss
    return np_agg(out, m, mode)


def np_agg(x, m, mode):
    if mode == "token-mean":
        return (x * m).sum() / m.sum()
    rows = []
    for i in range(x.shape[0]):
        if m[i].sum() == 0:
            continue
        s = (x[i] * m[i]).sum()
        rows.append(s if mode == "seq-mean-token-sum" else s / m[i].sum())
    return float(np.mean(rows))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_policy_loss_dual_clip_matches_numpy(mode):
    b, t = 9, 8
    old = RNG.normal(scale=1.0, size=(b, t)) - 2
    new = old + RNG.normal(scale=0.6, size=(b, t))  # ratios well outside the clip range
    adv = RNG.normal(scale=2.0, size=(b, t))
    m = _rand_mask(b, t)
    got = A.policy_loss(torch.tensor(old), torch.tensor(new), torch.tensor(adv), torch.tensor(m),
                        0.2, 0.28, 3.0, mode)
    want = np_policy_loss(old, new, adv, m, 0.2, 0.28, 3.0, mode)
    assert abs(float(got.loss) - want) < 1e-5
    # approx_kl is the masked mean of old - new
    assert abs(float(got.approx_kl) - ((old - new) * m).sum() / m.sum()) < 1e-5


def test_policy_loss_hand_cases():
    # ratio e^1 = 2.718 with A = +1: clipped at 1.2 -> loss = -1.2
    one = torch.ones(1, 1)
    out = A.policy_loss(torch.zeros(1, 1), one, one, one, 0.2, 0.2, 3.0)
    assert abs(float(out.loss) + 1.2) < 1e-6 and float(out.clipfrac) == 1.0
    # ratio e^2 = 7.39 with A = -1: unclipped would be 7.39, dual-clip caps it at 3
    out = A.policy_loss(torch.zeros(1, 1), 2 * one, -one, one, 0.2, 0.2, 3.0)
    assert abs(float(out.loss) - 3.0) < 1e-6 and float(out.clipfrac_lower) == 1.0
    # without dual clip it is e^2
    out = A.policy_loss(torch.zeros(1, 1), 2 * one, -one, one, 0.2, 0.2, None)
    assert abs(float(out.loss) - math.exp(2)) < 1e-5
    # ratio 1: loss = -A
    out = A.policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2))
    assert abs(float(out.loss) + 0.5) < 1e-6


def test_value_loss_matches_numpy_and_hand():
    b, t = 6, 7
    v, old, ret = RNG.normal(size=(b, t)), RNG.normal(size=(b, t)), RNG.normal(size=(b, t))
    m = _rand_mask(b, t)
    got, _ = A.value_loss(torch.tensor(v), torch.tensor(old), torch.tensor(ret), torch.tensor(m), 0.5)
    clipped = old + np.clip(v - old, -0.5, 0.5)
    want = 0.5 * np_agg(np.maximum((v - ret) ** 2, (clipped - ret) ** 2), m, "token-mean")
    assert abs(float(got) - want) < 1e-5
    # hand: v=2, old=0, R=0, clip .5 -> max(4, .25) / 2 = 2
    got, frac = A.value_loss(torch.tensor([[2.0]]), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), 0.5)
    assert float(got) == 2.0 and float(frac) == 0.0
    # v=2, old=0, R=2: unclipped 0, clipped (.5-2)^2 = 2.25 -> 1.125
    got, frac = A.value_loss(torch.tensor([[2.0]]), torch.zeros(1, 1), torch.tensor([[2.0]]), torch.ones(1, 1), 0.5)
    assert float(got) == 1.125 and float(frac) == 1.0


def test_entropy_and_logprobs_match_numpy():
    logits = RNG.normal(size=(3, 4, 9)) * 3
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    got = A.entropy_from_logits(torch.tensor(logits)).numpy()
    np.testing.assert_allclose(got, -(p * np.log(p)).sum(-1), atol=1e-5)
    labels = RNG.integers(0, 9, size=(3, 4))
    got = A.log_probs_from_logits(torch.tensor(logits), torch.tensor(labels)).numpy()
    want = np.log(np.take_along_axis(p, labels[..., None], -1)[..., 0])
    np.testing.assert_allclose(got, want, atol=1e-5)
    # uniform over 4 -> entropy ln 4
    assert abs(float(A.entropy_from_logits(torch.zeros(4))) - math.log(4)) < 1e-6


def test_kl_penalties_and_controllers():
    lp, ref = RNG.normal(size=(4, 5)), RNG.normal(size=(4, 5))
    d = lp - ref
    t = torch.tensor
    np.testing.assert_allclose(A.kl_penalty(t(lp), t(ref), "kl").numpy(), d, atol=1e-6)
    np.testing.assert_allclose(A.kl_penalty(t(lp), t(ref), "abs").numpy(), abs(d), atol=1e-6)
    np.testing.assert_allclose(A.kl_penalty(t(lp), t(ref), "mse").numpy(), 0.5 * d * d, atol=1e-6)
    k3 = np.clip(np.exp(ref - lp) - (ref - lp) - 1, -10, 10)
    np.testing.assert_allclose(A.kl_penalty(t(lp), t(ref), "low_var_kl").numpy(), k3, atol=1e-5)

    fixed = A.make_kl_controller({"type": "fixed", "kl_coef": 0.1, "target_kl": 1, "horizon": 1})
    fixed.update(5.0, 100)
    assert fixed.value == 0.1
    # adaptive: kl 0.3 vs target 0.1 -> error clipped to 0.2; 64 steps / horizon 640 -> x1.02
    ada = A.make_kl_controller({"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.1, "horizon": 640})
    ada.update(0.3, 64)
    assert abs(ada.value - 0.102) < 1e-12
    ada.update(0.05, 64)  # error -0.5 -> -0.2 -> x0.98
    assert abs(ada.value - 0.102 * 0.98) < 1e-12

    # the penalty enters the token rewards with the controller's coefficient
    scores = torch.zeros(2, 3)
    scores[:, -1] = 1.0
    lp_t, ref_t = torch.full((2, 3), -1.0), torch.full((2, 3), -1.5)
    mask = torch.ones(2, 3)
    rewards, kl = A.apply_kl_penalty(scores, lp_t, ref_t, mask, A.FixedKLController(0.2), "kl")
    assert abs(kl - 0.5) < 1e-6
    np.testing.assert_allclose(rewards.numpy(), [[-0.1, -0.1, 0.9]] * 2, atol=1e-6)


def test_scores_land_on_last_response_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float32)
    r = A.scores_to_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert r.tolist() == [[0, 0, 1, 0], [2, 0, 0, 0], [0, 0, 0, 0]]


def test_masked_whiten_zero_mean_unit_var():
    x = torch.tensor(RNG.normal(size=(5, 6)) * 4 + 3)
    m = torch.tensor(_rand_mask(5, 6, holes=False))
    w = A.masked_whiten(x, m)
    kept = w[m > 0].numpy()
    assert abs(kept.mean()) < 1e-6 and abs(kept.std(ddof=1) - 1) < 1e-4


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_parts_over_the_global_denominator_add_up_to_the_whole(mode):
    """What makes DP=W (and micro-batching) equal one rank: each part's loss is its sum over the
    mini-batch's global token/sequence count, so the parts add up to the whole batch's loss."""
    g = torch.Generator().manual_seed(3)
    loss = torch.randn(10, 6, generator=g)
    mask = (torch.rand(10, 6, generator=g) > 0.3).float()
    mask[4] = 0  # a response with no tokens: no token count, but one of the sequences (as in verl)
    whole = A.agg_loss(loss, mask, mode)
    denom = A.loss_denominator(mask, mode)
    for cuts in ([0, 10], [0, 5, 10], [0, 1, 4, 7, 10]):
        parts = sum(A.agg_loss(loss[a:b], mask[a:b], mode, denom) for a, b in zip(cuts, cuts[1:]))
        assert float(parts) == pytest.approx(float(whole), rel=1e-6, abs=1e-7)
