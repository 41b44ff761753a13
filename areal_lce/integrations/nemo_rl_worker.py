"""NeMo-RL adapter wired into its Megatron policy worker: with `policy.megatron_cfg.use_fused_linear_logprobs`,
packed sequences (`policy.sequence_packing.enabled`) and context parallelism, the logprobs NeMo-RL's training
loss and `get_logprobs` read come from areal_lce's fused op on the decoder's hidden states (snapshot 7ea279a).

    from areal_lce.integrations import nemo_rl_worker
    nemo_rl_worker.apply()          # in every Megatron policy worker, before its model setup
    nemo_rl_worker.remove()         # puts every NeMo-RL function back

NeMo-RL's fused forward (its patched `GPTModel.forward`) runs unchanged: it calls the module global
`from_parallel_hidden_states_to_logprobs(hidden, weight, ..., labels, ..., tp_group, cp_group)`, whose signature
carries neither the packed layout nor the temperature. `apply()` replaces, by name in NeMo-RL's modules:
  nemo_rl.models.megatron.train.forward_with_post_processing_fn: with the fused flag, reads the micro-batch
      (its packed input ids [1, T], cu_seqlens_padded, the unpacked width S) and the sampling temperature, and
      runs NeMo-RL's own function with them in scope and without `sampling_params` (so that
      `apply_temperature_scaling` does not divide the fused output, a tensor of logprobs: the op divides the
      logits instead, as NeMo-RL's logits route does).
  nemo_rl.distributed.model_utils.from_parallel_hidden_states_to_logprobs: in that scope, packed micro-batches
      go to `nemo_rl_packed.from_parallel_hidden_states_to_logprobs_packed_sequences` (CP all-gather inside)
      and return NeMo-RL's packed layout [B, S-1], the one its logits route returns; unpacked ones to the
      drop-in `nemo_rl.from_parallel_hidden_states_to_logprobs` ([B, S-1], with the temperature).
  nemo_rl.models.megatron.train.SequencePackingLossWrapper: a subclass that, for a loss with the fused flag,
      lays the [B, S-1] rows out at the packed positions and lets NeMo-RL's loop slice them as at CP = 1 (its
      own fused slicing cuts at seq_start // cp, a span of the sequence only at CP = 1).
  nemo_rl.models.megatron.train.prepare_packed_loss_input (`sequence_packing.fuse_loss`): for a loss with the
      fused flag, the [B, S-1] rows are the `next_token_logprobs` (NeMo-RL's would take them for logits).
`LogprobsPostProcessor` (its fused branch slices [:, :S-1]) and `prepare_loss_input` need no change.
`lift_config_checks()` (called by `apply()`) lifts NeMo-RL's fused + CP assert in the worker
(`nemo_rl/models/megatron/setup.py` l.883, by running `_apply_parallelism_config` on a config that hides the
fused flag from it); the driver's GRPO check (`nemo_rl/algorithms/grpo.py` l.672-677, fused + packing) is
inline in `setup()` and must be deleted in NeMo-RL's source (docs/integrations.md).

Refused, with the reason: top-k / top-p sampling (NeMo-RL's `*WithSampling` masks [T, V/tp] logits the op
never builds; NeMo-RL's GRPO refuses them with the fused flag too), post-processors other than the loss and
logprob ones (top-k logits need logits), a micro-batch whose labels do not match its packed ids.
Kept by NeMo-RL: fused + `overlap_param_gather` (setup.py l.1396: the fused forward reads
`output_layer.weight` without calling the layer, so megatron's parameter prefetch would go stale; that holds
here too). Entropy: NeMo-RL's losses ask for none (ClippedPGLossFn's `approx_entropy` comes from logprobs);
for a loss of one's own, `nemo_rl_packed.from_parallel_hidden_states_to_logprobs_and_entropy_packed_sequences`.
"""
from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
from typing import NamedTuple, Optional

import torch

from ..op import comms
from ._common import check_op_options, consistency_options, patch, restore
from . import nemo_rl as _dropin
from . import nemo_rl_packed as _packed
from .nemo_rl_packed import check_sampling

_NAME = "areal_lce.integrations.nemo_rl_worker"
TRAIN = "nemo_rl.models.megatron.train"
MODEL_UTILS = "nemo_rl.distributed.model_utils"
SETUP = "nemo_rl.models.megatron.setup"
PATCH_TARGETS = ((TRAIN, "forward_with_post_processing_fn"), (MODEL_UTILS, "from_parallel_hidden_states_to_logprobs"),
                 (TRAIN, "SequencePackingLossWrapper"), (TRAIN, "prepare_packed_loss_input"))
CHECK_TARGETS = ((SETUP, "_apply_parallelism_config"),)


class MicroBatch(NamedTuple):
    """What the fused forward of one micro-batch needs beyond NeMo-RL's arguments to the module global."""
    temperature: float
    packed_ids: Optional[torch.Tensor] = None          # [1, T]: the packed input ids (None: not packed)
    cu_seqlens_padded: Optional[torch.Tensor] = None   # [B+1]
    unpacked_seqlen: Optional[int] = None              # S: the width of the unpacked batch


