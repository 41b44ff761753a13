"""The public token_stats call on a user-built GPTModel (tests/helpers/gpt_builder.py), not the engine.

Oracle: megatron-core's own vocab_parallel_cross_entropy on the model's materialised logits (padding
columns masked) for logprobs; an fp64 softmax of the gathered logits for entropy and logit extremes.
Both routes (fused, fused=False) must match it in every per-token value and every parameter's
gradient. TP=1 runs in this process; TP=2 (SP on/off, tied, BSHD/THD, parallel_output=False, the
documented example) runs in one torchrun launch of tests/megatron/token_stats_worker.py.
"""
from __future__ import annotations

import functools
import os
import tempfile
import types
import warnings

import pytest
import torch

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))

from helpers.spies import count_temperature_checks, spy_heads
from helpers import gpt_builder as G  # noqa: E402
from helpers.gpt_builder import megatron_on_cpu  # noqa: E402,F401  (autouse: megatron-core on a CPU-only host)
from helpers.launch import torchrun  # noqa: E402

from areal_lce import LCEOptions  # noqa: E402
from areal_lce.megatron import capture, pack_rows, packed_next_token_labels, token_stats  # noqa: E402
from areal_lce.megatron.stats import find_gpt_model  # noqa: E402

ATOL = 2e-5  # fp32: the routes differ from the oracle only in summation order
GRAD_RTOL = 2e-5


def _check(model, ids, labels, temperature, **kw):
    errors, stats = G.compare_routes(model, ids, labels, temperature, **kw)
    for name, err in errors.items():
        limit = GRAD_RTOL if name.endswith("grad_rel") else ATOL
        assert err <= limit, f"{name}: {err:.2e} against megatron's oracle"
    assert all(st.logprobs.dtype == torch.float32 and st.logprobs.shape == labels.shape for st in stats.values())
    valid = labels != -100
    assert (stats[True].logprobs[valid] < 0).all() and (stats[True].logprobs[~valid] == 0).all()
    return stats[True]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("temp", ["scalar", "per_token"])
def test_bshd_matches_megatron_oracle(tied, temp):
    model = G.build_gpt(tied=tied)
    ids, labels, _ = G.batch(0)
    t = 0.7 if temp == "scalar" else torch.rand(labels.shape, generator=torch.Generator().manual_seed(1)) + 0.5
    _check(model, ids, labels, t)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_thd_matches_oracle_and_bshd(tied):
    """Packed sequences: values and gradients match the oracle on the packed row, and every token's
    values equal the BSHD values of the same sequence."""
    model = G.build_gpt(tied=tied)
    ids, labels, _ = G.batch(0)
    t = torch.rand(labels.shape[0], 1, generator=torch.Generator().manual_seed(2)) + 0.5  # per sequence
    bshd = token_stats(model, ids, labels, vocab_size=G.VOCAB, temperature=t, backend="torch")
    rows = pack_rows(ids, labels)
    t_packed = torch.broadcast_to(t, labels.shape).reshape(-1)[rows.index][None]
    thd = _check(model, rows.input_ids, rows.labels, t_packed, position_ids=rows.position_ids,
                 packed_seq_params=rows.packed_seq_params())
    back = rows.unpack(thd.pack())
    # the packed layout as one value is taken in place of megatron's PackedSeqParams: the same call
    same = token_stats(model, rows.input_ids, rows.labels, vocab_size=G.VOCAB, temperature=t_packed,
                       position_ids=rows.position_ids, packed_seq_params=rows.layout, backend="torch")
    assert torch.equal(same.pack().detach(), thd.pack().detach())
    for i, name in enumerate(bshd._fields):
        err = (back[..., i] - getattr(bshd, name).detach()).abs().max().item()
        assert err <= ATOL, f"THD vs BSHD {name}: {err:.2e}"


