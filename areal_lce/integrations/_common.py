"""What both adapters share: token rows and their labels, label values under contracts without an
ignore_index, the options forwarded to the op, and reversible module patches."""
from __future__ import annotations

import importlib

import torch

from ..op import checks
from .. import patching
from ..op.options import LCEOptions

_HANDLES: dict = {}  # (module name, attribute) -> the areal_lce.patching handle that remove() restores
_RESERVED = ("vocab_parallel", "tp_group", "sequence_parallel", "reduce_d_hidden", "temperature",
             "return_stats", "return_logit_sums", "vocab_size", "ignore_index")
# The op's ignore_index under the frameworks' contracts, which have none: a value no label takes (int64's
# smallest), so that every negative label, -100 included, is a bad label to the op's checks instead of an
# ignored row that silently scores 0.
NO_IGNORE_INDEX = -(2 ** 63)


# The options of the building blocks of slime's and miles' log-prob steps (`calculate_log_probs_and_entropy`):
# the step passes them on to the block, which fixes the op's contract from them.
BLOCK_OPTIONS = ("vocab_size", "logits_precision", "invariant", "check_labels")


def check_op_options(options: dict, adapter: str, block: tuple = ()) -> None:
    """Options forwarded to `linear_logprobs_entropy` may tune it (backend, cache_bytes, compact_ignored)
    but not change the framework's contract, which the adapter fixes; `block`: names the adapter takes for
    itself (BLOCK_OPTIONS), passed through. A name that is no LCEOptions field is refused here, once."""
    bad = sorted(set(options) & set(_RESERVED))
    if bad:
        raise TypeError(f"{adapter}: {bad} are set by the adapter from the framework's own arguments")
    LCEOptions.of(None, {k: v for k, v in options.items() if k not in block}, adapter)


def op_value(op_options: dict, adapter: str, temperature) -> LCEOptions:
    """The op's options of one adapter call as one LCEOptions, each checked once here (errors name
    `adapter`): the caller's tuning options and the framework's scalar temperature."""
    return LCEOptions.of(None, {**op_options, "temperature": temperature}, adapter)


def consistency_options(invariant, logits_precision, adapter: str) -> dict:
    """The op's `invariant` and `logits_precision`, type-checked here and passed on unchanged (the op
    validates the values)."""
    if invariant is not None and not isinstance(invariant, bool):
        raise TypeError(f"{adapter}: invariant must be None, True or False, got {invariant!r}")
    if not isinstance(logits_precision, str):
        raise TypeError(f"{adapter}: logits_precision must be a str ('fp32' or 'bf16'), got {logits_precision!r}")
    return dict(invariant=invariant, logits_precision=logits_precision)


def _squeezed(shape) -> tuple:
    return tuple(d for d in shape if d != 1)


def token_rows(hidden: torch.Tensor, labels: torch.Tensor, adapter: str, seq_factor: int = 1):
    """hidden [s, ..., H] -> [rows, H] and labels -> [rows · seq_factor], row for row. labels must have
    hidden's leading shape (the first dimension times seq_factor: the full sequence under sequence
    parallelism) up to size-1 dimensions, so that flattening pairs each label with its own row: the
    frameworks pass [T, 1, H] hidden with [1, T], [T, 1] or [T] labels, and [B, S, H] with [B, S]. A
    layout with the right element count but another order ([S, B] for [B, S, H]) is refused."""
    if not torch.is_tensor(hidden) or hidden.dim() < 2:
        raise ValueError(f"{adapter}: hidden must be a tensor [..., H], got {tuple(getattr(hidden, 'shape', ()))}")
    if not torch.is_tensor(labels):
        raise TypeError(f"{adapter}: labels must be an integer tensor, got {type(labels).__name__}")
    lead = tuple(hidden.shape[:-1])
    expected = (lead[0] * seq_factor,) + lead[1:]
    if _squeezed(labels.shape) != _squeezed(expected):
        under_sp = f" (hidden's first dim × {seq_factor}: the full sequence under sequence parallel)" \
            if seq_factor > 1 else ""
        raise ValueError(f"{adapter}: labels {tuple(labels.shape)} must have hidden's leading shape "
                         f"{expected}{under_sp}, size-1 dimensions aside; hidden {tuple(hidden.shape)}. Labels "
                         "are paired with hidden's rows in order, so another layout of the same tokens (e.g. "
                         "[S, B] labels for [B, S, H] hidden) would pair them wrongly")
    return hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)


def check_no_negative_labels(y: torch.Tensor, check_labels, tp: int, adapter: str) -> None:
    """The frameworks' contracts have no ignore_index, so the op runs with NO_IGNORE_INDEX: a negative label
    is a bad label like any out-of-range one (check_labels "sync", or True on CPU: the op raises on every
    rank; "deferred", True on accelerators: NaN logprob and check_deferred() raises). Without tensor
    parallelism, "sync" raises here first, saying why -100 is refused; under TP the op's check raises
    (it runs on every rank in step, where an error raised here on some ranks only could leave the others
    waiting in a collective)."""
    if tp > 1 or checks.resolve_mode(check_labels, y.device) != "sync":
        return
    negative = y < 0
    n = int(negative.sum())  # the host sync "sync" asks for
    if n:
        raise ValueError(f"{adapter}: labels hold {n} negative value(s) (first: {int(y[negative][0])}); the "
                         "framework's contract has no ignore_index (-100 is not skipped): pass token ids in "
                         "[0, vocab) and mask the tokens you do not want in the loss instead")


def _module_with(module_name: str, attr: str):
    mod = importlib.import_module(module_name)
    if not hasattr(mod, attr):
        raise RuntimeError(f"{module_name} has no attribute {attr!r}: this version of the framework does not "
                           "look its LM-head function up there; see docs/integrations.md")
    return mod


def patch(module_name: str, attr: str, new) -> str:
    """Set module.attr = new (areal_lce.patching), remembering the framework's original once: patching
    again replaces the replacement, and `restore` puts the original back. Raises if the attribute is not
    there (the framework moved it: the patch would silently do nothing)."""
    return patch_all([module_name], attr, new)[0]


def restore(module_name: str, attr: str) -> bool:
    """Put the framework's original back; False if it is not patched here."""
    handle = _HANDLES.pop((module_name, attr), None)
    return handle is not None and handle.restore()


def patch_all(module_names, attr: str, new) -> list:
    """`patch` in every module of `module_names`, none or all: every module is imported and checked before
    any is patched, and on a failure the patches of this call are undone (earlier ones stay)."""
    names = list(module_names)
    targets = [_module_with(name, attr) for name in names]
    handles = []
    try:
        for mod in targets:
            handles.append(patching.apply(patching.Patch(mod, attr, new)))
    except BaseException:
        for handle in reversed(handles):
            handle.restore()
        raise
    for name, handle in zip(names, handles):
        previous = _HANDLES.pop((name, attr), None)
        if previous is not None:  # this call's patch is on top: dropping the older one keeps it in place
            previous.restore()
        _HANDLES[(name, attr)] = handle
    return [f"{name}.{attr}" for name in names]


def restore_all(module_names, attr: str) -> list:
    """`restore` in every module of `module_names`; returns the restored names."""
    return [f"{name}.{attr}" for name in module_names if restore(name, attr)]
