"""Drop-in adapters that put the fused op behind other frameworks' own LM-head functions.

    areal_lce.integrations.verl    `linear_cross_entropy` with verl's contract, `apply()` patches verl's
                                   Megatron fused forward
    areal_lce.integrations.areal   `chunked_lm_head_logprobs_entropy` with AReaL's contract, `apply()`
                                   patches AReaL's Megatron engine

Each module imports nothing of its framework at import time (only `apply()` does), so both import on a
machine that has neither. See docs/integrations.md.
"""
