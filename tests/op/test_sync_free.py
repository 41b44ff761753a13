"""No host sync with default options: the forward and backward read no device value on the host.

On CPU a "sync" costs nothing, so the test is structural: every Tensor -> Python conversion (.item(),
.tolist(), int(t), bool(t), ...) and every op with a data-dependent output size (nonzero, masked_select,
unique) is made to raise while a call with the accelerator defaults runs forward and backward. The
accelerator default differs from the CPU default in one place only, the label check ("deferred" instead
of "sync"), which these tests pass explicitly; `test_default_check_mode_per_device` pins that choice.
On a GPU, `python -m benchmark.gpu_check` runs the same calls under torch.cuda.set_sync_debug_mode("error").

Also here: the device-side row partition, the deferred label check and its error, what a NaN hidden
row that is ignored can reach, and the Triton kernels' skipping of ignored rows in place (through the
interpreter).
"""
import contextlib
from types import SimpleNamespace

import pytest
import torch

import areal_lce
from areal_lce.op import checks
from areal_lce.op.backends import get_backend
from areal_lce.op.function import partition_rows

from helpers.inputs import PER_TOKEN, available_backends
from helpers.kernel_device import interpreter_on, kernel_device
from helpers.groups import fake_group  # noqa: F401  (fixture: a recording 2-rank TP group)

IGNORE = -100
_CONVERSIONS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
                "masked_select", "unique")


