"""The `distill:` section of the job config (on-policy distillation, job: distill).

The student is `engine` (the trained model, as the RL jobs' policy); the rollout is the RL jobs' and
takes its options from `rl:` (task, task_options, reward_fn, prompts_per_step, group_size, max_new_tokens,
temperature, top_p, stop_at_eos, logprob_max_tokens, minibatches). The PPO options of `rl:` have no
meaning here: `check_rl_for_distill` refuses a distill config that sets one. This section names the
teacher and the loss (docs/distill.md).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from areal_lce.engine.config import ModelConfig

from .rl_config import RLConfig

MAX_TOP_K = 64  # the op's top_k contract (areal_lce.linear_logprobs_entropy) covers 1..64
# rl: options that only the PPO update reads; a distill job refuses them set to anything but their default
RL_UNUSED = ("advantage", "adv_std_norm", "adv_eps", "ppo_epochs", "clip_eps", "clip_eps_high", "dual_clip",
             "entropy_coef", "kl_coef", "kl_estimator", "loss_agg")


@dataclass
class DistillConfig:
    teacher: ModelConfig = field(
        default_factory=ModelConfig,
        metadata={"help": "the teacher's model: a preset, hf_config_dir (weights from teacher_checkpoint) or "
                  "hf_checkpoint_dir (an HF export: architecture and weights); its vocabulary must be the "
                  "student's. It runs frozen, with the student's engine.parallel and engine.lce options"},
    )
    teacher_checkpoint: str = field(
        default="",
        metadata={"help": "a checkpoint of this package's train jobs holding the teacher's weights: a step "
                  "directory (OUTPUT_DIR/checkpoints/step_N) or a run directory (its latest complete "
                  "checkpoint); only the model weights are read. Empty: the weights of distill.teacher "
                  "(hf_checkpoint_dir); a randomly initialised teacher is refused"},
    )
    top_k: int = field(
        default=8,
        metadata={"help": f"teacher tokens per response position (1..{MAX_TOP_K}): the support of the forward KL"},
    )
    reverse_kl_coef: float = field(
        default=0.0,
        metadata={"help": "weight of the reverse KL on the sampled token (a REINFORCE term with per-token "
                  "reward log p_teacher - log p_student; 0: off)"},
    )
    teacher_score: bool = field(
        default=True,
        metadata={"help": "every step the teacher also answers the step's prompts (same sampler) and its task "
                  "score is logged as teacher_score (the student's is score)"},
    )

    def __post_init__(self):
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"distill.top_k={self.top_k!r}: expected an int in [1, {MAX_TOP_K}]")
        if not 0.0 <= self.reverse_kl_coef < math.inf:
            raise ValueError(f"distill.reverse_kl_coef={self.reverse_kl_coef} must be a finite number >= 0")
        if self.teacher_checkpoint and self.teacher.hf_checkpoint_dir:
            raise ValueError("set only one of distill.teacher_checkpoint and distill.teacher.hf_checkpoint_dir "
                             "(both give the teacher's weights)")

    def check_for_job(self, rl: RLConfig, engine) -> None:
        """What job distill needs beyond the section's own checks (`engine`: the student's EngineConfig): the
        fused route (the only one giving selected and top-k logprobs), a teacher with weights that reads the
        student's sequences, and no PPO option set in `rl:` (the job reads the rollout options there)."""
        if not engine.use_fused_linear_ce:
            raise ValueError("job distill needs engine.use_fused_linear_ce=true: the student's logprobs at the "
                             "teacher's ids and the teacher's top-k come from the fused LM head only")
        student = engine.model
        if not self.teacher_checkpoint and not self.teacher.hf_checkpoint_dir:
            raise ValueError("job distill: the teacher has no weights: set distill.teacher_checkpoint (a train "
                             "job's checkpoint) or distill.teacher.hf_checkpoint_dir (an HF export)")
        if self.teacher.max_seq_len < student.max_seq_len:
            raise ValueError(f"distill.teacher.max_seq_len={self.teacher.max_seq_len} is below the student's "
                             f"engine.model.max_seq_len={student.max_seq_len}: the teacher scores the student's "
                             "sequences")
        check_rl_for_distill(rl)


def check_rl_for_distill(rl: RLConfig) -> None:
    """Refuse, naming it, an `rl:` option that only the PPO update reads, set in a distill job (it would be
    silently ignored): the distill job takes its rollout from `rl:` and its loss from `distill:`."""
    default = RLConfig()
    changed = [name for name in RL_UNUSED if getattr(rl, name) != getattr(default, name)]
    if changed:
        shown = ", ".join(f"rl.{n}={getattr(rl, n)!r}" for n in changed)
        raise ValueError(f"job distill does not read {shown} (PPO options); its loss is set in distill: "
                         "(top_k, reverse_kl_coef). Remove them")


def teacher_engine_config(engine_cfg, teacher: ModelConfig):
    """The teacher's EngineConfig: the student's (parallel layout, LM-head route, seed) with the teacher's
    model section."""
    return dataclasses.replace(engine_cfg, model=teacher)
