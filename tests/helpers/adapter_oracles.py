"""Oracles for the framework adapters (tests/integrations/, and tests/engine/test_main_grad.py).

verl: its own torch implementation of the op, `verl.utils.experimental.torch_functional.FusedLinearForPPO`
(materialised logits per token chunk, hand-written backward), loaded by path from verl 0.9.1 installed
aside (`pip install --no-deps --target .venv/verl-aside verl==0.9.1`, as .ci/setup.sh does): importing the
`verl` package itself needs ray and more, that one file needs only torch.
AReaL: not installable here; the oracle is the materialised fp64 computation of its documented semantics,
and its output layers are megatron-core's ColumnParallelLinear, subclasses of it (a Gemma2-style soft-cap)
and a stand-in of AReaL's LM-head mixin on them.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import warnings

import torch
from helpers.paths import REPO

from areal_lce.op import reference

_SETUP_ASIDE = str(REPO / ".venv" / "verl-aside")
VERL_ASIDE = os.environ.get("AREAL_LCE_VERL_ASIDE", "") or _SETUP_ASIDE
VERL_TORCH_FILE = os.path.join(VERL_ASIDE, "verl", "utils", "experimental", "torch_functional.py")
VERL_FUSED_FILE = os.path.join(VERL_ASIDE, "verl", "models", "mcore", "model_forward_fused.py")
AREAL_FIELDS = ("logprobs", "entropy", "vocab_min_logits", "vocab_max_logits", "vocab_mean_logits",
                "vocab_norm_logits")  # AReaL's ChunkedLMHeadOutput, in order


def verl_available() -> bool:
    return os.path.isfile(VERL_TORCH_FILE)


def load_verl_torch_functional():
    spec = importlib.util.spec_from_file_location("verl_torch_functional_aside", VERL_TORCH_FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def verl_reference(hidden, weight, labels, temperature, g_lp, g_ent, reduction="none"):
    """verl's torch op on the full weight: (logprobs, entropy, d_hidden, d_weight) of
    loss = Σ g_lp·logprobs (g_lp·Σ logprobs, or its mean, for "sum"/"mean") + Σ g_ent·entropy."""
    fl = load_verl_torch_functional().FusedLinearForPPO(chunk_size=5, impl_backend="torch")
    h = hidden.detach().reshape(-1, hidden.shape[-1]).clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    lp, ent = fl(h, w, labels.reshape(-1), temperature)
    lp_term = {"none": (lp * g_lp).sum(), "sum": g_lp * lp.sum(), "mean": g_lp * lp.mean()}[reduction]
    (lp_term + (ent * g_ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def areal_oracle(hidden, weight, labels, temperature, logit_scale, g_lp):
    """AReaL's semantics, materialised in fp64 over the full weight (every row a vocabulary entry):
    logits r = (h·Wᵀ)·logit_scale, z = r / T; six per-token outputs and the gradients of Σ g_lp·logprobs
    (entropy does not carry gradient in AReaL's head)."""
    h = hidden.detach().reshape(-1, hidden.shape[-1]).double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    r = (h @ w.t()) * logit_scale
    lp, ent = reference.from_logits(r, labels.reshape(-1), temperature=temperature)[:2]  # the op's torch math
    (lp * g_lp.double()).sum().backward()
    rd = r.detach()
    outs = (lp.detach(), ent.detach(), rd.min(-1).values, rd.max(-1).values, rd.mean(-1), rd.norm(dim=-1))
    return outs, h.grad, w.grad


@functools.lru_cache(maxsize=None)
def column_parallel_linear():
    """megatron-core's ColumnParallelLinear, imported without megatron's import-time notices (no Apex / TE on
    this machine, its own deprecations)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        from megatron.core.tensor_parallel import ColumnParallelLinear
    return ColumnParallelLinear


@functools.lru_cache(maxsize=None)
def _layer_config(h: int):
    column_parallel_linear()  # megatron imported quietly first
    from megatron.core.transformer import TransformerConfig

    with warnings.catch_warnings():  # megatron's own deprecation notes on its default cuda_graph_scope
        warnings.simplefilter("ignore", UserWarning)
        return TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=2, use_cpu_initialization=True,
                                 gradient_accumulation_fusion=False)


def output_layer(h: int, v: int, cls=None, *, bias: bool = False, skip_bias_add: bool = False, **attrs):
    """A megatron-core ColumnParallelLinear LM head (or `cls`, a subclass) as AReaL passes it, built at TP = 1
    without any process group (the TP = 2 ones are built in tests/integrations/integrations_worker.py); `attrs` are set
    on it afterwards (e.g. fp32_operands, chunked_loss_supported)."""
    layer = (cls or column_parallel_linear())(h, v, config=_layer_config(h), init_method=torch.nn.init.zeros_,
                                          bias=bias, skip_bias_add=skip_bias_add, gather_output=False,
                                          skip_weight_param_allocation=True)
    for name, value in attrs.items():
        setattr(layer, name, value)
    return layer


def softcap_layer_class(cap: float):
    """An output layer that soft-caps its logits, cap·tanh(logits / cap), in its forward, as megatron-bridge's
    Gemma2 output layer does (AReaL then sets chunked_loss_supported=False on it)."""
    class Gemma2StyleOutputLayer(column_parallel_linear()):
        def forward(self, input_, weight=None, runtime_gather_output=None):
            logits, bias = super().forward(input_, weight, runtime_gather_output)
            return cap * torch.tanh(logits / cap), bias

    return Gemma2StyleOutputLayer


class _AReaLVocabParallelLMHeadMixin:
    """Stand-in of AReaL's LM-head mixin (areal.models.mcore.vocab_parallel_head, matched by module and name):
    it replaces ColumnParallelLinear._forward_impl by the same GEMM with a native or fp32 output."""

    fp32_output = False

    def _forward_impl(self, input, weight, bias=None, **_):
        out = torch.matmul(input, weight.t())
        out = out if bias is None else out + bias
        return out.float() if self.fp32_output else out


_AReaLVocabParallelLMHeadMixin.__module__ = "areal.models.mcore.vocab_parallel_head"


def areal_promoted(cls):
    """The class AReaL's replace_output_layer_with_areal_lm_head gives an output layer of class `cls`."""
    return type(f"AReaL{cls.__name__}", (_AReaLVocabParallelLMHeadMixin, cls), {})


def scaled_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x − ref| / max(1, max |ref|)."""
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1.0)).item()
