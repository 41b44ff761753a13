"""gradient_accumulation_fusion at the LM head (areal_lce/op/main_grad.py): the weight gradient is added in fp32
into `weight.main_grad`, `grad_added_to_main_grad` is set, and Megatron DDP's hook does not add it again.

Megatron refuses gradient_accumulation_fusion=True without APEX, which CI does not have, so the flag and
`main_grad` are set by hand on a built layer / parameter."""
from __future__ import annotations


import pytest
import torch


from helpers.bounds import assert_within, rounded_gemm_bound
from helpers.inputs import available_backends

from areal_lce import linear_logprobs_entropy  # noqa: E402
from areal_lce.op.main_grad import linear_logprobs_entropy_into_main_grad  # noqa: E402

N, H, V = 96, 64, 80


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(torch.bfloat16)
    w = torch.randn(V, H, generator=g).to(torch.bfloat16)
    w[:4] = h[:4]  # peaked logits: a few columns of W copied from rows of h
    y = torch.randint(0, V, (N,), generator=g)
    y[::7] = -100
    g_lp = torch.randn(N, generator=g)
    g_ent = torch.randn(N, generator=g)
    return h, w, y, g_lp, g_ent


def _param(w: torch.Tensor, main_grad: torch.Tensor) -> torch.nn.Parameter:
    p = torch.nn.Parameter(w.clone())
    p.main_grad = main_grad.clone()
    p.grad_added_to_main_grad = False  # megatron DDP sets the attribute on every parameter it buckets
    return p


def _backward(op, p, h, y, g_lp, g_ent, backend):
    hh = h.clone().requires_grad_()
    out = op(hh, p, y, backend=backend)
    (out.logprobs * g_lp + out.entropy * g_ent).sum().backward()
    return out, hh.grad


# every backend returns its d_weight in fp32 when asked: the CPU tensors' backends (the Triton ones through the
# interpreter, where helpers/kernel_device.py turns it on)
BACKENDS = available_backends()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_add_into_main_grad(backend):
    h, w, y, g_lp, g_ent = _inputs()
    init = torch.randn(V, H, generator=torch.Generator().manual_seed(1)) * 1e-2

    # a zero main_grad receives the op's d_weight as the backend accumulated it, in fp32
    p0 = _param(w, torch.zeros(V, H))
    _backward(linear_logprobs_entropy_into_main_grad, p0, h, y, g_lp, g_ent, backend)
    dw32 = p0.main_grad
    assert dw32.dtype == torch.float32 and not torch.equal(dw32, dw32.bfloat16().float()), "d_weight is not fp32"

    # the fused path: main_grad += dw32 in fp32 (bitwise), the flag set, a placeholder gradient for DDP
    p = _param(w, init)
    out, dh = _backward(linear_logprobs_entropy_into_main_grad, p, h, y, g_lp, g_ent, backend)
    assert torch.equal(p.main_grad, init + dw32)
    assert p.grad_added_to_main_grad is True
    assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype

    # the op through autograd gives the same outputs and d_hidden, and the bf16 rounding of dw32 as weight.grad
    q = torch.nn.Parameter(w.clone())
    ref, dh_ref = _backward(linear_logprobs_entropy, q, h, y, g_lp, g_ent, backend)
    assert torch.equal(out.logprobs, ref.logprobs) and torch.equal(out.entropy, ref.entropy)
    assert torch.equal(dh, dh_ref)
    assert torch.equal(q.grad, dw32.to(torch.bfloat16))

    # against fp64: the fused main_grad is at least as close as DDP's add of the bf16 gradient, and closer
    # overall (the bf16 rounding of d_weight, 2^-9 relative, is gone)
    p64 = torch.nn.Parameter(w.double())
    _backward(linear_logprobs_entropy, p64, h.double(), y, g_lp, g_ent, "reference")
    exact = init.double() + p64.grad
    err_fused = (p.main_grad.double() - exact).abs()
    err_bf16 = (init + q.grad.float()).double().sub(exact).abs()
    assert err_fused.sum() < err_bf16.sum(), (err_fused.sum().item(), err_bf16.sum().item())


