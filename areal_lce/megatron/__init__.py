"""Megatron-core integration: the public token_stats call, capture seam, packing, model building, engine.

    from areal_lce.megatron import token_stats, TokenStats, Route, packed_next_token_labels
    from areal_lce.megatron import split_for_context_parallel, gather_from_context_parallel

Importing this package does not import megatron-core; the functions do, when called.
"""
from .config import EngineConfig, LCEConfig, ModelConfig, OptimConfig, ParallelConfig
from .context_parallel import (ContextParallelPadding, gather_from_context_parallel, pad_for_context_parallel,
                               pad_packed, split_for_context_parallel)
from .microbatch import MicroBatch
from .packing import PackedRows, pack_rows, packed_next_token_labels
from .route import Route
from .stats import SelectedTokenStats, TokenStats, find_gpt_model, token_stats

__all__ = ["token_stats", "TokenStats", "SelectedTokenStats", "find_gpt_model", "packed_next_token_labels", "pack_rows", "PackedRows",
           "split_for_context_parallel", "gather_from_context_parallel", "pad_for_context_parallel", "pad_packed",
           "ContextParallelPadding", "MicroBatch", "Route", "EngineConfig", "LCEConfig", "ModelConfig", "OptimConfig",
           "ParallelConfig"]
