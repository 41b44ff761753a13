"""miles adapter: the fused form of miles' `miles.backends.training_utils.loss_hub.math_utils.
calculate_log_probs_and_entropy` and of its log-prob step `...loss_hub.logit_processors.get_log_probs_and_entropy`
(snapshot radixark/miles 31f1ca9), computed by areal_lce's fused op from the hidden states and the LM-head
weight shard instead of the [T, V/tp] logits. miles is a fork of slime, but its step and kernel differ (a
per-sample loop over `get_responses`, BSHD as well as THD, `entropy_requires_grad`, a dict result, and a
true-on-policy mode), so this is its own adapter, not slime's under another module path.

    from areal_lce.integrations import miles as lce_miles
    log_prob, entropy = lce_miles.calculate_log_probs_and_entropy(hidden, weight, tokens, tp_group,
                                                                  with_entropy=True, temperature=t)

is, outputs and gradients, miles'
    logits = (hidden @ weight.T).float() / temperature
    log_prob, entropy = calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=True)
  hidden [R, H]: the same on every rank of tp_group; weight [V/tp, H]: rank r owns ids [r·V/tp, (r+1)·V/tp);
  tokens [R]: global ids. Returns (log_prob [R, 1] ([R] in true-on-policy mode), entropy [R] or None); entropy carries gradient only with
  entropy_requires_grad=True. d_hidden is the full gradient on every rank (reduced inside), d_weight this
  rank's shard's. chunk_size is accepted and unused (the op never materialises logits).
Default mode (miles' normal path): softmax over every column of the shard (padding included; miles passes
no vocabulary size there), logits from the GEMM in the input dtype (logits_precision="bf16" for bf16
inputs), fp32 outputs. `vocab_size=` here excludes the padding columns in either mode (the exact mode with
logits_precision="fp32"); to match SGLang pass the HF config's `vocab_size` (not the tokenizer's size).
true_on_policy=True (miles' `--true-on-policy-mode`, which all-gathers the bf16 logits over TP, truncates them
to vocab_size and takes a bf16 `log_softmax`): here the op with logits_precision="bf16" and invariant=True
(each row's result independent of the TP split and the batch, no all-gather of [R, V] logits), the softmax
over the first vocab_size ids, outputs rounded to the logits' dtype (bf16) as miles returns them. Tolerance
against miles (tests/integrations/zero_mismatch_miles_cases.py): one bf16 rounding of the outputs on each side (2⁻⁷
relative; the entropy 2⁻⁶, miles' bf16 exp, products and sum), plus, at a temperature other than 1, one
bf16 rounding of the largest |logit / temperature| (miles rounds the scaled logits to bf16, the op the
unscaled ones); gradients: the op's own bf16 bound plus 2⁻⁸ per bf16 rounding in miles' backward (its
logits gradient: once in normal mode, megatron's fused cross entropy returning it in bf16; twice for the
true-on-policy logprob; five times the bounded terms of its bf16 entropy backward). fp16 models are
refused (the op has no fp16 rounding).

The log-prob step: `log_probs_step(weight_fn)` is miles' `get_log_probs_and_entropy` on the last stage's
hidden states ([1, T, H] THD or [B, S, H] BSHD, full sequence: sequence parallel is refused, as miles'
true-on-policy mode refuses it) instead of its logits, slicing each sample's response rows with miles' own
`get_responses` (zigzag or all-gather CP) and redistributing all-gather CP with its own helper;
`apply(weight_fn)` puts it in place of miles' in the modules that hold the name. The model side is slime's:
`areal_lce.integrations.slime.hidden_states_provider` / `output_weight` (the same megatron GPTModel provider
contract, `--custom-model-provider-path`).
"""
from __future__ import annotations

import importlib
from argparse import Namespace
from typing import Optional

import torch

from ..op import comms
from ..op.api import linear_logprobs_entropy
from ..op.types import VocabParallel
from ._common import (BLOCK_OPTIONS, NO_IGNORE_INDEX, check_no_negative_labels, check_op_options,
                      consistency_options, op_value, patch_all, restore_all, token_rows)
