"""Shared test helpers (importable as `helpers.<module>`: tests/conftest.py's folder, tests/, is on sys.path
under pytest, and helpers.launch puts it on the PYTHONPATH of every rank it launches).

    paths           REPO and TESTS, the one definition of where the checkout and the tests are
    kernel_device   where the Triton kernels run in this session (compiled on CUDA, or the interpreter on
                    CPU): TRITON_INTERPRET set on import (conftest, first), kernel_device(), skip markers
    inputs          the op's case type (Case; PER_TOKEN, the one spelling of a per-token temperature), its
                    case list and input builders, with the one peaked-logits builder
    backends        the backend harness: shard-level cases (ShardCase, the same fields at shard level) and
                    the one pass rule for every backend
    bounds          the fp32 rounding bounds of order-only comparisons (softcap_bounds: with a soft-cap)
    groups          `fake_group`: a recording 2-rank TP group on one process
    launch          the torchrun launch of the multi-rank workers and jobs (result JSON, failure tails)
    gpt_builder     a user's own megatron-core GPTModel and megatron's own oracle (seam, integrations, engine)
    engines         tiny_config / tiny_engine: the one builder of the tests' engines
    megatron_worker the shared 2-rank engine/seam cases, launched once per pytest process (`results()`)
    adapter_oracles the framework adapters' oracles (verl's own function loaded by path, AReaL's semantics)
    spies           spies on the capture seam's heads (which options reach them)
    cpu             the CPU's feature flags (the numerics tests' second CPU path and OpenBLAS kernels)
    gpu_host        on a host with a GPU: the main session with CUDA hidden, the gpu tests in a child session

Tests live in folders that mirror the package (op/, backends/, megatron/, engine/, train/, integrations/,
hf/, benchmark/); a worker a folder's tests launch sits next to them, what several folders share sits here.
"""
