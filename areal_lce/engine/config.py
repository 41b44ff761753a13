"""Configuration of the Megatron engine: plain nested dataclasses with defaults.

Every field carries a help string; `__post_init__` checks cross-field constraints and names the
offending option. The train jobs' YAML loader composes these into the job config, so the classes
stay plain (no custom constructors, only defaults).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

from ..megatron.capture import SEAMS
from ..op.options import group as options_group

PRESETS = ("tiny", "tiny-llama", "tiny-qwen3", "qwen2.5-0.5b", "qwen2.5-7b")
DTYPES = ("auto", "fp32", "bf16")
LR_SCHEDULES = ("constant", "cosine")
CAPTURE_SEAMS = ("auto",) + SEAMS  # "auto": the installed megatron-core's seam (capture.resolve_seam)


@dataclass
class ModelConfig:
    preset: str = field(
        default="tiny",
        metadata={"help": f"built-in architecture, one of {PRESETS}; ignored when hf_config_dir or "
                  "hf_checkpoint_dir is set. Presets are randomly initialised."},
    )
    hf_config_dir: str = field(
        default="",
        metadata={"help": "local directory with a Hugging Face config.json (Qwen2, Llama or Qwen3 family); "
                  "the model is built from it and randomly initialised"},
    )
    hf_checkpoint_dir: str = field(
        default="",
        metadata={"help": "local Hugging Face checkpoint directory (config.json + *.safetensors); "
                  "architecture and weights are loaded from it, sharded over tensor-parallel ranks"},
    )
    tie_word_embeddings: Optional[bool] = field(
        default=None,
        metadata={"help": "override the architecture's tie_word_embeddings (None: keep it)"},
    )
    num_layers: int = field(
        default=0,
        metadata={"help": "override the number of transformer layers (0: keep the architecture's); "
                  "not allowed together with hf_checkpoint_dir"},
    )
    dtype: str = field(
        default="auto",
        metadata={"help": f"parameter/compute dtype, one of {DTYPES}; auto = bf16 on GPU, fp32 on CPU"},
    )
    max_seq_len: int = field(
        default=512, metadata={"help": "longest sequence (prompt + response) the model will see"}
    )
    make_vocab_size_divisible_by: int = field(
        default=128,
        metadata={"help": "Megatron pads the vocabulary to a multiple of this times tensor_parallel; "
                  "padded rows never enter logprobs or entropy"},
    )
    attention: str = field(
        default="sdpa",
        metadata={"help": "core attention of the local layer spec: sdpa (torch scaled_dot_product_attention, "
                  "flash kernels on GPU, causal) | megatron (megatron-core DotProductAttention, stores the "
                  "[b, heads, s, s] probabilities); ignored when the Transformer Engine spec is used"},
    )
    rope_fusion: bool = field(
        default=True,
        metadata={"help": "on CUDA without Transformer Engine: apply RoPE with one Triton kernel per call "
                  "(areal_lce.engine.model.rope in megatron-core's apply_rope_fusion slot) instead of megatron's "
                  "unfused torch RoPE (~11 kernels per call); false: the unfused one. Ignored on CPU "
                  "and under Transformer Engine (its own fused RoPE)"},
    )
    activation_recompute: bool = field(
        default=False,
        metadata={"help": "recompute every transformer layer in the backward instead of storing its "
                  "activations (megatron-core's full, uniform recompute of one layer at a time): long "
                  "sequences fit at the cost of one more forward"},
    )
    cross_entropy_loss_fusion: bool = field(
        default=False,
        metadata={"help": "megatron-core's cross_entropy_loss_fusion: with use_fused_linear_ce=false, the SFT loss "
                  "(megatron-core's own labels= loss) takes its per-token cross entropy from megatron's "
                  "fused_vocab_parallel_cross_entropy instead of vocab_parallel_cross_entropy (the logits are "
                  "built either way). No effect on the fused route or on the RL jobs' logprob passes"},
    )
    vocab_size: int = field(
        default=0,
        metadata={"help": "the model's true vocabulary, the ids its softmax runs over (0: the vocab_size of "
                  "hf_checkpoint_dir's / hf_config_dir's config.json or of the preset, as vLLM and SGLang take "
                  "it). With a checkpoint it may not exceed the checkpoint's rows; rows past it are masked like "
                  "megatron's padding. Without one, the model is built with this many rows. The tokenizer may "
                  "have fewer ids, not more"},
    )

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype={self.dtype!r}: expected one of {DTYPES}")
        if not (self.hf_config_dir or self.hf_checkpoint_dir) and self.preset not in PRESETS:
            raise ValueError(f"model.preset={self.preset!r}: expected one of {PRESETS} "
                             "(or set model.hf_config_dir / model.hf_checkpoint_dir)")
        if self.hf_config_dir and self.hf_checkpoint_dir:
            raise ValueError("set only one of model.hf_config_dir and model.hf_checkpoint_dir "
                             "(the checkpoint directory already holds its config)")
        if self.num_layers < 0:
            raise ValueError(f"model.num_layers={self.num_layers} must be >= 0")
        if self.num_layers and self.hf_checkpoint_dir:
            raise ValueError("model.num_layers cannot override the depth of model.hf_checkpoint_dir")
        if self.max_seq_len <= 0:
            raise ValueError(f"model.max_seq_len={self.max_seq_len} must be > 0")
        if self.make_vocab_size_divisible_by <= 0:
            raise ValueError("model.make_vocab_size_divisible_by must be > 0")
        if self.attention not in ("sdpa", "megatron"):
            raise ValueError(f"model.attention={self.attention!r}: expected 'sdpa' or 'megatron'")
        if self.vocab_size < 0:
            raise ValueError(f"model.vocab_size={self.vocab_size} must be >= 0")


@dataclass
class ParallelConfig:
    tensor_parallel: int = field(default=1, metadata={"help": "tensor-parallel size (vocab and heads sharded)"})
    pipeline_parallel: int = field(default=1, metadata={"help": "pipeline-parallel size"})
    sequence_parallel: bool = field(
        default=False,
        metadata={"help": "Megatron sequence parallelism (activations sharded along the sequence "
                  "outside tensor-parallel regions); needs tensor_parallel > 1"},
    )
    context_parallel: int = field(
        default=1,
        metadata={"help": "context-parallel size: every sequence is cut into 2 x context_parallel chunks and "
                  "each CP rank keeps chunks r and 2cp-1-r (megatron's zigzag); attention all-gathers K/V "
                  "over the CP group. Needs model.attention=sdpa and pipeline_parallel=1"},
    )
    timeout_s: float = field(
        default=600.0,
        metadata={"help": "timeout of every collective (torch.distributed process group and Megatron's groups): "
                  "a rank that stalls or dies makes the others fail with an error after this many seconds "
                  "instead of hanging. 600 = Megatron-LM's default --distributed-timeout-minutes=10; raise it "
                  "when one rank may legitimately run alone longer (e.g. saving a large checkpoint)"},
    )

    def __post_init__(self):
        for name in ("tensor_parallel", "pipeline_parallel", "context_parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name}={getattr(self, name)} must be >= 1")
        if not 0 < self.timeout_s < float("inf"):
            raise ValueError(f"parallel.timeout_s={self.timeout_s} must be a finite number of seconds > 0")
        if self.context_parallel > 1 and self.pipeline_parallel > 1:
            raise ValueError(f"parallel.context_parallel={self.context_parallel} with parallel.pipeline_parallel="
                             f"{self.pipeline_parallel}: context parallelism runs with pipeline_parallel=1 only")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError("parallel.sequence_parallel=true needs parallel.tensor_parallel > 1")


@dataclass
class OptimConfig:
    lr: float = field(default=1e-5, metadata={"help": "peak learning rate"})
    min_lr: float = field(default=0.0, metadata={"help": "final learning rate of the cosine schedule"})
    weight_decay: float = field(default=0.0, metadata={"help": "decoupled (AdamW) weight decay"})
    betas: Tuple[float, float] = field(default=(0.9, 0.95), metadata={"help": "Adam (beta1, beta2)"})
    eps: float = field(default=1e-8, metadata={"help": "Adam epsilon"})
    clip_grad: float = field(default=1.0, metadata={"help": "global grad-norm clip (0: off)"})
    warmup_steps: int = field(default=0, metadata={"help": "linear warm-up steps from 0 to lr"})
    lr_schedule: str = field(default="constant", metadata={"help": f"one of {LR_SCHEDULES}"})
    total_steps: int = field(
        default=1000, metadata={"help": "steps over which the cosine schedule decays to min_lr"}
    )

    def __post_init__(self):
        self.betas = tuple(float(b) for b in self.betas)  # YAML gives a list
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas={self.betas}: expected two values in [0, 1)")
        if self.lr < 0 or self.min_lr < 0:
            raise ValueError("optim.lr and optim.min_lr must be >= 0")
        if self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr={self.min_lr} exceeds optim.lr={self.lr}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"optim.lr_schedule={self.lr_schedule!r}: expected one of {LR_SCHEDULES}")
        if self.warmup_steps < 0 or self.total_steps <= 0:
            raise ValueError("optim.warmup_steps must be >= 0 and optim.total_steps > 0")
        if self.lr_schedule == "cosine" and self.warmup_steps >= self.total_steps:
            raise ValueError(f"optim.warmup_steps={self.warmup_steps} must be < optim.total_steps="
                             f"{self.total_steps} for the cosine schedule")
        if self.clip_grad < 0 or self.eps <= 0 or self.weight_decay < 0:
            raise ValueError("optim.clip_grad and optim.weight_decay must be >= 0, optim.eps > 0")


def _check_compact_choice(v):
    return None if isinstance(v, bool) or v == "auto" else (ValueError, "true, false or 'auto'")


# engine.lce: the op's own options (LCEOptions' fields: type, default, check and help come from there; the
# engine's default cache budget is "auto") and one option of the engine's: compact_ignored "auto", a choice
# the engine makes per micro-batch from the host's labels (batch.compact_choice) that the op cannot make
# without a host sync. The per-call options (temperature, vocab_size, ignore_index, top_k, return_stats) come
# from the jobs and the model, not from this group.
LCEConfig = options_group(
    "LCEConfig", ("backend", "cache_bytes", "compact_ignored", "invariant", "logits_precision"), "engine.lce.",
    defaults={"cache_bytes": "auto"},
    own={"compact_ignored": (Union[bool, str], field(default="auto", metadata={"check": _check_compact_choice, "help": (
        "the fused op's compact_ignored per micro-batch: auto = true when at least 1/16 of the positions have "
        "no target (RL batches with their prompts masked: only the rows with a target are computed), else the "
        "backend's choice (Triton skips 128-row blocks without a target in place); counted on the host, no "
        "sync. true / false: always / never compact")}))},
    module=__name__,
    doc="engine.lce: the options of the fused LM head (`linear_logprobs_entropy`) on the engine's route; "
        "`options()` is their LCEOptions (compact_ignored, the engine's own, is chosen per micro-batch).")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "architecture and weights"})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"help": "model parallelism"})
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"help": "optimizer and lr schedule"})
    use_fused_linear_ce: bool = field(
        default=True,
        metadata={"help": "compute logprobs/entropy/stats with the fused linear op at the LM head "
                  "(the [tokens, vocab] logits are never built); false: the SFT loss is megatron-core's own "
                  "(GPTModel's labels= loss), the RL jobs' statistics come from materialised logits"},
    )
    lce: LCEConfig = field(default_factory=LCEConfig,
                           metadata={"help": "the fused LM head's options (engine.lce.*)"})
    capture_seam: str = field(
        default="auto",
        metadata={"help": f"one of {CAPTURE_SEAMS}: auto = GPTModel's output_processor when the "
                  "installed megatron-core has it (>= 0.18), else the output_layer replacement"},
    )
    pack_sequences: bool = field(
        default=True,
        metadata={"help": "pack every micro-batch's sequences into one THD row (PackedSeqParams, per-sequence "
                  "attention and RoPE) instead of right-padding them to the longest: no compute or memory "
                  "spent on padding, which dominates RL batches of variable-length responses. false: "
                  "right-padded [batch, seq] rows. Needs model.attention=sdpa"},
    )
    kv_cache: bool = field(
        default=True,
        metadata={"help": "generate with a KV cache (megatron-core's static inference context: prompts "
                  "prefilled once, one token per step against cached keys/values); false: re-run the "
                  "whole prefix for every new token (the reference route)"},
    )
    decode_cuda_graphs: bool = field(
        default=True,
        metadata={"help": "with kv_cache on CUDA at pipeline_parallel = 1 (tensor_parallel > 1 on NCCL): capture each decode "
                  "step (one per batch size) in a CUDA graph and replay it; elsewhere, or false, the same "
                  "fixed-shape step runs eagerly"},
    )
    model_cuda_graphs: Union[bool, str] = field(
        default="auto",
        metadata={"help": "on CUDA at tensor/pipeline/context parallel = 1 with packed sequences, local layers, "
                  "bf16 and no dropout, MoE or MTP: the second time a packed shape is seen, capture its model "
                  "call (forward + backward in train_step, forward in token_stats) in CUDA graphs and replay "
                  "them from then on. auto: on the fused route only (the materialised route's graph pools "
                  "would hold its logits beside the eager allocator's cache); true: both routes; false, or "
                  "where graphs do not apply: every call runs eagerly"},
    )
    cuda_graph_token_multiple: int = field(
        default=512,
        metadata={"help": "with model_cuda_graphs in use: packed rows are padded (ignored tokens) to a multiple "
                  "of this many tokens, so that graphed shapes repeat across batches"},
    )
    seed: int = field(default=1234, metadata={"help": "seed of parameter init, dropout and sampling"})

    def __post_init__(self):
        if not isinstance(self.lce, LCEConfig):
            raise ValueError(f"engine.lce must be an LCEConfig, got {type(self.lce).__name__}")
        if self.capture_seam not in CAPTURE_SEAMS:
            raise ValueError(f"capture_seam={self.capture_seam!r}: expected one of {CAPTURE_SEAMS}")
        if self.parallel.context_parallel > 1 and self.model.attention != "sdpa":
            raise ValueError(f"parallel.context_parallel={self.parallel.context_parallel} needs model.attention='sdpa' "
                             f"(megatron's local DotProductAttention refuses context parallelism)")
        if self.pack_sequences and self.model.attention != "sdpa":
            raise ValueError(f"pack_sequences=true needs model.attention='sdpa' (megatron's local "
                             f"DotProductAttention refuses packed sequences), got {self.model.attention!r}")
        if not isinstance(self.model_cuda_graphs, bool) and self.model_cuda_graphs != "auto":
            raise ValueError(f"engine.model_cuda_graphs={self.model_cuda_graphs!r}: expected true, false or 'auto'")
        if isinstance(self.cuda_graph_token_multiple, bool) or not isinstance(self.cuda_graph_token_multiple, int) \
                or self.cuda_graph_token_multiple < 1:
            raise ValueError(f"engine.cuda_graph_token_multiple={self.cuda_graph_token_multiple!r}: expected an int >= 1")