from .nemo_rl import default_precision

_NAME = "areal_lce.integrations.miles.calculate_log_probs_and_entropy"
_STEP = "areal_lce.integrations.miles.log_probs_step"
LOGIT_PROCESSORS = "miles.backends.training_utils.loss_hub.logit_processors"
CP_UTILS = "miles.backends.training_utils.cp_utils"
# the modules that hold the step under its name at call time: the policy loss, the re-export the actor imports
# from, and the megatron actor's own imported name (compute_log_prob)
STEP_TARGETS = ("miles.backends.training_utils.loss_hub.losses", "miles.backends.training_utils.loss",
                "miles.backends.megatron_utils.actor")


def calculate_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    tp_group,
    with_entropy: bool = False,
    entropy_requires_grad: bool = True,
    chunk_size: int = -1,
    true_on_policy: bool = False,
    vocab_size: Optional[int] = None,
    *,
    temperature: float = 1.0,
    logits_precision: Optional[str] = None,
    invariant: Optional[bool] = None,
    check_labels=True,
    **op_options,
):
    """miles' kernel on `(hidden @ weight.T).float() / temperature` -> (log_prob [R], entropy [R] or None);
    contract and modes in the module docstring. `op_options` go to `areal_lce.linear_logprobs_entropy`."""
    check_op_options(op_options, _NAME)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"{_NAME}: chunk_size must be an int (miles' --log-probs-chunk-size), got {chunk_size!r}")
    opts = op_value(op_options, _NAME, temperature)
    tp = comms.checked_group_size(tp_group, f"{_NAME}: tp_group")
    h2, y = token_rows(hidden, tokens, _NAME)
    if true_on_policy:
        if h2.dtype != torch.bfloat16 or logits_precision not in (None, "bf16"):
            raise NotImplementedError(f"{_NAME}: true_on_policy matches miles' bf16 log_softmax: it needs bf16 hidden "
                                      f"states and logits_precision 'bf16' (got {h2.dtype}, {logits_precision!r}); "
                                      "fp16 models have no such rounding in the op")
        logits_precision, invariant = "bf16", (True if invariant is None else invariant)
    if y.numel() == 0:  # miles returns [0] tensors (no [0, 1]) and runs no collective
        empty = h2.new_zeros((0,), dtype=h2.dtype if true_on_policy else torch.float32)
        return empty, (empty.clone() if with_entropy else None)
    consistency = consistency_options(invariant, default_precision(h2.dtype, logits_precision, _NAME), _NAME)
    check_no_negative_labels(y, check_labels, tp, _NAME)
    out = linear_logprobs_entropy(h2, weight, y, opts, vocab_parallel=VocabParallel(tp_group),
                                  vocab_size=vocab_size, ignore_index=NO_IGNORE_INDEX, check_labels=check_labels,
                                  **consistency)
    log_prob, entropy = out.logprobs, (out.entropy if with_entropy else None)
    if entropy is not None and not entropy_requires_grad:
        entropy = entropy.detach()
    if true_on_policy:  # miles' bf16 log_softmax returns bf16 values, [R]
        return log_prob.to(h2.dtype), (None if entropy is None else entropy.to(h2.dtype))
    return log_prob.unsqueeze(-1), entropy  # miles' normal mode: megatron's cross entropy's [R, 1]


