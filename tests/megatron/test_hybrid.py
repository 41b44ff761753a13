"""token_stats, the capture seam and the Route on megatron-core's HybridModel (tests/megatron/hybrid_builder.py).

HybridModel.forward has no output_processor argument: the instance-level output_layer seam serves it
("auto" picks it). Oracle: the materialised log_softmax of the model's own logits, every output and
gradient within the fp32 bound of tests/helpers/bounds.py (hybrid_builder's docstring says how). TP=1
runs in this process; TP=2 with and without sequence parallelism, BSHD and THD, in one torchrun launch
of tests/megatron/hybrid_worker.py. What the seam cannot serve on a HybridModel is refused with the reason; the
engine's builder hides megatron-core's GPTModel deprecation notice and nothing else.
"""
from __future__ import annotations

import functools
import logging
import os
import tempfile
import types
import warnings

import pytest
import torch

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))

from helpers import gpt_builder as G  # noqa: E402
import hybrid_builder as HB  # noqa: E402
from helpers.gpt_builder import megatron_on_cpu  # noqa: E402,F401  (autouse: megatron-core on a CPU-only host)
from helpers.launch import torchrun  # noqa: E402

from areal_lce import LCEOptions  # noqa: E402
import areal_lce.megatron as M  # noqa: E402
from areal_lce.megatron import capture, pack_rows, token_stats  # noqa: E402
from areal_lce.megatron.route import Route  # noqa: E402

pytest.importorskip("megatron.core.models.hybrid.hybrid_model", reason="HybridModel: megatron-core >= 0.19")


@pytest.fixture(scope="module")
def models():
    from areal_lce.megatron.compat import cpu_shims

    with cpu_shims():
        return {tied: HB.build_hybrid(tied=tied) for tied in (False, True)}


# why each case: untied and tied heads (the tied weight also takes the embedding's gradient), packed THD
@pytest.mark.parametrize("case", ["bshd-untied", "bshd-tied", "thd-untied"])
def test_tp1_matches_the_materialised_log_softmax(models, case):
    layout, tied = case.split("-")
    model = models[tied == "tied"]
    ids, labels, _ = G.batch(0)
    if layout == "bshd":
        t = torch.rand(labels.shape[0], 1, generator=torch.Generator().manual_seed(1)) + 0.5  # per sequence
        result = HB.check_routes(model, ids, labels, t)
    else:
        rows = pack_rows(ids, labels)
        t = torch.rand(1, rows.input_ids.shape[1], generator=torch.Generator().manual_seed(2)) + 0.5  # per token
        result = HB.check_routes(model, rows.input_ids, rows.labels, t, position_ids=rows.position_ids,
                                 packed_seq_params=rows.packed_seq_params())
    HB.assert_passes(case, result)


def test_the_check_has_teeth(models, monkeypatch):
    """token_stats at a temperature 1e-4 off the reference's: outputs and gradients leave the fp32 bound."""
    real = token_stats

    def off(*args, temperature, **kwargs):
        return real(*args, temperature=temperature * (1 + 1e-4), **kwargs)

    monkeypatch.setattr(M, "token_stats", off)
    ids, labels, _ = G.batch(0)
    result = HB.check_routes(models[False], ids, labels, 0.7)
    for tag in ("fused", "mat"):
        assert result[f"{tag}_logprobs"] > 1 and result[f"{tag}_d_head_input"] > 1, result


def test_auto_takes_the_output_layer_seam(models):
    """No output_processor in HybridModel.forward: 'auto' and 'output_layer' give the same values; a direct
    seam call with output_processor is refused by name, not met with a TypeError from forward."""
    model = models[False]
    ids, labels, _ = G.batch(0)
    auto = token_stats(model, ids, labels, vocab_size=G.VOCAB, backend="torch")
    explicit = token_stats(model, ids, labels, vocab_size=G.VOCAB, backend="torch", seam="output_layer")
    assert torch.equal(auto.logprobs, explicit.logprobs) and torch.equal(auto.entropy, explicit.entropy)
    assert Route.choose(seam="auto").seam_for(model) == "output_layer"
    ctx = capture.CaptureContext(labels=labels, options=LCEOptions(vocab_size=G.VOCAB))
    with pytest.raises(ValueError, match=r"HybridModel\.forward has no output_processor"):
        capture.run_fused(model, model, "output_processor", ctx, ids, None, None)


