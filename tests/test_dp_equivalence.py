"""Data parallelism is proven by equivalence: one PPO update of the actor and of the critic at
W=2 ranks (a real torch.distributed group over gloo, two Ray actors) gives the same weights as
W=1 on the same batch, to 1e-5, for DDP and for FSDP2 (``fully_shard``, which runs on CPU
here). The batch has two mini-batches, two PPO epochs with shuffling and micro-batches of one
row (gradient accumulation), and responses of different lengths (the loss is normalised by the
mini-batch's global token count). A grouped batch (GRPO: each prompt twice, in order, micro-batches
of two) has both sides run each group's prompt once (prompt sharing, under DDP as under FSDP2).
Four ranks as two data-parallel replicas of two Ulysses ranks each (dp=2 x sp=2) equal W=1 too.

One worker group per world size serves every case (its ranks and their torch.distributed group are
started once): each case builds fresh actor and critic workers in them from the case's config, seeded
as in a run, so no case sees another's weights or optimiser state.
"""
from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")
ray = pytest.importorskip("ray")

from trainer_fixtures import tiny_model  # noqa: E402,F401

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOL = 1e-5


class Roles:
    """An actor and a critic worker in one rank of a worker group (the hybrid layout)."""

    def configure(self, cfg: dict) -> None:
        """Fresh workers for one case (the rank and its process group stay)."""
        from hpc_verl.trainer.roles.actor import ActorWorker
        from hpc_verl.trainer.roles.critic import CriticWorker
        self.cfg = cfg
        self.actor = self.critic = None     # the previous case's models and optimisers go first
        self.actor = ActorWorker(cfg, total_steps=4)
        self.critic = CriticWorker(cfg, total_steps=4)

    def process(self, item):
        return item

    def update(self, batch: dict, own_rows: bool = False) -> dict:
        held = None
        actor_batch = dict(batch)
        if own_rows:   # the actor gets only the rows it trains on (what take_rows fetches in a run)
            from hpc_verl.dataflow import current_context
            from hpc_verl.trainer.roles.minibatch import actor_rows
            ctx = current_context()
            n = batch["responses"].shape[0]
            rows = actor_rows(self.cfg, n, ctx.rank, ctx.world_size, {"step": 1})
            assert len(rows) < n or ctx.world_size == 1
            actor_batch = {k: v[rows] if hasattr(v, "shape") and v.dim() and v.shape[0] == n else v
                           for k, v in batch.items()}
            held = (rows, batch["response_mask"])
        a = self.actor.update_policy(actor_batch, step=1, held=held)
        c = self.critic.update_critic(dict(batch))
        lp, _ = self.actor.compute_log_prob(dict(batch))
        out = {k: v for k, v in {**a, **c}.items() if k != "counts"}
        out["old_log_prob_after"] = lp["old_log_prob"]
        out["share_prompts"] = self.actor.share_prompts
        out["counts"] = (a["counts"], c["counts"])
        return out

    def weights(self) -> dict:
        return {"actor": {n: t.clone() for n, t in self.actor.export_tensors()},
                "critic": {n: t.clone() for n, t in self.critic.export_tensors()}}


def _batch(vocab: int, grouped: bool = False) -> dict:
    g = torch.Generator().manual_seed(7)
    n, plen, rlen = 8, 5, 4
    ids = torch.randint(8, vocab, (n, plen + rlen), generator=g)
    attn = torch.ones(n, plen + rlen, dtype=torch.long)
    attn[::3, :2] = 0                      # some left padding
    if grouped:                            # GRPO groups of two: each prompt twice, one after the other
        ids[1::2, :plen] = ids[0::2, :plen]
        attn[1::2, :plen] = attn[0::2, :plen]
    resp_mask = torch.ones(n, rlen)
    resp_mask[1, 2:] = 0                   # responses of different lengths
    resp_mask[4, 1:] = 0
    resp_mask[6, 3:] = 0
    attn[:, plen:] = resp_mask.long()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "responses": ids[:, plen:],
            "response_mask": resp_mask,
            "old_log_prob": -(torch.rand(n, rlen, generator=g) * 2 + 0.5) * resp_mask,
            "advantages": torch.randn(n, rlen, generator=g) * resp_mask,
            "values": torch.randn(n, rlen, generator=g) * resp_mask,
            "returns": torch.randn(n, rlen, generator=g) * resp_mask}


def _run(groups, model_path: str, world: int, strategy: str, batch: dict, sp: int = 1,
         grouped: bool = False, own_rows: bool = False) -> tuple[dict, dict]:
    from hpc_verl.trainer.config.schema import load_config

    cfg = load_config(None, [f"actor_rollout_ref.model.path={model_path}", "trainer.device=cpu",
                             f"trainer.n_gpus_per_node={world}", "data.train_batch_size=4",
                             "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                             f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={2 if grouped else 1}",
                             f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={2 if grouped else 1}",
                             "actor_rollout_ref.actor.ppo_epochs=2",
                             f"actor_rollout_ref.actor.shuffle={'false' if grouped else 'true'}",
                             "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.entropy_coeff=0.01",
                             "critic.ppo_micro_batch_size_per_gpu=1", "critic.optim.lr=1e-3",
                             f"actor_rollout_ref.actor.strategy={strategy}", f"critic.strategy={strategy}",
                             "algorithm.adv_estimator=gae",
                             f"actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size={sp}",
                             f"critic.fsdp.ulysses_sequence_parallel_size={sp}"]).to_dict()
    sched = groups(world)
    sched.call_all("roles", "configure", cfg)
    out = sched.call_all("roles", "update", batch, own_rows=own_rows)
    weights = sched.call_all("roles", "weights")
    status = sched.get_status()
    assert [w["rank"] for w in status["nodes"]["roles"]["workers"]] == list(range(world))
    assert status["nodes"]["roles"]["dist_backend"] == "gloo"
    # every rank gathered the same full weights
    for other in weights[1:]:
        for role in ("actor", "critic"):
            assert all(torch.equal(other[role][k], weights[0][role][k]) for k in weights[0][role])
    return out[0], weights[0]


