"""The plugin seam for a user's own megatron-core model: per-token logprobs, entropy and logit extremes from
the fused LM head, with the packing and context-parallel helpers a training loop needs.

    from areal_lce.megatron import token_stats, TokenStats, Route, packed_next_token_labels
    from areal_lce.megatron import split_for_context_parallel, gather_from_context_parallel

Modules (import floors, lowest first): compat (megatron-core version seams), packing (THD rows and labels),
context_parallel (zigzag split / gather), head (the output layer's weight, TP group and logit precision),
capture (the seam: output_processor / output_layer), route (fused or materialised, one model call), stats
(token_stats). areal_lce's own training engine (model builder, micro-batches, schedule, CUDA graphs,
generation) lives in areal_lce.engine, above this package.

Importing this package does not import megatron-core; the functions do, when called.
"""
from .context_parallel import (CPGroup, gather_from_context_parallel, pad_for_context_parallel, pad_packed,
                               split_for_context_parallel)
from .packing import PackedLayout, PackedRows, pack_rows, packed_next_token_labels
from .route import Route
from .stats import SelectedTokenStats, TokenStats, find_gpt_model, token_stats

__all__ = ["token_stats", "TokenStats", "SelectedTokenStats", "find_gpt_model", "packed_next_token_labels",
           "pack_rows", "PackedRows", "PackedLayout", "split_for_context_parallel", "gather_from_context_parallel",
           "pad_for_context_parallel", "pad_packed", "CPGroup", "Route"]
