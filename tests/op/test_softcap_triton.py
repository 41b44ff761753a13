"""softcap on the Triton kernels (CPU interpreter): the in-kernel tanh against float64, and the paths that
tests/op/test_select.py's triton rows do not take (those run the default invariant kernels without a logits
cache): the online-softmax kernels, and the logits cache, whose backward reads the capped logits instead
of recomputing them.

Bounds: tests/helpers/softcap_bounds.py (first order, on the test's own tensors).
"""
from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from areal_lce import linear_logprobs_entropy as lce
from areal_lce.op.backends.triton.kernel_common import soft_cap
from areal_lce.op.backends.triton.launch import INTERPRET

from helpers.bounds import U32
from helpers.kernel_device import kernel_device, needs_interpreter, needs_kernels
from helpers.softcap_bounds import softcap_check

pytestmark = [pytest.mark.slow, needs_kernels]  # the Triton interpreter (on a GPU: the kernels)

IGNORE, H, V, V_PAD, CAP = -100, 40, 300, 384, 3.0


@triton.jit
def cap_kernel(x_ptr, out_ptr, t_ptr, n, softcap, inv_softcap, INTERP: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    c, t = soft_cap(tl.load(x_ptr + o, mask=m, other=0.0), softcap, inv_softcap, INTERP)
    tl.store(out_ptr + o, c, mask=m)
    tl.store(t_ptr + o, t, mask=m)


def test_in_kernel_tanh_is_within_its_absolute_bound():
    """kernel_common.soft_cap against float64 tanh: |t - tanh x| <= 11u absolutely (its comment's bound; the
    softmax sees only absolute errors), over small |x|, the knee, saturation, ±inf and NaN; |t| <= 1; the
    capped logit is one fp32 product of t and c."""
    grid = torch.cat([torch.linspace(0, 1, 20001), torch.logspace(-38, 1.5, 4001),
                      torch.tensor([0.55, math.nextafter(0.55, 0), math.nextafter(0.55, 1), 1e-45, 9.0, 40.0])])
    x = torch.cat([grid, -grid, torch.tensor([float("inf"), -float("inf"), float("nan")])]).float()
    dev = kernel_device()  # on a GPU: the rcp.approx path
    out, t = torch.empty_like(x, device=dev), torch.empty_like(x, device=dev)
    cap_kernel[(triton.cdiv(x.numel(), 1024),)]((x * CAP).to(dev), out, t, x.numel(), CAP, 1 / CAP, INTERP=INTERPRET,
                                                BLOCK=1024)
    out, t = out.cpu(), t.cpu()
    xs = (x * CAP).double() * (1 / CAP)  # what the kernel receives, as a real number
    fin = torch.isfinite(x)
    want = torch.tanh(xs[fin])
    err = (t[fin].double() - want).abs()
    assert float(err.max()) <= 11 * U32, f"max |err| {float(err.max()):.3g} at x={float(xs[fin][err.argmax()])}"
    n = grid.numel()
    assert float((t[:n].double() + t[n: 2 * n].double()).abs().max()) <= 22 * U32  # odd within the bound
    assert (t[fin].abs() <= 1).all() and torch.equal(out[fin], t[fin] * CAP)  # one fp32 product
    assert t[-3:-1].tolist() == [1.0, -1.0] and out[-3:-1].tolist() == [CAP, -CAP] and t[-1].isnan()


def _inputs(n=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g)
    weight = torch.randn(V_PAD, H, generator=g) * 0.4
    weight[[5, 128, 299]] = hidden[:3] * 0.7  # peaked rows: their label logits saturate the cap
    labels = torch.randint(0, V, (n,), generator=g)
    labels[:3] = torch.tensor([5, 128, 299])
    labels[[6, 13, 20]] = IGNORE
    return hidden, weight, labels


@needs_interpreter  # CPU tensors against the CPU oracle (on a GPU: benchmark.op.gpu_check)
@pytest.mark.parametrize("kw", [
    dict(invariant=False, temperature="per_token"),  # the online-softmax kernels (lce_fwd_kernel)
    dict(invariant=False, temperature=0.7, cache_bytes="auto"),  # backward reads the capped cache
    dict(invariant=True, temperature=0.7, cache_bytes="auto"),  # the segment kernels' cache
], ids=["online", "online-cache", "invariant-cache"])
def test_online_and_cached_paths_match_the_float64_oracle(kw):
    hidden, weight, labels = _inputs()
    n = hidden.shape[0]
    temperature = torch.linspace(0.5, 1.5, n) if kw["temperature"] == "per_token" else kw["temperature"]
    inv_t = 1 / temperature
    g = torch.Generator().manual_seed(5)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = lce(h, w, labels, vocab_size=V, backend="triton", softcap=CAP, return_stats=True,
              **dict(kw, temperature=temperature))
    ((out.logprobs * g_lp).sum() + (out.entropy * g_ent).sum()).backward()
    c = softcap_check(hidden, weight, labels, inv_t, CAP, g_lp, g_ent, V)
    for name, got, want, bound in (("logprobs", out.logprobs, c.logprobs, c.b_logprobs),
                                   ("entropy", out.entropy, c.entropy, c.b_entropy),
                                   ("d_hidden", h.grad, c.d_hidden, c.b_d_hidden),
                                   ("d_weight", w.grad, c.d_weight, c.b_d_weight)):
        err = (got.double() - want).abs()
        assert (err <= bound).all(), f"{name}: max err {float(err.max()):.3e}, worst err/bound {float((err / bound).max()):.2f}"
    assert (out.max_logit[labels != IGNORE] <= CAP).all() and torch.all(w.grad[V:] == 0)
    # the cap bites: the peaked rows' label logits sit near CAP, where the slope is far below 1
    assert (out.max_logit[:3] > 0.9 * CAP).all()
