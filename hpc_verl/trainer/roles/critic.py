"""The critic role: values and the clipped value update (rank processes)."""
from __future__ import annotations

from typing import Any

from hpc_verl.trainer import core_algos as A
from hpc_verl.trainer.engine import ulysses
from hpc_verl.trainer.engine.device import cpu_linears, pick_device, setup_threads, torch_mod
from hpc_verl.trainer.engine.parallel import Parallel
from hpc_verl.trainer.roles.base import TrainableRole
from hpc_verl.trainer.roles.minibatch import update_generator


class CriticWorker(TrainableRole):
    """A value model (the LM backbone with a scalar head) and its clipped value-loss update."""

    def __init__(self, cfg: dict, total_steps: int = 0) -> None:
        torch = torch_mod()
        from transformers import AutoModelForTokenClassification
        setup_threads(cfg)
        torch.manual_seed(int(cfg["trainer"]["seed"]) + 1)
        self.cfg = cfg
        self.ccfg = cfg["critic"]
        self.device = pick_device(cfg)
        self.par = Parallel.current(self.device)
        # classifier_dropout=0: the value head's default dropout (0.1) would make every value forward
        # random in training mode (verl zeroes it too)
        from transformers import AutoConfig
        trust = cfg["actor_rollout_ref"]["model"]["trust_remote_code"]
        path = self.ccfg["model"]["path"]
        mcfg = AutoConfig.from_pretrained(path, num_labels=1, local_files_only=True, trust_remote_code=trust)
        mcfg.classifier_dropout = 0.0
        module = AutoModelForTokenClassification.from_pretrained(path, config=mcfg, local_files_only=True,
                                                                 trust_remote_code=trust).to(self.device)
        cpu_linears(cfg, module)
        self._init_sp(module, self.ccfg["fsdp"]["ulysses_sequence_parallel_size"])
        self._init_training(module, self.ccfg["strategy"], self.ccfg["fsdp"], self.ccfg["optim"], total_steps)
        self.n = int(cfg["actor_rollout_ref"]["rollout"]["n"])
        self.seed = int(cfg["trainer"]["seed"]) + 211

    def _values(self, batch: dict) -> Any:
        dev = self.device
        view = self.view()
        ids, attn, pos = (batch[k].to(dev) for k in ("input_ids", "attention_mask", "position_ids"))
        if view.sp > 1:
            out, sb = ulysses.forward(self.model, ids, attn, pos, view.sp_group)
            logits = sb.gather(out.logits)
        else:
            logits = self.model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
        rlen = batch["responses"].shape[1]
        return logits[:, -rlen - 1:-1, 0].float() * batch["response_mask"].to(dev)

    def compute_values(self, batch: dict) -> tuple[dict, int]:
        values, rows = self._forward_rows(batch, self.ccfg["ppo_micro_batch_size_per_gpu"], self._values, self.model)
        return {"values": values}, rows

    def update_critic(self, batch: dict, step: int = 0) -> dict:
        """PPO epochs of the value loss; ``critic.shuffle`` reorders the rows each epoch (the same
        order on every rank, from the seed and ``step``)."""
        c = self.ccfg
        dev = self.device
        torch = torch_mod()
        gen = update_generator(self.seed, step)

        def loss_fn(m: dict, denom: float, token_denom: float) -> tuple[Any, list[Any]]:
            mask = m["response_mask"].to(dev)
            loss, frac = A.value_loss(self._values(m), m["values"].to(dev), m["returns"].to(dev), mask,
                                      c["cliprange_value"], c["loss_agg_mode"], denom=denom, token_denom=token_denom)
            return loss, [loss.item(), frac.item()]

        return self._updates(batch, c["ppo_mini_batch_size"] * self.n, c["ppo_micro_batch_size_per_gpu"],
                             c["ppo_epochs"], c["shuffle"], gen, c["grad_clip"], c["loss_agg_mode"],
                             c["loss_scale_factor"], loss_fn, ["vf_loss", "vf_clipfrac"], "critic")
