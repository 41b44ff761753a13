"""megatron-core's own fused linear cross entropy (cross_entropy_fusion_impl="linear", development branch,
Blackwell only) makes GPTModel's output layer a `LinearCrossEntropyModule`. No installed release has it:
the test swaps a user-built GPTModel's output layer to a class of that name and forward signature (a
ColumnParallelLinear whose forward also takes the labels) and sets the two config fields."""
from __future__ import annotations


import pytest
import torch

from helpers import gpt_builder as G  # noqa: E402
from helpers.gpt_builder import megatron_on_cpu  # noqa: E402,F401  (autouse: megatron-core on a CPU-only host)

from areal_lce.megatron import token_stats  # noqa: E402


def _linear_ce_class():
    from megatron.core import tensor_parallel

    class LinearCrossEntropyModule(tensor_parallel.ColumnParallelLinear):
        """The development branch's forward: the plain logits unless asked for the fused loss."""

        loss_calls = 0

        def forward(self, input_, weight=None, runtime_gather_output=None, output_cross_entropy_loss=False,
                    labels=None, reduction="none", ignore_index=-100):
            if output_cross_entropy_loss:
                type(self).loss_calls += 1
                raise RuntimeError("megatron's fused linear CE kernel runs on Blackwell only")
            return super().forward(input_, weight, runtime_gather_output)

    return LinearCrossEntropyModule


def test_the_seam_runs_in_place_of_megatrons_fused_linear_ce_and_names_the_seam_it_breaks():
    model = G.build_gpt(tp=1)
    ids, labels, _ = G.batch(3)
    kw = dict(vocab_size=G.VOCAB, backend="torch", seam="output_processor")
    with torch.no_grad():
        before = {fused: token_stats(model, ids, labels, fused=fused, **kw) for fused in (True, False)}
    cls = _linear_ce_class()
    model.output_layer.__class__ = cls
    model.config.cross_entropy_loss_fusion = True
    model.config.cross_entropy_fusion_impl = "linear"
    with torch.no_grad():
        for fused in (True, False):  # the materialised route calls the layer's plain forward
            after = token_stats(model, ids, labels, fused=fused, **kw)
            for got, want in zip(after, before[fused]):
                assert torch.equal(got, want), fused
    assert cls.loss_calls == 0
    for fused in (True, False):
        with pytest.raises(ValueError, match=r"cross_entropy_fusion_impl='linear'.*LinearCrossEntropyModule.*"
                                             r"capture_seam='output_layer'"):
            token_stats(model, ids, labels, fused=fused, vocab_size=G.VOCAB, backend="torch", seam="output_layer")