def test_mtp_fused_matches_materialised():
    """MTP (megatron-core >= 0.18): the main head fused, the MTP heads as Megatron computes them; both
    routes give the same values and the same gradient in every parameter, the MTP layers' included."""
    model = G.build_gpt(mtp_layers=1)
    ids, labels, _ = G.batch(3)
    res = {}
    for fused in (True, False):
        st = token_stats(model, ids, labels, vocab_size=G.VOCAB, temperature=0.8, fused=fused, backend="torch")
        res[fused] = (st, G.grads(model, G.weighted_loss(st.logprobs, st.entropy, labels)))
    (sa, ga), (sb, gb) = res[True], res[False]
    for name, x, y in zip(sa._fields, sa, sb):
        assert (x - y).abs().max().item() <= ATOL, name
    assert G.max_rel(ga, gb) <= GRAD_RTOL
    mtp = [n for n in ga if n.startswith("mtp.")]
    assert mtp and all(ga[n].abs().max() > 0 for n in mtp), "the MTP loss must reach the MTP layers"


def test_mtp_refused_on_the_legacy_seam():
    model = G.build_gpt(mtp_layers=1)
    ids, labels, _ = G.batch(3)
    with pytest.raises(ValueError, match="mtp_num_layers"):
        token_stats(model, ids, labels, vocab_size=G.VOCAB, seam="output_layer")


def test_refusals_name_the_option():
    model = G.build_gpt()
    ids, labels, _ = G.batch(0)
    call = functools.partial(token_stats, model, ids, vocab_size=G.VOCAB)
    with pytest.raises(ValueError, match="vocab_size"):
        token_stats(model, ids, labels, vocab_size=None)
    with pytest.raises(ValueError, match="vocab_size"):
        token_stats(model, ids, labels, vocab_size=True)
    with pytest.raises(ValueError, match="vocab_size"):
        token_stats(model, ids, labels, vocab_size=G.padded_vocab(1) + 1)
    with pytest.raises(ValueError, match="labels"):
        call(labels.t())  # [s, b] labels for [b, s] input_ids
    with pytest.raises(ValueError, match="temperature"):
        call(labels, temperature=torch.ones(5))
    with pytest.raises(ValueError, match="temperature"):
        call(labels, temperature=0.0)
    psp = pack_rows(ids, labels).packed_seq_params()
    with pytest.raises(ValueError, match=r"\[1, T\]"):
        call(labels, packed_seq_params=psp)  # THD needs the packed [1, T] layout
    psp.qkv_format = "sbhd"
    with pytest.raises(ValueError, match="qkv_format"):
        token_stats(model, ids[:1], labels[:1], vocab_size=G.VOCAB, packed_seq_params=psp)
    model.config.defer_embedding_wgrad_compute = True
    with pytest.raises(ValueError, match="defer_embedding_wgrad_compute"):
        call(labels)
    model.config.defer_embedding_wgrad_compute = False
    rows = G.padded_vocab(1)
    for bad in (rows, -1):  # an input id the embedding has no row for: named, not torch's bare IndexError
        past = ids.clone()
        past[1, 2] = bad
        with pytest.raises(ValueError, match=rf"input_ids\[1, 2\] = {bad} is outside the model's embedding of "
                                             rf"{rows} rows"):
            token_stats(model, past, labels, vocab_size=G.VOCAB)


def test_square_batch_layout():
    """b == s: labels must follow input_ids' [batch, seq] layout; the values say which layout ran."""
    model = G.build_gpt()
    ids, labels, _ = G.batch(0, b=6, s=6)
    _check(model, ids, labels, 1.0)


def test_seam_checks_without_token_stats():
    """The processor refuses on its own, for callers that use the seam directly."""
    with pytest.raises(ValueError, match="vocab_size"):
        capture.CaptureContext(labels=torch.zeros(1, 4, dtype=torch.long), options=LCEOptions())
    ctx = capture.CaptureContext(labels=torch.zeros(2, 4, dtype=torch.long), options=LCEOptions(vocab_size=10))
    layer = types.SimpleNamespace(weight=torch.zeros(10, 8), sequence_parallel=False, tp_group=None,
                                  config=types.SimpleNamespace(defer_embedding_wgrad_compute=True))
    with pytest.raises(ValueError, match="defer_embedding_wgrad_compute"):
        capture.stats_output_processor(hidden_states=torch.zeros(4, 2, 8), output_layer=layer, output_weight=None,
                                       context=ctx, config=layer.config)
    layer.config.defer_embedding_wgrad_compute = False
    with pytest.raises(ValueError, match="laid out like input_ids"):
        capture.stats_output_processor(hidden_states=torch.zeros(4, 2, 8), output_layer=layer, output_weight=None,
                                       context=ctx, config=layer.config, input_ids=torch.zeros(4, 2, dtype=torch.long))


