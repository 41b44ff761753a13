"""Token generation for MegatronEngine: KV-cache decoding on megatron-core's static inference context,
and the full-recompute reference.

What generation needs of the engine is one narrow value, `GenerationModel` (the called model and the
bare GPTModel, the engine's `Route`, its `DistInfo`, vocabulary and length limits), which
`MegatronEngine.generate` builds; nothing here calls back into the engine.

One sampling loop drives either route. Each step a route returns the fp32 next-token logits of the
live sequences (in order, full vocabulary, on every rank; the LM head builds them for the last position
only, through the capture seam's last-token processor), `sample_tokens` picks the tokens on the device
and only their ids reach the host. Both routes see the same uniforms from the same host generator, so
they give the same tokens wherever their logits agree (fp32: to rounding).

KV cache (`engine.kv_cache: true`, the default), all megatron-core machinery:
  * cache  `StaticInferenceContext` passed as `GPTModel.forward(inference_context=...)`: each `Attention`
           allocates its K/V buffers [slots, batch, groups / tp, head_dim] on first use, writes the new
           keys/values at slots [sequence_len_offset, + sq) and hands the core attention slots
           [0, offset + sq) (keys are cached before RoPE; RoPE is applied at their slot positions).
  * prefill  all prompts in one forward, LEFT-padded to the longest prompt: the static context has one
           slot offset for the whole batch, so rows share one slot axis. A per-sequence key mask
           ([n, 1, sq, sk] bool, True = masked, megatron's convention) hides the padding slots in prefill
           and decode; RoPE is relative, so a prompt shifted right by its padding attends exactly as
           unshifted (to rounding). Unequal prompts therefore cost the padding's prefill compute and
           cache slots. Equal prompts need no mask. (megatron's dynamic context has per-request paged
           KV without padding, but its attention needs flash-attn's paged varlen kernels.)
  * decode one forward per new token on the [n_live, 1] last tokens; megatron switches the layers'
           mask type to no_mask and the core attention gets query length 1 against the cached keys.
  * EOS    finished sequences leave the decode batch: before the next step megatron's
           `swap_key_value_dict` permutes the cache rows so the live ones come first, and the step
           runs on those rows only (attention reads cache rows [0, n_live)).
  * TP     each rank caches its own K/V heads; logits are gathered over TP, so every rank samples the
           same tokens. SP: off while generating (a one-token step cannot be split over TP ranks), by
           megatron's `set_model_to_sequence_parallel`, restored afterwards.
  * PP     every stage caches its own layers; each forward runs megatron's pipeline schedule (one
           microbatch, forward only) and the last stage's logits reach the others by a sum over the
           pipeline group, as on the recompute route.
  * megatron-core 0.16/0.17: same context and keyword; an eval model given a context is in inference
           mode there, which asks for runtime_gather_output=True and hands the LM head the last
           position only: the last-token processor reads position -1 either way.
Falls back to the recompute route, with a warning: Transformer Engine core attention (its static-batch
path ignores the padding mask), or a megatron-core without StaticInferenceContext.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch

from .batch import prepare as prepare_batch
from .parallel import DistInfo
from .route import Route
from .sampling import sample_tokens
from .schedule import from_last_stage, run_schedule

# core attentions that honour the KV-cache contract (decode shapes + a per-sequence boolean mask)
CACHE_ATTENTIONS = ("SDPAttention", "DotProductAttention")


@dataclass(frozen=True)
class GenerationModel:
    """The model generation runs: `model` is what is called (DDP / Float16Module wrapped, switched to
    eval while generating), `gpt` the bare GPTModel; every forward goes through `route`'s seam.
    `seq_multiple`: the sequence length must be a multiple of it (TP size under sequence parallelism)."""

    model: Any
    gpt: Any
    route: Route
    dist: DistInfo
    vocab_size: int
    max_seq_len: int
    seq_multiple: int

    @property
    def device(self) -> torch.device:
        return self.dist.device


def check_request(prompts: List[List[int]], max_new_tokens: int, temperature: float, top_p: float) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs non-empty prompts")
    if max_new_tokens < 0 or temperature < 0 or not 0 < top_p <= 1:
        raise ValueError("generate: max_new_tokens >= 0, temperature >= 0 and 0 < top_p <= 1 required")


def generate_tokens(gm: GenerationModel, prompts: List[List[int]], max_new_tokens: int, *, kv_cache: bool,
                    temperature: float, top_p: float, eos_id: Optional[int],
                    generator: torch.Generator) -> List[List[int]]:
    """New tokens per prompt (stopping after `eos_id`, at max_new_tokens, or when the longest live
    sequence reaches gm.max_seq_len), through the KV cache when `kv_cache` and the model allow.
    The request is checked by the caller (`check_request`)."""
    prompts = [list(p) for p in prompts]
    cached = kv_cache and kv_cache_supported(gm)
    was_training = gm.model.training
    gm.model.eval()
    max_seq_len = gm.max_seq_len

    def recompute(live, new):
        return recompute_next_logits(gm, [prompts[i] + new[i] for i in live])

    try:
        with sequence_parallel_off(gm.gpt) if cached else contextlib.nullcontext():
            # at most max_seq_len - shortest prompt steps: the loop stops when a live sequence reaches it
            steps = min(max_new_tokens, max_seq_len - min(len(p) for p in prompts))
            step = CachedSteps(gm, prompts, steps) if cached else recompute
            return sample_loop(step, prompts, max_new_tokens, max_seq_len, temperature, top_p, eos_id, generator)
    finally:
        if was_training:
            gm.model.train()


def sample_loop(next_logits: Callable, prompts, max_new_tokens: int, max_seq_len: int, temperature: float,
                top_p: float, eos_id: Optional[int], generator: torch.Generator) -> List[List[int]]:
    """`next_logits(live, new)` -> [len(live), vocab] logits of the live sequences (prompt + new tokens)."""
    new: List[List[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    for _ in range(max_new_tokens):
        if not live or max(len(prompts[i]) + len(new[i]) for i in live) >= max_seq_len:
            break
        toks = sample_tokens(next_logits(live, new), temperature, top_p, generator).tolist()
        still = []
        for i, t in zip(live, toks):
            new[i].append(t)
            if eos_id is None or t != eos_id:
                still.append(i)
        live = still
    return new


def kv_cache_supported(gm: GenerationModel) -> bool:
    if gm.dist.cp_size > 1:
        warnings.warn(f"engine.kv_cache: megatron's static inference context does not run under context "
                      f"parallelism (parallel.context_parallel={gm.dist.cp_size}); generating by full "
                      "recompute over the CP-split sequences", RuntimeWarning, stacklevel=3)
        return False
    try:
        from megatron.core.inference.contexts import StaticInferenceContext  # noqa: F401
    except ImportError:
        warnings.warn("engine.kv_cache: this megatron-core has no StaticInferenceContext; generating by full "
                      "recompute", RuntimeWarning, stacklevel=3)
        return False
    kinds = {type(layer.self_attention.core_attention).__name__ for layer in gm.gpt.decoder.layers}
    if not kinds <= set(CACHE_ATTENTIONS):
        warnings.warn(f"engine.kv_cache: core attention {sorted(kinds - set(CACHE_ATTENTIONS))} does not take "
                      f"the cache's padding mask (supported: {CACHE_ATTENTIONS}); generating by full recompute",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


@contextlib.contextmanager
def sequence_parallel_off(gpt_model):
    """Megatron's static inference runs without sequence parallelism; restore it afterwards."""
    if not gpt_model.config.sequence_parallel:
        yield
        return
    from megatron.core.transformer import utils

    def forget():  # megatron caches the model's modules by id(): a freed model's id can come back
        (getattr(utils, "_sequence_parallel_attr_cache", None) or {}).pop(id(gpt_model), None)

    forget()
    utils.set_model_to_sequence_parallel(gpt_model, False)
    try:
        yield
    finally:
        utils.set_model_to_sequence_parallel(gpt_model, True)
        forget()


