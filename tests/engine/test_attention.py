"""SDPAttention (BSHD, packed THD, context parallel) and the context-parallel helpers.

One-rank cases run in this process; the CP=2 cases (helpers vs megatron's own split, GPTModel at CP=2
vs CP=1 for BSHD and THD) run in ONE torchrun launch of tests/engine/attention_worker.py (2 gloo ranks),
plus one more launch on megatron-core 0.16.1 when it is installed aside. The CUDA cases (varlen_attn, marked
`gpu`) are at the end.
"""
from __future__ import annotations

import functools
import os
import tempfile
import warnings

import pytest
import torch

warnings.filterwarnings("ignore")

import attention_worker as A  # noqa: E402
from helpers.paths import REPO
from helpers.gpt_builder import megatron_on_cpu  # noqa: E402,F401  (autouse: megatron-core on a CPU-only host)
from helpers.groups import fake_group  # noqa: E402,F401  (fixture: a recording 2-rank group)
from helpers.launch import torchrun  # noqa: E402

from areal_lce.megatron import context_parallel as CP  # noqa: E402
from areal_lce.engine.model.attention import (  # noqa: E402
    SDPAttention,
    causal_varlen_attention,
    make_segments,
    varlen_usable,
)

ATOL = 1e-5  # fp32, same weights: only summation order differs
GRAD_RTOL = 1e-5  # max |Δgrad| / max |grad| per parameter


@pytest.fixture(scope="module")
def tiny_state():
    A.init_parallel(1)
    return A.build_tiny(1).state_dict()


def _model(state):
    A.init_parallel(1)
    return A.build_tiny(1, state)


# ------------------------------------------------------------------------------- GPTModel, 1 rank


def test_thd_matches_bshd_one_by_one(tiny_state):
    """Packed THD through megatron's THD RoPE path (positions restart per sequence) == every sequence
    run alone as BSHD: logits and every parameter's gradient."""
    ids, pos, cu = A.thd_batch()
    weight = A._loss_weight((1, ids.shape[1], A.VOCAB), 21)
    m = _model(tiny_state)
    packed = m(ids, pos, None, packed_seq_params=A.packed_seq_params(cu))
    (packed * weight).sum().backward()
    g_thd = A.grads(m)
    m.zero_grad()
    alone = []
    for seq_ids, seq_pos, w in zip(ids.split(A.THD_LENGTHS, 1), pos.split(A.THD_LENGTHS, 1),
                                   weight.split(A.THD_LENGTHS, 1)):
        out = m(seq_ids, seq_pos, None)
        (out * w).sum().backward()  # grads accumulate over the sequences
        alone.append(out.detach())
    err = (packed.detach() - torch.cat(alone, 1)).abs().max().item()
    assert err <= ATOL, f"THD vs one-by-one BSHD logits: max |Δ| = {err:.3e}"
    g_bshd = A.grads(m)
    assert len(g_bshd) == len(list(m.parameters())) and all(g.abs().max() > 0 for g in g_bshd.values())
    assert A.max_rel(g_thd, g_bshd) <= GRAD_RTOL


def test_thd_padded_slots_do_not_change_real_tokens(tiny_state):
    """cu_seqlens_q_padded (every sequence padded to a multiple of 4, as CP needs): the real tokens'
    logits equal the unpadded pack's; padding content is irrelevant."""
    ids, pos, cu = A.thd_batch()
    pad = CP.pad_for_context_parallel(cu, 2)
    m = _model(tiny_state)
    with torch.no_grad():
        ref = m(ids, pos, None, packed_seq_params=A.packed_seq_params(cu))
        psp = A.packed_seq_params(cu, pad.cu_seqlens_padded, pad.max_seqlen)
        outs = [m(CP.pad_packed(ids, pad, fill), CP.pad_packed(pos, pad), None, packed_seq_params=psp)
                for fill in (0, 7)]
    for out in outs:
        err = (out.index_select(1, pad.index) - ref).abs().max().item()
        assert err <= ATOL, f"padded THD vs unpadded: {err:.3e}"


# ------------------------------------------------------------------------------ attention kernels


