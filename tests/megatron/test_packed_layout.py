"""`PackedLayout`: the packed (THD) layout as one value -- its constructors agree, its host and tensor
copies agree, its context-parallel form is what `pad_for_context_parallel` returns, the packed rows and
the engine's batches carry it (no other form of the layout), and bad input is refused naming the argument."""
import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from areal_lce.megatron import context_parallel as CP
from areal_lce.megatron.packing import PackedLayout, pack_rows, packed_next_token_labels
from helpers.groups import fake_group  # noqa: F401  (fixture: a recording 2-rank group)

# a zero-length sequence (an empty row between two), odd lengths (CP pads them), one long sequence
LENGTHS = (7, 12, 0, 3, 9)


def _cu(lengths, dtype=torch.int32):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)


def _same(a: PackedLayout, b: PackedLayout):
    assert a.lengths == b.lengths and a.padded_lengths == b.padded_lengths
    for name in ("cu_seqlens", "cu_seqlens_padded", "index"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_constructors_agree_and_copies_agree():
    layout = PackedLayout.from_lengths(LENGTHS)
    cu = _cu(LENGTHS)
    _same(layout, PackedLayout.of(cu))
    _same(layout, PackedLayout.of(cu.tolist()))
    _same(layout, PackedLayout.of(_cu(LENGTHS, torch.int64)))
    assert PackedLayout.of(layout) is layout
    assert PackedLayout.of(cu).cu_seqlens is cu  # an int32 tensor is kept, not copied
    # host ints and tensors describe the same layout; unpadded: one cumulative tensor
    assert layout.cu_seqlens.dtype == torch.int32 and layout.cu_seqlens.tolist() == cu.tolist()
    assert not layout.padded and layout.cu_seqlens_padded is layout.cu_seqlens
    assert (layout.total, layout.padded_total, layout.max_seqlen) == (31, 31, 12)
    assert layout.index.tolist() == list(range(31))
    # megatron's PackedSeqParams: it carries the layout, and a foreign one converts to the same layout
    psp = layout.packed_seq_params()
    assert psp.qkv_format == "thd" and psp.cu_seqlens_q is layout.cu_seqlens and psp.cu_seqlens_kv_padded is None
    assert psp.max_seqlen_q == psp.max_seqlen_kv == 12 and PackedLayout.of(psp) is layout
    _same(layout, PackedLayout.of(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)))
    # pack_rows builds its rows' layout from the same rule, and their PackedSeqParams carry it
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    rows = pack_rows(ids, ids.masked_fill(ids == 0, -100))
    _same(rows.layout, PackedLayout.from_lengths([3, 2]))
    assert PackedLayout.of(rows.packed_seq_params()) is rows.layout and rows.to("cpu").layout.lengths == (3, 2)


