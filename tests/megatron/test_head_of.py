"""megatron/head.py's head_of: the one reading of an output layer's tensor parallelism (as a VocabParallel)
and logit scale, which the capture seam and the AReaL adapter share. Fake layers, one process: fast."""
from __future__ import annotations

import types

import pytest
import torch

from areal_lce import LCEOptions
from areal_lce.op import comms
from areal_lce.megatron import head
from areal_lce.megatron.head import head_of


ONE_RANK = types.SimpleNamespace(size=lambda: 1)  # the layer's own tp_group (parallel_state is not asked)


def _layer(**kw):
    base = dict(tp_group=ONE_RANK, sequence_parallel=False, config=types.SimpleNamespace(use_mup=False))
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_without_tensor_parallelism():
    vp, scale, sp = head_of(_layer())
    assert (vp.group, vp.d_hidden, scale, sp) == (None, "caller", 1.0, False)
    assert head_of(_layer(), mappings=False).vocab_parallel.d_hidden == "caller"  # TP=1: no allreduce_dgrad


# seam: megatron's mappings (head_input) gather and reduce, the op leaves d_hidden to them; adapter: the op
# gathers a sequence shard, or all-reduces d_hidden where the layer would (allreduce_dgrad, on by default)
@pytest.mark.parametrize("sp,allreduce_dgrad,mappings,want", [
    pytest.param(False, None, True, ("caller", False), id="seam"),
    pytest.param(True, None, True, ("caller", True), id="seam-sp"),
    pytest.param(True, None, False, ("reduce_scatter", True), id="adapter-sp"),
    pytest.param(False, None, False, ("all_reduce", False), id="adapter"),
    pytest.param(False, False, False, ("caller", False), id="adapter-no-dgrad"),
])
def test_tensor_parallel_layers(monkeypatch, sp, allreduce_dgrad, mappings, want):
    group = object()  # a 2-rank group, as tp_of and VocabParallel see it
    monkeypatch.setattr(head, "tp_of", lambda layer: (layer.tp_group, 2))
    monkeypatch.setattr(comms, "checked_group_size", lambda g, what: 2)
    extra = {} if allreduce_dgrad is None else {"allreduce_dgrad": allreduce_dgrad}
    vp, scale, got_sp = head_of(_layer(tp_group=group, sequence_parallel=sp, **extra), mappings=mappings)
    assert vp.group is group and (vp.d_hidden, got_sp) == want and scale == 1.0


def test_logit_scale_from_mup_or_the_framework():
    mup = _layer(config=types.SimpleNamespace(use_mup=True))
    assert head_of(mup, scale_logits=lambda z: z * 0.25).logit_scale == 0.25
    assert head_of(mup).logit_scale == 1.0  # no scale_logits: GPTModel scales nothing
    with pytest.raises(ValueError, match="scale_logits is not a positive constant"):
        head_of(mup, scale_logits=lambda z: z * z)
    assert head_of(_layer(), logit_scale=2).logit_scale == 2.0
    for bad, exc in ((0.0, ValueError), (float("inf"), ValueError), (True, TypeError), ("2", TypeError)):
        with pytest.raises(exc, match="my_adapter: logit_scale must be"):
            head_of(_layer(), logit_scale=bad, caller="my_adapter")


def test_the_seam_and_the_areal_adapter_read_the_layer_through_head_of(monkeypatch):
    from areal_lce.integrations import areal
    from areal_lce.megatron import capture

    seen = []

    def spy(layer, *args, **kwargs):
        seen.append(kwargs.get("mappings", True))
        return head_of(layer, *args, **kwargs)

    monkeypatch.setattr(capture, "head_of", spy)
    monkeypatch.setattr(areal, "head_of", spy)
    monkeypatch.setattr(areal, "_check_layer", lambda layer: None)
    torch.manual_seed(0)
    h, w = torch.randn(4, 1, 8), torch.randn(16, 8)
    labels = torch.randint(0, 16, (1, 4))
    layer = _layer(weight=w, config=types.SimpleNamespace(use_mup=True))
    ctx = capture.CaptureContext(labels=labels, options=LCEOptions(vocab_size=16, backend="torch"))
    seam = capture.stats_output_processor(hidden_states=h, output_layer=layer, output_weight=None, context=ctx,
                                          scale_logits=lambda z: z * 0.5, config=layer.config)
    out = areal.chunked_lm_head_logprobs_entropy(layer, h, w, labels.reshape(-1), temperature=1.0, chunk_size=4,
                                                 logit_scale=0.5, backend="torch")
    assert seen == [True, False]  # the seam keeps megatron's mappings; the adapter has the op reduce
    torch.testing.assert_close(seam[0, :, 0], out.logprobs, rtol=1e-6, atol=1e-6)  # the same logits m·h·Wᵀ
