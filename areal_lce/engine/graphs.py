"""CUDA graphs of the engine's packed model calls: forward + backward in `train_step`, forward-only passes.

Why: on a small model the eager step is limited by the host, not the GPU. A 0.5B SFT step of two 8192-
token micro-batches issues ~3600 kernels from megatron-core's eager modules (about 180 ms of GPU work)
and the host takes longer than that to issue them (benchmark/results/archive/h100_train_rope_fusion). A
replayed graph issues the same kernels in one call.

What is captured, per key (packed length T, number of sequences, temperature, with or without grad, the
LM head's compact_ignored choice; the route's other options, engine.lce's backend, invariant and logits
precision, are the engine's for its whole life):
  * the first call at a key runs eagerly (Triton compiles, cuBLAS handles, megatron's lazy state);
  * the second records the model call (`call_model`: the whole GPTModel with the engine's LM-head
    route) into a forward graph and, with grad, its backward from a static output gradient into a
    backward graph: `torch.autograd.grad` of the parameters, then each gradient added to the parameter's
    `main_grad`, which is what megatron DDP's per-parameter hook does in the eager backward (without
    overlapped reduction). The hooks themselves cannot be recorded: autograd runs them, and the grad
    accumulation, on the stream each parameter was created on -- the legacy default stream, which a
    capture may not touch. Cost: the backward graph holds every parameter's gradient (2 bytes per
    bf16 parameter) until the adds, where the eager backward frees each one after its add;
  * every call from then on copies the micro-batch's ids, labels, positions and cu_seqlens into the
    graph's static inputs and replays the forward graph; the stats come back (cloned) through an autograd
    Function whose backward copies the incoming gradient into the static output gradient and replays
    the backward graph.
Inside the graphs nothing is read on the host: the packed sequences reach attention as the static
cu_seqlens tensor with max_seqlen = T (attention.captured_plan) and RoPE as one angle row per token
(rope.thd_rows), so one graph serves any layout of T tokens in the same number of sequences.

Order: a key's backward replay must follow its forward replay before any other forward replay with grad
(those graphs share one memory pool, so a forward reuses the saved activations' memory). `train_step`
runs each micro-batch's forward, loss and backward in that order, and graphed calls with grad are only
made there. Forward-only graphs have a pool of their own and return copies, so they may run anywhere.
At most MAX_GRAPHS keys are kept (least recently used dropped first).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional

import torch

from .batch import ModelBatch
from ..megatron.packing import PackedLayout, PackedRows, host_to_device

MAX_GRAPHS = 16
_SEEN = "seen"  # a key met once (ran eagerly)


def why_not_graphed(*, device: torch.device, dtype: torch.dtype, tp: int, pp: int, cp: int, packed: bool,
                    te: bool, config) -> str:
    """'' when the engine's model calls can be graphed, else why not (they then run eagerly)."""
    if device.type != "cuda":
        return f"device {device} (CUDA graphs need CUDA)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{dtype} model (packed attention in a graph runs through varlen_attn: bf16 / fp16)"
    if (tp, pp, cp) != (1, 1, 1):
        return f"tensor/pipeline/context parallel = {tp}/{pp}/{cp} (graphs are captured on one rank only)"
    if not packed:
        return "engine.pack_sequences is off (graphs key on the packed THD layout)"
    if te:
        return "Transformer Engine layers"
    if getattr(config, "attention_dropout", 0.0) or getattr(config, "hidden_dropout", 0.0):
        return "dropout > 0"
    if getattr(config, "num_moe_experts", None) or getattr(config, "mtp_num_layers", None):
        return "MoE or MTP layers"
    return ""


class _Entry:
    """One key's static inputs, graphs and outputs."""

    def __init__(self, mb: ModelBatch):
        rows = mb.packed
        t = rows.input_ids.shape[1]
        self.ids, self.labels, self.pos = (x.clone() for x in (rows.input_ids, rows.labels, rows.position_ids))
        self.cu = host_to_device(rows.layout.cu_seqlens, rows.input_ids.device).clone()
        # the static rows' sequences change at every replay, so their layout holds only the bound on the
        # host (T tokens: max_seqlen = T); attention's captured plan reads only the static cu tensor
        layout = PackedLayout.bound(self.cu, t)
        static = PackedRows(self.ids, self.labels, self.pos, layout, rows.index, rows.padded_shape)
        self.mb = ModelBatch(self.ids, self.labels, self.pos, None, static, mb.shape, layout=layout,
                             compact_ignored=mb.compact_ignored)
        self.fwd: Optional[torch.cuda.CUDAGraph] = None
        self.bwd: Optional[torch.cuda.CUDAGraph] = None
        self.out: Optional[torch.Tensor] = None
        self.grad_out: Optional[torch.Tensor] = None

    def load(self, mb: ModelBatch) -> None:
        rows = mb.packed
        self.ids.copy_(rows.input_ids)
        self.labels.copy_(rows.labels)
        self.pos.copy_(rows.position_ids)
        self.cu.copy_(host_to_device(rows.layout.cu_seqlens, self.cu.device))


