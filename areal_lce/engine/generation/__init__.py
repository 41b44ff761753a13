"""Generation with the engine's model: generate (rollouts), decode (KV cache, CUDA graphs), sampling."""