def test_refuses_a_weight_without_main_grad():
    h, w, y, _, _ = _inputs()
    with pytest.raises(ValueError, match="main_grad"):
        linear_logprobs_entropy_into_main_grad(h, torch.nn.Parameter(w), y, backend="torch")
    with pytest.raises(TypeError, match="d_weight_fp32"):
        linear_logprobs_entropy_into_main_grad(h, _param(w, torch.zeros(V, H)), y, d_weight_fp32=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'tp_group'"):
        linear_logprobs_entropy_into_main_grad(h, _param(w, torch.zeros(V, H)), y, tp_group=None)


def test_two_calls_before_one_backward_add_into_the_buffer_of_each_call():
    """A layer called twice before the backward (MTP): each call's d_weight goes into the main_grad the weight
    had at that call's forward, also where that is the other call's buffer, which the first backward has
    already added into in place (main_grad is the backward op's mutated argument, not a saved tensor)."""
    h, w, y, g_lp, g_ent = _inputs()
    h2 = h * 0.5
    dws = []
    for hh in (h, h2):  # each call's fp32 d_weight alone
        p0 = _param(w, torch.zeros(V, H))
        out = linear_logprobs_entropy_into_main_grad(hh, p0, y, backend="torch")
        (out.logprobs * g_lp + out.entropy * g_ent).sum().backward()
        dws.append(p0.main_grad)
    for swap in (False, True):
        p = _param(w, torch.zeros(V, H))
        first_buffer = p.main_grad
        a = linear_logprobs_entropy_into_main_grad(h, p, y, backend="torch")
        if swap:  # the second call sees another buffer
            p.main_grad = torch.zeros(V, H)
        second_buffer = p.main_grad
        b = linear_logprobs_entropy_into_main_grad(h2, p, y, backend="torch")
        (a.logprobs * g_lp + a.entropy * g_ent + b.logprobs * g_lp + b.entropy * g_ent).sum().backward()
        assert p.grad_added_to_main_grad is True
        if swap:
            assert torch.equal(first_buffer, dws[0]) and torch.equal(second_buffer, dws[1])
            assert p.main_grad is first_buffer, \
                "the weight's main_grad is the buffer of the call whose backward ran last (the first call's)"
        else:  # one buffer: the second call's backward adds first (autograd's reverse order)
            assert torch.equal(p.main_grad, dws[1] + dws[0])


def test_compiled_main_grad_call_equals_eager():
    """torch.compile(fullgraph=True) of the main_grad front end: one graph, main_grad added bitwise as in eager,
    the flag set on the real parameter and the placeholder gradient handed to it (DDP's hook fires)."""
    import torch._dynamo.testing

    h, w, y, g_lp, g_ent = _inputs()
    init = torch.randn(V, H, generator=torch.Generator().manual_seed(1)) * 1e-2

    def f(hh, p):
        out = linear_logprobs_entropy_into_main_grad(hh, p, y, backend="torch")
        return (out.logprobs * g_lp + out.entropy * g_ent).sum()

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, fullgraph=True, backend=counter)
    res = []
    for fn in (f, compiled):
        p, hh = _param(w, init), h.clone().requires_grad_()
        fn(hh, p).backward()
        res.append((p, hh.grad))
    (pe, dhe), (pc, dhc) = res
    assert counter.frame_count == 1
    assert torch.equal(pc.main_grad, pe.main_grad) and torch.equal(dhc, dhe)
    assert pc.grad_added_to_main_grad is True
    assert pc.grad is not None and pc.grad.shape == pc.shape and pc.grad.dtype == pc.dtype


def test_megatron_ddp_hook_adds_nothing_more():
    """Megatron DDP's own backward hook (its _make_backward_post_hook) after the fused backward: main_grad
    keeps exactly the fp32 sum (the hook sees grad_added_to_main_grad and does not add the placeholder)."""
    from types import SimpleNamespace

    from megatron.core.distributed import DistributedDataParallel

    h, w, y, g_lp, g_ent = _inputs()
    p = _param(w, torch.zeros(V, H))
    fake_ddp = SimpleNamespace(param_to_bucket_group={p: None},
                               ddp_config=SimpleNamespace(overlap_grad_reduce=False))
    hook = DistributedDataParallel._make_backward_post_hook(fake_ddp, p)
    _backward(linear_logprobs_entropy_into_main_grad, p, h, y, g_lp, g_ent, "torch")
    after_backward = p.main_grad.clone()
    hook()
    assert p.grad is None  # the hook consumed the placeholder
    assert torch.equal(p.main_grad, after_backward)


