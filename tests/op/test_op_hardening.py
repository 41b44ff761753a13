"""The op's front ends and the materialised route on inputs users get wrong or edit.

- A label >= vocab_size or a negative label that is not ignore_index: the materialised route refuses it
  as the fused op does (it used to score it 0, a perfect logprob).
- Outputs edited in place before backward (`lp[~mask] = 0; lp.sum().backward()`, the RL pattern) work on
  the op without TP and under TP (the same torch.library ops, the group by name), while a second-order
  gradient is still refused with a clear error.
- With compact_ignored=False a NaN in an ignored row's hidden reaches no d_hidden on the backends that
  compute every row (the contract api.py states).
"""
import pytest
import torch

import areal_lce
from areal_lce.op.materialised import logprobs_entropy_from_logits

from helpers.groups import fake_group  # noqa: F401  (fixture: a recording 2-rank TP group)
from helpers.kernel_device import on_kernel_device

IGNORE = -100


def _inputs(n=12, h=8, v=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 0.5, torch.randint(0, v, (n,), generator=g)


@pytest.mark.parametrize("bad", [40, 41, -1, -7])
def test_materialised_route_refuses_out_of_range_labels_like_the_op(bad):
    h, w, y = _inputs()
    y[3] = bad
    logits = h @ w.t()
    with pytest.raises(ValueError, match="outside \\[0, vocab_size=40\\)"):
        logprobs_entropy_from_logits(logits, y)
    with pytest.raises(ValueError, match="outside \\[0, vocab_size=40\\)"):
        areal_lce.linear_logprobs_entropy(h, w, y)
    y[3] = IGNORE  # ignore_index itself stays legal on both
    assert torch.isfinite(logprobs_entropy_from_logits(logits, y).logprobs).all()


def _edit_and_backward(call):
    h, w, y = _inputs()
    y[[2, 5]] = IGNORE
    h.requires_grad_()
    w.requires_grad_()
    out = call(h, w, y)
    lp = out.logprobs
    lp[y == IGNORE] = 0  # in-place edit of the op's output
    (lp.sum() + out.entropy.sum()).backward()
    return h.grad, w.grad


@pytest.mark.parametrize("front", ["library", "tensor_parallel"])
def test_outputs_edited_in_place_then_backward(front, request):
    if front == "library":
        def call(h, w, y):
            return areal_lce.linear_logprobs_entropy(h, w, y, backend="torch")
    else:
        group = request.getfixturevalue("fake_group")

        def call(h, w, y):
            return areal_lce.linear_logprobs_entropy(h, w, y, backend="torch", invariant=False,
                                                     vocab_parallel=areal_lce.VocabParallel(group, d_hidden="caller"))
    dh, dw = _edit_and_backward(call)
    assert torch.isfinite(dh).all() and torch.isfinite(dw).all() and dh.abs().sum() > 0
    # a gradient built with create_graph=True still cannot be differentiated again
    h, w, y = _inputs()
    h.requires_grad_()
    out = call(h, w, y)
    (g,) = torch.autograd.grad(out.logprobs.sum(), h, create_graph=True)
    with pytest.raises(RuntimeError, match="second-order"):
        g.sum().backward()


@pytest.mark.parametrize("backend", ["torch", "reference", "triton"])
def test_nan_in_an_ignored_row_reaches_no_d_hidden(backend):
    h, w, y = _inputs(n=9)
    y[[1, 4]] = IGNORE
    h[1] = float("nan")
    h[4, 0] = float("inf")
    if backend == "triton":
        h, w, y = on_kernel_device(h, w, y)  # the interpreter on CPU, or the kernels on a GPU
    h.requires_grad_()
    out = areal_lce.linear_logprobs_entropy(h, w, y, backend=backend, compact_ignored=False)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    assert torch.isfinite(h.grad).all(), h.grad
    assert (h.grad[[1, 4]] == 0).all()
