"""SFT loss: token-mean negative log-likelihood over the non-ignored tokens of the global batch.

The engine calls the loss once per microbatch with `TokenStats` (per-token logprobs, entropy and
logit extremes, 0 where labels == -100) and sums the returned losses. The loss reads only the logprobs
(`logprobs_only`): with `engine.use_fused_linear_ce: false` the engine then computes them with
megatron-core's own `labels=` loss (megatron/own_loss.py), whose stats have no entropy or logit
extremes (None), and the records hold nll and tokens only; Megatron's DDP then averages
gradients over data-parallel ranks. Dividing each microbatch's NLL sum by
``global_target_tokens / dp_size`` therefore makes the gradient that of the NLL averaged over every
target token of the global batch, independent of how tokens fall into microbatches and ranks.
"""
from __future__ import annotations

import math

import torch

from .data import IGNORE_INDEX


class SFTLoss:
    """`loss_fn` for `engine.train_step`: NLL sum / `denom`, recording detached per-microbatch sums.

    `denom` is the number of target tokens this rank's loss is normalised by (global batch targets
    divided by the data-parallel size). After the step, `sums()` returns this rank's totals:
    nll (sum of -logprob), entropy (sum), tokens, max_logit, min_logit over its target tokens; the last
    three only where the stats hold them (not on megatron-core's own loss path).
    """

    logprobs_only = True  # the loss reads stats.logprobs alone (MegatronEngine.uses_megatron_loss)

    def __init__(self, denom: float, ignore_index: int = IGNORE_INDEX):
        if not denom > 0:
            raise ValueError(f"SFTLoss: denom={denom} must be > 0 (a global batch without target tokens)")
        self.denom = float(denom)
        self.ignore_index = ignore_index
        self.records: list[dict] = []

    def __call__(self, stats, mb):
        labels = mb.labels.to(stats.logprobs.device)  # a no-op under train_step (it stages mb on the device)
        mask = labels != self.ignore_index
        nll_sum = -(stats.logprobs * mask).sum()
        loss = nll_sum / self.denom
        with torch.no_grad():  # 0-d fp64 device values, read once by sums() after the step
            rec = {"nll": nll_sum.detach().double(), "tokens": mask.sum().double()}
            if stats.entropy is not None:  # None on megatron-core's own loss path: no logits kept
                rec.update(entropy=(stats.entropy.detach() * mask).sum().double(),
                           max_logit=masked_extreme(stats.max_logit, mask, "max"),
                           min_logit=masked_extreme(stats.min_logit, mask, "min"))
        self.records.append(rec)
        return loss, {"token_nll": rec["nll"] / rec["tokens"].clamp_min(1)}

    def sums(self) -> dict:
        """This rank's totals as floats (one device read for all of them); entropy, max_logit and
        min_logit only where the records hold them."""
        out = {"nll": 0.0, "entropy": 0.0, "tokens": 0.0, "max_logit": -math.inf, "min_logit": math.inf}
        if self.records:
            out = {k: v for k, v in out.items() if k in self.records[0]}
            reduce = {"max_logit": "max", "min_logit": "min"}
            totals = torch.stack([getattr(torch.stack([r[k] for r in self.records]), reduce.get(k, "sum"))()
                                  for k in out])
            out = dict(zip(out, totals.tolist()))
        out["tokens"] = int(out["tokens"])
        return out


def masked_extreme(x: torch.Tensor, mask: torch.Tensor, reduce: str) -> torch.Tensor:
    """max or min (`reduce`) of x over the masked positions as a 0-d fp64 device value, without a host
    sync (no boolean indexing); -inf / +inf where the mask is empty."""
    fill = -math.inf if reduce == "max" else math.inf
    x = x.detach().double()
    return getattr(torch.where(mask, x, torch.full_like(x, fill)), reduce)()