def test_wrappers_and_pipeline_stages():
    model = G.build_gpt()
    wrapped = types.SimpleNamespace(module=types.SimpleNamespace(module=model))
    assert find_gpt_model(wrapped) is model
    with pytest.raises(TypeError, match="GPTModel"):
        find_gpt_model(torch.nn.Linear(2, 2))
    ids, labels, _ = G.batch(0)
    model.post_process = False  # a stage without the LM head returns what the schedule sends on
    out = token_stats(model, ids, labels, vocab_size=G.VOCAB)
    assert torch.is_tensor(out) and out.shape == (ids.shape[1], ids.shape[0], G.H)


def test_packed_next_token_labels():
    ids = torch.arange(100, 110)[None]
    lab = packed_next_token_labels(ids, torch.tensor([0, 3, 3, 4, 8], dtype=torch.int32))
    assert lab.tolist() == [[101, 102, -100, -100, 105, 106, 107, -100, -100, -100]]
    padded = packed_next_token_labels(ids, torch.tensor([0, 2, 5]), cu_seqlens_padded=torch.tensor([0, 4, 8]))
    assert padded.tolist() == [[101, -100, -100, -100, 105, 106, -100, -100, -100, -100]]
    # the same labels a per-sequence shift gives (what every framework writes by hand)
    seqs = [torch.randint(0, 50, (n,)) for n in (5, 1, 9)]
    want = torch.cat([torch.cat([x[1:], torch.tensor([-100])]) for x in seqs])
    cu = torch.tensor([0, 5, 6, 15])
    assert torch.equal(packed_next_token_labels(torch.cat(seqs), cu), want)
    with pytest.raises(ValueError, match="cu_seqlens"):
        packed_next_token_labels(ids, torch.tensor([0, 5, 3]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        packed_next_token_labels(ids, torch.tensor([1, 5]))


# ------------------------------------------------------------- the head's options (invariant, logits_precision)

@pytest.mark.parametrize("fused", [True, False], ids=["fused", "materialised"])
def test_token_stats_passes_the_head_options(monkeypatch, fused):
    model = G.build_gpt()
    ids, labels, _ = G.batch(0)
    call = functools.partial(token_stats, model, ids, labels, vocab_size=G.VOCAB, fused=fused, backend="torch")
    seen = spy_heads(monkeypatch)
    with torch.no_grad():
        call()  # None: the op's own defaults
        call(invariant=True, logits_precision="bf16")
        call(invariant=False, logits_precision="fp32")
    head = "linear_logprobs_entropy" if fused else "logprobs_entropy_from_logits"
    assert seen == [(head, {"invariant": None, "logits_precision": "fp32"}),
                    (head, {"invariant": True, "logits_precision": "bf16"}),
                    (head, {"invariant": False, "logits_precision": "fp32"})]
    with pytest.raises(TypeError, match="invariant"):
        call(invariant="yes")
    with pytest.raises(ValueError, match="logits_precision"):  # the op's own check
        call(logits_precision="fp16")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "materialised"])
