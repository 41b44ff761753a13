"""The fused op's options, declared once: `LCEOptions`, a frozen value with each option's default, check and
help text in its field.

    opts = LCEOptions(backend="torch", return_stats=True)
    out = linear_logprobs_entropy(hidden, weight, labels, opts)              # the value
    out = linear_logprobs_entropy(hidden, weight, labels, opts, top_k=4)     # the value, one field changed
    out = linear_logprobs_entropy(hidden, weight, labels, backend="torch")  # keywords: LCEOptions' fields

Options are what a caller chooses once and reuses across calls; call inputs are what each call brings. The
call inputs of `linear_logprobs_entropy` are not fields here: hidden, weight, labels, selected_ids (tensors
shaped by the call), a per-token temperature tensor (`temperature` here is the scalar one), and
`vocab_parallel` (a process group, per rank and not a plain value). `LCEParams` (types.py) is a different
thing: the options *resolved* for one call against its tensors and device (backend instance, cache budget
in bytes, this shard's vocabulary range), built by `api.prepare_call`.

Every value is checked once, where it enters: at construction, and by `replace` for the fields it changes
(the unchanged ones were checked when the value was built). Errors name the option, with `where`'s prefix
for a group built from these fields (`group`: the engine's YAML group `engine.lce`).
"""
from __future__ import annotations

import dataclasses
import numbers
import typing
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from .backends import BACKENDS
from .checks import LOGITS_PRECISIONS, check_temperature

MAX_TOP_K = 1024  # the top-k recomputes k segments of 128 ids per row
LABEL_CHECKS = (True, False, "sync", "deferred")


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _expect(ok: bool, what: str, exc=ValueError):
    """None when ok, else (exception type, what was expected)."""
    return None if ok else (exc, what)


def _check_bool(v):
    return _expect(isinstance(v, bool), "True or False", TypeError)


def _check_optional_bool(v):
    return _expect(v is None or isinstance(v, bool), "None, True or False", TypeError)


def _check_temperature(v, name):
    return check_temperature(v, name, allow_tensor=False)  # the one temperature rule (checks.py); its own errors


def _check_cache_bytes(v):
    return _expect(v == "auto" if isinstance(v, str) else _is_int(v) and v >= 0, "an int >= 0 or 'auto'")


def _check_vocab_size(v):
    if v is None:
        return None
    return _expect(_is_int(v), "None or an int > 0", TypeError) or _expect(v > 0, "None or an int > 0")


def _check_softcap(v):
    ok = v is None or (isinstance(v, numbers.Real) and not isinstance(v, bool) and (v == 0 or 0 < v < float("inf")))
    return _expect(ok, "None or a finite float > 0 (logits -> softcap·tanh(logits/softcap))")


def _option(default, check: Callable, help: str):
    """A field of LCEOptions: its default, its check (value -> None, or (exception type, what is expected))
    and its help text (the YAML reference and docs/op.md print it)."""
    return field(default=default, metadata={"help": help, "check": check})


