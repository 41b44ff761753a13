"""Capture seam at Megatron's LM head: fused route == materialised route, refusals, memory.

TP=1 cases run in this process (single-rank gloo group); TP=2 cases (sequence parallel off/on, tied and
untied embeddings, both seams, 10 training steps) run in ONE torchrun launch of tests/helpers/megatron_worker.py,
shared with tests/engine/test_engine.py through `worker_results`.
"""
from __future__ import annotations

import os
import types
import warnings

import pytest
import torch

warnings.filterwarnings("ignore")

from helpers.paths import REPO
from helpers import megatron_worker as W  # noqa: E402
from helpers.engines import tiny_engine  # noqa: E402
from helpers.megatron_worker import results as worker_results  # noqa: E402

from areal_lce import LCEOptions  # noqa: E402
from areal_lce.megatron import capture  # noqa: E402
from areal_lce.engine.microbatch import MicroBatch  # noqa: E402
from areal_lce.engine.config import EngineConfig, ParallelConfig  # noqa: E402
from areal_lce.engine.engine import MegatronEngine  # noqa: E402

STATS_ATOL = 1e-5  # fp32, same weights: only summation order differs between the routes
GRAD_RTOL = 1e-5  # max |Δgrad| / max |grad| per parameter


def tp1_engine(fused: bool, *, tied: bool, seam: str = "auto", lr: float = 0.0, vocab: int = W.VOCAB,
               seq: int = 64) -> MegatronEngine:
    return tiny_engine(vocab, model=dict(tie_word_embeddings=tied, max_seq_len=seq),
                       optim=dict(lr=lr, clip_grad=0.0 if lr == 0 else 1.0), use_fused_linear_ce=fused,
                       capture_seam=seam)


# TP=1, in process: tie x seam. "output_layer" forces the megatron-core <= 0.17 seam on 0.19.
TP1_CASES = [
    pytest.param(False, "auto", id="untied-output_processor"),
    pytest.param(True, "auto", id="tied-output_processor"),
    pytest.param(False, "output_layer", id="untied-legacy_seam"),
    pytest.param(True, "output_layer", id="tied-legacy_seam"),
]


@pytest.mark.parametrize("tied,seam", TP1_CASES)
def test_fused_matches_materialised_tp1(tied, seam):
    ids, labels = W.batch(1)
    res = {}
    for fused in (True, False):
        e = tp1_engine(fused, tied=tied, seam=seam)
        st = e.token_stats(ids, labels, temperature=0.7)
        e.train_step([MicroBatch(ids, labels, 0.7)], W.pg_loss)
        res[fused] = (st, e.grads())
    (sa, ga), (sb, gb) = res[True], res[False]
    for name, x, y in zip(sa._fields, sa, sb):
        err = (x - y).abs().max().item()
        assert err <= STATS_ATOL, f"{name}: fused vs materialised max |Δ| = {err:.3e}"
    assert (sa.logprobs[labels == -100] == 0).all() and (sa.entropy[labels == -100] == 0).all()
    assert (sa.logprobs[labels != -100] < 0).all(), "logprobs must be negative (padding rows masked)"
    head = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    assert head in ga and ga[head].abs().max() > 0, "LM-head weight got no gradient in main_grad"
    assert set(ga) == set(gb)
    for n in gb:
        rel = ((ga[n] - gb[n]).abs().max() / gb[n].abs().max().clamp(min=1e-12)).item()
        assert rel <= GRAD_RTOL, f"grad of {n}: rel err {rel:.3e}"


