"""MegatronEngine: a megatron-core GPTModel with its DDP, optimizer and lr schedule, plus token stats.

What runs where:
  * model: megatron-core GPTModel (local layer spec; Transformer Engine spec on GPU when importable),
    bf16 under Float16Module on GPU, fp32 on CPU.
  * gradients: megatron-core DistributedDataParallel everywhere (grad buffers / main_grad, fp32
    reduction), finished by megatron's `finalize_model_grads` (data-parallel all-reduce, sequence-
    parallel norm grads over TP, tied embeddings across pipeline stages).
  * optimizer on GPU: megatron-core's `get_megatron_optimizer` (Adam; fp32 master weights under bf16)
    with its grad clipping. On CPU megatron's optimizer wrappers allocate on CUDA, so the engine uses
    `torch.optim.AdamW` on the parameters with `param.grad = param.main_grad`, and clips by a global
    norm computed here (tensor-parallel duplicates counted once, summed over the model-parallel group).
  * lr schedule: linear warm-up then constant or cosine to min_lr, set on the param groups each step.
  * frozen (`trainable=False`, e.g. an RL reference policy): the model only, parameters with
    requires_grad False, called without the DDP wrapper (no grad buffers) and with no optimizer;
    `token_stats(grad=False)`, `generate`, `save` / `load` and parameter copies work, training refuses.

Token statistics come from the public `token_stats` route (stats.py): the fused op at the LM head when
`use_fused_linear_ce`, else the output layer's logits (`fused=False`), same seam either way. Callers
pass right-padded [b, s] batches; with `pack_sequences` the engine packs them into one THD row per
micro-batch (batch.py) and returns stats in the padded layout. Pipeline parallelism runs Megatron's
1F1B schedule (the capture seam only runs on the last stage; statistics and logits are shared with the
other stages by a sum over the pipeline group).
`generate` samples on the engine's device (sampling.py), through a KV cache by default (generate.py).
"""
from __future__ import annotations

import dataclasses
import os
import resource
from typing import Callable, Dict, List, Optional

import torch

