"""What both adapters share: flattening hidden/labels to token rows, and reversible module patches."""
from __future__ import annotations

import importlib
import math

import torch

_ORIGINALS: dict = {}  # (module name, attribute) -> the framework's own function, kept for remove()
_RESERVED = ("vocab_parallel", "tp_group", "sequence_parallel", "reduce_d_hidden", "temperature",
             "return_stats", "return_logit_sums", "vocab_size")


def check_op_options(options: dict, adapter: str) -> None:
    """Options forwarded to `linear_logprobs_entropy` may tune it (backend, cache_bytes, check_labels,
    compact_ignored) but not change the framework's contract, which the adapter fixes."""
    bad = sorted(set(options) & set(_RESERVED))
    if bad:
        raise TypeError(f"{adapter}: {bad} are set by the adapter from the framework's own arguments")


def token_rows(hidden: torch.Tensor, labels: torch.Tensor, rows_per_label: int, adapter: str):
    """hidden [..., H] -> [rows, H] and labels [...] -> [rows · rows_per_label]: the frameworks pass
    [T, 1, H] hidden with [1, T] or [T, 1] labels, which only agree once flattened."""
    if not torch.is_tensor(hidden) or hidden.dim() < 2:
        raise ValueError(f"{adapter}: hidden must be a tensor [..., H], got {tuple(getattr(hidden, 'shape', ()))}")
    h2 = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    if y.numel() != h2.shape[0] * rows_per_label:
        what = f"{h2.shape[0]} hidden rows"
        if rows_per_label > 1:
            what += f" × {rows_per_label} (sequence parallel)"
        raise ValueError(f"{adapter}: labels {tuple(labels.shape)} hold {y.numel()} tokens, hidden "
                         f"{tuple(hidden.shape)} gives {what}")
    return h2, y


def positive_float(value, name: str, adapter: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{adapter}: {name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{adapter}: {name} must be finite and > 0, got {value}")
    return value


def patch(module_name: str, attr: str, new) -> str:
    """Set module.attr = new, remembering the framework's original once. Raises if the attribute is not
    there (the framework moved it: the patch would silently do nothing)."""
    mod = importlib.import_module(module_name)
    if not hasattr(mod, attr):
        raise RuntimeError(f"{module_name} has no attribute {attr!r}: this version of the framework does not "
                           "look its LM-head function up there; see docs/integrations.md")
    _ORIGINALS.setdefault((module_name, attr), getattr(mod, attr))
    setattr(mod, attr, new)
    return f"{module_name}.{attr}"


def restore(module_name: str, attr: str) -> bool:
    """Put the framework's original back; False if it was never patched here."""
    original = _ORIGINALS.pop((module_name, attr), None)
    if original is None:
        return False
    setattr(importlib.import_module(module_name), attr, original)
    return True