_SCOPE: contextvars.ContextVar = contextvars.ContextVar("areal_lce_nemo_rl_microbatch", default=None)


def microbatch_of(processed_mb, temperature: float) -> MicroBatch:
    """MicroBatch from NeMo-RL's ProcessedMicrobatch (packed when it carries packed_seq_params)."""
    if getattr(processed_mb, "packed_seq_params", None) is None:
        return MicroBatch(temperature)
    cu = processed_mb.cu_seqlens_padded
    if cu is None:
        cu = processed_mb.packed_seq_params.cu_seqlens_q_padded
    return MicroBatch(temperature, processed_mb.input_ids, cu, int(processed_mb.data_dict["input_ids"].shape[1]))


def _forward_step(original, post_processors):
    """NeMo-RL's forward_with_post_processing_fn, run for the fused flag with the micro-batch in scope."""
    sig = inspect.signature(original)
    missing = {"data_iterator", "post_processing_fn", "sampling_params", "use_fused_linear_logprobs"} - set(sig.parameters)
    if missing:
        raise RuntimeError(f"{_NAME}: {TRAIN}.forward_with_post_processing_fn has no {sorted(missing)} parameter: "
                           "this NeMo-RL version calls its fused forward differently; see docs/integrations.md")

    @functools.wraps(original)
    def forward_with_post_processing_fn(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        if not bound.arguments.get("use_fused_linear_logprobs", False):
            return original(*args, **kwargs)
        post = bound.arguments["post_processing_fn"]
        if not isinstance(post, post_processors):
            raise NotImplementedError(f"{_NAME}: {type(post).__name__} with use_fused_linear_logprobs: the fused forward "
                                      "returns token logprobs, and only the loss and logprob post-processors read them")
        temperature = check_sampling(bound.arguments.get("sampling_params"), f"{_NAME} (forward)")
        processed_mb = next(bound.arguments["data_iterator"])
        bound.arguments["data_iterator"] = iter([processed_mb])
        bound.arguments["sampling_params"] = None  # the op divides the logits; NeMo-RL would divide its output
        token = _SCOPE.set(microbatch_of(processed_mb, temperature))
        try:
            return original(*bound.args, **bound.kwargs)
        finally:
            _SCOPE.reset(token)
    return forward_with_post_processing_fn


def _module_global(options: dict):
    """The replacement of NeMo-RL's `from_parallel_hidden_states_to_logprobs` (its signature)."""
    def from_parallel_hidden_states_to_logprobs(tensor_parallel_hidden_states, output_weight_layer,
                                                runtime_gather_output, target, vocab_start_index, vocab_end_index,
                                                tp_group, inference_only=False, cp_group=None, chunk_size=None):
        mb = _SCOPE.get()
        args = (tensor_parallel_hidden_states, output_weight_layer)
        if mb is None or mb.packed_ids is None:
            return _dropin.from_parallel_hidden_states_to_logprobs_at_temperature(
                1.0 if mb is None else mb.temperature, *args, runtime_gather_output, target, vocab_start_index,
                vocab_end_index, tp_group, inference_only, cp_group, chunk_size, **options)
        cp = comms.checked_group_size(cp_group, f"{_NAME}: cp_group")
        if not torch.is_tensor(target) or target.numel() * cp != mb.packed_ids.numel():
            raise ValueError(f"{_NAME}: the fused forward's labels {tuple(getattr(target, 'shape', ()))} are not this CP "
                             f"rank's share (1/{cp}) of the micro-batch's packed ids {tuple(mb.packed_ids.shape)}")
        return _packed.from_parallel_hidden_states_to_logprobs_packed_sequences(
            *args, mb.packed_ids, mb.cu_seqlens_padded, mb.unpacked_seqlen, vocab_start_index, vocab_end_index,
            tp_group, inference_only, cp_group, chunk_size, temperature=mb.temperature, **options)
    return from_parallel_hidden_states_to_logprobs


def rows_to_packed(rows: torch.Tensor, cu_seqlens_padded) -> torch.Tensor:
    """[B, W] per-sequence rows -> [1, T]: row i's first min(W, len_i) values at packed positions cu[i] + j,
    zeros elsewhere (differentiable)."""
    cu = torch.as_tensor(cu_seqlens_padded).detach().to("cpu", torch.int64).reshape(-1)
    lengths = cu[1:] - cu[:-1]
    if rows.dim() != 2 or rows.shape[0] != lengths.numel():
        raise ValueError(f"{_NAME}: the fused logprobs {tuple(rows.shape)} must be [B, S-1] with B = "
                         f"{lengths.numel()} packed sequences (cu_seqlens_padded)")
    width = rows.shape[1]
    keep = lengths.clamp(min=0, max=width)
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), keep)
    offset = torch.arange(int(keep.sum())) - (torch.cumsum(keep, 0) - keep)[seg]
    src, dst = (seg * width + offset).to(rows.device), (cu[:-1][seg] + offset).to(rows.device)
    out = rows.new_zeros(int(cu[-1]))
    return out.index_copy(0, dst, rows.reshape(-1).index_select(0, src)).unsqueeze(0)


