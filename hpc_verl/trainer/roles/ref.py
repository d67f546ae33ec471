"""The reference policy role: log-probs under the frozen initial model (rank processes)."""
from __future__ import annotations

from typing import Any

from hpc_verl.trainer.engine.logprobs import can_share_prompts
from hpc_verl.trainer.engine.device import cpu_linears, load_causal_lm, pick_device, setup_threads
from hpc_verl.trainer.engine.parallel import Parallel, shard_model, shards
from hpc_verl.trainer.roles.base import SequenceParallelRole, rank_counts


class RefWorker(SequenceParallelRole):
    """A frozen copy of the initial policy, for the KL term: one rank of its group (sharded like
    the actor under FSDP, sequence-parallel like the ref's fsdp_config says)."""

    def __init__(self, cfg: dict) -> None:
        setup_threads(cfg)
        self.cfg = cfg
        mcfg = cfg["actor_rollout_ref"]["model"]
        self.device = pick_device(cfg)
        self.par = Parallel.current(self.device)
        self.model = load_causal_lm(mcfg["path"], self.device, "float32", mcfg["trust_remote_code"])
        cpu_linears(cfg, self.model)
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        fc = cfg["actor_rollout_ref"]["ref"]["fsdp_config"]
        self._init_sp(self.model, fc["ulysses_sequence_parallel_size"])
        if shards(cfg["actor_rollout_ref"]["actor"]["strategy"], self.par):
            shard_model(self.model, self.par, param_offload=bool(fc["param_offload"]),
                        reshard_after_forward=bool(fc["reshard_after_forward"]),
                        mixed_precision=self.device == "cuda")
        self.share_prompts = self.sp_configured == 1 and can_share_prompts(self.model)
        self.temperature = float(cfg["actor_rollout_ref"]["rollout"]["temperature"])

    def _sp_module(self) -> Any:
        return self.model

    def compute_ref_log_prob(self, batch: dict) -> dict:
        """Log-probs of the whole batch: this data-parallel rank's rows, gathered (SPMD)."""
        micro = self.cfg["actor_rollout_ref"]["ref"]["log_prob_micro_batch_size_per_gpu"]
        lp, rows = self._forward_rows(batch, micro, lambda mb: self._log_probs(self.model, mb, self.temperature))
        counts = rank_counts(self.par, rows, 0, 0)
        return {"ref_log_prob": lp, "counts": {"fwd_rows": counts["fwd_rows"]}}
