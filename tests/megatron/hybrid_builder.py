"""A user's megatron-core HybridModel built from megatron's local modules, and the fp32-bound check of
token_stats on it against the materialised log_softmax of the model's own logits.

Used in-process by tests/megatron/test_hybrid.py (TP=1) and by tests/megatron/hybrid_worker.py (TP=2, gloo).

The model: megatron's hybrid layer specs are Transformer Engine modules (absent on CPU and here), so the
stack is composed from megatron's local ones -- attention layers ("*": torch RMSNorm, ColumnParallelLinear
QKV, areal_lce's SDPA core attention for packed THD, RowParallelLinear) and MLP layers ("-": RMSNorm,
SwiGLU MLP of Column/RowParallelLinear) -- in a HybridStack whose final norm is the same torch RMSNorm
(HybridStack builds a TENorm there). No Mamba layers: they need CUDA kernels (mamba_ssm, causal_conv1d).

The check (`check_routes`), per rank, for the fused and the materialised route:
  reference   the model's own materialised fp32 logits (gathered over TP), log_softmax and entropy in
              fp64 of those logits; its gradients by autograd through the model (back to fp32 at the
              logits). Its error against the exact values lies within the fp32 bound B of
              tests/helpers/bounds.py (the logits' GEMM rounding and one rounding of d_logits are terms
              of B); token_stats' lies within B too, so the two differ by at most 2·B, computed from this
              call's hidden states, LM-head weight, temperatures and upstream gradients.
  outputs     logprobs and entropy within 2·B; max/min logit within 2·γ_(H+1)·max_j Σ_k |h_k w_jk|.
  gradients   the gradient reaching the head's input (the decoder's output, after the head's own TP / SP
              mappings) within 2·B.d_hidden, and the LM-head weight's within 2·B.d_weight (tied: the
              embedding's gradient less its body part, the subtraction's rounding added). Every other
              parameter's gradient is the body's backward of that d_hidden: checked bitwise (the body's
              backward run again from the head input's gradient gives every parameter the same
              gradient), so no gradient reaches the body except through the bounded one.
  body        the decoder's output is bitwise the same in every forward (the seam changes the head only).
The result is {metric: worst err/bound ratio (<= 1 passes), or a mismatch count (0 passes)}.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from areal_lce.op import reference
from helpers import gpt_builder as G
from helpers.bounds import U32, gamma, op_bounds

PATTERN = "*-*-"  # attention, MLP, attention, MLP


def build_hybrid(tp: int = 1, sp: bool = False, tied: bool = False, pattern: str = PATTERN, seed: int = 1234,
                 head_scale: float = 4.0):
    """HybridModel of `pattern` (no "M": see the module docstring), H=64, GQA 4/2 heads, RoPE, RMSNorm,
    SwiGLU, the vocabulary padded as megatron pads it; the LM head scaled by `head_scale` (peaked softmax)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from areal_lce.engine.model.attention import SDPAttention
    from areal_lce.engine.model.builder import _local_rms_norm_class

    G.init(tp, sp, seed)
    norm = _local_rms_norm_class()  # marks its weight sequence_parallel, as megatron's fused norms are

    class LocalNormHybridStack(HybridStack):
        """HybridStack with a torch RMSNorm as its final norm (HybridStack itself builds a TENorm)."""

        def __init__(self, config, submodules, *args, post_layer_norm: bool = True, **kwargs):
            super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm
            if self.post_process and post_layer_norm:
                self.final_norm = norm(config, config.hidden_size, eps=config.layernorm_epsilon)

    cfg = TransformerConfig(
        num_layers=len(pattern), hidden_size=G.H, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        kv_channels=16, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        sequence_parallel=sp, use_cpu_initialization=True, params_dtype=torch.float32,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
    local = get_gpt_layer_local_spec(normalization="RMSNorm").submodules
    local.self_attention.submodules.core_attention = SDPAttention  # causal, packed THD too
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm, self_attention=local.self_attention, self_attn_bda=local.self_attn_bda))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=norm, mlp=local.mlp, mlp_bda=local.mlp_bda))
    stack = ModuleSpec(module=LocalNormHybridStack,
                       submodules=HybridStackSubmodules(attention_layer=attention, mlp_layer=mlp))
    model = HybridModel(config=cfg, hybrid_stack_spec=stack, vocab_size=G.padded_vocab(tp), max_sequence_length=128,
                        hybrid_layer_pattern=pattern, parallel_output=True, share_embeddings_and_output_weights=tied,
                        position_embedding_type="rope", rotary_base=10000)
    with torch.no_grad():
        head_weight(model).mul_(head_scale)
    return model


