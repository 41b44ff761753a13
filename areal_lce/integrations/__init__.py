"""Drop-in adapters that put the fused op behind other frameworks' own LM-head functions.

    areal_lce.integrations.verl    `linear_cross_entropy` with verl's contract, `apply()` patches verl's
                                   Megatron fused forward
    areal_lce.integrations.areal   `chunked_lm_head_logprobs_entropy` with AReaL's contract, `apply()`
                                   patches AReaL's Megatron engine
    areal_lce.integrations.nemo_rl `from_parallel_hidden_states_to_logprobs` with NeMo-RL's contract,
                                   `apply()` patches NeMo-RL's fused linear-logprobs forward
    areal_lce.integrations.nemo_rl_packed  NeMo-RL's packed / context-parallel log-prob function on
                                   hidden states (the second seam: cu_seqlens and the CP layout)
    areal_lce.integrations.slime   `calculate_log_probs_and_entropy` of slime, from hidden states and the
                                   LM-head weight shard instead of logits; its log-prob step, `apply()`
    areal_lce.integrations.miles   the same for miles (its own step and kernel, true-on-policy mode)

Each module imports nothing of its framework at import time (only `apply()` does), so each imports on a
machine that has none of them. See docs/integrations.md.
"""