def _dense_reference(q, k, v, bounds_q, bounds_k, scale):
    """fp64 softmax attention per segment, queries aligned to the end of their keys."""
    n = q.shape[1]
    k, v = (t.double().repeat_interleave(n // t.shape[1], dim=1) for t in (k, v))
    out = []
    for (q0, q1), (k0, k1) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        s = torch.einsum("qnd,knd->nqk", q[q0:q1].double(), k[k0:k1]) * scale
        lq, lk = q1 - q0, k1 - k0
        allowed = torch.arange(lk)[None] <= torch.arange(lq)[:, None] + (lk - lq)
        out.append(torch.einsum("nqk,knd->qnd", s.masked_fill(~allowed, float("-inf")).softmax(-1), v[k0:k1]))
    return torch.cat(out)


# (query lengths, key lengths): why each exists
SEGMENT_CASES = [
    pytest.param([5, 1, 9], [5, 1, 9], id="self-attention-packed"),  # THD: one segment per sequence
    pytest.param([3, 3, 2, 2], [3, 12, 4, 6], id="cp-chunks"),  # CP rank 0 of 2: chunk 0 and chunk 3
    pytest.param([4, 0, 2], [8, 0, 2], id="empty-segment"),  # an empty sequence in the pack
]


@pytest.mark.parametrize("q_lens,k_lens", SEGMENT_CASES)
def test_causal_varlen_attention_matches_dense(q_lens, k_lens):
    g = torch.Generator().manual_seed(0)
    heads, groups, d, scale = 4, 2, 16, 0.3
    q = torch.randn(sum(q_lens), heads, d, generator=g, requires_grad=True)
    k = torch.randn(sum(k_lens), groups, d, generator=g, requires_grad=True)
    v = torch.randn(sum(k_lens), groups, d, generator=g, requires_grad=True)
    segs = make_segments(torch.tensor(q_lens), torch.tensor(k_lens), "cpu")
    out = causal_varlen_attention(q, k, v, segs, scale, impl="sdpa")
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _dense_reference(qd, kd, vd, segs.bounds_q, segs.bounds_k, scale)
    assert (out.double() - ref).abs().max().item() <= 1e-5
    w = torch.randn(out.shape, generator=g)
    (out * w).sum().backward()
    (ref * w.double()).sum().backward()
    for name, a, b in (("dq", q, qd), ("dk", k, kd), ("dv", v, vd)):
        assert (a.grad.double() - b.grad).abs().max().item() <= 1e-5, name


def test_varlen_impl_needs_cuda_half_precision():
    q = torch.randn(4, 2, 8)
    segs = make_segments(torch.tensor([4]), torch.tensor([4]), "cpu")
    with pytest.raises(RuntimeError, match="CUDA in bf16/fp16"):
        causal_varlen_attention(q, q, q, segs, 0.1, impl="varlen")


def _attention():
    A.init_parallel(1)
    from megatron.core.transformer.enums import AttnMaskType

    from areal_lce.engine.model import builder as M
    from areal_lce.engine.config import ModelConfig, ParallelConfig

    cfg = M.build_transformer_config(M.resolve_arch(ModelConfig(preset="tiny")), ParallelConfig(), torch.float32)
    return SDPAttention(cfg, 1, AttnMaskType.causal)


def test_thd_padding_slots_output_zeros():
    attn = _attention()
    real, padded = [3, 6], [4, 8]
    cu, cu_pad = A.cu_of(real), A.cu_of(padded)
    q, k, v = (torch.randn(12, h, 16) for h in (4, 2, 2))
    out = attn(q, k, v, None, packed_seq_params=A.packed_seq_params(cu, cu_pad)).view(12, 4, 16)
    is_pad = torch.tensor([0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool)
    assert (out[is_pad] == 0).all() and (out[~is_pad].abs().sum(-1) > 0).all()
    ref = attn(q, k, v, None, packed_seq_params=A.packed_seq_params(cu_pad))  # attention over the pads too
    assert torch.equal(out[~is_pad], ref.view(12, 4, 16)[~is_pad])  # causal: real tokens never see pads


THD_REFUSALS = [
    pytest.param(dict(max_seqlen=12), ValueError, "max_seqlen_q/kv", id="max_seqlen-is-packed-length"),
    pytest.param(dict(max_seqlen=3), ValueError, "max_seqlen_q/kv", id="max_seqlen-too-short"),
    pytest.param(dict(cu_kv=None), ValueError, "cu_seqlens_kv is required", id="no-cu_seqlens_kv"),
    pytest.param(dict(cu_kv=[0, 6, 12]), NotImplementedError, "self-attention", id="kv-layout-differs"),
    pytest.param(dict(cu=[0, 4, 10]), ValueError, "cu_seqlens_q\\[-1\\] = 10", id="token-count"),
    pytest.param(dict(fmt="sbhd"), ValueError, "qkv_format='sbhd'", id="not-thd"),
    pytest.param(dict(local_cp_size=2), NotImplementedError, "local_cp_size=2", id="hybrid-cp"),
]


@pytest.mark.parametrize("change,exc,match", THD_REFUSALS)
def test_thd_refusals_name_the_field(change, exc, match):
    attn = _attention()
    cu = torch.tensor(change.get("cu", [0, 4, 12]), dtype=torch.int32)
    psp = A.packed_seq_params(cu, max_seqlen=change.get("max_seqlen"))
    psp.qkv_format = change.get("fmt", "thd")
    psp.local_cp_size = change.get("local_cp_size")
    if "cu_kv" in change:
        psp.cu_seqlens_kv = None if change["cu_kv"] is None else torch.tensor(change["cu_kv"], dtype=torch.int32)
    q, k = torch.randn(12, 4, 16), torch.randn(12, 2, 16)
    with pytest.raises(exc, match=match):
        attn(q, k, k, None, packed_seq_params=psp)


def test_thd_plan_follows_replaced_cu_seqlens():
    """The per-forward plan cached on PackedSeqParams is recomputed when its tensors are replaced or
    modified in place (a framework reusing one PackedSeqParams object across micro-batches)."""
    attn = _attention()
    q, k, v = (torch.randn(12, h, 16) for h in (4, 2, 2))
    layouts = ([0, 4, 12], [0, 6, 12], [0, 5, 12])
    fresh = [attn(q, k, v, None, packed_seq_params=A.packed_seq_params(torch.tensor(c, dtype=torch.int32)))
             for c in layouts]
    psp = A.packed_seq_params(torch.tensor(layouts[0], dtype=torch.int32), max_seqlen=8)
    assert torch.equal(attn(q, k, v, None, packed_seq_params=psp), fresh[0])
    psp.cu_seqlens_q = psp.cu_seqlens_kv = torch.tensor(layouts[1], dtype=torch.int32)  # replaced
    assert torch.equal(attn(q, k, v, None, packed_seq_params=psp), fresh[1])
    psp.cu_seqlens_q[1] = 5  # modified in place (cu_seqlens_kv is the same tensor)
    assert torch.equal(attn(q, k, v, None, packed_seq_params=psp), fresh[2])


def test_decode_shapes_are_the_last_rows_of_causal_attention():
    """Decoding against a KV cache (1 query, 5 cached keys) = the last row of full causal attention."""
    attn = _attention()
    q, k, v = torch.randn(5, 2, 4, 16), torch.randn(5, 2, 2, 16), torch.randn(5, 2, 2, 16)
    full = attn(q, k, v, None)
    last = attn(q[-1:], k, v, None)
    torch.testing.assert_close(last, full[-1:], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- helpers, one rank


def test_pad_for_context_parallel():
    cu = A.cu_of([7, 12, 3, 9, 0])
    pad = CP.pad_for_context_parallel(cu, 2)
    assert pad.cu_seqlens_padded.tolist() == [0, 8, 20, 24, 36, 36] and pad.cu_seqlens_padded.dtype == torch.int32
    assert pad.max_seqlen == 12 and pad.padded_total == 36 and pad.total == 31
    assert pad.index.tolist() == list(range(7)) + list(range(8, 20)) + [20, 21, 22] + list(range(24, 33))
    x = torch.arange(1, 32)[None]
    padded = CP.pad_packed(x, pad, -1)
    assert torch.equal(padded.index_select(1, pad.index), x) and (padded == -1).sum() == 5
    assert CP.pad_for_context_parallel(cu, 2, multiple=8).cu_seqlens_padded.tolist() == [0, 8, 24, 32, 48, 48]
    with pytest.raises(ValueError, match="multiple=6"):
        CP.pad_for_context_parallel(cu, 2, multiple=6)


def test_split_and_gather_without_context_parallel_are_identity():
    x = torch.randn(2, 6, 3)
    assert CP.split_for_context_parallel(x, None) is x and CP.gather_from_context_parallel(x, None) is x


def test_prepare_takes_one_cp_value(fake_group):
    """The engine's batches take the context-parallel group as one CPGroup (built once by the engine), not a
    (group, size) pair: this rank's zigzag share of the right-padded rows; a bare group is refused."""
    from areal_lce.engine.batch import prepare

    ids = torch.arange(1, 7).view(1, 6)
    cp, kw = CP.CPGroup.of(fake_group), dict(device=torch.device("cpu"), max_seq_len=8, pack=False)
    mb = prepare(ids, ids.clone(), cp=cp, **kw)  # padded to 8 = 4 chunks of 2; rank 0 keeps chunks 0 and 3
    assert mb.cp is cp and mb.input_ids.tolist() == [[1, 2, 0, 0]] and mb.labels.tolist() == [[1, 2, -100, -100]]
    assert prepare(ids, ids.clone(), **kw).cp == CP.CPGroup.none()
    with pytest.raises(TypeError, match="cp must be a CPGroup"):
        prepare(ids, ids.clone(), cp=fake_group, **kw)
    assert fake_group.calls == []


def test_prepare_builds_one_packed_layout(fake_group):
    """A packed micro-batch carries its layout as one value, built once by prepare (CP-padded under CP):
    its PackedSeqParams carries it (attention and the CP helpers read its host lengths), and under CP it
    equals pad_for_context_parallel of the packed cu_seqlens."""
    from areal_lce.engine.batch import prepare
    from areal_lce.megatron.packing import PackedLayout

    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]])
    labels = ids.masked_fill(ids == 0, -100)
    kw = dict(device=torch.device("cpu"), max_seq_len=8, pack=True)
    mb = prepare(ids, labels, **kw)
    assert mb.layout is mb.packed.layout and mb.layout.lengths == (3, 5) and not mb.layout.padded
    assert PackedLayout.of(mb.packed_seq_params) is mb.layout and mb.packed_seq_params.max_seqlen_q == 5
    mb = prepare(ids, labels, cp=CP.CPGroup.of(fake_group), **kw)
    old = CP.pad_for_context_parallel(mb.packed.layout.cu_seqlens, 2)
    assert mb.layout.lengths == (3, 5) and mb.layout.padded_lengths == (4, 8)
    assert mb.layout.cu_seqlens is mb.packed.layout.cu_seqlens
    psp = mb.packed_seq_params
    assert PackedLayout.of(psp) is mb.layout and psp.cu_seqlens_q_padded is mb.layout.cu_seqlens_padded
    assert psp.max_seqlen_q == old.max_seqlen == 8
    assert torch.equal(mb.layout.cu_seqlens_padded, old.cu_seqlens_padded) and torch.equal(mb.layout.index, old.index)
    assert mb.layout.padded_total == old.padded_total == 12 and old.padded_lengths == mb.layout.padded_lengths
    assert mb.input_ids.tolist() == [[5, 0, 8, 9, 0, 0]]  # rank 0: chunk 0 and 3 of [5 6 7 0] and [8 .. 12 0 0 0]
    assert fake_group.calls == []


def test_thd_plan_reads_the_carried_layout(monkeypatch):
    """The engine's PackedSeqParams carry their PackedLayout: the attention plan takes the host lengths
    from it and never reads cu_seqlens back (a device sync per forward on an accelerator)."""
    from areal_lce.engine.model import attention
    from areal_lce.megatron import packing
    from areal_lce.megatron.packing import PackedLayout

    attn = _attention()
    q, k, v = (torch.randn(12, h, 16) for h in (4, 2, 2))
    layout = PackedLayout.from_lengths([3, 5, 0, 4])
    want = attn(q, k, v, None, packed_seq_params=A.packed_seq_params(layout.cu_seqlens.clone()))

    def no_read(*args, **kwargs):
        raise AssertionError("cu_seqlens read back on the host")

    monkeypatch.setattr(packing, "sequence_lengths", no_read)
    monkeypatch.setattr(attention, "_host", no_read)
    assert torch.equal(attn(q, k, v, None, packed_seq_params=layout.packed_seq_params()), want)


def test_zigzag_positions():
    assert CP.zigzag_positions([8], 2, 0).tolist() == [0, 1, 6, 7]
    assert CP.zigzag_positions([8, 4], 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    with pytest.raises(ValueError, match="multiple of 2\\*cp = 4"):
        CP.zigzag_positions([6], 2, 0)


# --------------------------------------------------------------------------------- CP = 2 (2 ranks)


def _launch(pythonpath: str = "") -> dict:
    out = os.path.join(tempfile.mkdtemp(prefix="areal_lce_attn_"), "worker.json")
    return torchrun(A.__file__, out, timeout=400, pythonpath=pythonpath, result=out)


@functools.lru_cache(maxsize=None)
def worker_results(pythonpath: str = "") -> dict:
    return _launch(pythonpath)


def _check_cp2(r: dict) -> None:
    for case in ("split", "gpt", "refusal"):
        assert "error" not in r[case], r[case].get("error")
    s, g = r["split"], r["gpt"]
    # bit-exact: the split is megatron's, the gather its inverse, the gather grad each rank's own slice
    for k in ("bshd_split_mismatch", "thd_split_mismatch", "bshd_gather_inverse", "thd_gather_inverse",
              "bshd_gather_grad", "thd_gather_grad"):
        assert s[k] == 0.0, (k, s)
    assert s["bad_length_refused"] == 1.0 and r["refusal"]["p2p_refused"] == 1.0
    assert g["thd_local_tokens"] == 18  # (8 + 12 + 4 + 12) / 2: padded to multiples of 2*cp, then split
    for k in ("bshd_logits", "thd_logits"):
        assert g[k] <= ATOL, (k, g)
    for k in ("bshd_grad_rel", "thd_grad_rel"):
        assert g[k] <= GRAD_RTOL, (k, g)
    # the comparison is sensitive: contiguous halves (wrong RoPE positions and causal mask) are far off
    assert g["bshd_contiguous_split_error"] > 1e-2 * g["logits_scale"], g


@pytest.mark.distributed
def test_context_parallel_two_ranks():
    """CP=2 on 2 gloo ranks: helpers == megatron's get_batch_on_this_cp_rank; GPTModel outputs (gathered)
    and CP-summed parameter gradients == CP=1, BSHD and THD (megatron's RoPE gets the zigzag positions)."""
    r = worker_results()
    assert tuple(r["meta"]["megatron_version"][:2]) >= (0, 18), r["meta"]
    _check_cp2(r)


_SETUP_LEGACY = str(REPO / ".venv" / "megatron-legacy")
LEGACY_DIR = os.environ.get("AREAL_LCE_MEGATRON_LEGACY", "") or (_SETUP_LEGACY if os.path.isdir(_SETUP_LEGACY) else "")


@pytest.mark.skipif(not LEGACY_DIR, reason="needs megatron-core 0.16.1 aside (.ci/setup.sh or AREAL_LCE_MEGATRON_LEGACY)")
@pytest.mark.distributed
def test_context_parallel_two_ranks_legacy_megatron():
    """The same cases on megatron-core 0.16.1 (its THD RoPE and split have the same contracts)."""
    r = worker_results(LEGACY_DIR)
    assert tuple(r["meta"]["megatron_version"][:2]) < (0, 18), r["meta"]
    _check_cp2(r)


# --------------------------------------------------------------------------------------------------
# CUDA (marked `gpu`: skipped without a CUDA device)
# The engine's core attention (areal_lce/engine/model/attention.py) on one CUDA device. Needs megatron-core, as the rest of the attention tests do.
#
#     python -m pytest -q -m gpu tests/engine/test_attention.py
#     python -m benchmark.engine.gpu_attention_check --out DIR     # the same tests, a timing line, JSON summary
#
# 1. Kernels: `causal_varlen_attention` through torch's `varlen_attn` (flash varlen, impl="varlen") against
#    one SDPA call per segment (impl="sdpa") at the same dtype, both judged against the fp32 SDPA result on
#    the same values: packed self-attention with RL-like lengths, context-parallel segments (queries fewer
#    than keys, causal aligned lower right), GQA 14/2 heads d=64 (Qwen2.5-0.5B) and 28/4 d=128 (7B), bf16 and
#    fp16; output and dq/dk/dv. Pass rule: err(varlen) <= 4 x err(sdpa) + atol, err = max |Δ| to fp32.
# 2. GPTModel: the `tiny` preset in bf16, 4 packed THD sequences (varlen path) vs the same sequences one by
#    one as BSHD (SDPA), both judged against the BSHD fp32 model: the same pass rule.

VARLEN_ATOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
_RL = torch.randint(64, 2049, (8,), generator=torch.Generator().manual_seed(1)).tolist() + [1, 7]  # RL-like + tiny
_C = [96, 40, 256]  # CP=2, rank 0: chunk 0 sees c keys, chunk 3 sees 4c keys
KERNEL_CASES = {  # name: (query lengths, key lengths, heads, kv groups, head dim)
    "packed-rl-0.5b": (_RL, _RL, 14, 2, 64),
    "cp-segments-0.5b": ([n for n in _C for _ in range(2)], [m * n for n in _C for m in (1, 4)], 14, 2, 64),
    "packed-7b": (_RL[:4], _RL[:4], 28, 4, 128),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_varlen_attn_matches_sdpa(name, dtype, record_property):
    q_lens, k_lens, heads, groups, d = KERNEL_CASES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    q32 = torch.randn(sum(q_lens), heads, d, device="cuda", generator=g)
    k32, v32 = (torch.randn(sum(k_lens), groups, d, device="cuda", generator=g) for _ in range(2))
    w = torch.randn(q32.shape, device="cuda", generator=g)
    segs = make_segments(torch.tensor(q_lens), torch.tensor(k_lens), "cuda")
    scale = d ** -0.5

    def run(impl, dt):
        q, k, v = (t.detach().to(dt).clone().requires_grad_() for t in (q32, k32, v32))
        out = causal_varlen_attention(q, k, v, segs, scale, impl=impl)
        (out.float() * w).sum().backward()
        return [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]

    ref, sdpa = run("sdpa", torch.float32), run("sdpa", dtype)
    assert varlen_usable(q32.to(dtype), scale, 0.0), "varlen_attn is not usable here"
    varlen = run("varlen", dtype)
    res = {}
    for label, r, s, v in zip(("out", "dq", "dk", "dv"), ref, sdpa, varlen):
        res[f"{label}_err_varlen"], res[f"{label}_err_sdpa"] = float((v - r).abs().max()), float((s - r).abs().max())
    record_property("result", res)
    bad = [k for k in ("out", "dq", "dk", "dv") if res[f"{k}_err_varlen"] > 4 * res[f"{k}_err_sdpa"] + VARLEN_ATOL[dtype]]
    assert not bad, (bad, res)


@pytest.mark.gpu
def test_gpt_tiny_thd_varlen_matches_bshd(record_property):
    from megatron.core.packed_seq_params import PackedSeqParams

    from areal_lce.engine.model import builder as M
    from areal_lce.engine.config import ModelConfig, ParallelConfig
    from areal_lce.engine.parallel import init_distributed

    init_distributed(ParallelConfig(), seed=3)
    cfg = ModelConfig(preset="tiny", max_seq_len=4096)
    arch = M.resolve_arch(cfg)
    m32 = M.build_gpt_model(arch, cfg, ParallelConfig(), torch.float32)
    m16 = M.build_gpt_model(arch, cfg, ParallelConfig(), torch.bfloat16)
    m16.load_state_dict(m32.state_dict())
    kind = type(m16.decoder.layers[0].self_attention.core_attention).__name__
    lengths = [300, 17, 1024, 555]
    ids = torch.randint(0, 512, (1, sum(lengths)), device="cuda")
    pos = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                          max_seqlen_kv=max(lengths))

    def one_by_one(m):
        return torch.cat([m(i, p, None).float() for i, p in zip(ids.split(lengths, 1), pos.split(lengths, 1))], 1)

    with torch.no_grad():
        ref, bshd = one_by_one(m32), one_by_one(m16)
        thd = m16(ids, pos, None, packed_seq_params=psp).float()
    res = {"core_attention": kind, "err_thd_bf16": float((thd - ref).abs().max()),
           "err_bshd_bf16": float((bshd - ref).abs().max())}
    record_property("result", res)
    assert kind == "SDPAttention", res
    assert res["err_thd_bf16"] <= 4 * res["err_bshd_bf16"] + 1e-2, res