from .. import checks, comms, durable
from .batch import ModelBatch, packed_length, per_token_rope
from .batch import prepare as prepare_batch
from . import generate as generation
from .compat import cpu_shims
from .config import EngineConfig
from .model import build_gpt_model, load_hf_checkpoint, resolve_arch, use_te_spec
from .microbatch import MicroBatch, check_microbatches
from .optim import build_optimizer, grad_norm_and_clip, lr_at
from .parallel import init_distributed, object_from_last_stage
from .route import Route
from .stats import TokenStats


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
        true_vocab = cfg.model.vocab_size or vocab_size or arch.vocab_size  # the config overrides
        if cfg.model.hf_checkpoint_dir:
            if true_vocab > arch.vocab_size:
                raise ValueError(f"vocab_size={true_vocab} exceeds the checkpoint's vocab_size={arch.vocab_size}")
        elif true_vocab != arch.vocab_size:
            arch = dataclasses.replace(arch, vocab_size=true_vocab)
        self.arch, self.vocab_size = arch, true_vocab
        with cpu_shims():  # on a CPU-only host: megatron's model and grad buffers ask for a CUDA device
            self._build_model(trainable)
        d = self.dist
        self.tp_group, self.mp_group, self.dp_group, self.pp_group, self.cp_group = (
            d.tp_group, d.mp_group, d.dp_group, d.pp_group, d.cp_group)
        self.optimizer, self.megatron_optimizer = None, False
        if trainable:
            self._build_optimizer()
        self.step_count = 0
        self._gen_calls = 0

    def _build_model(self, trainable: bool) -> None:
        cfg, arch = self.cfg, self.arch
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        self.gpt = build_gpt_model(arch, cfg.model, cfg.parallel, self.dtype)
        if cfg.model.hf_checkpoint_dir:
            load_hf_checkpoint(self.gpt, cfg.model.hf_checkpoint_dir, arch)
        if not trainable:
            self.gpt.requires_grad_(False)
        # the LM-head route, chosen once: token_stats, train_step and generate all run through it
        self.route = Route.choose(cfg.use_fused_linear_ce, cfg.capture_seam, cfg.lce_backend, cfg.lce_cache_bytes)
        self.route.check(self.gpt.config)
        module = self.gpt
        if self.dtype != torch.float32:
            from megatron.core.transformer.module import Float16Module

            module = Float16Module(self.gpt.config, self.gpt)
        if trainable:
            ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                    use_distributed_optimizer=False)
            self.model = DistributedDataParallel(self.gpt.config, ddp_cfg, module)
        else:  # the DDP wrapper exists for its grad buffers and reduction: a frozen model needs neither
            self.model = module

    def _require_trainable(self, what: str) -> None:
        if not self.trainable:
            raise RuntimeError(f"{what} needs a trainable engine; this MegatronEngine was built with "
                               "trainable=False (frozen: no grad buffers, no optimizer)")

    # ------------------------------------------------------------------------------ optimizer
    def _build_optimizer(self) -> None:
        self.optimizer, self.megatron_optimizer = build_optimizer(self.model, self.cfg.optim, self.dtype)

    def _grad_norm_and_clip(self) -> float:
        return grad_norm_and_clip(self.model, self.mp_group, self.device, self.cfg.optim.clip_grad)

    def _set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    # ------------------------------------------------------------------------------ forward
    def _seq_multiple(self) -> int:
        return self.dist.tp_size if self.cfg.parallel.sequence_parallel else 1

    def _prepare(self, input_ids: torch.Tensor, labels: torch.Tensor, min_packed_length: int = 0) -> ModelBatch:
        return prepare_batch(input_ids, labels, device=self.device, max_seq_len=self.cfg.model.max_seq_len,
                             pack=self.cfg.pack_sequences, seq_multiple=self._seq_multiple(),
                             min_packed_length=min_packed_length, cp_group=self.cp_group, cp_size=self.dist.cp_size,
                             cu_seqlens_on_host=not use_te_spec())

    def _call_model(self, mb: ModelBatch, temperature: float) -> torch.Tensor:
        """One model call through `token_stats`' route: packed stats [b, s, 4] / [1, T, 4] on the last
        pipeline stage, hidden states on the others."""
        with per_token_rope(self.gpt, mb):
            return self.route.stats(self.model, mb.input_ids, mb.labels, vocab_size=self.vocab_size,
                                    position_ids=mb.position_ids, attention_mask=mb.attention_mask,
                                    packed_seq_params=mb.packed_seq_params, temperature=float(temperature))

    def _forward_stats(self, input_ids, labels, temperature: float) -> TokenStats:
        mb = self._prepare(input_ids, labels)
        return mb.stats(self._call_model(mb, temperature))

    @cpu_shims()
    def token_stats(self, input_ids: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                    grad: bool = False) -> TokenStats:
        """Per-token stats of `labels` (next-token targets aligned with input positions; -100 ignored),
        [b, s] in and out whether or not the engine packs. Under pipeline parallelism (grad=False only)
        every stage receives the last stage's values."""
        if grad:
            self._require_trainable("token_stats(grad=True)")
        if self.dist.pp_size > 1:
            if grad:
                raise ValueError("token_stats(grad=True) needs parallel.pipeline_parallel=1; under pipeline "
                                 "parallelism gradients flow only through train_step")
            packed = self._pipeline_forward([(input_ids, labels, float(temperature))])[0]
            return TokenStats(*packed.unbind(-1))
        if grad:
            return self._forward_stats(input_ids, labels, temperature)
        with torch.no_grad():
            return self._forward_stats(input_ids, labels, temperature)

    # ------------------------------------------------------------------------------ pipeline
    def _pipeline_shapes(self, batches, pack: bool):
        """Fixed (micro_batch_size, seq_length) of the p2p tensors: padded [b, s] rows, or one packed row
        of the longest packed micro-batch."""
        if pack:
            return 1, max(packed_length(ids, lab, self._seq_multiple()) for ids, lab, _t in batches)
        b = max(x[0].shape[0] for x in batches)
        s = max(x[0].shape[1] for x in batches)
        return b, s + (-s) % self._seq_multiple()

    @staticmethod
    def _pad_to(input_ids, labels, b: int, s: int):
        """Pad a microbatch to the pipeline's fixed [b, s] (p2p tensors have one shape per step)."""
        ids = torch.zeros(b, s, dtype=torch.long)
        lab = torch.full((b, s), -100, dtype=torch.long)
        ids[: input_ids.shape[0], : input_ids.shape[1]] = input_ids
        lab[: labels.shape[0], : labels.shape[1]] = labels
        return ids, lab

    def _run_schedule(self, batches, on_stats, forward_only: bool) -> None:
        """Megatron's pipeline schedule over `batches` = [(input_ids, labels, temperature)];
        `on_stats(i, TokenStats)` runs on the last stage and returns microbatch i's loss tensor."""
        from functools import partial

        from megatron.core.pipeline_parallel import get_forward_backward_func

        pack = self.cfg.pack_sequences
        b, s = self._pipeline_shapes(batches, pack)
        n = len(batches)

        def loss_func(i, mb, out):
            # The schedule divides each microbatch's loss by the microbatch count; the caller has
            # already normalised it (the engine sums), so undo that division.
            return on_stats(i, mb.stats(out)) * n, {}

        def forward_step(data_iterator, model):
            i, (input_ids, labels, temperature) = next(data_iterator)
            if pack:  # one packed row per micro-batch, all of the pipeline's fixed length s
                mb = self._prepare(input_ids, labels, min_packed_length=s)
            else:
                mb = self._prepare(*self._pad_to(input_ids, labels, b, s))
                mb.shape = tuple(input_ids.shape)
            return self._call_model(mb, temperature), partial(loss_func, i, mb)

        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(list(enumerate(batches))), model=[self.model],
            num_microbatches=n, seq_length=s, micro_batch_size=b, forward_only=forward_only)

    def _pipeline_forward(self, batches) -> List[torch.Tensor]:
        """Forward-only pipeline pass; per microbatch packed [b, s, 4] stats on EVERY stage."""
        store: Dict[int, torch.Tensor] = {}

        def keep(i, stats):
            store[i] = torch.stack(list(stats), -1).detach()
            return stats.logprobs.sum() * 0.0

        with torch.no_grad():
            self._run_schedule(batches, keep, forward_only=True)
        outs = []
        for i, (ids, _lab, _t) in enumerate(batches):
            t = store.get(i, torch.zeros(ids.shape[0], ids.shape[1], 4, device=self.device)).contiguous()
            comms.all_reduce_sum_(t, self.pp_group)  # SUM over stages: only the last stage holds values
            outs.append(t)
        return outs


    # ------------------------------------------------------------------------------ training
    @cpu_shims()
    def train_step(self, microbatches: List[MicroBatch], loss_fn: Callable) -> Dict[str, float]:
        from megatron.core.distributed import finalize_model_grads

        self._require_trainable("train_step")
        check_microbatches(microbatches)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss_sum, sums = 0.0, {}
        tokens = sum(mb.target_tokens() for mb in microbatches)

        def account(mb, stats):
            nonlocal loss_sum
            loss, metrics = loss_fn(stats, mb)
            loss_sum += float(loss.detach())
            for k, v in (metrics or {}).items():
                sums[k] = sums.get(k, 0.0) + float(v.detach() if torch.is_tensor(v) else v)
            return loss

        if self.dist.pp_size > 1:
            batches = [(mb.input_ids, mb.labels, float(mb.temperature)) for mb in microbatches]
            self._run_schedule(batches, lambda i, st: account(microbatches[i], st), forward_only=False)
        else:
            for mb in microbatches:
                stats = self.token_stats(mb.input_ids, mb.labels, temperature=float(mb.temperature), grad=True)
                # Under CP every rank holds the full statistics and the same loss, and its backward reaches
                # only its own tokens; megatron's DDP averages over data x context parallel ranks, so the
                # loss is scaled by cp for that average to be the sum of the CP shares (as Megatron-LM does).
                (account(mb, stats) * self.dist.cp_size).backward()
        checks.check_deferred()  # the op's deferred label checks, read where the loss floats already synced
        # DP all-reduce of the grad buffers, SP norm grads over TP, tied embeddings across stages.
        finalize_model_grads([self.model])
        lr = lr_at(self.step_count, self.cfg.optim)
        self._set_lr(lr)
        if self.megatron_optimizer:
            _ok, grad_norm, _zeros = self.optimizer.step()
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        else:
            grad_norm = self._grad_norm_and_clip()
            for p in self.model.parameters():
                if p.requires_grad:
                    # fp32 on CPU: a view of the grad buffer. (bf16 on CPU has no fp32 master weights;
                    # it exists to exercise the Float16Module path, not to train.)
                    p.grad = p.main_grad if p.main_grad.dtype == p.dtype else p.main_grad.to(p.dtype)
            self.optimizer.step()
        self.step_count += 1
        # Report the data-parallel mean of the per-rank numbers (every rank prints the same values).
        keys = object_from_last_stage(sorted(sums), self.dist)  # under PP only the last stage ran loss_fn
        # on the engine's device: NCCL groups reduce CUDA tensors only
        vec = torch.tensor([loss_sum, float(tokens)] + [sums.get(k, 0.0) / len(microbatches) for k in keys],
                           dtype=torch.float64, device=self.device)
        if self.dist.pp_size > 1:
            if not self.dist.is_last_stage:
                vec[0] = 0.0
                vec[2:] = 0.0
            comms.all_reduce_sum_(vec, self.pp_group)  # SUM over stages: values live on the last one
        comms.all_reduce_sum_(vec, self.dp_group)  # SUM over data-parallel ranks
        dp = self.dist.dp_size
        out = {k: float(vec[2 + i]) / dp for i, k in enumerate(keys)}
        out.update(loss=float(vec[0]) / dp, grad_norm=grad_norm, lr=lr, tokens=float(vec[1]),
                   peak_mem_gib=self.peak_mem_gib())
        return out

    @staticmethod
    def peak_mem_gib() -> float:
        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated() / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux

    # ------------------------------------------------------------------------------ generation
    @torch.no_grad()
    @cpu_shims()
    def generate(self, prompts: List[List[int]], max_new_tokens: int, *, temperature: float = 1.0,
                 top_p: float = 1.0, eos_id: Optional[int] = None,
                 generator: Optional[torch.Generator] = None) -> List[List[int]]:
        """Sample continuations (new tokens only) from the current policy; identical on every TP rank
        when the CPU `generator` is seeded identically (default: seeded from cfg.seed and the call count).
        Sampling runs on the engine's device; only the chosen token ids reach the host. With
        cfg.kv_cache the prompts are prefilled once and each new token reads cached keys/values
        (megatron-core's static inference context); else every step re-runs the whole prefix (generate.py)."""
        generation.check_request(prompts, max_new_tokens, temperature, top_p)
        if generator is None:
            generator = torch.Generator().manual_seed(self.cfg.seed * 1000003 + self._gen_calls)
        self._gen_calls += 1
        return generation.generate_tokens(self, prompts, max_new_tokens, temperature=temperature, top_p=top_p,
                                          eos_id=eos_id, generator=generator)

    # ------------------------------------------------------------------------------ state
    def parameters_named(self) -> Dict[str, torch.nn.Parameter]:
        """This rank's parameters (TP shards) by GPTModel name."""
        return dict(self.gpt.named_parameters())

    def grads(self) -> Dict[str, torch.Tensor]:
        """This rank's finalised gradients (main_grad after the last train_step's reduction), by name."""
        return {n: p.main_grad.detach().clone() for n, p in self.gpt.named_parameters() if p.requires_grad}

    def _rank_file(self, path: str) -> str:
        return os.path.join(path, f"rank{self.dist.rank:05d}.pt")

    def save(self, path: str) -> None:
        from megatron.core import tensor_parallel

        os.makedirs(path, exist_ok=True)
        state = {
            "model": self.gpt.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "step_count": self.step_count,
            "gen_calls": self._gen_calls,
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
                    "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()},
            "meta": {"world_size": self.dist.world_size, "tp": self.dist.tp_size, "vocab_size": self.vocab_size},
        }
        durable.torch_save(state, self._rank_file(path))  # temp name, fsync, rename: on disk before COMPLETE

    def load(self, path: str) -> None:
        from megatron.core import tensor_parallel

        f = self._rank_file(path)
        if not os.path.isfile(f):
            raise FileNotFoundError(f"no engine checkpoint for rank {self.dist.rank} at {f!r}")
        state = torch.load(f, map_location=self.device, weights_only=False)
        meta = state["meta"]
        if meta["world_size"] != self.dist.world_size or meta["tp"] != self.dist.tp_size:
            raise ValueError(f"checkpoint {path!r} was written with world_size={meta['world_size']}, "
                             f"tp={meta['tp']}; this run has {self.dist.world_size}, {self.dist.tp_size}")
        self.gpt.load_state_dict(state["model"])
        if self.optimizer is not None:
            if state["optimizer"] is None:
                raise ValueError(f"checkpoint {path!r} has no optimizer state (written by a trainable=False "
                                 "engine); a trainable engine cannot resume from it")
            self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = state["step_count"]
        self._gen_calls = state["gen_calls"]
        torch.set_rng_state(state["rng"]["torch"].cpu())
        if torch.cuda.is_available() and state["rng"]["cuda"] is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"].cpu())
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng"]["tracker"])

