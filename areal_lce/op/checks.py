"""Validation of label and temperature *values*: now (one host sync) or deferred (no sync).

Shapes, dtypes and options are checked in api.py from metadata alone. Values live on the device, and
reading one on the host stalls the stream and breaks CUDA-graph capture, so the op offers three modes
(`check_labels=` of `linear_logprobs_entropy`, resolved by `resolve_mode`):

  "sync"      `check_now`: one reduction, one host sync, a ValueError at the call naming the first
              bad label. The default for CPU tensors (the host is the device: no stream to stall).
  "deferred"  `record`: one kernel (the Triton backend's `record_labels`; a dozen [N] torch ops on the
              other backends) folds the bad labels of the call into a per-device record
              (count, smallest and largest bad value, count of bad temperatures); no host sync, so the
              call can be captured in a CUDA graph or compiled. The rows with a bad label get
              logprob = NaN, so a loss over them shows it at once. `check_deferred()` reads every
              record (one sync per device), resets it and raises the ValueError naming the values.
              The default on accelerators; the Megatron engine calls `check_deferred()` once per
              training step, where it already syncs to read the loss.
  "off"       no check: a label outside the vocabulary is owned by no shard, so logprob = -lse.

Under tensor parallelism both checking modes also compare the ranks' labels (their values, their
ignore_index pattern) and vocab shard sizes through a fingerprint (`tp_key`) whose [max, -min] over the
group the caller all-reduces on the device (function.py, comms.agreement_votes): "sync" reads the votes
in its one host sync and raises on every rank; "deferred" counts the disagreeing call in the record and
makes every logprob of the call NaN.
"""
from __future__ import annotations

import warnings

import numbers
from typing import Callable, Dict, Optional, Tuple

import torch

from . import exact

MODES = ("sync", "deferred", "off")
_BIG = torch.iinfo(torch.int64).max
# device -> int64 [5]: (bad labels, -(smallest bad label), largest bad label, bad temperatures,
# tensor-parallel calls whose ranks disagreed)
_RECORDS: Dict[torch.device, torch.Tensor] = {}
_CONTEXT: Dict[torch.device, Tuple[int, int]] = {}  # device -> (vocab_size, ignore_index) of the last record
# (device, message) -> int64 count of calls whose ranks disagreed (record_disagreement), read by check_deferred
_DISAGREEMENTS: Dict[Tuple[torch.device, str], torch.Tensor] = {}


def resolve_mode(check_labels, device: torch.device) -> str:
    """check_labels argument -> one of MODES. True: "sync" on CPU tensors, "deferred" elsewhere."""
    if check_labels is True:
        return "sync" if device.type == "cpu" else "deferred"
    if check_labels is False:
        return "off"
    if check_labels in ("sync", "deferred"):
        return check_labels
    raise ValueError(f"check_labels={check_labels!r}: expected True (sync on CPU, deferred on accelerators), "
                     "False, 'sync' or 'deferred'")


def bad_labels(y: torch.Tensor, vocab_size: int, ignore_index: int) -> torch.Tensor:
    """[N] bool: labels outside [0, vocab_size) that are not ignore_index."""
    return (y.clamp(0, vocab_size - 1) != y) & (y != ignore_index)


def bad_temperatures(inv_t: torch.Tensor) -> torch.Tensor:
    """[N] bool: 1/T not in (0, inf), i.e. T not finite and > 0 (NaN included)."""
    return ~((inv_t > 0) & (inv_t < float("inf")))


def tp_key(y: torch.Tensor, ignore_index: int, v_shard: int) -> torch.Tensor:
    """int64 fingerprint of (labels, their ignore pattern, the shard size): equal on the TP ranks when they
    agree. Σ (y'+2)·(i mod 1021 + 1) with y' = labels clamped to [-1, 2^24] (-1 at ignore_index): < 2^62
    below 2^28 labels, so no overflow."""
    i = torch.arange(y.numel(), device=y.device)
    yy = torch.where(y == ignore_index, -1, y.clamp(-1, 1 << 24)) + 2
    return (yy * (i % 1021 + 1)).sum() + (v_shard * 1_000_003 + y.numel() * 999_983)