def log_probs_step(weight_fn, *, logit_processors=None, cp_utils=None, **options):
    """miles' `get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
    with_entropy=False, entropy_requires_grad=True, non_loss_data=True, max_seq_lens=None)` taking the last
    stage's hidden states in place of the logits and `weight_fn()` (the LM-head weight shard at call time).
    Returns miles' `{"log_probs": [R_i], "entropy": [R_i]}`. `options`: the building block's (vocab_size,
    logits_precision, invariant, check_labels) and the op's tuning options; args.vocab_size is used in
    true-on-policy mode, as miles uses it. `logit_processors` / `cp_utils`: miles' modules (imported by name
    when not given)."""
    check_op_options(options, _STEP, block=BLOCK_OPTIONS)
    if not callable(weight_fn):
        raise TypeError(f"{_STEP}: weight_fn must be a callable returning the LM-head weight shard, got {weight_fn!r}")
    lp_mod = logit_processors or importlib.import_module(LOGIT_PROCESSORS)
    cp_mod = cp_utils or importlib.import_module(CP_UTILS)

    def get_log_probs_and_entropy(hidden, *, args, unconcat_tokens, total_lengths, response_lengths,
                                  with_entropy=False, entropy_requires_grad=True, non_loss_data=True,
                                  max_seq_lens=None):
        if not non_loss_data:
            raise ValueError(f"{_STEP}: non_loss_data=False is not a mode of miles' step either")
        if getattr(args, "sequence_parallel", False):
            raise NotImplementedError(f"{_STEP}: sequence parallel hands this rank a shard of the rows; miles slices "
                                      "samples from the full sequence (and its true-on-policy mode disables it)")
        if not torch.is_tensor(hidden) or hidden.dim() != 3:
            raise ValueError(f"{_STEP}: hidden must be the last stage's [1, T, H] (THD) or [B, S, H] (BSHD), got "
                             f"{tuple(getattr(hidden, 'shape', ()))}")
        weight = weight_fn()
        true_on_policy = bool(getattr(args, "true_on_policy_mode", False))
        # miles' own slicing, on hidden rows: no temperature (the op applies it) and no dtype cast there
        plain = Namespace(**{**vars(args), "rollout_temperature": 1.0, "true_on_policy_mode": False})
        pieces = list(lp_mod.get_responses(hidden, args=plain, unconcat_tokens=unconcat_tokens,
                                           total_lengths=total_lengths, response_lengths=response_lengths,
                                           max_seq_lens=max_seq_lens))
        lengths = [int(tok.shape[0]) for _, tok in pieces]
        rows = torch.cat([h for h, _ in pieces]).to(weight.dtype)  # Float16Module's fp32: back, exactly
        tokens = torch.cat([tok for _, tok in pieces]).to(torch.long)
        opts = dict(options)
        if true_on_policy and opts.get("vocab_size") is None:
            opts["vocab_size"] = getattr(args, "vocab_size", None)
        temperature = args.rollout_temperature if args.rollout_temperature > 0 else 1.0
        log_prob, entropy = calculate_log_probs_and_entropy(
            rows, weight, tokens, lp_mod.get_parallel_state().tp.group, with_entropy, entropy_requires_grad,
            getattr(args, "log_probs_chunk_size", -1), true_on_policy, temperature=temperature, **opts)
        res = {"log_probs": list(log_prob.reshape(-1).split(lengths))}
        if with_entropy:
            res["entropy"] = list(entropy.split(lengths))
        if args.allgather_cp:
            cp_mod.allgather_cp_redistribute(res, logits=hidden, args=args, total_lengths=total_lengths,
                                             response_lengths=response_lengths, max_seq_lens=max_seq_lens)
        return res

    return get_log_probs_and_entropy


def apply(weight_fn, **options) -> list:
    """Put `log_probs_step(weight_fn, ...)` in place of miles' `get_log_probs_and_entropy` in STEP_TARGETS;
    returns the patched names, `remove()` undoes it. Run it in every training process (a
    `--custom-megatron-init-path` hook), with a model whose last stage returns hidden states."""
    step = log_probs_step(weight_fn, **options)
    return patch_all(STEP_TARGETS, "get_log_probs_and_entropy", step)


def remove() -> list:
    """Restore miles' own step where `apply()` replaced it; returns the restored names."""
    return restore_all(STEP_TARGETS, "get_log_probs_and_entropy")


def megatron_init(args) -> list:
    """`--custom-megatron-init-path areal_lce.integrations.miles.megatron_init`: `apply` with the model built by
    `areal_lce.integrations.slime.hidden_states_provider` (its `output_weight`) and the default semantics."""
    from .slime import output_weight

    return apply(output_weight)
