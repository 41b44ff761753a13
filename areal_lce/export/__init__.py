"""Hugging Face export of the engine's model (docs/export.md).

    from areal_lce.export import export_hf
    export_hf(engine, "out/hf", tokenizer=tok)          # live engine, any parallel layout (collective)
    python -m areal_lce.export RUN_DIR/checkpoints/step_N OUT_DIR    # a train job's checkpoint

`weights.py` gathers the parameters into Hugging Face tensors, `hf.py` writes the directory, `__main__.py`
is the command line (it builds the run's engine from the config saved with the checkpoint).
"""
from .hf import export_hf

__all__ = ["export_hf"]