def test_seam_with_gradient_accumulation_fusion_under_megatron_ddp():
    """The capture seam on an engine (megatron DDP, fp32 grad buffers, TP=1) whose output layer has
    gradient_accumulation_fusion=True: two micro-batches give the output weight's main_grad of the same run
    without the flag, bitwise (fp32 model: the same d_weight), and the flag is set (DDP's hook added nothing)."""
    from helpers import megatron_worker as W

    from areal_lce.engine.microbatch import MicroBatch
    from helpers.engines import tiny_engine

    grads = {}
    for fusion in (False, True):
        e = tiny_engine(W.VOCAB, optim=dict(lr=0.0, clip_grad=0.0), use_fused_linear_ce=True)
        layer = e.gpt.output_layer
        layer.gradient_accumulation_fusion = fusion
        e.train_step([MicroBatch(*W.batch(100)), MicroBatch(*W.batch(101))], W.pg_loss)
        grads[fusion] = layer.weight.main_grad.clone()
        assert layer.weight.grad_added_to_main_grad is fusion
    assert grads[False].abs().max() > 0
    assert torch.equal(grads[True], grads[False])


def test_areal_adapter_adds_into_main_grad():
    """AReaL's chunked LM head (the adapter) on a ColumnParallelLinear built with the flag set by hand: main_grad
    gets the fp32 d_weight added, bitwise as the wrapper adds it, and the flag is set."""
    from helpers import adapter_oracles as I

    from areal_lce.integrations import areal as lce_areal

    h, w, y, g_lp, _ = _inputs()
    y = y.clamp_min(0).reshape(-1, 1)  # AReaL's contract has no ignore_index; [T, 1] labels
    hidden = h.reshape(N, 1, H)
    init = torch.randn(V, H, generator=torch.Generator().manual_seed(2)) * 1e-2
    res = {}
    for fusion in (False, True):
        p = _param(w, init)
        layer = I.output_layer(H, V, gradient_accumulation_fusion=fusion)
        out = lce_areal.chunked_lm_head_logprobs_entropy(layer, hidden, p, y, temperature=1.0, chunk_size=4,
                                                         backend="torch")
        (out.logprobs * g_lp).sum().backward()
        if not fusion:  # megatron DDP's add of the bf16 gradient
            p.main_grad += p.grad.float()
        res[fusion] = p
    assert res[True].grad_added_to_main_grad is True and res[False].grad_added_to_main_grad is False
    p0 = _param(w, torch.zeros(V, H))
    out = linear_logprobs_entropy_into_main_grad(h, p0, y.reshape(-1), backend="torch", ignore_index=-(2 ** 63))
    (out.logprobs * g_lp).sum().backward()
    assert torch.equal(res[True].main_grad, init + p0.main_grad)
    assert not torch.equal(res[True].main_grad, res[False].main_grad)  # the bf16 rounding the fusion removes


def test_materialised_fp32_logits_add_into_main_grad():
    """The materialised route's fp32 logits of a bf16 model (head.fp32_logits) under the output layer's
    gradient_accumulation_fusion: d_weight accumulated in fp32 into main_grad (the flag set), not rounded to
    bf16 as the gradient through autograd is."""
    from helpers import adapter_oracles as I

    from areal_lce.megatron.head import fp32_logits

    h, w, _, _, _ = _inputs()
    hidden = h.reshape(N // 2, 2, H)
    g = torch.randn(N // 2, 2, V, generator=torch.Generator().manual_seed(3))
    init = torch.randn(V, H, generator=torch.Generator().manual_seed(4)) * 1e-2
    res = {}
    for fusion in (False, True):
        p = _param(w, init)
        (fp32_logits(hidden, p, I.output_layer(H, V, gradient_accumulation_fusion=fusion)) * g).sum().backward()
        if not fusion:  # megatron DDP's add of the bf16 gradient
            p.main_grad += p.grad.float()
        res[fusion] = p
    assert res[True].grad_added_to_main_grad is True and res[False].grad_added_to_main_grad is False
    g16 = g.reshape(N, V).bfloat16()  # the layer's bf16 output gradient
    dw32 = g16.float().t() @ h.float()  # fp32 accumulation: the same fp32 mm, shapes and strides as the fused path
    assert torch.equal(res[True].main_grad, init + dw32)
    # autograd's d_weight is a bf16 `mm` (oneDNN on an AVX-512 CPU, another GEMM than the fp32 one): its bf16
    # rounding of an fp32 accumulation in its own order, within the bound of one bf16 rounding plus two orders
    assert res[False].grad.dtype == torch.bfloat16
    assert_within("bf16 d_weight", res[False].grad, dw32, rounded_gemm_bound(g16.t(), h, dw32))
    # the rounding the fusion removes: the fused main_grad is closer to the exact fp32-operand sum
    exact = init.double() + g16.double().t() @ h.double()
    assert (res[True].main_grad.double() - exact).abs().sum() < (res[False].main_grad.double() - exact).abs().sum()