@pytest.mark.parametrize("cp, multiple", [(1, None), (2, None), (2, 8), (3, 6)])
def test_context_parallel_form_is_pad_for_context_parallel(cp, multiple):
    layout = PackedLayout.from_lengths(LENGTHS)
    padded = layout.for_context_parallel(cp, multiple)
    old = CP.pad_for_context_parallel(_cu(LENGTHS), cp, multiple)
    assert isinstance(old, PackedLayout)  # the public helper returns the layout value itself
    _same(padded, old)
    step = multiple or 2 * cp
    assert padded.lengths == LENGTHS and padded.padded_lengths == tuple(-(-n // step) * step for n in LENGTHS)
    assert padded.padded and padded.cu_seqlens is not padded.cu_seqlens_padded
    assert padded.cu_seqlens_padded.tolist() == old.cu_seqlens_padded.tolist()
    assert padded.cu_seqlens_padded.dtype == old.cu_seqlens_padded.dtype == torch.int32
    assert torch.equal(padded.index, old.index) and padded.max_seqlen == old.max_seqlen
    assert padded.padded_total == old.padded_total == sum(padded.padded_lengths) and old.total == sum(LENGTHS)
    # the padded PackedSeqParams round-trips: the carried layout, or the same layout rebuilt from its tensors
    psp = padded.packed_seq_params()
    assert psp.cu_seqlens_q_padded is psp.cu_seqlens_kv_padded is padded.cu_seqlens_padded
    assert psp.max_seqlen_q == padded.max_seqlen and PackedLayout.of(psp) is padded
    psp.packed_layout = None
    _same(padded, PackedLayout.of(psp))
    # a carried layout is not trusted once the PackedSeqParams' tensors are replaced or modified in place
    psp = layout.packed_seq_params()
    psp.cu_seqlens_q = psp.cu_seqlens_kv = _cu((3, 4))
    assert PackedLayout.of(psp).lengths == (3, 4)
    psp = PackedLayout.from_lengths((3, 4)).packed_seq_params()
    psp.cu_seqlens_q[2] = 9
    assert PackedLayout.of(psp).lengths == (3, 6)
    # so do the next-token labels (the padded layout stands for cu_seqlens_padded)
    ids = torch.arange(1, padded.padded_total + 1)[None]
    want = packed_next_token_labels(ids, old_cu := _cu(LENGTHS), cu_seqlens_padded=old.cu_seqlens_padded)
    for spelling in (padded, padded.packed_seq_params()):
        assert torch.equal(packed_next_token_labels(ids, spelling), want)
    assert torch.equal(packed_next_token_labels(ids[:, :31], layout), packed_next_token_labels(ids[:, :31], old_cu))
    # pad_for_context_parallel takes the layout and megatron's PackedSeqParams too
    for spelling in (layout, layout.packed_seq_params()):
        again = CP.pad_for_context_parallel(spelling, cp, multiple)
        assert again.cu_seqlens_padded.tolist() == old.cu_seqlens_padded.tolist() and torch.equal(again.index, old.index)


def test_cp_split_takes_the_layout(fake_group):
    """The zigzag split reads a layout's padded slots from its host copy, as it reads a cu_seqlens tensor."""
    padded = PackedLayout.from_lengths(LENGTHS).for_context_parallel(2)
    x = torch.arange(padded.padded_total)[None]
    want = CP.split_for_context_parallel(x, fake_group, padded.cu_seqlens_padded)
    for spelling in (padded, padded.packed_seq_params()):
        assert torch.equal(CP.split_for_context_parallel(x, fake_group, spelling), want)
    assert fake_group.calls == []


def test_pad_packed_takes_the_layout():
    """pad_packed lays the packed tokens out in a layout's padded slots; it takes the layout value only."""
    padded = CP.pad_for_context_parallel(_cu(LENGTHS), 2)
    x = torch.arange(1, padded.total + 1)[None, :, None].expand(1, -1, 2)
    out = CP.pad_packed(x, padded, -1)
    assert out.shape == (1, padded.padded_total, 2) and torch.equal(out.index_select(1, padded.index), x)
    assert int((out == -1).sum()) == 2 * (padded.padded_total - padded.total)
    unpadded = PackedLayout.from_lengths(LENGTHS)
    assert torch.equal(CP.pad_packed(x, unpadded), x)
    with pytest.raises(TypeError, match="pad_packed: layout must be a PackedLayout .* got Tensor"):
        CP.pad_packed(x, padded.cu_seqlens_padded)
    with pytest.raises(ValueError, match=f"pad_packed: x must be \\[1, {padded.total}, ...\\]"):
        CP.pad_packed(x[:, 1:], padded)


def test_bound_layout_of_a_graphs_static_input():
    """A CUDA graph's static cu_seqlens (refilled on the device before every replay): its layout holds the
    bound on the host (max_seqlen = the token count), and once the tensor is written the PackedSeqParams'
    carried layout is no longer trusted: the tensor is read again."""
    cu = _cu((3, 5, 0))
    layout = PackedLayout.bound(cu, 8)
    assert layout.cu_seqlens is cu and not layout.padded and len(layout.lengths) == 3
    assert (layout.total, layout.max_seqlen) == (8, 8)
    psp = layout.packed_seq_params()
    assert psp.cu_seqlens_q is cu and psp.cu_seqlens_q_padded is None and psp.max_seqlen_q == psp.max_seqlen_kv == 8
    assert PackedLayout.of(psp) is layout
    cu.copy_(_cu((6, 1, 1)))  # what a graph replay's input copy does
    assert PackedLayout.of(psp).lengths == (6, 1, 1)
    for bad_cu, bad_tokens, what in ((cu.long(), 8, "cu_seqlens must be a 1-D int32"),
                                     (cu[:1], 8, "cu_seqlens must be .* got torch.int32 \\(1,\\)"),
                                     (cu, 0, "tokens=0"), (cu, True, "tokens=True")):
        with pytest.raises(ValueError, match=f"PackedLayout.bound: {what}"):
            PackedLayout.bound(bad_cu, bad_tokens)


def test_one_form_of_the_layout():
    """The layout has one form: the packed rows hold no cu_seqlens of their own and the engine's batch no
    second CP padding; a packed batch without its layout is refused."""
    import dataclasses

    import areal_lce.megatron as M
    from areal_lce.engine.batch import ModelBatch
    from areal_lce.megatron.packing import PackedRows

    assert {f.name for f in dataclasses.fields(PackedRows)} == {"input_ids", "labels", "position_ids", "layout",
                                                                "index", "padded_shape"}
    assert not hasattr(M, "ContextParallelPadding") and not hasattr(CP, "ContextParallelPadding")
    assert not hasattr(ModelBatch, "cp_padding")
    ids = torch.tensor([[5, 6, 7]])
    rows = pack_rows(ids, ids)
    with pytest.raises(ValueError, match="ModelBatch: a packed .THD. batch carries its PackedLayout"):
        ModelBatch(rows.input_ids, rows.labels, rows.position_ids, None, rows, (1, 3))
    with pytest.raises(ValueError, match="ModelBatch: a packed .THD. batch carries its PackedLayout"):
        ModelBatch(ids, ids, ids, None, None, (1, 3), layout=rows.layout)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D cumulative lengths starting at 0"):
        PackedLayout.of(torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="my_cu must be non-decreasing"):
        PackedLayout.of(torch.tensor([0, 3, 2]), "my_cu")
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D integer"):
        PackedLayout.of(torch.tensor([0.0, 2.0]))
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D integer"):
        PackedLayout.of(None)
    with pytest.raises(ValueError, match="lengths must be non-negative integers"):
        PackedLayout.from_lengths([3, -1])
    with pytest.raises(ValueError, match="lengths must be non-negative integers"):
        PackedLayout.from_lengths([3, 2.5])
    with pytest.raises(ValueError, match="padded_lengths must be non-negative integers"):
        PackedLayout.from_lengths([3], ["4"])
    with pytest.raises(ValueError, match="padded_lengths .* each at least its real length"):
        PackedLayout.from_lengths([3, 4], [4, 3])
    with pytest.raises(ValueError, match="packed_seq_params.qkv_format='sbhd'"):
        PackedLayout.of(PackedSeqParams(qkv_format="sbhd"), "packed_seq_params")
    cu, short = _cu([4, 4]), _cu([4, 2])
    with pytest.raises(ValueError, match="psp.cu_seqlens_q lengths .* must not exceed the cu_seqlens_q_padded"):
        PackedLayout.of(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=short), "psp")
    with pytest.raises(ValueError, match="multiple=6 must be a positive multiple of 2\\*cp_size = 4"):
        PackedLayout.from_lengths(LENGTHS).for_context_parallel(2, 6)
    with pytest.raises(ValueError, match="packed_seq_params.cu_seqlens_q must be 1-D integer"):
        PackedLayout.of(PackedSeqParams(qkv_format="thd"), "packed_seq_params")