def _loss_wrapper(base):
    class SequencePackingLossWrapper(base):
        """NeMo-RL's per-sequence packed loss loop; for a loss with the fused flag the [B, S-1] logprobs are laid
        out at the packed positions (rows_to_packed) and sliced as at CP = 1: they are already gathered over CP."""

        def __call__(self, next_token_logits, data, global_valid_seqs, global_valid_toks):
            if not getattr(self.loss_fn, "use_fused_linear_logprobs", False):
                return super().__call__(next_token_logits, data, global_valid_seqs, global_valid_toks)
            cu = self.cu_seqlens_q_padded if self.cu_seqlens_q_padded is not None else self.cu_seqlens_q
            packed = rows_to_packed(next_token_logits, cu)
            cp_group, self.context_parallel_group = self.context_parallel_group, None
            try:
                return super().__call__(packed, data, global_valid_seqs, global_valid_toks)
            finally:
                self.context_parallel_group = cp_group
    SequencePackingLossWrapper.__qualname__ = "SequencePackingLossWrapper"  # module: this one
    return SequencePackingLossWrapper


def _prepare_packed(original):
    sig = inspect.signature(original)

    @functools.wraps(original)
    def prepare_packed_loss_input(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        loss_fn = bound.arguments["loss_fn"]
        if not getattr(loss_fn, "use_fused_linear_logprobs", False):
            return original(*args, **kwargs)
        check_sampling(bound.arguments.get("sampling_params"), f"{_NAME} (prepare_packed_loss_input)")
        if getattr(loss_fn.input_type, "name", None) != "LOGPROB":
            raise ValueError(f"{_NAME}: sequence_packing.fuse_loss takes logprob losses only, got {loss_fn.input_type}")
        data = bound.arguments["data"]
        logprobs = bound.arguments["logits"].to(torch.float32)[:, : data["input_ids"].shape[1] - 1]
        return {"next_token_logprobs": logprobs}, data
    return prepare_packed_loss_input


def _hide_fused_flag(original):
    @functools.wraps(original)
    def _apply_parallelism_config(model_cfg, config):
        hidden = dict(config, megatron_cfg=dict(config["megatron_cfg"], use_fused_linear_logprobs=False))
        return original(model_cfg, hidden)
    return _apply_parallelism_config


def lift_config_checks() -> list:
    """Lift, in this process, NeMo-RL's worker-side refusal of the fused flag with context parallelism
    (setup.py's `_apply_parallelism_config` assert); its other checks there (CP needs sequence packing) stay.
    Idempotent; `remove()` undoes it."""
    for target in CHECK_TARGETS:
        restore(*target)
    mod, attr = CHECK_TARGETS[0]
    return [patch(mod, attr, _hide_fused_flag(getattr(importlib.import_module(mod), attr)))]


def apply(*, vocab_size: Optional[int] = None, logits_precision: Optional[str] = None,
          invariant: Optional[bool] = None, check_labels=True, lift_checks: bool = True, **op_options) -> list:
    """Wire the fused route into NeMo-RL's Megatron worker (module docstring); options as
    `nemo_rl.apply`. Returns the patched names; idempotent; `remove()` undoes it. Needs nemo_rl importable."""
    check_op_options(op_options, _NAME)
    consistency_options(invariant, logits_precision or "fp32", _NAME)
    options = dict(vocab_size=vocab_size, logits_precision=logits_precision, invariant=invariant,
                   check_labels=check_labels, **op_options)
    remove()
    train = importlib.import_module(TRAIN)
    originals = {attr: getattr(train, attr, None) for mod, attr in PATCH_TARGETS if mod == TRAIN}
    posts = tuple(getattr(train, name, None) for name in ("LossPostProcessor", "LogprobsPostProcessor"))
    absent = [name for name, v in originals.items() if v is None] + [n for n, p in zip(
        ("LossPostProcessor", "LogprobsPostProcessor"), posts) if not isinstance(p, type)]
    if absent:
        raise RuntimeError(f"{_NAME}: {TRAIN} has no {absent}: this NeMo-RL version wires its packed loss "
                           "differently; see docs/integrations.md")
    news = {"forward_with_post_processing_fn": _forward_step(originals["forward_with_post_processing_fn"], posts),
            "from_parallel_hidden_states_to_logprobs": _module_global(options),
            "SequencePackingLossWrapper": _loss_wrapper(originals["SequencePackingLossWrapper"]),
            "prepare_packed_loss_input": _prepare_packed(originals["prepare_packed_loss_input"])}
    done = []
    try:
        for mod, attr in PATCH_TARGETS:
            done.append(patch(mod, attr, news[attr]))
        if lift_checks:
            done += lift_config_checks()
    except Exception:
        remove()
        raise
    return done


def remove() -> list:
    """Put back every NeMo-RL function `apply()` / `lift_config_checks()` replaced; returns their names."""
    return [f"{m}.{a}" for m, a in PATCH_TARGETS + CHECK_TARGETS if restore(m, a)]
