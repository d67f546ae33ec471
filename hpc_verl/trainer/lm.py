"""Language-model plumbing shared by the roles: device, threads, loading a local
Hugging Face model and tokenizer, row slices of a batch, response log-probs."""
from __future__ import annotations

from typing import Any, Iterator

from hpc_verl.trainer import algorithms as A


def torch_mod() -> Any:
    import torch
    return torch


def pick_device(cfg: dict) -> str:
    torch = torch_mod()
    if cfg["trainer"]["device"] == "cuda" and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def setup_threads(cfg: dict) -> None:
    """CPU threads of this role: ``hpc_verl.torch_threads`` if set, else what Ray gave the actor.

    Ray starts actors with OMP_NUM_THREADS = their CPUs (1 per rank on CPU). More threads
    help big models on idle CPUs, but on a shared small CPU OpenMP oversubscription makes
    tiny models several times slower, so it is opt-in.
    """
    n = cfg.get("hpc_verl", {}).get("torch_threads")
    if n:
        torch_mod().set_num_threads(int(n))


def load_causal_lm(path: str, device: str, dtype: str = "float32", trust_remote_code: bool = False) -> Any:
    torch = torch_mod()
    from transformers import AutoModelForCausalLM
    torch_dtype = getattr(torch, dtype) if device != "cpu" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True,
                                                 trust_remote_code=trust_remote_code)
    return model.to(device)


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def chunks(n: int, size: int | None) -> Iterator[slice]:
    size = n if not size or size <= 0 else size
    for s in range(0, n, size):
        yield slice(s, min(n, s + size))


def sub_batch(batch: dict, idx: Any) -> dict:
    """Rows ``idx`` (slice or index tensor) of every row tensor of ``batch``."""
    torch = torch_mod()
    n = batch["responses"].shape[0] if "responses" in batch else None
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and (n is None or v.shape[0] == n):
            out[k] = v[idx]
        else:
            out[k] = v
    return out


def response_log_probs(model: Any, batch: dict, temperature: float = 1.0, with_entropy: bool = False,
                       device: Any = None) -> Any:
    """log p(response token) under ``model`` for every response position (and entropy)."""
    dev = device if device is not None else next(model.parameters()).device
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
