"""Job configuration: nested dataclasses, a YAML loader and dotted command-line overrides.

A job is one `JobConfig`. YAML only sets fields that exist (unknown keys are errors naming the full
dotted option), overrides `a.b.c=value` are typed by the dataclass field they target, and every
dataclass checks its own cross-field constraints in `__post_init__`, naming the offending option.
The loader and type machinery live in `config_io` (strict YAML: duplicate keys are errors).

    cfg = load_config("configs/sft_tiny.yaml", ["trainer.steps=20", "engine.use_fused_linear_ce=false"])
    print(format_help(JobConfig))   # every option with its type, default and help string
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence, Union

from areal_lce.engine.config import EngineConfig

from . import config_io
from .config_io import (ConfigError, dump_yaml, from_dict, iter_fields, load_yaml, parse_value,  # noqa: F401
                        to_dict)
from .distill_config import DistillConfig
from .loggers import LOGGERS
from .rl_config import RLConfig

RL_JOBS = ("grpo", "ppo")
JOBS = ("sft",) + RL_JOBS + ("distill",)
DATA_FORMATS = ("prompt_response", "text")


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class DataConfig:
    path: str = field(
        default="builtin:sft_tiny.jsonl",
        metadata=_help("JSONL file, one example per line; 'builtin:NAME' reads the file NAME shipped in "
                       "areal_lce/train/data/"),
    )
    format: str = field(
        default="prompt_response",
        metadata=_help(f"one of {DATA_FORMATS}: prompt_response = loss on the response tokens only "
                       "(keys prompt_key/response_key); text = loss on every token (key text_key)"),
    )
    tokenizer: str = field(
        default="builtin",
        metadata=_help("local Hugging Face tokenizer directory (AutoTokenizer.from_pretrained), or "
                       "'builtin' for the offline byte-level tokenizer (259 ids)"),
    )
    max_seq_len: int = field(
        default=256, metadata=_help("examples are truncated to this many tokens (prompt + response)")
    )
    shuffle_seed: int = field(
        default=1234, metadata=_help("seed of the per-epoch example order (the order is a pure function "
                                     "of seed, epoch and step, so a resumed run sees the same batches)")
    )
    shuffle: bool = field(default=True, metadata=_help("shuffle the examples every epoch"))
    prompt_key: str = field(default="prompt", metadata=_help("JSON key of the prompt (prompt_response)"))
    response_key: str = field(default="response", metadata=_help("JSON key of the response (prompt_response)"))
    text_key: str = field(default="text", metadata=_help("JSON key of the text (format=text)"))
    add_bos: bool = field(default=True, metadata=_help("prepend the tokenizer's BOS id when it has one"))
    add_eos: bool = field(default=True, metadata=_help("append the tokenizer's EOS id (trained on)"))
    pad_to_multiple_of: int = field(
        default=1, metadata=_help("right-pad each micro-batch to a multiple of this length (the job also "
                                  "rounds up to tensor_parallel under sequence parallelism)")
    )

    def __post_init__(self):
        if self.format not in DATA_FORMATS:
            raise ConfigError(f"data.format={self.format!r}: expected one of {DATA_FORMATS}")
        if not self.path:
            raise ConfigError("data.path is empty: give a JSONL file or 'builtin:NAME'")
        if not self.tokenizer:
            raise ConfigError("data.tokenizer is empty: give a tokenizer directory or 'builtin'")
        if self.max_seq_len < 2:
            raise ConfigError(f"data.max_seq_len={self.max_seq_len} must be >= 2 (one input, one target)")
        if self.pad_to_multiple_of < 1:
            raise ConfigError(f"data.pad_to_multiple_of={self.pad_to_multiple_of} must be >= 1")


@dataclass
class TrainerConfig:
    steps: int = field(default=60, metadata=_help("optimizer steps of the whole run"))
    global_batch_size: int = field(
        default=8, metadata=_help("examples per optimizer step, summed over data-parallel ranks")
    )
    micro_batch_size: int = field(
        default=4, metadata=_help("examples per forward/backward; global_batch_size must be a multiple "
                                  "of micro_batch_size x data-parallel size")
    )
    output_dir: str = field(
        default="runs/sft_tiny",
        metadata=_help("run directory: metrics.jsonl, metrics.png, config.yaml, checkpoints/"),
    )
    save_interval: int = field(
        default=0, metadata=_help("save a checkpoint every this many steps (0: only at the end)")
    )
    save_final: bool = field(default=True, metadata=_help("save a checkpoint after the last step"))
    keep_last: int = field(
        default=0, metadata=_help("after each save, delete this run's checkpoints but the newest this many "
                                  "(0: keep all). Only complete checkpoints this run wrote are deleted (its id "
                                  "in trainer_state.json, every file listed in their MANIFEST.json)")
    )
    resume: Union[bool, str] = field(
        default=False,
        metadata=_help("true: resume from the last checkpoint in output_dir (error if none); 'auto': "
                       "resume when one exists, else start fresh; false: start fresh"),
    )
    stop_at: int = field(
        default=0, metadata=_help("end this invocation right after this step, without the final save, "
                                  "as if the process were killed (0: off); used to exercise resume")
    )
    log_interval: int = field(default=1, metadata=_help("print a metrics line every this many steps"))
    seed: int = field(default=1234, metadata=_help("seeds python's and torch's RNGs once the engine is built "
                                                   "(engine.seed seeds the model init)"))
    progress: bool = field(default=True, metadata=_help("show a tqdm progress bar on rank 0"))
    plot: bool = field(default=True, metadata=_help("write metrics.png (matplotlib, drawn from metrics.jsonl) at "
                                                    "the end of the run"))
    loggers: list[str] = field(
        default_factory=lambda: ["jsonl"],
        metadata=_help(f"where rank 0 logs each step's metrics, some of {tuple(LOGGERS)}: jsonl = "
                       "RUN_DIR/metrics.jsonl; tensorboard = event files in RUN_DIR/tensorboard/ (extra "
                       "'tensorboard'); wandb = a W&B run in RUN_DIR/wandb/ (extra 'wandb'; WANDB_MODE=offline "
                       "needs no network; WANDB_PROJECT, default areal_lce). On the command line: "
                       "trainer.loggers=jsonl,tensorboard"),
    )
    sample_prompts: int = field(
        default=0, metadata=_help("after the last step, greedily complete this many prompts of the dataset "
                                  "(file order) and print them with their reference responses; also "
                                  "written to samples.jsonl (0: off; format prompt_response only)")
    )

    def __post_init__(self):
        if self.steps < 1:
            raise ConfigError(f"trainer.steps={self.steps} must be >= 1")
        if self.micro_batch_size < 1 or self.global_batch_size < 1:
            raise ConfigError("trainer.global_batch_size and trainer.micro_batch_size must be >= 1")
        split_global_batch(self.global_batch_size, self.micro_batch_size)  # for any data-parallel size
        if isinstance(self.resume, str) and self.resume != "auto":
            raise ConfigError(f"trainer.resume={self.resume!r}: expected true, false or 'auto'")
        for name in ("save_interval", "stop_at", "keep_last"):
            if getattr(self, name) < 0:
                raise ConfigError(f"trainer.{name}={getattr(self, name)} must be >= 0")
        if self.log_interval < 1:
            raise ConfigError(f"trainer.log_interval={self.log_interval} must be >= 1")
        if not self.output_dir:
            raise ConfigError("trainer.output_dir is empty")
        if self.sample_prompts < 0:
            raise ConfigError(f"trainer.sample_prompts={self.sample_prompts} must be >= 0")
        unknown = [name for name in self.loggers if name not in LOGGERS]
        if unknown or len(set(self.loggers)) != len(self.loggers):
            raise ConfigError(f"trainer.loggers={list(self.loggers)}: expected distinct names among "
                              f"{tuple(LOGGERS)}")
        if self.plot and "jsonl" not in self.loggers:
            raise ConfigError(f"trainer.plot=true draws metrics.png from metrics.jsonl, but trainer.loggers="
                              f"{list(self.loggers)} leaves out jsonl: add jsonl or set trainer.plot=false")


def split_global_batch(global_batch_size: int, micro_batch_size: int, dp_size: int = 1) -> int:
    """Examples of one global batch per data-parallel rank; raises naming the trainer options unless the
    global batch splits into whole micro-batches on each of `dp_size` ranks (at load: dp_size 1)."""
    if global_batch_size % (micro_batch_size * dp_size):
        dp = (f" x data-parallel size {dp_size} (world / (tensor x pipeline x context parallel))"
              if dp_size > 1 else "")
        raise ConfigError(f"trainer.global_batch_size={global_batch_size} must be a multiple of "
                          f"trainer.micro_batch_size={micro_batch_size}{dp}")
    return global_batch_size // dp_size



@dataclass
class JobConfig:
    job: str = field(default="sft", metadata=_help(f"which job runs, one of {JOBS}"))
    engine: EngineConfig = field(default_factory=EngineConfig,
                                 metadata=_help("model, parallelism, optimizer, fused-op route"))
    data: DataConfig = field(default_factory=DataConfig, metadata=_help("dataset and tokenizer"))
    trainer: TrainerConfig = field(default_factory=TrainerConfig, metadata=_help("loop, batching, checkpoints"))
    rl: RLConfig = field(default_factory=RLConfig, metadata=_help("RL jobs (grpo, ppo); job distill reads its "
                                                                  "rollout options here"))
    distill: DistillConfig = field(default_factory=DistillConfig,
                                   metadata=_help("job distill only: the teacher and the loss"))

    def __post_init__(self):
        if self.job not in JOBS:
            raise ConfigError(f"job={self.job!r}: expected one of {JOBS}")
        if self.data.max_seq_len > self.engine.model.max_seq_len:
            raise ConfigError(f"data.max_seq_len={self.data.max_seq_len} exceeds "
                              f"engine.model.max_seq_len={self.engine.model.max_seq_len}")
        optim = self.engine.optim
        if self.job == "sft" and optim.total_steps != self.trainer.steps:
            # One optimizer step per SFT step: the lr schedule spans the run (trainer.steps wins).
            optim.total_steps = self.trainer.steps
            if optim.lr_schedule == "cosine" and optim.warmup_steps >= optim.total_steps:
                raise ConfigError(f"engine.optim.warmup_steps={optim.warmup_steps} must be < trainer.steps="
                                  f"{self.trainer.steps} for the cosine schedule")
        if self.trainer.sample_prompts and self.data.format != "prompt_response":
            raise ConfigError("trainer.sample_prompts needs data.format=prompt_response (prompts to complete)")
        if self.trainer.stop_at and self.trainer.stop_at >= self.trainer.steps:
            raise ConfigError(f"trainer.stop_at={self.trainer.stop_at} must be < trainer.steps="
                              f"{self.trainer.steps} (0 disables it)")
        if self.job in RL_JOBS:
            try:
                self.rl.advantage_for(self.job)  # rl.advantage=auto resolves by job: group for grpo
            except ValueError as e:
                raise ConfigError(str(e)) from e
        if self.job == "distill":
            try:
                self.distill.check_for_job(self.rl, self.engine)
            except ValueError as e:
                raise ConfigError(str(e)) from e


def check_runs_here(cfg: JobConfig) -> None:
    """Refuse, before any process group or model exists, a fused-op backend this machine cannot run: an
    explicit `engine.lce.backend` (or AREAL_LCE_BACKEND) of triton without CUDA, triton_ascend without an
    NPU, or one whose package is missing. The engine runs on CUDA when it is available, else on the CPU."""
    if not cfg.engine.use_fused_linear_ce:
        return  # the materialised route does not call the op
    import torch

    from areal_lce.op.backends import resolve_backend

    name, option = cfg.engine.lce.backend, "engine.lce.backend"
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolve_backend(name, device)
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"{option}={name!r} cannot run on this machine ({device.type}): {e}; use {option}="
                          "auto (triton on CUDA, else torch) or torch") from e


def apply_overrides(data: dict, overrides: Sequence[str], cls=None) -> dict:
    """Set dotted `key=value` overrides into the nested dict `data` (typed by `cls`'s fields, JobConfig's
    by default)."""
    return config_io.apply_overrides(data, overrides, JobConfig if cls is None else cls)


def load_config(path: Union[str, Path, None] = None, overrides: Sequence[str] = (), cls=None):
    """YAML file (optional) + dotted overrides -> validated config (JobConfig by default)."""
    return config_io.load_config(path, overrides, JobConfig if cls is None else cls)


def format_help(cls=None) -> str:
    """Text listing of every option: dotted name, type, default and help string."""
    return config_io.format_help(JobConfig if cls is None else cls)


def format_markdown(cls=None) -> str:
    """Markdown tables of every option (one per top-level section), from the help strings."""
    return config_io.format_markdown(JobConfig if cls is None else cls)