def _disagree(votes: torch.Tensor) -> torch.Tensor:
    """0-d bool: the ranks' fingerprints differ (votes = [max, -min] of tp_key over the group)."""
    return votes[0] != -votes[1]


def check_now(y: torch.Tensor, inv_t: Optional[torch.Tensor], vocab_size: int, ignore_index: int,
              votes: Optional[torch.Tensor] = None, on_disagreement: Optional[Callable[[], None]] = None) -> None:
    """Raise ValueError on a bad label or temperature value (one reduction and one host sync). Under TP,
    `votes` (the all-reduced tp_key) are read in the same sync; when the ranks disagree, `on_disagreement`
    runs first (every rank sees the same votes, so every rank takes that branch together) and must raise."""
    bad = bad_labels(y, vocab_size, ignore_index)
    checks = [bad.sum(), bad_temperatures(inv_t).sum() if inv_t is not None else bad.new_zeros((), dtype=torch.int64)]
    if votes is not None:
        checks.append(_disagree(votes).to(torch.int64))
    counts = torch.stack(checks).tolist()  # the one host sync of the checks
    if votes is not None and counts[2]:
        on_disagreement()
    if counts[0]:
        first = int(y[bad][0])
        raise ValueError(f"labels: {counts[0]} value(s) outside [0, vocab_size={vocab_size}) and not "
                         f"ignore_index={ignore_index} (first: {first})")
    if counts[1]:
        raise ValueError("temperature tensor has values that are not finite and > 0 (or so small that "
                         "1/temperature overflows fp32)")


def _record_of(device: torch.device) -> torch.Tensor:
    rec = _RECORDS.get(device)
    if rec is None:  # first deferred call on this device; device kernels only (capturable), no host copy
        rec = torch.zeros(5, dtype=torch.int64, device=device)
        _reset(rec)
        _RECORDS[device] = rec
    return rec


def _reset(rec: torch.Tensor) -> None:
    rec.zero_()
    rec[1:3].fill_(-_BIG)


def record(y: torch.Tensor, inv_t: Optional[torch.Tensor], vocab_size: int, ignore_index: int,
           votes: Optional[torch.Tensor] = None, fold: Optional[Callable] = None) -> torch.Tensor:
    """Fold this call's bad labels and temperatures (and, under TP, whether the ranks' `votes` disagree)
    into the device's record, without a host sync. Returns the [N] mask of rows whose logprob the caller
    sets to NaN: the bad labels, or every row when the ranks disagree. `fold(y, inv_t, vocab_size,
    ignore_index, rec) -> bad`: a backend's one-kernel version of the fold below (the same record)."""
    rec = _record_of(y.device)
    if fold is not None and y.numel():
        bad = fold(y, inv_t, vocab_size, ignore_index, rec)
    else:
        bad = bad_labels(y, vocab_size, ignore_index)
        if y.numel():
            n_bad_t = bad_temperatures(inv_t).sum() if inv_t is not None else bad.new_zeros((), dtype=torch.int64)
            rec[0::3].add_(torch.stack([bad.sum(), n_bad_t]))  # counts (slots 0 and 3)
            extremes = torch.stack([-torch.where(bad, y, _BIG).amin(), torch.where(bad, y, -_BIG).amax()])
            rec[1:3].copy_(torch.maximum(rec[1:3], extremes))  # -(smallest), largest
    if y.numel():
        _CONTEXT[y.device] = (vocab_size, ignore_index)
    if votes is not None:
        disagree = _disagree(votes)
        rec[4:].add_(disagree.to(torch.int64))
        bad = bad | disagree
    return bad


def record_disagreement(votes: torch.Tensor, message: str) -> torch.Tensor:
    """Count, without a host sync, a call whose ranks disagreed (`votes`: comms.agreement_votes of a key,
    [max, -min] over the group, on the device); `check_deferred` then raises ValueError(message). Returns
    the 0-d bool "the ranks disagree", for the caller to poison its output with."""
    disagree = _disagree(votes).any()
    count = _DISAGREEMENTS.get((votes.device, message))
    if count is None:
        count = _DISAGREEMENTS[(votes.device, message)] = torch.zeros((), dtype=torch.int64, device=votes.device)
    count.add_(disagree.to(torch.int64))
    return disagree


