"""MegatronEngine: a megatron-core GPTModel with its DDP, optimizer and lr schedule, plus token stats.

What runs where:
  * model: megatron-core GPTModel (local layer spec; Transformer Engine spec on GPU when importable),
    bf16 under Float16Module on GPU, fp32 on CPU.
  * gradients: megatron-core DistributedDataParallel everywhere (grad buffers / main_grad, fp32
    reduction), finished by megatron's `finalize_model_grads` (data-parallel all-reduce, sequence-
    parallel norm grads over TP, tied embeddings across pipeline stages).
  * optimizer (optim.py): megatron-core's `get_megatron_optimizer` on GPU (Adam; fp32 master weights
    under bf16) with its grad clipping; `torch.optim.AdamW` fed `param.grad = param.main_grad` on CPU
    (megatron's optimizer wrappers allocate on CUDA), clipped by a global norm computed there.
  * lr schedule: linear warm-up then constant or cosine to min_lr, set on the param groups each step.
  * frozen (`trainable=False`, e.g. an RL reference policy): the model only, parameters with
    requires_grad False, called without the DDP wrapper (no grad buffers) and with no optimizer;
    `token_stats(grad=False)`, `generate`, `save` / `load` and parameter copies work, training refuses.

The true vocabulary (`self.vocab_size`, what every route normalises over and the sampler draws from) is
engine.model.vocab_size, else the `vocab_size` argument, else the checkpoint config's / preset's
(`builder.true_vocab_size`); only the rows past it (megatron's padding) are masked.
The LM-head route is chosen once, at construction: `self.route` (route.py) from `use_fused_linear_ce`,
`capture_seam` and `engine.lce` (backend, cache_bytes, invariant, logits_precision; compact_ignored is
chosen per micro-batch); `token_stats`, `train_step` and `generate` all run through it, except that on the
materialised route `train_step` runs a loss reading only logprobs (`loss_fn.logprobs_only`: the SFT loss)
through megatron-core's own `labels=` loss (own_loss.py), as Megatron-LM does. Callers pass
right-padded [b, s] batches; with `pack_sequences` the engine packs them into
one THD row per micro-batch (batch.py) and returns stats in the padded layout. Pipeline parallelism
runs Megatron's 1F1B schedule (schedule.py; the capture seam only runs on the last stage, whose
statistics and logits are shared with the other stages by a sum over the pipeline group).
With `model_cuda_graphs` (default "auto": on the fused route; CUDA, one rank of each model-parallel kind,
packed bf16 sequences) a packed shape's model call is captured in CUDA graphs the second time it is seen and replayed from then
on (graphs.py): forward + backward of `train_step`'s micro-batches, forward of `token_stats`.
`generate` samples on the engine's device through a KV cache by default (generate.py, given a
`GenerationModel` view of the engine); `save` / `load` write and read sharded tensors, loadable at any
parallel layout (state.py).
The engine's collectives use the process groups of its `DistInfo` (`self.dist`).
On a CPU-only host megatron runs inside `compat.cpu_shims()`, entered by the methods that call it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import resource
from typing import Any, Callable, Dict, List, Optional

import torch

from ..op import checks
from .generation import generate as generation
from . import schedule
from . import state as engine_state
from .batch import ModelBatch, per_token_rope
from .graphs import ModelCallGraphs, why_not_graphed
from .batch import prepare as prepare_batch
from ..op.checks import check_temperature
from ..megatron.compat import cpu_shims
from ..megatron.context_parallel import CPGroup
from .config import EngineConfig
from .metrics import StepShare, reduce_step
from .microbatch import MicroBatch, check_microbatches
from .model.builder import build_gpt_model, load_hf_checkpoint, resolve_arch, true_vocab_size, use_te_spec
from .optim import build_optimizer, lr_at, optimizer_step
from .own_loss import check_temperature_one, logprobs_only, megatron_loss_call
from .parallel import init_distributed, object_from_last_stage
from .per_token import IGNORE_INDEX, stats_with_extras, to_model_layout
from ..megatron.route import Route
from ..megatron.stats import TokenStats


def _resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


class MegatronEngine:
    def __init__(self, cfg: EngineConfig, vocab_size: Optional[int] = None, *, trainable: bool = True):
        self.cfg = cfg
        self.trainable = trainable
        self.dist = init_distributed(cfg.parallel, cfg.seed)
        self.device = self.dist.device
        self.dtype = _resolve_dtype(cfg.model.dtype)
        arch = resolve_arch(cfg.model)
        true_vocab = true_vocab_size(cfg.model, arch, vocab_size)
        if not cfg.model.hf_checkpoint_dir and true_vocab != arch.vocab_size:
            arch = dataclasses.replace(arch, vocab_size=true_vocab)  # a random-init model gets exactly those rows
        self.arch, self.vocab_size = arch, true_vocab
        d = self.dist
        self.tp_group, self.mp_group, self.dp_group, self.pp_group, self.cp_group = (
            d.tp_group, d.mp_group, d.dp_group, d.pp_group, d.cp_group)
        self.cp = CPGroup.of(d.cp_group if d.cp_size > 1 else None)  # the context-parallel group, as one value
        # the LM-head route, chosen once: token_stats, train_step and generate all run through it
        self.route = Route.choose(cfg.use_fused_linear_ce, cfg.capture_seam, cfg.lce.options())
        with cpu_shims():  # on a CPU-only host: megatron's model and grad buffers ask for a CUDA device
            self.gpt, self.model = self._build_model()
        self.route.check(self.gpt.config)
        self.graphs: Optional[ModelCallGraphs] = None  # CUDA graphs of the packed model calls (graphs.py)
        if cfg.model_cuda_graphs is True or (cfg.model_cuda_graphs == "auto" and self.route.fused):
            why = why_not_graphed(device=self.device, dtype=self.dtype, tp=d.tp_size, pp=d.pp_size, cp=d.cp_size,
                                  packed=cfg.pack_sequences, te=use_te_spec(), config=self.gpt.config)
            if not why:
                self.graphs = ModelCallGraphs(self._call_model, self.gpt.parameters(), self.device)
        self.optimizer, self.megatron_optimizer = None, False
        if trainable:
            self.optimizer, self.megatron_optimizer = build_optimizer(self.model, cfg.optim, self.dtype)
        self.step_count = 0
        self._gen_calls = 0

    def _build_model(self):
        """(bare GPTModel, what is called: DDP over [Float16Module over] the GPTModel, or without DDP
        when frozen)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        cfg = self.cfg
        gpt = build_gpt_model(self.arch, cfg.model, cfg.parallel, self.dtype)
        if cfg.model.hf_checkpoint_dir:
            load_hf_checkpoint(gpt, cfg.model.hf_checkpoint_dir, self.arch)
        if not self.trainable:
            gpt.requires_grad_(False)
        module = gpt
        if self.dtype != torch.float32:
            from megatron.core.transformer.module import Float16Module

            module = Float16Module(gpt.config, gpt)
        if not self.trainable:  # the DDP wrapper exists for its grad buffers and reduction: not needed here
            return gpt, module
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=False)
        if self.device.type != "cuda":
            return gpt, DistributedDataParallel(gpt.config, ddp_cfg, module)
        # DDP creates every parameter's grad accumulator here, and autograd runs the accumulation (and DDP's
        # hook) on the stream that was current at creation. On a side stream, a backward recorded in a CUDA
        # graph (graphs.py) never makes the legacy default stream wait on the capturing stream, which CUDA
        # refuses; eager backward passes join that stream back to the caller's at their end.
        with torch.cuda.stream(torch.cuda.Stream(self.device)):
            ddp = DistributedDataParallel(gpt.config, ddp_cfg, module)
        torch.cuda.synchronize(self.device)  # the grad buffers DDP zeroed on that stream
        return gpt, ddp

    def _require_trainable(self, what: str) -> None:
        if not self.trainable:
            raise RuntimeError(f"{what} needs a trainable engine; this MegatronEngine was built with "
                               "trainable=False (frozen: no grad buffers, no optimizer)")

    # ------------------------------------------------------------------------------ forward
    def _seq_multiple(self) -> int:
        return self.dist.tp_size if self.cfg.parallel.sequence_parallel else 1

    def _prepare(self, input_ids: torch.Tensor, labels: torch.Tensor, min_packed_length: int = 0) -> ModelBatch:
        multiple = self._seq_multiple()
        if self.graphs is not None:  # packed lengths on a grid, so that graphed shapes repeat
            multiple = math.lcm(multiple, self.cfg.cuda_graph_token_multiple)
        return prepare_batch(input_ids, labels, device=self.device, max_seq_len=self.cfg.model.max_seq_len,
                             pack=self.cfg.pack_sequences, seq_multiple=multiple,
                             min_packed_length=min_packed_length, cp=self.cp,
                             cu_seqlens_on_host=not use_te_spec(),
                             compact_ignored=self.cfg.lce.compact_ignored if self.route.fused else None)

    def _call_model(self, mb: ModelBatch, temperature: float, selected_ids=None, top_k=None) -> torch.Tensor:
        """One model call through the route: packed stats [b, s, 4] / [1, T, 4] on the last pipeline
        stage, hidden states on the others. `selected_ids` (laid out like mb.labels) / `top_k`: the route's
        extra outputs (Route.stats), asked only when given."""
        extra = {} if selected_ids is None and not top_k else {"selected_ids": selected_ids, "top_k": top_k}
        with per_token_rope(self.gpt, mb):
            return self.route.stats(self.model, mb.input_ids, mb.labels, vocab_size=self.vocab_size,
                                    position_ids=mb.position_ids, attention_mask=mb.attention_mask,
                                    packed_seq_params=mb.packed_seq_params, temperature=float(temperature),
                                    compact_ignored=mb.compact_ignored, **extra)

    def _call_megatron_loss(self, mb: ModelBatch, temperature: float) -> torch.Tensor:
        """One model call through megatron-core's own `labels=` loss (own_loss.py): packed [b, s, 4] with
        the logprobs in channel 0 on the last pipeline stage, hidden states on the others."""
        check_temperature_one(temperature)
        with per_token_rope(self.gpt, mb):
            return megatron_loss_call(self.model, self.gpt, mb)

    def uses_megatron_loss(self, loss_fn) -> bool:
        """Whether train_step runs `loss_fn` on megatron-core's own loss path: the materialised route
        (use_fused_linear_ce=false) and a loss that reads only the logprobs (`loss_fn.logprobs_only`)."""
        return not self.route.fused and bool(getattr(loss_fn, "logprobs_only", False))

    def _schedule_kwargs(self, megatron_loss: bool = False) -> dict:
        """How the pipeline schedule prepares and runs this engine's micro-batches (schedule.py)."""
        call = self._call_megatron_loss if megatron_loss else self._call_model
        return dict(prepare=self._prepare, call_model=call, pack=self.cfg.pack_sequences,
                    seq_multiple=self._seq_multiple())

    @cpu_shims()
    def token_stats(self, input_ids: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                    grad: bool = False, selected_ids: Optional[torch.Tensor] = None,
                    top_k: Optional[int] = None) -> TokenStats:
        """Per-token stats of `labels` (next-token targets aligned with input positions; -100 ignored),
        [b, s] in and out whether or not the engine packs. Under pipeline parallelism (grad=False only)
        every stage receives the last stage's values. `selected_ids` [b, s, K] (global ids, -100 entries
        allowed) adds `selected_logprobs` [b, s, K]; `top_k` adds `topk_ids` / `topk_logprobs` [b, s, k]
        (pipeline_parallel=1 only)."""
        temperature = check_temperature(temperature, "token_stats: temperature", allow_tensor=False)
        if grad:
            self._require_trainable("token_stats(grad=True)")
        if selected_ids is not None or top_k:
            self._check_extras(selected_ids is not None)
        if self.dist.pp_size > 1:
            if grad:
                raise ValueError("token_stats(grad=True) needs parallel.pipeline_parallel=1; under pipeline "
                                 "parallelism gradients flow only through train_step")
            packed = schedule.stats_on_every_stage(
                self.model, [MicroBatch(input_ids, labels, temperature)], pp_group=self.pp_group,
                device=self.device, **self._schedule_kwargs())[0]
            return TokenStats.unpack(packed)
        with contextlib.nullcontext() if grad else torch.no_grad():
            return self._stats(input_ids, labels, temperature, graphed=not grad, selected_ids=selected_ids,
                               top_k=top_k)

    def _check_extras(self, selected: bool) -> None:
        if self.dist.pp_size > 1:
            what = "selected_ids" if selected else "top_k"
            raise ValueError(f"token_stats / train_step with {what} need parallel.pipeline_parallel=1 (the "
                             "pipeline schedule hands the four packed statistics between stages)")

    def _stats(self, input_ids: torch.Tensor, labels: torch.Tensor, temperature, *, graphed: bool,
               selected_ids: Optional[torch.Tensor] = None, top_k: Optional[int] = None) -> TokenStats:
        """One model call on one stage, through the graphs when `graphed` and they apply. Calls with grad
        are graphed only from train_step, which runs each backward before the next forward (graphs.py,
        "Order"). Calls with `selected_ids` / `top_k` are not graphed (the graphs record the four
        statistics): those travel through the model batch's layout like the labels (per_token.py)."""
        mb = self._prepare(input_ids, labels)
        if selected_ids is None and not top_k:
            if graphed and self.graphs is not None:
                return mb.stats(self.graphs(mb, float(temperature), grad=torch.is_grad_enabled()))
            return mb.stats(self._call_model(mb, temperature))
        sel = None if selected_ids is None else to_model_layout(selected_ids, mb, fill=IGNORE_INDEX)
        return stats_with_extras(self._call_model(mb, temperature, sel, top_k), mb)

    # ------------------------------------------------------------------------------ training
    def train_step(self, microbatches: List[MicroBatch], loss_fn: Callable) -> Dict[str, float]:
        """`train_step_local`, its share reduced (metrics.reduce_step): the data-parallel mean of loss and
        metrics, the tokens summed, grad_norm, lr, peak_mem_gib and peak_reserved_gib (the same on every
        rank but the peaks)."""
        return reduce_step(self.train_step_local(microbatches, loss_fn), self.dist)

    @cpu_shims()
    def train_step_local(self, microbatches: List[MicroBatch], loss_fn: Callable) -> StepShare:
        """One optimizer step over `microbatches`: `loss_fn(stats, mb)` -> (loss, metrics) per micro-batch
        (the engine sums the losses: normalise them in loss_fn), backward, gradient reduction, clipping
        and the step. On the materialised route a `loss_fn` whose `logprobs_only` attribute is true (the
        SFT loss) runs on megatron-core's own loss path instead (own_loss.py: GPTModel's `labels=` loss,
        never graphed): its stats hold the logprobs, and None for entropy, max_logit and min_logit. `loss_fn` receives each micro-batch with its tensor fields on the engine's device
        (`MicroBatch.to`). Returns this rank's share (metrics.StepShare: sums over its micro-batches,
        nothing reduced), which the caller reduces once with its own metrics (metrics.reduce_metrics)."""
        from megatron.core.distributed import finalize_model_grads

        self._require_trainable("train_step")
        check_microbatches(microbatches)
        if any(mb.selected_ids is not None for mb in microbatches):
            self._check_extras(True)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        sums: Dict[str, Any] = {}  # loss and metrics summed over micro-batches, on the device: no host sync
        tokens = sum(mb.target_tokens() for mb in microbatches)
        # loss_fn gets each micro-batch on the device, copied without a sync: a `.to(device)` of a host tensor
        # there would make the host wait for the forward before it can issue the backward
        staged = [mb.to(self.device) for mb in microbatches]

        megatron_loss = self.uses_megatron_loss(loss_fn)

        def account(mb, stats):
            if megatron_loss:
                stats = logprobs_only(stats)
            loss, metrics = loss_fn(stats, mb)
            for k, v in (("loss", loss), *(metrics or {}).items()):
                v = v.detach().to(self.device, torch.float64) if torch.is_tensor(v) else float(v)
                sums[k] = sums[k] + v if k in sums else v
            return loss

        if self.dist.pp_size > 1:
            schedule.stats_schedule(self.model, microbatches, on_stats=lambda i, st: account(staged[i], st),
                                    forward_only=False, **self._schedule_kwargs(megatron_loss))
        else:
            for mb, on_device in zip(microbatches, staged):
                if megatron_loss:
                    batch = self._prepare(mb.input_ids, mb.labels)
                    stats = batch.stats(self._call_megatron_loss(batch, mb.temperature))
                else:
                    stats = self._stats(mb.input_ids, mb.labels, mb.temperature, graphed=True,
                                        selected_ids=mb.selected_ids)
                # Under CP every rank holds the full statistics and the same loss, and its backward reaches
                # only its own tokens; megatron's DDP averages over data x context parallel ranks, so the
                # loss is scaled by cp for that average to be the sum of the CP shares (as Megatron-LM does).
                (account(on_device, stats) * self.dist.cp_size).backward()
        checks.check_deferred()  # the op's deferred label checks, read once per step before the update
        # DP all-reduce of the grad buffers, SP norm grads over TP, tied embeddings across stages.
        finalize_model_grads([self.model])
        lr = lr_at(self.step_count, self.cfg.optim)
        grad_norm = optimizer_step(self.model, self.optimizer, self.megatron_optimizer, lr, self.mp_group,
                                   self.device, self.cfg.optim.clip_grad)
        self.step_count += 1
        keys = object_from_last_stage(sorted(sums), self.dist)  # under PP only the last stage ran loss_fn
        return StepShare({k: sums.get(k, 0.0) for k in ["loss"] + [k for k in keys if k != "loss"]},
                         len(microbatches), tokens, dict(grad_norm=grad_norm, lr=lr, peak_mem_gib=self.peak_mem_gib(),
                                                         peak_reserved_gib=self.peak_reserved_gib()))

    @staticmethod
    def peak_mem_gib() -> float:
        """Peak of the tensors allocated since the step began. Memory that CUDA graphs keep for their
        replays (activations of graphed calls) was allocated when they were captured and is not in it:
        peak_reserved_gib is."""
        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated() / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux

    @staticmethod
    def peak_reserved_gib() -> float:
        """Peak memory the CUDA caching allocator held since the step began: the tensors, the memory pools of
        CUDA graphs, and cached free blocks (on CPU: as peak_mem_gib)."""
        if torch.cuda.is_available():
            return torch.cuda.max_memory_reserved() / 2**30
        return MegatronEngine.peak_mem_gib()

    # ------------------------------------------------------------------------------ generation
    def generation_model(self) -> generation.GenerationModel:
        """What generation needs of this engine (generate.py never calls back into it)."""
        return generation.GenerationModel(model=self.model, gpt=self.gpt, route=self.route, dist=self.dist,
                                          vocab_size=self.vocab_size, max_seq_len=self.cfg.model.max_seq_len,
                                          seq_multiple=self._seq_multiple())

    @torch.no_grad()
    @cpu_shims()
    def generate(self, prompts: List[List[int]], max_new_tokens: int, *, temperature: float = 1.0,
                 top_p: float = 1.0, eos_id: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, return_logprobs: bool = False):
        """Sample continuations (new tokens only) from the current policy; identical on every TP rank
        when the CPU `generator` is seeded identically (default: seeded from cfg.seed and the call count).
        Sampling runs on the engine's device; only the chosen token ids reach the host. With
        cfg.kv_cache the prompts are prefilled once and each new token reads cached keys/values
        (megatron-core's static inference context); else every step re-runs the whole prefix (generate.py).
        Returns the token lists, or with `return_logprobs` a `Generation` (tokens, the sampler's logprobs by
        the training head: generate.py)."""
        generation.check_request(prompts, max_new_tokens, temperature, top_p)
        if generator is None:
            generator = torch.Generator().manual_seed(self.cfg.seed * 1000003 + self._gen_calls)
        self._gen_calls += 1
        return generation.generate_tokens(self.generation_model(), prompts, max_new_tokens, kv_cache=self.cfg.kv_cache,
                                          temperature=temperature, top_p=top_p, eos_id=eos_id, generator=generator,
                                          cuda_graphs=self.cfg.decode_cuda_graphs, return_logprobs=return_logprobs)

    # ------------------------------------------------------------------------------ state
    def parameters_named(self) -> Dict[str, torch.nn.Parameter]:
        """This rank's parameters (TP shards) by GPTModel name."""
        return dict(self.gpt.named_parameters())

    def grads(self) -> Dict[str, torch.Tensor]:
        """This rank's finalised gradients (main_grad after the last train_step's reduction), by name."""
        return {n: p.main_grad.detach().clone() for n, p in self.gpt.named_parameters() if p.requires_grad}

    @cpu_shims()
    def save(self, path: str) -> None:
        """Collective: model, optimizer, counters and RNG states under the directory `path`, as sharded tensors
        that load at any parallel layout (state.py)."""
        engine_state.save_state(path, self.gpt, self.optimizer, self.megatron_optimizer,
                                {"step_count": self.step_count, "gen_calls": self._gen_calls}, self.dist,
                                self.vocab_size)

    @cpu_shims()
    def load(self, path: str) -> None:
        """Collective: resume from `save`'s directory at any parallel layout: weights, optimizer state (a
        trainable engine), counters, and RNG states when the layout is the writer's."""
        counters = engine_state.load_state(path, self.gpt, self.optimizer, self.megatron_optimizer, self.dist,
                                           self.vocab_size)
        self.step_count, self._gen_calls = counters["step_count"], counters["gen_calls"]

    @cpu_shims()
    def load_weights(self, path: str) -> None:
        """Collective: the model weights only from `save`'s directory (any layout), nothing else."""
        engine_state.load_weights(path, self.gpt, self.dist, self.vocab_size)
