"""fp32 linear layers on oneDNN's GEMM instead of MKL's, on CPUs where oneDNN's is the faster one.

A CPU build of torch runs ``F.linear`` in fp32 through MKL's sgemm. On an AMD Zen 4
MKL reports no AVX-512 path (``MKL_VERBOSE``: "Intel(R) Architecture processors");
oneDNN, also in every x86 torch build, runs its AVX-512 kernel there
(``ONEDNN_VERBOSE``: ``brg_matmul:avx512_core``, f32 in and out) and the same fp32
products about a tenth faster (``benchmarks/ppo_throughput.py`` shapes, one thread:
104-108 against 85-100 GFLOP/s). Same precision: fp32 inputs, fp32 accumulation, only the order of
the sums differs (relative differences near 1e-6; ``tests/test_cpu_gemm.py`` holds
outputs and gradients to 1e-5).

``install(model)`` turns every ``nn.Linear`` of a CPU model into ``Linear`` below: its
forward and its input gradient (``dy @ W``) run on oneDNN, its weight gradient stays on
MKL (oneDNN is not faster there). Anything but plain float32 CPU tensors (bf16, GPUs,
DTensors) takes ``F.linear`` as before. Imported by the roles only (it imports torch).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_op: Any = None   # oneDNN's dense linear once checked; False: not in this torch (or not right)


def _onednn() -> Any:
    """``mkldnn::_linear_pointwise`` if this torch has it and it computes ``x @ W^T``, else None."""
    global _op
    if _op is None:
        _op = False
        try:
            op = torch.ops.mkldnn._linear_pointwise.default
            if torch.backends.mkldnn.is_available():
                g = torch.Generator().manual_seed(0)
                x, w = torch.randn(5, 3, 16, generator=g), torch.randn(8, 16, generator=g)
                if torch.allclose(op(x, w, None, "none", [], ""), x @ w.t(), rtol=1e-5, atol=1e-5):
                    _op = op
        except (AttributeError, RuntimeError):
            pass
    return _op or None


def available() -> bool:
    return _onednn() is not None


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Any, weight: Any, bias: Any) -> Any:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _op(x, weight, bias, "none", [], "")

    @staticmethod
    def backward(ctx: Any, gy: Any) -> tuple[Any, Any, Any]:
        x, weight = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:   # dy @ W = linear(dy, W^T)
            gx = _op(gy, weight.t(), None, "none", [], "")
        g2 = gy.reshape(-1, gy.shape[-1])
        if ctx.needs_input_grad[1]:   # dy^T @ x on MKL
            gw = g2.t().mm(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb


def linear(x: Any, weight: Any, bias: Any = None) -> Any:
    """``F.linear(x, weight, bias)``, on oneDNN for plain float32 CPU tensors."""
    if (not _op or type(x) is not torch.Tensor or type(weight) not in _PLAIN
            or x.dtype is not torch.float32 or weight.dtype is not torch.float32 or x.device.type != "cpu"):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _LinearFn.apply(x, weight, bias)
    return _op(x, weight, bias, "none", [], "")


class Linear(torch.nn.Linear):
    """``nn.Linear`` whose float32 CPU products run on oneDNN (same parameters, same state dict)."""

    def forward(self, x: Any) -> Any:
        return linear(x, self.weight, self.bias)


def install(model: Any, choice: str = "onednn") -> int:
    """Run ``model``'s ``nn.Linear`` layers on oneDNN (``choice`` ``onednn``, where this torch has
    it); the number of layers switched (0: nothing changed)."""
    if choice != "onednn" or not available():
        return 0
    n = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.device.type == "cpu":
            module.__class__ = Linear
            n += 1
    return n