@pytest.fixture(scope="module")
def cluster():
    from hpc_verl.testbed.simcluster import start_sim_cluster, stop_sim_cluster
    c = start_sim_cluster([(7, 0)])   # (logical CPUs: groups of one, two and four ranks of one CPU each)
    try:
        yield c
    finally:
        stop_sim_cluster(c)


@pytest.fixture(scope="module")
def groups(cluster):
    """``groups(W)``: the module's worker group of W ranks (a real gloo group), started on first use."""
    from hpc_verl.dataflow import DataflowGraph, HybridScheduler, Node, WorkerGroup

    started: dict[int, HybridScheduler] = {}

    def get(world: int) -> HybridScheduler:
        if world not in started:
            graph = DataflowGraph(f"dp-{world}")
            graph.add(Node("roles", Roles, group=WorkerGroup("g", world, {"CPU": 1}, timeout_s=60)))
            started[world] = HybridScheduler(graph, backpressure=False).start()
        return started[world]

    try:
        yield get
    finally:
        for sched in started.values():
            sched.shutdown()


@pytest.mark.parametrize("strategy,sp,grouped,world,own_rows", [
    ("ddp", 1, False, 2, False), ("fsdp2", 1, False, 2, False), ("ddp", 2, False, 2, False),
    ("fsdp2", 2, False, 2, False), ("ddp", 1, True, 2, False), ("fsdp2", 1, True, 2, False),
    ("ddp", 2, False, 4, False), ("fsdp2", 2, False, 4, False), ("ddp", 1, False, 2, True),
    ("fsdp2", 1, True, 2, True)],
    ids=["ddp", "fsdp2", "ddp-ulysses2", "fsdp2-ulysses2", "ddp-shared-prompts", "fsdp2-shared-prompts",
         "ddp-dp2xsp2", "fsdp2-dp2xsp2", "ddp-own-rows", "fsdp2-shared-prompts-own-rows"])
def test_two_ranks_update_like_one(groups, tiny_model, strategy, sp, grouped, world, own_rows):
    """W=2 as two data-parallel ranks, or (ulysses2) as one data-parallel rank whose two ranks
    split every sequence (Ulysses SP=2, all-to-all attention), or (dp2xsp2) four ranks: two
    data-parallel replicas of two sequence-parallel ranks each - against W=1. With own-rows each
    actor rank holds only the rows it trains on (``actor_rows``: two shuffled epochs, or in
    order), as ``take_rows`` fetches them in a run."""
    import json
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    batch = _batch(vocab, grouped)
    m1, w1 = _run(groups, str(tiny_model), 1, strategy, batch, grouped=grouped)
    m2, w2 = _run(groups, str(tiny_model), world, strategy, batch, sp=sp, grouped=grouped, own_rows=own_rows)
    assert m2["actor/ulysses_sp"] == m2["critic/ulysses_sp"] == sp
    assert m1["share_prompts"] is True and m2["share_prompts"] is (sp == 1)   # (Ulysses splits sequences)
    phases = [f"timing_s/update_actor/{p}" for p in ("forward", "backward", "allreduce", "optimizer")]
    assert all(m2[k] >= m2[k + "_min"] >= 0 for k in phases) and m2["perf/rank_imbalance"] >= 1.0
    assert m1["timing_s/update_actor/allreduce"] == 0 and m2["timing_s/update_actor/backward"] > 0
    moved = 0.0
    for role in ("actor", "critic"):
        for name, t1 in w1[role].items():
            diff = float((t1 - w2[role][name]).abs().max())
            assert diff < TOL, f"{strategy} {role}.{name}: W={world} (sp={sp}) differs from W=1 by {diff:g}"
    from transformers import AutoModelForCausalLM
    init = dict(AutoModelForCausalLM.from_pretrained(str(tiny_model)).named_parameters())
    moved = max(float((w1["actor"][n] - init[n].detach()).abs().max()) for n in init)
    assert moved > 1e-4, "the update did not change the actor; the comparison would prove nothing"
    for key in ("actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac", "actor/grad_norm",
                "critic/vf_loss", "critic/grad_norm"):
        assert m1[key] == pytest.approx(m2[key], abs=TOL, rel=TOL), key
    mask = batch["response_mask"]   # (padded positions carry no meaning: the losses mask them)
    assert torch.allclose(m1["old_log_prob_after"] * mask, m2["old_log_prob_after"] * mask, atol=TOL)
    # the same work at either size: 2 epochs x 8 rows forward+backward, 2 epochs x 2 optimizer steps
    assert m1["counts"] == m2["counts"] == ({"fwd_rows": 16, "bwd_rows": 16, "optim_steps": 4},) * 2
