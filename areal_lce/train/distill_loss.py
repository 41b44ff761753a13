"""On-policy distillation losses on per-token statistics, whichever route produced them.

Plain tensor math, no model and no communication. Per response position (labels != ignore_index), with
S = the teacher's top-k token ids there, p the teacher's and q the student's distributions (both at the
sampling temperature):

  forward KL on the support, with a tail bucket (what `forward_kl_topk` computes):
      KL_S(p || q) = Σ_{i in S} p_i (log p_i - log q_i) + p_tail (log p_tail - log q_tail),
      p_tail = 1 - Σ_{i in S} p_i,  q_tail = 1 - Σ_{i in S} q_i.
  It is the exact KL between p and q coarsened to S + one bucket for the rest of the vocabulary: >= 0,
  0 only when q matches p on every id of S (and so on the tail's total mass), and a lower bound of the
  full KL(p || q). Unlike the KL of p and q renormalised on S, it also pulls the student's total mass
  onto S (a fresh student spreads its mass over the whole vocabulary).
  Tail masses are floored at TAIL_FLOOR (below it 1 - Σ p is rounding of the k logprobs).

  reverse KL on the sampled token y ~ q (optional, weight `distill.reverse_kl_coef`):
      sg(log q(y) - log p(y)) · log q(y)
  whose gradient is the REINFORCE estimate of ∇ KL(q || p) (the expected score E_q ∇ log q is 0); its
  value is logged as reverse_kl = mean of log q(y) - log p(y), the k1 estimate of KL(q || p).

`distill_loss` is the `loss_fn` of `MegatronEngine.train_step`: the student's stats carry
`selected_logprobs` at the teacher's ids (`DistillMicroBatch.selected_ids`); the loss is the token mean
over the minibatch's response tokens (`num_tokens`), so the engine's sum over micro-batches is that mean.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from ..engine.microbatch import MicroBatch

IGNORE_INDEX = -100
# Logprobs of fp32 logits of magnitude up to 64 carry absolute errors up to ulp(64) = 2^-17 each, so the
# tail 1 - Σ_{i in S} p_i, a difference of numbers near 1, is rounding below about 2^-16: both tails are
# floored there (no log of 0 or of a negative rounding residue, no unbounded push on a vanishing tail).
TAIL_FLOOR = 2.0 ** -16


@dataclass(frozen=True, kw_only=True)
class DistillMicroBatch(MicroBatch):
    """Rollout rows with the teacher's answer per response position: `selected_ids` [B, S, k] its top-k ids
    (the student's logprobs are taken there), `teacher_logprobs` [B, S, k] its logprobs of them,
    `teacher_token_logprobs` [B, S] its logprob of the sampled token; `num_tokens`: response tokens of the
    minibatch this micro-batch belongs to (the token mean's denominator)."""

    teacher_logprobs: torch.Tensor
    teacher_token_logprobs: torch.Tensor
    num_tokens: Optional[int] = None
    num_seqs: Optional[int] = None  # sequences of the minibatch (set by rl.minibatch_plan; not read)

    def __post_init__(self):
        super().__post_init__()
        if self.selected_ids is None:
            raise ValueError("DistillMicroBatch.selected_ids (the teacher's top-k ids) is required")
        if tuple(self.teacher_logprobs.shape) != tuple(self.selected_ids.shape):
            raise ValueError(f"DistillMicroBatch.teacher_logprobs {tuple(self.teacher_logprobs.shape)} must match "
                             f"selected_ids {tuple(self.selected_ids.shape)}")
        if tuple(self.teacher_token_logprobs.shape) != tuple(self.labels.shape):
            raise ValueError(f"DistillMicroBatch.teacher_token_logprobs {tuple(self.teacher_token_logprobs.shape)} "
                             f"must match labels {tuple(self.labels.shape)}")


def _tail(logprobs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """1 - Σ exp(logprobs) over the valid entries of the last dim, as -expm1(logsumexp): exact near 0."""
    masked = logprobs.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(masked, dim=-1)
    return -torch.expm1(torch.where(valid.any(-1), lse, torch.full_like(lse, float("-inf"))))


def forward_kl_topk(student: torch.Tensor, teacher: torch.Tensor, ids: torch.Tensor,
                    ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """KL_S(p || q) per position (module docstring): `student` [..., k] log q at the teacher's ids `ids`
    [..., k] (differentiable), `teacher` [..., k] log p there; entries whose id is ignore_index are left
    out of the support. Returns [...] fp32."""
    if student.shape != teacher.shape or ids.shape != student.shape:
        raise ValueError(f"forward_kl_topk: student {tuple(student.shape)}, teacher {tuple(teacher.shape)} and ids "
                         f"{tuple(ids.shape)} must have the same shape [..., k]")
    s, t = student.float(), teacher.to(student.device, torch.float32).detach()
    valid = ids.to(student.device) != ignore_index
    p = torch.where(valid, t.exp(), torch.zeros_like(t))
    on_support = (p * torch.where(valid, t - s, torch.zeros_like(s))).sum(-1)
    p_tail = _tail(t, valid).clamp_min(0.0)
    log_p_tail = p_tail.clamp_min(TAIL_FLOOR).log()
    log_q_tail = _tail(s, valid).clamp_min(TAIL_FLOOR).log()
    return on_support + p_tail * (log_p_tail - log_q_tail)


def reverse_kl_sampled(student: torch.Tensor, teacher: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per sampled token: (the REINFORCE surrogate sg(log q - log p) · log q, the k1 value log q - log p)."""
    diff = student.float() - teacher.to(student.device, torch.float32)
    return diff.detach() * student.float(), diff.detach()


def token_mean(x: torch.Tensor, mask: torch.Tensor, num_tokens: Optional[int]) -> torch.Tensor:
    """Σ x over `mask` / num_tokens (the minibatch's tokens; this micro-batch's when None)."""
    n = num_tokens if num_tokens is not None else mask.sum().clamp_min(1)
    return torch.where(mask, x, torch.zeros_like(x)).sum() / n


def distill_loss(stats, mb: DistillMicroBatch, reverse_kl_coef: float = 0.0
                 ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The student's loss on one micro-batch: token mean of KL_S(p || q) (+ reverse_kl_coef x the sampled
    token's reverse-KL surrogate), and its metrics as 0-d device tensors (this micro-batch's token means)."""
    if getattr(stats, "selected_logprobs", None) is None:
        raise ValueError("distill_loss needs the student's selected_logprobs: run it through "
                         "MegatronEngine.train_step with micro-batches carrying selected_ids")
    dev = stats.logprobs.device
    mask = mb.labels.to(dev) != IGNORE_INDEX
    fkl = forward_kl_topk(stats.selected_logprobs, mb.teacher_logprobs, mb.selected_ids)
    per_token = fkl
    surrogate, rkl = reverse_kl_sampled(stats.logprobs, mb.teacher_token_logprobs)
    if reverse_kl_coef:
        per_token = per_token + reverse_kl_coef * surrogate
    loss = token_mean(per_token, mask, mb.num_tokens)
    with torch.no_grad():  # 0-d device tensors: the engine reduces them once per step
        metrics = {"kl_fwd": token_mean(fkl.detach(), mask, None),
                   "reverse_kl": token_mean(rkl, mask, None),
                   "entropy": token_mean(stats.entropy.detach().float(), mask, None)}
    return loss, metrics