def check_deferred() -> None:
    """Raise ValueError if a call with deferred checks saw a bad label or temperature, or (under tensor
    parallelism) ranks passing different labels, since the last check, or a `record_disagreement` counted
    one. Reads each device's record (one host sync per device that has one) and resets it."""
    for (device, message), count in list(_DISAGREEMENTS.items()):
        n = int(count)  # the deferred sync
        if n:
            count.zero_()
            raise ValueError(f"{message} ({n} call(s) on {device} since the last check)")
    for device, rec in list(_RECORDS.items()):
        n_bad, neg_lo, hi, n_bad_t, n_disagree = rec.tolist()  # the deferred sync
        if not (n_bad or n_bad_t or n_disagree):
            continue
        _reset(rec)
        vocab_size, ignore_index = _CONTEXT.get(device, ("?", "?"))
        if n_disagree:
            raise ValueError(f"labels differ across the tensor-parallel group: {n_disagree} call(s) of "
                             f"linear_logprobs_entropy on {device} since the last check got different labels, "
                             "ignore_index rows or weight shard sizes on different ranks (their logprobs are "
                             "NaN): every rank must pass an equal-sized vocab shard and the same global labels")
        if n_bad:
            raise ValueError(f"labels: {n_bad} value(s) outside [0, vocab_size) and not ignore_index were "
                             f"passed to linear_logprobs_entropy on {device} since the last check (smallest: "
                             f"{-neg_lo}, largest: {hi}; last call: vocab_size={vocab_size}, "
                             f"ignore_index={ignore_index}); their logprobs are NaN")
        raise ValueError(f"temperature tensor: {n_bad_t} value(s) that are not finite and > 0 were passed to "
                         f"linear_logprobs_entropy on {device} since the last check")


def check_temperature(temperature, what: str = "temperature", allow_tensor: bool = True, shape=None):
    """The one temperature rule, called by every entry point (the op, the materialised route, `token_stats`
    and the capture seam, the engine's batches, the RL config, the sampler, the HF patch, the adapters):
    a Python number (not a bool) that is finite and > 0 and whose inverse fits fp32, or (allow_tensor) a
    floating-point tensor, broadcast to `shape` (the labels') when given; a tensor's *values* (finite,
    > 0) are checked on the device with the labels (`check_now` / `record`: one sync or deferred).
    Returns the float, or the tensor (a broadcast view when `shape` is given). Errors name `what`: a
    TypeError for a wrong type, a ValueError for a value out of range or a shape that does not broadcast."""
    if torch.is_tensor(temperature):
        if not allow_tensor:
            raise TypeError(f"{what} must be a float, got a tensor")
        if temperature.is_complex() or not temperature.is_floating_point():
            raise TypeError(f"{what} tensor must be floating point, got {temperature.dtype}")
        if shape is None:
            return temperature
        try:
            return torch.broadcast_to(temperature, tuple(shape))
        except RuntimeError as e:
            raise ValueError(f"{what} of shape {tuple(temperature.shape)} does not broadcast to labels "
                             f"{tuple(shape)} (per token, per row [b, 1], or a float)") from e
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"{what} must be a float{' or a tensor' if allow_tensor else ''}, got {temperature!r}")
    t = float(temperature)
    if not t > 0 or t == float("inf"):
        raise ValueError(f"{what} must be a finite float > 0, got {temperature}")
    if 1.0 / t > torch.finfo(torch.float32).max:
        raise ValueError(f"{what}={temperature} is too small: 1/temperature overflows fp32 (the logits are "
                         "scaled by it in fp32)")
    return t


def check_sampling_temperature(temperature, what: str = "temperature") -> float:
    """A sampler's temperature: exactly 0 means greedy (argmax), the one extension of `check_temperature`'s
    rule, which every other value must pass (a float, finite and > 0). Returns a float."""
    if not isinstance(temperature, bool) and isinstance(temperature, numbers.Real) and temperature == 0:
        return 0.0
    return check_temperature(temperature, f"{what} (0: greedy)", allow_tensor=False)


