"""Megatron-core's pipeline schedule, driven through callables.

`run_schedule` runs megatron's `get_forward_backward_func` (1F1B with backward, or forward only) over a
list of items with the caller's `forward(i, item, model) -> (stage output, loss(output))`: this module
knows nothing of the engine or of generation, and imports neither. On the last stage `loss` receives
the model's output (statistics or logits) and returns the tensor the schedule backpropagates; the
other stages send their hidden states on. Megatron's p2p tensors have one shape per call, hence the
fixed `[micro_batch_size, seq_length]`.

The engine's use: `stats_schedule` prepares each micro-batch at the pipeline's fixed shape (padded rows,
or packed rows of one length) and hands its statistics, back in the caller's layout, to `on_stats`;
`stats_on_every_stage` runs that forward only and shares the last stage's statistics with every stage.
Generation runs one forward-only item through `run_schedule` (generate.py).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch

from ..op import comms
from .batch import packed_length
from .microbatch import MicroBatch


def run_schedule(model, items: Sequence, forward: Callable, *, seq_length: int, micro_batch_size: int,
                 forward_only: bool) -> None:
    """Megatron's pipeline schedule over `items`: `forward(i, item, model)` -> (output, loss), with
    `loss(output)` -> the loss tensor of item i (called on the last stage only)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        i, item = next(data_iterator)
        output, loss = forward(i, item, model)
        return output, lambda out: (loss(out), {})

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(list(enumerate(items))), model=[model],
        num_microbatches=len(items), seq_length=seq_length, micro_batch_size=micro_batch_size,
        forward_only=forward_only)


def from_last_stage(t: torch.Tensor, pp_group) -> torch.Tensor:
    """The last stage's `t` on every stage (the other stages pass zeros of the same shape)."""
    t = t.contiguous()
    comms.all_reduce_sum_(t, pp_group)  # SUM over stages: only the last stage holds values
    return t


def pipeline_shapes(microbatches: Sequence[MicroBatch], pack: bool, seq_multiple: int) -> Tuple[int, int]:
    """Fixed (micro_batch_size, seq_length) of the p2p tensors: padded [b, s] rows, or one packed row
    of the longest packed micro-batch."""
    if pack:
        return 1, max(packed_length(mb.input_ids, mb.labels, seq_multiple) for mb in microbatches)
    b = max(mb.input_ids.shape[0] for mb in microbatches)
    s = max(mb.input_ids.shape[1] for mb in microbatches)
    return b, s + (-s) % seq_multiple


def pad_to(input_ids: torch.Tensor, labels: torch.Tensor, b: int, s: int):
    """Pad a micro-batch to the pipeline's fixed [b, s] (p2p tensors have one shape per step)."""
    ids = torch.zeros(b, s, dtype=torch.long)
    lab = torch.full((b, s), -100, dtype=torch.long)
    ids[: input_ids.shape[0], : input_ids.shape[1]] = input_ids
    lab[: labels.shape[0], : labels.shape[1]] = labels
    return ids, lab


def stats_schedule(model, microbatches: Sequence[MicroBatch], *, prepare: Callable, call_model: Callable,
                   on_stats: Callable, pack: bool, seq_multiple: int, forward_only: bool) -> None:
    """The pipeline schedule over the engine's micro-batches. `prepare(input_ids, labels,
    min_packed_length)` -> ModelBatch, `call_model(model_batch, temperature)` -> the stage's output
    (the model that the schedule passes is the one `call_model` calls), `on_stats(i, TokenStats)` ->
    micro-batch i's loss tensor, on the last stage."""
    b, s = pipeline_shapes(microbatches, pack, seq_multiple)
    n = len(microbatches)

    def forward(i, mb: MicroBatch, _model):
        if pack:  # one packed row per micro-batch, all of the pipeline's fixed length s
            batch = prepare(mb.input_ids, mb.labels, s)
        else:
            batch = prepare(*pad_to(mb.input_ids, mb.labels, b, s), 0)
            batch.shape = tuple(mb.input_ids.shape)
        # The schedule divides each micro-batch's loss by the micro-batch count; the caller has already
        # normalised it (the engine sums), so undo that division.
        return call_model(batch, mb.temperature), lambda out: on_stats(i, batch.stats(out)) * n

    run_schedule(model, microbatches, forward, seq_length=s, micro_batch_size=b, forward_only=forward_only)


def stats_on_every_stage(model, microbatches: Sequence[MicroBatch], *, pp_group, device,
                         **schedule_kwargs) -> List[torch.Tensor]:
    """Forward-only `stats_schedule` (prepare, call_model, pack, seq_multiple as there): per micro-batch
    packed [b, s, 4] statistics on EVERY stage."""
    store: Dict[int, torch.Tensor] = {}

    def keep(i, stats):
        store[i] = stats.pack().detach()
        return stats.logprobs.sum() * 0.0

    with torch.no_grad():
        stats_schedule(model, microbatches, on_stats=keep, forward_only=True, **schedule_kwargs)
    outs = []
    for i, mb in enumerate(microbatches):
        t = store[i] if i in store else torch.zeros(*mb.input_ids.shape, 4, device=device)
        outs.append(from_last_stage(t, pp_group))
    return outs
