"""CPU linear layers on oneDNN (``hpc_verl.cpu_matmul: onednn``) compute what ``F.linear`` computes:
outputs and the gradients of input, weight and bias to 1e-5 (fp32 both ways, only the order of
the sums differs), a Llama's logits and one AdamW step the same, and everything that is not a
plain float32 CPU tensor goes to ``F.linear`` untouched."""
from __future__ import annotations

import copy
import pickle

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainer_fixtures import digit_overrides, digits_data, tiny_model  # noqa: E402,F401

from hpc_verl.trainer.engine import cpu_gemm  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="this torch build has no oneDNN linear")


def _pair(bias: bool, seed: int = 0):
    torch.manual_seed(seed)
    ref = torch.nn.Linear(48, 24, bias=bias)
    ours = copy.deepcopy(ref)
    assert cpu_gemm.install(torch.nn.Sequential(ours)) == 1 and type(ours) is cpu_gemm.Linear
    return ref, ours


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("strided", [False, True])
def test_outputs_and_all_three_gradients_equal_f_linear(bias, strided):
    ref, ours = _pair(bias)
    base = torch.randn(3, 48, 7) if strided else torch.randn(3, 7, 48)
    x = base.transpose(1, 2) if strided else base   # (a transposed view, as attention outputs can be)
    gy = torch.randn(3, 7, 24)
    outs, grads = [], []
    for layer in (ref, ours):
        xi = x.detach().clone().requires_grad_(True)
        y = layer(xi)
        y.backward(gy)
        outs.append(y.detach())
        grads.append([xi.grad] + [p.grad for p in layer.parameters()])
    assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    for g_ref, g_ours in zip(*grads):
        assert g_ours is not None and torch.allclose(g_ref, g_ours, rtol=1e-5, atol=1e-5)
    assert not torch.equal(outs[1], torch.zeros_like(outs[1]))


def test_only_plain_float32_cpu_tensors_take_onednn(monkeypatch):
    _, ours = _pair(True)
    calls = []
    real = cpu_gemm.F.linear
    monkeypatch.setattr(cpu_gemm.F, "linear", lambda *a: calls.append(a[0].dtype) or real(*a))
    with torch.no_grad():
        ours(torch.randn(2, 48))
        assert calls == []                               # float32: oneDNN
        ours.to(torch.bfloat16)(torch.randn(2, 48, dtype=torch.bfloat16))
    assert calls == [torch.bfloat16]                     # anything else: F.linear as before


def test_a_llama_gives_the_same_logits_and_the_same_adamw_step(tiny_model):  # noqa: F811
    from hpc_verl.trainer.engine.device import load_causal_lm

    ref = load_causal_lm(str(tiny_model), "cpu")
    ours = copy.deepcopy(ref)
    n = cpu_gemm.install(ours)
    assert n == sum(1 for m in ref.modules() if type(m) is torch.nn.Linear) and n > 0
    ids = torch.randint(3, 60, (4, 12), generator=torch.Generator().manual_seed(0))
    logits = []
    for model in (ref, ours):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out = model(input_ids=ids).logits
        logits.append(out.detach())
        torch.log_softmax(out, -1)[..., 5].mean().backward()
        opt.step()
    assert torch.allclose(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    for (name, p_ref), (_, p_ours) in zip(ref.named_parameters(), ours.named_parameters()):
        assert torch.allclose(p_ref, p_ours, rtol=1e-5, atol=1e-6), name
    assert ref.state_dict().keys() == ours.state_dict().keys()
    again = pickle.loads(pickle.dumps(ours))             # (a plain subclass: copies and pickles)
    assert type(again.lm_head) is cpu_gemm.Linear


def test_the_config_key_switches_the_roles(tiny_model, digits_data, tmp_path):  # noqa: F811
    from hpc_verl.trainer.config.schema import load_config
    from hpc_verl.trainer.rollout.hf import RolloutWorker

    def kinds(*extra):
        cfg = load_config(None, digit_overrides(tiny_model, digits_data, tmp_path, 1, extra)).to_dict()
        return {type(m) for m in RolloutWorker(cfg).model.modules() if isinstance(m, torch.nn.Linear)}

    assert kinds() == {cpu_gemm.Linear}                            # the default: oneDNN
    assert kinds("hpc_verl.cpu_matmul=torch") == {torch.nn.Linear}
    assert cpu_gemm.install(torch.nn.Linear(2, 2), "torch") == 0
