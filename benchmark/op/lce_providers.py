"""The implementations `bench_lce` times: each is fn(h, W, y) -> (logprobs, entropy or None).

    areal_triton           areal_lce.linear_logprobs_entropy(..., backend="triton", cache_bytes=0) with
                           its default options (deferred label checks, ignored rows skipped inside the
                           kernels: no host sync)
    areal_triton_cache     the same with cache_bytes >= the fp32 logits 4·N·V: the backward reads them
    areal_triton_nochecks  areal_triton with check_labels=False, compact_ignored=False
    areal_torch            the chunked torch backend through the same API
    torch_eager            bf16 logits materialised, log_softmax in fp32
    torch_compile          the same under torch.compile
    liger, cce, verl       the peers' public entry points, loaded by the shared peer loader
                           (--peers-script, default /work/shared/peers/bench_peers.py): this repo imports
                           their packages and copies none of their code. Liger and CCE give no entropy.

A provider that cannot load is a string saying why; the benchmark records it and goes on.
"""
from __future__ import annotations

import os
import sys

import torch

PROVIDERS = ["areal_triton", "areal_triton_cache", "areal_triton_nochecks", "areal_torch", "torch_eager",
             "torch_compile", "liger", "cce", "verl"]
ENT_PROVIDERS = {"areal_triton", "areal_triton_cache", "areal_triton_nochecks", "areal_torch", "torch_eager",
                 "torch_compile", "verl"}  # the timed loss is -sum(logp) - sum(entropy); others -sum(logp)
PEERS = {"liger": "liger_none", "cce": "cce", "verl": "verl"}  # name -> key in the peer loader's THIRD


def areal(backend: str, cache: bool, checks: bool = True):
    """The public op on one backend; cache: a cache budget that holds the fp32 logits of any call."""
    from areal_lce import linear_logprobs_entropy

    off = {} if checks else {"check_labels": False, "compact_ignored": False}

    def fn(h, W, y):
        cb = 4 * h.shape[0] * W.shape[0] + 1 if cache else 0
        o = linear_logprobs_entropy(h, W, y, backend=backend, cache_bytes=cb, **off)
        return o.logprobs, o.entropy
    return fn


def torch_lp_ent(h, W, y):
    """Materialised: bf16 logits, log_softmax in fp32, entropy from the log-probabilities."""
    z = (h @ W.t()).float()
    lpa = torch.log_softmax(z, dim=-1)
    lp = lpa.gather(1, y[:, None]).squeeze(1)
    ent = -(lpa.exp() * lpa).sum(-1)
    return lp, ent


_compiled = None


def torch_compile(h, W, y):
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(torch_lp_ent, dynamic=False)
    return _compiled(h, W, y)


OURS = {
    "areal_triton": lambda: areal("triton", False),
    "areal_triton_cache": lambda: areal("triton", True),
    "areal_triton_nochecks": lambda: areal("triton", False, checks=False),
    "areal_torch": lambda: areal("torch", False),
    "torch_eager": lambda: torch_lp_ent,
    "torch_compile": lambda: torch_compile,
}


def load_peers(names, peers_script) -> tuple:
    """({name: fn or 'unavailable: why'}, {package: version}) for the peers among `names`."""
    out, versions = {}, {}
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(peers_script)))
        import bench_peers  # the shared peer loader: imports the peers' packages, no code copied

        bench_peers.load_third_party()
        versions.update(bench_peers.VERSIONS)
        for n in names:
            f = bench_peers.THIRD.get(PEERS[n])
            if callable(f):
                out[n] = (lambda f: lambda h, W, y: f(h, W, y, 1.0)[:2])(f)
            else:
                out[n] = f"unavailable: {f}"
    except Exception as e:  # noqa: BLE001
        for n in names:
            out[n] = f"unavailable: {type(e).__name__}: {e}"
    return out, versions


def load_providers(names, peers_script) -> tuple:
    """({name: fn or 'unavailable: why'} in the order of `names`, peer versions); unknown names raise."""
    unknown = [n for n in names if n not in OURS and n not in PEERS]
    if unknown:
        raise ValueError(f"--providers: unknown {unknown}; choose from {PROVIDERS} or 'all'")
    out = {n: OURS[n]() for n in names if n in OURS}
    peers, versions = load_peers([n for n in names if n in PEERS], peers_script) if any(
        n in PEERS for n in names) else ({}, {})
    out.update(peers)
    return out, versions