def test_wrapped_model_is_found(models):
    model = models[False]
    wrapped = types.SimpleNamespace(module=types.SimpleNamespace(module=model))
    assert M.find_gpt_model(wrapped) is model
    with pytest.raises(TypeError, match="GPTModel or HybridModel"):
        M.find_gpt_model(torch.nn.Linear(2, 2))


def test_refusals_give_the_reason(models, monkeypatch):
    model = models[False]
    ids, labels, _ = G.batch(0)
    if capture.resolve_seam("auto") == "output_processor":  # a megatron-core whose GPTModel has the seam
        with pytest.raises(ValueError, match=r"capture_seam='output_processor' with a HybridModel.*'auto'"):
            token_stats(model, ids, labels, vocab_size=G.VOCAB, seam="output_processor")
    monkeypatch.setattr(model, "mtp_num_depths", 1)  # as a hybrid_layer_pattern "...//..." builds it
    for fused in (True, False):
        with pytest.raises(ValueError, match=r"MTP depth.*calls the output layer"):
            token_stats(model, ids, labels, vocab_size=G.VOCAB, fused=fused)
    monkeypatch.setattr(model, "mtp_num_depths", 0)
    monkeypatch.setattr(model.config, "use_mup", True)
    monkeypatch.setattr(model.config, "mup_output_mult", 0.5)
    with pytest.raises(ValueError, match=r"MuP output scaling.*capture_seam='output_layer'"):
        token_stats(model, ids, labels, vocab_size=G.VOCAB)
    monkeypatch.undo()
    positions = torch.tensor([3, 4, 5])
    with pytest.raises(ValueError, match=r"inference_context with a HybridModel.*GPTModel only"):
        Route.choose().last_token_logits(model, model, positions, ids, None, None, inference_context=object())


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "materialised"])
def test_last_token_logits_without_kv_cache(models, fused):
    """Generation's full-forward step (no KV cache) on a HybridModel: the logits of one position per row,
    within the order-only fp32 bound 2·γ_(H)·Σ_k |h_k w_jk| of the model's own logits there."""
    from helpers.bounds import gamma

    model = models[False]
    ids, _, _ = G.batch(0)
    positions = torch.tensor([15, 10, 6])
    hook = HB._HeadInput(model)
    try:
        with torch.no_grad():
            got = Route.choose(fused=fused).last_token_logits(model, model, positions, ids, None, None)
            want = model(ids, None, None)[torch.arange(3), positions]
            h = hook.value[positions, torch.arange(3)].double()
    finally:
        hook.handle.remove()
    v = want.shape[-1]
    bound = 2 * gamma(G.H) * (h.abs() @ HB.head_weight(model).double().abs().t())
    assert got.shape == (3, v + G.H)
    assert ((got[:, :v].double() - want.double()).abs() <= bound).all()


def test_engine_builder_hides_only_the_gpt_deprecation(caplog):
    """megatron-core 0.19 logs "GPTModel IS DEPRECATED" at every GPTModel construction; the engine's builder
    drops that record (its GPTModel is deliberate: docs/megatron.md), a user's own GPTModel still logs it."""
    from megatron.core.models.gpt import gpt_model

    from areal_lce.engine.model import builder as builder
    from areal_lce.megatron.compat import quiet_gpt_deprecation
    from areal_lce.engine.config import ModelConfig, ParallelConfig

    notice = "GPTModel IS DEPRECATED"
    with caplog.at_level(logging.WARNING, logger=gpt_model.logger.name):
        G.init(1)
        cfg = ModelConfig(preset="tiny")
        builder.build_gpt_model(builder.resolve_arch(cfg), cfg, ParallelConfig(), torch.float32)
        assert not [r for r in caplog.records if notice in r.getMessage()]
        with quiet_gpt_deprecation():
            gpt_model.logger.warning("another notice of that module")
        assert [r.getMessage() for r in caplog.records] == ["another notice of that module"]
        G.build_gpt()  # a user's own GPTModel, outside the builder
        assert [r for r in caplog.records if notice in r.getMessage()], "a user's GPTModel keeps the notice"


# --------------------------------------------------------------------------------------------- TP = 2

@functools.lru_cache(maxsize=None)
def worker_results() -> dict:
    out = os.path.join(tempfile.mkdtemp(prefix="areal_lce_hybrid_"), "out.json")
    return torchrun(os.path.join(HERE, "hybrid_worker.py"), out, timeout=400, result=out)


def _worker_cases():
    import hybrid_worker as W

    return list(W.CASES)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", _worker_cases())
def test_tp2_matches_the_materialised_log_softmax(case):
    result = worker_results()[case]
    assert "error" not in result, result.get("error")
    HB.assert_passes(case, result)