def inv_temperature(temperature, labels: torch.Tensor) -> tuple[Optional[float], Optional[torch.Tensor]]:
    """(inv_t float, None) for a scalar temperature, (None, inv_t [N] fp32) for a tensor broadcastable to
    `labels` (N = labels.numel()). The op and the materialised route scale logits by inv_t = 1/T."""
    checked = check_temperature(temperature, shape=labels.shape)
    if not torch.is_tensor(checked):
        return 1.0 / checked, None
    t = torch.broadcast_to(temperature.detach().to(labels.device, torch.float32), labels.shape)
    return None, (1.0 / t).reshape(-1).contiguous()


# invariant=None resolves per backend: on where the backend implements the contract at no measured cost
# (docs/op.md "Consistency"), off for the fp64 checking path and the materialised reference
INVARIANT_DEFAULT = {"triton": True, "torch": True, "reference": False, "triton_ascend": False}
LOGITS_PRECISIONS = ("fp32", "bf16")


def resolve_invariant(invariant, name: str, dtype: torch.dtype) -> bool:
    """The invariance option of one call on backend `name` (None: that backend's default)."""
    if invariant is not None and not isinstance(invariant, bool):
        raise TypeError(f"invariant must be None, True or False, got {invariant!r}")
    if invariant is None:
        return INVARIANT_DEFAULT.get(name, False) and dtype != torch.float64
    if invariant and name == "triton_ascend":
        raise ValueError("invariant=True is not implemented by the triton_ascend backend: pass invariant=None "
                         "or False there (its results are deterministic, not batch-invariant)")
    if invariant and dtype == torch.float64:
        raise ValueError("invariant=True takes bf16 / fp16 / fp32 inputs (its segment partials are fp32); "
                         "fp64 inputs are for checking: pass invariant=None or False")
    return invariant


def check_logits_precision(logits_precision) -> str:
    if logits_precision not in LOGITS_PRECISIONS:
        raise ValueError(f"logits_precision must be one of {LOGITS_PRECISIONS}, got {logits_precision!r}")
    return logits_precision


def check_invariant_layout(v_shard: int, tp: int, vocab_size: int, asked: bool = True) -> bool:
    """Invariant mode's segments must tile every shard: shard starts at multiples of exact.SEG. Where they
    do not, invariant=True raises; the default (invariant=None) warns once and runs the online merge."""
    if tp > 1 and v_shard % exact.SEG:
        if not asked:
            _warn_layout_once(v_shard, tp)
            return False
        raise ValueError(f"invariant=True needs every vocab shard to start at a multiple of {exact.SEG} global ids, "
                         f"but the shards hold {v_shard} rows each (tp={tp}): pad the vocabulary to a multiple "
                         f"of {exact.SEG}·tp (megatron's make_vocab_size_divisible_by={exact.SEG} or a multiple "
                         "of it does), or pass invariant=False")
    if vocab_size >= exact.MAX_VOCAB:
        if not asked:
            return False
        raise ValueError(f"invariant=True supports vocab_size < {exact.MAX_VOCAB}, got {vocab_size}")
    return True


_WARNED_LAYOUTS = set()


@torch.compiler.assume_constant_result  # run while torch.compile traces (a warning is no graph break)
def _warn_layout_once(v_shard: int, tp: int) -> bool:
    if (v_shard, tp) in _WARNED_LAYOUTS:
        return False
    _WARNED_LAYOUTS.add((v_shard, tp))
    warnings.warn(f"areal_lce: vocab shards of {v_shard} rows (tp={tp}) do not start at multiples of {exact.SEG} "
                  "global ids, so the default invariant mode is off for these calls (logprobs may change with "
                  f"the batch and the TP degree); pad the vocabulary to a multiple of {exact.SEG}·tp, or pass "
                  "invariant=False to silence this", RuntimeWarning, stacklevel=4)
    return True
