"""A rank's device and threads, and a local Hugging Face model and tokenizer loaded onto it.
Rank processes; torch and transformers are imported in the functions (``torch_mod``), so
torch-free modules (roles/nodes, roles/minibatch) can name these."""
from __future__ import annotations

import os
from typing import Any

from hpc_verl.errors import ConfigError
from hpc_verl.trainer.models.check import ModelError
from hpc_verl.dataflow import current_context


def torch_mod() -> Any:
    """torch, imported on first use (heavy: only the ranks that compute need it)."""
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
    pins = cfg.get("hpc_verl", {}).get("pin_cpus")
    if pins:
        pin_process(int(pins[_rank() % len(pins)]))


def _rank() -> int:
    try:
        return int(current_context().rank)
    except Exception:  # noqa: BLE001 - outside a worker group: one rank
        return 0


def pin_process(cpu: int) -> None:
    """Every thread of this process (Ray's and torch's, and those started later) on ``cpu`` only."""
    allowed = os.sched_getaffinity(0)
    if cpu not in allowed:
        raise ConfigError(f"config key 'hpc_verl.pin_cpus': CPU {cpu} is not one this process may run on "
                          f"({', '.join(map(str, sorted(allowed)))})")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except OSError:   # a thread that ended meanwhile
            pass


def cpu_linears(cfg: dict, model: Any) -> int:
    """``hpc_verl.cpu_matmul``: a CPU model's float32 linear layers on oneDNN (``cpu_gemm``); how many."""
    from hpc_verl.trainer.engine import cpu_gemm   # torch at its top: only where a role asks for it

    return cpu_gemm.install(model, cfg["hpc_verl"]["cpu_matmul"])   # (layers on a GPU are left as they are)


def compute_dtype(device: str, dtype: str) -> str:
    """The dtype a role computes in: the configured one on GPUs, float32 on a CPU (every CPU role,
    the vLLM engine too, so their log-probs agree)."""
    return "float32" if device == "cpu" else dtype


def load_causal_lm(path: str, device: str, dtype: str = "float32", trust_remote_code: bool = False) -> Any:
    torch = torch_mod()
    from transformers import AutoModelForCausalLM
    torch_dtype = getattr(torch, compute_dtype(device, dtype))
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True,
                                                     trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises many types; the first line says what is wrong
        raise _not_loading(path, "model", exc) from None
    return model.to(device)


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:  # (as above)
        raise _not_loading(path, "tokenizer", exc) from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _not_loading(path: str, what: str, exc: BaseException) -> Exception:
    """One line for a model directory a rank cannot load (transformers' message starts with the cause)."""
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return ModelError(f"model {path}: the {what} does not load ({type(exc).__name__}: "
                      f"{lines[0][:300] if lines else ''}); `hpc-verl check-model {path}` shows the same offline")
