"""The GPU check's checks: the trainer's worker classes in this process (see ``gpu_check``).

A world-size-1 ``torch.distributed`` group (NCCL on CUDA, gloo on CPU) and a dataflow
context carrying it stand in for the worker group, so ``ActorWorker`` & co. run exactly as
rank 0 of a group of one: FSDP2 shards (over one rank), DDP at one rank is the plain module
(as in the trainer). Every check returns its figures or raises; peak GPU memory is measured
per role from a reset.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable

from hpc_verl.ops import gpu_model as G

CHECKS = ("model", "actor_update_fsdp2", "weight_handover", "actor_update_ddp", "critic_forward", "ref_forward",
          "rollout_hf", "ulysses_sp1", "ulysses_sp2")
SP2_TIMEOUT_S = 150.0


def check_names() -> tuple[str, ...]:
    return CHECKS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gib(n: float) -> float:
    return round(n / 2 ** 30, 3)


class Suite:
    """State shared by the checks: the model on disk, the process group, the actor for the hand-over."""

    def __init__(self, out: Path, size: str, device: str, report: Any) -> None:
        self.out, self.size, self.device, self.report = out, size, device, report
        self.work = G.WORK[size]
        self.model_path: Path | None = None
        self.n_params = 0
        self.config: Any = None
        self.actor: Any = None
        self.group_ready = False

    def checks(self) -> list[tuple[str, Callable[[], dict]]]:
        return [(name, getattr(self, f"check_{name}")) for name in CHECKS]

    # ---- plumbing ---------------------------------------------------------------------------
    def _torch(self) -> Any:
        import torch
        return torch

    def _group(self) -> None:
        """A world of one rank (NCCL/gloo) and the dataflow context that hands it to the workers."""
        if self.group_ready:
            return
        torch = self._torch()
        import torch.distributed as dist

        from hpc_verl.dataflow import context
        if self.device == "cuda":
            torch.cuda.set_device(0)
        backend = "nccl" if self.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        context._CONTEXT = context.WorkerContext(node_name="gpu_check", instance_id="gpu_check_0", index=0,
                                                 rank=0, world_size=1, group="gpu_check",
                                                 process_group=dist.group.WORLD)
        self.group_ready = True

    def close(self) -> None:
        if self.group_ready:
            import torch.distributed as dist
            dist.destroy_process_group()
            self.group_ready = False

    def _need_model(self) -> Path:
        if self.model_path is None:
            raise RuntimeError("no model: the 'model' check did not pass")
        return self.model_path

    def _cfg(self, *extra: str) -> dict:
        from hpc_verl.trainer.config.schema import load_config
        w = self.work
        over = [f"actor_rollout_ref.model.path={self._need_model()}", f"trainer.device={self.device}",
                "trainer.n_gpus_per_node=1", f"data.max_prompt_length={w['prompt']}",
                f"data.max_response_length={w['response']}", f"data.train_batch_size={w['rows']}",
                "actor_rollout_ref.rollout.n=1", f"actor_rollout_ref.actor.ppo_mini_batch_size={w['rows']}",
                f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={w['micro']}",
                f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={w['micro']}",
                f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={w['micro']}",
                f"critic.ppo_micro_batch_size_per_gpu={w['micro']}", "actor_rollout_ref.rollout.ignore_eos=true",
                f"hpc_verl.run_dir={self.out / 'run'}", "hpc_verl.progress=false", *extra]
        return load_config(None, over).to_dict()

    def _batch(self, rows: int, prompt: int, response: int) -> dict:
        """Random tokens from the tokenizer's ids, full attention, responses of full length."""
        torch = self._torch()
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(8, 100, (rows, prompt + response), generator=g)
        attn = torch.ones_like(ids)
        pos = attn.cumsum(-1) - 1
        return {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "responses": ids[:, prompt:],
                "response_mask": torch.ones(rows, response), "advantages": torch.randn(rows, response, generator=g)}

    def _reset_peak(self) -> None:
        torch = self._torch()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def _peak(self) -> float | None:
        torch = self._torch()
        if self.device != "cuda":
            return None
        torch.cuda.synchronize()
        return _gib(torch.cuda.max_memory_allocated())

    def _sync(self) -> None:
        if self.device == "cuda":
            self._torch().cuda.synchronize()

    def _drop_actor(self) -> None:
        self.actor = None
        import gc
        gc.collect()

    # ---- checks -----------------------------------------------------------------------------
    def check_model(self) -> dict:
        t0 = time.perf_counter()
        self.model_path, self.n_params = G.build_model(self.out, self.size)
        from transformers import AutoConfig
        self.config = AutoConfig.from_pretrained(self.model_path)
        return {"params": self.n_params, "path": str(self.model_path), "build_s": round(time.perf_counter() - t0, 2),
                "layers": self.config.num_hidden_layers, "hidden": self.config.hidden_size,
                "vocab": self.config.vocab_size}

    def _actor_update(self, strategy: str, keep: bool) -> dict:
        from hpc_verl.trainer.roles.actor import ActorWorker
        self._group()
        self._drop_actor()
        self._reset_peak()
        w = self.work
        actor = ActorWorker(self._cfg(f"actor_rollout_ref.actor.strategy={strategy}"), total_steps=10)
        batch = self._batch(w["rows"], w["prompt"], w["response"])
        batch["old_log_prob"] = actor.compute_log_prob(batch)[0]["old_log_prob"]
        actor.update_policy(dict(batch), step=1)                 # warm-up (allocator, kernels)
        self._sync()
        t0 = time.perf_counter()
        for step in range(w["updates"]):
            out = actor.update_policy(dict(batch), step=2 + step)
        self._sync()
        seconds = time.perf_counter() - t0
        if not all(abs(out[k]) < float("inf") for k in ("actor/pg_loss", "actor/grad_norm")):
            raise RuntimeError(f"non-finite loss or gradient norm after the update: {out}")
        seq = w["prompt"] + w["response"]
        tokens = w["rows"] * seq * w["updates"]
        flops = tokens * G.train_flops_per_token(self.n_params, self.config, seq)
        # the trainer computes in bf16 only under FSDP2 on CUDA (MixedPrecisionPolicy); DDP keeps float32
        bf16 = actor.model.sharded and self.device == "cuda"
        figures = {"wrapper": type(actor.model.forward_module).__name__, "sharded": actor.model.sharded,
                   "compute_dtype": "bfloat16" if bf16 else str(next(actor.model.parameters()).dtype)[6:],
                   "updates": w["updates"], "optim_steps_per_update": out["counts"]["optim_steps"],
                   "tokens_per_update": w["rows"] * seq, "update_s": round(seconds / w["updates"], 4),
                   "tokens_per_s": round(tokens / seconds, 1), "peak_mem_gib": self._peak(),
                   "grad_norm": round(float(out["actor/grad_norm"]), 4)}
        if self.device == "cuda":
            figures["model_tflops_per_s"] = round(flops / seconds / 1e12, 2)
            figures["mfu"] = round(flops / seconds / G.H200_BF16_DENSE_FLOPS, 4)
        if keep:
            self.actor = actor
        return figures

    def check_actor_update_fsdp2(self) -> dict:
        return self._actor_update("fsdp2", keep=True)

    def check_actor_update_ddp(self) -> dict:
        return self._actor_update("ddp", keep=False)

    def check_weight_handover(self) -> dict:
        """Colocated sync: the rollout loads the FSDP actor's full tensors in this process."""
        from hpc_verl.trainer.rollout.hf import RolloutWorker
        if self.actor is None:
            raise RuntimeError("no actor: actor_update_fsdp2 did not pass")
        rollout = RolloutWorker(self._cfg())
        self._sync()
        t0 = time.perf_counter()
        rollout.load_tensors(self.actor.export_tensors(), version=1)
        self._sync()
        seconds = time.perf_counter() - t0
        got = dict(rollout.model.named_parameters())
        worst, nbytes = 0.0, 0
        for name, t in self.actor.export_tensors():
            if name in got:
                dst = got[name]
                worst = max(worst, float((dst - t.to(dst.device, dst.dtype)).abs().max()))
                nbytes += dst.numel() * dst.element_size()
        if worst != 0.0 or rollout.version != 1:
            raise RuntimeError(f"rollout weights differ from the actor's after the hand-over (max {worst})")
        del rollout
        self._drop_actor()
        self._reset_peak()
        return {"seconds_sync": round(seconds, 4), "bytes": nbytes, "gb_per_s": round(nbytes / seconds / 1e9, 2),
                "rollout_dtype": str(next(iter(got.values())).dtype).replace("torch.", "")}

    def check_critic_forward(self) -> dict:
        from hpc_verl.trainer.roles.critic import CriticWorker
        return self._forward_role(lambda cfg: CriticWorker(cfg, total_steps=10), lambda w, b: w.compute_values(b))

    def check_ref_forward(self) -> dict:
        from hpc_verl.trainer.roles.ref import RefWorker
        return self._forward_role(RefWorker, lambda w, b: w.compute_ref_log_prob(b))

    def _forward_role(self, make: Callable[[dict], Any], run: Callable[[Any, dict], Any]) -> dict:
        self._group()
        self._reset_peak()
        w = self.work
        worker = make(self._cfg())
        batch = self._batch(w["rows"], w["prompt"], w["response"])
        run(worker, batch)                                       # warm-up
        self._sync()
        t0 = time.perf_counter()
        run(worker, batch)
        self._sync()
        seconds = time.perf_counter() - t0
        tokens = w["rows"] * (w["prompt"] + w["response"])
        return {"forward_s": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1),
                "peak_mem_gib": self._peak()}

    def check_rollout_hf(self) -> dict:
        from hpc_verl.trainer.rollout.hf import RolloutWorker
        self._reset_peak()
        w = self.work
        rollout = RolloutWorker(self._cfg(f"data.max_response_length={w['gen_response']}"))
        torch = self._torch()
        g = torch.Generator().manual_seed(2)
        prompts = torch.randint(8, 100, (w["gen_rows"], w["gen_prompt"]), generator=g).tolist()
        rollout.generate({"prompt_ids": prompts[:2], "step": 0})     # warm-up
        out = rollout.generate({"prompt_ids": prompts, "step": 1})
        seconds, tokens = out["gen_time_s"][0], out["n_response_tokens"][0]
        if tokens != w["gen_rows"] * w["gen_response"]:
            raise RuntimeError(f"ignore_eos: expected {w['gen_rows'] * w['gen_response']} tokens, got {tokens}")
        return {"rows": w["gen_rows"], "prompt_tokens": w["gen_prompt"], "response_tokens": w["gen_response"],
                "gen_s": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1), "peak_mem_gib": self._peak(),
                "dtype": str(next(rollout.model.parameters()).dtype).replace("torch.", "")}

    def check_ulysses_sp1(self) -> dict:
        """SP=1 (no group) through the Ulysses attention equals transformers' sdpa, in float32."""
        from hpc_verl.trainer.engine import ulysses
        from hpc_verl.trainer.engine.device import load_causal_lm
        self._reset_peak()
        ref = load_causal_lm(str(self._need_model()), self.device, "float32")
        b = _padded_batch(self._torch(), rows=4, seq=min(64, self.work["prompt"] + self.work["response"]),
                          response=min(16, self.work["response"]), vocab=100)
        diffs = ulysses.compare_with_unsplit(ref, b, None)
        _require(diffs, 1e-4)
        return {**diffs, "peak_mem_gib": self._peak()}

    def check_ulysses_sp2(self) -> dict:
        """SP=2 as two processes on this one device (NCCL may refuse two ranks on one GPU)."""
        import torch.multiprocessing as mp
        d = self.out / "sp2"
        d.mkdir(exist_ok=True)
        for f in d.glob("*"):
            f.unlink()
        ctx = mp.start_processes(_sp2_worker, args=(str(d / "init"), str(d), self.device), nprocs=2,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + SP2_TIMEOUT_S
        try:
            while not ctx.join(timeout=2):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"SP=2 did not finish within {SP2_TIMEOUT_S:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        ranks = [json.loads((d / f"rank{r}.json").read_text()) for r in (0, 1)]
        for r in ranks:
            _require(r, 1e-4)
        return {"backend": ranks[0].pop("backend"), **{f"rank{i}_{k}": v for i, r in enumerate(ranks)
                                                        for k, v in r.items() if k in ("logits", "grads")}}


def _padded_batch(torch: Any, rows: int, seq: int, response: int, vocab: int) -> dict:
    """Left-padded rows of different lengths (the padding case Ulysses must get right)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.zeros(rows, seq, dtype=torch.long)
    attn = torch.zeros(rows, seq, dtype=torch.long)
    for i in range(rows):
        n = seq - (i * seq) // (2 * rows)
        ids[i, seq - n:] = torch.randint(8, vocab, (n,), generator=g)
        attn[i, seq - n:] = 1
    return {"input_ids": ids, "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, -response:], "weights": torch.randn(rows, response, generator=g)}


def _require(diffs: dict, tol: float) -> None:
    bad = {k: diffs[k] for k in ("logits", "logp", "grads", "unsplit") if k in diffs and not diffs[k] < tol}
    if bad or not diffs.get("finite", True):
        raise RuntimeError(f"Ulysses differs from the unsplit model beyond {tol:g}: {bad or 'non-finite'}")


def _sp2_worker(rank: int, init_file: str, out_dir: str, device: str) -> None:
    """One SP rank: a small Llama (GQA) in float32 on ``device``, compared with its unsplit self."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpc_verl.trainer.engine import ulysses
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)          # both ranks on the one GPU
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                                             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                             max_position_embeddings=256, pad_token_id=0)).to(device)
        diffs = ulysses.compare_with_unsplit(model, _padded_batch(torch, 4, 37, 8, 128), dist.group.WORLD)
        diffs["backend"] = backend
        tmp = Path(out_dir) / f".rank{rank}.json"
        tmp.write_text(json.dumps(diffs))
        os.replace(tmp, Path(out_dir) / f"rank{rank}.json")
    finally:
        dist.destroy_process_group()
