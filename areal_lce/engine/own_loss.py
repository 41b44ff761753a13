"""megatron-core's own loss path: the model's `labels=` loss, as a Megatron-LM user runs it.

    out = megatron_loss_call(model, gpt, batch)   # packed [b, s', 4] on the last stage, hidden states elsewhere
    stats = logprobs_only(batch.stats(out))        # TokenStats(logprobs=-CE, entropy=None, ...)

With `engine.use_fused_linear_ce: false`, a loss that reads only the per-token logprobs (the SFT loss:
`logprobs_only = True` on the loss function) is computed by GPTModel itself: its output layer builds
the logits and `LanguageModule.compute_language_model_loss` takes the per-token cross entropy with
`tensor_parallel.vocab_parallel_cross_entropy`, or with `fused_vocab_parallel_cross_entropy` under
`engine.model.cross_entropy_loss_fusion`. Tensor, sequence and context parallelism and packed (THD)
sequences run as megatron runs them. Megatron's CE has no ignore_index: positions without a target get
label 0 and a `loss_mask` of 0, and the per-token loss is multiplied by that mask, as Megatron-LM's
`loss_func` does. Two differences from areal_lce's routes follow from running megatron's own code:
  * no entropy and no logit extremes: `logprobs_only` returns them as None (the SFT job drops those
    metrics);
  * megatron's softmax runs over the padded vocabulary (`make_vocab_size_divisible_by` x TP), where
    areal_lce's routes exclude the padded rows: the losses agree where the vocabulary is not padded.
There is no temperature on this path: a micro-batch at a temperature other than 1 is refused.
"""
from __future__ import annotations

import torch

from ..op.checks import check_temperature
from ..megatron.stats import TokenStats


def check_temperature_one(temperature) -> None:
    """megatron's loss has no temperature: refuse any other than 1 (a valid one, checks.check_temperature's
    rule, that is not 1), naming the path."""
    if torch.is_tensor(temperature) or check_temperature(temperature, "temperature") != 1.0:
        raise ValueError(f"temperature={temperature!r}: megatron-core's own loss (use_fused_linear_ce=false with a "
                         "logprobs-only loss) has no temperature; use 1.0, or use_fused_linear_ce=true")


def megatron_loss_call(model, gpt, batch, ignore_index: int = -100) -> torch.Tensor:
    """One model call through GPTModel's `labels=` loss: on the last pipeline stage packed [b, s', 4]
    (-CE·loss_mask, 0, 0, 0) in the model's token layout (what `ModelBatch.stats` takes), the decoder's
    output on the other stages. `model` is what is called (DDP / Float16Module), `gpt` the bare GPTModel."""
    valid = batch.labels != ignore_index
    labels = torch.where(valid, batch.labels, torch.zeros_like(batch.labels))  # megatron's CE indexes every label
    loss_mask = valid.float()
    out = model(batch.input_ids, batch.position_ids, batch.attention_mask, labels=labels, loss_mask=loss_mask,
                packed_seq_params=batch.packed_seq_params)
    if not gpt.post_process:
        return out
    if tuple(out.shape) != tuple(labels.shape):
        raise ValueError(f"GPTModel's labels= loss {tuple(out.shape)} is not laid out like the labels "
                         f"{tuple(labels.shape)}")
    nll = out.float() * loss_mask  # Megatron-LM's loss_func: the per-token losses times the loss mask
    zero = torch.zeros_like(nll)
    return torch.stack([-nll, zero, zero, zero], dim=-1)


def logprobs_only(stats: TokenStats) -> TokenStats:
    """The statistics megatron's own loss gives: logprobs (-CE, 0 where there is no target); entropy,
    max_logit and min_logit None (never built)."""
    return TokenStats(stats.logprobs, None, None, None)