class _Replay(torch.autograd.Function):
    """Forward: replay the forward graph, return a copy of its output. Backward: the output gradient into
    the static one, replay the backward graph (which adds the parameter gradients to main_grad).
    `anchor` is a leaf that requires grad, so that autograd records this node; it gets no gradient."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, entry: _Entry) -> torch.Tensor:
        entry.fwd.replay()
        ctx.entry = entry
        return entry.out.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        entry = ctx.entry
        entry.grad_out.copy_(grad)
        entry.bwd.replay()
        return None, None


class ModelCallGraphs:
    """CUDA graphs of `call_model(model_batch, temperature)` -> packed stats [1, T, 4] (module doc)."""

    def __init__(self, call_model: Callable, params, device: torch.device):
        self.call_model = call_model
        self.params = [p for p in params if p.requires_grad]
        self.entries: "OrderedDict[tuple, object]" = OrderedDict()
        self.pools: dict = {}  # grad -> memory pool: a forward-only replay never reuses a training graph's memory
        self.anchor = torch.zeros((), device=device, requires_grad=True)
        self.replays = 0  # graph replays so far (tests and benchmarks read it)

    def __call__(self, mb: ModelBatch, temperature: float, grad: bool) -> torch.Tensor:
        rows = mb.packed
        key = (rows.input_ids.shape[1], rows.layout.cu_seqlens.numel(), float(temperature), bool(grad),
               mb.compact_ignored)
        entry = self.entries.get(key)
        if entry is None:  # first sighting: eager
            self._remember(key, _SEEN)
            return self.call_model(mb, temperature)
        self.entries.move_to_end(key)
        if entry == _SEEN:
            entry = self._capture(key, mb, temperature, grad)
        entry.load(mb)
        self.replays += 1
        if not grad:
            entry.fwd.replay()
            return entry.out.clone()
        return _Replay.apply(self.anchor, entry)

    def _remember(self, key, value) -> None:
        self.entries[key] = value
        self.entries.move_to_end(key)
        while len(self.entries) > MAX_GRAPHS:
            self.entries.popitem(last=False)

    def _capture(self, key, mb: ModelBatch, temperature: float, grad: bool) -> _Entry:
        """Record the key's graphs. A failed capture raises: it leaves torch's CUDA generator registered
        to the broken graph, so carrying on eagerly would fail later with a less clear error."""
        entry = _Entry(mb)
        try:
            if grad not in self.pools:
                self.pools[grad] = torch.cuda.graph_pool_handle()
            pool = self.pools[grad]
            entry.fwd = torch.cuda.CUDAGraph()
            with torch.enable_grad() if grad else torch.no_grad():
                with torch.cuda.graph(entry.fwd, pool=pool):  # records; nothing runs yet
                    out = self.call_model(entry.mb, temperature)
            if grad:
                entry.grad_out = torch.zeros_like(out)
                entry.bwd = torch.cuda.CUDAGraph()
                with torch.cuda.graph(entry.bwd, pool=pool):
                    grads = torch.autograd.grad(out, self.params, entry.grad_out, allow_unused=True)
                    for p, g in zip(self.params, grads):
                        if g is not None:  # megatron DDP's hook: main_grad += grad (fp32 buffer)
                            p.main_grad.add_(g)
                    del grads
            entry.out = out.detach()
        except Exception as e:
            first = e  # a failure inside the capture surfaces again when the capture ends: name the first
            while first.__context__ is not None:
                first = first.__context__
            cause = str(first).strip().splitlines()[0] if str(first).strip() else ""
            raise RuntimeError(f"engine.model_cuda_graphs: capturing the model call at packed length {key[0]} "
                               f"({key[1] - 1} sequences, grad={grad}) in a CUDA graph failed: "
                               f"{type(first).__name__}: {cause}. Set engine.model_cuda_graphs: false to run "
                               "every call eagerly") from e
        self._remember(key, entry)
        return entry
