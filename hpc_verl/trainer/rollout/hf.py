"""The rollout role: batched sampling with the transformers model and its KV cache
(or vLLM behind the same calls, on GPUs or its CPU build: ``vllm_rollout``).

A replica generates for its shard of the batch. Its sampling generator is seeded
from (trainer.seed, step, the shard's first row): reproducible for a given layout,
and a resumed run needs no generator state (a different replica count draws
different samples). Weights arrive as ``(name, tensor)``
pairs (``load_tensors``) from the actor's tensor transport, with the version.
"""
from __future__ import annotations

import time
from typing import Any, Iterable

from hpc_verl.errors import HpcVerlError
from hpc_verl.trainer import core_algos as A
from hpc_verl.trainer.rollout import prompt_attention as P
from hpc_verl.trainer.engine.kvcache import expand_rows, preallocated_cache
from hpc_verl.trainer.engine.device import (cpu_linears, load_causal_lm, load_tokenizer, pick_device, setup_threads,
                                            torch_mod)
from hpc_verl.trainer.engine.parallel import load_named


class StalePolicyError(HpcVerlError):
    """A rollout was asked to generate with a policy version it has not received."""


def _left_pad(prompts: list[list[int]], width: int, pad: int) -> tuple[Any, Any]:
    torch = torch_mod()
    bsz = len(prompts)
    ids = torch.full((bsz, width), pad, dtype=torch.long)
    attn = torch.zeros((bsz, width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: every prompt ends at column width-1
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attn[i, width - len(p):] = 1
    return ids, attn


class RolloutWorker:
    """Batched sampling with the transformers model and its KV cache."""

    def __init__(self, cfg: dict) -> None:
        setup_threads(cfg)
        self.cfg = cfg
        mcfg, rcfg = cfg["actor_rollout_ref"]["model"], cfg["actor_rollout_ref"]["rollout"]
        self.device = pick_device(cfg)
        self.tokenizer = load_tokenizer(mcfg["tokenizer_path"] or mcfg["path"], mcfg["trust_remote_code"])
        self.model = load_causal_lm(mcfg["path"], self.device, rcfg["dtype"], mcfg["trust_remote_code"])
        self.model.eval()
        cpu_linears(cfg, self.model)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.version = 0
        self.seed = int(cfg["trainer"]["seed"])
        self.response_length = int(cfg["data"]["max_response_length"])
        import inspect   # the prefill needs the last position's logits only, where the model can say so
        self._last_logits = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(
            self.model.forward).parameters else {}

    # --- weight sync -------------------------------------------------------------------------
    def load_tensors(self, named: Iterable[tuple[str, Any]], version: int) -> int:
        """Install the actor's weights, streamed by name; versions only move forward."""
        if version < self.version:
            raise StalePolicyError(f"rollout has policy version {self.version}, refusing older version {version}")
        load_named(self.model, named)
        self.version = int(version)
        return self.version

    def tensor_dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).replace("torch.", "")

    # --- generation ----------------------------------------------------------------------------
    def generate(self, batch: dict, required_version: int | None = None, greedy: bool = False,
                 first_row: int = 0) -> dict:
        """Sample one response per row of ``batch['prompt_ids']``; returns the padded sequences."""
        torch = torch_mod()
        if required_version is not None and self.version < required_version:
            raise StalePolicyError(f"rollout has policy version {self.version} but version {required_version} "
                                   "is required (weight sync did not arrive)")
        rcfg = self.cfg["actor_rollout_ref"]["rollout"]
        prompts: list[list[int]] = batch["prompt_ids"]
        pad = self.tokenizer.pad_token_id
        eos = self.tokenizer.eos_token_id
        width = int(batch.get("prompt_width") or max((len(p) for p in prompts), default=1))
        ids, attn = _left_pad(prompts, width, pad)
        if not prompts:   # a replica whose shard is empty (fewer prompt groups than replicas)
            return self._empty(width)
        gen = torch.Generator(device="cpu")
        gen.manual_seed((self.seed * 1_000_003 + int(batch.get("step", 0)) * 7919 + first_row) % 2**63)
        t0 = time.perf_counter()
        responses, sample_log_prob = self._sample(ids, attn, eos, pad, gen, greedy=greedy or not rcfg["do_sample"])
        gen_s = time.perf_counter() - t0
        if rcfg["ignore_eos"]:   # every response is max_response_length tokens long
            resp_mask = torch.ones_like(responses)
        else:  # response mask: tokens up to and including the first EOS
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
               "policy_version": self.version, "gen_time_s": [gen_s],
               "n_response_tokens": [int(resp_mask.sum())]}
        if sample_log_prob is not None:
            out["rollout_log_prob"] = sample_log_prob * resp_mask
        return out

    def _empty(self, width: int) -> dict:
        """The outputs of a replica with no rows: the right shapes, nothing in them."""
        torch = torch_mod()
        ids = torch.zeros((0, width + self.response_length), dtype=torch.long)
        resp = torch.zeros((0, self.response_length), dtype=torch.long)
        return {"input_ids": ids, "attention_mask": ids.clone(), "position_ids": ids.clone(), "responses": resp,
                "response_mask": resp.float(), "response_text": [], "policy_version": self.version,
                "gen_time_s": [0.0], "n_response_tokens": [0], "rollout_log_prob": resp.float()}

    def _sample(self, ids: Any, attn: Any, eos: int, pad: int, gen: Any, greedy: bool) -> Any:
        torch = torch_mod()
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
        stop_at_eos = not rcfg["ignore_eos"]
        attn_d = attn.to(dev)
        pos = (attn_d.cumsum(-1) - 1).clamp(min=0)
        # each distinct prompt is prefilled once; its rows (GRPO's group) share the keys/values
        _, owner = torch.unique_consecutive(torch.cat([ids, attn], dim=1), dim=0, return_inverse=True)
        first = torch.nonzero(torch.cat([torch.ones(1, dtype=torch.bool), owner[1:] != owner[:-1]])).squeeze(1)
        owner, first = owner.to(dev), first.to(dev)   # (row -> its prompt; the first row of each prompt)
        sizes = torch.bincount(owner).tolist()
        shared = P.applies(self.model, sizes)
        if shared:   # the prompt part of attention read once per group (prompt_attention)
            P.enable(self.model)
            cache = P.shared_prompt_cache(self.model.config, self.response_length, attn_d[first])
        else:
            cache = preallocated_cache(self.model.config, ids.shape[1] + self.response_length)
        with torch.inference_mode():
            out = self.model(input_ids=ids.to(dev)[first], attention_mask=attn_d[first], position_ids=pos[first],
                             past_key_values=cache, use_cache=True, **self._last_logits)
            logits = out.logits[:, -1, :].float()
            if len(first) < bsz:
                if not shared:
                    expand_rows(cache, owner)
                logits = logits[owner]
            last_pos = pos[:, -1:]
            for t in range(self.response_length):
                if greedy:
                    nxt = logits.argmax(-1).cpu()
                else:
                    nxt = _sample_logits(logits.cpu(), temperature, top_k, top_p, gen)
                nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
                out_tokens[:, t] = nxt
                out_logp[:, t] = A.log_probs_from_logits(logits.cpu() / temp, nxt)
                if stop_at_eos:
                    finished |= nxt == eos
                if bool(finished.all()) or t == self.response_length - 1:
                    break
                last_pos = last_pos + 1
                if shared:   # (every response position is attended: the cache holds the prompt's mask)
                    step = {"attention_mask": None, "shared_prompt": cache}
                else:
                    attn_d = torch.cat([attn_d, torch.ones((bsz, 1), dtype=attn_d.dtype, device=dev)], dim=1)
                    step = {"attention_mask": attn_d}
                out = self.model(input_ids=nxt[:, None].to(dev), position_ids=last_pos, past_key_values=cache,
                                 use_cache=True, **step)
                logits = out.logits[:, -1, :].float()
        return out_tokens, out_logp


def _sample_logits(logits: Any, temperature: float, top_k: int, top_p: float, gen: Any) -> Any:
    torch = torch_mod()
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