def head_weight(model) -> torch.Tensor:
    """The LM head's weight: the output layer's own, or the shared embedding (tied)."""
    own = model.output_layer.weight
    return own if own is not None else model.shared_embedding_or_output_weight()


def _tp():
    from megatron.core import parallel_state as mpu

    return mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_world_size(), \
        mpu.get_tensor_model_parallel_rank()


def _gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x of every TP rank, concatenated along dim (no grad; the bounds' inputs)."""
    group, tp, _ = _tp()
    if tp == 1:
        return x.detach()
    parts = [torch.empty_like(x) for _ in range(tp)]
    torch.distributed.all_gather(parts, x.detach().contiguous(), group=group)
    return torch.cat(parts, dim)


def _reference(model, ids, labels, temperature, position_ids, packed_seq_params):
    """(logprobs, entropy, max_logit, min_logit) of the model's own logits: fp32 logits gathered over TP,
    the softmax in fp64 over the true vocabulary."""
    from megatron.core import tensor_parallel

    logits = model(ids, position_ids, None, packed_seq_params=packed_seq_params)  # [b, s, V_pad/tp] fp32
    full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)[..., :G.VOCAB]
    return reference.from_logits(full, labels, temperature=temperature)[:4]  # areal_lce.op.reference: fp64, differentiable


def _coefficients(labels, seed: int = 5):
    """Per-token weights (a, c) of the loss Σ a·logprob + c·entropy over labelled tokens (RL-like)."""
    g = torch.Generator().manual_seed(seed)
    valid = (labels != -100).float()
    return valid * (torch.rand(labels.shape, generator=g) + 0.5), valid * torch.rand(labels.shape, generator=g) * 0.2


class _HeadInput:
    """Forward hook on the decoder: the tensor the output layer receives in the last forward."""

    def __init__(self, model):
        self.value = None
        self.handle = model.decoder.register_forward_hook(self)

    def __call__(self, module, args, output):
        self.value = output


def _route_grads(model, head_input, lp, ent, a, c, tied: bool):
    """(d_head_input, d_head_weight, {name: grad}, body mismatches) of Σ a·lp + c·ent."""
    loss = (a.to(lp.dtype) * lp + c.to(ent.dtype) * ent).sum()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    head = head_weight(model)
    h = head_input.value
    got = torch.autograd.grad(loss, [h] + [p for _, p in named], retain_graph=True, allow_unused=True)
    d_h, grads = got[0], {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(named, got[1:])}
    body = [(n, p) for n, p in named if p is not head or tied]
    again = torch.autograd.grad(h, [p for _, p in body], grad_outputs=d_h, allow_unused=True)
    mismatches, d_w, slack = 0, None, None
    for (n, p), g in zip(body, again):
        g = g if g is not None else torch.zeros_like(p)
        if p is head:  # tied: the embedding's gradient = body part + the head's d_weight
            d_w = grads[n] - g
            slack = 2 * U32 * (grads[n].abs() + g.abs()).double()  # rounding of the sum and of the difference
        else:
            mismatches += int(not torch.equal(g, grads[n]))
    if d_w is None:
        d_w = grads[[n for n, p in named if p is head][0]]
    return d_h, d_w, slack, mismatches


