"""The engine's GPT model: the builder (presets and HF import), attention, KV-cache attention, RoPE and
its Triton kernel."""
