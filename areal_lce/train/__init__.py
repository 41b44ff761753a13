"""Jobs layer: YAML job config, data and tokenizer, the SFT and RL jobs and their one run loop,
checkpoints, metrics, torchrun entry.

Run a job with ``torchrun --nproc_per_node=N -m areal_lce.train CONFIG.yaml [key=value ...]``
(or ``python -m areal_lce.train`` for the embedded tiny SFT default); see docs/training.md.
"""