def test_legacy_seam_restores_output_layer_forward():
    e = tp1_engine(True, tied=False, seam="output_layer")
    layer = e.gpt.output_layer
    calls = []
    handle = layer.register_forward_hook(lambda *a: calls.append(1))
    ids, labels = W.batch(2)
    e.token_stats(ids, labels)
    handle.remove()
    assert calls == [1], "module hooks must still fire on the replaced forward"
    assert "forward" not in vars(layer), "instance-level forward must be removed after the call"
    logits, _ = layer(torch.randn(4, 1, 64))  # class forward is back: real logits
    assert logits.shape == (4, 1, 512)
    # Sampling also goes through the seam (last-position logits only): same tokens as the 0.18+ seam.
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    legacy = e.generate(prompts, 4, temperature=0.0)
    assert "forward" not in vars(layer)
    assert legacy == tp1_engine(True, tied=False, seam="auto").generate(prompts, 4, temperature=0.0)


def test_training_losses_equal_tp1():
    losses = {}
    for fused in (True, False):
        e = tp1_engine(fused, tied=False, lr=3e-3)
        losses[fused] = [e.train_step([MicroBatch(i, l) for i, l in (W.batch(100 + s),)],
                                      W.pg_loss)["loss"] for s in range(10)]
    for step, (a, b) in enumerate(zip(losses[True], losses[False])):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: fused {a} vs materialised {b}"
    assert losses[True][-1] != losses[True][0], "parameters did not change"


def _saved_tensor_bytes(e: MegatronEngine, ids, labels):
    """(total bytes of activations autograd saved, largest saved tensor's shape) for one forward."""
    params = {p.data_ptr() for p in e.gpt.parameters()}
    seen, shapes = {}, []

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        st = e.token_stats(ids, labels, grad=True)
    st.logprobs.sum().backward()
    return sum(seen.values()), shapes


def test_fused_route_saves_no_logits():
    vocab, b, s = 8192, 2, 64  # logits [2, 64, 8192] fp32 = 4 MiB dwarf the tiny model's activations
    ids, labels = W.batch(5, b=b, s=s, vocab=vocab)
    fused_bytes, fused_shapes = _saved_tensor_bytes(tp1_engine(True, tied=False, vocab=vocab), ids, labels)
    mat_bytes, mat_shapes = _saved_tensor_bytes(tp1_engine(False, tied=False, vocab=vocab), ids, labels)
    has_logits = [sh for sh in mat_shapes if sh and sh[-1] == vocab and len(sh) >= 2]
    assert has_logits, "materialised route should save [.., vocab] logits (test premise)"
    leaked = [sh for sh in fused_shapes if sh and sh[-1] == vocab and len(sh) >= 2 and sh[0] != vocab]
    assert not leaked, f"fused route saved logits-shaped tensors: {leaked}"
    assert fused_bytes * 2 < mat_bytes, f"fused saved {fused_bytes} B vs materialised {mat_bytes} B"


# ---------------------------------------------------------------------------------------- refusals


def _fake_model(**cfg):
    base = dict(mtp_num_layers=None, context_parallel_size=1, defer_embedding_wgrad_compute=False,
                use_mup=False, mup_output_mult=1.0)
    base.update(cfg)
    layer = types.SimpleNamespace(gather_output=False)
    return types.SimpleNamespace(config=types.SimpleNamespace(**base), post_process=True, parallel_output=True,
                                 output_layer=layer)


@pytest.mark.parametrize("cfg,seam,match", [
    pytest.param(dict(mtp_num_layers=1), "output_layer", "mtp_num_layers", id="mtp-legacy-seam"),
    pytest.param(dict(defer_embedding_wgrad_compute=True), "output_processor", "defer_embedding", id="defer-wgrad"),
    pytest.param(dict(use_mup=True, mup_output_mult=0.5), "output_layer", "MuP", id="mup-legacy-seam"),
])
def test_refusals(cfg, seam, match):
    with pytest.raises(ValueError, match=match):
        capture.check_seam_config(_fake_model(**cfg).config, seam)
    capture.check_seam_config(_fake_model().config, seam)  # the same model without the feature passes


def test_mtp_and_parallel_output_false_pass_the_output_processor_checks():
    """MTP runs as Megatron runs it before the processor; parallel_output=False changes no statistic
    (the fused route never gathers logits): both are supported on the output_processor seam."""
    capture.check_seam_config(_fake_model(mtp_num_layers=1).config, "output_processor")
    m = _fake_model()
    m.parallel_output = False
    capture.check_seam_config(m.config, "output_processor")