@dataclass(frozen=True)
class LCEOptions:
    """The options of `linear_logprobs_entropy` (module docstring: what is an option, what a call input)."""

    temperature: float = _option(1.0, _check_temperature, (
        "softmax temperature T > 0 (finite, 1/T representable in fp32): logits z = h·Wᵀ / T; not differentiated. "
        "A per-token temperature is a call input (a tensor broadcastable to labels), not this option"))
    ignore_index: int = _option(-100, lambda v: _expect(_is_int(v), "an int (e.g. -100)", TypeError), (
        "rows with this label get logprob = entropy = stats = 0 and exactly zero gradient, with no host count of "
        "them. A NaN / Inf in such a row's hidden reaches no output and no d_hidden; it reaches d_weight (as "
        "0 · NaN) unless the rows are partitioned (compact_ignored)"))
    vocab_size: Optional[int] = _option(None, _check_vocab_size, (
        "the true (global) vocabulary; weight rows at global ids >= vocab_size are padding, excluded from the "
        "softmax (as if their logits were -inf). None: every row is real"))
    return_stats: bool = _option(False, _check_bool, (
        "also return max_logit, min_logit (raw, before temperature) and lse (tempered, differentiable)"))
    return_logit_sums: bool = _option(False, _check_bool, (
        "also return sum_logit = Σ_j r_j and sumsq_logit = Σ_j r_j² of the raw logits r = h·W_jᵀ over the "
        "true vocabulary (row mean sum_logit / vocab_size, L2 norm sqrt(sumsq_logit)), accumulated in the "
        "forward's own pass and merged in its existing SUM (no extra collective); two reductions per logit"))
    backend: str = _option("auto", lambda v: _expect(v == "auto" or v in BACKENDS, f"one of {('auto',) + BACKENDS}"), (
        "auto | triton | triton_ascend | torch | reference (docs/backends.md). auto: the AREAL_LCE_BACKEND "
        "environment variable, else triton on CUDA, triton_ascend on NPU, torch elsewhere"))
    cache_bytes: Union[int, str] = _option(0, _check_cache_bytes, (
        "logits-cache budget in bytes: when this rank's fp32 logits (4·N·V_shard bytes) fit it, the forward "
        "keeps them and the backward skips the recompute GEMM. 0: always recompute. 'auto': 6 GiB when the "
        "hidden size is >= 2048, else 0, chosen from the shapes alone (docs/op.md, Logits cache)"))
    check_labels: Union[bool, str] = _option(True, lambda v: _expect(
        any(v is c if isinstance(c, bool) else v == c for c in LABEL_CHECKS),
        "True (sync on CPU, deferred on accelerators), False, 'sync' or 'deferred'"), (
        "validate label values (outside [0, vocab_size) and not ignore_index) and per-token temperatures (not "
        "finite and > 0). True: 'sync' on CPU tensors, 'deferred' on accelerators. 'sync': raise at the call "
        "(one reduction and a host sync). 'deferred': no host sync; bad rows get logprob NaN and "
        "areal_lce.check_deferred() raises naming the values. False: off. Under vocab_parallel it also checks "
        "that every rank passes the same labels (ignore pattern included) and shard size, with one all-reduce of "
        "2 int64 per call and no further host sync: 'sync' raises on every rank at the call, 'deferred' makes "
        "every logprob of the call NaN and check_deferred() names the disagreement; off: the shard size is "
        "checked once per group only"))
    compact_ignored: Optional[bool] = _option(None, _check_optional_bool, (
        "how ignored rows are kept out of the work. None: the backend's choice: triton skips them in its "
        "kernels with no copy (a block of 128 rows that are all ignored runs no GEMM; ignored rows in a mixed "
        "block are computed and their gradient zeroed); the other backends partition the rows on the device, "
        "valid ones first, into a copy of hidden whose ignored tail is zeroed. True: always partition (triton "
        "then skips the whole tail: worth a copy of hidden when ignored rows are many and scattered); False: "
        "rows in place"))
    invariant: Optional[bool] = _option(None, _check_optional_bool, (
        "True: each token's logprob, entropy, max / min logit, lse and logit sums are bitwise identical "
        "whatever else is in the call (row count, order, ignored neighbours, padding rows, tensor-parallel "
        "degree with shards at multiples of 128 ids, SP on or off) for a fixed weight, temperature, "
        "vocab_size, logits_precision and backend (docs/op.md, Consistency). None: on for the triton and torch "
        "backends with bf16 / fp16 / fp32 inputs, off for reference, fp64 inputs and triton_ascend (which "
        "refuses True). False: the online-softmax merge. Gradients are deterministic either way, not "
        "batch-invariant. The materialised route (logprobs_entropy_from_logits) takes it too"))
    logits_precision: str = _option("fp32", lambda v: _expect(v in LOGITS_PRECISIONS, f"one of {LOGITS_PRECISIONS}"), (
        "fp32: logits are the fp32 accumulation of the GEMM (an fp32 / tf32 LM head). bf16: each raw logit "
        "rounded to bf16 before the temperature, as a bf16-head inference engine (vLLM / SGLang defaults); "
        "the gradient treats the rounding as identity. The materialised route takes it too"))
    d_weight_fp32: bool = _option(False, _check_bool, (
        "the backward's d_weight stays in fp32 (fp64 for fp64 inputs), for a front end that takes it from the "
        "op's backward itself and accumulates it in fp32 (areal_lce.op.main_grad); through autograd torch casts "
        "it to weight.dtype, so weight.grad is unchanged by it"))
    top_k: Optional[int] = _option(None, lambda v: _expect(v is None or (_is_int(v) and 0 <= v <= MAX_TOP_K),
                                                           f"None or an int in [1, {MAX_TOP_K}]"), (
        "k: also topk_ids [..., k] (int64, descending by logit, ties to the lower id) and topk_logprobs "
        "[..., k] (differentiable as if those ids were selected); exact, batch / TP invariant in invariant "
        "mode (select.py). None or 0: off"))
    softcap: Optional[float] = _option(None, _check_softcap, (
        "c > 0: logits r -> c · tanh(r / c) before the temperature (transformers' final_logit_softcapping), "
        "with exact gradients; stats are of the capped logits. None or 0: off"))

    def __post_init__(self):
        validate(self, _CHECKS)

    @classmethod
    def of(cls, options: Optional["LCEOptions"], overrides: dict, caller: str) -> "LCEOptions":
        """`options` (None: the defaults) with `overrides` applied: the value a front end taking
        `(options=None, **overrides)` runs with. An unknown keyword is a TypeError naming `caller`."""
        if options is None:
            options = _DEFAULT
        elif not isinstance(options, LCEOptions):
            raise TypeError(f"{caller}: options must be an areal_lce.LCEOptions or None, got {options!r}")
        return options.replace(caller, **overrides) if overrides else options

    def replace(self, caller: str = "LCEOptions.replace", /, **changes) -> "LCEOptions":
        """A copy with `changes`; only the changed fields are checked (the others were, at construction),
        errors naming `caller`."""
        for key in changes:
            if key not in _CHECKS:
                raise TypeError(f"{caller}() got an unexpected keyword argument {key!r}")
        new = object.__new__(LCEOptions)
        for name in _CHECKS:
            object.__setattr__(new, name, changes[name] if name in changes else getattr(self, name))
        validate(new, changes, f"{caller}: ")
        return new

    def asdict(self) -> dict:
        return {name: getattr(self, name) for name in _CHECKS}


