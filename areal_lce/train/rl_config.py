"""The `rl:` section of the job config (GRPO and PPO jobs).

Plain dataclass with a help string per field; `__post_init__` checks cross-field constraints and names
the offending option. The train package's YAML loader nests it into `JobConfig.rl`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Tuple, Union

from ..op.checks import check_temperature

LOSS_AGG_MODES = ("token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum")
KL_ESTIMATORS = ("k1", "k3")
ADVANTAGES = ("auto", "group", "batch")
AUTO_LOGPROB_TOKENS = 16384  # rl.logprob_max_tokens="auto" on the fused route


@dataclass
class RLConfig:
    # --- task and reward -------------------------------------------------------------------------
    task: str = field(
        default="say_letter",
        metadata={"help": "prompt source: a name from areal_lce.train.tasks.TASKS (say_letter, addition) "
                  "or a dotted path 'pkg.module:Name' to a task class (with sample(n, rng) and "
                  "default_reward) or a function marked @areal_lce.train.tasks.task_factory; the config "
                  "names code to run: trust it like code"},
    )
    task_options: Any = field(
        default_factory=dict,
        metadata={"help": "mapping of keyword arguments for the task's constructor, e.g. {letters: AB}"},
    )
    reward_fn: str = field(
        default="",
        metadata={"help": "dotted path 'pkg.module:function' of the reward, called as "
                  "fn(prompt=str, response=str, answer=str) -> float (its signature is checked first); "
                  "empty: the task's default reward"},
    )
    # --- rollout -----------------------------------------------------------------------------------
    prompts_per_step: int = field(
        default=8, metadata={"help": "distinct prompts per RL step (over all data-parallel ranks)"}
    )
    group_size: int = field(
        default=8, metadata={"help": "responses sampled per prompt (the GRPO group)"}
    )
    max_new_tokens: int = field(default=8, metadata={"help": "response length limit in tokens"})
    temperature: float = field(
        default=1.0,
        metadata={"help": "sampling temperature, a finite float > 0; behaviour, reference and trained "
                  "logprobs are all taken at this temperature (logits / T), matching the sampler"},
    )
    top_p: float = field(default=1.0, metadata={"help": "nucleus-sampling mass in (0, 1]"})
    stop_at_eos: bool = field(
        default=True, metadata={"help": "end a response at the tokenizer's EOS token (kept in the response)"}
    )
    logprob_max_tokens: Union[int, str] = field(
        default="auto",
        metadata={"help": "tokens per forward of the behaviour and reference logprob passes (no grad: "
                  "nothing is kept between micro-batches): consecutive sequences are run together up to "
                  "this many packed tokens (padded rows x width with engine.pack_sequences=false). 'auto': "
                  f"{AUTO_LOGPROB_TOKENS} on the fused route, which holds no [tokens, vocab] logits; trainer.micro_batch_size "
                  "sequences per forward on the materialised route (use_fused_linear_ce=false), whose "
                  "forward holds the [tokens, vocab] logits the output layer builds"},
    )
    # --- advantages --------------------------------------------------------------------------------
    advantage: str = field(
        default="auto",
        metadata={"help": f"one of {ADVANTAGES}: group = (r - group mean) / (group std + eps) (GRPO); "
                  "batch = same over the whole step's batch (critic-free PPO); auto = group for "
                  "job grpo, batch for job ppo"},
    )
    adv_std_norm: bool = field(
        default=True, metadata={"help": "divide advantages by the std (false: mean-centred only, Dr. GRPO)"}
    )
    adv_eps: float = field(default=1e-6, metadata={"help": "added to the std before dividing"})
    # --- policy update -----------------------------------------------------------------------------
    ppo_epochs: int = field(default=1, metadata={"help": "passes over each rollout batch"})
    minibatches: int = field(
        default=1,
        metadata={"help": "optimizer steps per epoch (the step's batch is split into this many; each is "
                  "run in microbatches of trainer.micro_batch_size sequences)"}
    )
    clip_eps: float = field(default=0.2, metadata={"help": "PPO ratio clip: lower bound 1 - clip_eps"})
    clip_eps_high: Optional[float] = field(
        default=None, metadata={"help": "upper bound 1 + clip_eps_high (None: clip_eps; larger = clip-higher)"}
    )
    dual_clip: float = field(
        default=0.0,
        metadata={"help": "dual-clip constant c > 1 bounding the loss of negative-advantage tokens at "
                  "c * |A| (0: off)"},
    )
    entropy_coef: float = field(default=0.0, metadata={"help": "weight of the entropy bonus (loss -= coef * H)"})
    kl_coef: float = field(
        default=0.0, metadata={"help": "weight of the KL penalty to the frozen reference policy"}
    )
    kl_estimator: str = field(
        default="k3",
        metadata={"help": f"one of {KL_ESTIMATORS}: k1 = log p - log p_ref, k3 = exp(log p_ref - log p) "
                  "- (log p_ref - log p) - 1 (unbiased, >= 0)"},
    )
    loss_agg: str = field(
        default="token-mean",
        metadata={"help": f"one of {LOSS_AGG_MODES}: mean over all response tokens of the minibatch; "
                  "mean over sequences of each sequence's token mean; mean over sequences of token sums"},
    )

    def __post_init__(self):
        for name in ("prompts_per_step", "group_size", "max_new_tokens", "ppo_epochs", "minibatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"rl.{name}={getattr(self, name)} must be >= 1")
        if not isinstance(self.task_options, dict):
            raise ValueError(f"rl.task_options={self.task_options!r} must be a mapping")
        self.temperature = check_temperature(self.temperature, "rl.temperature", allow_tensor=False)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"rl.top_p={self.top_p} must be in (0, 1]")
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"rl.advantage={self.advantage!r}: expected one of {ADVANTAGES}")
        if self.adv_eps < 0:
            raise ValueError(f"rl.adv_eps={self.adv_eps} must be >= 0")
        self.advantage_for(None)
        if not 0.0 < self.clip_eps < 1.0:
            raise ValueError(f"rl.clip_eps={self.clip_eps} must be in (0, 1)")
        if self.clip_eps_high is not None and not self.clip_eps_high > 0:
            raise ValueError(f"rl.clip_eps_high={self.clip_eps_high} must be > 0")
        if self.dual_clip and not self.dual_clip > 1.0:
            raise ValueError(f"rl.dual_clip={self.dual_clip} must be > 1 (or 0 to turn it off)")
        if self.entropy_coef < 0 or self.kl_coef < 0:
            raise ValueError("rl.entropy_coef and rl.kl_coef must be >= 0")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"rl.kl_estimator={self.kl_estimator!r}: expected one of {KL_ESTIMATORS}")
        if self.loss_agg not in LOSS_AGG_MODES:
            raise ValueError(f"rl.loss_agg={self.loss_agg!r}: expected one of {LOSS_AGG_MODES}")
        lmt = self.logprob_max_tokens
        if lmt != "auto" and (isinstance(lmt, bool) or not isinstance(lmt, int) or lmt < 1):
            raise ValueError(f"rl.logprob_max_tokens={lmt!r}: expected an int >= 1 or 'auto'")
        self.rank_split(dp_size=1)  # the divisibility that every data-parallel size needs

    def advantage_for(self, job: Optional[str]) -> str:
        """The advantage estimator of job `job` (grpo | ppo): rl.advantage with 'auto' resolved (group for
        grpo, batch for ppo; left as 'auto' when `job` is None). Raises when the group estimator would
        see groups of one response."""
        mode = self.advantage
        if mode == "auto" and job is not None:
            mode = "group" if job == "grpo" else "batch"
        if mode == "group" and self.group_size < 2:
            how = "" if mode == self.advantage else f" (auto: group for job {job})"
            raise ValueError(f"rl.advantage={self.advantage!r}{how} needs rl.group_size >= 2: a group of one "
                             "response has zero advantage (set rl.advantage=batch for group_size 1)")
        return mode

    def rank_split(self, dp_size: int, micro_batch_size: Optional[int] = None) -> Tuple[int, int]:
        """(prompts per data-parallel rank and step, sequences per forward/backward) on `dp_size` ranks.

        Each rank's `prompts x group_size` sequences split into `minibatches` optimizer steps, each run as
        micro-batches of `micro_batch_size` sequences (capped at the minibatch; None: one micro-batch per
        minibatch). Raises naming the option that does not divide.
        """
        if self.prompts_per_step % dp_size:
            raise ValueError(f"rl.prompts_per_step={self.prompts_per_step} must be a multiple of the "
                             f"data-parallel size {dp_size}")
        prompts = self.prompts_per_step // dp_size
        sequences = prompts * self.group_size
        if sequences % self.minibatches:
            raise ValueError(f"rl.minibatches={self.minibatches} must divide the {sequences} sequences per "
                             f"data-parallel rank (rl.prompts_per_step x rl.group_size / data-parallel size {dp_size})")
        minibatch = sequences // self.minibatches
        micro = minibatch if micro_batch_size is None else min(micro_batch_size, minibatch)
        if minibatch % micro:
            raise ValueError(f"trainer.micro_batch_size={micro_batch_size} must divide the RL minibatch of "
                             f"{minibatch} sequences (rl.prompts_per_step x rl.group_size / dp / rl.minibatches)")
        return prompts, micro

    def logprob_budget(self, fused: bool) -> Optional[int]:
        """Tokens per forward of the logprob passes: rl.logprob_max_tokens with 'auto' resolved for the
        route (None: trainer.micro_batch_size sequences per forward)."""
        if self.logprob_max_tokens != "auto":
            return self.logprob_max_tokens
        return AUTO_LOGPROB_TOKENS if fused else None

    @property
    def clip_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