def test_config_refusals():
    with pytest.raises(ValueError, match="context_parallel"):
        ParallelConfig(context_parallel=2, pipeline_parallel=2)
    with pytest.raises(ValueError, match="sequence_parallel"):
        ParallelConfig(sequence_parallel=True)
    with pytest.raises(ValueError, match="capture_seam"):
        EngineConfig(capture_seam="logits")
    with pytest.raises(ValueError, match="pipeline_parallel"):  # world size 1 cannot hold 2 stages
        MegatronEngine(EngineConfig(parallel=ParallelConfig(pipeline_parallel=2)))


def test_mup_folds_into_temperature():
    """A positive constant logit multiplier m: stats of (m·z)/T == stats of z/(T/m), raw stats scaled."""
    from areal_lce import logprobs_entropy_from_logits

    torch.manual_seed(0)
    h, w = torch.randn(6, 1, 16), torch.randn(40, 16)
    labels = torch.randint(0, 40, (1, 6))
    layer = types.SimpleNamespace(tp_group=None, sequence_parallel=False, weight=w,
                                  config=types.SimpleNamespace(use_mup=True))
    ctx = capture.CaptureContext(labels=labels, options=LCEOptions(temperature=0.8, vocab_size=40, backend="torch"))
    cfg = types.SimpleNamespace(use_mup=True)
    packed = capture.stats_output_processor(hidden_states=h, output_layer=layer, output_weight=None, context=ctx,
                                            scale_logits=lambda z: z * 0.25, config=cfg)
    ref = logprobs_entropy_from_logits((h[:, 0] @ w.t() * 0.25)[None], labels, temperature=0.8)
    for got, want in zip(capture.unpack(packed), ref[:4]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="scale_logits"):
        capture.stats_output_processor(hidden_states=h, output_layer=layer, output_weight=None, context=ctx,
                                       scale_logits=lambda z: z * z, config=cfg)


# ---------------------------------------------------------------------------------------- TP = 2

TP2_CASES = ["tp2-sp0-untied-auto", "tp2-sp0-tied-auto", "tp2-sp1-untied-auto", "tp2-sp1-tied-auto",
             "tp2-sp0-untied-legacy", "tp2-sp1-tied-legacy"]


@pytest.mark.parametrize("case", TP2_CASES)
@pytest.mark.distributed
def test_fused_matches_materialised_tp2(case):
    assert worker_results()["meta"]["auto_seam"] == capture.resolve_seam("auto")
    r = worker_results()[case]
    assert "error" not in r, r.get("error")
    for k in ("d_logprobs", "d_entropy", "d_max_logit", "d_min_logit"):
        assert r[k] <= STATS_ATOL, f"{case} {k} = {r[k]:.3e}"
    assert r["d_grad_rel"] <= GRAD_RTOL, f"{case}: grads rel err {r['d_grad_rel']:.3e}"
    assert r["head_grad_nonzero"] > 0
    assert r["sp_active"] == float("-sp1-" in case), "sequence parallelism not in the expected state"


@pytest.mark.distributed
def test_fused_matches_materialised_tp2_bf16():
    r = worker_results()["tp2-sp1-tied-bf16"]
    assert "error" not in r, r.get("error")
    for k in ("d_logprobs", "d_entropy", "d_max_logit", "d_min_logit"):
        assert r[k] <= 1e-2, f"bf16 {k} = {r[k]:.3e}"
    assert r["d_grad_rel"] <= 5e-2 and r["sp_active"] == 1.0 and r["head_grad_nonzero"] > 0, r


@pytest.mark.distributed
def test_training_losses_equal_tp2():
    r = worker_results()["tp2-train-sp1"]
    assert "error" not in r, r.get("error")
    assert r["max_rel_loss"] <= 1e-4, r


