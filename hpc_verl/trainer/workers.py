"""The PPO roles as plain classes; the trainer wraps each in a dataflow Node (a Ray actor).

Every role takes and returns a ``dict`` batch (tensors and lists) and adds only
the fields it computes, so little data crosses the graph's edges:

- ``RolloutWorker.generate``: prompts → responses (+ masks, policy version)
- ``RewardWorker.score``: responses → ``scores`` (rule per data_source, or a reward model)
- ``RefWorker.compute_ref_log_prob``: → ``ref_log_prob`` (frozen initial policy)
- ``CriticWorker.compute_values`` / ``update_critic``: → ``values`` / value loss
- ``ActorWorker.compute_log_prob`` / ``update_policy``: → ``old_log_prob`` / policy loss

Weight sync: ``ActorWorker.get_weights()`` → ``RolloutWorker.load_weights(w, version)``;
a generate request carries the version it needs and a stale rollout refuses it.
"""
from __future__ import annotations

import time
from typing import Any, Iterator

from hpc_verl.errors import HpcVerlError
from hpc_verl.trainer import algorithms as A


class StalePolicyError(HpcVerlError):
    """A rollout was asked to generate with a policy version it has not received."""


def _torch():
    import torch
    return torch


def pick_device(cfg: dict) -> str:
    torch = _torch()
    if cfg["trainer"]["device"] == "cuda" and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _setup_threads(cfg: dict) -> None:
    """CPU threads of this role: ``hpc_verl.torch_threads`` if set, else what Ray gave the actor.

    Ray starts actors with OMP_NUM_THREADS=1. More threads help big models on idle
    CPUs, but on a shared small CPU OpenMP oversubscription makes tiny models several
    times slower, so it is opt-in.
    """
    torch = _torch()
    n = cfg.get("hpc_verl", {}).get("torch_threads")
    if n:
        torch.set_num_threads(int(n))


def _load_causal_lm(path: str, device: str, dtype: str = "float32", trust_remote_code: bool = False):
    torch = _torch()
    from transformers import AutoModelForCausalLM
    torch_dtype = getattr(torch, dtype) if device != "cpu" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True,
                                                 trust_remote_code=trust_remote_code)
    return model.to(device)


def _load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _chunks(n: int, size: int | None) -> Iterator[slice]:
    size = n if not size or size <= 0 else size
    for s in range(0, n, size):
        yield slice(s, min(n, s + size))


def _sub(batch: dict, idx: Any) -> dict:
    """Rows ``idx`` (slice or index tensor) of every tensor field of ``batch``."""
    torch = _torch()
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            out[k] = v[idx]
        else:
            out[k] = v
    return out