@contextlib.contextmanager
def no_host_reads():
    """Every Tensor -> host conversion and data-dependent-size op raises inside the block."""
    saved = {name: getattr(torch.Tensor, name) for name in _CONVERSIONS}
    saved_fns = {name: getattr(torch, name) for name in ("nonzero", "masked_select", "unique", "argwhere")}

    def forbid(name):
        def raiser(*a, **k):
            raise AssertionError(f"host read on the hot path: Tensor.{name}")
        return raiser

    try:
        for name in _CONVERSIONS:
            setattr(torch.Tensor, name, forbid(name))
        for name in saved_fns:
            setattr(torch, name, forbid(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        for name, fn in saved_fns.items():
            setattr(torch, name, fn)


@pytest.fixture(autouse=True)
def clean_records():
    checks._RECORDS.clear()
    yield
    checks._RECORDS.clear()


def _inputs(n=29, h=16, v=300, ignored=(0, 3, 4, 17), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 0.4).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[list(ignored)] = IGNORE
    temp = torch.rand(n, generator=g) + 0.5
    return hidden, weight, labels, temp


def _run(hidden, weight, labels, **kw):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    out = areal_lce.linear_logprobs_entropy(h, w, labels, return_stats=True, **kw)
    loss = (out.logprobs * torch.linspace(-1, 1, labels.numel())).sum() + 0.3 * out.entropy.sum()
    loss.backward()
    return [t.detach() for t in out if t is not None] + [h.grad, w.grad]  # fields not asked for are None


def test_default_check_mode_per_device():
    assert checks.resolve_mode(True, torch.device("cpu")) == "sync"
    for dev in (torch.device("cuda"), torch.device("cuda:1"), torch.device("mps"), SimpleNamespace(type="npu")):
        assert checks.resolve_mode(True, dev) == "deferred"
    assert checks.resolve_mode(False, torch.device("cuda")) == "off"
    assert checks.resolve_mode("sync", torch.device("cuda")) == "sync"
    with pytest.raises(ValueError, match="check_labels"):
        checks.resolve_mode("yes", torch.device("cpu"))


CASES = {
    "scalar_t": dict(temperature=0.8),
    "tensor_t": dict(temperature=PER_TOKEN),
    "cache": dict(temperature=1.3, cache_bytes=1 << 30),  # a budget that holds the logits (auto keeps none at this H)
    "no_compact": dict(temperature=0.8, compact_ignored=False),
    "logit_sums": dict(temperature=PER_TOKEN, return_logit_sums=True),
}


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("case", list(CASES))
def test_accelerator_defaults_read_nothing_on_the_host(backend, case):
    hidden, weight, labels, temp = _inputs()
    kw = dict(CASES[case], backend=backend)
    if kw["temperature"] == PER_TOKEN:
        kw["temperature"] = temp
    with no_host_reads():
        got = _run(hidden, weight, labels, check_labels="deferred", **kw)
    eager = _run(hidden, weight, labels, check_labels="sync", **kw)  # the CPU default: checks at the call
    for a, b in zip(got, eager):
        assert torch.equal(a, b)
    checks.check_deferred()  # good labels: nothing recorded


def test_tensor_parallel_path_reads_nothing_on_the_host(fake_group):  # noqa: F811
    hidden, weight, labels, _ = _inputs(n=12, v=10, ignored=(1, 7))
    labels = labels % 20  # global ids over 2 shards of 10
    labels[[1, 7]] = IGNORE
    kw = dict(backend="torch", vocab_parallel=areal_lce.VocabParallel(fake_group), check_labels="deferred",
              temperature=0.9)
    first = _run(hidden, weight, labels, **kw)  # the shard-size agreement check syncs once per group
    with no_host_reads():
        again = _run(hidden, weight, labels, **kw)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_tensor_parallel_label_disagreement_deferred_and_sync(fake_group, monkeypatch):  # noqa: F811
    """Ranks passing different labels (here: the other rank's label fingerprint is larger, so the int64
    MAX of [key, -key] that the agreement check all-reduces comes back with key + 1): "deferred" reads
    nothing on the host, makes every logprob of the call NaN and check_deferred() names the
    disagreement; "sync" (the CPU default) raises at the call."""
    import torch.distributed as dist

    hidden, weight, labels, _ = _inputs(n=12, v=10, ignored=(1, 7))
    labels = labels % 20
    labels[[1, 7]] = IGNORE
    kw = dict(backend="torch", vocab_parallel=areal_lce.VocabParallel(fake_group), temperature=0.9)
    areal_lce.linear_logprobs_entropy(hidden, weight, labels, check_labels=False, **kw)  # one-time shard check
    record = dist.all_reduce

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        record(t, op=op, group=group, async_op=async_op)
        if t.dtype == torch.int64 and t.numel() == 2 and op == dist.ReduceOp.MAX:
            t[0] += 1
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with no_host_reads():
        out = areal_lce.linear_logprobs_entropy(hidden, weight, labels, check_labels="deferred", **kw)
    assert torch.isnan(out.logprobs).all()
    with pytest.raises(ValueError, match=r"labels differ across the tensor-parallel group: 1 call\(s\)"):
        areal_lce.check_deferred()
    areal_lce.check_deferred()  # read and reset
    with pytest.raises(ValueError, match="labels differ across the tensor-parallel group"):
        areal_lce.linear_logprobs_entropy(hidden, weight, labels, **kw)


class _StubKernel:
    """Stands for a @triton.jit kernel: launching it does nothing (the host code is what is checked)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def test_triton_launcher_reads_nothing_on_the_host(monkeypatch):
    if not interpreter_on():
        pytest.skip("the stubbed launcher runs on CPU tensors: only under TRITON_INTERPRET=1")
    from areal_lce.op.backends.triton import launch

    from areal_lce.op.backends.triton import value_check

    for name in ("lce_fwd_kernel", "lce_fwd_merge_kernel", "lce_bwd_kernel", "lce_bwd_label_kernel"):
        monkeypatch.setattr(launch, name, _StubKernel())
    monkeypatch.setattr(value_check, "check_labels_kernel", _StubKernel())
    hidden, weight, labels, temp = _inputs()
    for kw in (dict(temperature=temp), dict(temperature=0.7, cache_bytes=1 << 30)):
        with no_host_reads():
            _run(hidden, weight, labels, backend="triton", check_labels="deferred", **kw)


# ---- the pieces ----------------------------------------------------------------------------------

@pytest.mark.parametrize("ignored", [[], [0], [1, 2, 5], list(range(7)), [6]], ids=str)
def test_partition_rows(ignored):
    labels = torch.arange(7) + 10
    labels[ignored] = IGNORE
    part = partition_rows(labels, IGNORE)
    valid = [i for i in range(7) if i not in ignored]
    assert part.order.tolist() == valid + sorted(ignored)  # stable: valid rows first, then ignored
    assert torch.equal(part.order[part.dest], torch.arange(7)) and torch.equal(part.dest[part.order], torch.arange(7))
    assert part.n_valid.shape == (1,) and part.n_valid.item() == len(valid)
    assert part.live.tolist() == [j < len(valid) for j in range(7)]
    empty = partition_rows(torch.zeros(0, dtype=torch.int64), IGNORE)
    assert empty.order.numel() == 0 and empty.n_valid.tolist() == [0]


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("compact", [None, True], ids=["default", "compact"])
def test_nan_in_an_ignored_row(backend, compact):
    """A NaN (or Inf) hidden entry in an ignored row reaches no output and no d_hidden. With compaction
    (forced, or the default of a backend that does not skip ignored rows) the ignored tail is zero-filled
    before the backend, so d_weight is clean too; the triton backend's default keeps rows in place, and
    d_weight = d_logitsᵀ · hidden then gets 0 · NaN in the poisoned columns (as in any masked loss)."""
    hidden, weight, labels, _ = _inputs()
    clean = _run(hidden, weight, labels, backend=backend, temperature=0.9, compact_ignored=compact)
    poisoned = hidden.clone()
    poisoned[3, 1], poisoned[17, 0] = float("nan"), float("inf")  # rows 3 and 17 are ignored
    got = _run(poisoned, weight, labels, backend=backend, temperature=0.9, compact_ignored=compact)
    in_place = compact is None and get_backend(backend).skips_ignored_rows
    for a, b in zip(got[:-1], clean[:-1]):  # outputs and d_hidden
        assert torch.equal(a, b)
    if in_place:
        assert torch.isnan(got[-1][:, [0, 1]]).all() and torch.equal(got[-1][:, 2:], clean[-1][:, 2:])
    else:
        assert torch.equal(got[-1], clean[-1])


def test_deferred_check_names_the_bad_values():
    hidden, weight, labels, temp = _inputs(v=300)
    labels[5], labels[9], labels[11] = -5, 300, 1234
    out = areal_lce.linear_logprobs_entropy(hidden, weight, labels, backend="torch", check_labels="deferred")
    bad = torch.zeros(labels.shape, dtype=torch.bool)
    bad[[5, 9, 11]] = True
    assert torch.isnan(out.logprobs[bad]).all(), "rows with a bad label show NaN at once"
    off = areal_lce.linear_logprobs_entropy(hidden, weight, labels, backend="torch", check_labels=False)
    assert torch.equal(out.logprobs[~bad], off.logprobs[~bad]) and torch.equal(out.entropy, off.entropy)
    with pytest.raises(ValueError, match=r"labels: 3 value\(s\).*smallest: -5, largest: 1234.*vocab_size=300"):
        areal_lce.check_deferred()
    areal_lce.check_deferred()  # read and reset: nothing left
    temp[4] = 0.0
    good = _inputs(v=300)[2]
    areal_lce.linear_logprobs_entropy(hidden, weight, good, backend="torch", temperature=temp, check_labels="deferred")
    with pytest.raises(ValueError, match="temperature tensor: 1 value"):
        areal_lce.check_deferred()
    # the opt-in eager check raises at the call, naming the first bad value
    with pytest.raises(ValueError, match=r"labels: 3 value\(s\) outside \[0, vocab_size=300\).*first: -5"):
        areal_lce.linear_logprobs_entropy(hidden, weight, labels, backend="torch", check_labels="sync")


def test_triton_label_check_kernel_folds_the_same_record(monkeypatch):
    """The Triton backend's one-kernel deferred check (check_labels_kernel, 64-label programs here so the
    atomics combine several) leaves the same record and returns the same bad-row mask as the torch ops,
    over two calls (the record accumulates), with bad labels on both sides, ignore_index rows, and bad
    1/T values (0, negative, NaN, inf)."""
    dev = kernel_device()
    if dev is None:
        pytest.skip("no device runs the Triton kernels here")
    from areal_lce.op.backends.triton import configs, launch

    monkeypatch.setattr(configs, "CHECK_BLOCK", 64)
    g = torch.Generator().manual_seed(3)
    calls = []
    for n, bad_rows, t_bad in ((300, {7: -5, 64: 1000, 65: 2**40, 299: 999}, {3: 0.0, 200: float("nan")}),
                               (130, {0: -(2**35), 129: 1001}, {5: -1.0, 6: float("inf")}),
                               (77, {}, {})):
        y = torch.randint(0, 999, (n,), generator=g)
        y[torch.randint(0, n, (n // 4,), generator=g)] = IGNORE
        for i, v in bad_rows.items():
            y[i] = v
        inv_t = torch.rand(n, generator=g) + 0.5
        for i, v in t_bad.items():
            inv_t[i] = v
        calls.append((y.to(dev), inv_t.to(dev)))
    records = {}
    for name, fold in (("torch", None), ("triton", launch.TritonBackend().record_labels)):
        checks._RECORDS.pop(dev, None)
        masks = [checks.record(y, t, 999, IGNORE, fold=fold) for y, t in calls]
        masks.append(checks.record(calls[2][0], None, 999, IGNORE, fold=fold))  # without temperatures
        records[name] = (checks._RECORDS.pop(dev).tolist(), [m.cpu() for m in masks])
    rec, masks = records["triton"]
    assert rec == records["torch"][0] == [6, 2**35, 2**40, 4, 0], records
    for got, ref, (y, _) in zip(masks, records["torch"][1], calls + [calls[2]]):
        assert got.dtype == torch.bool and torch.equal(got, ref)
        assert torch.equal(got, checks.bad_labels(y.cpu(), 999, IGNORE))


@pytest.mark.parametrize("cache", [False, True], ids=["recompute", "cache"])
def test_triton_skips_ignored_rows_in_place(cache):
    """Backend level, rows not compacted: a row block whose rows are all ignored folds no vocab tile,
    ignored rows get d_hidden exactly 0 whatever their hidden / lse / entropy (NaN and Inf here), every
    d_logits row cuBLAS reads is written (the launcher's buffers start as NaN under the tests,
    tests/conftest.py, and would leak into d_weight), and the valid rows match the exact computation."""
    from areal_lce.op.backends import base

    assert base.POISON
    dev = kernel_device()
    if dev is None:
        pytest.skip("no device runs the Triton kernels here")
    from areal_lce.op.backends.reference import ReferenceBackend
    from areal_lce.op.backends.triton import configs
    from areal_lce.op.backends.triton.launch import TritonBackend
    from areal_lce.op.types import LCEParams

    bn = configs.tile("bwd", fp32=False, interpret=dev.type == "cpu", H=32).block_n
    n, h, v = 3 * bn + 5, 32, 300
    ignored = torch.zeros(n, dtype=torch.bool)
    ignored[[0, 3, bn - 1]] = True  # block 0 mixes both (a label at its last row too)
    ignored[bn:2 * bn] = True  # block 1: all ignored
    ignored[3 * bn + 2:] = True  # the ragged last block: 2 live rows, 3 ignored
    g = torch.Generator().manual_seed(0)
    hid = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) * 0.4
    y = torch.randint(0, v, (n,), generator=g)
    y[ignored] = IGNORE
    y[2 * bn + 1] = v - 1  # labels at the shard's edges in live rows
    y[2 * bn] = 0
    p = LCEParams(inv_t=1 / 0.8, vocab_size=v, shard_valid=v, backend=TritonBackend(),
                  cache_bytes=(1 << 30) if cache else 0)
    clean = hid.masked_fill(ignored[:, None], 0.0)
    poisoned = clean.clone()
    poisoned[ignored, :5] = float("nan")
    poisoned[3, 7] = float("inf")
    live = ~ignored
    be = TritonBackend()
    st = be.forward(poisoned.to(dev), w.to(dev), y.to(dev), None, p, keep_cache=True)
    assert (st.cache is not None) == cache
    # skipped rows keep the partials' initial values (s = 0, m = -inf), which the merge turns into NaN;
    # clean hidden rows that ran their GEMM would give a finite s
    st_clean = be.forward(clean.to(dev), w.to(dev), y.to(dev), None, p, keep_cache=True)
    s_clean = st_clean.s.cpu()
    assert torch.isnan(s_clean[bn:2 * bn]).all(), "an all-ignored block ran its GEMM"
    assert torch.isfinite(s_clean[[0, 3, bn - 1, 3 * bn + 4]]).all(), "ignored rows of a mixed block are computed"
    ref = ReferenceBackend().forward(clean.double(), w.double(), y, None, p, False)
    for k in ("m", "s", "a", "zy", "mn", "mx"):
        assert torch.allclose(getattr(st, k).cpu()[live].double(), getattr(ref, k)[live], rtol=1e-5, atol=1e-5), k
    lse = (ref.m + ref.s.log()).float()
    ent = (ref.s.log() - ref.a / ref.s).float()
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    g_lp[ignored], g_ent[ignored] = 0, 0  # the Function zeroes the ignored rows' upstream gradient
    lse_in, ent_in = lse.masked_fill(ignored, float("nan")), ent.masked_fill(ignored, float("inf"))
    dh, dw = be.backward(poisoned.to(dev), w.to(dev), y.to(dev), None, p, st.cache, lse_in.to(dev), ent_in.to(dev),
                         g_lp.to(dev), g_ent.to(dev), True, True)
    _, dw_clean = be.backward(clean.to(dev), w.to(dev), y.to(dev), None, p, st_clean.cache, lse.to(dev), ent.to(dev),
                                     g_lp.to(dev), g_ent.to(dev), True, True)
    rh, rw = ReferenceBackend().backward(clean.double(), w.double(), y, None, p, None, lse.double(), ent.double(),
                                         g_lp.double(), g_ent.double(), True, True)
    dh = dh.cpu()
    assert torch.equal(dh[ignored], torch.zeros_like(dh[ignored])) and torch.isfinite(dh).all()
    assert torch.allclose(dh.double(), rh, rtol=1e-4, atol=1e-5)
    assert torch.allclose(dw_clean.cpu().double(), rw, rtol=1e-4, atol=1e-5)
    # d_weight = d_logitsᵀ · hidden: an ignored row adds 0 · hidden, which is NaN where hidden is not
    # finite (as in any masked loss): the columns of a poisoned hidden entry, and only those
    bad_cols = ~torch.isfinite(poisoned).all(0)
    assert torch.isnan(dw).any(0).cpu().tolist() == bad_cols.tolist() == [k < 5 or k == 7 for k in range(h)]
    assert torch.equal(dw[:, ~bad_cols.to(dev)], dw_clean[:, ~bad_cols.to(dev)])


@pytest.mark.parametrize("agg", ["token-mean", "sequence-mean-token-mean"])
def test_job_losses_read_nothing_on_the_host(agg):
    """The SFT and RL jobs' loss_fn, on a micro-batch already on the device (train_step stages it there),
    read no device value on the host: the engine's step issues the backward without waiting for the
    forward. Their records reach the host later, once per step (SFTLoss.sums)."""
    from areal_lce.megatron.stats import TokenStats
    from areal_lce.train.losses import SFTLoss
    from areal_lce.train.rl_config import RLConfig
    from areal_lce.train.rl_losses import PolicyMicroBatch, rl_loss

    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 50, (3, 7), generator=g)
    labels[0, 4:] = IGNORE
    labels[2] = IGNORE  # a row without targets
    lp = (-torch.rand(3, 7, generator=g)).requires_grad_()
    stats = TokenStats(lp, torch.rand(3, 7, generator=g), torch.rand(3, 7, generator=g), -torch.rand(3, 7, generator=g))
    mb = PolicyMicroBatch(labels, labels, old_logprobs=lp.detach() - 0.1, advantages=torch.randn(3, generator=g),
                          ref_logprobs=lp.detach() + 0.05)
    sft = SFTLoss(denom=9.0)
    cfg = RLConfig(kl_coef=0.1, entropy_coef=0.01, loss_agg=agg)
    with no_host_reads():
        loss_sft, _ = sft(stats, mb)
        loss_rl, metrics = rl_loss(stats, mb, cfg)
        (loss_sft + loss_rl).backward()
    mask = labels != IGNORE
    totals = sft.sums()
    assert totals["tokens"] == int(mask.sum()) and isinstance(totals["tokens"], int)
    assert totals["nll"] == pytest.approx(float(-(lp.detach() * mask).sum()))
    assert torch.isfinite(lp.grad).all() and all(torch.isfinite(torch.as_tensor(v)).all() for v in metrics.values())
