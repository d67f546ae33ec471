"""The built-in trainer's maths equals upstream verl 0.9.1's, checked by calling verl's own
functions on the same random float32 tensors (ragged response masks, a masked hole inside a
response, a response with no tokens) and asserting equality to 1e-6.

The loss aggregation is compared where it matters for training: a whole mini-batch split over
two simulated data-parallel ranks and into micro-batches. verl's FSDP engine gives every
micro-batch the mini-batch's global token count (``batch_num_tokens``, all-reduced over the
data-parallel ranks), ``global_batch_size`` = ppo_mini_batch_size x rollout.n and ``dp_size``,
and DDP/FSDP average the ranks' gradients; so the mini-batch's gradient-equivalent loss is the
sum of verl's micro-batch losses over ranks and micro-batches divided by ``dp_size``. Ours is the
sum of our micro-batch losses over our denominators (``algorithms.loss_denominator``, as
``roles.base.TrainableRole._updates`` computes them). Every value of the config keys this covers is
taken from ``hpc_verl.trainer.config.schema``, so a value we accept is a value tested here.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
C = pytest.importorskip("verl.trainer.ppo.core_algos",
                        reason="upstream verl is not importable (pip install --no-deps verl==0.9.1)")

import verl.utils.torch_functional as VF  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

from hpc_verl.trainer import core_algos as A  # noqa: E402
from hpc_verl.trainer.config import schema as cfgmod  # noqa: E402

TOL = {"atol": 1e-6, "rtol": 1e-6}
pytestmark = pytest.mark.filterwarnings("ignore:.*engine is not available:UserWarning",
                                        "ignore:`warmup_style` is deprecated:DeprecationWarning")
DP, MICRO = 2, 2   # simulated data-parallel ranks; rows per micro-batch


def close(got, want) -> None:
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float32),
                               torch.as_tensor(want, dtype=torch.float32), **TOL)


def make_mask(rows: int = 8, width: int = 7, seed: int = 0) -> torch.Tensor:
    """Ragged responses: row 0 full, row 3 empty, row 5 with a masked hole (an observation token)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    lengths[0], lengths[3] = width, 0
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    mask[5, :] = 1.0
    mask[5, 2] = 0.0
    return mask