def response_log_probs(model: Any, batch: dict, temperature: float = 1.0, with_entropy: bool = False):
    """log p(response token) under ``model`` for every response position (and entropy)."""
    dev = next(model.parameters()).device
    ids = batch["input_ids"].to(dev)
    out = model(input_ids=ids, attention_mask=batch["attention_mask"].to(dev),
                position_ids=batch["position_ids"].to(dev), use_cache=False)
    resp_len = batch["responses"].shape[1]
    logits = out.logits[:, -resp_len - 1:-1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = A.log_probs_from_logits(logits, batch["responses"].to(dev))
    ent = A.entropy_from_logits(logits) if with_entropy else None
    del out
    return (logp, ent) if with_entropy else logp


class RolloutWorker:
    """Batched sampling with the transformers model and its KV cache (or vLLM behind the same calls)."""

    def __init__(self, cfg: dict) -> None:
        torch = _torch()
        _setup_threads(cfg)
        self.cfg = cfg
        mcfg, rcfg = cfg["actor_rollout_ref"]["model"], cfg["actor_rollout_ref"]["rollout"]
        self.device = pick_device(cfg)
        self.tokenizer = _load_tokenizer(mcfg["tokenizer_path"] or mcfg["path"], mcfg["trust_remote_code"])
        self.model = _load_causal_lm(mcfg["path"], self.device, rcfg["dtype"], mcfg["trust_remote_code"])
        self.model.eval()
        self.version = 0
        self.gen = torch.Generator(device="cpu")
        self.gen.manual_seed(int(cfg["trainer"]["seed"]) * 7919 + 17)
        self.response_length = int(cfg["data"]["max_response_length"])

    # --- weight sync -------------------------------------------------------------------------
    def load_weights(self, state_dict: dict, version: int) -> int:
        """Install the actor's weights; versions only move forward."""
        if version < self.version:
            raise StalePolicyError(f"rollout has policy version {self.version}, refusing older version {version}")
        self.model.load_state_dict(state_dict, strict=True)
        self.version = int(version)
        return self.version

    def get_version(self) -> int:
        return self.version

    def rng_state(self) -> Any:
        return self.gen.get_state()

    def set_rng_state(self, state: Any) -> None:
        self.gen.set_state(state)

    # --- generation ----------------------------------------------------------------------------
    def generate(self, batch: dict, required_version: int | None = None, greedy: bool = False) -> dict:
        """Sample one response per row of ``batch['prompt_ids']``; returns the padded sequences."""
        torch = _torch()
        if required_version is not None and self.version < required_version:
            raise StalePolicyError(f"rollout has policy version {self.version} but version {required_version} "
                                   "is required (weight sync did not arrive)")
        rcfg = self.cfg["actor_rollout_ref"]["rollout"]
        prompts: list[list[int]] = batch["prompt_ids"]
        pad = self.tokenizer.pad_token_id
        eos = self.tokenizer.eos_token_id
        bsz, plen = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((bsz, plen), pad, dtype=torch.long)
        attn = torch.zeros((bsz, plen), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at column plen-1
            ids[i, plen - len(p):] = torch.tensor(p, dtype=torch.long)
            attn[i, plen - len(p):] = 1
        t0 = time.perf_counter()
        responses, sample_log_prob = self._sample(ids, attn, eos, pad, greedy=greedy or not rcfg["do_sample"])
        gen_s = time.perf_counter() - t0
        # response mask: tokens up to and including the first EOS
        is_eos = responses == eos
        after_eos = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
        resp_mask = (after_eos == 0).long()
        full_ids = torch.cat([ids, responses], dim=1)
        full_attn = torch.cat([attn, resp_mask], dim=1)
        position_ids = (torch.cumsum(full_attn, dim=1) - 1).clamp(min=0)
        texts = self.tokenizer.batch_decode([r[m.bool()].tolist() for r, m in zip(responses, resp_mask)],
                                            skip_special_tokens=True)
        out = {"input_ids": full_ids, "attention_mask": full_attn, "position_ids": position_ids,
               "responses": responses, "response_mask": resp_mask.float(), "response_text": texts,
               "policy_version": self.version, "gen_time_s": gen_s,
               "n_response_tokens": int(resp_mask.sum())}
        if sample_log_prob is not None:
            out["rollout_log_prob"] = sample_log_prob * resp_mask
        return out

    def _sample(self, ids: Any, attn: Any, eos: int, pad: int, greedy: bool) -> Any:
        torch = _torch()
        rcfg = self.cfg["actor_rollout_ref"]["rollout"]
        temperature, top_k, top_p = rcfg["temperature"], rcfg["top_k"], rcfg["top_p"]
        dev = self.device
        bsz = ids.shape[0]
        out_tokens = torch.full((bsz, self.response_length), pad, dtype=torch.long)
        # log p(token) under softmax(logits / temperature), before top-k/top-p filtering: the same
        # quantity the actor computes, so it can serve as PPO's old log-prob
        out_logp = torch.zeros((bsz, self.response_length), dtype=torch.float32)
        temp = 1.0 if greedy else max(float(temperature), 1e-6)
        finished = torch.zeros(bsz, dtype=torch.bool)
        attn_d = attn.to(dev)
        pos = (attn_d.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            out = self.model(input_ids=ids.to(dev), attention_mask=attn_d, position_ids=pos, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float()
            last_pos = pos[:, -1:]
            for t in range(self.response_length):
                if greedy:
                    nxt = logits.argmax(-1).cpu()
                else:
                    nxt = _sample_logits(logits.cpu(), temperature, top_k, top_p, self.gen)
                nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
                out_tokens[:, t] = nxt
                out_logp[:, t] = A.log_probs_from_logits(logits.cpu() / temp, nxt)
                finished |= nxt == eos
                if bool(finished.all()) or t == self.response_length - 1:
                    break
                attn_d = torch.cat([attn_d, torch.ones((bsz, 1), dtype=attn_d.dtype, device=dev)], dim=1)
                last_pos = last_pos + 1
                out = self.model(input_ids=nxt[:, None].to(dev), attention_mask=attn_d, position_ids=last_pos,
                                 past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[:, -1, :].float()
        return out_tokens, out_logp


def _sample_logits(logits: Any, temperature: float, top_k: int, top_p: float, gen: Any) -> Any:
    torch = _torch()
    logits = logits / max(temperature, 1e-6)
    if top_k and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, -1)
        drop = probs.cumsum(-1) - probs > top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, -1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


class VLLMRolloutWorker(RolloutWorker):
    """``rollout.name=vllm``: the same interface, generation by a vLLM engine on the role's GPUs."""

    def __init__(self, cfg: dict) -> None:  # pragma: no cover - needs GPUs and vLLM
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise HpcVerlError("actor_rollout_ref.rollout.name=vllm but vLLM is not installed here; install the "
                               "'vllm' extra on GPU nodes or use actor_rollout_ref.rollout.name=hf") from None
        torch = _torch()
        if not torch.cuda.is_available():
            raise HpcVerlError("actor_rollout_ref.rollout.name=vllm needs GPUs; none are visible to the rollout "
                               "worker (use rollout.name=hf on CPU)")
        from vllm import LLM
        self.cfg = cfg
        mcfg, rcfg = cfg["actor_rollout_ref"]["model"], cfg["actor_rollout_ref"]["rollout"]
        self.tokenizer = _load_tokenizer(mcfg["tokenizer_path"] or mcfg["path"], mcfg["trust_remote_code"])
        self.llm = LLM(model=mcfg["path"], tensor_parallel_size=rcfg["tensor_model_parallel_size"],
                       gpu_memory_utilization=rcfg["gpu_memory_utilization"], dtype=rcfg["dtype"],
                       enforce_eager=rcfg["enforce_eager"], seed=int(cfg["trainer"]["seed"]),
                       max_num_seqs=rcfg["max_num_seqs"], trust_remote_code=mcfg["trust_remote_code"])
        self.version = 0
        self.device = "cuda"
        self.response_length = int(cfg["data"]["max_response_length"])
        self.gen = torch.Generator(device="cpu")

    def load_weights(self, state_dict: dict, version: int) -> int:  # pragma: no cover
        if version < self.version:
            raise StalePolicyError(f"rollout has policy version {self.version}, refusing older version {version}")
        engine_model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        engine_model.load_weights(state_dict.items())
        self.version = int(version)
        return self.version

    def _sample(self, ids: Any, attn: Any, eos: int, pad: int, greedy: bool) -> Any:  # pragma: no cover
        torch = _torch()
        from vllm import SamplingParams
        rcfg = self.cfg["actor_rollout_ref"]["rollout"]
        params = SamplingParams(temperature=0.0 if greedy else rcfg["temperature"],
                                top_k=rcfg["top_k"], top_p=rcfg["top_p"], max_tokens=self.response_length)
        prompts = [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(ids, attn)]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        tokens = torch.full((len(prompts), self.response_length), pad, dtype=torch.long)
        for i, o in enumerate(outs):
            toks = list(o.outputs[0].token_ids)[: self.response_length]
            tokens[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        return tokens, None


def make_rollout_worker(cfg: dict) -> RolloutWorker:
    if cfg["actor_rollout_ref"]["rollout"]["name"] == "vllm":
        return VLLMRolloutWorker(cfg)
    return RolloutWorker(cfg)


class _TrainableWorker:
    """Shared optimiser / scheduler / checkpoint plumbing of the actor and the critic."""

    model: Any
    optimizer: Any
    scheduler: Any

    def _make_optimizer(self, optim_cfg: dict, total_steps: int) -> None:
        torch = _torch()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim_cfg["lr"],
                                           betas=tuple(optim_cfg["betas"]), weight_decay=optim_cfg["weight_decay"])
        warmup = optim_cfg["lr_warmup_steps"]
        if warmup is None or warmup < 0:
            warmup = int(optim_cfg["lr_warmup_steps_ratio"] * max(total_steps, 0))
        warmup = max(int(warmup), 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0)

    def state_dict(self) -> dict:
        return {"model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "rng": _torch().get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if "rng" in state:
            _torch().set_rng_state(state["rng"])

    def _step(self, grad_clip: float) -> tuple[float, bool]:
        torch = _torch()
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=grad_clip if grad_clip > 0 else float("inf"))
        ok = bool(torch.isfinite(norm))
        if ok:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm), ok


def _minibatches(n: int, mini: int, shuffle: bool, gen: Any) -> list[Any]:
    torch = _torch()
    order = torch.randperm(n, generator=gen) if shuffle else torch.arange(n)
    return [order[s:s + mini] for s in range(0, n, mini)]


class ActorWorker(_TrainableWorker):
    """The policy: log-probs of sampled responses and the clipped PPO update."""

    def __init__(self, cfg: dict, total_steps: int = 0) -> None:
        torch = _torch()
        _setup_threads(cfg)
        torch.manual_seed(int(cfg["trainer"]["seed"]))
        self.cfg = cfg
        mcfg = cfg["actor_rollout_ref"]["model"]
        self.acfg = cfg["actor_rollout_ref"]["actor"]
        self.device = pick_device(cfg)
        self.model = _load_causal_lm(mcfg["path"], self.device, "float32", mcfg["trust_remote_code"])
        if mcfg["enable_gradient_checkpointing"]:
            self.model.gradient_checkpointing_enable()
        self._make_optimizer(self.acfg["optim"], total_steps)
        self.version = 0
        self.gen = torch.Generator().manual_seed(int(cfg["trainer"]["seed"]) + 101)
        self.n = int(cfg["actor_rollout_ref"]["rollout"]["n"])
        self.temperature = float(cfg["actor_rollout_ref"]["rollout"]["temperature"])

    def get_weights(self) -> tuple[dict, int]:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}, self.version

    def get_version(self) -> int:
        return self.version

    def compute_log_prob(self, batch: dict) -> dict:
        torch = _torch()
        micro = self.cfg["actor_rollout_ref"]["rollout"]["log_prob_micro_batch_size_per_gpu"]
        self.model.eval()
        outs = []
        with torch.no_grad():
            for sl in _chunks(batch["responses"].shape[0], micro):
                outs.append(response_log_probs(self.model, _sub(batch, sl), self.temperature).cpu())
        return {"old_log_prob": torch.cat(outs)}

    def update_policy(self, batch: dict) -> dict:
        """PPO epochs over mini-batches (one optimiser step each), micro-batches accumulate grads."""
        a = self.acfg
        n_rows = batch["responses"].shape[0]
        mini = min(n_rows, a["ppo_mini_batch_size"] * self.n)
        micro = a["ppo_micro_batch_size_per_gpu"] or mini
        self.model.train()
        stats: dict[str, list[float]] = {}
        use_kl_loss = a["use_kl_loss"] and "ref_log_prob" in batch

        def add(k: str, v: float) -> None:
            stats.setdefault(k, []).append(float(v))

        for _ in range(a["ppo_epochs"]):
            for mb_idx in _minibatches(n_rows, mini, a["shuffle"], self.gen):
                mb = _sub(batch, mb_idx)
                rows = mb["responses"].shape[0]
                for sl in _chunks(rows, micro):
                    m = _sub(mb, sl)
                    mask = m["response_mask"].to(self.device)
                    logp, ent = response_log_probs(self.model, m, self.temperature, with_entropy=True)
                    pl = A.policy_loss(m["old_log_prob"].to(self.device), logp, m["advantages"].to(self.device),
                                       mask, a["clip_ratio_low"], a["clip_ratio_high"], a["clip_ratio_c"],
                                       a["loss_agg_mode"])
                    entropy = A.agg_loss(ent, mask, a["loss_agg_mode"])
                    loss = pl.loss - a["entropy_coeff"] * entropy
                    if use_kl_loss:
                        kl = A.agg_loss(A.kl_penalty(logp, m["ref_log_prob"].to(self.device), a["kl_loss_type"]),
                                        mask, a["loss_agg_mode"])
                        loss = loss + a["kl_loss_coef"] * kl
                        add("actor/kl_loss", kl.item())
                    (loss * (m["responses"].shape[0] / rows)).backward()
                    add("actor/pg_loss", pl.loss.item())
                    add("actor/entropy", entropy.item())
                    add("actor/pg_clipfrac", pl.clipfrac.item())
                    add("actor/ppo_kl", pl.approx_kl.item())
                    add("actor/pg_clipfrac_lower", float(pl.clipfrac_lower))
                norm, ok = self._step(a["grad_clip"])
                add("actor/grad_norm", norm)
                add("actor/skipped_steps", 0.0 if ok else 1.0)
            self.scheduler.step()
        self.version += 1
        out = {k: sum(v) / len(v) for k, v in stats.items()}
        out["actor/skipped_steps"] = sum(stats.get("actor/skipped_steps", [0.0]))
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        out["actor/policy_version"] = self.version
        return out

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["version"] = self.version
        state["gen"] = self.gen.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.version = int(state.get("version", 0))
        if "gen" in state:
            self.gen.set_state(state["gen"])


class RefWorker:
    """A frozen copy of the initial policy, for the KL term."""

    def __init__(self, cfg: dict) -> None:
        _setup_threads(cfg)
        self.cfg = cfg
        mcfg = cfg["actor_rollout_ref"]["model"]
        self.device = pick_device(cfg)
        self.model = _load_causal_lm(mcfg["path"], self.device, "float32", mcfg["trust_remote_code"])
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.temperature = float(cfg["actor_rollout_ref"]["rollout"]["temperature"])

    def compute_ref_log_prob(self, batch: dict) -> dict:
        torch = _torch()
        micro = self.cfg["actor_rollout_ref"]["ref"]["log_prob_micro_batch_size_per_gpu"]
        outs = []
        with torch.no_grad():
            for sl in _chunks(batch["responses"].shape[0], micro):
                outs.append(response_log_probs(self.model, _sub(batch, sl), self.temperature).cpu())
        return {"ref_log_prob": torch.cat(outs)}


class CriticWorker(_TrainableWorker):
    """A value model (the LM backbone with a scalar head) and its clipped value-loss update."""

    def __init__(self, cfg: dict, total_steps: int = 0) -> None:
        torch = _torch()
        from transformers import AutoModelForTokenClassification
        _setup_threads(cfg)
        torch.manual_seed(int(cfg["trainer"]["seed"]) + 1)
        self.cfg = cfg
        self.ccfg = cfg["critic"]
        self.device = pick_device(cfg)
        path = self.ccfg["model"]["path"]
        self.model = AutoModelForTokenClassification.from_pretrained(
            path, num_labels=1, local_files_only=True,
            trust_remote_code=cfg["actor_rollout_ref"]["model"]["trust_remote_code"]).to(self.device)
        self._make_optimizer(self.ccfg["optim"], total_steps)
        self.n = int(cfg["actor_rollout_ref"]["rollout"]["n"])

    def _values(self, batch: dict) -> Any:
        dev = self.device
        out = self.model(input_ids=batch["input_ids"].to(dev), attention_mask=batch["attention_mask"].to(dev),
                         position_ids=batch["position_ids"].to(dev))
        rlen = batch["responses"].shape[1]
        return out.logits[:, -rlen - 1:-1, 0].float() * batch["response_mask"].to(dev)

    def compute_values(self, batch: dict) -> dict:
        torch = _torch()
        self.model.eval()
        micro = self.ccfg["ppo_micro_batch_size_per_gpu"]
        outs = []
        with torch.no_grad():
            for sl in _chunks(batch["responses"].shape[0], micro):
                outs.append(self._values(_sub(batch, sl)).cpu())
        return {"values": torch.cat(outs)}

    def update_critic(self, batch: dict) -> dict:
        c = self.ccfg
        n_rows = batch["responses"].shape[0]
        mini = min(n_rows, c["ppo_mini_batch_size"] * self.n)
        micro = c["ppo_micro_batch_size_per_gpu"] or mini
        self.model.train()
        stats: dict[str, list[float]] = {}
        for _ in range(c["ppo_epochs"]):
            for mb_idx in _minibatches(n_rows, mini, False, None):  # (the critic does not shuffle)
                mb = _sub(batch, mb_idx)
                rows = mb["responses"].shape[0]
                for sl in _chunks(rows, micro):
                    m = _sub(mb, sl)
                    mask = m["response_mask"].to(self.device)
                    v = self._values(m)
                    loss, frac = A.value_loss(v, m["values"].to(self.device), m["returns"].to(self.device), mask,
                                              c["cliprange_value"], c["loss_agg_mode"])
                    (loss * (m["responses"].shape[0] / rows)).backward()
                    stats.setdefault("critic/vf_loss", []).append(loss.item())
                    stats.setdefault("critic/vf_clipfrac", []).append(frac.item())
                norm, _ = self._step(c["grad_clip"])
                stats.setdefault("critic/grad_norm", []).append(norm)
            self.scheduler.step()
        return {k: sum(v) / len(v) for k, v in stats.items()}


class RewardWorker:
    """Scores responses: rule functions by ``data_source``, or a sequence-classification reward model."""

    def __init__(self, cfg: dict) -> None:
        from hpc_verl.trainer.rewards import RuleReward
        _setup_threads(cfg)
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
        torch = _torch()
        if self.rm_model is not None:
            with torch.no_grad():
                dev = self.device
                out = self.rm_model(input_ids=batch["input_ids"].to(dev),
                                    attention_mask=batch["attention_mask"].to(dev),
                                    position_ids=batch["position_ids"].to(dev))
                scores = out.logits[:, 0].float().cpu()
        else:
            scores = torch.tensor([self.rule.score(ds, text, gt, ex) for ds, text, gt, ex in zip(
                batch["data_source"], batch["response_text"], batch["ground_truth"], batch["extra_info"])],
                dtype=torch.float32)
        return {"scores": scores}