# ------------------------------------------------------------------------------------ KV cache


class CachedSteps:
    """Next-token logits through megatron's StaticInferenceContext: prefill on the first call, then one
    token per call; finished sequences are dropped from the cache batch."""

    def __init__(self, gm: GenerationModel, prompts: List[List[int]], max_steps: int):
        from megatron.core.inference.contexts import StaticInferenceContext

        self.gm, self.prompts = gm, prompts
        self.width = max(len(p) for p in prompts)  # prompts are left-padded to this many slots
        # step t > 0 writes slot width + t - 1: the last of max_steps steps needs width + max_steps - 1 slots
        self.ctx = StaticInferenceContext(len(prompts), self.width + max(max_steps, 1) - 1)
        self.rows = list(range(len(prompts)))  # prompt index of each active cache row, in row order
        self.pad = torch.tensor([self.width - len(p) for p in prompts], device=gm.device)
        self.padded = bool(self.pad.any())

    def __call__(self, live: List[int], new: List[List[int]]) -> torch.Tensor:
        dev = self.gm.device
        if self.ctx.sequence_len_offset == 0:
            return self._prefill()
        if live != self.rows:
            self._drop_finished(live)
        ids = torch.tensor([[new[i][-1]] for i in live], dtype=torch.long, device=dev)
        mask = None
        if self.padded:  # the padding slots of each row stay hidden; every cached key precedes the query
            slots = torch.arange(self.ctx.sequence_len_offset + 1, device=dev)
            mask = (slots[None, :] < self.pad[:, None])[:, None, None, :]
        return self._forward(ids, mask)

    def _prefill(self) -> torch.Tensor:
        dev, w = self.gm.device, self.width
        ids = torch.zeros(len(self.prompts), w, dtype=torch.long)
        for i, p in enumerate(self.prompts):
            ids[i, w - len(p):] = torch.tensor(p, dtype=torch.long)
        slots = torch.arange(w, device=dev)
        mask = (slots[None, :] > slots[:, None])[None, None]  # [1, 1, w, w] causal, True = masked
        if self.padded:  # + each row's padding keys; a padding query still sees itself (no empty row)
            mask = mask | (slots[None, :] < self.pad[:, None])[:, None, None, :]
            mask = mask & ~torch.eye(w, dtype=torch.bool, device=dev)
        out = self._forward(ids.to(dev), mask)
        self.ctx.enable_decode_mode()
        return out

    def _drop_finished(self, live: List[int]) -> None:
        """Megatron's own row swap: live rows first (in order), the others after, then run on n_live rows."""
        where = {i: r for r, i in enumerate(self.rows)}
        keep = [where[i] for i in live]
        rest = sorted(set(range(self.ctx.max_batch_size)) - set(keep))
        self.ctx.swap_key_value_dict(torch.tensor(keep + rest, device=self.gm.device))
        self.pad = self.pad[torch.tensor(keep, device=self.gm.device)]
        self.rows = list(live)

    def _forward(self, ids: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        gm, (b, sq) = self.gm, ids.shape
        start = self.ctx.sequence_len_offset
        pos = torch.arange(start, start + sq, device=gm.device).unsqueeze(0).expand(b, sq)
        last = torch.full((b,), -1, dtype=torch.long, device=gm.device)
        out = next_token_logits(gm, ids, pos, mask, last, inference_context=self.ctx, runtime_gather_output=True)
        self.ctx.sequence_len_offset += sq
        return out


def next_token_logits(gm: GenerationModel, ids, pos, mask, last: torch.Tensor, **model_kwargs) -> torch.Tensor:
    """[b, vocab] fp32 logits at position `last[i]` of each row i, on every rank: one forward through the
    route's last-token processor, under pipeline parallelism one forward-only micro-batch through
    megatron's schedule (only the last stage computes the logits; a sum over the pipeline group shares
    them)."""
    b, v = ids.shape[0], gm.vocab_size
    if gm.dist.pp_size == 1:
        return gm.route.last_token_logits(gm.model, gm.gpt, last, ids, pos, mask, **model_kwargs)[:, :v]
    store = {}

    def forward(_i, _item, model):
        def keep(out):
            store["logits"] = out[:, :v].float()
            return out.float().sum() * 0.0
        return gm.route.last_token_logits(model, gm.gpt, last, ids, pos, mask, **model_kwargs), keep

    run_schedule(gm.model, [None], forward, seq_length=ids.shape[1], micro_batch_size=b, forward_only=True)
    return from_last_stage(store["logits"] if "logits" in store else torch.zeros(b, v, device=gm.device),
                           gm.dist.pp_group)


# ------------------------------------------------------------------------------------ recompute


@torch.no_grad()
def recompute_next_logits(gm: GenerationModel, seqs: List[List[int]]) -> torch.Tensor:
    """Reference route: full-vocabulary fp32 logits [n, vocab] of the token after each sequence, on every
    rank, re-running each whole sequence. Only the n last-position rows of logits are computed."""
    lengths = [len(x) for x in seqs]
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
    cp_group = gm.dist.cp_group if gm.dist.cp_size > 1 else None
    mb = prepare_batch(ids, torch.full_like(ids, -100), device=gm.device, max_seq_len=gm.max_seq_len, pack=False,
                       seq_multiple=gm.seq_multiple, cp_group=cp_group, cp_size=gm.dist.cp_size)
    last = torch.tensor(lengths, device=gm.device) - 1
    return next_token_logits(gm, mb.input_ids, mb.position_ids, mb.attention_mask, last, cp_group=cp_group)