@pytest.mark.distributed
def test_packed_matches_padded_tp2_sp():
    r = worker_results()["tp2-pack-sp1"]
    assert "error" not in r, r.get("error")
    assert r["max_rel_loss_fused1"] <= 1e-5 and r["max_rel_loss_fused0"] <= 1e-5, r


@pytest.mark.distributed
def test_context_parallel_two_ranks_matches_cp1():
    r = worker_results()["cp2"]
    assert "error" not in r, r.get("error")
    for k, v in r.items():
        limit = 1e-5 if k.startswith("max_rel_loss") else 2e-5 if k.startswith("d_stats") else 0.0
        assert v <= limit, f"{k} = {v:.3e}"


@pytest.mark.distributed
def test_data_parallel_two_ranks():
    r = worker_results()["dp2"]
    assert "error" not in r, r.get("error")
    assert r["dp_grad_mismatch"] == 0.0 and r["dp_param_mismatch"] == 0.0, r
    assert r["route_grad_rel"] <= GRAD_RTOL and r["route_loss_rel"] <= 1e-6, r


# megatron-core 0.16.1 (no output_processor seam) installed aside by .ci/setup.sh, or named by the env var
_SETUP_LEGACY = str(REPO / ".venv" / "megatron-legacy")
LEGACY_DIR = os.environ.get("AREAL_LCE_MEGATRON_LEGACY", "") or (_SETUP_LEGACY if os.path.isdir(_SETUP_LEGACY) else "")


@pytest.mark.skipif(not LEGACY_DIR, reason="needs megatron-core 0.16.1 aside: run .ci/setup.sh, or set AREAL_LCE_MEGATRON_LEGACY to a "
                    "`pip install --no-deps --target DIR megatron-core==0.16.1` directory")
@pytest.mark.distributed
def test_worker_cases_on_legacy_megatron(tmp_path):
    """Every 2-rank case on megatron-core 0.16/0.17, where `auto` must pick the output_layer seam."""
    hf_dir = str(tmp_path / "hf")
    W.make_hf_checkpoint(hf_dir)
    r = W.launch(str(tmp_path), hf_dir, pythonpath=LEGACY_DIR)
    assert tuple(r["meta"]["megatron_version"][:2]) < (0, 18) and r["meta"]["auto_seam"] == "output_layer", r["meta"]
    for case, v in r.items():
        assert "error" not in v, f"{case}: {v.get('error')}"
    for case in TP2_CASES:
        assert r[case]["d_logprobs"] <= STATS_ATOL and r[case]["d_grad_rel"] <= GRAD_RTOL, (case, r[case])
    assert r["tp2-train-sp1"]["max_rel_loss"] <= 1e-4 and r["pp2"]["rel_loss_pp2_vs_pp1"] <= 1e-5


def test_float16module_bf16_routes_agree():
    """bf16 weights under Float16Module (the GPU configuration, here on CPU): the fused route sees bf16
    hidden states and weight, the materialised route bf16 logits; they agree to bf16 rounding."""
    ids, labels = W.batch(1)
    res = {}
    for fused in (True, False):
        e = tiny_engine(W.VOCAB, model=dict(dtype="bf16"), optim=dict(lr=0.0, clip_grad=0.0), use_fused_linear_ce=fused)
        assert type(e.model.module).__name__ == "Float16Module"
        st = e.token_stats(ids, labels)
        e.train_step([MicroBatch(ids, labels)], W.pg_loss)
        res[fused] = (st, e.grads())
    (sa, ga), (sb, gb) = res[True], res[False]
    assert sa.logprobs.dtype == torch.float32
    for name, x, y in zip(sa._fields, sa, sb):
        err = (x - y).abs().max().item()
        assert err <= 1e-2, f"{name}: bf16 routes differ by {err:.3e}"
    for n in gb:
        rel = ((ga[n].float() - gb[n].float()).abs().max() / gb[n].float().abs().max()).item()
        assert rel <= 5e-2, f"grad of {n}: rel err {rel:.3e} (a missing or doubled reduction gives ~1)"
