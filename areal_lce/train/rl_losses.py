"""GRPO/PPO losses on per-token (logprobs, entropy), whichever route produced them.

Everything here is plain tensor math on [B, S] tensors with a 0/1 response mask: no model, no
communication. `rl_loss` is the `loss_fn` handed to `MegatronEngine.train_step`; it reads the
rollout tensors the RL loop puts in each `PolicyMicroBatch`:

  old_logprobs  [B, S] behaviour-policy logprobs (no grad, same temperature)
  rollout_logprobs  [B, S] the sampler's own logprobs of the response tokens (`generate(...,
                return_logprobs=True)`), for the train-vs-rollout metrics (`rollout_mismatch`)
  ref_logprobs  [B, S] frozen reference-policy logprobs (no grad), needed when kl_coef > 0
  advantages    [B]    one advantage per sequence (broadcast over its response tokens)
  num_tokens    total response tokens of the minibatch this microbatch belongs to
  num_seqs      total sequences of that minibatch

so that the microbatch losses the engine sums add up to the minibatch's aggregate (see `aggregate`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from ..engine.microbatch import MicroBatch
from .losses import masked_extreme

# log-ratio clamp of the k3 estimator: exp(20) ~ 5e8 keeps the penalty finite in fp32 when the policy
# has moved far from the reference on a rare token.
_K3_LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True, kw_only=True)
class PolicyMicroBatch(MicroBatch):
    """A MicroBatch of rollout rows with the policy-gradient loss inputs (module docstring)."""

    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    ref_logprobs: Optional[torch.Tensor] = None
    rollout_logprobs: Optional[torch.Tensor] = None
    num_tokens: Optional[int] = None
    num_seqs: Optional[int] = None

    def __post_init__(self):
        super().__post_init__()
        for name in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != tuple(self.labels.shape):
                raise ValueError(f"PolicyMicroBatch.{name} {tuple(t.shape)} must match labels {tuple(self.labels.shape)}")
        if self.advantages.shape[0] != self.rows:
            raise ValueError(f"PolicyMicroBatch.advantages {tuple(self.advantages.shape)}: one value per row "
                             f"({self.rows}) expected")


def rollout_mismatch(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
                     ) -> Dict[str, torch.Tensor]:
    """How far the trainer's logprobs [B, S] are from the sampler's on the same response tokens (`mask`),
    as 0-d fp64 device tensors to reduce over micro-batches and ranks: `abs_diff_max` and `abs_diff_sum` of
    |lp_train - lp_rollout|, `tokens` (the count), `ratio_dev_max` = max |exp(lp_train - lp_rollout) - 1|
    (the importance ratio's distance from 1). Maxima are 0 over no token."""
    mask = mask.to(logprobs.device)
    d = (logprobs.detach().double() - rollout_logprobs.to(logprobs.device).double()).masked_fill(~mask, 0.0)
    zero = d.new_zeros(())
    return {"abs_diff_max": d.abs().amax() if d.numel() else zero,
            "abs_diff_sum": d.abs().sum(),
            "tokens": mask.sum().double(),
            "ratio_dev_max": torch.expm1(d).abs().amax() if d.numel() else zero}


def group_advantages(rewards: torch.Tensor, group_size: int, *, std_norm: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: rewards [G * group_size] laid out group by group -> (r - mean) / (std + eps).

    std is the population std of the group (correction 0), so a group of identical rewards gets 0
    advantage and no group can produce NaN. std_norm=False keeps only the mean-centring.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(rewards.shape)}")
    r = rewards.float().view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if std_norm:
        adv = adv / (r.std(dim=1, correction=0, keepdim=True) + eps)
    return adv.reshape(-1)


def batch_advantages(rewards: torch.Tensor, *, std_norm: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Critic-free PPO advantages: the whole batch is one group (REINFORCE with a batch baseline)."""
    return group_advantages(rewards.reshape(-1), rewards.numel(), std_norm=std_norm, eps=eps)


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *,
                  clip_low: float, clip_high: float, dual_clip: float = 0.0
                  ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Per-token PPO clipped surrogate loss (to be minimised), shape of `logprobs`.

    ratio = exp(logprobs - old_logprobs);  loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)).
    Dual clip (c = dual_clip > 1): for A < 0 the loss is further capped at -A * c, so a token whose
    ratio exploded cannot dominate the step. `advantages` broadcasts against `logprobs`.
    Returns (loss, {"ratio", "clipped", "dual_clipped"}) where the masks are bool tensors.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    surr = -advantages * ratio
    surr_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(surr, surr_clipped)
    clipped = surr_clipped > surr
    dual_clipped = torch.zeros_like(clipped)
    if dual_clip:
        cap = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (loss > cap)
        loss = torch.where(dual_clipped, cap.expand_as(loss), loss)
    return loss, {"ratio": ratio.detach(), "clipped": clipped, "dual_clipped": dual_clipped}


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi.

    k1 = log pi - log pi_ref (unbiased, can be negative per token);
    k3 = exp(d) - d - 1 with d = log pi_ref - log pi (unbiased, >= 0, lower variance).
    """
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k3":
        d = (ref_logprobs - logprobs).clamp(-_K3_LOG_RATIO_CLAMP, _K3_LOG_RATIO_CLAMP)
        return torch.exp(d) - d - 1.0
    raise ValueError(f"kl estimator {estimator!r}: expected 'k1' or 'k3'")


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, *, num_tokens=None,
              num_seqs=None) -> torch.Tensor:
    """Reduce per-token `values` [B, S] over the response `mask` [B, S] to a scalar.

    token-mean                Σ v·m / num_tokens
    sequence-mean-token-mean  Σ_b (Σ_t v·m / n_b) / num_seqs     (n_b = tokens of sequence b, >= 1)
    sequence-mean-token-sum   Σ_b Σ_t v·m / num_seqs
    num_tokens / num_seqs default to this batch's own counts; the RL loop passes the minibatch totals
    so that the microbatch results sum to the minibatch aggregate.
    """
    mask = mask.to(values.dtype)
    masked = values * mask
    if mode == "token-mean":
        if num_tokens is None:  # this batch's count, kept on the device (no host read)
            return masked.sum() / mask.sum().clamp_min(1.0)
        return masked.sum() / max(float(num_tokens), 1.0)
    denom = values.shape[0] if num_seqs is None else num_seqs
    per_seq = masked.sum(dim=-1)
    if mode == "sequence-mean-token-mean":
        per_seq = per_seq / mask.sum(dim=-1).clamp_min(1.0)
    elif mode != "sequence-mean-token-sum":
        raise ValueError(f"loss aggregation {mode!r}: expected token-mean, sequence-mean-token-mean "
                         "or sequence-mean-token-sum")
    return per_seq.sum() / max(float(denom), 1.0)


def rl_loss(stats, mb: PolicyMicroBatch, cfg) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The engine's loss_fn: PPO surrogate + kl_coef * KL(ref) - entropy_coef * H, aggregated by cfg.loss_agg.

    `stats` has [B, S] `logprobs`, `entropy` (and optionally `max_logit`, `min_logit`) with grad;
    `mb` is a PolicyMicroBatch (module docstring); `cfg` is an `RLConfig`.
    Metrics are token means over this microbatch's response tokens, as floats.
    """
    lp, ent = stats.logprobs, stats.entropy
    dev = lp.device  # rollout tensors live on the host; the stats on the engine's device
    mask = mb.labels.to(dev) != -100
    old = mb.old_logprobs.to(dev, lp.dtype)
    adv = mb.advantages.to(dev, lp.dtype)
    if adv.dim() == 1:
        adv = adv[:, None]
    pg, info = ppo_clip_loss(lp, old, adv, clip_low=cfg.clip_eps,
                             clip_high=cfg.clip_high, dual_clip=cfg.dual_clip)
    per_token = pg
    if cfg.entropy_coef:
        per_token = per_token - cfg.entropy_coef * ent
    kl = None
    if mb.ref_logprobs is not None:
        kl = kl_penalty(lp, mb.ref_logprobs.to(dev, lp.dtype), cfg.kl_estimator)
        if cfg.kl_coef:
            per_token = per_token + cfg.kl_coef * kl
    elif cfg.kl_coef:
        raise ValueError("rl.kl_coef > 0 but the microbatch has no ref_logprobs")
    agg = dict(mode=cfg.loss_agg, num_tokens=mb.num_tokens, num_seqs=mb.num_seqs)
    loss = aggregate(per_token, mask, **agg)

    with torch.no_grad():  # 0-d device tensors: the engine reduces them once per step (no host sync here)
        n = mask.sum().clamp_min(1).float()
        some = mask.any()

        def tok_mean(x):
            return ((x.float() * mask).sum() / n).detach()

        def masked(x, reduce):  # max / min over this microbatch's response tokens; 1.0 with none
            out = masked_extreme(x.float(), mask, reduce)
            return torch.where(some, out, torch.ones_like(out))

        ratio = info["ratio"]
        metrics = {
            "pg_loss": tok_mean(pg),
            "entropy": tok_mean(ent),
            "clip_frac": tok_mean(info["clipped"]),
            "dual_clip_frac": tok_mean(info["dual_clipped"]),
            "ratio_mean": torch.where(some, tok_mean(ratio), torch.ones_like(n)),
            "ratio_max": masked(ratio, "max"),
            "ratio_min": masked(ratio, "min"),
            # k3 estimate of KL(pi || pi_behaviour): how far this update has moved off the sampler
            "approx_kl": tok_mean(kl_penalty(lp.detach(), old, "k3")),
            "kl": tok_mean(kl) if kl is not None else 0.0,
        }
        # extremes of the raw (pre-temperature) vocab logits over this microbatch's response tokens
        if getattr(stats, "max_logit", None) is not None:
            metrics["max_logit"] = masked(stats.max_logit, "max")
            metrics["min_logit"] = masked(stats.min_logit, "min")
    return loss, metrics