def test_token_stats_checks_a_temperature_once(monkeypatch, fused):
    """token_stats is one entry: its float temperature is checked once (the LCEOptions it builds), and the
    seam and the op take that value without checking it again; a tensor likewise, where the route broadcasts
    it. The materialised route's head is an entry of its own (logprobs_entropy_from_logits): one more. A
    tensor's type and shape are checked where the route broadcasts it and by the op's head (an entry of its
    own that takes any broadcastable tensor); its values once, on the device, with the labels."""
    model = G.build_gpt()
    ids, labels, _ = G.batch(0)
    calls = count_temperature_checks(monkeypatch)
    with torch.no_grad():
        token_stats(model, ids, labels, vocab_size=G.VOCAB, fused=fused, backend="torch", temperature=0.7)
        assert len(calls) == (1 if fused else 2), calls
        calls.clear()
        token_stats(model, ids, labels, vocab_size=G.VOCAB, fused=fused, backend="torch",
                    temperature=torch.full((ids.shape[0], 1), 0.7))
    assert len(calls) == 2, calls


GRID = 64  # the LM head's inputs on a 1/64 grid (_exact_head_model)
T = 0.75  # rounding to bf16 comes before the temperature: a temperature != 1 tells the orders apart


def _exact_head_model(dtype: torch.dtype):
    """build_gpt (untied) whose LM head multiplies hidden states and weights on the 1/GRID grid, |h| <= 2 (a
    hook on the final norm rounds its output there) and |w| <= 1: every logit is a sum of H = 64 products on
    the 2^-12 grid below 2^7, exact in fp32 in any order, and the inputs are exact in bf16. So every route
    and the fp64 reference start from the same logits; they differ only in the softmax's rounding.
    Returns the model and a dict that receives the head's hidden states ([s, b, H]) of each call."""
    model = G.build_gpt()
    with torch.no_grad():
        w = model.output_layer.weight
        w.copy_(torch.randint(-GRID, GRID + 1, w.shape, generator=torch.Generator().manual_seed(11)) / GRID)
    model = model.to(dtype)
    seen = {}

    def snap(module, args, out):
        seen["hidden"] = (out * GRID).round().clamp(-2 * GRID, 2 * GRID) / GRID
        return seen["hidden"]

    model.decoder.final_layernorm.register_forward_hook(snap)
    return model, seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32_model", "bf16_model"])
