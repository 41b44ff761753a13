"""Oracles for the framework adapters (tests/test_integrations.py and tests/integrations_worker.py).

verl: its own torch implementation of the op, `verl.utils.experimental.torch_functional.FusedLinearForPPO`
(materialised logits per token chunk, hand-written backward), loaded by path from verl 0.9.1 installed
aside (`pip install --no-deps --target .venv/verl-aside verl==0.9.1`, as .ci/setup.sh does): importing the
`verl` package itself needs ray and more, that one file needs only torch.
AReaL: not installable here; the oracle is the materialised fp64 computation of its documented semantics.
"""
from __future__ import annotations

import importlib.util
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SETUP_ASIDE = os.path.join(ROOT, ".venv", "verl-aside")
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
    logp = torch.log_softmax(r / temperature, dim=-1)
    lp = logp.gather(1, labels.reshape(-1, 1)).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    (lp * g_lp.double()).sum().backward()
    rd = r.detach()
    outs = (lp.detach(), ent.detach(), rd.min(-1).values, rd.max(-1).values, rd.mean(-1), rd.norm(dim=-1))
    return outs, h.grad, w.grad


def scaled_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x − ref| / max(1, max |ref|)."""
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1.0)).item()
