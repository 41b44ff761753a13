"""Next-token logits for generation: the KV-cache route on megatron-core's static inference context,
with fixed-shape decode steps that CUDA graphs replay, and the full-recompute reference route.

`GenerationModel` is the narrow view of the engine that generation needs (called model, bare GPTModel,
`Route`, `DistInfo`, vocabulary and length limits); nothing here calls back into the engine. Every
forward goes through `next_token_logits`: one model call through the route's last-token processor
(the LM head builds logits for the last position only), under pipeline parallelism one forward-only
micro-batch through megatron's schedule. It returns a `NextToken`: the fp32 logits and the last hidden
states they come from, which `sampled_logprobs` hands to the training head for the sampled tokens'
logprobs (sampling.py).

KV cache (`CachedSteps`), all megatron-core machinery: `StaticInferenceContext` passed as
`GPTModel.forward(inference_context=...)`; each `Attention` allocates its K/V buffers
[slots, batch, groups / tp, head_dim] on first use, writes the new keys/values at slots
[sequence_len_offset, + sq) and hands the core attention slots [0, offset + sq), keys before RoPE
(RoPE is applied at the slots' positions, from the model's rotary table).
  * prefill  all prompts in one forward at offset 0, LEFT-padded to the longest prompt (one slot axis
           for the batch). A per-sequence key mask ([n, 1, sq, sk] bool, True = masked, megatron's
           convention) hides the padding; RoPE is relative, so a prompt shifted right by its padding
           attends as unshifted (to rounding). Unequal prompts cost the padding's prefill and slots.
  * decode   one forward per new token on [batch, 1] last tokens, at FIXED shapes, so that the step
           can be captured once in a CUDA graph and replayed (megatron's own static-batch graphs need
           its flash-decode kernels): the context's offset stays at the last slot S-1, a staging slot,
           so megatron writes the new K/V there and always reads all S slots. The step's real slot t
           lives on the device: a forward hook on the model's rotary embedding gives the staging slot
           the angles of position t (the other slots keep their own), the key mask hides slots
           [t, S-1) and each row's padding, and after the forward the staging K/V are copied to slot t
           and t advances. Nothing in a step reads a device value on the host.
  * EOS    finished sequences stop costing compute in steps: the decode batch is the smallest of
           n, and the powers of two below n, that holds the live sequences (one graph per size, captured
           when first needed); when it shrinks, the cache rows are permuted in place (live rows first;
           megatron's `swap_key_value_dict` would re-allocate the buffers a graph points to) and finished
           rows inside the batch compute on unread.
  * graphs   `cuda_graphs=True` on CUDA with PP = 1, at any TP degree whose group runs on NCCL (the
           step's collectives, megatron's TP all-reduces and the logits gather, are captured with it: every
           TP rank captures and replays the same step in lockstep, as the ranks decode the same batch):
           a size's first step runs eagerly (lazy initialisation, NCCL communicator set-up), the next is
           captured and every later one replays; elsewhere (CPU, gloo, PP > 1) the same fixed-shape step
           runs eagerly. A replay's logits and hidden states are overwritten by the next (the sampled
           tokens' logprobs are taken before it).
  * TP / PP  each rank caches its own K/V heads, each stage its own layers; logits are gathered over TP
           and shared over the pipeline group, so every rank samples the same tokens. Sequence
           parallelism is off while generating (generate.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional

import torch

from ...op import comms
from ..batch import prepare as prepare_batch
from ..parallel import DistInfo
from ...megatron.context_parallel import CPGroup
from ...megatron.route import Route
from .sampling import token_logprobs
from ..schedule import from_last_stage, run_schedule


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


class NextToken(NamedTuple):
    """The LM head's output for generation, one row per sequence: `logits` [n, vocab] fp32 over the true
    vocabulary (the fp32 accumulation of h·Wᵀ) and `hidden` [n, H] fp32, the last hidden states they come
    from (the head's input, exactly), for the sampled tokens' logprobs."""

    logits: torch.Tensor
    hidden: torch.Tensor

    def rows(self, index) -> "NextToken":
        return NextToken(self.logits[index], self.hidden[index])


def _next_token(gm: GenerationModel, out: torch.Tensor) -> NextToken:
    """Split the last-token processor's [b, V_pad + H] output (capture.py)."""
    return NextToken(out[:, :gm.vocab_size], out[:, out.shape[1] - gm.gpt.config.hidden_size:])


def next_token_logits(gm: GenerationModel, ids, pos, mask, last: torch.Tensor, **model_kwargs) -> NextToken:
    """Logits and hidden states at position `last[i]` of each row i, on every rank (see the module doc)."""
    b = ids.shape[0]
    if gm.dist.pp_size == 1:
        return _next_token(gm, gm.route.last_token_logits(gm.model, gm.gpt, last, ids, pos, mask, **model_kwargs))
    store = {}

    def forward(_i, _item, model):
        def keep(out):
            store["out"] = out.float()
            return out.float().sum() * 0.0
        return gm.route.last_token_logits(model, gm.gpt, last, ids, pos, mask, **model_kwargs), keep

    run_schedule(gm.model, [None], forward, seq_length=ids.shape[1], micro_batch_size=b, forward_only=True)
    width = gm.gpt.vocab_size + gm.gpt.config.hidden_size  # padded vocabulary + hidden
    out = store["out"] if "out" in store else torch.zeros(b, width, device=gm.device)
    return _next_token(gm, from_last_stage(out, gm.dist.pp_group))


def sampled_logprobs(gm: GenerationModel, hidden: torch.Tensor, tokens: torch.Tensor, *, temperature: float,
                     invariant: Optional[bool], logits_precision: Optional[str]) -> torch.Tensor:
    """[n] fp32 logprobs of the sampled `tokens` from the `hidden` states of their `NextToken`, by the
    training head (`sampling.token_logprobs`) with this rank's LM-head weight (the output layer's, or the
    shared embedding's when tied, as GPTModel picks it) over the TP group; computed on the last pipeline
    stage and shared over the pipeline, so every rank holds them."""
    d, gpt = gm.dist, gm.gpt
    if d.pp_size > 1 and not d.is_last_stage:
        lp = torch.zeros(tokens.shape, dtype=torch.float32, device=gm.device)
    else:
        weight = (gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights
                  else gpt.output_layer.weight)
        lp = token_logprobs(hidden, weight, tokens, temperature=temperature, vocab_size=gm.vocab_size,
                            backend=gm.route.options.backend, invariant=invariant, logits_precision=logits_precision,
                            tp_group=d.tp_group if d.tp_size > 1 else None)
    return from_last_stage(lp, d.pp_group) if d.pp_size > 1 else lp


@torch.no_grad()
def recompute_next_logits(gm: GenerationModel, seqs: List[List[int]]) -> NextToken:
    """Reference route: the `NextToken` (full-vocabulary fp32 logits [n, vocab], hidden states) of the token
    after each sequence, on every rank, re-running each whole sequence. Only the n last-position rows of
    logits are computed."""
    lengths = [len(x) for x in seqs]
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
    cp = CPGroup.of(gm.dist.cp_group if gm.dist.cp_size > 1 else None)
    mb = prepare_batch(ids, torch.full_like(ids, -100), device=gm.device, max_seq_len=gm.max_seq_len, pack=False,
                       seq_multiple=gm.seq_multiple, cp=cp)
    last = torch.tensor(lengths, device=gm.device) - 1
    return next_token_logits(gm, mb.input_ids, mb.position_ids, mb.attention_mask, last, cp_group=cp)


def decode_batch(n_live: int, n: int) -> int:
    """Rows a decode step runs on: the smallest of n and the powers of two below n that is >= n_live."""
    b = n
    while b > 1:
        smaller = 1 << ((b - 1).bit_length() - 1)  # the largest power of two below b
        if smaller < n_live:
            break
        b = smaller
    return b


def graphs_usable(gm: GenerationModel) -> bool:
    """CUDA graphs for the decode step: on CUDA, one pipeline stage, and a tensor-parallel group of one rank
    or on NCCL (whose collectives a CUDA graph captures; gloo's run on the host)."""
    if gm.device.type != "cuda" or gm.dist.pp_size != 1:
        return False
    return gm.dist.tp_size == 1 or comms.group_backend(gm.dist.tp_group) == "nccl"


class CachedSteps:
    """Next-token logits through megatron's StaticInferenceContext: prefill on the first call, then one
    fixed-shape decode step per call (module doc). Use as a context manager: leaving it removes the
    rotary hook and frees the graphs."""

    def __init__(self, gm: GenerationModel, prompts: List[List[int]], max_steps: int, *, cuda_graphs: bool):
        from megatron.core.inference.contexts import StaticInferenceContext

        self.gm, self.prompts, dev = gm, prompts, gm.device
        self.n = len(prompts)
        self.width = max(len(p) for p in prompts)  # prompts are left-padded to this many slots
        # step k >= 1 writes slot width + k - 1 (the last, k = max_steps - 1, slot width + max_steps - 2);
        # slot S - 1 = width + max_steps - 1 is the staging slot
        self.S = self.width + max(max_steps, 1)
        self.ctx = StaticInferenceContext(self.n, self.S)
        self.rows = list(range(self.n))  # prompt index of each cache row of the decode batch, in row order
        self.pad = torch.tensor([self.width - len(p) for p in prompts], device=dev)
        self.t = torch.tensor(self.width, device=dev)  # the real slot of the next decode step's token
        self.slots = torch.arange(self.S, device=dev)
        self.rope_index = torch.arange(self.S, device=dev)  # rotary row of each slot: the staging one -> t
        self.ids = torch.zeros(self.n, 1, dtype=torch.long, device=dev)
        self.last = torch.full((self.n,), -1, dtype=torch.long, device=dev)
        self.use_graphs = cuda_graphs and graphs_usable(gm)
        self.graphs: dict = {}  # batch -> (CUDAGraph, its logits) ; batch -> None once warmed up
        self.pool = None
        self._hook = None

    def __enter__(self) -> "CachedSteps":
        return self

    def __exit__(self, *exc) -> None:
        if self._hook is not None:
            self._hook.remove()
        self.graphs.clear()

    def __call__(self, live: List[int], new: List[List[int]]) -> NextToken:
        """The `NextToken` of the live sequences (prompt + new tokens), in `live`'s order."""
        if self.ctx.sequence_len_offset == 0:
            return self._prefill()
        b = decode_batch(len(live), self.n)
        if b < len(self.rows):
            self._shrink(live, b)
        row = {p: r for r, p in enumerate(self.rows)}
        tokens = [[new[p][-1]] for p in self.rows]  # finished rows in the batch repeat their last token
        self.ids[:b].copy_(torch.tensor(tokens, dtype=torch.long))
        out = self._decode(b)
        at = [row[p] for p in live]
        in_order = at == list(range(len(live)))
        return out.rows(slice(0, len(live)) if in_order else torch.tensor(at, device=self.gm.device))

    # ---------------------------------------------------------------------------- prefill
    def _prefill(self) -> NextToken:
        dev, w = self.gm.device, self.width
        ids = torch.zeros(self.n, w, dtype=torch.long)
        for i, p in enumerate(self.prompts):
            ids[i, w - len(p):] = torch.tensor(p, dtype=torch.long)
        slots = self.slots[:w]
        mask = (slots[None, :] > slots[:, None])[None, None]  # [1, 1, w, w] causal, True = masked
        if any(len(p) < w for p in self.prompts):  # + each row's padding keys; a padding query sees itself
            mask = mask | (slots[None, :] < self.pad[:, None])[:, None, None, :]
            mask = mask & ~torch.eye(w, dtype=torch.bool, device=dev)
        out = self._forward(ids.to(dev), mask)
        for kv in self.ctx.key_value_memory_dict.values():
            for buf in kv:  # unwritten slots stay finite: a masked key still meets its value in P @ V
                buf[w:].zero_()
        self.ctx.sequence_len_offset = self.S - 1  # every decode step writes the staging slot
        self.ctx.enable_decode_mode()
        rotary = getattr(self.gm.gpt, "rotary_pos_emb", None)
        if rotary is not None:
            self._hook = rotary.register_forward_hook(lambda _m, _a, table: table.index_select(0, self.rope_index))
        return out

    # ---------------------------------------------------------------------------- decode
    def _decode(self, b: int) -> NextToken:
        if not self.use_graphs:
            return self._step(b)
        if b not in self.graphs:  # first step at this size: eager (cuBLAS / cuDNN handles, lazy inits)
            self.graphs[b] = None
            return self._step(b)
        if self.graphs[b] is None:
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):  # records the step; nothing runs yet
                out = self._step(b)
            self.graphs[b] = (graph, out)
        graph, out = self.graphs[b]
        graph.replay()
        return out

    def _step(self, b: int) -> NextToken:
        """One fixed-shape decode step on cache rows [0, b): device-side slot t, no host reads."""
        last = self.S - 1
        self.rope_index[last:].copy_(self.t)
        hidden = (self.slots[None, :] < self.pad[:b, None]) | ((self.slots >= self.t) & (self.slots < last))
        out = self._forward(self.ids[:b], hidden[:, None, None, :])
        for kv in self.ctx.key_value_memory_dict.values():
            for buf in kv:  # the new token's K/V from the staging slot to its real slot t
                buf[:, :b].index_copy_(0, self.t.view(1), buf[last:, :b].clone())
        self.t.add_(1)
        return out

    def _shrink(self, live: List[int], b: int) -> None:
        """Permute the cache rows in place so the live sequences are rows [0, len(live)), then run on b."""
        where = {p: r for r, p in enumerate(self.rows)}
        keep = [where[p] for p in live]
        order = keep + sorted(set(range(self.n)) - set(keep))
        idx = torch.tensor(order, device=self.gm.device)
        for kv in self.ctx.key_value_memory_dict.values():
            for buf in kv:
                buf.copy_(buf.index_select(1, idx))
        self.pad.copy_(self.pad.index_select(0, idx))
        self.rows = [self.rows[r] for r in order[:b]]

    def _forward(self, ids: torch.Tensor, mask: Optional[torch.Tensor]) -> NextToken:
        b, sq = ids.shape
        if self.ctx.sequence_len_offset == 0:
            pos = self.slots[:sq].unsqueeze(0).expand(b, sq)
        else:
            pos = self.t.view(1, 1).expand(b, 1)
        return next_token_logits(self.gm, ids, pos, mask, self.last[:b], inference_context=self.ctx,
                                 runtime_gather_output=True)