def test_logits_precision_on_every_route(dtype):
    """Each route (fused; materialised through either seam) against an fp64 softmax of the exact logits
    ("fp32") and of the exact logits rounded to bf16 before the temperature ("bf16"): within the fp32
    rounding bound B of the op's softmax (tests/helpers/bounds.py) of its own mode's reference, and far
    from the other mode's (the bf16 rounding of the logits moves these logprobs by 0.03-0.05; B is ~3e-4,
    mostly the GEMM's rounding term, which these exact logits do not have). B is computed from the unrounded
    logits; those of the bf16 mode differ by < 2^-8 relative, so 2·B covers both. A bf16 model's
    materialised route used to take bf16 logits from the output layer whatever was asked."""
    from helpers.bounds import op_bounds

    model, seen = _exact_head_model(dtype)
    ids, labels, _ = G.batch(4)
    valid = labels != -100
    routes = {"fused": dict(fused=True), "materialised": dict(fused=False),
              "materialised_output_layer_seam": dict(fused=False, seam="output_layer")}
    got = {}
    with torch.no_grad():
        for route, kw in routes.items():
            for precision in ("fp32", "bf16"):
                st = token_stats(model, ids, labels, vocab_size=G.VOCAB, temperature=T, backend="torch",
                                 logits_precision=precision, **kw)
                got[route, precision] = st.logprobs.double()
    h = seen["hidden"].transpose(0, 1).double()  # [b, s, H]
    w = model.output_layer.weight.double()[:G.VOCAB]
    exact = h @ w.t()  # every value exact (see _exact_head_model)
    ref = {}
    for precision, z in (("fp32", exact), ("bf16", exact.to(torch.bfloat16).double())):
        lp = torch.log_softmax(z / T, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        ref[precision] = torch.where(valid, lp, torch.zeros_like(lp))
    bound = 2 * op_bounds(h.reshape(-1, G.H).float(), w.float(), labels.reshape(-1), 1 / T,
                          vocab_size=G.VOCAB).logprobs.view(labels.shape)
    rounding = (ref["fp32"] - ref["bf16"]).abs().max().item()
    assert rounding > 20 * bound.max().item(), "the test needs logits whose bf16 rounding shows"
    for (route, precision), lp in got.items():
        other = "bf16" if precision == "fp32" else "fp32"
        err = (lp - ref[precision]).abs()
        assert (err <= bound).all(), (f"{route} {precision}: |d logprob| {err.max().item():.2e} against the "
                                      f"{precision} reference, bound {bound.max().item():.2e}")
        assert (lp - ref[other]).abs().max().item() > 0.5 * rounding, (route, precision)


class TestWithoutCpuShims:
    """token_stats enters megatron-core's CPU shims itself (RoPE asks for torch.cuda.current_device() on
    every forward); a caller who has not entered them gets a working forward and backward at TP=1, and a
    clear refusal where the backward would need them (sequence parallelism)."""

    @pytest.fixture(autouse=True)
    def megatron_on_cpu(self):  # replaces gpt_builder's fixture: no shims around the test
        yield

    @pytest.fixture
    def model(self):
        from areal_lce.megatron.compat import cpu_shims

        with cpu_shims():
            return G.build_gpt()

    @pytest.mark.skipif(torch.cuda.is_available(), reason="the shims are a no-op with CUDA")
    def test_forward_and_backward(self, model):
        from areal_lce.megatron.compat import shims_active

        ids, labels, _ = G.batch(0)
        assert not shims_active()
        st = token_stats(model, ids, labels, vocab_size=G.VOCAB, backend="torch")
        assert not shims_active()  # entered for the call only
        st.logprobs.sum().backward()
        assert model.output_layer.weight.grad.abs().sum() > 0

    @pytest.mark.skipif(torch.cuda.is_available(), reason="the shims are a no-op with CUDA")
    def test_sequence_parallel_backward_is_refused_naming_the_fix(self, model):
        ids, labels, _ = G.batch(0)
        model.config.sequence_parallel, model.config.tensor_model_parallel_size = True, 2  # as a TP=2 + SP model
        try:
            with pytest.raises(RuntimeError, match=r"sequence_parallel.*cpu_shims\(\)"):
                token_stats(model, ids, labels, vocab_size=G.VOCAB, backend="torch")
        finally:
            model.config.sequence_parallel, model.config.tensor_model_parallel_size = False, 1


# --------------------------------------------------------------------------------------------- TP = 2

@functools.lru_cache(maxsize=None)
def worker_results() -> dict:
    out = os.path.join(tempfile.mkdtemp(prefix="areal_lce_ts_"), "out.json")
    return torchrun(os.path.join(HERE, "token_stats_worker.py"), out, timeout=600, result=out)


def _worker_cases(prefix):
    import token_stats_worker as W

    return [c for c in W.CASES if c.startswith(prefix)]


@pytest.mark.parametrize("case", _worker_cases("bshd") + _worker_cases("thd"))
@pytest.mark.distributed
def test_tp2_matches_megatron_oracle(case):
    r = worker_results()[case]
    assert "error" not in r, r.get("error")
    for k, v in r.items():
        limit = GRAD_RTOL if k.endswith("grad_rel") else ATOL
        assert v <= limit, f"{case} {k} = {v:.2e}"


@pytest.mark.distributed
def test_tp2_parallel_output_false():
    r = worker_results()["parallel_output_false"]
    assert "error" not in r, r.get("error")
    assert max(r.values()) <= ATOL, r


@pytest.mark.distributed
def test_tp2_sequence_parallel_length_error():
    r = worker_results()["sp_length_error"]
    assert "error" not in r, r.get("error")
    assert "sequence_parallel" in r["message"] and "multiple of 2" in r["message"], r


@pytest.mark.distributed
def test_documented_example_tp2_sp():
    r = worker_results()["example"]
    assert "error" not in r, r.get("error")
    assert r["thd_vs_bshd_logprobs"] <= ATOL and r["thd_vs_bshd_entropy"] <= ATOL, r
    assert r["logprobs_max"] < 0 and r["head_grad_norm"] > 0, r
