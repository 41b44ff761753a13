"""areal_lce's Megatron training engine, built on the plugin seam (areal_lce.megatron): what the jobs of
areal_lce.train run.

    from areal_lce.engine import MegatronEngine, EngineConfig, MicroBatch

Modules (import floors, lowest first): config (EngineConfig and its sections), parallel (process groups and
rank info), microbatch, batch (a micro-batch in the model's layout: padding, THD, CP), per_token (per-token
tensors into and out of that layout), schedule (megatron's pipeline schedule), optim, sharded / state
(checkpoints through dist_checkpointing), graphs (CUDA graphs of the model call), own_loss
(megatron-core's own loss: the flag-off SFT route), engine (MegatronEngine); the subpackages model/ (the GPT
builder with HF import, attention, KV attention, RoPE and its Triton kernel) and generation/ (generate,
decode with the KV cache, sampling).
"""
from .config import EngineConfig, LCEConfig, ModelConfig, OptimConfig, ParallelConfig
from .microbatch import MicroBatch

__all__ = ["MegatronEngine", "EngineConfig", "LCEConfig", "ModelConfig", "OptimConfig", "ParallelConfig",
           "MicroBatch"]


def __getattr__(name: str):
    if name == "MegatronEngine":  # imported on first use: the engine module pulls in much more
        from .engine import MegatronEngine
        return MegatronEngine
    raise AttributeError(f"module 'areal_lce.engine' has no attribute {name!r}")
