"""The reward role: rule-based scores, or a reward model's (rank processes)."""
from __future__ import annotations

from hpc_verl.errors import HpcVerlError
from hpc_verl.trainer.engine.logprobs import chunks
from hpc_verl.trainer.engine.device import pick_device, setup_threads, torch_mod
from hpc_verl.trainer.roles.reward_rules import RuleReward


class RewardWorker:
    """Scores responses: rule functions by ``data_source``, or a sequence-classification reward model."""

    def __init__(self, cfg: dict) -> None:
        setup_threads(cfg)
        self.cfg = cfg
        rm = cfg["reward_model"]
        cr = cfg["custom_reward_function"]
        self.rule = RuleReward(cr["path"], cr["name"])
        self.rm_model = None
        if rm["enable"]:
            from transformers import AutoModelForSequenceClassification
            path = rm["model"]["path"]
            if not path:
                raise HpcVerlError("reward_model.enable=true needs reward_model.model.path (a local "
                                   "sequence-classification model directory)")
            self.device = pick_device(cfg)
            self.rm_model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, local_files_only=True).to(self.device).eval()

    def score(self, batch: dict) -> dict:
        torch = torch_mod()
        if self.rm_model is not None:
            micro = self.cfg["reward_model"]["micro_batch_size_per_gpu"]
            outs = []
            with torch.no_grad():
                dev = self.device
                for sl in chunks(batch["input_ids"].shape[0], micro):
                    out = self.rm_model(input_ids=batch["input_ids"][sl].to(dev),
                                        attention_mask=batch["attention_mask"][sl].to(dev),
                                        position_ids=batch["position_ids"][sl].to(dev))
                    outs.append(out.logits[:, 0].float().cpu())
            scores = torch.cat(outs)
        else:
            scores = torch.tensor([self.rule.score(ds, text, gt, ex) for ds, text, gt, ex in zip(
                batch["data_source"], batch["response_text"], batch["ground_truth"], batch["extra_info"])],
                dtype=torch.float32)
        return {"scores": scores}
