"""SFT loss: token-mean negative log-likelihood over the non-ignored tokens of the global batch.

The engine calls the loss once per microbatch with `TokenStats` (per-token logprobs, entropy and
logit extremes, 0 where labels == -100) and sums the returned losses; Megatron's DDP then averages
gradients over data-parallel ranks. Dividing each microbatch's NLL sum by
``global_target_tokens / dp_size`` therefore makes the gradient that of the NLL averaged over every
target token of the global batch, independent of how tokens fall into microbatches and ranks.
"""
from __future__ import annotations

import torch

from .data import IGNORE_INDEX


class SFTLoss:
    """`loss_fn` for `engine.train_step`: NLL sum / `denom`, recording detached per-microbatch sums.

    `denom` is the number of target tokens this rank's loss is normalised by (global batch targets
    divided by the data-parallel size). After the step, `sums()` returns this rank's totals:
    nll (sum of -logprob), entropy (sum), tokens, max_logit, min_logit over its target tokens.
    """

    def __init__(self, denom: float, ignore_index: int = IGNORE_INDEX):
        if not denom > 0:
            raise ValueError(f"SFTLoss: denom={denom} must be > 0 (a global batch without target tokens)")
        self.denom = float(denom)
        self.ignore_index = ignore_index
        self.records: list[dict] = []

    def __call__(self, stats, mb):
        labels = mb.labels.to(stats.logprobs.device)  # batches are built on the host
        mask = labels != self.ignore_index
        nll_sum = -(stats.logprobs * mask).sum()
        loss = nll_sum / self.denom
        with torch.no_grad():
            n = int(mask.sum())
            rec = {
                "nll": float(nll_sum),
                "entropy": float((stats.entropy.detach() * mask).sum()),
                "tokens": n,
                "max_logit": float(stats.max_logit.detach()[mask].max()) if n else float("-inf"),
                "min_logit": float(stats.min_logit.detach()[mask].min()) if n else float("inf"),
            }
        self.records.append(rec)
        return loss, {"token_nll": rec["nll"] / max(n, 1)}

    def sums(self) -> dict:
        out = {"nll": 0.0, "entropy": 0.0, "tokens": 0, "max_logit": float("-inf"), "min_logit": float("inf")}
        for r in self.records:
            out["nll"] += r["nll"]
            out["entropy"] += r["entropy"]
            out["tokens"] += r["tokens"]
            out["max_logit"] = max(out["max_logit"], r["max_logit"])
            out["min_logit"] = min(out["min_logit"], r["min_logit"])
        return out