def check_routes(model, ids, labels, temperature, *, position_ids=None, packed_seq_params=None) -> dict:
    """The module docstring's check of token_stats (fused and materialised routes) on this rank."""
    from areal_lce.megatron import token_stats

    _, tp, rank = _tp()
    sp = model.config.sequence_parallel and tp > 1
    tied = model.share_embeddings_and_output_weights
    t = torch.broadcast_to(torch.as_tensor(temperature, dtype=torch.float32), labels.shape)
    a, c = _coefficients(labels)
    hook = _HeadInput(model)
    try:
        ref = _reference(model, ids, labels, t, position_ids, packed_seq_params)
        ref_h = hook.value
        ref_dh, ref_dw, ref_slack, ref_mis = _route_grads(model, hook, ref[0], ref[1], a, c, tied)
        out = {"ref_body_grad_mismatches": ref_mis}
        for fused in (True, False):
            tag = "fused" if fused else "mat"
            st = token_stats(model, ids, labels, vocab_size=G.VOCAB, temperature=temperature, fused=fused,
                             backend="torch", position_ids=position_ids, packed_seq_params=packed_seq_params)
            out[f"{tag}_head_input_differs"] = int(not torch.equal(hook.value, ref_h))
            dh, dw, slack, mis = _route_grads(model, hook, st.logprobs, st.entropy, a, c, tied)
            out[f"{tag}_body_grad_mismatches"] = mis
            if fused:
                stats = st
                grads = (dh, dw, slack)
            else:
                out.update(_ratios("mat", st, ref, *_bounds(model, ref_h, labels, t, a, c, sp, tp, rank),
                                   (dh, dw, slack), (ref_dh, ref_dw, ref_slack)))
        out.update(_ratios("fused", stats, ref, *_bounds(model, ref_h, labels, t, a, c, sp, tp, rank),
                           grads, (ref_dh, ref_dw, ref_slack)))
    finally:
        hook.handle.remove()
    return out


def _bounds(model, head_input, labels, t, a, c, sp: bool, tp: int, rank: int):
    """2·B of tests/helpers/bounds.py for this call, cut to what this rank holds: (outputs, extremes,
    d_head_input [this rank's sequence share under SP], d_weight [this rank's vocabulary rows])."""
    h = _gather(head_input, 0) if sp else head_input.detach()  # [s, b, H], the sequence gathered under SP
    w = _gather(head_weight(model), 0)  # [V_pad, H]
    flat_h = h.transpose(0, 1).reshape(-1, h.shape[-1])  # tokens in labels' [b, s] order
    b = op_bounds(flat_h, w, labels.reshape(-1), 1 / t.reshape(-1), a.reshape(-1), c.reshape(-1),
                  vocab_size=G.VOCAB)
    extremes = 2 * gamma(flat_h.shape[1] + 1) * (flat_h.double().abs() @ w[:G.VOCAB].double().abs().t()).max(-1).values
    d_h = (2 * b.d_hidden).view(labels.shape[0], labels.shape[1], -1).transpose(0, 1)  # [s, b, H]
    if sp:
        d_h = d_h.chunk(tp, 0)[rank]
    d_w = (2 * b.d_weight).chunk(tp, 0)[rank]
    return 2 * b.logprobs.view(labels.shape), 2 * b.entropy.view(labels.shape), extremes.view(labels.shape), d_h, d_w


def _ratio(got, want, bound) -> float:
    err = (got.detach().double() - want.detach().double()).abs()
    return float((err / bound.clamp_min(1e-300)).max()) if err.numel() else 0.0


def _ratios(tag, st, ref, lp_b, ent_b, ext_b, dh_b, dw_b, grads, ref_grads) -> dict:
    (dh, dw, slack), (ref_dh, ref_dw, ref_slack) = grads, ref_grads
    if slack is not None:
        dw_b = dw_b + slack + ref_slack
    return {f"{tag}_logprobs": _ratio(st.logprobs, ref[0], lp_b), f"{tag}_entropy": _ratio(st.entropy, ref[1], ent_b),
            f"{tag}_max_logit": _ratio(st.max_logit, ref[2], ext_b), f"{tag}_min_logit": _ratio(st.min_logit, ref[3], ext_b),
            f"{tag}_d_head_input": _ratio(dh, ref_dh, dh_b), f"{tag}_d_head_weight": _ratio(dw, ref_dw, dw_b)}


def assert_passes(case: str, result: dict) -> None:
    """Every ratio <= 1 and every count 0; the failure message lists the whole result."""
    bad = {k: v for k, v in result.items()
           if (k.endswith(("mismatches", "differs")) and v != 0) or (not k.endswith(("mismatches", "differs")) and not v <= 1.0)}
    assert not bad, f"{case}: {bad} (ratios are |error| / fp32 bound; all: {result})"
