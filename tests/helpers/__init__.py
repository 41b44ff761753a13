"""Shared test helpers (importable as `helpers.<module>`: pytest puts tests/ on sys.path).

    inputs    the op's case list and input builders, with the one peaked-logits builder
    backends  the backend harness: shard-level cases and the one pass rule for every backend
    launch    the torchrun launch of the multi-rank workers and jobs (result JSON, failure tails)
"""