def validate(value, names, where: str = "", checks: Optional[dict] = None) -> None:
    """Check the fields `names` of `value` (an LCEOptions, or a `group` of its fields with its `checks`) with
    their own checks, naming each as `where` + name; a checked temperature is stored as a float."""
    checks = _CHECKS if checks is None else checks
    for name in names:
        check = checks[name]
        v = getattr(value, name)
        if check is _check_temperature:
            object.__setattr__(value, name, check_temperature(v, f"{where}{name}", allow_tensor=False))
            continue
        bad = check(v)
        if bad is not None:
            exc, expected = bad
            raise exc(f"{where}{name}={v!r}: expected {expected}")


_CHECKS = {f.name: f.metadata["check"] for f in dataclasses.fields(LCEOptions)}  # name -> check, in field order
_DEFAULT = LCEOptions()


def group(name: str, names: tuple, where: str, *, defaults: Optional[dict] = None, own: Optional[dict] = None,
          module: str = __name__, doc: str = "") -> type:
    """A plain dataclass of some of LCEOptions' fields (their types, checks and help; `defaults` may change a
    default), plus `own` fields (name -> (type, dataclasses.field with "help" and "check" metadata)) that
    belong to the group's owner, not to the op: e.g. the engine's YAML group. Its `options(**call)` is the
    LCEOptions of its op fields plus `call`; errors name `where` + the field."""
    hints = typing.get_type_hints(LCEOptions)
    by_name = {f.name: f for f in dataclasses.fields(LCEOptions)}
    defaults, own = defaults or {}, own or {}
    spec = []
    for key in names:
        if key in own:
            spec.append((key, *own[key]))
            continue
        f = by_name[key]
        spec.append((key, hints[key], field(default=defaults.get(key, f.default), metadata=f.metadata)))
    op_fields = tuple(k for k in names if k not in own)
    checks = {key: spec_field.metadata["check"] for key, _, spec_field in spec}

    def __post_init__(self):
        validate(self, names, where, checks)

    def options(self, **call) -> LCEOptions:
        """These op options, and `call`'s, as one LCEOptions (checked where they entered)."""
        return _DEFAULT.replace(f"{where.rstrip('.')}.options", **{k: getattr(self, k) for k in op_fields}, **call)

    cls = dataclasses.make_dataclass(name, spec, namespace={"__post_init__": __post_init__, "options": options,
                                                            "__doc__": doc, "__module__": module})
    return cls
