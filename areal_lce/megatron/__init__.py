"""Megatron-core integration: capture seam at the LM head, model building, distributed init, engine.

Importing this package does not import megatron-core; the submodules do, when used.
"""
from .config import EngineConfig, ModelConfig, OptimConfig, ParallelConfig

__all__ = ["EngineConfig", "ModelConfig", "OptimConfig", "ParallelConfig"]