def randn(shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# ---- advantages ------------------------------------------------------------------------------

@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae(gamma, lam):
    mask = make_mask()
    rewards, values = randn(mask.shape, 1) * mask, randn(mask.shape, 2)
    adv, ret = A.compute_gae(rewards, values, mask, gamma, lam)
    v_adv, v_ret = C.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    kept = mask.bool()
    close(adv[kept], v_adv[kept])
    close(ret[kept], v_ret[kept])
    # masked-out positions: ours are 0, verl's carry the next kept token's values (no loss reads them)
    assert not adv[~kept].any() and not ret[~kept].any()


GROUPS = np.array(["a", "a", "a", "b", "b", "b", "b", "c"], dtype=object)   # "c": a group of one


@pytest.mark.parametrize("norm", [True, False])
def test_grpo(norm):
    mask = make_mask()
    rewards = randn(mask.shape, 3) * mask   # what the trainer builds: nothing outside the mask
    ours = A.outcome_advantages("grpo", rewards, mask, list(GROUPS), norm_adv_by_std_in_grpo=norm)
    theirs, _ = C.compute_grpo_outcome_advantage(rewards, mask, GROUPS, norm_adv_by_std_in_grpo=norm)
    close(ours, theirs)


@pytest.mark.parametrize("name", [e for e in cfgmod.ADV_ESTIMATORS if e not in ("gae", "grpo")])
def test_other_outcome_estimators(name):
    mask = make_mask()
    rewards = randn(mask.shape, 4) * mask
    fn = C.get_adv_estimator_fn(name)
    theirs, _ = fn(token_level_rewards=rewards, response_mask=mask, index=GROUPS, config=AlgoConfig(gamma=0.95))
    ours = A.outcome_advantages(name, rewards, mask, list(GROUPS), gamma=0.95)
    close(ours, theirs)


# ---- per-token terms -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", cfgmod.KL_ESTIMATORS)
def test_kl_penalty_value_and_gradient(kind):
    mask = make_mask()
    lp = randn(mask.shape, 5, 2.0).requires_grad_()
    ref = randn(mask.shape, 6, 2.0)
    with torch.no_grad():
        lp[1, :2] = torch.tensor([30.0, -30.0])   # past the k3 estimator's clamps
    ours = A.kl_penalty(lp, ref, kind)
    theirs = C.kl_penalty(lp, ref, kind)
    close(ours.detach(), theirs.detach())
    g_ours, = torch.autograd.grad((ours * mask).sum(), lp)
    g_theirs, = torch.autograd.grad((theirs * mask).sum(), lp)
    close(g_ours, g_theirs)


def test_entropy_from_logits():
    logits = randn((4, 5, 33), 7, 3.0)
    close(A.entropy_from_logits(logits), VF.entropy_from_logits(logits))


CLIPS = [(0.2, 0.2, 3.0), (0.1, 0.3, 3.0), (0.2, 0.28, 1.5)]   # (low, high, dual-clip c)


def _policy_inputs(mask: torch.Tensor):
    old = randn(mask.shape, 8) - 2.0
    new = old + randn(mask.shape, 9, 0.6)   # ratios well outside the clip range
    new[2, 0] = old[2, 0] + 25.0            # past the log-ratio clamp
    adv = randn(mask.shape, 10, 2.0)
    return old, new, adv


def _verl_actor_config(low: float, high: float, c: float, mode: str, lsf: float | None = None) -> ActorConfig:
    return ActorConfig(strategy="fsdp", clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c,
                       loss_agg_mode=mode, loss_scale_factor=lsf, ppo_mini_batch_size=4,
                       ppo_micro_batch_size_per_gpu=MICRO, rollout_n=2)


@pytest.mark.parametrize("low,high,c", CLIPS)
def test_policy_loss_outputs(low, high, c):
    """One batch, verl's vanilla PPO loss and its three statistics (token-mean)."""
    mask = make_mask()
    old, new, adv = _policy_inputs(mask)
    out = A.policy_loss(old, new, adv, mask, low, high, c, "token-mean")
    cfg = _verl_actor_config(low, high, c, "token-mean")
    loss, stats = C.compute_policy_loss_vanilla(old, new, adv, mask.bool(), "token-mean", cfg)
    close(out.loss, loss)
    close(out.clipfrac, stats["actor/pg_clipfrac"])
    close(out.approx_kl, stats["actor/ppo_kl"])
    close(out.clipfrac_lower, stats["actor/pg_clipfrac_lower"])
    assert float(out.clipfrac) > 0 and float(out.clipfrac_lower) > 0   # both clips are exercised


def test_value_loss_outputs():
    mask = make_mask()
    v, old, ret = randn(mask.shape, 11), randn(mask.shape, 12), randn(mask.shape, 13)
    loss, frac = A.value_loss(v, old, ret, mask, 0.5)
    v_loss, v_frac = C.compute_value_loss(v, ret, old, mask.bool(), 0.5, "token-mean")
    close(loss, v_loss)
    close(frac, v_frac)
    assert 0 < float(frac) < 1


# ---- a mini-batch over ranks and micro-batches, every loss_agg_mode ---------------------------

def _parts(rows: int):
    """(rank, micro-batch) row slices as the engine splits a mini-batch: contiguous per rank."""
    per_rank = rows // DP
    for r in range(DP):
        for a in range(0, per_rank, MICRO):
            yield slice(r * per_rank + a, r * per_rank + a + MICRO)


def _verl_batch_info(mask: torch.Tensor, lsf: float | None) -> dict:
    """What verl's FSDP engine and losses.py hand agg_loss for every micro-batch of this mini-batch."""
    return {"dp_size": DP, "batch_num_tokens": int(mask.sum().item()), "global_batch_size": mask.shape[0],
            "loss_scale_factor": lsf}


MODE_CASES = [(m, None) for m in cfgmod.LOSS_AGG_MODES] + [("seq-mean-token-sum-norm", 5)]


@pytest.mark.parametrize("mode,lsf", MODE_CASES)
@pytest.mark.parametrize("kl_type", ["low_var_kl", "k3+"])
def test_actor_loss_over_a_mini_batch(mode, lsf, kl_type):
    """pg loss - entropy_coeff x entropy + kl_loss_coef x KL loss, as verl's losses.ppo_loss builds it
    from its parts, over 2 ranks x 2 micro-batches: the loss, its gradient and the pg loss."""
    mask = make_mask()
    old, new, adv = _policy_inputs(mask)
    ent, ref = randn(mask.shape, 14).abs(), new + randn(mask.shape, 15, 0.3)
    new = new.clone().requires_grad_()
    low, high, c = CLIPS[2]
    ent_coef, kl_coef = 0.01, 0.1
    denom = A.loss_denominator(mask, mode, lsf)
    vcfg = _verl_actor_config(low, high, c, mode, lsf)
    vcfg.global_batch_info.update(_verl_batch_info(mask, lsf))
    ours = theirs = pg_ours = pg_theirs = 0.0
    for sl in _parts(mask.shape[0]):
        m = mask[sl]
        pl = A.policy_loss(old[sl], new[sl], adv[sl], m, low, high, c, mode, denom=denom)
        ours = ours + pl.loss - ent_coef * A.agg_loss(ent[sl], m, mode, denom) \
            + kl_coef * A.agg_loss(A.kl_penalty(new[sl], ref[sl], kl_type), m, mode, denom)
        pg_ours = pg_ours + pl.loss
        pg, _ = C.compute_policy_loss_vanilla(old[sl], new[sl], adv[sl], m.bool(), mode, vcfg)
        entropy = C.agg_loss(ent[sl], m.bool(), mode, **vcfg.global_batch_info)
        kl = C.agg_loss(C.kl_penalty(new[sl], ref[sl], kl_type), m.bool(), mode, **vcfg.global_batch_info)
        theirs = theirs + pg - ent_coef * entropy + kl * kl_coef
        pg_theirs = pg_theirs + pg
    theirs, pg_theirs = theirs / DP, pg_theirs / DP   # DDP/FSDP average the ranks' gradients
    close(ours.detach(), theirs.detach())
    close(pg_ours.detach(), pg_theirs.detach())
    g_ours, = torch.autograd.grad(ours, new)
    g_theirs, = torch.autograd.grad(theirs, new)
    close(g_ours, g_theirs)


@pytest.mark.parametrize("mode,lsf", MODE_CASES)
def test_value_loss_over_a_mini_batch(mode, lsf):
    mask = make_mask()
    v, old, ret = randn(mask.shape, 16).requires_grad_(), randn(mask.shape, 17), randn(mask.shape, 18)
    denom = A.loss_denominator(mask, mode, lsf)
    info = _verl_batch_info(mask, lsf)
    ours = theirs = 0.0
    for sl in _parts(mask.shape[0]):
        ours = ours + A.value_loss(v[sl], old[sl], ret[sl], mask[sl], 0.5, mode, denom=denom)[0]
        theirs = theirs + C.compute_value_loss(v[sl], ret[sl], old[sl], mask[sl].bool(), 0.5, mode, **info)[0]
    theirs = theirs / DP
    close(ours.detach(), theirs.detach())
    close(torch.autograd.grad(ours, v)[0], torch.autograd.grad(theirs, v)[0])


def test_one_part_is_the_whole_mini_batch():
    """Without a denominator our agg_loss takes its tensor as the whole mini-batch: verl's with
    the global figures of that one batch (dp_size 1)."""
    mask = make_mask()
    loss = randn(mask.shape, 19)
    for mode, lsf in MODE_CASES:
        info = _verl_batch_info(mask, lsf) | {"dp_size": 1}
        close(A.agg_loss(loss, mask, mode, loss_scale_factor=lsf), C.agg_loss(loss, mask.bool(), mode, **info))


# ---- KL in the reward and its controllers -----------------------------------------------------

@pytest.mark.parametrize("ctrl", [{"type": "fixed", "kl_coef": 0.05, "target_kl": 0.1, "horizon": 1000},
                                  {"type": "adaptive", "kl_coef": 0.05, "target_kl": 0.1, "horizon": 1000}])
def test_kl_controllers_and_reward_penalty(ctrl):
    """Six steps of KL in the reward, each with another estimator. verl's side is its
    ``ray_trainer.apply_kl_penalty`` step by step (that module imports Ray): verl's estimator on the
    masked tokens, rewards = scores - beta x KL, the batch KL = the mean of each sequence's masked
    mean, then the controller's update with n_steps = the batch size."""
    ours, theirs = A.make_kl_controller(ctrl), C.get_kl_controller(SimpleNamespace(**ctrl))
    mask = make_mask()
    for step in range(6):
        scores = randn(mask.shape, 20 + step) * mask
        lp, ref = randn(mask.shape, 30 + step, 0.5 + step), randn(mask.shape, 40 + step)
        kind = cfgmod.KL_ESTIMATORS[step % len(cfgmod.KL_ESTIMATORS)]
        rewards, kl = A.apply_kl_penalty(scores, lp, ref, mask, ours, kind)
        kld = C.kl_penalty(lp, ref, kind) * mask
        want_rewards = scores - theirs.value * kld
        want_kl = torch.mean(VF.masked_mean(kld, mask=mask, axis=-1), dim=0).item()
        theirs.update(current_kl=want_kl, n_steps=mask.shape[0])
        close(rewards, want_rewards)
        assert kl == pytest.approx(want_kl, rel=1e-6, abs=1e-7)
        assert ours.value == pytest.approx(float(theirs.value), rel=1e-12)
    if ctrl["type"] == "adaptive":
        assert ours.value != ctrl["kl_coef"]   # it moved


# ---- learning-rate schedule -------------------------------------------------------------------

LR_CASES = [
    [],                                                                       # constant, no warm-up
    ["lr_warmup_steps=5"],
    ["lr_warmup_steps=0", "lr_warmup_steps_ratio=0.2"],                      # <= 0: the ratio
    ["lr_warmup_steps=-1", "lr_warmup_steps_ratio=0.1"],
    ["lr_scheduler_type=cosine"],
    ["lr_scheduler_type=cosine", "lr_warmup_steps=3", "min_lr_ratio=0.1"],
    ["lr_scheduler_type=cosine", "lr_warmup_steps_ratio=0.25", "num_cycles=1.5", "zero_indexed_step=false"],
    ["warmup_style=cosine", "lr_warmup_steps=4"],                            # verl's deprecated name
]


@pytest.mark.parametrize("role", ["actor_rollout_ref.actor", "critic"])
@pytest.mark.parametrize("keys", LR_CASES, ids=lambda k: ",".join(k) or "defaults")
def test_lr_schedule(role, keys):
    """Our role's optim keys through our config, then verl's FSDP engine builds its scheduler from
    the same keys (its FSDPOptimizerConfig takes ours as they are): the multipliers of 20 steps."""
    from verl.workers.config import FSDPOptimizerConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    total = 20
    cfg = cfgmod.load_config(None, [f"{role}.optim.{k}" for k in keys]).to_dict()
    optim = cfg["critic"]["optim"] if role == "critic" else cfg["actor_rollout_ref"]["actor"]["optim"]
    param = torch.nn.Parameter(torch.zeros(1))
    opts = torch.optim.SGD([param], lr=1.0), torch.optim.SGD([param], lr=1.0)
    ours = torch.optim.lr_scheduler.LambdaLR(opts[0], A.lr_lambda(optim, total))
    engine = SimpleNamespace(optimizer_config=FSDPOptimizerConfig(**optim, total_training_steps=total), rank=1)
    theirs = FSDPEngine._build_lr_scheduler(engine, opts[1])
    got, want = [], []
    for _ in range(total):
        got.append(ours.get_last_lr()[0])
        want.append(theirs.get_last_lr()[0])
        for opt, sched in zip(opts, (ours, theirs)):
            opt.step()   # (no gradient: a no-op, in the order torch expects)
            sched.step()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    if keys:
        assert min(got) < 1.0   # the case schedules something


def test_critic_defaults_follow_the_actor_as_in_verl():
    """verl's critic.yaml takes shuffle, loss_agg_mode and loss_scale_factor from the actor."""
    cfg = cfgmod.load_config(None, ["actor_rollout_ref.actor.shuffle=true",
                                    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
                                    "actor_rollout_ref.actor.loss_scale_factor=64"])
    assert (cfg.critic.shuffle, cfg.critic.loss_agg_mode, cfg.critic.loss_scale_factor) == (
        True, "seq-mean-token-sum-norm", 64)
    assert math.isclose(A.loss_denominator(torch.ones(4, 8), "seq-mean-token-sum-norm", 64), 4 * 64)
